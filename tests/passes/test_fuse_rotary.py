"""fuse_rotary: RotaryEmbedding counts, the skip report, and onnxruntime parity with the unfused graphs.

Graphs: the canonical decoder's prefill/decode export (position_ids is a graph input), and Hugging Face's
traced Llama (positions computed inside the graph, batch 1, no cache) for the fallback paths.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from passes import fuse_rotary
from tests.passes.test_fuse_attention import (CONFIG, MAX_CONTEXT, decoder_graphs, generate_logits, hf_traced,  # noqa: F401 (fixtures)
                                              op_counts, rotary_table_shape)

ROTARIES = 2 * CONFIG.num_layers  # q and k in every layer


def test_every_rotary_becomes_one_rotary_embedding(decoder_graphs):  # noqa: F811
    fused = {}
    for phase, model in decoder_graphs.items():
        fused[phase], report = fuse_rotary.run(model, fuse_rotary.Options())
        assert report["rewrites"] == ROTARIES and report["skipped"] == [], (phase, report)
        counts = op_counts(fused[phase])
        assert counts["RotaryEmbedding"] == ROTARIES
        # The Cos/Sin tables were read only by the rotaries, so they go with them; no Neg anywhere else.
        assert counts["Neg"] == counts["Cos"] == counts["Sin"] == 0, (phase, counts)
        for node in (n for n in fused[phase].graph.node if n.op_type == "RotaryEmbedding"):  # a row per position
            assert rotary_table_shape(fused[phase], node.input[1]) == [MAX_CONTEXT, CONFIG.head_dim // 2]
        assert report["nodes"]["after"] < report["nodes"]["before"]
        assert fused[phase].ir_version >= 10 and {o.domain: o.version for o in fused[phase].opset_import}[""] >= 23
        onnx.checker.check_model(fused[phase])
    for reference, result in zip(generate_logits(decoder_graphs), generate_logits(fused)):
        np.testing.assert_allclose(result, reference, atol=1e-5)


def test_max_rewrites_fuses_only_the_first(decoder_graphs):  # noqa: F811
    fused, report = fuse_rotary.run(decoder_graphs["decode"], fuse_rotary.Options(max_rewrites=1))
    assert report["rewrites"] == 1 and op_counts(fused)["RotaryEmbedding"] == 1
    assert [s["reason"] for s in report["skipped"]] == ["max_rewrites=1"] * (ROTARIES - 1)
    assert op_counts(fused)["Cos"] == 1  # still read by the three unfused rotaries


def test_max_rewrites_does_not_hide_why_a_rotary_was_not_fused(decoder_graphs):  # noqa: F811
    """Past the first N, a rotary that fails a check is reported with its own reason, not as held back by the limit."""
    _, report = fuse_rotary.run(swap_rotate_half(decoder_graphs["decode"]), fuse_rotary.Options(max_rewrites=1))
    reasons = sorted((s["layer"], s["reason"].split(":")[0]) for s in report["skipped"])
    assert report["rewrites"] == 1 and reasons == [("layers.0", "max_rewrites=1"), ("layers.1", "max_rewrites=1"),
                                                   ("layers.1", "rotary")], report
    assert "rotate-half" in next(s["reason"] for s in report["skipped"] if s["reason"].startswith("rotary"))


def swap_rotate_half(model: onnx.ModelProto) -> onnx.ModelProto:
    """Concat(Neg(t2), t1) -> Concat(t1, Neg(t2)) in layer 1's first rotary: no longer a rotation."""
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    concat = next(n for n in broken.graph.node if n.op_type == "Concat" and "layers.1" in n.name
                  and any(p.op_type == "Neg" and p.output[0] == n.input[0] for p in broken.graph.node))
    concat.input[0], concat.input[1] = concat.input[1], concat.input[0]
    return broken


def test_a_swapped_rotate_half_is_skipped_with_a_reason(decoder_graphs):  # noqa: F811
    broken = {phase: swap_rotate_half(model) for phase, model in decoder_graphs.items()}
    fused = {}
    for phase, model in broken.items():
        before = model.SerializeToString()
        fused[phase], report = fuse_rotary.run(model, fuse_rotary.Options())
        assert model.SerializeToString() == before  # pure
        assert report["rewrites"] == ROTARIES - 1 and len(report["skipped"]) == 1, report
        assert report["skipped"][0]["layer"] == "layers.1" and "rotate-half" in report["skipped"][0]["reason"]
        assert op_counts(fused[phase])["Neg"] == 1
    for reference, result in zip(generate_logits(broken), generate_logits(fused)):
        np.testing.assert_allclose(result, reference, atol=1e-5)


def test_hugging_face_positions_are_found_under_cos(hf_traced):  # noqa: F811
    model, ids, mask, expected = hf_traced
    _, report = fuse_rotary.run(model, fuse_rotary.Options())
    assert report["rewrites"] == 0 and "rotary_cache_length" in report["skipped"][0]["reason"]  # no KV cache input
    fused, report = fuse_rotary.run(model, fuse_rotary.Options(rotary_cache_length=128))
    assert report["rewrites"] == ROTARIES and op_counts(fused)["RotaryEmbedding"] == ROTARIES
    session = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"input_ids": ids, "attention_mask": mask})[0], expected, atol=1e-5)


@pytest.mark.parametrize("sized_from", ["attention_mask", "input_ids"])
def test_positions_sized_from_the_attention_mask_are_not_taken_from_its_values(sized_from):
    """A dynamo-style trace: no position_ids input, positions = Range(0, Shape(attention_mask)[1]) as [1, S, 1]. The
    mask is read for its shape only; taking it as the positions (it is the nearest int64 [B, S] tensor) changed the
    output by 3.5. The subgraph is left alone (rank-3 positions are not the op's), and the graph computes the same.
    Sized from input_ids likewise: the search for positions does not go up through Shape, which reads no values."""
    from onnx import TensorProto as TP
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    s, d = 6, 4
    constants = {"inv_freq": np.array([1.0, 0.1], np.float32), "one_s": np.array(1, np.int64),
                 "zero_s": np.array(0, np.int64), "ax02": np.array([0, 2], np.int64), "half": np.array([d // 2]),
                 "end": np.array([d]), "start": np.array([0]), "last": np.array([-1]), "ax1": np.array([1])}
    nodes = [oh.make_node("Shape", [sized_from], ["mask_shape"]),
             oh.make_node("Gather", ["mask_shape", "one_s"], ["seq"], axis=0),
             oh.make_node("Range", ["zero_s", "seq", "one_s"], ["arange"]),
             oh.make_node("Unsqueeze", ["arange", "ax02"], ["pos3"]), oh.make_node("Cast", ["pos3"], ["posf"], to=TP.FLOAT),
             oh.make_node("Mul", ["posf", "inv_freq"], ["freqs"]),
             oh.make_node("Concat", ["freqs", "freqs"], ["angles"], axis=-1), oh.make_node("Cos", ["angles"], ["cos3"]),
             oh.make_node("Sin", ["angles"], ["sin3"]), oh.make_node("Unsqueeze", ["cos3", "ax1"], ["cos"]),
             oh.make_node("Unsqueeze", ["sin3", "ax1"], ["sin"]),
             oh.make_node("Slice", ["t", "half", "end", "last"], ["t2"]), oh.make_node("Neg", ["t2"], ["neg"]),
             oh.make_node("Slice", ["t", "start", "half", "last"], ["t1"]),
             oh.make_node("Concat", ["neg", "t1"], ["rot"], axis=-1), oh.make_node("Mul", ["t", "cos"], ["tc"]),
             oh.make_node("Mul", ["rot", "sin"], ["rs"]), oh.make_node("Add", ["tc", "rs"], ["y"])]
    graph = oh.make_graph(nodes, "rotary", [oh.make_tensor_value_info("t", TP.FLOAT, [1, 1, s, d]),
                                            oh.make_tensor_value_info(sized_from, TP.INT64, ["b", "s"])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [1, 1, s, d])],
                          [nh.from_array(np.asarray(v, np.int64 if v.dtype.kind == "i" else v.dtype), k)
                           for k, v in constants.items()])
    model = onnx.shape_inference.infer_shapes(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)]))
    fused, report = fuse_rotary.run(model, fuse_rotary.Options(rotary_cache_length=64))
    assert not any(n.op_type == "RotaryEmbedding" and sized_from in n.input for n in fused.graph.node)
    assert [s["reason"] for s in report["skipped"]] == [
        "rotary: no position_ids input and no int64 [B, S] positions tensor under Cos"]
    feed = {"t": np.random.default_rng(0).standard_normal((1, 1, s, d)).astype(np.float32),
            sized_from: np.array([[1, 5, 9, 14, 200, 7]])}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]  # noqa: E731
    np.testing.assert_allclose(run(fused), run(model), atol=1e-5)


def test_an_old_opset_is_kept_when_nothing_is_rewritten_and_refused_when_it_would_be(decoder_graphs):  # noqa: F811
    """Raising opset 17 to 23 in place would make a ReduceMean's `axes` attribute invalid: refused, with the fix."""
    from onnx import helper as oh

    from passes import lower_onnx_attention
    from passes.errors import PassError

    reduce = oh.make_graph([oh.make_node("ReduceMean", ["x"], ["y"], axes=[-1], keepdims=1)], "g",
                           [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
                           [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 1])])
    old = oh.make_model(reduce, opset_imports=[oh.make_opsetid("", 17)])
    for out, _ in (fuse_rotary.run(old, fuse_rotary.Options(rotary_cache_length=8)),
                   lower_onnx_attention.run(old, lower_onnx_attention.Options())):
        assert [o.version for o in out.opset_import if o.domain == ""] == [17]
        ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    unfused = onnx.ModelProto()
    unfused.CopyFrom(decoder_graphs["prefill"])
    for opset in unfused.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = 17
    with pytest.raises(PassError, match="this graph is at opset 17; export it at opset 18 or later"):
        fuse_rotary.run(unfused, fuse_rotary.Options())


def test_an_operator_whose_meaning_changed_after_opset_18_is_refused_not_relabelled():
    """GroupNormalization-18 takes scale and bias per group, -21 per channel: relabelled to 23 it passed the checker
    and strict shape inference, and computed something else (onnx's reference evaluator refused to run it)."""
    import onnx_graphsurgeon as gs
    from onnx import helper as oh

    from passes.errors import PassError
    from passes.opset import raise_opset

    def model(opset):
        node = oh.make_node("GroupNormalization", ["x", "scale", "bias"], ["y"], num_groups=2)
        graph = oh.make_graph([node], "g", [oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)
                                            for name, shape in (("x", [1, 4, 3]), ("scale", [2]), ("bias", [2]))],
                              [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 3])])
        return oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])

    with pytest.raises(PassError, match="GroupNormalization at opset 18 means something else at 23; convert"):
        raise_opset(gs.import_onnx(model(18)), model(18), 23, "lower_onnx_attention")
    raise_opset(gs.import_onnx(model(21)), model(21), 23, "lower_onnx_attention")  # already at its current meaning


def rotary_graph(layout: str = "BHSD", position_divisor: float | None = None, negate_sin: bool = False,
                 s: int = 6, heads: int = 2, d: int = 8, positions_counted_from_mask: bool = False,
                 cos_factor=None, sin_factor=None, dynamic_sequence: bool = False, positions_from_past: bool = False,
                 position_clamp: float | None = None) -> tuple[onnx.ModelProto, tuple[int, ...]]:
    """One rotate-half rotary of t (fixed shapes), as transformers traces it; variants whose math differs from
    RotaryEmbedding's in ways its nodes do not show: t laid out [B, S, heads, D] (cos unsqueezed at axis 2, as
    `apply_rotary_pos_emb(..., unsqueeze_dim=2)`), positions divided before the Mul by inv_freq (linear position
    scaling), or Neg(sin) (the inverse rotation). `positions_counted_from_mask`: no position_ids input; the
    positions are CumSum(attention_mask) - 1, counted in float. `cos_factor` / `sin_factor` (a scalar, or one per
    channel [D]) multiply the tables after Cos / Sin, as YaRN's attention factor does (`cos = emb.cos() * scaling`).
    `dynamic_sequence`: the sequence dimension of t, the output and position_ids is named, not fixed.
    `positions_from_past`: no position_ids input; the positions are past length + 0..s-1, the past length read from
    the shape of input past_key_values.0.key [1, heads, past, d]. `position_clamp`: positions past it are read as it
    (Min), as a table of too few rows would give."""
    from onnx import TensorProto as TP
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    shape = (1, s, heads, d) if layout == "BSHD" else (1, heads, s, d)
    constants = {"inv_freq": 1.0 / 10000 ** (np.arange(0, d, 2, dtype=np.float32) / d), "last": np.array([-1]),
                 "heads_axis": np.array([2 if layout == "BSHD" else 1]), "start": np.array([0]),
                 "half": np.array([d // 2]), "end": np.array([d]), "divisor": np.array(position_divisor or 1.0, np.float32)}
    if position_clamp is not None:
        constants["clamp"] = np.array(position_clamp, np.float32)
    for name, factor in (("cos_factor", cos_factor), ("sin_factor", sin_factor)):
        if factor is not None:
            constants[name] = np.asarray(factor, np.float32)
    position_input = oh.make_tensor_value_info("position_ids", TP.INT64, [1, "sequence" if dynamic_sequence else s])
    if positions_from_past:
        constants.update({"past_axis": np.array(2), "length": np.array(s), "step": np.array(1), "batch_axis": np.array([0])})
        positions = [oh.make_node("Shape", ["past_key_values.0.key"], ["past_shape"]),
                     oh.make_node("Gather", ["past_shape", "past_axis"], ["past"], axis=0),
                     oh.make_node("Add", ["past", "length"], ["stop"]), oh.make_node("Range", ["past", "stop", "step"], ["arange"]),
                     oh.make_node("Unsqueeze", ["arange", "batch_axis"], ["positions"]),
                     oh.make_node("Cast", ["positions"], ["p0"], to=TP.FLOAT)]
        position_input = oh.make_tensor_value_info("past_key_values.0.key", TP.FLOAT, [1, heads, "past", d])
    elif positions_counted_from_mask:
        constants.update({"mask_axis": np.array(1), "one": np.array(1.0, np.float32)})
        positions = [oh.make_node("Cast", ["attention_mask"], ["mask"], to=TP.FLOAT),
                     oh.make_node("CumSum", ["mask", "mask_axis"], ["counted"]),
                     oh.make_node("Sub", ["counted", "one"], ["p0"])]
        position_input = oh.make_tensor_value_info("attention_mask", TP.INT64, [1, s])
    else:
        positions = [oh.make_node("Cast", ["position_ids"], ["p0"], to=TP.FLOAT)]
    nodes = [*positions,
             oh.make_node("Div" if position_divisor else "Identity", ["p0", "divisor"][:2 if position_divisor else 1], ["pd"]),
             oh.make_node("Min" if position_clamp is not None else "Identity", ["pd", "clamp"][:1 + (position_clamp is not None)], ["p"]),
             oh.make_node("Unsqueeze", ["p", "last"], ["pu"]), oh.make_node("Mul", ["pu", "inv_freq"], ["freqs"]),
             oh.make_node("Concat", ["freqs", "freqs"], ["angles"], axis=-1), oh.make_node("Cos", ["angles"], ["c"]),
             oh.make_node("Sin", ["angles"], ["s0"]),
             oh.make_node("Mul" if cos_factor is not None else "Identity", ["c", "cos_factor"][:1 + (cos_factor is not None)], ["cf"]),
             oh.make_node("Mul" if sin_factor is not None else "Identity", ["s0", "sin_factor"][:1 + (sin_factor is not None)], ["sf"]),
             oh.make_node("Unsqueeze", ["cf", "heads_axis"], ["cos"]), oh.make_node("Unsqueeze", ["sf", "heads_axis"], ["s1"]),
             oh.make_node("Neg" if negate_sin else "Identity", ["s1"], ["sin"]),
             oh.make_node("Slice", ["t", "start", "half", "last"], ["t1"]),
             oh.make_node("Slice", ["t", "half", "end", "last"], ["t2"]), oh.make_node("Neg", ["t2"], ["neg"]),
             oh.make_node("Concat", ["neg", "t1"], ["rot"], axis=-1), oh.make_node("Mul", ["t", "cos"], ["tc"]),
             oh.make_node("Mul", ["rot", "sin"], ["rs"]), oh.make_node("Add", ["tc", "rs"], ["y"], name="layers.0.rotary")]
    declared = [dim if not dynamic_sequence or dim != s else "sequence" for dim in shape]
    graph = oh.make_graph(nodes, "rotary", [oh.make_tensor_value_info("t", TP.FLOAT, declared), position_input],
                          [oh.make_tensor_value_info("y", TP.FLOAT, declared)],
                          [nh.from_array(np.asarray(v, np.int64 if v.dtype.kind == "i" else v.dtype), k)
                           for k, v in constants.items()],
                          value_info=[oh.make_tensor_value_info("positions", TP.INT64, [1, s])] if positions_from_past else None)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)]), shape


ONE_CHANNEL_OFF = np.array([1, 1, 1, 1.001, 1, 1, 1, 1], np.float32)  # a per-channel factor: the match reads no such Mul


@pytest.mark.parametrize("variant, expected", [
    ({}, None),
    ({"cos_factor": 1.139, "sin_factor": 1.139}, None),  # YaRN's attention factor (factor 4): scaling 1.139
    ({"cos_factor": 1.139}, "computes something other than RotaryEmbedding with the matched inv_freq and scaling 1.139"),
    ({"position_divisor": 1.001}, "computes something other than RotaryEmbedding"),  # off by ~3e-3
    ({"cos_factor": ONE_CHANNEL_OFF}, "computes something other than RotaryEmbedding"),  # ~7e-4, in one channel
    ({"position_divisor": 4.0}, "computes something other than RotaryEmbedding"),
    ({"negate_sin": True}, "computes something other than RotaryEmbedding"),
    ({"layout": "BSHD", "s": 4, "heads": 4}, "computes something other than RotaryEmbedding"),  # shapes alike
    ({"layout": "BSHD", "s": 5, "heads": 2}, "its positions [1, 5] do not match t [1, 5, 2, 8]'s batch and axis 2"),
    ({"layout": "BSHD", "s": 5, "heads": 2, "dynamic_sequence": True}, "could not be checked by running it"),
])
def test_a_rotary_is_fused_only_when_a_probe_shows_it_computes_rotary_embedding(variant, expected):
    """Before the probe, the last four were fused: the next three changed the output (this test's parity check
    failed), and the fifth failed in onnxruntime at run time."""
    model, shape = rotary_graph(**variant)
    fused, report = fuse_rotary.run(model, fuse_rotary.Options(rotary_cache_length=64))
    feed = {"t": np.random.default_rng(1).standard_normal(shape).astype(np.float32),
            "position_ids": np.arange(shape[2 if variant.get("layout") != "BSHD" else 1])[None]}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]  # noqa: E731
    np.testing.assert_allclose(run(fused), run(model), atol=1e-5)
    if expected is None:
        assert report["rewrites"] == 1 and report["skipped"] == [], report
        assert [n.op_type for n in fused.graph.node] == ["RotaryEmbedding"]  # t has batch 1: no Expand of positions
    else:
        assert report["rewrites"] == 0 and op_counts(fused)["RotaryEmbedding"] == 0
        assert [s["layer"] for s in report["skipped"]] == ["layers.0"] and expected in report["skipped"][0]["reason"]


@pytest.mark.parametrize("variant, expected", [
    ({}, None),
    ({"negate_sin": True}, "computes something other than RotaryEmbedding"),
    ({"position_divisor": 4.0}, "computes something other than RotaryEmbedding"),
    ({"cos_factor": 1.139, "sin_factor": 1.139}, None),
])
def test_a_one_token_rotary_of_fixed_shapes_is_checked_at_a_position_other_than_0(variant, expected):
    """A graph of fixed shapes for one token (a decode step): the probe ran it at position 0 only, where cos is 1 and
    sin 0 whatever the graph computes, so a negated sin or scaled positions were fused and changed the output by
    1.7 at position 5."""
    model, shape = rotary_graph(s=1, **variant)
    fused, report = fuse_rotary.run(model, fuse_rotary.Options(rotary_cache_length=64))
    t = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    for position in (0, 5, 63):
        feed = {"t": t, "position_ids": np.array([[position]])}
        run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]  # noqa: E731, B023
        np.testing.assert_allclose(run(fused), run(model), atol=1e-5)
    if expected is None:
        assert report["rewrites"] == 1 and report["skipped"] == [], report
    else:
        assert report["rewrites"] == 0 and expected in report["skipped"][0]["reason"], report


def test_a_one_token_rotary_whose_probe_positions_are_all_0_is_not_fused():
    """One token at position past length + 0, the past read from the cache input's shape: the probe's past is empty,
    so its one position is 0, where every rotation is the identity; a negated sin would be fused unseen."""
    model, shape = rotary_graph(s=1, negate_sin=True, positions_from_past=True)
    fused, report = fuse_rotary.run(model, fuse_rotary.Options(rotary_cache_length=64))
    assert report["rewrites"] == 0 and op_counts(fused)["RotaryEmbedding"] == 0
    assert report["skipped"][0]["reason"].startswith("rotary: could not be checked by running it (its positions on a "
                                                     "probe are [[0]]")
    feed = {"t": np.random.default_rng(1).standard_normal(shape).astype(np.float32),
            "past_key_values.0.key": np.zeros((1, 2, 5, 8), np.float32)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]  # noqa: E731
    np.testing.assert_allclose(run(fused), run(model), atol=1e-5)


@pytest.mark.parametrize("shapes_inferred", [False, True])
def test_positions_counted_from_the_attention_mask_are_not_taken_as_the_mask_itself(shapes_inferred):
    """No position_ids input: the positions are CumSum(attention_mask) - 1, computed in float, so the nearest int64
    [B, S] tensor under Cos is attention_mask itself. It says which tokens are real, not where they are (all ones
    here: RotaryEmbedding would rotate every token as position 1); with no int64 positions to give the op, the
    rotary stays as it is, and the graph computes the same. With shapes inferred (as after cleanup), the float
    positions [1, S] are not taken either: RotaryEmbedding takes int64 ones."""
    model, shape = rotary_graph(positions_counted_from_mask=True)
    if shapes_inferred:
        model = onnx.shape_inference.infer_shapes(model)
    fused, report = fuse_rotary.run(model, fuse_rotary.Options(rotary_cache_length=64))
    assert fused is not model and report["nodes"] == {"before": len(model.graph.node), "after": len(model.graph.node)}
    feed = {"t": np.random.default_rng(1).standard_normal(shape).astype(np.float32),
            "attention_mask": np.ones((1, shape[2]), np.int64)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]  # noqa: E731
    np.testing.assert_allclose(run(fused), run(model), atol=1e-5)
    assert report["rewrites"] == 0 and op_counts(fused)["RotaryEmbedding"] == 0
    assert [s["reason"] for s in report["skipped"]] == [
        "rotary: no position_ids input and no int64 [B, S] positions tensor under Cos"]


def test_int32_position_ids_are_not_given_to_rotary_embedding():
    """RotaryEmbedding takes int64 position_ids: fused with int32 ones, onnxruntime refuses the graph."""
    model, shape = rotary_graph()
    model.graph.input[1].type.tensor_type.elem_type = onnx.TensorProto.INT32
    fused, report = fuse_rotary.run(model, fuse_rotary.Options(rotary_cache_length=64))
    assert report["rewrites"] == 0 and [s["reason"] for s in report["skipped"]] == ["position_ids is int32, not int64"]
    feed = {"t": np.ones(shape, np.float32), "position_ids": np.arange(shape[2], dtype=np.int32)[None]}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]  # noqa: E731
    np.testing.assert_array_equal(run(fused), run(model))


def test_a_graph_of_an_older_ir_version_is_raised_to_ir_10_with_opset_23():
    model, shape = rotary_graph()
    model.ir_version, model.opset_import[0].version = 8, 18
    fused, report = fuse_rotary.run(model, fuse_rotary.Options(rotary_cache_length=64))
    assert report["rewrites"] == 1 and fused.ir_version == 10 and fused.opset_import[0].version == 23
    onnx.checker.check_model(fused)
    feed = {"t": np.ones(shape, np.float32), "position_ids": np.arange(shape[2])[None]}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]  # noqa: E731
    np.testing.assert_allclose(run(fused), run(model), atol=1e-6)


def test_bfloat16_rotaries_are_checked_in_float32_and_fused(decoder_graphs):  # noqa: F811
    from compiler.export import export_graphs
    from compiler.frontend.model import build_decoder
    from compiler.frontend.random_init import random_model
    from passes import cleanup
    from tests.passes.test_fuse_attention import MAX_CONTEXT

    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    for phase, model in export_graphs(decoder, MAX_CONTEXT, dtype="bfloat16").items():
        fused, report = fuse_rotary.run(cleanup.run(model, cleanup.Options())[0], fuse_rotary.Options())
        assert report["rewrites"] == ROTARIES and report["skipped"] == [], (phase, report)
        onnx.checker.check_model(fused, full_check=True)  # the tables in the graph's type (they were float32)


def test_float16_rotaries_fuse_into_a_graph_onnxruntime_runs_with_the_same_logits():
    """The cos/sin tables were float32 beside float16 data: the report said fused, and onnxruntime refused to load
    the graph ("Type parameter (T) ... bound to different types")."""
    from compiler.export import export_graphs
    from compiler.frontend.model import build_decoder
    from compiler.frontend.random_init import random_model
    from passes import cleanup
    from tests.passes.test_fuse_attention import MAX_CONTEXT, io_names

    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    model = cleanup.run(export_graphs(decoder, MAX_CONTEXT, dtype="float16")["prefill"], cleanup.Options())[0]
    fused, report = fuse_rotary.run(model, fuse_rotary.Options())
    assert report["rewrites"] == ROTARIES
    caches = [np.zeros((1, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), np.float16)] * (2 * CONFIG.num_layers)
    feed = {"input_ids": np.array([[1, 5, 9, 14, 200, 7]]), "position_ids": np.arange(6)[None],
            "attention_mask": np.ones((1, 6), np.int64), **dict(zip(io_names(CONFIG)[0][3:], caches))}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)  # noqa: E731
    for before, after in zip(run(model), run(fused)):  # logits and every cache written
        np.testing.assert_allclose(after.astype(np.float32), before.astype(np.float32), atol=2e-2)


@pytest.mark.parametrize("dynamic_sequence, s", [(True, 6), (False, 1)])
def test_positions_clamped_past_the_probe_are_not_fused(dynamic_sequence, s):
    """The probe rotates positions up to 6; positions clamped at 10 passed it and were fused, the RotaryEmbedding
    rotating by the true positions from 11 on. The graph's cos and sin are now run over every row of the fused
    tables (a graph of fixed width fed its width at a time)."""
    model, shape = rotary_graph(s=s, dynamic_sequence=dynamic_sequence, position_clamp=10.0)
    fused, report = fuse_rotary.run(model, fuse_rotary.Options(rotary_cache_length=64))
    assert report["rewrites"] == 0, report
    assert report["skipped"][0]["reason"].startswith("rotary: its cos table differs from cos(position * inv_freq)")
    assert "positions, from position 11 on" in report["skipped"][0]["reason"]
    unclamped, _ = rotary_graph(s=s, dynamic_sequence=dynamic_sequence)
    assert fuse_rotary.run(unclamped, fuse_rotary.Options(rotary_cache_length=64))[1]["rewrites"] == 1


def test_tables_that_cannot_be_run_over_every_row_leave_the_rotary_unfused():
    """A fixed sequence width whose positions come from the past's shape cannot be moved over the 64 rows the fused
    tables hold, and a width above those rows would index past them: both stay unfused, saying why."""
    model, _ = rotary_graph(positions_from_past=True)  # 6 tokens, fixed; no position_ids input
    report = fuse_rotary.run(model, fuse_rotary.Options(rotary_cache_length=64))[1]
    assert report["rewrites"] == 0 and report["skipped"][0]["reason"].startswith(
        "rotary: its cos table could not be run over the 64 positions the fused tables serve")
    model, _ = rotary_graph(s=100)
    report = fuse_rotary.run(model, fuse_rotary.Options(rotary_cache_length=64))[1]
    assert report["rewrites"] == 0 and report["skipped"][0]["reason"] == (
        "rotary: its cos/sin tables could not be checked by running them (its fixed sequence width 100 exceeds the 64 "
        "rows the fused tables hold); left unfused")
