"""benchmarks/batching.py at a tiny size: the closed loop and both Poisson runs are served and written where asked,
also when every request makes one token (no TPOT exists then); rounds interleave and their ratios are paired."""
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
                            "--rounds", "1", "--poisson-requests", "3", "--slots", "2", "--prompt-tokens", "8",
                            "--poisson-output-tokens", "2:4", "--rate", "50", "--out", str(out)])
    assert json.loads(out.read_text())["closed_loop"] == json.loads(json.dumps(result["closed_loop"]))
    assert result["closed_loop"]["1"]["summary"]["tpot_ms"]["median"] is None  # one token each: no TPOT
    assert set(result["poisson"]) == {"static", "continuous"}
    assert (tmp_path / "b-poisson.json").is_file()


def test_auto_rate_offers_a_multiple_of_the_closed_loop_capacity(tiny_artifact, tmp_path):
    result = batching.main(["--artifact", str(tiny_artifact), "--concurrency", "1,2", "--new-tokens", "2",
                            "--rounds", "2", "--poisson-requests", "3", "--slots", "2", "--prompt-tokens", "8",
                            "--poisson-output-tokens", "2:4", "--load", "2", "--out", str(tmp_path / "b.json")])
    first_round = result["closed_loop"]["2"]["rounds"][0]  # the first round sets the rate for every round
    capacity = first_round["summary"]["output_tokens_per_s"] / 3  # mean output of 2:4
    assert result["poisson_rate"]["requests_per_s"] == pytest.approx(2 * capacity)
    assert "concurrency 2" in result["poisson_rate"]["source"]


@pytest.mark.parametrize("flags, message", [(["--rate", "0"], "--rate: '0' is neither"),
                                            (["--rate", "fast"], "--rate: 'fast' is neither"),
                                            (["--load", "-1"], "--load: -1.0 must be positive"),
                                            (["--rounds", "0"], "--rounds: 0 must be >= 1")])
def test_bad_rates_are_refused_before_anything_runs(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        batching.main(["--artifact", "/nonexistent", *flags])
    assert exit_info.value.code == 2
    # the error line: the usage above it names every flag, and the missing artifact's error would exit 2 as well
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_rounds_interleave_abba_and_ratios_are_paired(tiny_artifact, tmp_path, monkeypatch):
    served = []  # (concurrency or mode, slots) in the order the runs happened
    real_serve = batching.serve

    def recording_serve(engine, workload, mode, slots, progress, label):
        served.append(label.split()[-1])
        return real_serve(engine, workload, mode, slots, progress, label)

    monkeypatch.setattr(batching, "serve", recording_serve)
    result = batching.main(["--artifact", str(tiny_artifact), "--concurrency", "1,2", "--new-tokens", "2",
                            "--rounds", "4", "--poisson-requests", "3", "--slots", "2", "--prompt-tokens", "8",
                            "--poisson-output-tokens", "2:4", "--rate", "50", "--out", str(tmp_path / "b.json")])
    forward, backward = ["1", "2", "static", "continuous"], ["2", "1", "continuous", "static"]
    assert served == forward + backward + backward + forward  # ABBA: a steady drift favours neither side
    assert [order["closed_loop"] for order in result["orders"]] == [[1, 2], [2, 1], [2, 1], [1, 2]]
    single, pair = ([r["summary"]["output_tokens_per_s"] for r in result["closed_loop"][level]["rounds"]]
                    for level in ("1", "2"))
    ratios = result["closed_loop_vs_first_level"]["2"]
    assert ratios["rounds"] == pytest.approx([p / s for p, s in zip(pair, single)])
    middle = sorted(ratios["rounds"])[1:3]
    assert ratios["median"] == pytest.approx(sum(middle) / 2)  # numpy's median of an even count
    assert result["closed_loop_vs_first_level"]["1"]["rounds"] == pytest.approx([1.0] * 4)
    static, continuous = ([s["output_tokens_per_s"] for s in result["poisson"][mode]["rounds"]]
                          for mode in ("static", "continuous"))
    per_round = result["poisson_continuous_over_static"]["output_tokens_per_s"]["rounds"]
    assert per_round == pytest.approx([c / s for c, s in zip(continuous, static)])
    shown = result["poisson_plotted_round"] - 1  # the upper middle round's summaries are the top-level ones
    assert sorted(per_round)[2] == pytest.approx(per_round[shown])
    assert result["poisson"]["static"]["summary"]["output_tokens_per_s"] == static[shown]
    for mode in ("static", "continuous"):  # one share per round, each a part of its run
        assert len(result["poisson"][mode]["queued_share"]) == 4
        assert all(0.0 <= share <= 1.0 for share in result["poisson"][mode]["queued_share"])
    written = json.loads((tmp_path / "b-poisson.json").read_text())
    assert written["settings"]["round"] == shown + 1
    assert written["backends"]["static"]["summary"]["output_tokens_per_s"] == pytest.approx(static[shown])


def test_paired_ratios_and_the_median_round():
    assert batching.paired([10.0, 30.0, 20.0], [5.0, 10.0, 20.0]) == {"median": 2.0, "rounds": [2.0, 3.0, 1.0]}
    assert batching.median_round([3.0, 1.0, 2.0]) == 2
    assert batching.median_round([4.0, 1.0]) == 0  # even count: the upper of the two middle values
    assert [batching.run_order([1, 2, 3], r) for r in range(5)] == [[1, 2, 3], [3, 2, 1], [3, 2, 1], [1, 2, 3], [1, 2, 3]]


@pytest.mark.parametrize("flags, message", [
    (["--poisson-requests", "0"], "--poisson-requests must be >= 1, got 0"),
    (["--concurrency", "0"], "each level must be >= 1 and given once"),
    (["--concurrency", "1,1"], "each level must be >= 1 and given once"),
    (["--poisson-output-tokens", "4:900"], "--poisson-output-tokens for the Poisson part"),  # cannot fit 128 tokens
])
def test_the_poisson_part_is_checked_before_the_closed_loop_runs(tiny_artifact, flags, message, capsys, monkeypatch):
    """These failed with a traceback after part 1 had served every closed-loop level."""
    monkeypatch.setattr(batching, "serve", lambda *a: pytest.fail("served before the arguments were checked"))
    with pytest.raises(SystemExit) as exit_info:
        batching.main(["--artifact", str(tiny_artifact), "--prompt-tokens", "8", "--new-tokens", "2", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_tables_median_tokens_per_s_is_in_the_json_too():
    runs = [{"wall_with_setup_s": 1.0, "summary": {"output_tokens_per_s": v}} for v in (10.0, 40.0, 20.0, 30.0)]
    assert batching.median_tokens_per_s(runs) == 25.0  # the table's; median_entry's round is the upper one (30)
    assert batching.median_entry(runs)["summary"]["output_tokens_per_s"] == 30.0
