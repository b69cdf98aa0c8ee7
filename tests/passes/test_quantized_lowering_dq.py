"""quantized_lowering_dq: a QuantizedWeight lowered to DequantizeLinear (opset 21) -> MatMul, run in onnxruntime.

Needs onnxruntime (CPU) only. Each check compares with `X @ dequantize(qw)`, the numpy reference of the same
quantized weights, so it tests the layout, signedness, 4-bit packing and the op's reading of them, not the
rounding. onnxruntime 1.32's CPU DequantizeLinear-21 runs every format here: INT8 per axis, INT4 blocked
(axis 0, block_size) symmetric and UINT4 blocked with zero points, in float32 and float16.

At ORT_ENABLE_EXTENDED and above, onnxruntime's CPU optimizer fuses DequantizeLinear -> MatMul into
com.microsoft.MatMulNBits (INT8 per channel too, re-blocked to block_size 32) with accuracy_level 4 by default,
which quantizes the activations to int8 and moves the result ~1% from the reference; the session option
`session.qdq_matmulnbits_accuracy_level = 0` keeps float activations, and then the result matches again.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest

from passes.quantized_lowering_dq import rewrite_dequantize_linear
from passes.quantized_weights import dequantize, quantize_rtn

K, N = 256, 96
FORMATS = {  # name: (bits, block_size or None for per channel, symmetric)
    "int8_per_channel": (8, None, True),
    "int4_block32_sym": (4, 32, True),
    "int4_block128_sym": (4, 128, True),
    "int4_block32_asym": (4, 32, False),
    "int4_one_block": (4, K, True),  # a block as long as K: still the blocked form (TensorRT reads INT4 no other way)
}


def random_weight(seed=0) -> np.ndarray:
    weight = np.random.default_rng(seed).standard_normal((K, N)).astype(np.float32)
    weight[:, 0] += 3.0   # all positive: the asymmetric range still includes 0
    weight[:32, 1] = 0.0  # an all-zero block
    return weight


def matmul_model(weight: np.ndarray, shared: bool = False, opset: int = 21) -> onnx.ModelProto:
    """Y = X @ W, and with `shared` also Z = X @ W: two MatMuls reading one weight."""
    nodes = [onnx.helper.make_node("MatMul", ["X", "W"], ["Y"], name="proj")]
    outputs = [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [2, 3, N])]
    if shared:
        nodes.append(onnx.helper.make_node("MatMul", ["X", "W"], ["Z"], name="proj_again"))
        outputs.append(onnx.helper.make_tensor_value_info("Z", onnx.TensorProto.FLOAT, [2, 3, N]))
    graph = onnx.helper.make_graph(
        nodes, "tiny", [onnx.helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [2, 3, K])], outputs,
        initializer=[onnx.numpy_helper.from_array(weight, "W")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])


def lower(model: onnx.ModelProto, bits: int, block_size: int, symmetric: bool):
    """Quantize W once and lower every MatMul reading it; returns the model, the weight and the bytes stored."""
    graph = gs.import_onnx(model)
    weight = graph.tensors()["W"].values
    qw = quantize_rtn(weight, bits, block_size, symmetric)
    cache, stored = {}, []
    for matmul in [n for n in graph.nodes if n.op == "MatMul"]:
        stored.append(rewrite_dequantize_linear(graph, matmul, qw, "W", np.dtype(np.float32), cache))
    graph.cleanup().toposort()
    return gs.export_onnx(graph), qw, stored


def initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def session(model: onnx.ModelProto, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL, optimized_path=None,
            fused_accuracy_level: int | None = None):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    if fused_accuracy_level is not None:  # the accuracy_level of the MatMulNBits that onnxruntime fuses to
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(fused_accuracy_level))
    if optimized_path:
        options.optimized_model_filepath = str(optimized_path)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_linear_in_onnxruntime_matches_the_numpy_reference(name):
    bits, block_size, symmetric = FORMATS[name]
    model, qw, _ = lower(matmul_model(random_weight()), bits, block_size or K, symmetric)
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "MatMul"]
    x = np.random.default_rng(1).standard_normal((2, 3, K)).astype(np.float32)
    expected = x @ dequantize(qw)
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        actual = session(model, level, fused_accuracy_level=0).run(None, {"X": x})[0]
        difference = np.abs(actual - expected).max() / np.abs(expected).max()
        print(f"{name} {level}: max relative difference {difference:.3g}")
        assert difference < 1e-5


@pytest.mark.parametrize("name", FORMATS)
def test_the_onnx_specs_reference_evaluator_reads_the_weights_as_numpy_does(name):
    """onnx's reference evaluator (the spec's DequantizeLinear-21: INT4 packing, blocked axis and block_size, zero
    point types) is independent of onnxruntime, whose reading TensorRT need not share."""
    from onnx.reference import ReferenceEvaluator

    bits, block_size, symmetric = FORMATS[name]
    model, qw, _ = lower(matmul_model(random_weight()), bits, block_size or K, symmetric)
    x = np.random.default_rng(1).standard_normal((2, 3, K)).astype(np.float32)
    np.testing.assert_allclose(ReferenceEvaluator(model).run(None, {"X": x})[0], x @ dequantize(qw), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", FORMATS)
def test_constants_are_stored_in_their_bit_width(name):
    bits, block_size, symmetric = FORMATS[name]
    model, qw, stored = lower(matmul_model(random_weight()), bits, block_size or K, symmetric)
    tensors = initializers(model)
    assert "W" not in tensors  # the float weight is gone
    codes = tensors[f"W_q{bits}"]
    assert list(codes.dims) == [K, N]
    expected_types = {(8, True): onnx.TensorProto.INT8, (4, True): onnx.TensorProto.INT4,
                      (4, False): onnx.TensorProto.UINT4}
    assert codes.data_type == expected_types[bits, symmetric]
    assert len(codes.raw_data) == K * N * bits // 8  # INT4: really packed two per byte
    scale_shape = [N] if block_size is None else [K // block_size, N]  # INT4 with one block: [1, N]
    assert list(tensors["W_scale"].dims) == scale_shape
    zero_point_bytes = 0
    if not symmetric:
        zero_point = tensors["W_zero_point"]
        assert zero_point.data_type == onnx.TensorProto.UINT4 and list(zero_point.dims) == scale_shape
        zero_point_bytes = len(zero_point.raw_data)
        assert zero_point_bytes == K // block_size * N // 2
    else:
        assert "W_zero_point" not in tensors  # signed codes: the default zero point 0 needs no tensor
    assert stored == [K * N * bits // 8 + int(np.prod(scale_shape)) * 4 + zero_point_bytes]


@pytest.mark.parametrize("name, attributes", [("int8_per_channel", {"axis": 1}),
                                              ("int4_one_block", {"axis": 0, "block_size": K}),
                                              ("int4_block32_sym", {"axis": 0, "block_size": 32})])
def test_int8_per_channel_is_per_axis_and_int4_is_always_blocked(name, attributes):
    bits, block_size, symmetric = FORMATS[name]
    model, _, _ = lower(matmul_model(random_weight()), bits, block_size or K, symmetric)
    node = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} == attributes


def test_int4_codes_are_signed_and_low_nibble_first():
    model, qw, _ = lower(matmul_model(random_weight()), 4, 32, True)
    codes = initializers(model)["W_q4"]
    first = codes.raw_data[0]  # elements [0, 0] and [0, 1] of the [K, N] tensor, the first in the low nibble
    low, high = first & 0xF, first >> 4
    as_signed = lambda nibble: nibble - 16 if nibble >= 8 else nibble  # noqa: E731
    assert [as_signed(low), as_signed(high)] == [int(qw.codes[0, 0]) - 8, int(qw.codes[1, 0]) - 8]


@pytest.mark.parametrize("name", ["int8_per_channel", "int4_block32_asym"])
def test_a_shared_weight_is_stored_and_dequantized_once(name):
    bits, block_size, symmetric = FORMATS[name]
    model, qw, stored = lower(matmul_model(random_weight(), shared=True), bits, block_size or K, symmetric)
    onnx.checker.check_model(model, full_check=True)
    assert sorted(n.op_type for n in model.graph.node) == ["DequantizeLinear", "MatMul", "MatMul"]
    assert stored[0] > 0 and stored[1] == 0
    assert len(model.graph.initializer) == (2 if symmetric else 3)
    x = np.random.default_rng(2).standard_normal((2, 3, K)).astype(np.float32)
    y, z = session(model).run(None, {"X": x})
    np.testing.assert_allclose(y, x @ dequantize(qw), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(y, z)


@pytest.mark.parametrize("opset", [19, 20])
def test_an_opset_below_21_is_refused(opset):
    graph = gs.import_onnx(matmul_model(random_weight(), opset=opset))
    qw = quantize_rtn(graph.tensors()["W"].values, 4, 32, True)
    with pytest.raises(ValueError, match="opset >= 21"):
        rewrite_dequantize_linear(graph, graph.nodes[0], qw, "W", np.dtype(np.float32), {})


@pytest.mark.parametrize("name", ["int8_per_channel", "int4_block32_sym", "int4_block32_asym"])
def test_float16_scales_follow_the_matmul_type(name):
    bits, block_size, symmetric = FORMATS[name]
    weight = random_weight().astype(np.float16)
    graph = gs.import_onnx(matmul_model(weight.astype(np.float32)))
    graph.tensors()["W"].values = weight
    graph.inputs[0].dtype = graph.outputs[0].dtype = np.float16
    qw = quantize_rtn(weight, bits, block_size or K, symmetric)
    rewrite_dequantize_linear(graph, graph.nodes[0], qw, "W", np.dtype(np.float16), {})
    graph.cleanup().toposort()
    model = gs.export_onnx(graph)
    onnx.checker.check_model(model, full_check=True)
    assert initializers(model)["W_scale"].data_type == onnx.TensorProto.FLOAT16
    x = np.random.default_rng(1).standard_normal((2, 3, K)).astype(np.float16)
    expected = x.astype(np.float32) @ dequantize(qw).astype(np.float16).astype(np.float32)
    actual = session(model).run(None, {"X": x})[0]
    assert actual.dtype == np.float16
    difference = np.abs(actual.astype(np.float32) - expected).max() / np.abs(expected).max()
    print(f"{name} float16: max relative difference {difference:.3g}")
    assert difference < 2e-3  # float16 accumulation over K=256


@pytest.mark.parametrize("name", FORMATS)
def test_onnxruntime_fuses_to_matmulnbits_with_int8_activations_by_default(name, tmp_path):
    """Pinned so that a change in onnxruntime's optimizer shows up here: at ORT_ENABLE_ALL (from EXTENDED on)
    every format here becomes one com.microsoft.MatMulNBits with accuracy_level 4 (int8 activations), unless
    the session sets `session.qdq_matmulnbits_accuracy_level`. ORT_ENABLE_BASIC leaves DequantizeLinear -> MatMul."""
    bits, block_size, symmetric = FORMATS[name]
    model, _, _ = lower(matmul_model(random_weight()), bits, block_size or K, symmetric)
    optimized_path = tmp_path / "optimized.onnx"
    session(model, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, optimized_path)
    nodes = onnx.load(str(optimized_path)).graph.node
    print(f"{name}: after ORT_ENABLE_ALL: {[n.op_type for n in nodes]}")
    assert [n.op_type for n in nodes] == ["MatMulNBits"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["bits"] == bits and attrs["accuracy_level"] == 4
    session(model, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, optimized_path)
    assert [n.op_type for n in onnx.load(str(optimized_path)).graph.node] == ["DequantizeLinear", "MatMul"]
