"""benchmarks/load_test.py on the tiny artifact: at the issue's size (1,000 requests at concurrency 32, a few seconds)
nothing lost, no errors, every output complete and RSS growth under 5% from the 100th request to the last; smaller
runs for prefix sharing and the deadline."""
from __future__ import annotations

import json
import sys

import pytest
from rich.console import Console

from tests.conftest import REPO


def test_load_test_at_the_issues_size(tiny_artifact, tmp_path):
    """The whole requirement, memory included (a scheduler that kept 256 KiB per finished request grew +27%)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import load_test

    out = tmp_path / "load.json"
    report = load_test.main(["--artifact", str(tiny_artifact), "--requests", "1000", "--concurrency", "32",
                             "--cancel-fraction", "0.1", "--check", "8", "--out", str(out)],
                            console=Console(quiet=True))
    assert (report["lost"], report["errors"], report["incomplete"], report["mismatched"]) == (0, 0, 0, 0)
    assert report["checked"] == 8 and report["cancelled"] >= 50
    assert report["rss_from_request"] == 100 and report["rss_growth"] < load_test.MAX_RSS_GROWTH, report["rss_growth"]
    assert report["passed"] and report["summary"]["output_tokens"] > 0
    assert json.loads(out.read_text())["settings"]["requests"] == 1000


def test_an_output_cut_short_is_incomplete_though_its_timings_count_every_token():
    """"Complete" is what the request returned: its token_ids (and stop token) against the tokens asked, and its
    timings' count too (a result whose ids were cut to half, its timings left whole, had passed)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import load_test

    requests = [{"prompt": [1, 2], "max_new_tokens": 4, "sampling": {"temperature": 1.0, "seed": 0}}] * 3
    ledger = load_test.Ledger(3, [])
    ledger.finish[:] = load_test.FINISH.index("length")
    ledger.tokens[:] = [4, 2, 4]  # returned
    ledger.timed_tokens[:] = [4, 4, 3]  # counted by the timings
    verdict = load_test.judge(None, requests, ledger, cancel=set())
    assert verdict["incomplete"] == [1, 2]


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
