"""benchmarks/kv_cache_attention.py at a tiny size: both caches run through one GroupQueryAttention node in each
phase, and the JSON holds a row per prompt and context with positive times."""
from __future__ import annotations

import json
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import kv_cache_attention  # noqa: E402


def test_small_run_times_both_caches_in_both_phases(tmp_path):
    out = tmp_path / "kv.json"
    result = kv_cache_attention.main(["--runs", "3", "--prompts", "16", "--contexts", "8,40", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == result["rows"]
    assert [(r["phase"], r["tokens"]) for r in rows] == [("prefill", 16), ("decode", 8), ("decode", 40)]
    assert all(r["float_ms"] > 0 and r["int8_ms"] > 0 for r in rows)
