"""benchmarks/load_test.py at CI size on the tiny artifact: nothing lost, no errors, every output complete.

The full run (1,000 requests at concurrency 32) also requires RSS growth under 5% from the 100th request to the
last; at this size the window is warm-up (the 10th to the 100th), so growth is reported, not asserted.
"""
from __future__ import annotations

import json
import sys

import pytest
from rich.console import Console

from tests.conftest import REPO


def test_load_test_small(tiny_artifact, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import load_test

    out = tmp_path / "load.json"
    report = load_test.main(["--artifact", str(tiny_artifact), "--requests", "100", "--concurrency", "8",
                             "--cancel-fraction", "0.1", "--check", "8", "--out", str(out)],
                            console=Console(quiet=True))
    assert (report["lost"], report["errors"], report["incomplete"], report["mismatched"]) == (0, 0, 0, 0)
    assert report["checked"] == 8 and report["cancelled"] >= 1
    assert report["summary"]["output_tokens"] > 0 and report["rss_growth"] is not None
    assert json.loads(out.read_text())["settings"]["requests"] == 100


def test_load_test_small_with_prefix_sharing(tiny_artifact, tmp_path):
    """Prompts that begin with one of 3 shared prefixes, served with prefix caching: requests copy their starts from
    other slots (running ones, or ones left), some are cancelled, and the greedy ones checked make the tokens the
    batch-1 path makes without prefix caching."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import load_test

    report = load_test.main(["--artifact", str(tiny_artifact), "--requests", "100", "--concurrency", "8",
                             "--cancel-fraction", "0.1", "--check", "12", "--prefix-caching", "--shared-prefixes", "3",
                             "--out", str(tmp_path / "load.json")], console=Console(quiet=True))
    assert (report["lost"], report["errors"], report["incomplete"], report["mismatched"]) == (0, 0, 0, 0)
    assert report["checked"] == 12 and report["cancelled"] >= 1
    # most requests after the first few find their 24-token prefix somewhere (16 is the least worth reusing)
    assert report["cached_prompt_tokens"] >= 24 * 60, report["cached_prompt_tokens"]


def test_requests_without_a_result_by_the_deadline_count_as_lost(tiny_artifact, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import load_test

    report = load_test.main(["--artifact", str(tiny_artifact), "--requests", "30", "--concurrency", "8",
                             "--timeout", "0.0001", "--out", str(tmp_path / "l.json")], console=Console(quiet=True))
    assert report["lost"] >= 1 and report["errors"] == 0


def test_bad_sizes_are_usage_errors_before_anything_runs(capsys, tmp_path):
    """--requests 0 waited out the whole --timeout, then failed on an index; --concurrency 0 named --slots."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import load_test

    for flags, message in ((["--requests", "0"], "--requests must be >= 1, got 0"),
                           (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
                           (["--cancel-fraction", "2"], "--cancel-fraction must be in [0, 1]"),
                           (["--shared-prefixes", "-1"], "--shared-prefixes must be >= 0, got -1"),
                           (["--artifact", str(tmp_path / "none")], "not an artifact folder (no such directory)")):
        with pytest.raises(SystemExit) as stopped:
            load_test.main([*flags, "--timeout", "1"], console=Console(quiet=True))
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_the_latency_summary_counts_finished_requests_not_cancelled_ones():
    """vLLM's throughput and percentiles are over successful requests; a cancelled one's one token, its TTFT and its
    cancel time had counted (65 tokens over 5 s, TTFT p50 2.55 s, for this ledger)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import load_test

    ledger = load_test.Ledger(2, [])
    ledger.finish[:] = [load_test.FINISH.index("length"), load_test.FINISH.index("cancelled")]
    ledger.tokens[:] = [64, 1]
    ledger.times[:] = [[0.0, 0.1, 1.0, 1.0], [0.0, 5.0, 5.0, 5.0]]
    summary = load_test.latency_summary(ledger)
    assert summary["output_tokens"] == 64 and summary["duration_s"] == pytest.approx(1.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)
