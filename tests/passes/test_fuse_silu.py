"""fuse_silu: each MLP's SiLU becomes one QuickGelu, and the graphs compute the same."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from passes import fuse_silu
from tests.passes.test_fuse_attention import CONFIG, decoder_graphs, generate_logits, op_counts  # noqa: F401


def test_every_silu_fuses_and_outputs_are_unchanged(decoder_graphs):  # noqa: F811
    fused = {}
    for phase, model in decoder_graphs.items():
        fused[phase], report = fuse_silu.run(model, fuse_silu.Options())
        assert report["fused"] == CONFIG.num_layers and not report["skipped"]
        counts = op_counts(fused[phase])
        assert counts["QuickGelu"] == CONFIG.num_layers and counts["Sigmoid"] == 0
        assert len(fused[phase].graph.node) == len(model.graph.node) - CONFIG.num_layers
    for reference, result in zip(generate_logits(decoder_graphs), generate_logits(fused)):
        np.testing.assert_allclose(result, reference, atol=1e-5)


def test_a_sigmoid_that_is_not_silu_is_left_with_a_reason():
    nodes = [onnx.helper.make_node("Sigmoid", ["x"], ["s"], name="gate"), onnx.helper.make_node("Mul", ["s", "y"], ["z"])]
    tensor = lambda name: onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [2])  # noqa: E731
    graph = onnx.helper.make_graph(nodes, "g", [tensor("x"), tensor("y")], [tensor("z")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    result, report = fuse_silu.run(model, fuse_silu.Options())
    assert report["fused"] == 0 and report["skipped"] == [
        {"node": "gate", "reason": "the Mul does not multiply the Sigmoid's own input"}]
    assert [n.op_type for n in result.graph.node] == ["Sigmoid", "Mul"]


@pytest.mark.parametrize("limit", [1])
def test_max_rewrites(decoder_graphs, limit):  # noqa: F811
    _, report = fuse_silu.run(decoder_graphs["decode"], fuse_silu.Options(max_rewrites=limit))
    assert report["fused"] == limit and report["skipped"][0]["reason"] == f"max_rewrites={limit}"


def test_unnamed_sigmoids_get_distinct_names_and_an_overridable_input_stays():
    """Two unnamed Sigmoids both became QuickGelu "_silu", which onnxruntime refuses; and an initializer that is also
    a graph input (an overridable default) was dropped from the inputs by the export."""
    tensor = lambda name: onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [2])  # noqa: E731
    nodes = [onnx.helper.make_node("Add", ["x", "bias"], ["h"]),
             onnx.helper.make_node("Sigmoid", ["h"], ["s1"]), onnx.helper.make_node("Mul", ["h", "s1"], ["y1"]),
             onnx.helper.make_node("Sigmoid", ["x"], ["s2"]), onnx.helper.make_node("Mul", ["x", "s2"], ["y2"])]
    graph = onnx.helper.make_graph(nodes, "g", [tensor("x"), tensor("bias")], [tensor("y1"), tensor("y2")],
                                   [onnx.numpy_helper.from_array(np.array([0.5, -1.0], np.float32), "bias")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    result, report = fuse_silu.run(model, fuse_silu.Options())
    assert report["fused"] == 2 and sorted(n.name for n in result.graph.node if n.op_type == "QuickGelu") == [
        "y1_silu", "y2_silu"]
    assert [i.name for i in result.graph.input] == ["x", "bias"]
    feeds = {"x": np.array([0.3, -2.0], np.float32), "bias": np.array([1.0, 2.0], np.float32)}
    expected, fused = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
                       for m in (model, result))
    for a, b in zip(expected, fused):
        np.testing.assert_allclose(b, a, atol=1e-6)


def small_model(nodes: list[onnx.NodeProto], outputs: list[str]) -> onnx.ModelProto:
    """A graph of `nodes` over x [2], each of `outputs` a [2] float."""
    tensor = lambda name: onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [2])  # noqa: E731
    graph = onnx.helper.make_graph(nodes, "g", [tensor("x")], [tensor(name) for name in outputs])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])


def run_both(model: onnx.ModelProto, result: onnx.ModelProto) -> None:
    feeds = {"x": np.array([0.3, -2.0], np.float32)}
    expected, fused = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
                       for m in (model, result))
    for a, b in zip(expected, fused):
        np.testing.assert_allclose(b, a, atol=1e-6)


@pytest.mark.parametrize("readers, outputs", [
    ([onnx.helper.make_node("Add", ["x", "s"], ["z"])], ["z"]),  # x + Sigmoid(x) is no SiLU
    # x * Sigmoid(x) whose Sigmoid a Neg reads too: fused, the Sigmoid would still run, and QuickGelu besides
    ([onnx.helper.make_node("Mul", ["x", "s"], ["z"]), onnx.helper.make_node("Neg", ["s"], ["n"])], ["z", "n"]),
])
def test_a_sigmoid_not_read_by_exactly_one_mul_is_left_with_a_reason(readers, outputs):
    model = small_model([onnx.helper.make_node("Sigmoid", ["x"], ["s"], name="gate"), *readers], outputs)
    result, report = fuse_silu.run(model, fuse_silu.Options())
    assert report["fused"] == 0 and report["skipped"] == [
        {"node": "gate", "reason": "the Sigmoid's output does not feed exactly one Mul"}]
    assert [n.op_type for n in result.graph.node] == [n.op_type for n in model.graph.node]


def test_a_fused_name_already_taken_gets_a_suffix():
    """Sigmoid "act" fuses to "act_silu", which another node already has: onnxruntime refuses two nodes of one name."""
    model = small_model([onnx.helper.make_node("Sigmoid", ["x"], ["s"], name="act"),
                         onnx.helper.make_node("Mul", ["x", "s"], ["y"], name="mul"),
                         onnx.helper.make_node("Neg", ["y"], ["z"], name="act_silu")], ["z"])
    result, report = fuse_silu.run(model, fuse_silu.Options())
    assert report["fused"] == 1 and sorted(n.name for n in result.graph.node) == ["act_silu", "act_silu_1"]
    run_both(model, result)

