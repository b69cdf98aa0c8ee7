"""benchmarks/matmul_limits.py at a tiny size: each format's chain holds the weights it says, runs, and the JSON
rows derive GB/s and GFLOP/s from the measured time."""
from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import matmul_limits  # noqa: E402

TINY = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--kv-width", "32", "--vocab", "256"]


def test_chain_weights_and_output_shape():
    model, weight_bytes, params = matmul_limits.chain_model("fp32", 3, 2, 64, 128, 32, 256)
    per_layer = 64 * 128 + 64 * 64 + 64 * 256 + 128 * 64
    assert params == 2 * per_layer + 64 * 256 and weight_bytes == 4 * params
    out = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": np.ones((3, 64), np.float32)})
    assert out[0].shape == (3, 256) and np.isfinite(out[0]).all()
    _, int4_bytes, _ = matmul_limits.chain_model("int4", 1, 2, 64, 128, 32, 256)
    assert int4_bytes == params // 2 + 4 * params // 32  # 4-bit codes + one float32 scale per 32 weights
    float_activations, _, _ = matmul_limits.chain_model("int4", 1, 1, 64, 128, 32, 256, accuracy_level=0)
    levels = {attribute.i for node in onnx.load_from_string(float_activations).graph.node
              for attribute in node.attribute if attribute.name == "accuracy_level"}
    assert levels == {0}


def test_small_run_writes_rows_for_every_format(tmp_path):
    out = tmp_path / "m.json"
    report = matmul_limits.main(TINY + ["--rows", "1,4", "--runs", "2", "--bandwidth", "10", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == report["rows"] and [(r["format"], r["rows"]) for r in rows] == [
        (f, n) for f in ("fp32", "int4", "int8") for n in (1, 4)]
    for r in rows:
        assert r["ms"] > 0 and r["gb_per_s"] == pytest.approx(r["weight_bytes"] / (r["ms"] / 1e3) / 1e9)
        assert r["of_bandwidth"] == pytest.approx(r["gb_per_s"] / 10)


def test_unknown_format_is_refused():
    with pytest.raises(SystemExit):
        matmul_limits.main(TINY + ["--formats", "fp8"])
