"""quantize: RTN weight-only quantization, its numpy reference, and its MatMulNBits lowering in onnxruntime.

Needs onnxruntime (CPU) only. The onnxruntime checks compare with `X @ dequantize(qw)`, the numpy reference of
the same quantized weights, so they test the packing and the op's reading of it, not the rounding.
"""
from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from passes import quantize
from passes.errors import PassError
from passes.quantized_weights import dequantize, pack_matmulnbits, quantize_rtn
from tests.passes.test_fuse_attention import CONFIG, decoder_graphs, generate_logits, op_counts  # noqa: F401

FORMATS = {  # name: (bits, block_size or None for per channel, symmetric, full_range)
    "int8_per_channel": (8, None, True, False),
    "int4_block32_sym": (4, 32, True, False),
    "int4_block32_sym_full_range": (4, 32, True, True),
    "int4_block32_asym": (4, 32, False, False),
    "int4_block16_sym": (4, 16, True, False),  # the smallest block MatMulNBits takes, kept as it is
}


def random_weight(k=64, n=48, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((k, n)).astype(np.float32)
    weight[:, 0] += 3.0  # a column that is all positive: asymmetric ranges must still include 0
    weight[:32, 1] = 0.0  # an all-zero block
    return weight


def expected_scales(weight: np.ndarray, bits: int, block_size: int, symmetric: bool, full_range: bool) -> np.ndarray:
    """[N, blocks] scales by the formats' definitions, one column's block at a time (an all-zero block: 1)."""
    k, n = weight.shape
    scales = np.ones((n, k // block_size))
    for column in range(n):
        for block in range(k // block_size):
            values = weight[block * block_size:(block + 1) * block_size, column].astype(np.float64)
            if not values.any():
                continue
            if symmetric and full_range:  # the largest element, sign kept, is code 0 (-2**(bits-1) steps)
                scales[column, block] = values[np.abs(values).argmax()] / -2 ** (bits - 1)
            elif symmetric:
                scales[column, block] = np.abs(values).max() / (2 ** (bits - 1) - 1)
            else:  # the range, widened to include 0, over 2**bits - 1 steps
                scales[column, block] = (max(values.max(), 0) - min(values.min(), 0)) / (2 ** bits - 1)
    return scales


@pytest.mark.parametrize("name", FORMATS)
def test_dequantized_weights_are_within_half_a_step(name):
    bits, block_size, symmetric, full_range = FORMATS[name]
    weight = random_weight()
    qw = quantize_rtn(weight, bits, block_size or weight.shape[0], symmetric, full_range)
    assert qw.codes.shape == (48, 64) and qw.codes.dtype == np.uint8 and qw.codes.max() < 2 ** bits
    assert qw.scales.shape == (48, 64 // qw.block_size)
    assert (qw.zero_points is None) == symmetric
    # Each (column, block) has its own scale, computed here block by block from the format's definition: the
    # half-step bound below uses the code's scales, so one coarse scale for the whole tensor would pass it.
    np.testing.assert_allclose(qw.scales, expected_scales(weight, bits, qw.block_size, symmetric, full_range),
                               rtol=1e-6)
    step = np.abs(np.repeat(qw.scales, qw.block_size, axis=1).T)  # [K, N], each element's own |scale|
    error = np.abs(weight - dequantize(qw))
    print(f"{name}: max abs weight error {error.max():.3g}")
    assert np.all(dequantize(qw)[:32, 1] == 0)
    if not full_range:
        assert np.all(error <= step / 2 + 1e-6)
        return
    # All 16 codes: the largest element of each block is exact (code 0), nothing is further than a step (the other
    # side is clipped at 7 steps), within half a step below that, and the finer step beats [-7, 7] on average.
    assert (qw.scales < 0).any() and (qw.scales > 0).any()
    blocks = weight.T.reshape(48, -1, block_size)
    largest = np.abs(blocks).argmax(axis=-1)
    nonzero = np.abs(blocks).max(axis=-1) > 0  # an all-zero block (column 1's first) encodes 0 as the midpoint
    assert np.all(np.take_along_axis(qw.codes.reshape(48, -1, block_size), largest[..., None], -1)[nonzero] == 0)
    assert np.all(error <= step + 1e-6)
    assert np.all(error[np.abs(weight) <= 7 * step] <= step[np.abs(weight) <= 7 * step] / 2 + 1e-6)
    restricted = np.abs(weight - dequantize(quantize_rtn(weight, bits, block_size, symmetric)))
    assert np.sqrt(np.mean(error ** 2)) < 0.95 * np.sqrt(np.mean(restricted ** 2))


def test_int4_packing_is_low_nibble_first_and_zero_points_packed_per_row():
    weight = random_weight(k=96)  # 3 blocks of 32: an odd count, so each row's zero points end in a half byte
    qw = quantize_rtn(weight, 4, 32, symmetric=False)
    blob, scales, zero_points = pack_matmulnbits(qw)
    assert blob.shape == (48, 3, 16) and scales.shape == (48, 3) and zero_points.shape == (48, 2)
    assert blob[5, 1, 2] == qw.codes[5, 32 + 4] | (qw.codes[5, 32 + 5] << 4)
    assert zero_points[5, 0] == qw.zero_points[5, 0] | (qw.zero_points[5, 1] << 4)
    assert zero_points[5, 1] == qw.zero_points[5, 2]


def matmul_model(weight: np.ndarray) -> onnx.ModelProto:
    k, n = weight.shape
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["X", "W"], ["Y"], name="proj")], "tiny",
        [onnx.helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [2, 3, k])],
        [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [2, 3, n])],
        initializer=[onnx.numpy_helper.from_array(weight, "W")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])


def run_onnxruntime(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x})[0]


@pytest.mark.parametrize("name", FORMATS)
def test_matmulnbits_in_onnxruntime_matches_the_numpy_reference(name):
    bits, block_size, symmetric, full_range = FORMATS[name]
    weight = random_weight()
    options = quantize.Options(bits=bits, block_size=block_size or 32, symmetric=symmetric, full_range=full_range)
    quantized, report = quantize.run(matmul_model(weight), options)
    assert [n.op_type for n in quantized.graph.node] == ["MatMulNBits"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in quantized.graph.node[0].attribute}
    assert attrs == {"K": 64, "N": 48, "bits": bits, "block_size": block_size or 64}
    qw = quantize_rtn(weight, bits, block_size or 64, symmetric, full_range)
    x = np.random.default_rng(1).standard_normal((2, 3, 64)).astype(np.float32)
    difference = np.abs(run_onnxruntime(quantized, x) - x @ dequantize(qw)).max()
    print(f"{name}: onnxruntime vs numpy reference max abs diff {difference:.3g}")
    assert difference <= 1e-4
    (layer,) = report["layers"]
    assert layer["node"] == "proj" and layer["bits"] == bits and layer["bytes_before"] == 64 * 48 * 4
    assert layer["full_range"] == full_range  # the report says which grid the codes are on
    assert layer["max_abs_weight_error"] == pytest.approx(np.abs(weight - dequantize(qw)).max())
    packed_codes = 64 * 48 * bits // 8
    assert layer["bytes_after"] == packed_codes + qw.scales.nbytes + (0 if symmetric else 48 * 2 // 2)
    totals = report["totals"]
    assert (totals["weight_bytes_before"], totals["weight_bytes_after"]) == (64 * 48 * 4, layer["bytes_after"])
    assert (totals["graph_bytes_before"], totals["graph_bytes_after"]) == (64 * 48 * 4, layer["bytes_after"])
    assert (totals["quantized"], totals["skipped"]) == (1, 0)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LM_HEAD = "/decoder/lm_head/MatMul"  # the export names the output projection after lm_head (compiler/export.py)


def test_int8_decoder_keeps_logits_close_and_every_projection_becomes_matmulnbits(decoder_graphs):  # noqa: F811
    quantized = {}
    for phase, model in decoder_graphs.items():
        quantized[phase], report = quantize.run(model, quantize.Options(bits=8, exclude=(LM_HEAD,)))
        counts = op_counts(quantized[phase])
        assert counts["MatMulNBits"] == CONFIG.num_layers * len(PROJECTIONS)
        # Left as MatMul: attention's two activation x activation products per layer, and the excluded lm_head.
        assert counts["MatMul"] == 2 * CONFIG.num_layers + 1
        names = sorted(layer["node"].split("/")[-2] for layer in report["layers"])
        assert names == sorted(PROJECTIONS * CONFIG.num_layers)
        assert {s["reason"] for s in report["skipped"]} == {"B is not a constant weight", f"excluded by pattern {LM_HEAD!r}"}
        totals = report["totals"]
        assert totals["quantized"] == 14 and totals["weight_bytes_after"] < totals["weight_bytes_before"] / 3.5
    worst = 0.0
    for reference, result in zip(generate_logits(decoder_graphs), generate_logits(quantized)):
        worst = max(worst, float(np.abs(result - reference).max()))
    print(f"int8 decoder: max abs logit/cache diff vs float {worst:.3g}")
    # Per-channel INT8 moves each weight by at most max|w|/254 (0.4% of the row's range); through two random
    # layers that is ~1e-3 relative on O(1) logits. 2e-2 leaves room for the rounding across layers while a
    # packing or scale mistake (wrong nibble, wrong channel) moves logits by O(1).
    assert worst < 2e-2


def test_whole_decoder_with_lm_head_quantizes_fifteen_matmuls(decoder_graphs):  # noqa: F811
    quantized, report = quantize.run(decoder_graphs["decode"], quantize.Options(bits=4, block_size=32))
    assert op_counts(quantized)["MatMulNBits"] == CONFIG.num_layers * len(PROJECTIONS) + 1
    assert report["layers"][-1]["node"] == LM_HEAD


@pytest.mark.parametrize("bits", [3, 16])
def test_unsupported_bits_is_an_error(bits):
    with pytest.raises(PassError, match=f"bits={bits} is not supported"):
        quantize.run(matmul_model(random_weight()), quantize.Options(bits=bits))


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_methods_without_calibration_data_are_an_error(method):
    with pytest.raises(PassError, match=f"method {method} needs calibration data: set `calibration`"):
        quantize.run(matmul_model(random_weight()), quantize.Options(method=method))


@pytest.mark.parametrize("lowering", ["matmulnbits", "dequantize_linear"])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_block_size_that_does_not_divide_k_is_padded_and_still_exact(bits, lowering):
    """K=80: INT4 blocks of 32 end in a partial block of 16; INT8 per channel (one block of 80, not a power of two)
    becomes MatMulNBits blocks of 16 with the channel's scale repeated. Both must equal the numpy reference."""
    weight = random_weight(k=80)
    options = quantize.Options(bits=bits, block_size=32, lowering=lowering)
    quantized, report = quantize.run(matmul_model(weight), options)
    full_range = bits == 4 and lowering == "matmulnbits"  # the default: signed scales for onnxruntime only
    qw = quantize_rtn(weight, bits, 32 if bits == 4 else 80, symmetric=True, full_range=full_range)
    assert qw.blocks == (3 if bits == 4 else 1) and dequantize(qw).shape == (80, 48)
    x = np.random.default_rng(1).standard_normal((2, 3, 80)).astype(np.float32)
    options_ort = ort.SessionOptions()
    options_ort.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # no DQ+MatMul fusion
    session = ort.InferenceSession(quantized.SerializeToString(), options_ort, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"X": x})[0], x @ dequantize(qw), rtol=1e-5, atol=1e-5)
    (layer,) = report["layers"]
    assert report["totals"]["quantized"] == 1
    assert (layer["note"] or "") == ("K=80 padded to 3 blocks of 32 (the last holds 16 values)" if bits == 4 else "")


@pytest.mark.parametrize("lowering", ["matmulnbits", "dequantize_linear"])
def test_quantizing_a_quantized_graph_again_is_an_error(lowering):
    once, _ = quantize.run(matmul_model(random_weight()), quantize.Options(bits=4, block_size=32, lowering=lowering))
    with pytest.raises(PassError, match="already quantized .* list quantize once in the recipe .* `overrides`"):
        quantize.run(once, quantize.Options(bits=8))


def test_the_refusal_to_quantize_again_counts_each_kind_of_node():
    """The refusal gave every quantized node's count under the first one's kind (10 GatherBlockQuantized where a
    graph held 9 MatMulNBits and 1 GatherBlockQuantized)."""
    once = onnx.ModelProto()
    once.CopyFrom(matmul_model(random_weight()))
    once.graph.node.append(onnx.helper.make_node("GatherBlockQuantized", ["table", "ids", "scales"], ["rows"],
                                                 name="embed_q4", domain="com.microsoft"))
    once.graph.node.append(onnx.helper.make_node("MatMulNBits", ["X", "codes", "scales"], ["product"],
                                                 name="proj_q4", domain="com.microsoft"))
    with pytest.raises(PassError, match=r"already quantized \(1 GatherBlockQuantized, 1 MatMulNBits nodes"):
        quantize.run(once, quantize.Options(bits=8))


def test_an_exclude_pattern_that_matches_nothing_is_an_error():
    with pytest.raises(PassError, match=re.escape("pattern(s) exclude '*lm_head*' match no MatMul")):
        quantize.run(matmul_model(random_weight()), quantize.Options(exclude=("proj", "*lm_head*")))


def test_exclude_by_weight_name():
    quantized, report = quantize.run(matmul_model(random_weight()), quantize.Options(exclude=("W",)))
    assert [n.op_type for n in quantized.graph.node] == ["MatMul"]
    assert report["skipped"] == [{"node": "proj", "reason": "excluded by pattern 'W'"}]


@pytest.mark.parametrize("accuracy_level", [0, 4])
def test_int8_kernel_block_keeps_the_weights_and_sets_the_kernel_block(accuracy_level):
    """INT8 per channel re-blocked for MatMulNBits in blocks of 16: the same dequantized weights (each channel's
    scale repeated), the kernel's block_size 16; with accuracy_level 4 onnxruntime quantizes activations per
    block, so its output moves, but only by activation rounding."""
    weight = random_weight()
    options = quantize.Options(bits=8, int8_kernel_block=16, accuracy_level=accuracy_level)
    quantized, report = quantize.run(matmul_model(weight), options)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in quantized.graph.node[0].attribute}
    assert attrs["block_size"] == 16 and attrs.get("accuracy_level", 0) == accuracy_level
    x = np.random.default_rng(1).standard_normal((2, 3, 64)).astype(np.float32)
    reference = x @ dequantize(quantize_rtn(weight, 8, 64, True))  # per channel: one block spans K = 64
    difference = np.abs(run_onnxruntime(quantized, x) - reference).max()
    print(f"int8 kernel block 16, accuracy_level {accuracy_level}: max abs diff {difference:.3g}")
    assert difference <= (1e-4 if accuracy_level == 0 else 0.05 * np.abs(reference).max())


@pytest.mark.parametrize("k, block", [(512, 256), (576, 64), (200, 128)])
def test_int8_per_channel_is_stored_in_the_largest_power_of_two_block_dividing_k(k, block):
    """Without int8_kernel_block each channel's scale is repeated over the largest power of two <= 256 dividing K,
    or over blocks of 128 when none from 16 does (K = 200: two blocks, the last padded); compiler/plan.py counts the
    stored scales by the same rule. K = 512 had been kept as one block of 512. The weights stay the per-channel ones."""
    weight = random_weight(k=k, n=16)
    quantized, _ = quantize.run(matmul_model(weight), quantize.Options(bits=8))
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in quantized.graph.node[0].attribute}
    assert attrs == {"K": k, "N": 16, "bits": 8, "block_size": block}
    x = np.random.default_rng(1).standard_normal((2, 3, k)).astype(np.float32)
    reference = x @ dequantize(quantize_rtn(weight, 8, k, True))  # per channel: one block spans K
    np.testing.assert_allclose(run_onnxruntime(quantized, x), reference, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("block", [8, 24, 512])
def test_int8_kernel_block_must_be_a_power_of_two_from_16_to_256(block):
    with pytest.raises(PassError, match=f"int8_kernel_block={block}: MatMulNBits needs a power of two from 16 to 256"):
        quantize.run(matmul_model(random_weight()), quantize.Options(bits=8, int8_kernel_block=block))


def test_full_range_is_refused_for_the_dequantize_linear_lowering():
    """TensorRT takes strictly positive scales: the signed-scale INT4 grid must not reach its lowering."""
    with pytest.raises(PassError, match="full_range: true needs negative scales"):
        quantize.run(matmul_model(random_weight()), quantize.Options(bits=4, lowering="dequantize_linear",
                                                                     full_range=True))
    quantized, _ = quantize.run(matmul_model(random_weight()), quantize.Options(bits=4, lowering="dequantize_linear"))
    scales = [onnx.numpy_helper.to_array(t) for t in quantized.graph.initializer if "scale" in t.name]
    assert scales and all((s > 0).all() for s in scales)  # the default there: positive scales, codes in [-7, 7]


@pytest.mark.parametrize("bits, option", [(4, "block_size"), (8, "int8_kernel_block")])
def test_a_block_larger_than_k_is_the_power_of_two_that_holds_k(bits, option):
    """K = 64: a block of 128 or 256 would pad each column to 2-4x its codes for the same grid; it becomes 64."""
    weight = random_weight(k=64)
    sizes = {}
    for block in (64, 128, 256):
        model, report = quantize.run(matmul_model(weight), quantize.Options(bits=bits, **{option: block}))
        sizes[block] = (report["layers"][0]["bytes_after"], report["layers"][0]["block_size"])
        node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
        assert next(a.i for a in node.attribute if a.name == "block_size") == 64
    assert sizes[128] == sizes[256] == sizes[64]
    with pytest.raises(PassError, match="from 16 to 256"):
        quantize.run(matmul_model(weight), quantize.Options(bits=bits, **{option: 512}))


def test_the_lm_head_is_selected_by_its_name(decoder_graphs):  # noqa: F811
    _, report = quantize.run(decoder_graphs["decode"], quantize.Options(
        bits=4, overrides=(quantize.Override("*lm_head*", bits=8),)))
    head = [layer for layer in report["layers"] if "lm_head" in layer["node"]]
    assert [(layer["node"], layer["bits"]) for layer in head] == [(LM_HEAD, 8)]


def two_readers_model(weight: np.ndarray, names=("first", "second")) -> onnx.ModelProto:
    """x -> MatMul(x, W) -> a and x -> MatMul(x, W) -> b: one float weight read by two nodes."""
    k, n = weight.shape
    nodes = [onnx.helper.make_node("MatMul", ["x", "W"], [output], name=name) for output, name in zip("ab", names)]
    graph = onnx.helper.make_graph(nodes, "two_readers", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, k])],
                                   [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, [2, 3, n]) for o in "ab"],
                                   [onnx.numpy_helper.from_array(weight, "W")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])


@pytest.mark.parametrize("lowering", ["matmulnbits", "dequantize_linear"])
def test_one_weight_quantized_two_ways_keeps_both_forms(lowering):
    """An override gives the second reader of W zero points: the two forms were both named W_q4 / W_scales, and
    graphsurgeon kept one, so the symmetric node read the asymmetric codes (differences of 13.9 in outputs of ~40)."""
    weight = random_weight(k=128, n=16)
    model = two_readers_model(weight)
    override = (quantize.Override("second", symmetric=False),)
    quantized, report = quantize.run(model, quantize.Options(bits=4, block_size=32, lowering=lowering,
                                                             overrides=override))
    names = [t.name for t in quantized.graph.initializer]
    assert len(names) == len(set(names)) and all(layer["bytes_after"] > 0 for layer in report["layers"])
    onnx.checker.check_model(quantized)
    x = np.random.default_rng(1).standard_normal((2, 3, 128)).astype(np.float32)
    exact = ort.SessionOptions()  # as stored: onnxruntime's optimizer would fuse DequantizeLinear into int8 products
    exact.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    first, second = ort.InferenceSession(quantized.SerializeToString(), exact,
                                         providers=["CPUExecutionProvider"]).run(None, {"x": x})
    full_range = lowering == "matmulnbits"  # the default for MatMulNBits (its signed codes reach -8)
    np.testing.assert_allclose(first, x @ dequantize(quantize_rtn(weight, 4, 32, True, full_range)), atol=1e-3)
    np.testing.assert_allclose(second, x @ dequantize(quantize_rtn(weight, 4, 32, False)), atol=1e-3)


@pytest.mark.parametrize("lowering", ["matmulnbits", "dequantize_linear"])
def test_one_weight_quantized_the_same_way_by_two_nodes_is_stored_once(lowering):
    quantized, report = quantize.run(two_readers_model(random_weight(k=128, n=16)),
                                     quantize.Options(bits=4, block_size=32, lowering=lowering))
    first, second = report["layers"]
    assert first["bytes_after"] > 0 and second["bytes_after"] == 0
    assert len(quantized.graph.initializer) == len({t.name for t in quantized.graph.initializer})
    assert quantize.unique_initializer_bytes(quantized) == first["bytes_after"]


def test_unnamed_matmuls_get_distinct_node_names():
    """ONNX allows unnamed nodes; both became MatMulNBits named "_q4", which the checker refuses."""
    quantized, _ = quantize.run(two_readers_model(random_weight(k=64, n=16), names=("", "")),
                                quantize.Options(bits=4, block_size=16))
    assert sorted(n.name for n in quantized.graph.node) == ["a_q4", "b_q4"]
    onnx.checker.check_model(quantized)


def test_quantizing_reads_each_weight_when_it_needs_it_not_all_at_once():
    """Six 32 MB weights, in a fresh process: the pass had read every weight into its constant to check its rank and
    type (kept there to the pass's end), so its peak rose by a copy of all of them on top of the new model; it now
    reads one at a time."""
    from tests.peak_memory import peak_growth_mb

    grown = peak_growth_mb("from passes import quantize\nmodel = matmul_model(6, 2048, 4096, random=True)", """
        result, report = quantize.run(model, quantize.Options(bits=4, block_size=32, method="rtn", embedding="float"))
        assert len(report["layers"]) == 6, report
    """)
    assert grown < 6 * 32, grown  # 139 MB (331 MB before) over 192 MB of float weights


def test_a_partial_last_block_is_padded_with_zeros_that_do_not_widen_its_scale():
    """K = 40 in blocks of 32: the last block holds 8 weights and 24 padding. The padding must encode 0 (the
    midpoint code, symmetric) and leave the block's scale to its own 8 weights; the other tests compare against a
    reference padded the same way, so they would agree with any padding."""
    rng = np.random.default_rng(5)
    weight = (0.06 * rng.standard_normal((40, 6))).astype(np.float32)
    qw = quantize_rtn(weight, 4, 32, symmetric=True)
    codes = qw.codes.reshape(6, 2, 32)
    assert (codes[:, 1, 8:] == 8).all()  # 0 at 4 bits, symmetric: code 8
    np.testing.assert_allclose(qw.scales[:, 1], np.abs(weight[32:]).max(axis=0) / 7, rtol=1e-6)


@pytest.mark.parametrize("attributes, quantized", [({"transB": 1}, True), ({"transB": 1, "alpha": 2.0}, False),
                                                   ({"transB": 0}, False)])
def test_a_gemm_is_quantized_only_when_it_is_a_at_b_transposed(attributes, quantized):
    """A Gemm with alpha 2 computes 2 (A @ Bᵀ): lowered to MatMulNBits, the factor was dropped and the logits
    halved, with nothing to say so."""
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((16, 64)).astype(np.float32)  # [N, K], as transB reads it
    if not attributes.get("transB"):
        weight = np.ascontiguousarray(weight.T)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gemm", ["x", "w"], ["y"], name="lm_head", **attributes)], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 64])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 16])],
        [onnx.numpy_helper.from_array(weight, "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    result, report = quantize.run(model, quantize.Options(bits=8))
    assert (report["totals"]["quantized"] == 1) == quantized, report
    x = {"x": rng.standard_normal((3, 64)).astype(np.float32)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]  # noqa: E731
    expected = run(model)  # per-channel int8 moves it by well under 2% of its range; alpha 2 dropped: by half
    np.testing.assert_allclose(run(result), expected, atol=0.02 * np.abs(expected).max())


def as_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its float32 initializers, inputs and outputs in float16."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    for tensor in result.graph.initializer:
        if tensor.data_type == onnx.TensorProto.FLOAT:
            values = onnx.numpy_helper.to_array(tensor).astype(np.float16)
            tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
    for value in (*result.graph.input, *result.graph.output):
        if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    return result


def test_a_float16_matmul_gets_float16_scales():
    """MatMulNBits takes its scales in A's type: float32 scales beside float16 activations fail to load."""
    weight = random_weight().astype(np.float16)
    quantized, _ = quantize.run(as_float16(matmul_model(weight.astype(np.float32))), quantize.Options(bits=4))
    scales = next(t for t in quantized.graph.initializer if t.name.endswith("_scales"))
    assert scales.data_type == onnx.TensorProto.FLOAT16
    x = np.random.default_rng(1).standard_normal((2, 3, 64)).astype(np.float16)
    expected = x.astype(np.float32) @ dequantize(quantize_rtn(weight, 4, 32, True, full_range=True)).astype(np.float16)
    actual = run_onnxruntime(quantized, x)
    assert actual.dtype == np.float16
    difference = np.abs(actual - expected).max() / np.abs(expected).max()
    assert difference < 2e-3  # float16 accumulation over K = 64


def gather_model(table: np.ndarray) -> onnx.ModelProto:
    """ids -> Gather(E [V, H]) -> x: an embedding without a tied lm_head."""
    row_type = onnx.helper.np_dtype_to_tensor_dtype(table.dtype)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gather", ["E", "ids"], ["x"], name="embed")], "embedding",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [None])],
        [onnx.helper.make_tensor_value_info("x", row_type, [None, table.shape[1]])],
        initializer=[onnx.numpy_helper.from_array(table, "E")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])


@pytest.mark.parametrize("symmetric, dtype", [(False, np.float32), (True, np.float16)])
def test_a_quantized_embedding_gathers_the_rows_of_the_numpy_reference(symmetric, dtype):
    """GatherBlockQuantized over the table's rows (H = 80: 3 blocks of 32, the last padded and sliced off): with zero
    points (without them the kernel assumes the midpoint, 8) and with float16 scales for a float16 table."""
    table = random_weight(k=96, n=80).astype(dtype)  # [V, H]; row 0 all positive
    quantized, report = quantize.run(gather_model(table), quantize.Options(bits=4, symmetric=symmetric,
                                                                          embedding="quantized"))
    assert report["embedding"]["kernel"] == "com.microsoft.GatherBlockQuantized"
    ids = np.array([0, 7, 95, 7])
    session = ort.InferenceSession(quantized.SerializeToString(), providers=["CPUExecutionProvider"])
    rows = session.run(None, {"ids": ids})[0]
    expected = dequantize(quantize_rtn(table.T.copy(), 4, 32, symmetric, full_range=symmetric)).T[ids].astype(dtype)
    assert rows.dtype == dtype
    np.testing.assert_allclose(rows.astype(np.float32), expected.astype(np.float32), rtol=0, atol=1e-3)


# -- options that no layer uses, overrides that never apply: refused, as a pattern matching nothing is --
def two_matmuls() -> onnx.ModelProto:
    """x -> MatMul 'gate_proj' (W1) and x -> MatMul 'down_proj' (W2)."""
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal((64, 32)).astype(np.float32) for name in ("W1", "W2")}
    nodes = [onnx.helper.make_node("MatMul", ["x", w], [o], name=n)
             for w, o, n in (("W1", "a", "gate_proj"), ("W2", "b", "down_proj"))]
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 64])],
        [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, [1, 3, 32]) for o in "ab"],
        [onnx.numpy_helper.from_array(v, k) for k, v in weights.items()])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])


def test_an_override_shadowed_by_an_earlier_one_is_an_error():
    # The user wants down_proj in INT8, but "*proj*" matches it first: down_proj silently stays INT4 today.
    options = quantize.Options(bits=4, overrides=(quantize.Override("*proj*", block_size=16),
                                                  quantize.Override("down_proj", bits=8)))
    with pytest.raises(PassError, match=r"overrides\[1\] 'down_proj' never applies"):
        quantize.run(two_matmuls(), options)


def test_an_override_of_excluded_nodes_only_is_an_error():
    options = quantize.Options(bits=4, exclude=("down_proj",), overrides=(quantize.Override("down_proj", bits=8),))
    # it said to put the narrower pattern first, which cannot help: exclude always comes first
    with pytest.raises(PassError, match=r"overrides\[0\] 'down_proj' never applies: every node it matches is "
                                        r"excluded \(by 'down_proj'\), and exclude is applied before overrides"):
        quantize.run(two_matmuls(), options)


def test_an_override_that_sets_nothing_is_an_error():
    with pytest.raises(PassError, match=r"overrides\[0\] \('down_proj'\) sets nothing"):
        quantize.run(two_matmuls(), quantize.Options(bits=4, overrides=(quantize.Override("down_proj"),)))


def test_overrides_that_each_claim_a_node_still_build():
    options = quantize.Options(bits=4, overrides=(quantize.Override("down_proj", bits=8),
                                                  quantize.Override("*proj*", block_size=16)))
    _, report = quantize.run(two_matmuls(), options)
    assert {layer["node"]: (layer["bits"], layer["block_size"]) for layer in report["layers"]} == \
        {"gate_proj": (4, 16), "down_proj": (8, 64)}


@pytest.mark.parametrize("options, message", [
    (dict(bits=4, symmetric=False, full_range=True), "full_range: true applies to symmetric INT4 only"),
    (dict(bits=8, full_range=True), "full_range: true applies to symmetric INT4 only"),
    (dict(bits=4, method="rtn", gptq_act_order=True), "gptq_act_order: true applies to method gptq or awq_gptq"),
    (dict(bits=4, int8_kernel_block=32), "int8_kernel_block applies to INT8 layers"),
])
def test_an_option_no_layer_uses_is_an_error(options, message):
    with pytest.raises(PassError, match=message):
        quantize.run(two_matmuls(), quantize.Options(**options))


def test_full_range_with_an_int4_symmetric_override_is_accepted():
    options = quantize.Options(bits=8, full_range=True, overrides=(quantize.Override("gate_proj", bits=4),))
    _, report = quantize.run(two_matmuls(), options)
    assert [layer["full_range"] for layer in report["layers"]] == [True, False]


# -- option checks, overrides and block sizes that no test pinned ----------------------
@pytest.mark.parametrize("block", [8, 24])
def test_an_int4_block_size_below_16_or_not_a_power_of_two_is_an_error(block):
    with pytest.raises(PassError, match=re.escape(f"quantize: block_size={block}: MatMulNBits needs a power of two "
                                                  f"from 16 to 256")):
        quantize.run(matmul_model(random_weight()), quantize.Options(bits=4, block_size=block))


@pytest.mark.parametrize("options, message", [
    (dict(bits=8, block_size=64), "quantize: block_size=64 with bits=8: INT8 has one scale per output channel"),
    (dict(bits=8, symmetric=False), "quantize: symmetric=false with bits=8: INT8 is symmetric per output channel"),
    (dict(bits=4, overrides=(quantize.Override("down_proj", bits=8, block_size=64),)),
     "quantize: overrides[0] ('down_proj'): block_size=64 with bits=8"),
    (dict(bits=4, overrides=(quantize.Override("down_proj", bits=8, symmetric=False),)),
     "quantize: overrides[0] ('down_proj'): symmetric=false with bits=8"),
    (dict(bits=4, overrides=(quantize.Override("down_proj", block_size=24),)),
     "quantize: overrides[0] ('down_proj'): block_size=24: MatMulNBits needs a power of two"),
    (dict(accuracy_level=5), "quantize: accuracy_level=5: MatMulNBits takes 0 (unset)"),
    (dict(max_rewrites=-1), "quantize: max_rewrites=-1 must be >= 0"),
    # a skipped override's settings would be no layer's: refused as such before full_range is weighed
    (dict(bits=8, full_range=True, overrides=(quantize.Override("gate_proj", bits=4, skip=True),)),
     "quantize: overrides[0] ('gate_proj'): skip: true keeps these layers float, so bits would do nothing"),
])
def test_int8_blocks_and_zero_points_and_out_of_range_options_are_errors(options, message):
    with pytest.raises(PassError, match=re.escape(message)):
        quantize.run(two_matmuls(), quantize.Options(**options))


def test_an_int8_override_of_an_asymmetric_int4_recipe_is_symmetric_per_channel():
    """bits=8 alone on an override of a symmetric=false recipe: INT8 is symmetric, the layer's zero points dropped."""
    options = quantize.Options(bits=4, symmetric=False, overrides=(quantize.Override("down_proj", bits=8),))
    _, report = quantize.run(two_matmuls(), options)
    layers = {layer["node"]: (layer["bits"], layer["symmetric"], layer["full_range"]) for layer in report["layers"]}
    assert layers == {"gate_proj": (4, False, False), "down_proj": (8, True, False)}


def test_an_int4_override_inherits_the_lowerings_default_full_range():
    """full_range unset: on for MatMulNBits, for an overridden INT4 layer as for the others."""
    options = quantize.Options(bits=4, overrides=(quantize.Override("down_proj", block_size=16),))
    _, report = quantize.run(two_matmuls(), options)
    assert {layer["node"]: (layer["block_size"], layer["full_range"]) for layer in report["layers"]} == \
        {"gate_proj": (32, True), "down_proj": (16, True)}


def test_settings_beside_skip_or_for_another_lowering_are_errors_not_dropped():
    """skip: true with bits: 8 kept the layers float and dropped the 8 unsaid; int8_kernel_block with
    lowering dequantize_linear built byte-identical weights whatever it was."""
    skipped = quantize.Options(bits=4, overrides=(quantize.Override("down_proj", bits=8, skip=True),))
    with pytest.raises(PassError, match=r"overrides\[0\] \('down_proj'\): skip: true keeps these layers float, so "
                                        r"bits would do nothing"):
        quantize.run(two_matmuls(), skipped)
    dq = quantize.Options(bits=8, int8_kernel_block=16, lowering="dequantize_linear")
    with pytest.raises(PassError, match="int8_kernel_block sets MatMulNBits' blocks, and lowering dequantize_linear"):
        quantize.run(two_matmuls(), dq)


def test_an_override_with_skip_keeps_its_layers_float():
    options = quantize.Options(bits=4, overrides=(quantize.Override("down_proj", skip=True),))
    quantized, report = quantize.run(two_matmuls(), options)
    assert [layer["node"] for layer in report["layers"]] == ["gate_proj"]
    assert report["skipped"] == [{"node": "down_proj", "reason": "kept float by override 'down_proj'"}]
    assert sorted(n.op_type for n in quantized.graph.node) == ["MatMul", "MatMulNBits"]


@pytest.mark.parametrize("limit, quantized", [(0, []), (1, ["gate_proj"]), (2, ["gate_proj", "down_proj"])])
def test_max_rewrites_quantizes_only_that_many(limit, quantized):
    result, report = quantize.run(two_matmuls(), quantize.Options(bits=4, max_rewrites=limit))
    assert [layer["node"] for layer in report["layers"]] == quantized
    assert report["skipped"] == [{"node": node, "reason": f"max_rewrites={limit}"}
                                 for node in ("gate_proj", "down_proj") if node not in quantized]
    assert [n.op_type for n in result.graph.node].count("MatMulNBits") == len(quantized)


def test_gptq_act_order_is_accepted_when_an_override_uses_awq_gptq():
    from passes.calibration import CalibrationSpec

    quantize.check_options(quantize.Options(bits=4, gptq_act_order=True, calibration=CalibrationSpec(),
                                            overrides=(quantize.Override("down_proj", method="awq_gptq"),)))
    quantize.check_options(quantize.Options(bits=4, method="awq_gptq", gptq_act_order=True,
                                            calibration=CalibrationSpec()))


@pytest.mark.parametrize("options", [quantize.Options(bits=4, method="awq"),
                                     quantize.Options(bits=8, overrides=(quantize.Override("*mlp*", method="gptq"),))])
def test_a_calibrated_method_without_calibration_is_refused_before_the_export(options):
    """It was refused only when the pass ran, after the export and the passes before it."""
    with pytest.raises(PassError, match=r"quantize: method (awq|gptq) needs calibration data: set `calibration`"):
        quantize.check_options(options)


def test_a_k_of_16_keeps_one_block_of_16():
    """K = 16 with blocks of 32: the smallest block MatMulNBits takes (16), not a padded 32; the report says so (the
    README had said a padded block, and the report nothing)."""
    weight = random_weight(k=16)
    quantized, report = quantize.run(matmul_model(weight), quantize.Options(bits=4, block_size=32))
    (layer,) = report["layers"]
    assert layer["block_size"] == 16 and layer["note"] == "block_size 32 > K=16: one block of 16"
    assert layer["kernel_block"] == 16  # MatMulNBits' blocks, as the node's attribute says
    node = next(n for n in quantized.graph.node if n.op_type == "MatMulNBits")
    assert next(a.i for a in node.attribute if a.name == "block_size") == 16


def test_a_gemm_that_transposes_a_or_a_one_d_activation_is_left_float():
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((16, 64)).astype(np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gemm", ["x", "w"], ["y"], name="lm_head", transA=1, transB=1)], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [64, 3])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 16])],
        [onnx.numpy_helper.from_array(weight, "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    _, report = quantize.run(model, quantize.Options(bits=8))
    assert report["skipped"] == [{"node": "lm_head", "reason": "Gemm is not A @ Bᵀ without bias"}]
    vector = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["X", "W"], ["Y"], name="proj")], "v",
        [onnx.helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [64])],
        [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [48])],
        [onnx.numpy_helper.from_array(random_weight(), "W")])
    _, report = quantize.run(onnx.helper.make_model(vector, opset_imports=[onnx.helper.make_opsetid("", 21)]),
                             quantize.Options(bits=4))
    assert report["skipped"] == [{"node": "proj", "reason": "A is 1-D; MatMulNBits needs A of rank >= 2"}]


def test_the_report_counts_a_float16_weight_at_two_bytes_a_value():
    _, report = quantize.run(as_float16(matmul_model(random_weight())), quantize.Options(bits=4))
    assert report["layers"][0]["bytes_before"] == 64 * 48 * 2 == report["totals"]["weight_bytes_before"]


def test_an_embedding_whose_int4_rows_are_not_whole_bytes_stays_float():
    table = random_weight(k=96, n=17)  # [V, H]: H = 17 at 4 bits is 8.5 bytes a row
    _, report = quantize.run(gather_model(table), quantize.Options(bits=4, embedding="quantized"))
    assert report["embedding"] == {"quantized": False, "node": "embed",
                                   "reason": "hidden size 17 x 4 bits is not whole bytes per row"}


def test_the_dequantize_linear_lowering_asks_onnxruntime_for_the_float_product_it_writes():
    """onnxruntime fuses DequantizeLinear -> MatMul into MatMulNBits at accuracy level 4 by default: int8 activations,
    1.7 off a largest output of 269 here, where the graph says x @ dequantized W. The lowering now records the
    session entry that keeps the float product (the recipe's accuracy_level, 0 unless set)."""
    from passes.session_config import session_config

    rng = np.random.default_rng(0)
    k, n = 256, 128
    weight = rng.standard_normal((k, n)).astype(np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W"], ["y"], name="proj")], "one_projection",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, n])],
        initializer=[onnx.numpy_helper.from_array(weight, "W")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    x = rng.standard_normal((4, k)).astype(np.float32) * np.linspace(0.1, 10, k).astype(np.float32)

    def run(quantized, entries):
        options = ort.SessionOptions()
        for key, value in entries.items():
            options.add_session_config_entry(key, value)
        session = ort.InferenceSession(quantized.SerializeToString(), options, providers=["CPUExecutionProvider"])
        dequantized = session.run(None, {"x": np.eye(k, dtype=np.float32)})[0].astype(np.float64)  # one-hot rows: exact
        return np.abs(session.run(None, {"x": x})[0] - x.astype(np.float64) @ dequantized).max()

    quantized, report = quantize.run(model, quantize.Options(bits=4, block_size=32, lowering="dequantize_linear"))
    assert report["session_config"] == session_config(quantized) == {"session.qdq_matmulnbits_accuracy_level": "0"}
    assert run(quantized, session_config(quantized)) < 1e-3
    assert run(quantized, {}) > 0.1  # onnxruntime's default: what the recorded entry is for
    fast, _ = quantize.run(model, quantize.Options(bits=4, block_size=32, lowering="dequantize_linear", accuracy_level=4))
    assert session_config(fast) == {"session.qdq_matmulnbits_accuracy_level": "4"}


def test_only_a_gather_of_rows_is_taken_for_the_embedding():
    """GatherBlockQuantized gathers rows (gather_axis 0): a Gather along axis 1 (a table read by columns, in an
    imported graph) was rewritten into one, with another shape and other values, silently."""
    from onnx import TensorProto, helper, numpy_helper

    table = np.random.default_rng(0).standard_normal((64, 40)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Gather", ["T", "ids"], ["columns"], axis=1, name="pick_columns")],
                              "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("columns", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(table, "T")])
    model, report = quantize.run(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]),
                                 quantize.Options(bits=4, block_size=32, embedding="quantized"))
    assert report["embedding"]["quantized"] is False and "rows" in report["embedding"]["reason"]
    assert [node.op_type for node in model.graph.node] == ["Gather"]
