"""Tests for passes/cleanup.py: tiny generated graphs, op counts before/after, onnxruntime parity."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes import cleanup

OPSET = [helper.make_opsetid("", 17)]


def make_model() -> onnx.ModelProto:
    """
        Constant(1) ─► Add(weight) ─► Mul(two) ─┐
        x ──────────────────────────────────────┴─► MatMul ─► Add(bias_a) ─► y
                                                           └─► Sub(bias_b) ─► z      (bias_a == bias_b)
        x ─► Relu ─► (dead)          past_key: an input nothing reads     unused_weight: read by nothing
    """
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 3)).astype(np.float32)
    bias = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    initializers = [
        numpy_helper.from_array(weight, "weight"),
        numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two"),
        numpy_helper.from_array(bias, "bias_a"),
        numpy_helper.from_array(bias.copy(), "bias_b"),
        numpy_helper.from_array(np.ones((8,), dtype=np.float32), "unused_weight"),
    ]
    nodes = [
        helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.ones((4, 3), np.float32))),
        helper.make_node("Add", ["weight", "one"], ["shifted"]),
        helper.make_node("Mul", ["shifted", "two"], ["scaled"]),
        helper.make_node("MatMul", ["x", "scaled"], ["product"]),
        helper.make_node("Add", ["product", "bias_a"], ["y"]),
        helper.make_node("Sub", ["product", "bias_b"], ["z"]),
        helper.make_node("Relu", ["x"], ["dead"]),
    ]
    graph = helper.make_graph(
        nodes, "cleanup_test",
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
                helper.make_tensor_value_info("past_key", TensorProto.FLOAT, [1, 2])],
        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
                 helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 3])],
        initializer=initializers,
    )
    return helper.make_model(graph, opset_imports=OPSET)


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_folds_constants_and_removes_dead_nodes():
    model = make_model()
    assert op_counts(model) == Counter(Constant=1, Add=2, Mul=1, MatMul=1, Sub=1, Relu=1)

    cleaned, report = cleanup.run(model, cleanup.Options())

    assert op_counts(cleaned) == Counter(MatMul=1, Add=1, Sub=1)
    assert report["dead_nodes_removed"] == 1
    assert report["nodes_folded"] == 3  # Constant, Add, Mul
    assert report["constants_folded"] == 1  # `scaled`: the initializers it replaced are not counted
    assert report["nodes"] == {"before": 7, "after": 3}
    assert report["ops_changed"]["Relu"] == {"before": 1, "after": 0}
    assert "MatMul" not in report["ops_changed"]
    shapes = {value.name: value.type.tensor_type.shape for value in cleaned.graph.value_info}
    assert [dim.dim_param or dim.dim_value for dim in shapes["product"].dim] == ["batch", 3]  # inferred
    assert len(cleaned.graph.value_info) == len(shapes)  # each tensor described once, by inference


def test_deduplicates_identical_initializers_and_rewires_consumers():
    cleaned, report = cleanup.run(make_model(), cleanup.Options())

    assert report["initializers_deduplicated"] == 1
    names = {tensor.name for tensor in cleaned.graph.initializer}
    assert "bias_a" in names and "bias_b" not in names and "unused_weight" not in names
    consumers = {node.op_type: list(node.input) for node in cleaned.graph.node}
    assert consumers["Add"][1] == "bias_a" and consumers["Sub"][1] == "bias_a"
    # weight, two, both biases, unused_weight -> the folded weight and one bias
    assert report["initializers"] == {"before": 5, "after": 2}
    assert report["initializer_bytes"] == {"before": 48 + 4 + 12 + 12 + 32, "after": 48 + 12}


def test_keeps_graph_inputs_and_outputs_exactly():
    model = make_model()
    cleaned, report = cleanup.run(model, cleanup.Options())

    assert [value.name for value in cleaned.graph.input] == ["x", "past_key"]  # past_key is read by nothing
    assert [value.name for value in cleaned.graph.output] == ["y", "z"]
    assert report["inputs"] == ["x", "past_key"] and report["outputs"] == ["y", "z"]


def test_keeps_an_initializer_that_is_also_a_graph_input():
    # Older exporters list initializers as inputs (an overridable default); graphsurgeon would drop the input.
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "scale"], ["y"])], "defaults",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        initializer=[numpy_helper.from_array(np.full(2, 3.0, np.float32), "scale")])
    cleaned, _ = cleanup.run(helper.make_model(graph, opset_imports=OPSET), cleanup.Options())

    assert [value.name for value in cleaned.graph.input] == ["x", "scale"]
    assert [tensor.name for tensor in cleaned.graph.initializer] == ["scale"]


def test_outputs_match_onnxruntime_before_and_after():
    model = make_model()
    cleaned, _ = cleanup.run(model, cleanup.Options())
    onnx.checker.check_model(cleaned)

    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((5, 4)).astype(np.float32), "past_key": np.zeros((1, 2), np.float32)}
    for expected, actual in zip(run_ort(model, feeds), run_ort(cleaned, feeds)):
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("infer_shapes", [True, False])
def test_does_not_mutate_its_input_and_report_is_json(infer_shapes):
    model = make_model()
    serialized = model.SerializeToString()
    _, report = cleanup.run(model, cleanup.Options(infer_shapes=infer_shapes))
    assert model.SerializeToString() == serialized
    json.dumps(report)


def test_options_turn_each_step_off():
    options = cleanup.Options(fold_constants=False, deduplicate_initializers=False, infer_shapes=False)
    cleaned, report = cleanup.run(make_model(), options)

    assert op_counts(cleaned) == Counter(Constant=1, Add=2, Mul=1, MatMul=1, Sub=1)  # only the dead Relu went
    assert report["nodes_folded"] == 0 and report["initializers_deduplicated"] == 0
    assert {"bias_a", "bias_b"} <= {tensor.name for tensor in cleaned.graph.initializer}


@pytest.mark.parametrize("threshold, expands_left", [(64, 1), (1 << 20, 0)])
def test_size_threshold_keeps_large_results_unfolded(threshold, expands_left):
    # Expand of a 1-element constant to 1000 floats (4000 bytes): folding it would add a big initializer.
    nodes = [helper.make_node("Expand", ["scalar", "shape"], ["wide"]),
             helper.make_node("Add", ["x", "wide"], ["y"])]
    graph = helper.make_graph(
        nodes, "expand", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1000])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1000])],
        initializer=[numpy_helper.from_array(np.array([0.5], np.float32), "scalar"),
                     numpy_helper.from_array(np.array([1000], np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=OPSET)

    cleaned, _ = cleanup.run(model, cleanup.Options(fold_size_threshold_bytes=threshold))

    assert op_counts(cleaned)["Expand"] == expands_left


def test_custom_domain_nodes_are_kept_and_do_not_block_folding():
    # onnxruntime cannot evaluate aotlm ops, so folding must skip them rather than give up on the whole graph.
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]),
             helper.make_node("FlashAttention", ["sum", "x"], ["attended"], domain="aotlm"),
             helper.make_node("FlashAttention", ["a", "b"], ["constant_attended"], domain="aotlm"),
             helper.make_node("Add", ["attended", "constant_attended"], ["y"])]
    graph = helper.make_graph(
        nodes, "custom", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        initializer=[numpy_helper.from_array(np.ones(2, np.float32), "a"),
                     numpy_helper.from_array(np.ones(2, np.float32) * 3, "b")])
    model = helper.make_model(graph, opset_imports=OPSET + [helper.make_opsetid("aotlm", 1)])

    cleaned, report = cleanup.run(model, cleanup.Options())

    assert "fold_skipped" not in report
    assert op_counts(cleaned) == Counter(FlashAttention=2, Add=1)
    assert report["nodes_folded"] == 1
    assert report["ops_changed"] == {"Add": {"before": 2, "after": 1}}
    onnx.checker.check_model(cleaned)


def test_an_overridable_initializer_is_not_folded_into_its_readers():
    """y = x * (scale + 1), scale an initializer (3) and a graph input (a default the caller may override): folding
    baked the default in, so a fed scale of 10 gave 4 and leaving scale out failed as a missing input."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["scale", "one"], ["s1"]), helper.make_node("Mul", ["x", "s1"], ["y"])], "defaults",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        initializer=[numpy_helper.from_array(np.full(2, 3.0, np.float32), "scale"),
                     numpy_helper.from_array(np.full(2, 1.0, np.float32), "one")])
    cleaned, _ = cleanup.run(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), cleanup.Options())
    session = ort.InferenceSession(cleaned.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.ones(2, np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x, "scale": np.full(2, 10.0, np.float32)})[0], [11, 11])
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], [4, 4])


def small_model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    value = lambda name, kind, shape: helper.make_tensor_value_info(name, kind, shape)  # noqa: E731
    graph = helper.make_graph(nodes, "small", [value(*i) for i in inputs], [value(*o) for o in outputs],
                              list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def same_outputs(model: onnx.ModelProto, feeds: dict) -> None:
    cleaned, _ = cleanup.run(model, cleanup.Options())
    for before, after in zip(run_ort(model, feeds), run_ort(cleaned, feeds), strict=True):
        np.testing.assert_array_equal(after, before)


def test_overridable_defaults_are_neither_shared_nor_dropped_nor_read_by_shape_inference():
    """Initializers also listed as graph inputs: `scale` was deduplicated with the equal `bias` (then the bias read a
    fed scale), an unused one became a required input, and a Reshape target's default was folded into Shape."""
    model = small_model(
        [helper.make_node("Mul", ["x", "scale"], ["y"]), helper.make_node("Add", ["x", "bias"], ["z"]),
         helper.make_node("Reshape", ["w", "target"], ["r"]), helper.make_node("Shape", ["r"], ["s"])],
        [("x", TensorProto.FLOAT, [2]), ("scale", TensorProto.FLOAT, [2]), ("unused", TensorProto.FLOAT, [2]),
         ("w", TensorProto.FLOAT, [6]), ("target", TensorProto.INT64, [2])],
        [("y", TensorProto.FLOAT, [2]), ("z", TensorProto.FLOAT, [2]), ("s", TensorProto.INT64, [2])],
        [numpy_helper.from_array(np.full(2, 3.0, np.float32), "scale"),
         numpy_helper.from_array(np.full(2, 3.0, np.float32), "bias"),
         numpy_helper.from_array(np.ones(2, np.float32), "unused"),
         numpy_helper.from_array(np.array([2, 3], np.int64), "target")])
    x, w = np.ones(2, np.float32), np.zeros(6, np.float32)
    same_outputs(model, {"x": x, "w": w})  # the defaults
    same_outputs(model, {"x": x, "w": w, "scale": np.full(2, 10.0, np.float32), "target": np.array([3, 2])})


def test_random_ops_are_not_folded_into_one_sample():
    model = small_model([helper.make_node("RandomUniform", [], ["noise"], shape=[4], dtype=TensorProto.FLOAT),
                         helper.make_node("Add", ["x", "noise"], ["y"])],
                        [("x", TensorProto.FLOAT, [4])], [("y", TensorProto.FLOAT, [4])])
    cleaned, _ = cleanup.run(model, cleanup.Options())
    session = ort.InferenceSession(cleaned.SerializeToString(), providers=["CPUExecutionProvider"])
    assert len({tuple(session.run(None, {"x": np.zeros(4, np.float32)})[0]) for _ in range(4)}) > 1


def test_int_arithmetic_in_float_with_a_fractional_or_shared_constant_keeps_its_meaning():
    """graphsurgeon's cast elision made y = int(float(x) * 0.5) into x * int(0.5) = 0, and retyped a constant that
    a float Mul also read (onnxruntime then refused the graph)."""
    model = small_model([helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
                         helper.make_node("Mul", ["xf", "half"], ["hf"]),
                         helper.make_node("Cast", ["hf"], ["y"], to=TensorProto.INT64),
                         helper.make_node("Mul", ["f", "two"], ["g"]),
                         helper.make_node("Cast", ["x"], ["xf2"], to=TensorProto.FLOAT),
                         helper.make_node("Mul", ["xf2", "two"], ["df"]),
                         helper.make_node("Cast", ["df"], ["d"], to=TensorProto.INT64)],
                        [("x", TensorProto.INT64, [3]), ("f", TensorProto.FLOAT, [3])],
                        [("y", TensorProto.INT64, [3]), ("g", TensorProto.FLOAT, [3]), ("d", TensorProto.INT64, [3])],
                        [numpy_helper.from_array(np.array(0.5, np.float32), "half"),
                         numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    same_outputs(model, {"x": np.array([7, 8, 100], np.int64), "f": np.ones(3, np.float32)})


def test_shape_start_and_end_are_kept_when_folded():
    """Shape(x, start=1) of a static [2, 3, 4, 5] folded to the whole shape (and Shape(x, end=2) must fold to [2, 3])."""
    model = small_model([helper.make_node("Shape", ["x"], ["y"], start=1),
                         helper.make_node("Shape", ["x"], ["s"], start=1, end=3),
                         helper.make_node("Gather", ["s", "zero"], ["z"], axis=0),
                         helper.make_node("Shape", ["x"], ["w"], start=-1),
                         helper.make_node("Shape", ["x"], ["e"], end=2)],
                        [("x", TensorProto.FLOAT, [2, 3, 4, 5])],
                        [("y", TensorProto.INT64, [3]), ("z", TensorProto.INT64, []), ("w", TensorProto.INT64, [1]),
                         ("e", TensorProto.INT64, [2])],
                        [numpy_helper.from_array(np.array(0, np.int64), "zero")])
    cleaned, _ = cleanup.run(model, cleanup.Options())
    assert len(cleaned.graph.node) == 0  # all static: folded
    same_outputs(model, {"x": np.zeros((2, 3, 4, 5), np.float32)})


def test_constant_value_floats_fold_to_float32():
    """graphsurgeon read value_float[s] as float64: the folded initializers were DOUBLE beside a float Mul."""
    model = small_model([helper.make_node("Constant", [], ["c"], value_float=2.0),
                         helper.make_node("Constant", [], ["d"], value_floats=[1.0, 2.0]),
                         helper.make_node("Mul", ["x", "c"], ["xc"]), helper.make_node("Add", ["xc", "d"], ["y"])],
                        [("x", TensorProto.FLOAT, [2])], [("y", TensorProto.FLOAT, [2])])
    cleaned, _ = cleanup.run(model, cleanup.Options())
    assert {tensor.data_type for tensor in cleaned.graph.initializer} == {TensorProto.FLOAT}
    same_outputs(model, {"x": np.ones(2, np.float32)})


def test_unnamed_shape_ranges_of_dynamic_tensors_and_in_branches_keep_their_meaning():
    """The Slices replacing Shape(start, end) were all named "_range" for unnamed Shapes (onnxruntime refused the
    graph once they stayed, over a dynamic input), and Shapes inside an If branch still folded to the whole shape."""
    cases = [dict(start=-3, end=-1), dict(start=1, end=100), dict(start=3, end=1)]
    model = small_model([helper.make_node("Shape", ["x"], [f"s{i}"], **bounds) for i, bounds in enumerate(cases)],
                        [("x", TensorProto.FLOAT, ["a", 3, "b", 5])], [(f"s{i}", TensorProto.INT64, None)
                                                                       for i in range(len(cases))])
    same_outputs(model, {"x": np.zeros((2, 3, 4, 5), np.float32)})
    then = helper.make_graph([helper.make_node("Shape", ["x"], ["t"], start=1)], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.INT64, None)])
    other = helper.make_graph([helper.make_node("Shape", ["x"], ["e"], start=2)], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.INT64, None)])
    branches = small_model([helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
                           [("x", TensorProto.FLOAT, [2, 3, 4, 5]), ("cond", TensorProto.BOOL, [])],
                           [("y", TensorProto.INT64, None)])
    same_outputs(branches, {"x": np.zeros((2, 3, 4, 5), np.float32), "cond": np.array(True)})


@pytest.mark.parametrize("half", ["initializer", "constant_node"])
def test_cast_elision_is_kept_off_a_fractional_constant_however_it_is_given(half):
    """The guard looked at initializers only: a Constant node's 0.5 still turned int(float(x) * 0.5) into 0."""
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xf", "half"], ["hf"]),
             helper.make_node("Cast", ["hf"], ["y"], to=TensorProto.INT64)]
    initializers = [numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    if half == "constant_node":
        nodes.insert(0, helper.make_node("Constant", [], ["half"], value_float=0.5))
        initializers = []
    model = small_model(nodes, [("x", TensorProto.INT64, [3])], [("y", TensorProto.INT64, [3])], initializers)
    same_outputs(model, {"x": np.array([7, 8, 100], np.int64)})


def test_export_like_gives_an_unused_overridable_default_its_value_back():
    """A pass whose graphsurgeon cleanup dropped an unused default's initializer dropped its input too (the build
    then failed: "changed the graph's inputs"), or, before that, left the input without its default."""
    from passes import fuse_silu

    model = small_model([helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])],
                        [("x", TensorProto.FLOAT, [2]), ("unused", TensorProto.FLOAT, [2])],
                        [("y", TensorProto.FLOAT, [2])], [numpy_helper.from_array(np.ones(2, np.float32), "unused")])
    fused, _ = fuse_silu.run(model, fuse_silu.Options())
    assert [value.name for value in fused.graph.input] == ["x", "unused"]
    assert "unused" in {tensor.name for tensor in fused.graph.initializer}
    np.testing.assert_allclose(run_ort(fused, {"x": np.ones(2, np.float32)})[0], run_ort(model, {"x": np.ones(2, np.float32)})[0])


def test_constants_with_equal_bytes_but_other_types_are_not_merged():
    """int32 0 and float32 0.0 have the same four bytes: merged, one reader would get the other's type (a graph
    onnxruntime refuses)."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "zero_float"], ["y"]), helper.make_node("Add", ["n", "zero_int"], ["m"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("n", TensorProto.INT32, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("m", TensorProto.INT32, [2])],
        [numpy_helper.from_array(np.zeros(1, np.float32), "zero_float"),
         numpy_helper.from_array(np.zeros(1, np.int32), "zero_int")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    cleaned, report = cleanup.run(model, cleanup.Options())
    assert report["initializers_deduplicated"] == 0
    feeds = {"x": np.array([1.5, 2.5], np.float32), "n": np.array([3, 4], np.int32)}
    for got, expected in zip(run_ort(cleaned, feeds), run_ort(model, feeds)):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("given_as", ["initializer", "constant_node"])
def test_casts_around_a_whole_constant_are_elided_and_no_guard_is_left(given_as):
    """int(float(x) * 2) is x * 2 in int64 (graphsurgeon's cast elision, exact for a whole constant however it is
    given); around a fractional constant the Casts stay, and the Identity guarding them goes again."""
    def model(factor: float) -> onnx.ModelProto:
        nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
                 helper.make_node("Mul", ["xf", "factor"], ["product"]),
                 helper.make_node("Cast", ["product"], ["y"], to=TensorProto.INT64)]
        initializers = [numpy_helper.from_array(np.array(factor, np.float32), "factor")]
        if given_as == "constant_node":
            nodes.insert(0, helper.make_node("Constant", [], ["factor"], value_float=factor))
            initializers = []
        return small_model(nodes, [("x", TensorProto.INT64, [3])], [("y", TensorProto.INT64, [3])], initializers)

    feeds = {"x": np.array([7, 8, 100], np.int64)}
    whole, _ = cleanup.run(model(2.0), cleanup.Options())
    assert op_counts(whole) == Counter(Mul=1)
    np.testing.assert_array_equal(run_ort(whole, feeds)[0], [14, 16, 200])
    fractional, report = cleanup.run(model(0.5), cleanup.Options())
    assert op_counts(fractional) == Counter(Cast=2, Mul=1)
    assert report["nodes_folded"] == (1 if given_as == "constant_node" else 0)  # the Constant; the guard is not counted
    np.testing.assert_array_equal(run_ort(fractional, feeds)[0], [3, 4, 50])


def test_int_arithmetic_in_float_of_constants_alone_folds_whole():
    """int(float(n) * 0.5) + x, n an initializer: the Casts are guarded (0.5 is not whole), and the guarded chain,
    all constant, still folds to one initializer [3, 4, 50]."""
    model = small_model([helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
                         helper.make_node("Mul", ["nf", "half"], ["hf"]),
                         helper.make_node("Cast", ["hf"], ["h"], to=TensorProto.INT64),
                         helper.make_node("Add", ["x", "h"], ["y"])],
                        [("x", TensorProto.INT64, [3])], [("y", TensorProto.INT64, [3])],
                        [numpy_helper.from_array(np.array([7, 8, 100], np.int64), "n"),
                         numpy_helper.from_array(np.array(0.5, np.float32), "half")])
    cleaned, report = cleanup.run(model, cleanup.Options())
    assert op_counts(cleaned) == Counter(Add=1) and report["nodes_folded"] == 3
    assert [numpy_helper.to_array(t).tolist() for t in cleaned.graph.initializer] == [[3, 4, 50]]
    np.testing.assert_array_equal(run_ort(cleaned, {"x": np.zeros(3, np.int64)})[0], [3, 4, 50])


def test_nodes_of_the_ai_onnx_domain_are_folded_like_the_default_domain():
    """"ai.onnx" is the standard domain's other name: its constant nodes fold (onnxruntime runs them)."""
    model = small_model([helper.make_node("Add", ["a", "b"], ["sum"], domain="ai.onnx"),
                         helper.make_node("Mul", ["x", "sum"], ["y"])],
                        [("x", TensorProto.FLOAT, [2])], [("y", TensorProto.FLOAT, [2])],
                        [numpy_helper.from_array(np.ones(2, np.float32), "a"),
                         numpy_helper.from_array(np.full(2, 2.0, np.float32), "b")])
    model.opset_import.append(helper.make_opsetid("ai.onnx", 21))
    cleaned, report = cleanup.run(model, cleanup.Options())
    assert op_counts(cleaned) == Counter(Mul=1) and report["nodes_folded"] == 1
    np.testing.assert_array_equal(run_ort(cleaned, {"x": np.ones(2, np.float32)})[0], [3, 3])


def test_tensor_nbytes_counts_packed_sub_byte_and_string_data():
    int4 = helper.make_tensor("codes", TensorProto.INT4, [5], [1, 2, 3, 4, 5])  # 5 nibbles: 3 bytes
    uint4 = helper.make_tensor("ucodes", TensorProto.UINT4, [2, 3], list(range(6)))  # 6 nibbles: 3 bytes
    words = helper.make_tensor("words", TensorProto.STRING, [2], [b"abc", b"de"])
    assert [cleanup.tensor_nbytes(t) for t in (int4, uint4, words)] == [3, 3, 5]
    assert cleanup.tensor_nbytes(numpy_helper.from_array(np.zeros((3, 4), np.float16), "h")) == 24


def test_shape_inference_reads_small_initializers_such_as_a_reshape_target():
    model = small_model([helper.make_node("Reshape", ["x", "target"], ["grid"]),
                         helper.make_node("Relu", ["grid"], ["y"])],
                        [("x", TensorProto.FLOAT, [6])], [("y", TensorProto.FLOAT, None)],
                        [numpy_helper.from_array(np.array([2, 3], np.int64), "target")])
    cleaned, _ = cleanup.run(model, cleanup.Options())
    shapes = {value.name: [dim.dim_value for dim in value.type.tensor_type.shape.dim]
              for value in cleaned.graph.value_info}
    assert shapes["grid"] == [2, 3]


@pytest.mark.parametrize("elements, folded", [((1 << 20) // 4, True), ((1 << 20) // 4 + 1, False)])
def test_the_default_size_threshold_folds_results_up_to_one_mebibyte(elements, folded):
    model = small_model([helper.make_node("Expand", ["scalar", "shape"], ["wide"]),
                         helper.make_node("Add", ["x", "wide"], ["y"])],
                        [("x", TensorProto.FLOAT, [elements])], [("y", TensorProto.FLOAT, [elements])],
                        [numpy_helper.from_array(np.array([0.5], np.float32), "scalar"),
                         numpy_helper.from_array(np.array([elements], np.int64), "shape")])
    cleaned, _ = cleanup.run(model, cleanup.Options())
    assert op_counts(cleaned)["Expand"] == (0 if folded else 1)


def test_the_shape_of_a_computed_tensor_folds_from_inferred_shapes():
    """Shape(Relu(x)) with x static: the model gives no shape for Relu's output; inference does, and folding uses it."""
    model = small_model([helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Shape", ["h"], ["s"]),
                         helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
                         helper.make_node("Add", ["h", "sf"], ["y"])],
                        [("x", TensorProto.FLOAT, [2])], [("y", TensorProto.FLOAT, [2])])
    cleaned, _ = cleanup.run(model, cleanup.Options())
    assert op_counts(cleaned) == Counter(Relu=1, Add=1)
    np.testing.assert_array_equal(run_ort(cleaned, {"x": np.array([-1.0, 1.0], np.float32)})[0], [2, 3])


def test_without_any_initializers_copies_every_other_field_even_those_set_to_zero():
    model = make_model()
    model.model_version = 0  # set, though to the default: still a field the copy must hold
    model.graph.doc_string = ""
    copy = cleanup.without_any_initializers(model)
    expected = onnx.ModelProto()
    expected.CopyFrom(model)
    del expected.graph.initializer[:]
    assert copy.HasField("model_version") and copy.graph.HasField("doc_string")
    assert copy.SerializeToString() == expected.SerializeToString()


def test_constants_and_int_arithmetic_inside_branches_keep_their_meaning():
    """Inside an If branch as outside: Constant(value_float) folds to float32 (not float64 beside a float Mul), and
    int(float(x) * 0.5) is not elided into x * int(0.5)."""
    then = helper.make_graph([helper.make_node("Constant", [], ["two"], value_float=2.0),
                              helper.make_node("Mul", ["f", "two"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
                               helper.make_node("Mul", ["xf", "half"], ["hf"]),
                               helper.make_node("Cast", ["hf"], ["hi"], to=TensorProto.INT64),
                               helper.make_node("Cast", ["hi"], ["e"], to=TensorProto.FLOAT)], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    model = small_model([helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
                        [("x", TensorProto.INT64, [3]), ("f", TensorProto.FLOAT, [3]), ("cond", TensorProto.BOOL, [])],
                        [("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(np.array(0.5, np.float32), "half")])
    for cond in (True, False):
        same_outputs(model, {"x": np.array([7, 8, 100], np.int64), "f": np.ones(3, np.float32), "cond": np.array(cond)})


def test_a_constant_subgraph_onnxruntime_cannot_evaluate_folds_nothing_and_says_why():
    """bfloat16 Add has no onnxruntime CPU kernel (TensorRT runs it): nothing is folded, not even the Shape of a
    static input or the Casts around int(float(n) * 2), which graphsurgeon edits before it evaluates, and the report
    says why."""
    nodes = [helper.make_node("Add", ["a", "a"], ["sum"]),
             helper.make_node("Cast", ["sum"], ["sf"], to=TensorProto.FLOAT),
             helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Reshape", ["sf", "shape"], ["r"]),
             helper.make_node("Mul", ["x", "r"], ["y"]), helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["nf", "two"], ["doubled"]),
             helper.make_node("Cast", ["doubled"], ["m"], to=TensorProto.INT64)]
    model = small_model(nodes, [("x", TensorProto.FLOAT, [2]), ("n", TensorProto.INT64, [2])],
                        [("y", TensorProto.FLOAT, [2]), ("m", TensorProto.INT64, [2])],
                        [helper.make_tensor("a", TensorProto.BFLOAT16, [2], [1.0, 2.0]),
                         numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    cleaned, report = cleanup.run(model, cleanup.Options())
    assert report["fold_skipped"].startswith("onnxruntime could not evaluate the constant subgraph: ")
    assert "Add" in report["fold_skipped"]
    assert op_counts(cleaned) == op_counts(model) and report["nodes_folded"] == 0
    assert sorted(node.output[0] for node in cleaned.graph.node) == sorted(node.output[0] for node in model.graph.node)


def test_constants_with_equal_bytes_but_other_shapes_are_not_merged():
    """[2, 3] and [3, 2] of the same six values: merged, the [3, 2] reader would get a [2, 3] tensor."""
    values = np.arange(6, dtype=np.float32)
    model = small_model([helper.make_node("Add", ["x", "wide"], ["y"]), helper.make_node("Add", ["t", "tall"], ["z"])],
                        [("x", TensorProto.FLOAT, [2, 3]), ("t", TensorProto.FLOAT, [3, 2])],
                        [("y", TensorProto.FLOAT, [2, 3]), ("z", TensorProto.FLOAT, [3, 2])],
                        [numpy_helper.from_array(values.reshape(2, 3), "wide"),
                         numpy_helper.from_array(values.reshape(3, 2), "tall")])
    cleaned, report = cleanup.run(model, cleanup.Options())
    assert report["initializers_deduplicated"] == 0
    assert {tensor.name: list(tensor.dims) for tensor in cleaned.graph.initializer} == {"wide": [2, 3], "tall": [3, 2]}
    same_outputs(model, {"x": np.zeros((2, 3), np.float32), "t": np.zeros((3, 2), np.float32)})


def test_initializers_stored_as_typed_values_are_compared_by_value():
    """Tensors written with float_data (not raw_data) hold no raw bytes: hashing those alone merged every pair of one
    shape, whatever its values."""
    model = small_model([helper.make_node("Add", ["x", name], [out])
                         for name, out in (("first", "y"), ("second", "z"), ("third", "w"))],
                        [("x", TensorProto.FLOAT, [2])],
                        [("y", TensorProto.FLOAT, [2]), ("z", TensorProto.FLOAT, [2]), ("w", TensorProto.FLOAT, [2])],
                        [helper.make_tensor("first", TensorProto.FLOAT, [2], [1.0, 2.0]),
                         helper.make_tensor("second", TensorProto.FLOAT, [2], [3.0, 4.0]),
                         helper.make_tensor("third", TensorProto.FLOAT, [2], [1.0, 2.0])])
    cleaned, report = cleanup.run(model, cleanup.Options())
    assert report["initializers_deduplicated"] == 1
    assert sorted(tensor.name for tensor in cleaned.graph.initializer) == ["first", "second"]
    same_outputs(model, {"x": np.zeros(2, np.float32)})


def test_export_like_keeps_one_copy_of_a_default_that_is_still_read():
    from passes import fuse_silu

    model = small_model([helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["m"]),
                         helper.make_node("Add", ["m", "bias"], ["y"])],
                        [("x", TensorProto.FLOAT, [2]), ("bias", TensorProto.FLOAT, [2])],
                        [("y", TensorProto.FLOAT, [2])], [numpy_helper.from_array(np.ones(2, np.float32), "bias")])
    fused, _ = fuse_silu.run(model, fuse_silu.Options())
    assert [tensor.name for tensor in fused.graph.initializer] == ["bias"]
    feeds = {"x": np.ones(2, np.float32)}
    np.testing.assert_allclose(run_ort(fused, feeds)[0], run_ort(model, feeds)[0])


def test_the_models_own_fields_are_kept():
    model = make_model()
    model.doc_string, model.domain, model.model_version = "a tiny test model", "org.example", 7
    onnx.helper.set_model_props(model, {"source": "test_cleanup"})
    cleaned, _ = cleanup.run(model, cleanup.Options())
    assert (cleaned.doc_string, cleaned.domain, cleaned.model_version) == ("a tiny test model", "org.example", 7)
    assert {prop.key: prop.value for prop in cleaned.metadata_props} == {"source": "test_cleanup"}


def test_the_report_names_custom_ops_by_domain():
    nodes = [helper.make_node("FlashAttention", ["x"], ["dead"], domain="aotlm"),
             helper.make_node("Relu", ["x"], ["y"])]
    model = small_model(nodes, [("x", TensorProto.FLOAT, [2])], [("y", TensorProto.FLOAT, [2])])
    model.opset_import.append(helper.make_opsetid("aotlm", 1))
    _, report = cleanup.run(model, cleanup.Options())
    assert report["ops_changed"] == {"aotlm.FlashAttention": {"before": 1, "after": 0}}


def test_a_folded_output_equal_to_an_initializer_is_kept_and_not_counted_as_deduplicated():
    """y = a + b folds to the constant [3, 3], equal to initializer c: a graph output keeps its own name and tensor,
    so it is not one of the initializers deduplicated (the count said 1, and nothing had gone)."""
    model = small_model([helper.make_node("Add", ["a", "b"], ["y"]), helper.make_node("Mul", ["x", "c"], ["z"])],
                        [("x", TensorProto.FLOAT, [2])], [("y", TensorProto.FLOAT, [2]), ("z", TensorProto.FLOAT, [2])],
                        [numpy_helper.from_array(np.ones(2, np.float32), "a"),
                         numpy_helper.from_array(np.full(2, 2.0, np.float32), "b"),
                         numpy_helper.from_array(np.full(2, 3.0, np.float32), "c")])
    cleaned, report = cleanup.run(model, cleanup.Options())
    assert report["initializers_deduplicated"] == 0 and report["outputs"] == ["y", "z"]
    assert sorted(tensor.name for tensor in cleaned.graph.initializer) == ["c", "y"]
    same_outputs(model, {"x": np.ones(2, np.float32)})


def test_external_weights_are_neither_read_nor_merged(tmp_path):
    """Two equal weights stored as external data (not loaded): their bytes are not at hand, so they are not compared
    (loading them to hash would read every weight file); both stay, still pointing into the data file."""
    weight = np.arange(6, dtype=np.float32)
    model = small_model([helper.make_node("Add", ["x", "first"], ["y"]), helper.make_node("Mul", ["x", "second"], ["z"])],
                        [("x", TensorProto.FLOAT, [6])], [("y", TensorProto.FLOAT, [6]), ("z", TensorProto.FLOAT, [6])],
                        [numpy_helper.from_array(weight, "first"), numpy_helper.from_array(weight.copy(), "second")])
    onnx.save_model(model, tmp_path / "model.onnx", save_as_external_data=True, location="weights.bin",
                    size_threshold=0)
    cleaned, report = cleanup.run(onnx.load(tmp_path / "model.onnx", load_external_data=False), cleanup.Options())
    assert report["initializers_deduplicated"] == 0
    assert {tensor.name: (tensor.data_location, {e.key: e.value for e in tensor.external_data}["offset"])
            for tensor in cleaned.graph.initializer} == {"first": (TensorProto.EXTERNAL, "0"),
                                                         "second": (TensorProto.EXTERNAL, "24")}
    onnx.save_model(cleaned, tmp_path / "cleaned.onnx")
    session = ort.InferenceSession(str(tmp_path / "cleaned.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": np.ones(6, np.float32)})
    np.testing.assert_array_equal(got[0], weight + 1)
    np.testing.assert_array_equal(got[1], weight)


def test_an_input_the_export_lost_is_put_back_and_a_lost_output_is_refused(monkeypatch):
    """After the export, every graph input is put back in its place (graphsurgeon drops some); an output the export
    lost (a bug in the pass, never the model's) raises with the names before and after, rather than handing on a
    graph whose outputs the runtime would read wrongly."""
    export = cleanup._export
    lose = {"what": "input"}

    def losing_the_first(graph, original):
        result = export(graph, original)
        del getattr(result.graph, lose["what"])[0]
        return result

    monkeypatch.setattr(cleanup, "_export", losing_the_first)
    cleaned, report = cleanup.run(make_model(), cleanup.Options())
    assert [value.name for value in cleaned.graph.input] == report["inputs"] == ["x", "past_key"]
    assert cleaned.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    lose["what"] = "output"
    with pytest.raises(RuntimeError, match=r"cleanup changed the graph outputs: \['y', 'z'\] -> \['z'\]"):
        cleanup.run(make_model(), cleanup.Options())


def test_a_constant_inside_a_branch_is_folded_without_touching_the_callers_model():
    """A Constant node's tensor inside an If branch: folded, it becomes a tensor that points at the attribute, and
    export renames it; without its own copy, that renamed the tensor in the caller's model."""
    then = helper.make_graph([helper.make_node("Constant", [], ["two"],
                                               value=numpy_helper.from_array(np.full(3, 2.0, np.float32), "stored")),
                              helper.make_node("Mul", ["f", "two"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["f"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    model = small_model([helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
                        [("f", TensorProto.FLOAT, [3]), ("cond", TensorProto.BOOL, [])], [("y", TensorProto.FLOAT, None)])
    before = model.SerializeToString()
    cleaned, _ = cleanup.run(model, cleanup.Options())
    assert model.SerializeToString() == before
    feeds = {"f": np.ones(3, np.float32), "cond": np.array(True)}
    np.testing.assert_array_equal(run_ort(cleaned, feeds)[0], [2, 2, 2])


def test_weights_equal_at_both_ends_but_not_between_are_not_merged_and_equal_ones_are():
    """deduplicate_initializers compares a sample of each weight's bytes (its start and end) before hashing it whole:
    weights whose samples match but whose middles differ stay apart; equal ones still go to the first of them."""
    size = 4 * cleanup.DIGEST_SAMPLE_BYTES  # float32: the sample covers half of each weight
    base = np.arange(size, dtype=np.float32)
    middle = base.copy()
    middle[size // 2] = -1.0  # outside both ends' samples
    weights = {"w0": base, "w1": middle, "w2": base.copy(), "w3": middle.copy()}
    names = list(weights)
    nodes = [helper.make_node("Add", ["x", name], [f"y_{name}"]) for name in names]
    model = small_model(nodes, [("x", TensorProto.FLOAT, [size])], [(f"y_{n}", TensorProto.FLOAT, [size]) for n in names],
                        [numpy_helper.from_array(array, name) for name, array in weights.items()])
    cleaned, report = cleanup.run(model, cleanup.Options())
    assert report["initializers_deduplicated"] == 2
    assert sorted(tensor.name for tensor in cleaned.graph.initializer) == ["w0", "w1"]
    readers = {node.output[0]: node.input[1] for node in cleaned.graph.node}
    assert readers == {"y_w0": "w0", "y_w1": "w1", "y_w2": "w0", "y_w3": "w1"}
    same_outputs(model, {"x": np.ones(size, np.float32)})


def test_a_bfloat16_constant_is_not_read_to_decide_cast_elision(capsys):
    """graphsurgeon casts a bfloat16 constant's values to read them, and said for every weight of a bfloat16 build
    that they "will have a different type" (124 times for SmolLM2, none true): its Casts are guarded unread."""
    import ml_dtypes

    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
             helper.make_node("Mul", ["xb", "factor"], ["product"]),
             helper.make_node("Cast", ["product"], ["y"], to=TensorProto.INT64)]
    factor = numpy_helper.from_array(np.array(2.0, ml_dtypes.bfloat16), "factor")
    model = small_model(nodes, [("x", TensorProto.INT64, [3])], [("y", TensorProto.INT64, [3])], [factor])
    cleaned, _ = cleanup.run(model, cleanup.Options())
    captured = capsys.readouterr()
    assert "casted" not in captured.out + captured.err, captured
    assert op_counts(cleaned) == Counter(Cast=2, Mul=1)  # guarded: the casts stay
    stored = next(t for t in cleaned.graph.initializer if t.name == "factor")
    assert stored.data_type == TensorProto.BFLOAT16


@pytest.mark.parametrize("usable", [0, 1])
def test_folding_sessions_use_the_cpus_the_process_may_use(monkeypatch, usable):
    """graphsurgeon opens its folding sessions without options: onnxruntime's default pool pinned workers to CPUs a
    container's cpuset forbids. Restricted (cpu_threads > 0), each session gets that thread count; else the default."""
    opened = []
    original = ort.InferenceSession

    def spy(model, sess_options=None, *args, **kwargs):
        opened.append(None if sess_options is None else sess_options.intra_op_num_threads)
        return original(model, sess_options, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    monkeypatch.setattr(cleanup, "cpu_threads", lambda: usable)
    cleaned, report = cleanup.run(make_model(), cleanup.Options())

    assert report["nodes_folded"] == 3 and opened  # folded, through sessions the spy saw
    assert opened == [usable or None] * len(opened)
    assert ort.InferenceSession is spy  # put back after the fold
