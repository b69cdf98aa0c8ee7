"""Tests for passes/slice_packed_weights.py: a traced tiny decoder after pack_projections, hand-made graphs for what
is kept and why, and onnxruntime parity."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.export import export_graphs
from compiler.frontend.model import build_decoder
from compiler.frontend.random_init import random_model
from passes import cleanup, pack_projections, slice_packed_weights
from passes.errors import PassError
from tests.passes.test_pack_projections import MAX_CONTEXT, decoder_feeds, run_ort, tiny_config

OPTIONS = slice_packed_weights.Options()


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


@pytest.fixture(scope="module")
def packed_prefill():
    config = tiny_config(attention_bias=False)
    decoder = build_decoder(config, random_model(config, seed=0).state_dict)
    prefill = cleanup.run(export_graphs(decoder, max_context=MAX_CONTEXT)["prefill"], cleanup.Options())[0]
    return config, pack_projections.run(prefill, pack_projections.Options())[0]


def test_the_decoders_gate_up_splits_become_sliced_matmuls_with_the_same_outputs(packed_prefill):
    config, packed = packed_prefill
    before = op_counts(packed)
    assert before["Split"] >= config.num_layers  # gate/up per layer (q/k/v too: no attention fused here)
    original = packed.SerializeToString()
    sliced, report = slice_packed_weights.run(packed, OPTIONS)
    after = op_counts(sliced)
    assert packed.SerializeToString() == original  # pure
    parts = sum(len(entry["widths"]) for entry in report["rewritten"])
    assert after["Split"] == before["Split"] - len(report["rewritten"]) == 0
    assert after["MatMul"] == before["MatMul"] - len(report["rewritten"]) + parts
    assert after["Slice"] - before["Slice"] == parts
    assert [config.intermediate_size] * 2 in [entry["widths"] for entry in report["rewritten"]]
    weights = lambda model: sorted(init.name for init in model.graph.initializer if init.dims and len(init.dims) == 2)  # noqa: E731
    assert weights(sliced) == weights(packed)  # the same initializers: the artifact does not grow
    feeds = decoder_feeds(config)
    expected, got = run_ort(packed, feeds), run_ort(sliced, feeds)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-5, err_msg=name)


def hand_made(weight_from_input: bool = False, axis: int = -1, extra_reader: bool = False, sizes=(4, 6)):
    """x [2, 3, 8] -> MatMul(W [8, 10]) -> Split(sizes) -> y0, y1 (+ the packed output as a graph output)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 10)).astype(np.float32)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])]
    initializers = [numpy_helper.from_array(np.array(sizes, np.int64), "sizes")]
    nodes = []
    if weight_from_input:
        inputs.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT, [1]))
        initializers.append(numpy_helper.from_array(weight, "w0"))
        nodes.append(helper.make_node("Mul", ["w0", "scale"], ["w"], name="scaled"))
    else:  # computed from constants only, as dequantize_weights' chain is
        initializers += [numpy_helper.from_array(weight, "w0"), numpy_helper.from_array(np.float32([2.0]), "two")]
        nodes.append(helper.make_node("Mul", ["w0", "two"], ["w"], name="doubled"))
    nodes += [helper.make_node("MatMul", ["x", "w"], ["packed"], name="packed_matmul"),
              helper.make_node("Split", ["packed", "sizes"], ["y0", "y1"], name="split", axis=axis)]
    shapes = {-1: ([2, 3, sizes[0]], [2, 3, sizes[1]]), 1: ([2, 3, 10], [2, 3, 10])}[axis]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in zip(("y0", "y1"), shapes)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("packed", TensorProto.FLOAT, [2, 3, 10]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_weight_computed_from_constants_is_sliced_after_it_and_matches():
    model = hand_made()
    sliced, report = slice_packed_weights.run(model, OPTIONS)
    assert report["rewritten"] == [{"node": "packed_matmul", "widths": [4, 6]}]
    assert op_counts(sliced) == Counter({"Mul": 1, "Slice": 2, "MatMul": 2})
    x = {"x": np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)}
    expected, got = run_ort(model, x), run_ort(sliced, x)
    for name in ("y0", "y1"):
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("case, reason", [
    ({"weight_from_input": True}, "computed from a graph input"),
    ({"axis": 1, "sizes": (1, 2)}, "not the last one"),
    ({"extra_reader": True}, "read by more than the Split"),
    ({"sizes": (4, 5)}, "do not cut the weight's 10 columns"),
])
def test_what_is_kept_is_reported_with_the_reason(case, reason):
    model = hand_made(**case)
    result, report = slice_packed_weights.run(model, OPTIONS)
    assert result is model and not report["applied"]
    assert len(report["kept"]) == 1 and reason in report["kept"][0]["reason"]


@pytest.mark.parametrize("phases", [(), ("prefill", "prefill"), ("train",)])
def test_bad_phases_are_refused(phases):
    with pytest.raises(PassError, match="phases"):
        slice_packed_weights.check_options(slice_packed_weights.Options(phases=phases))
