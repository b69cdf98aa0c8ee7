"""benchmarks/http_serving.py at a tiny size: both modes serve every request's tokens (over HTTP through a real
`aotlm serve` process), and one-token outputs, which have no TPOT, still make a table and a JSON."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import http_serving  # noqa: E402


@pytest.mark.parametrize("new_tokens", [3, 1])
def test_both_modes_serve_every_token_and_write_the_json(tiny_artifact, tmp_path, new_tokens):
    out = tmp_path / "h.json"
    result = http_serving.main(["--artifact", str(tiny_artifact), "--concurrency", "1,2", "--requests", "3",
                                "--rounds", "1", "--prompt-tokens", "8", "--new-tokens", str(new_tokens),
                                "--out", str(out)])
    assert json.loads(out.read_text())["runs"] == json.loads(json.dumps(result["runs"]))
    for level in ("1", "2"):
        (local,), (remote,) = result["runs"][level]["in_process"], result["runs"][level]["http"]
        assert local["output_tokens"] == remote["output_tokens"] == 3 * new_tokens
        assert remote["output_tokens_per_s"] > 0 and remote["ttft_ms"]["median"] > 0
        assert (remote["tpot_ms"]["median"] is None) == (new_tokens == 1)
        assert len(local["ttfts_ms"]) == len(remote["ttfts_ms"]) == 3  # each request's, for the plot
        assert np.median(remote["ttfts_ms"]) == pytest.approx(remote["ttft_ms"]["median"])
    assert (tmp_path / "h-ttft.png").stat().st_size > 0


def test_a_level_above_the_requests_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        http_serving.main(["--artifact", "/nonexistent", "--concurrency", "4", "--requests", "2"])
    assert "each level must be in 1..--requests (2)" in capsys.readouterr().err.splitlines()[-1]  # not the usage
