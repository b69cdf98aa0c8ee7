"""skip_unused_rows: the prefill graph's last layer runs its post-attention part on the selected rows only, and the
logits and the written cache stay the same (onnxruntime, right-padded batch of two, then decode steps)."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest

from compiler.errors import BuildError
from compiler.export import export_graphs
from compiler.frontend.model import build_decoder
from compiler.frontend.random_init import random_model
from compiler.pipeline import check_passes
from compiler.recipe import PassSpec
from passes import (cleanup, fuse_attention, fuse_rms_norm, fuse_silu, lower_onnxruntime, pack_projections, quantize,
                    quantize_kv_cache, skip_unused_rows)
from tests.passes.test_fuse_attention import CONFIG, MAX_CONTEXT, decoder_graphs, generate_logits, op_counts  # noqa: F401

DEFAULT_RECIPE_PASSES = (fuse_attention, lower_onnxruntime, fuse_rms_norm, fuse_silu, pack_projections)
POST_ATTENTION = ["MatMul", "SkipSimplifiedLayerNormalization", "MatMul", "Split", "QuickGelu", "Mul", "MatMul", "Add"]


def run_passes(model: onnx.ModelProto, passes) -> onnx.ModelProto:
    for module in passes:
        model = module.run(model, module.Options())[0]
    return model


def skip(graphs: dict) -> tuple[dict, dict]:
    results = {phase: skip_unused_rows.run(model, skip_unused_rows.Options()) for phase, model in graphs.items()}
    return {p: r[0] for p, r in results.items()}, {p: r[1] for p, r in results.items()}


def assert_same_generation(before: dict, after: dict) -> None:
    for reference, result in zip(generate_logits(before), generate_logits(after)):
        np.testing.assert_allclose(result, reference, rtol=0, atol=1e-6)


def output_shape(model: onnx.ModelProto, tensor: str, length: int = 6) -> tuple:
    """Runs the prefill graph on a batch of two prompts of `length` tokens with `tensor` added as an output."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.helper.make_empty_tensor_value_info(tensor))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {"input_ids": np.ones((2, length), np.int64), "position_ids": np.tile(np.arange(length), (2, 1)),
            "attention_mask": np.ones((2, length), np.int64)}
    for value in session.get_inputs()[3:]:
        feed[value.name] = np.zeros((2, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), np.float32)
    return session.run([tensor], feed)[0].shape


def test_default_passes_then_skip_moves_the_last_layer_after_attention(decoder_graphs):  # noqa: F811
    graphs = {phase: run_passes(model, DEFAULT_RECIPE_PASSES) for phase, model in decoder_graphs.items()}
    skipped, reports = skip(graphs)
    report = reports["prefill"]
    assert report["applied"], report
    assert [m["op"] for m in report["moved"]] == POST_ATTENTION
    assert all("layers.1" in m["node"] for m in report["moved"])  # the last layer only
    assert report["frontier"][0] == "layers.1.attention_output"
    assert "layers.0" in report["frontier"][1]  # the residual stream coming out of layer 0
    # o_proj 64x64, gate/up 64x256, down 128x64: 2·K·N each
    assert report["flops_per_skipped_row"] == 2 * (64 * 64 + 64 * 256 + 128 * 64)
    before, after = op_counts(graphs["prefill"]), op_counts(skipped["prefill"])
    assert after["MatMul"] == before["MatMul"] and after["Gather"] == before["Gather"] + 1  # two selections, one gone
    assert after["Squeeze"] == before["Squeeze"] + 1 and after["Flatten"] == before["Flatten"] + 1
    # The moved products really see one row per sequence: [1, batch, N], where they saw [batch, sequence, N].
    down = next(m["node"] for m in report["moved"] if "down_proj" in m["node"])
    down_output = next(n.output[0] for n in skipped["prefill"].graph.node if n.name == down)
    assert output_shape(graphs["prefill"], down_output) == (2, 6, CONFIG.hidden_size)
    assert output_shape(skipped["prefill"], down_output) == (1, 2, CONFIG.hidden_size)
    assert not reports["decode"]["applied"] and "every position's logits" in reports["decode"]["reason"]
    assert skipped["decode"] is graphs["decode"]
    assert_same_generation(graphs, skipped)
    again, again_report = skip_unused_rows.run(skipped["prefill"], skip_unused_rows.Options())  # listed twice
    assert again is skipped["prefill"] and not again_report["applied"]
    assert again_report["reason"].startswith("the unused rows are skipped already (")  # not "... also read outside"


def test_unfused_graph_moves_its_norm_math_too(decoder_graphs):  # noqa: F811
    skipped, reports = skip(decoder_graphs)
    moved = [m["op"] for m in reports["prefill"]["moved"]]
    assert moved[:6] == ["MatMul", "Add", "Pow", "ReduceMean", "Add", "Sqrt"], moved  # o_proj, residual, RMSNorm
    assert moved.count("MatMul") == 4  # o_proj, gate, up, down
    assert_same_generation(decoder_graphs, skipped)


def test_int4_matmulnbits_graph_skips_and_generates_the_same(decoder_graphs):  # noqa: F811
    options = quantize.Options(bits=4, block_size=16)
    graphs = {phase: quantize.run(run_passes(model, DEFAULT_RECIPE_PASSES), options)[0]
              for phase, model in decoder_graphs.items()}
    skipped, reports = skip(graphs)
    moved = [m["op"] for m in reports["prefill"]["moved"]]
    assert moved.count("MatMulNBits") == 3, moved
    assert reports["prefill"]["flops_per_skipped_row"] == 2 * (64 * 64 + 64 * 256 + 128 * 64)
    assert_same_generation(graphs, skipped)


def test_prefill_with_every_positions_logits_is_left_alone():
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    prefill = cleanup.run(export_graphs(decoder, MAX_CONTEXT, prefill_logits="all")["prefill"], cleanup.Options())[0]
    result, report = skip_unused_rows.run(prefill, skip_unused_rows.Options())
    assert result is prefill and not report["applied"] and "every position's logits" in report["reason"]


def test_rows_mixed_along_the_sequence_stop_the_move_with_a_reason(decoder_graphs):  # noqa: F811
    """The last residual Add gets a term averaged over the sequence ([B, 1, H]): the selection cannot move above it
    (that tensor has no per-token rows), and the pass says so rather than selecting the wrong rows."""
    model = onnx.ModelProto()
    model.CopyFrom(run_passes(decoder_graphs["prefill"], DEFAULT_RECIPE_PASSES))
    flatten = next(n for n in model.graph.node if n.op_type == "Flatten")
    last = flatten.input[0]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "sequence_axis"))
    model.graph.node.extend([
        onnx.helper.make_node("ReduceMean", [last, "sequence_axis"], ["sequence_mean"], keepdims=1),
        onnx.helper.make_node("Add", [last, "sequence_mean"], ["mixed"])])
    for node in model.graph.node:
        if node.output[0] != "sequence_mean" and node.op_type in ("Flatten", "Shape") and node.input[0] == last:
            node.input[0] = "mixed"
    model = cleanup.run(model, cleanup.Options())[0]  # puts the new nodes in order and infers their shapes
    result, report = skip_unused_rows.run(model, skip_unused_rows.Options())
    assert not report["applied"] and "sequence_mean" in report["reason"], report
    assert result is model


def test_a_recipe_that_quantizes_after_skipping_is_refused():
    with pytest.raises(BuildError, match=r"passes\[1\] \(quantize\) comes after passes\[0\] \(skip_unused_rows\)"):
        check_passes([PassSpec("skip_unused_rows", skip_unused_rows.Options()),
                      PassSpec("quantize", quantize.Options())])


def test_a_graph_without_shapes_is_left_with_the_fix(decoder_graphs):  # noqa: F811
    model = onnx.ModelProto()
    model.CopyFrom(run_passes(decoder_graphs["prefill"], DEFAULT_RECIPE_PASSES))
    del model.graph.value_info[:]  # as before cleanup's shape inference
    result, report = skip_unused_rows.run(model, skip_unused_rows.Options())
    assert not report["applied"] and "run cleanup (shape inference)" in report["reason"], report
    assert result is model


def test_int8_kv_cache_graph_skips_and_generates_the_same():
    """After quantize_kv_cache the prefill graph writes int8 codes after its attention; the rows move above the
    attention's output as before, and logits and the int8 cache stay the same."""
    from tests.passes.test_quantize_kv_cache import calibration_set, run_steps

    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    options = quantize_kv_cache.Options(calibration=calibration_set())
    graphs = {phase: quantize_kv_cache.run(run_passes(cleanup.run(model, cleanup.Options())[0], DEFAULT_RECIPE_PASSES),
                                           options)[0]
              for phase, model in export_graphs(decoder, MAX_CONTEXT).items()}
    skipped, reports = skip(graphs)
    assert [m["op"] for m in reports["prefill"]["moved"]] == POST_ATTENTION
    logits_before, caches_before = run_steps(graphs, np.int8)
    logits_after, caches_after = run_steps(skipped, np.int8)
    for before, after in zip(logits_before + caches_before, logits_after + caches_after):
        np.testing.assert_array_equal(after, before)


# -- hand-built graphs: t = f(x, ...) [B, S, H], then the selection torch.onnx emits for x[arange(B), S - 1] --------
H = 4


def selection_model(nodes, initializers, inputs, shapes: dict) -> onnx.ModelProto:
    tail = [onnx.helper.make_node("Shape", ["t"], ["shape"]),
            onnx.helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
            onnx.helper.make_node("Gather", ["shape", "one"], ["sequence"], axis=0),
            onnx.helper.make_node("Range", ["zero", "batch", "one"], ["row_starts"]),
            onnx.helper.make_node("Mul", ["row_starts", "sequence"], ["flat_starts"]),
            onnx.helper.make_node("Sub", ["sequence", "one"], ["last"]),
            onnx.helper.make_node("Add", ["flat_starts", "last"], ["rows"]),
            onnx.helper.make_node("Flatten", ["t"], ["flat"], axis=2),
            onnx.helper.make_node("Gather", ["flat", "rows"], ["out"], axis=0)]
    constants = [onnx.numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("zero", 0), ("one", 1))]
    value = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(nodes + tail, "g", [value(n, onnx.TensorProto.FLOAT, s) for n, s in inputs],
                                   [value("out", onnx.TensorProto.FLOAT, None)], initializers + constants)
    graph.value_info.extend([value(n, onnx.TensorProto.FLOAT, s) for n, s in shapes.items()] +
                            [value("rows", onnx.TensorProto.INT64, ["rows"])])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17),
                                                        onnx.helper.make_opsetid("com.microsoft", 1)])


def weight(*shape) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal(shape).astype(np.float32), "W")


def test_a_hand_built_row_wise_graph_skips_and_computes_the_same():
    """The control for the refusals below: LayerNormalization over axis 2 (the last of 3), then a 2-D weight."""
    nodes = [onnx.helper.make_node("LayerNormalization", ["x", "gamma"], ["normed"], axis=2),
             onnx.helper.make_node("MatMul", ["normed", "W"], ["t"])]
    gamma = onnx.numpy_helper.from_array(np.full(H, 1.5, np.float32), "gamma")
    model = selection_model(nodes, [weight(H, H), gamma], [("x", ["batch", "sequence", H])],
                            {"normed": ["batch", "sequence", H], "t": ["batch", "sequence", H]})
    result, report = skip_unused_rows.run(model, skip_unused_rows.Options())
    assert report["applied"] and [m["op"] for m in report["moved"]] == ["LayerNormalization", "MatMul"], report
    x = {"x": np.random.default_rng(1).standard_normal((2, 3, H)).astype(np.float32)}
    outputs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]
               for m in (model, result)]
    np.testing.assert_array_equal(outputs[1], outputs[0])


@pytest.mark.parametrize("case, reason", [
    ("attention over a query averaged along the sequence", "a (where the selection would move to) is not known"),
    ("a weight batched as [2, K, N]", "a MatMul whose weight is not known to be 2-D"),
    ("a constant of unknown shape", "Add with a constant of rank > 1 or of unknown shape"),
    ("unknown batch and sequence dimensions", "run cleanup (shape inference) first"),
    ("a constant per position", "Add with a constant of rank > 1"),  # [S, H]: each row its own values
])
def test_graphs_whose_rows_cannot_be_proven_per_token_are_left_alone(case, reason):
    """Each of these once applied and then failed in onnxruntime or changed the output (a review's repros)."""
    known = ["batch", "sequence", H]
    if case.startswith("attention"):
        nodes = [onnx.helper.make_node("ReduceMean", ["x"], ["q"], axes=[1], keepdims=1),
                 onnx.helper.make_node("MultiHeadAttention", ["q", "x", "x"], ["a"], domain="com.microsoft",
                                       num_heads=1),
                 onnx.helper.make_node("Add", ["x", "a"], ["y"]), onnx.helper.make_node("MatMul", ["y", "W"], ["t"])]
        model = selection_model(nodes, [weight(H, H)], [("x", known)], {"y": known, "t": known})
    elif case.startswith("a weight"):
        model = selection_model([onnx.helper.make_node("MatMul", ["x", "W"], ["t"])], [weight(2, H, H)],
                                [("x", [2, "sequence", H])], {"t": [2, "sequence", H]})
    elif case == "a constant per position":
        model = selection_model([onnx.helper.make_node("Add", ["x", "W"], ["t"])], [weight(3, H)],
                                [("x", ["batch", 3, H])], {"t": ["batch", 3, H]})
    elif case == "a constant of unknown shape":
        nodes = [onnx.helper.make_node("Identity", ["W"], ["c"]), onnx.helper.make_node("Add", ["x", "c"], ["t"])]
        model = selection_model(nodes, [weight(1, 3, H)], [("x", ["batch", 3, H])], {"t": ["batch", 3, H]})
    else:
        nodes = [onnx.helper.make_node("Add", ["x", "y"], ["s"]), onnx.helper.make_node("MatMul", ["s", "W"], ["t"])]
        unknown = [None, None, H]
        model = selection_model(nodes, [weight(H, H)], [("x", unknown), ("y", unknown)], {"s": unknown, "t": unknown})
    result, report = skip_unused_rows.run(model, skip_unused_rows.Options())
    assert not report["applied"] and reason in report["reason"], report
    assert result is model


def test_a_norm_over_the_sequence_stays_before_the_selection():
    """LayerNormalization over axis 1 mixes the positions: the selection may move above the MatMul after it, not
    above the norm (which, moved, would normalize the last row alone)."""
    nodes = [onnx.helper.make_node("LayerNormalization", ["x", "gamma"], ["normed"], axis=1),
             onnx.helper.make_node("MatMul", ["normed", "W"], ["t"])]
    gamma = onnx.numpy_helper.from_array(np.ones((3, H), np.float32), "gamma")
    model = selection_model(nodes, [weight(H, H), gamma], [("x", ["batch", 3, H])],
                            {"normed": ["batch", 3, H], "t": ["batch", 3, H]})
    result, report = skip_unused_rows.run(model, skip_unused_rows.Options())
    assert [m["op"] for m in report["moved"]] == ["MatMul"] and report["frontier"] == ["normed"], report
    x = {"x": np.random.default_rng(1).standard_normal((2, 3, H)).astype(np.float32)}
    outputs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]
               for m in (model, result)]
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-6, atol=1e-6)


def wide_projection(*extra_nodes, outputs=()) -> onnx.ModelProto:
    """t = x @ W [H, 2H]: t is wider than x, where the selection would move to, so whatever reads t's third dimension
    would read x's instead. `extra_nodes` are added, `outputs` (name, type, shape) become graph outputs too."""
    known = ["batch", "sequence", H]
    nodes = [onnx.helper.make_node("MatMul", ["x", "W"], ["t"]), *extra_nodes]
    model = selection_model(nodes, [weight(H, 2 * H)], [("x", known)], {"t": ["batch", "sequence", 2 * H]})
    model.graph.output.extend(onnx.helper.make_tensor_value_info(*output) for output in outputs)
    return model


def width_read_from_shape(start: int, index: int) -> onnx.ModelProto:
    """A Shape of t read beyond its batch and sequence: dimension 2, as Gather(Shape(t, start), index)."""
    model = wide_projection(onnx.helper.make_node("Shape", ["t"], ["t_shape"], start=start),
                            onnx.helper.make_node("Gather", ["t_shape", "index"], ["width"]),
                            outputs=[("width", onnx.TensorProto.INT64, [])])
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(index, np.int64), "index"))
    return model


def flatten_over_axis_1() -> onnx.ModelProto:
    """Flatten(t, axis 1) [B, S·2H] gathered by batch: every position of each sequence, not one row per sequence."""
    model = wide_projection()
    flatten = next(node for node in model.graph.node if node.op_type == "Flatten")
    flatten.attribute[0].i = 1
    rows = next(node for node in model.graph.node if node.output[0] == "rows")
    rows.CopyFrom(onnx.helper.make_node("Identity", ["row_starts"], ["rows"]))
    return model


def reduction_without_keepdims() -> onnx.ModelProto:
    """x [1, 4, 4] times its mean over the last axis without keepdims ([1, 4], which broadcasts as [1, 1, 4]): each
    position is scaled by every position's mean, so the mean is no per-token row."""
    shape = [1, 4, H]
    nodes = [onnx.helper.make_node("ReduceMean", ["x"], ["r"], axes=[-1], keepdims=0),
             onnx.helper.make_node("Mul", ["x", "r"], ["t"])]
    return selection_model(nodes, [], [("x", shape)], {"r": [1, 4], "t": shape})


def mean_over_the_sequence() -> onnx.ModelProto:
    """x plus its mean over the sequence (keepdims: [B, 1, H]): every row depends on every position."""
    shape = ["batch", 3, H]
    nodes = [onnx.helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=1),
             onnx.helper.make_node("Add", ["x", "m"], ["t"])]
    return selection_model(nodes, [], [("x", shape)], {"m": ["batch", 1, H], "t": shape})


@pytest.mark.parametrize("make_model, reason", [
    (lambda: width_read_from_shape(start=0, index=2), "the row indices read more of t's shape"),
    (lambda: width_read_from_shape(start=1, index=1), "the row indices read more of t's shape"),  # [S, 2H][1]
    (flatten_over_axis_1, "no row selection (Gather of Flatten(t, axis 2))"),
    # The flattened rows are a graph output too: the pass applied (it counted only reader nodes), and that output
    # came back with B rows for B·S.
    (lambda: wide_projection(outputs=[("flat", onnx.TensorProto.FLOAT, None)]), "flat, every row of t, is a graph output"),
    (lambda: wide_projection(onnx.helper.make_node("Identity", ["flat"], ["flat_copy"]),
                             outputs=[("flat_copy", onnx.TensorProto.FLOAT, None)]),
     "t is read by more than the selection and Shape nodes"),
    (reduction_without_keepdims, "r (where the selection would move to) is not known"),
    (mean_over_the_sequence, "m (where the selection would move to) is not known"),
], ids=["shape_dim_2", "shape_from_the_sequence", "flatten_over_axis_1", "flattened_rows_a_graph_output",
        "flattened_rows_read_by_another_node",
        "reduction_without_keepdims", "mean_over_the_sequence"])
def test_selections_that_cannot_move_are_refused_with_the_reason(make_model, reason):
    """Each is refused by one check that a mutation audit found no test for: without it the pass applies, and the
    moved graph reads x's width for t's, gathers rows of a batch-flattened tensor, changes a graph output's shape, or
    selects rows before a reduction that mixes them."""
    model = make_model()
    result, report = skip_unused_rows.run(model, skip_unused_rows.Options())
    assert not report["applied"] and reason in report["reason"], report
    assert result is model


def flatten_gather_graph(source_shape, logits_shape) -> gs.Graph:
    """Flatten(x, axis -1) gathered on axis 0 (transformers' mask code indexes attention_mask [B, S] so), and a
    logits output of the given shape computed beside it."""
    x = gs.Variable("x", np.float32, source_shape)
    flat, picked = gs.Variable("flat", np.float32, None), gs.Variable("picked", np.float32, None)
    logits = gs.Variable("logits", np.float32, logits_shape)
    h = gs.Variable("h", np.float32, logits_shape)
    nodes = [gs.Node("Flatten", inputs=[x], outputs=[flat], attrs={"axis": -1}),
             gs.Node("Gather", inputs=[flat, gs.Constant("rows", np.array([0], np.int64))], outputs=[picked],
                     attrs={"axis": 0}),
             gs.Node("Relu", inputs=[h], outputs=[logits])]
    return gs.Graph(nodes=nodes, inputs=[x, h], outputs=[logits, picked])


@pytest.mark.parametrize("source_shape, logits_shape, reason", [
    # a known 2-D source is no selection of positions: it was "no known 3-D shape; run cleanup" after cleanup ran
    (["batch", "sequence"], ["batch", "sequence", 8], "no row selection (Gather of Flatten(t, axis 2)): the graph "
                                                      "returns every position's logits"),
    (None, ["batch", "sequence", 8], "has no known shape; run cleanup (shape inference) before this pass"),
    # dynamo's last-valid-token GatherND returns one position: not "every position's logits"
    (["batch", "sequence"], ["batch", 1, 8], "the graph returns one position's logits, selected in a way this pass "
                                             "does not read"),
], ids=["known_2d_source", "unknown_rank", "one_position_selected_otherwise"])
def test_no_selection_is_said_as_what_the_graph_does(source_shape, logits_shape, reason):
    found = skip_unused_rows.find_selection(flatten_gather_graph(source_shape, logits_shape))
    assert isinstance(found, str) and reason in found, found
