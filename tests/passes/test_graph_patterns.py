"""passes/graph_patterns.py on tiny graphsurgeon graphs built here: each walker and parser finds what it should and
names the check that failed where it finds nothing."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from passes import graph_patterns as patterns
from passes.flash_attention_op import rotary_tables

INV_FREQ = np.array([1.0, 0.1], np.float32)


def node(graph: gs.Graph, op: str, inputs: list, **attrs) -> gs.Variable:
    """One node of `graph`; returns its (only) output."""
    return graph.layer(op=op, inputs=inputs, outputs=[f"{op.lower()}_{len(graph.nodes)}"], attrs=attrs)[0]


def scalar(name: str, value: float) -> gs.Constant:
    return gs.Constant(name, np.array(value, np.float32))


def test_an_omitted_optional_input_is_not_present():
    assert not patterns.is_present(gs.Variable.empty())
    assert patterns.is_present(gs.Variable("past_key")) and patterns.is_present(scalar("s", 1.0))


def test_computed_from_constants_follows_constants_and_stops_at_inputs_sources_and_subgraphs():
    graph, x = gs.Graph(), gs.Variable("x", np.float32, [2])
    from_constant_node = node(graph, "Constant", [], value=gs.Constant("c", np.ones(2, np.float32)))
    folded = node(graph, "Add", [from_constant_node, gs.Constant("w", np.ones(2, np.float32))])
    assert patterns.computed_from_constants(from_constant_node) and patterns.computed_from_constants(folded)
    assert not patterns.computed_from_constants(node(graph, "Add", [folded, x]))  # reads a graph input
    assert not patterns.computed_from_constants(node(graph, "RandomNormal", [], shape=[2]))  # a source, not folded
    branch = gs.Graph(outputs=[gs.Constant("b", np.ones(2, np.float32))])
    assert not patterns.computed_from_constants(node(graph, "If", [gs.Constant("cond", np.array(True))],
                                                     then_branch=branch, else_branch=branch))


def test_scalar_factor_is_a_mul_or_div_by_one_constant_scalar():
    graph, x = gs.Graph(), gs.Variable("x", np.float32, [2])
    factor = lambda output: patterns.scalar_factor(output.inputs[0])  # noqa: E731
    assert factor(node(graph, "Mul", [scalar("two", 2.0), x])) == 2.0
    assert factor(node(graph, "Div", [x, scalar("four", 4.0)])) == 0.25
    assert factor(node(graph, "Div", [scalar("one", 1.0), x])) is None  # 1 / x scales nothing
    assert factor(node(graph, "Mul", [x, gs.Constant("row", np.array([2.0, 3.0], np.float32))])) is None
    assert factor(node(graph, "Mul", [scalar("a", 2.0), scalar("b", 3.0)])) is None  # a constant, not a scaling
    assert factor(node(graph, "Div", [scalar("six", 6.0), scalar("three", 3.0)])) is None
    assert factor(node(graph, "Add", [x, scalar("c", 2.0)])) is None


def test_walk_up_scaled_multiplies_the_factors_it_passes():
    graph, q = gs.Graph(), gs.Variable("q", np.float32, [2, 4])
    scaled = node(graph, "Mul", [node(graph, "Reshape", [node(graph, "Mul", [q, scalar("half", 0.5)]),
                                                          gs.Constant("shape", np.array([2, 4]))]),
                                 scalar("six", 6.0)])
    reached, factor = patterns.walk_up_scaled(node(graph, "Transpose", [scaled]), {"Reshape", "Transpose"})
    assert reached is q and factor == pytest.approx(3.0)
    assert patterns.walk_up(node(graph, "Transpose", [node(graph, "Reshape", [q, gs.Constant("s2", np.array([8]))])]),
                            {"Reshape", "Transpose"}) == (q, None)


@pytest.mark.parametrize("name, expected", [("layers.3.self_attn/Softmax", "layers.3"),
                                            ("/model/layers/2/attn", "layers.2"),
                                            ("model_layers_4_self_attn", "layers.4"),
                                            ("node_Softmax_157", "node_Softmax_157"), ("", "attention")])
def test_layer_name_reads_the_layer_number_whatever_the_separator(name, expected):
    assert patterns.layer_name(gs.Node("Softmax", name=name)) == expected


def test_numbered_keeps_only_a_whole_layer_name():
    assert patterns.numbered("layers.3", 7) == "layers.3"
    assert patterns.numbered("layers.3.extra", 7) == "attention.7"
    assert patterns.numbered("node_Softmax_157", 0) == "attention.0"


def rotate_half(graph: gs.Graph, t: gs.Tensor, cos: gs.Tensor, sin: gs.Tensor, negate: bool = True,
                cos_reads: gs.Tensor | None = None) -> gs.Variable:
    """t * cos + Concat(-t[..., 1:], t[..., :1]) * sin (head_dim 2)."""
    def half(name: str, start: int) -> gs.Variable:
        bounds = [gs.Constant(f"{name}_{what}", np.array([value])) for what, value in
                  (("start", start), ("end", start + 1), ("axis", -1))]
        return node(graph, "Slice", [t, *bounds])

    first, second = half("first", 0), half("second", 1)
    turned = node(graph, "Concat", [node(graph, "Neg" if negate else "Identity", [second]), first], axis=-1)
    return node(graph, "Add", [node(graph, "Mul", [cos_reads if cos_reads is not None else t, cos]),
                               node(graph, "Mul", [turned, sin])])


def test_parse_rotary_finds_the_rotated_tensor_and_its_cos_table():
    graph, t = gs.Graph(), gs.Variable("t", np.float32, [1, 3, 2])
    cos, sin = gs.Variable("cos", np.float32, [3, 2]), gs.Variable("sin", np.float32, [3, 2])
    assert patterns.parse_rotary(rotate_half(graph, t, cos, sin)) == (t, cos)
    reason = patterns.parse_rotary(rotate_half(graph, t, cos, sin, negate=False))
    assert isinstance(reason, patterns.SkipReason) and "no rotate-half term" in reason
    other = gs.Variable("other", np.float32, [1, 3, 2])
    reason = patterns.parse_rotary(rotate_half(graph, t, cos, sin, cos_reads=other))
    assert reason == "rotary: the cos term does not multiply the tensor being rotated"


@pytest.mark.parametrize("attrs, indexed, refused", [
    ({}, False, False), ({"rotary_embedding_dim": 8}, False, False),  # the whole head, said explicitly
    ({"interleaved": 1}, False, True), ({"rotary_embedding_dim": 4}, False, True), ({}, True, True)])
def test_parse_rotary_takes_a_rotary_embedding_only_if_it_rotates_all_of_each_head_at_its_position(attrs, indexed,
                                                                                                   refused):
    graph = gs.Graph()
    x, cos, sin = gs.Variable("x", np.float32, [1, 2, 3, 8]), gs.Variable("cos"), gs.Variable("sin")
    position_ids = gs.Variable("position_ids", np.int64, [1, 3]) if indexed else gs.Variable.empty()
    rotated = node(graph, "RotaryEmbedding", [x, cos, sin, position_ids], **attrs)
    found = patterns.parse_rotary(rotated)
    if refused:
        assert isinstance(found, patterns.SkipReason) and "interleaved, partial or indexed" in found
    else:
        assert found == (x, cos)


def cos_table(graph: gs.Graph, angles: gs.Tensor) -> gs.Variable:
    """Cos(angles), scaled by 2 and reshaped on the way to the table (as exporters write an attention factor)."""
    cos = node(graph, "Cos", [angles])
    return node(graph, "Reshape", [node(graph, "Mul", [cos, scalar("attention_factor", 2.0)]),
                                   gs.Constant("table_shape", np.array([-1, 2]))])


def test_parse_inv_freq_finds_the_nearest_float_vector_under_cos_and_the_scaling():
    graph, positions = gs.Graph(), gs.Variable("positions", np.float32, [3, 1])
    inv_freq = gs.Constant("inv_freq", INV_FREQ)
    angles = node(graph, "Mul", [node(graph, "Mul", [positions, inv_freq]), scalar("one", 1.0)])  # a scalar on the way
    angles = node(graph, "Reshape", [angles, gs.Constant("flat", np.array([3, 2]))])  # an int vector on the way
    found, scaling = patterns.parse_inv_freq(cos_table(graph, angles))
    np.testing.assert_array_equal(found, INV_FREQ)
    assert scaling == 2.0


def test_parse_inv_freq_searches_breadth_first():
    """inv_freq two nodes under Cos; another float vector three nodes under it, on the other branch."""
    graph, positions = gs.Graph(), gs.Variable("positions", np.float32, [3, 1])
    near = node(graph, "Mul", [positions, gs.Constant("inv_freq", INV_FREQ)])
    far = node(graph, "Mul", [node(graph, "Mul", [positions, gs.Constant("other", np.array([5.0, 6.0], np.float32))]),
                              positions])
    found, _ = patterns.parse_inv_freq(cos_table(graph, node(graph, "Add", [near, far])))
    np.testing.assert_array_equal(found, INV_FREQ)


def test_parse_inv_freq_says_why_it_found_nothing():
    graph = gs.Graph()
    reason = patterns.parse_inv_freq(gs.Constant("cos", np.ones((3, 2), np.float32)))
    assert reason == "rotary: cos table is not computed from positions in the graph"
    reason = patterns.parse_inv_freq(node(graph, "Sin", [gs.Variable("angles", np.float32, [3, 2])]))
    assert reason == "rotary: cos table comes from Sin, not Cos"
    reason = patterns.parse_inv_freq(cos_table(graph, gs.Variable("angles", np.float32, [3, 2])))
    assert reason == "rotary: no inv_freq constant under Cos"


def test_constant_reads_initializers_and_constant_nodes_only():
    graph = gs.Graph()
    np.testing.assert_array_equal(patterns.constant(node(graph, "Constant", [], value=gs.Constant("c", np.ones(2)))),
                                  np.ones(2))
    np.testing.assert_array_equal(patterns.constant(scalar("s", 3.0)), 3.0)
    assert patterns.constant(node(graph, "Relu", [scalar("r", 1.0)])) is None


def test_a_weight_read_from_a_model_is_read_without_being_kept_and_typed_without_being_read():
    weights = np.arange(6, dtype=np.float16).reshape(2, 3)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 3])], [numpy_helper.from_array(weights, "w")]))
    weight = gs.import_onnx(model).tensors()["w"]
    assert patterns.constant_type(weight) == np.float16
    np.testing.assert_array_equal(patterns.uncached_values(weight), weights)
    assert isinstance(weight._values, LazyValues)  # still lazy: no second copy of the weight held


def test_unique_name_counts_up_past_every_name_taken():
    taken = {"norm", "norm_1"}
    assert patterns.unique_name("norm", taken) == "norm_2"
    assert patterns.unique_name("norm", taken) == "norm_3"  # the name it gave is taken now
    assert patterns.unique_name("silu", taken) == "silu" and "silu" in taken


@pytest.mark.parametrize("dtype, cast_to", [(None, None), (np.float32, None), (np.float16, TensorProto.FLOAT16),
                                            (TensorProto.BFLOAT16, TensorProto.BFLOAT16)])
def test_rotary_table_constants_are_float32_tables_cast_to_the_graphs_type(dtype, cast_to):
    graph = gs.Graph()
    tables = patterns.rotary_table_constants(graph, "layer0_", INV_FREQ, rows=5, scaling=1.5, dtype=dtype)
    expected = rotary_tables(INV_FREQ, 5, 1.5)
    if cast_to is None:
        assert graph.nodes == [] and [t.name for t in tables] == ["layer0_cos_cache", "layer0_sin_cache"]
        constants = tables
    else:
        casts = [table.inputs[0] for table in tables]
        assert [(c.op, c.attrs["to"]) for c in casts] == [("Cast", cast_to)] * 2 and graph.nodes == casts
        assert [t.shape for t in tables] == [[5, 2], [5, 2]]
        constants = [c.inputs[0] for c in casts]
    for constant, values in zip(constants, expected):
        np.testing.assert_array_equal(constant.values, values)
