"""benchmarks/decode_profile.py on the tiny artifact: the decode graph runs over its bound cache, the profiler's
per-operator times are per step and cover the attention and the projections, and the JSON is the table's data."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import decode_profile  # noqa: E402


def test_profile_of_the_tiny_artifact(tiny_artifact, tmp_path):
    out = tmp_path / "p.json"
    report = decode_profile.main(["--artifacts", str(tiny_artifact), "--no-genai", "--contexts", "8,40",
                                  "--steps", "4", "--threads", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = report["rows"]
    assert [(row["graph"], row["context"]) for row in rows] == [("tiny-random", 8), ("tiny-random", 40)]
    for row in rows:
        assert {"GroupQueryAttention", "MatMul"} <= set(row["ops_ms"])
        assert row["step_ms"] > 0 and row["profiled_sum_ms"] == pytest.approx(sum(row["ops_ms"].values()))
        assert all(ms > 0 for ms in row["ops_ms"].values())


def test_a_context_past_the_cache_is_refused(tiny_artifact, tmp_path):
    with pytest.raises(SystemExit, match="exceed its cache"):
        decode_profile.main(["--artifacts", str(tiny_artifact), "--no-genai", "--contexts", "120", "--steps", "4",
                             "--out", str(tmp_path / "p.json")])


def test_the_bound_cache_is_written_in_every_row(tiny_artifact):
    """Never-written zeros would be the kernel's shared zero page, read faster than a real cache is."""
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    config = manifest["model"]["config"]
    graph = decode_profile.DecodeGraph("tiny", tiny_artifact / "decode.onnx", config["num_kv_heads"],
                                       config["head_dim"], None, 1)
    assert len(graph.buffers) == 2 * config["num_layers"]
    for buffer in graph.buffers:
        values = buffer.numpy()
        assert values.shape[2] == graph.capacity
        assert np.all(np.any(values != 0, axis=-1)), "a cache row left all zeros"


def test_written_buffers_keep_the_cache_type():
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float16, np.int8):
        values = decode_profile.written_cache_buffer((1, 2, 8, 16), dtype, rng)
        assert values.dtype == dtype and np.count_nonzero(values) > 0.9 * values.size


def test_batched_steps_run_every_row(tiny_artifact, tmp_path):
    """--rows profiles the scheduler's batched steps: one buffer row, one token and one logits row per sequence."""
    report = decode_profile.main(["--artifacts", str(tiny_artifact), "--no-genai", "--contexts", "8", "--rows", "1,3",
                                  "--steps", "3", "--threads", "1", "--out", str(tmp_path / "p.json")])
    assert [(row["rows"], row["context"]) for row in report["rows"]] == [(1, 8), (3, 8)]
    assert report["settings"]["rows"] == [1, 3]
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    config = manifest["model"]["config"]
    graph = decode_profile.DecodeGraph("tiny", tiny_artifact / "decode.onnx", config["num_kv_heads"],
                                       config["head_dim"], None, 1, rows=3)
    assert all(buffer.numpy().shape[0] == 3 for buffer in graph.buffers)
    graph.step(8)
    logits = graph.binding.copy_outputs_to_cpu()[-1]  # bound last, after the presents
    assert logits.shape[:2] == (3, 1) and np.all(np.isfinite(logits))
    assert not np.allclose(logits[0], logits[1]), "rows over different caches gave the same logits"


def test_rows_below_one_are_refused(tiny_artifact, tmp_path):
    with pytest.raises(SystemExit):
        decode_profile.main(["--artifacts", str(tiny_artifact), "--no-genai", "--rows", "0",
                             "--out", str(tmp_path / "p.json")])
