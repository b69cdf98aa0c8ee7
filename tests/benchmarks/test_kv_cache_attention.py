"""benchmarks/kv_cache_attention.py at a tiny size: both caches run through one GroupQueryAttention node in each
phase (the element type each column's node wrote is recorded), and the JSON holds a row per prompt and context
with positive times; the rotary-separate graph it times
computes what the node with rotary inside does."""
from __future__ import annotations

import json
import sys

import numpy as np
import onnxruntime as ort

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
    assert all(r["rotary_separate_ms"] > 0 for r in rows)
    # what each column timed: the int8 column wrote an int8 cache, the others a float one
    assert all(r["cache_types"] == {"float": "tensor(float)", "int8": "tensor(int8)", "rotary_separate": "tensor(float)"}
               for r in rows)


def test_the_rotary_separate_graph_computes_what_the_node_alone_does():
    """The third column times RotaryEmbedding x2 + the node with do_rotary 0: same output, same cache writes."""
    rng = np.random.default_rng(0)
    queries, context = 3, 20
    angles = np.arange(kv_cache_attention.CACHE)[:, None] * (1e4 ** (-np.arange(32) / 32))[None]
    feed = {"q": rng.standard_normal((1, queries, 9 * 64), dtype=np.float32),
            "k": rng.standard_normal((1, queries, 3 * 64), dtype=np.float32),
            "v": rng.standard_normal((1, queries, 3 * 64), dtype=np.float32),
            "seqlens_k": np.array([context - 1], np.int32), "total": np.array(context, np.int32),
            "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32),
            "past_key": rng.standard_normal((1, 3, kv_cache_attention.CACHE, 64), dtype=np.float32),
            "past_value": rng.standard_normal((1, 3, kv_cache_attention.CACHE, 64), dtype=np.float32)}
    outputs = []
    for separate in (False, True):
        model = kv_cache_attention.attention_model(queries, "float32", True, False, rotary_separate=separate)
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        extra = {"positions": np.arange(context - queries, context, dtype=np.int64)[None]} if separate else {}
        outputs.append(session.run(None, {**feed, **extra}))
    for inside, separate in zip(*outputs):
        np.testing.assert_allclose(inside, separate, atol=1e-5)
