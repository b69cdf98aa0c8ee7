"""passes/probe_precision.as_float32: a probe of a float16/bfloat16 graph runs as the same math in float32
(onnxruntime's CPU kernels have no bfloat16 Mul); a float32 probe is left as it is."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort

from passes.probe_precision import as_float32


def squares(reduced: int, typed: bool) -> gs.Graph:
    """x (float32) -> Cast(reduced) -> Mul(h, h) -> Cast(float32); the intermediates typed or, as in a graph
    without value_info, not."""
    x, y = gs.Variable("x", dtype=np.float32, shape=[4]), gs.Variable("y", dtype=np.float32, shape=[4])
    dtype = onnx.helper.tensor_dtype_to_np_dtype(reduced) if typed else None
    h, m = gs.Variable("h", dtype=dtype), gs.Variable("m", dtype=dtype)
    nodes = [gs.Node("Cast", inputs=[x], outputs=[h], attrs={"to": reduced}),
             gs.Node("Mul", inputs=[h, h], outputs=[m]),
             gs.Node("Cast", inputs=[m], outputs=[y], attrs={"to": onnx.TensorProto.FLOAT})]
    return gs.Graph(nodes=nodes, inputs=[x], outputs=[y], opset=17)


def run(graph: gs.Graph) -> np.ndarray:
    session = ort.InferenceSession(gs.export_onnx(graph).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": np.arange(4, dtype=np.float32)})[0]


def test_a_reduced_cast_is_widened_even_where_no_value_carries_its_type():
    for typed in (True, False):  # untyped intermediates: the Casts alone say bfloat16
        graph = squares(onnx.TensorProto.BFLOAT16, typed)
        as_float32(graph)
        assert [node.attrs["to"] for node in graph.nodes if node.op == "Cast"] == [onnx.TensorProto.FLOAT] * 2
        np.testing.assert_array_equal(run(graph), [0, 1, 4, 9])


def test_a_reduced_constant_attribute_is_widened():
    x, y = gs.Variable("x", dtype=np.float32, shape=[4]), gs.Variable("y", dtype=np.float32, shape=[4])
    c, h, m = gs.Variable("c"), gs.Variable("h"), gs.Variable("m")
    two = gs.Constant("two", np.full([4], 2, dtype=np.float16))
    graph = gs.Graph(nodes=[gs.Node("Constant", outputs=[c], attrs={"value": two}),
                            gs.Node("Cast", inputs=[x], outputs=[h], attrs={"to": onnx.TensorProto.FLOAT16}),
                            gs.Node("Mul", inputs=[h, c], outputs=[m]),
                            gs.Node("Cast", inputs=[m], outputs=[y], attrs={"to": onnx.TensorProto.FLOAT})],
                     inputs=[x], outputs=[y], opset=17)
    as_float32(graph)
    assert graph.nodes[0].attrs["value"].values.dtype == np.float32
    np.testing.assert_array_equal(run(graph), [0, 2, 4, 6])


def test_a_float32_probe_is_left_as_it_is():
    """Nothing to widen: not even cleaned up (run_cut does that once; each cleanup of a deep graph cost seconds)."""
    x, y = gs.Variable("x", dtype=np.float32, shape=[4]), gs.Variable("y", dtype=np.float32, shape=[4])
    unused = gs.Variable("unused", dtype=np.float32, shape=[4])
    graph = gs.Graph(nodes=[gs.Node("Mul", inputs=[x, x], outputs=[y])], inputs=[x, unused], outputs=[y], opset=17)
    as_float32(graph)
    assert [value.name for value in graph.inputs] == ["x", "unused"] and graph.inputs[0].dtype == np.float32
