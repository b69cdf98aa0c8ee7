"""benchmarks/load_test.py at CI size on the tiny artifact: nothing lost, no errors, every output complete.

The full run (1,000 requests at concurrency 32) also requires RSS growth under 5% from the 100th request to the
last; at this size the window is warm-up (the 10th to the 100th), so growth is reported, not asserted.
"""
from __future__ import annotations

import json
import sys

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


def test_requests_without_a_result_by_the_deadline_count_as_lost(tiny_artifact, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import load_test

    report = load_test.main(["--artifact", str(tiny_artifact), "--requests", "30", "--concurrency", "8",
                             "--timeout", "0.0001", "--out", str(tmp_path / "l.json")], console=Console(quiet=True))
    assert report["lost"] >= 1 and report["errors"] == 0
