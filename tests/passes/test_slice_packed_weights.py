"""Tests for passes/slice_packed_weights.py: a traced tiny decoder after pack_projections, hand-made graphs for what
is kept and why, and onnxruntime parity."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.errors import BuildError
from compiler.export import export_graphs
from compiler.frontend.model import build_decoder
from compiler.frontend.random_init import random_model
from compiler.pipeline import check_passes, run_pipeline
from compiler.recipe import PassSpec
from passes import cleanup, dequantize_weights, pack_projections, quantize, skip_unused_rows, slice_packed_weights
from passes.errors import PassError
from passes.session_config import session_config
from tests.passes.test_dequantize_weights import FORMATS, prefill_only, session
from tests.passes.test_fuse_attention import decoder_graphs, generate_logits  # noqa: F401
from tests.passes.test_pack_projections import MAX_CONTEXT, decoder_feeds, run_ort, tiny_config
from tests.passes.test_quantize import random_weight
from tests.passes.test_skip_unused_rows import DEFAULT_RECIPE_PASSES, run_passes

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


def hand_made(weight_from_input: bool = False, axis: int = -1, extra_reader: bool = False, sizes=(4, 6),
              reader_node: bool = False, sizes_as_attribute: bool = False):
    """x [2, 3, 8] -> MatMul(W [8, 10]) -> Split(sizes) -> y0, y1 (+ the packed output as a graph output, or read by a
    Relu too). sizes_as_attribute: opset 11, where Split takes its sizes as the `split` attribute."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 10)).astype(np.float32)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])]
    initializers = [] if sizes_as_attribute else [numpy_helper.from_array(np.array(sizes, np.int64), "sizes")]
    nodes = []
    if weight_from_input:
        inputs.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT, [1]))
        initializers.append(numpy_helper.from_array(weight, "w0"))
        nodes.append(helper.make_node("Mul", ["w0", "scale"], ["w"], name="scaled"))
    else:  # computed from constants only, as dequantize_weights' chain is
        initializers += [numpy_helper.from_array(weight, "w0"), numpy_helper.from_array(np.float32([2.0]), "two")]
        nodes.append(helper.make_node("Mul", ["w0", "two"], ["w"], name="doubled"))
    split = (helper.make_node("Split", ["packed"], ["y0", "y1"], name="split", axis=axis, split=list(sizes))
             if sizes_as_attribute else
             helper.make_node("Split", ["packed", "sizes"], ["y0", "y1"], name="split", axis=axis))
    nodes += [helper.make_node("MatMul", ["x", "w"], ["packed"], name="packed_matmul"), split]
    last = ([2, 3, sizes[0]], [2, 3, sizes[1]])
    shapes = {-1: last, 2: last, 1: ([2, 3, 10], [2, 3, 10])}[axis]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in zip(("y0", "y1"), shapes)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("packed", TensorProto.FLOAT, [2, 3, 10]))
    if reader_node:
        nodes.append(helper.make_node("Relu", ["packed"], ["rectified"], name="reader"))
        outputs.append(helper.make_tensor_value_info("rectified", TensorProto.FLOAT, [2, 3, 10]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11 if sizes_as_attribute else 17)])


# also the last axis by its positive index, and sizes as the `split` attribute (pack_projections' form before opset 13)
@pytest.mark.parametrize("case", [{}, {"axis": 2}, {"sizes_as_attribute": True}])
def test_a_weight_computed_from_constants_is_sliced_after_it_and_matches(case):
    model = hand_made(**case)
    sliced, report = slice_packed_weights.run(model, OPTIONS)
    assert report["rewritten"] == [{"node": "packed_matmul", "widths": [4, 6]}]
    assert op_counts(sliced) == Counter({"Mul": 1, "Slice": 2, "MatMul": 2})
    x = {"x": np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)}
    expected, got = run_ort(model, x), run_ort(sliced, x)
    for name in ("y0", "y1"):
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6)


def packed_quantized(options: dict, flat: bool = False, bias: bool = False) -> onnx.ModelProto:
    """x [2, 3, 80] -> MatMulNBits(W [80, 48] in `options`' format) -> Split(20, 28) -> y0, y1. K = 80 is 2.5 blocks
    of 32: a padded last block, and with zero points an odd block count (a padding nibble per column). flat: scales
    and zero points in the spec's 1-D layout (aotlm's quantize writes [N, blocks] and [N, bytes]); bias: a bias [N]."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["packed"], name="packed_matmul"),
             helper.make_node("Split", ["packed", "sizes"], ["y0", "y1"], name="split", axis=-1)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 80])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 3, width]) for name, width in (("y0", 20), ("y1", 28))],
        [numpy_helper.from_array(random_weight(k=80, n=48), "w"), numpy_helper.from_array(np.int64([20, 28]), "sizes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    quantized = quantize.run(model, quantize.Options(**options))[0]
    (node,) = [n for n in quantized.graph.node if n.op_type == "MatMulNBits"]
    initializers = {t.name: t for t in quantized.graph.initializer}
    for name in node.input[2:4] if flat else ():
        initializers[name].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(initializers[name]).reshape(-1), name))
    if bias:
        quantized.graph.initializer.append(numpy_helper.from_array(np.linspace(-1, 1, 48, dtype=np.float32), "bias"))
        node.input.extend([""] * (5 - len(node.input)) + ["bias"])  # zero points (if absent) and g_idx omitted
    return quantized


LAYOUTS = {"as-quantize-writes": {}, "flat-with-bias": {"flat": True, "bias": True}}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FORMATS)
def test_a_quantized_packed_product_is_cut_in_its_codes_and_each_part_folds_to_float(name, layout, tmp_path):
    quantized = packed_quantized(FORMATS[name], **LAYOUTS[layout])
    sliced, report = slice_packed_weights.run(quantized, OPTIONS)
    (node,) = [n for n in quantized.graph.node if n.op_type == "MatMulNBits"]
    assert report["rewritten"] == [{"node": node.name, "widths": [20, 28]}]
    per_column = len([i for i in (1, 2, 3, 5) if i < len(node.input) and node.input[i]])  # B, scales, (zp, bias)
    assert per_column == 2 + ("zero-points" in name) + ("bias" in layout)
    assert op_counts(sliced) == Counter({"MatMulNBits": 2, "Slice": 2 * per_column})  # each cut once per part
    big = lambda model: {t.name: t for t in model.graph.initializer if numpy_helper.to_array(t).nbytes > 64}  # noqa: E731
    assert big(sliced) == big(quantized)  # the same codes: no new weights, the decode graph's stay shared
    x = {"x": np.random.default_rng(3).standard_normal((2, 3, 80)).astype(np.float32)}
    expected, got = run_ort(quantized, x), run_ort(sliced, x)
    for output in ("y0", "y1"):
        np.testing.assert_allclose(got[output], expected[output], rtol=0, atol=1e-5, err_msg=output)

    # dequantize_weights then unpacks each part's own codes; onnxruntime folds the Slices with the rest
    floats, float_report = dequantize_weights.run(sliced, dequantize_weights.Options())
    assert len(float_report["rewritten"]) == 2 and float_report["float_weight_bytes_at_load"] == 80 * 48 * 4
    optimized = tmp_path / "optimized.onnx"
    folded = session(floats, session_config(floats), optimized).run(None, x)
    left = op_counts(onnx.load(optimized))
    assert left["MatMul"] + left["Gemm"] == 2 and not {"Slice", "DequantizeLinear", "MatMulNBits", "BitShift"} & set(left)
    packed_floats = dequantize_weights.run(quantized, dequantize_weights.Options())[0]
    reference = session(packed_floats, session_config(packed_floats)).run(None, x)
    for output, expected_part, got_part in zip(("y0", "y1"), reference, folded):
        np.testing.assert_allclose(got_part, expected_part, rtol=0, atol=1e-5, err_msg=output)


def test_a_matmulnbits_with_rows_its_layout_does_not_give_is_kept():
    quantized = packed_quantized(FORMATS["int4-symmetric-full-range"], flat=True)
    (node,) = [n for n in quantized.graph.node if n.op_type == "MatMulNBits"]
    scales = next(t for t in quantized.graph.initializer if t.name == node.input[2])
    scales.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scales)[:48 * 2], scales.name))  # 2 blocks, not 3
    result, report = slice_packed_weights.run(quantized, OPTIONS)
    assert result is quantized and "scales has shape [96], not 144 rows first (3 per column" in report["kept"][0]["reason"]
    node.input.extend(["", "order"][len(node.input) - 3:])  # a g_idx input
    quantized.graph.initializer.append(numpy_helper.from_array(np.arange(80, dtype=np.int32) // 32, "order"))
    assert "g_idx" in slice_packed_weights.run(quantized, OPTIONS)[1]["kept"][0]["reason"]


def assert_cut_in_two_and_unchanged(quantized, node_name: str) -> None:
    """The pass cuts `node_name` into its two readers' widths, and both outputs are what they were."""
    sliced, report = slice_packed_weights.run(quantized, OPTIONS)
    assert report["rewritten"] == [{"node": node_name, "widths": [20, 28]}]
    x = {"x": np.random.default_rng(3).standard_normal((2, 3, 80)).astype(np.float32)}
    expected, got = run_ort(quantized, x), run_ort(sliced, x)
    for output in ("y0", "y1"):
        np.testing.assert_allclose(got[output], expected[output], rtol=0, atol=1e-5, err_msg=output)


def test_float_zero_points_are_cut_by_blocks_not_packed_bytes():
    """MatMulNBits also takes zero points in the scales' type, one per block ([N * blocks] flat), where uint8 ones are
    packed two per byte: a column's rows are then its 3 blocks, not its 2 bytes."""
    quantized = packed_quantized(FORMATS["int4-zero-points"], flat=True)
    (node,) = [n for n in quantized.graph.node if n.op_type == "MatMulNBits"]
    zero_points = next(t for t in quantized.graph.initializer if t.name == node.input[3])
    packed = numpy_helper.to_array(zero_points).reshape(48, -1)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(48, -1)[:, :3]  # low nibble first; the 4th pads
    zero_points.CopyFrom(numpy_helper.from_array(codes.reshape(-1).astype(np.float32), zero_points.name))
    assert_cut_in_two_and_unchanged(quantized, node.name)


def test_a_matmulnbits_whose_scales_are_computed_from_constants_is_cut_after_them():
    """A per-column input computed from constants has no shape until inferred: the pass infers it, and cuts it."""
    quantized = packed_quantized(FORMATS["int4-symmetric-full-range"])
    (node,) = [n for n in quantized.graph.node if n.op_type == "MatMulNBits"]
    quantized.graph.node.insert(0, helper.make_node("Identity", [node.input[2]], ["scales_copy"], name="copy"))
    node.input[2] = "scales_copy"
    assert_cut_in_two_and_unchanged(quantized, node.name)


def test_in_an_int4_decoder_prefill_cuts_gate_up_codes_and_generates_the_same_logits(decoder_graphs):  # noqa: F811
    fused = {phase: run_passes(model, DEFAULT_RECIPE_PASSES) for phase, model in decoder_graphs.items()}
    quantized, _ = run_pipeline(fused, prefill_only([(quantize, quantize.Options(bits=4, block_size=32)),
                                                     (skip_unused_rows, skip_unused_rows.Options())]))
    dequantize = (dequantize_weights, dequantize_weights.Options())
    reference, _ = run_pipeline(quantized, prefill_only([dequantize]))
    graphs, results = run_pipeline(quantized, prefill_only([(slice_packed_weights, OPTIONS), dequantize]))
    sliced = next(r.report for r in results if r.name == "slice_packed_weights" and r.phase == "prefill")
    assert [len(entry["widths"]) for entry in sliced["rewritten"]] == [2, 2]  # gate/up of both layers
    assert op_counts(graphs["prefill"])["Split"] == 0 and graphs["decode"] is reference["decode"]
    floats = next(r.report for r in results if r.name == "dequantize_weights" and r.phase == "prefill")
    assert len(floats["rewritten"]) == 10  # 2 layers x (q/k/v, o_proj, gate, up, down_proj); the lm_head is kept
    for expected, got in zip(generate_logits(reference), generate_logits(graphs)):  # prefill, then decode steps
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def test_a_matmulnbits_whose_codes_come_from_a_graph_input_is_kept():
    quantized = packed_quantized(FORMATS["int4-symmetric-full-range"])
    (node,) = [n for n in quantized.graph.node if n.op_type == "MatMulNBits"]
    scales = next(t for t in quantized.graph.initializer if t.name == node.input[2])
    quantized.graph.initializer.remove(scales)
    quantized.graph.input.append(helper.make_tensor_value_info(scales.name, scales.data_type, list(scales.dims)))
    result, report = slice_packed_weights.run(quantized, OPTIONS)
    assert result is quantized and not report["applied"]
    assert "scales is computed from a graph input" in report["kept"][0]["reason"]


def test_after_dequantize_weights_the_pass_is_refused():
    specs = [PassSpec("quantize", quantize.Options()), PassSpec("dequantize_weights", dequantize_weights.Options()),
             PassSpec("slice_packed_weights", OPTIONS)]
    with pytest.raises(BuildError, match="list slice_packed_weights before dequantize_weights"):
        check_passes(specs)
    check_passes([specs[0], specs[2], specs[1]])  # the order the quantized recipes use


def test_quantize_after_the_pass_is_refused():
    """Prefill's sliced products read Slice(W), not a constant weight: quantize left them float there, and an AWQ
    scale folded into decode's value columns only made the two graphs write different values to the cache."""
    specs = [PassSpec("slice_packed_weights", OPTIONS), PassSpec("quantize", quantize.Options())]
    with pytest.raises(BuildError, match=r"passes\[1\] \(quantize\) comes after passes\[0\] \(slice_packed_weights\)"
                                         r": slice_packed_weights makes prefill's packed products read column slices"):
        check_passes(specs)
    check_passes(specs[::-1])


@pytest.mark.parametrize("case, reason", [
    ({"weight_from_input": True}, "computed from a graph input"),
    ({"axis": 1, "sizes": (1, 2)}, "not the last one"),
    ({"extra_reader": True}, "read by more than the Split"),
    ({"reader_node": True}, "read by more than the Split"),  # sliced, the packed product would run as well
    ({"sizes": (4, 5)}, "do not cut the weight's 10 columns"),
])
def test_what_is_kept_is_reported_with_the_reason(case, reason):
    model = hand_made(**case)
    result, report = slice_packed_weights.run(model, OPTIONS)
    assert result is model and not report["applied"]
    assert len(report["kept"]) == 1 and reason in report["kept"][0]["reason"]


def test_max_rewrites_stops_after_that_many(packed_prefill):
    _, packed = packed_prefill
    _, report = slice_packed_weights.run(packed, slice_packed_weights.Options(max_rewrites=1))
    assert len(report["rewritten"]) == 1 and report["kept"]
    assert {entry["reason"] for entry in report["kept"]} == {"max_rewrites=1"}


@pytest.mark.parametrize("phases", [(), ("prefill", "prefill"), ("train",)])
def test_bad_phases_are_refused(phases):
    with pytest.raises(PassError, match="phases"):
        slice_packed_weights.check_options(slice_packed_weights.Options(phases=phases))
