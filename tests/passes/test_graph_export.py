"""passes/graph_export.export_onnx: the model graphsurgeon's export_onnx returns, with large weights copied once."""
from __future__ import annotations


import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper, numpy_helper

from passes.graph_export import STUB_ABOVE_BYTES, export_onnx
from tests.peak_memory import peak_growth_mb


def model_with_weights() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    big = numpy_helper.from_array(rng.standard_normal((64, 512)).astype(np.float32), "big")  # 128 KB
    small = numpy_helper.from_array(np.arange(4, dtype=np.int64), "small")
    doubles = helper.make_tensor("doubles", TensorProto.DOUBLE, [100, 100], rng.standard_normal(10000).tolist())
    nodes = [helper.make_node("MatMul", ["x", "big"], ["y"], name="mm"),
             helper.make_node("Reshape", ["y", "small"], ["z"], name="reshape"),
             helper.make_node("Add", ["w", "doubles"], ["v"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
                                           helper.make_tensor_value_info("w", TensorProto.DOUBLE, [100, 100])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("v", TensorProto.DOUBLE, None)],
                              initializer=[big, small, doubles])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def edited(model: onnx.ModelProto) -> gs.Graph:
    """A pass's kind of edit: a weight renamed, new large weights (float32 and float16), a new small one."""
    graph = gs.import_onnx(model)
    constants = {name: tensor for name, tensor in graph.tensors().items() if isinstance(tensor, gs.Constant)}
    constants["big"].name = "big.renamed"
    mm = next(node for node in graph.nodes if node.name == "mm")
    packed = gs.Constant("packed", np.ones((512, 64), np.float32) * 0.5)
    half = gs.Constant("half", np.full((512, 64), 0.25, np.float16))
    tiny = gs.Constant("tiny", np.array([2.0], np.float32))
    graph.nodes.append(gs.Node("MatMul", name="mm2", inputs=[mm.outputs[0], packed], outputs=[gs.Variable("u")]))
    graph.nodes.append(gs.Node("MatMul", name="mm3", inputs=[mm.outputs[0], half], outputs=[gs.Variable("t")]))
    graph.nodes.append(gs.Node("Mul", name="mul", inputs=[mm.outputs[0], tiny], outputs=[gs.Variable("s")]))
    return graph


def test_it_returns_what_graphsurgeon_returns_and_leaves_the_graph_as_it_was():
    graph = edited(model_with_weights())
    ours = export_onnx(graph, do_type_check=False)
    reference = gs.export_onnx(edited(model_with_weights()), do_type_check=False)
    assert ours.SerializeToString() == reference.SerializeToString()
    names = {t.name for t in ours.graph.initializer}
    assert {"big.renamed", "packed", "half", "doubles", "small", "tiny"} <= names
    assert [t.data_type for t in ours.graph.initializer if t.name == "half"] == [TensorProto.FLOAT16]
    # graphsurgeon's constants hold their values again: the graph exports the same model a second time
    assert export_onnx(graph, do_type_check=False).SerializeToString() == reference.SerializeToString()
    assert all(not isinstance(t, gs.Constant) or t.values.nbytes > 0 for t in graph.tensors().values())
    assert STUB_ABOVE_BYTES < 128 << 10  # "big" goes through the stub path


def test_it_holds_the_weights_once_more_not_twice():
    """Exporting a graph of 320 MB of weights read from a model: graphsurgeon's own export raised the peak resident
    memory by about two copies (make_graph, then make_model), this one, and a pass that exports through it, by about
    one. Measured in fresh processes."""
    setup = """
        import sys
        import onnx_graphsurgeon as gs
        from passes.graph_export import export_onnx
        model = matmul_model(20, 1024, 4096)
        imported = gs.import_onnx(model)
    """
    measured = """
        if sys.argv[1] == "pass":  # a whole pass, which reads the model and exports its result through cleanup
            from passes import fuse_silu
            exported = fuse_silu.run(model, fuse_silu.Options())
        else:
            exported = (export_onnx if sys.argv[1] == "lean" else gs.export_onnx)(imported)
    """
    grown = {kind: peak_growth_mb(setup, measured, kind) for kind in ("lean", "pass", "graphsurgeon")}
    weights_mb = 20 * 1024 * 4096 * 4 / 2**20
    assert grown["graphsurgeon"] > 1.7 * weights_mb, grown  # the two copies this module avoids
    assert grown["lean"] < 1.3 * weights_mb and grown["pass"] < 1.3 * weights_mb, grown


def test_constants_in_subgraphs_and_constant_outputs_export_as_graphsurgeon_exports_them():
    """A large constant read inside an If branch too had been exported there as the empty stub; a large array constant
    that is also a graph output had its stub's type in the output's value_info."""
    big = gs.Constant("big", np.ones((200, 200), np.float32))
    x, cond = gs.Variable("x", np.float32, (200, 200)), gs.Variable("cond", np.bool_, ())
    branches = {}
    for key, op in (("then_branch", "Add"), ("else_branch", "Sub")):
        out = gs.Variable(f"{op}_out", np.float32, (200, 200))
        branches[key] = gs.Graph(nodes=[gs.Node(op, inputs=[x, big], outputs=[out])], outputs=[out])
    product, chosen = gs.Variable("m", np.float32, (200, 200)), gs.Variable("out", np.float32, (200, 200))
    with_if = gs.Graph(nodes=[gs.Node("Mul", inputs=[x, big], outputs=[product]),
                              gs.Node("If", inputs=[cond], outputs=[chosen], attrs=branches)],
                       inputs=[x, cond], outputs=[chosen, product], opset=17)
    assert export_onnx(with_if).SerializeToString() == gs.export_onnx(with_if).SerializeToString()
    also_output = gs.Constant("c", np.ones((200, 200), np.float32))
    copied = gs.Variable("copy", np.float32, (200, 200))
    outputs = gs.Graph(nodes=[gs.Node("Identity", inputs=[x], outputs=[copied])], inputs=[x],
                       outputs=[copied, also_output], opset=17)
    ours = export_onnx(outputs)
    assert ours.SerializeToString() == gs.export_onnx(outputs).SerializeToString()
    assert ours.graph.output[1].type.tensor_type.elem_type == TensorProto.FLOAT


def test_a_large_constant_output_keeps_its_own_type_whether_new_or_read_from_a_model():
    """The stub carries the constant's type into the output's value_info: a float16 output must not read FLOAT."""
    half = numpy_helper.from_array(np.ones((200, 200), np.float16), "read")  # 80 KB, above STUB_ABOVE_BYTES
    read = gs.import_onnx(helper.make_model(helper.make_graph(
        [], "g", [], [helper.make_tensor_value_info("read", TensorProto.FLOAT16, [200, 200])], initializer=[half]),
        opset_imports=[helper.make_opsetid("", 21)]))
    new = gs.Graph(outputs=[gs.Constant("new", np.ones((200, 200), np.float16))], opset=21)
    for graph in (read, new):
        ours = export_onnx(graph)
        assert ours.SerializeToString() == gs.export_onnx(graph).SerializeToString()
        assert ours.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
