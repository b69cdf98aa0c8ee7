"""benchmarks/batching.py at a tiny size: the closed loop and both Poisson runs are served and written where asked,
also when every request makes one token (no TPOT exists then)."""
from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import batching  # noqa: E402


def test_one_token_requests_and_an_output_path(tiny_artifact, tmp_path):
    out = tmp_path / "b.json"
    result = batching.main(["--artifact", str(tiny_artifact), "--concurrency", "1,2", "--new-tokens", "1",
                            "--poisson-requests", "3", "--slots", "2", "--prompt-tokens", "8",
                            "--poisson-output-tokens", "2:4", "--rate", "50", "--out", str(out)])
    assert json.loads(out.read_text())["closed_loop"] == json.loads(json.dumps(result["closed_loop"]))
    assert result["closed_loop"]["1"]["summary"]["tpot_ms"]["median"] is None  # one token each: no TPOT
    assert set(result["poisson"]) == {"static", "continuous"}
    assert (tmp_path / "b-poisson.json").is_file()


def test_auto_rate_offers_a_multiple_of_the_closed_loop_capacity(tiny_artifact, tmp_path):
    result = batching.main(["--artifact", str(tiny_artifact), "--concurrency", "1,2", "--new-tokens", "2",
                            "--poisson-requests", "3", "--slots", "2", "--prompt-tokens", "8",
                            "--poisson-output-tokens", "2:4", "--load", "2", "--out", str(tmp_path / "b.json")])
    capacity = result["closed_loop"]["2"]["summary"]["output_tokens_per_s"] / 3  # mean output of 2:4
    assert result["poisson_rate"]["requests_per_s"] == pytest.approx(2 * capacity)
    assert "concurrency 2" in result["poisson_rate"]["source"]


@pytest.mark.parametrize("flags", [["--rate", "0"], ["--rate", "fast"], ["--load", "-1"]])
def test_bad_rates_are_refused_before_anything_runs(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        batching.main(["--artifact", "/nonexistent", *flags])
    assert exit_info.value.code == 2
    assert flags[0] in capsys.readouterr().err
