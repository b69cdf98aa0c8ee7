"""benchmarks/phases.py's summary: bytes a decode step reads, the machine's bandwidth floor, and the table that
shows both (made-up timings; the sweep itself needs onnxruntime-genai and the default model)."""
from __future__ import annotations

import sys
from argparse import Namespace

import pytest
from rich.console import Console

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import phases  # noqa: E402


def test_floor_is_the_bytes_at_the_measured_bandwidth():
    manifest = {"backend": {"weights": {"bytes": 500_000_000}}, "kv_cache": {"bytes_per_token": 46_080}}
    measurement = {"median_ms": 30.0, "p90_ms": 33.0}
    raw = {"decode": {phases.FUSED: {64: [measurement], 2000: [{"median_ms": 45.0, "p90_ms": 50.0}]}},
           "prefill": {phases.FUSED: {128: [{"median_ms": 300.0}]}}}
    args = Namespace(repeats=1, steps=4, prefill_runs=1, contexts=[64, 2000], prompt_lengths=[128])
    # A step reads less than the weights file: an untied embedding table is only gathered from (plan's count).
    summary = phases.summarize(raw, args, {phases.FUSED: manifest}, bandwidth=20e9,
                               step_weights={phases.FUSED: 450_000_000})
    at64, at2000 = summary["decode"][phases.FUSED][64], summary["decode"][phases.FUSED][2000]
    assert at64["bytes_read"] == 450_000_000 + 46_080 * 64
    assert at64["floor_ms"] == pytest.approx((450_000_000 + 46_080 * 64) / 20e9 * 1e3)
    assert at64["of_floor"] == pytest.approx(30.0 / at64["floor_ms"])
    assert at2000["floor_ms"] == pytest.approx((450_000_000 + 46_080 * 2000) / 20e9 * 1e3)
    console = Console(record=True, width=250)
    pairs = phases.paired_ratios(summary, args.contexts, args.prompt_lengths)
    lines = phases.render(summary, pairs, args, console, bandwidth=20e9)
    text = console.export_text()
    assert "20.0 GB/s" in text and "fused/floor" in text and f"{at64['floor_ms']:.2f}" in text
    assert lines == ["decode ms ctx2000 / ctx64: aotlm-fused 1.50x", "paired (median of the repeats' ratios): aotlm-fused 1.50x"]


def test_ratios_pair_each_repeat_with_the_same_repeat():
    """A host that slows down between repeats: the ratios of the medians mislead, the per-repeat ratios do not."""
    def runs(*ms):
        return [{"median_ms": m, "p90_ms": m} for m in ms]
    raw = {"decode": {phases.FUSED: {64: runs(10.0, 20.0, 40.0), 2000: runs(12.0, 24.0, 48.0)},
                      phases.GENAI: {64: runs(25.0, 12.5, 100.0), 2000: runs(30.0, 15.0, 120.0)}},
           "prefill": {phases.FUSED: {128: runs(80.0, 160.0, 320.0)}, phases.GENAI: {128: runs(100.0, 100.0, 400.0)}}}
    args = Namespace(repeats=3, steps=4, prefill_runs=1, contexts=[64, 2000], prompt_lengths=[128])
    summary = phases.summarize(raw, args, {}, bandwidth=20e9, step_weights={})
    pairs = phases.paired_ratios(summary, args.contexts, args.prompt_lengths)
    assert pairs["decode"][64]["fused_vs_genai"] == pytest.approx(0.4)  # of 0.4, 1.6, 0.4; the medians' ratio: 20/25
    assert pairs["decode"][64]["fused_vs_unfused"] is None  # no unfused backend measured
    assert pairs["prefill"][128]["fused_vs_genai"] == pytest.approx(0.8)  # of 0.8, 1.6, 0.8; the medians': 160/100
    assert pairs["decode_growth"] == {phases.FUSED: pytest.approx(1.2), phases.GENAI: pytest.approx(1.2)}


def test_a_context_beyond_the_artifact_is_refused_before_any_measurement(tiny_artifact, tmp_path, monkeypatch):
    monkeypatch.setattr(phases, "run_sweeps", lambda *a: pytest.fail("measured before checking the sizes"))
    for sizes in (["--contexts", "130", "--prompt-lengths", "8"], ["--contexts", "8", "--prompt-lengths", "200"]):
        with pytest.raises(SystemExit):
            phases.main(["--backends", phases.FUSED, "--fused-artifact", str(tiny_artifact), *sizes,
                         "--out", str(tmp_path / "p.json")])


def test_the_report_holds_the_paired_ratios_of_its_own_repeats(tiny_artifact, tmp_path):
    report = phases.main(["--backends", phases.FUSED, "--fused-artifact", str(tiny_artifact), "--contexts", "8,16",
                          "--prompt-lengths", "8", "--steps", "2", "--repeats", "2", "--prefill-runs", "1",
                          # no re-measuring: under xdist the other worker reads as contention, and the waits
                          # (5 + 10 + 20 s a measurement) took 0-75 s at random
                          "--retries", "0", "--out", str(tmp_path / "p.json")])
    repeats = {ctx: [r["median_ms"] for r in report["decode"][phases.FUSED][ctx]["repeats"]] for ctx in ("8", "16")}
    growth = sorted(hi / lo for hi, lo in zip(repeats["16"], repeats["8"]))
    assert report["paired"]["decode_growth"][phases.FUSED] == pytest.approx(sum(growth) / 2)
    assert report["paired"]["decode"]["8"] == {"fused_vs_unfused": None, "fused_vs_genai": None,
                                               "fused_vs_genai_pruned": None}
    assert report["token_agreement"]["first_difference_from_fused"] == {"8": {phases.FUSED: None},
                                                                        "16": {phases.FUSED: None}}
    assert len(report["decode"][phases.FUSED]["8"]["repeats"][0]["token_ids"]) == phases.WARMUP_STEPS + 2 + 1
    assert report["settings"]["aotlm_spin_after_run"] == ["decode"]
    assert report["decode_growth_paired"].startswith("paired")


@pytest.mark.parametrize("flags, message", [
    (["--contexts", "64,512,512"], "each must be >= 1 and given once"),
    (["--prompt-lengths", "0"], "each must be >= 1 and given once"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--prefill-runs", "0"], "--prefill-runs must be >= 1, got 0"),
])
def test_bad_sizes_are_refused_before_any_measurement(tiny_artifact, flags, message, capsys, monkeypatch):
    """A context given twice failed on uneven lists after the whole sweep; --steps 0 at the first measurement."""
    monkeypatch.setattr(phases, "run_sweeps", lambda *a: pytest.fail("measured before checking the arguments"))
    with pytest.raises(SystemExit) as stopped:
        phases.main(["--backends", phases.FUSED, "--fused-artifact", str(tiny_artifact), *flags])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_token_agreement_names_the_first_token_a_backend_made_otherwise():
    """The same weights must give the same greedy tokens: a stale or wrong baseline model was timed unnoticed."""
    def made(*tokens):
        return [{"token_ids": list(tokens)}]
    raw = {"decode": {phases.FUSED: {64: made(5, 6, 7, 8), 512: made(1, 2)},
                      phases.GENAI: {64: made(5, 6, 9, 8), 512: made(1, 2, 3)},
                      phases.GENAI_PRUNED: {64: made(5, 6, 7), 512: made(4)}}}
    assert phases.token_agreement(raw) == {64: {phases.FUSED: None, phases.GENAI: 2, phases.GENAI_PRUNED: None},
                                           512: {phases.FUSED: None, phases.GENAI: None, phases.GENAI_PRUNED: 0}}


def test_each_repeat_rotates_the_backends_and_the_contexts():
    """No backend and no context is always measured first (the first measurement of a repeat ran slow for every
    backend in session 60's runs: the context-64 step, which the context ratio divides by)."""
    from rich.progress import Progress

    measured = []

    class Backend:
        def __init__(self, name):
            self.name = name

        def decode(self, prompt_ids, steps):
            measured.append(("decode", self.name, len(prompt_ids)))
            return [0.01] * steps, [1] * steps

        def prefill(self, prompt_ids):
            return 0.01

    args = Namespace(repeats=3, steps=2, prefill_runs=1, contexts=[4, 8, 16], prompt_lengths=[4], retries=0,
                     max_other_cores=99.0)
    with Progress(disable=True) as progress:
        phases.run_sweeps({"a": Backend("a"), "b": Backend("b")}, list(range(16)), args, progress, Console(quiet=True))
    firsts = [measured[i * 6] for i in range(3)]  # each repeat: 3 contexts x 2 backends
    assert firsts == [("decode", "a", 4), ("decode", "b", 8), ("decode", "a", 16)]
