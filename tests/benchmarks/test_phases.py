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
    summary = phases.summarize(raw, args, {phases.FUSED: manifest}, bandwidth=20e9)
    at64, at2000 = summary["decode"][phases.FUSED][64], summary["decode"][phases.FUSED][2000]
    assert at64["bytes_read"] == 500_000_000 + 46_080 * 64
    assert at64["floor_ms"] == pytest.approx((500_000_000 + 46_080 * 64) / 20e9 * 1e3)
    assert at64["of_floor"] == pytest.approx(30.0 / at64["floor_ms"])
    assert at2000["floor_ms"] == pytest.approx((500_000_000 + 46_080 * 2000) / 20e9 * 1e3)
    console = Console(record=True, width=250)
    lines = phases.render(summary, args, console, bandwidth=20e9)
    text = console.export_text()
    assert "20.0 GB/s" in text and "fused/floor" in text and f"{at64['floor_ms']:.2f}" in text
    assert lines == ["decode ms ctx2000 / ctx64: aotlm-fused 1.50x"]


def test_a_context_beyond_the_artifact_is_refused_before_any_measurement(tiny_artifact, tmp_path, monkeypatch):
    monkeypatch.setattr(phases, "run_sweeps", lambda *a: pytest.fail("measured before checking the sizes"))
    for sizes in (["--contexts", "130", "--prompt-lengths", "8"], ["--contexts", "8", "--prompt-lengths", "200"]):
        with pytest.raises(SystemExit):
            phases.main(["--backends", phases.FUSED, "--fused-artifact", str(tiny_artifact), *sizes,
                         "--out", str(tmp_path / "p.json")])
