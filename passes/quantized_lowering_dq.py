"""Lowering of a `QuantizedWeight` to standard ONNX: `DequantizeLinear` (opset >= 21) feeding the same `MatMul`.

    A ---> MatMul ---> Y              A ------------------------------------------> MatMul ---> Y
    W [K, N] --^               =>     x [K, N], scale (, zero_point) -> DequantizeLinear --^

This is the form TensorRT and plain-ONNX backends read (onnxruntime's own lowering is MatMulNBits, in
`passes/quantized_lowering_ort.py`). DequantizeLinear computes y = (x - zero_point) * scale along [K, N], the
MatMul's own layout, so the codes are stored transposed back from the representation's [N, K]:

    INT8 per channel (one block along K):  scale [N],          axis=1                  (per-axis form)
    INT4, and INT8 in blocks along K:      scale [K/block, N], axis=0, block_size=block (blocked form, opset 21)

INT4 takes the blocked form even when one block spans K (a small layer): TensorRT reads INT4 weights only with
per-block scales ("supported block sizes are {64, 128}"), never per channel.

Symmetric weights are stored signed (codes - midpoint: INT8 for 8 bits, INT4 for 4) with no zero-point tensor,
since the signed types' default zero point is 0; asymmetric weights are stored unsigned (UINT8 / UINT4) with a
zero point of the same type and the scale's shape. The scale has the MatMul's float type.

INT4 / UINT4 initializers are made by `onnx.numpy_helper.from_array` on an `ml_dtypes.int4` / `uint4` array,
which packs two values per byte into raw_data (element 2i in the low nibble, the ONNX layout), and are handed
to graphsurgeon as `gs.Constant(values=LazyValues(tensor_proto))`, which it exports as that proto unchanged.
A plain `gs.Constant(name, int4_array)` does not work with onnx_graphsurgeon 0.6: its exporter writes
`values.tobytes()` (one byte per element, as numpy holds ml_dtypes.int4) and onnx.helper.make_tensor rejects it
("Raw data size does not match tensor's size").
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes.quantized_weights import QuantizedWeight

MIN_OPSET = 21  # INT4/UINT4 and the blocked form (block_size attribute) of DequantizeLinear
SIGNED = {4: ml_dtypes.int4, 8: np.int8}     # symmetric: codes - midpoint, zero point 0 (no tensor)
UNSIGNED = {4: ml_dtypes.uint4, 8: np.uint8}  # asymmetric: codes as they are, with a zero-point tensor


def default_opset(graph: gs.Graph) -> int:
    """The default-domain opset the graph will be exported with (import_domains wins over graph.opset)."""
    for opset in graph.import_domains or []:
        if opset.domain in ("", "ai.onnx"):
            return opset.version
    return graph.opset


def packed_tensor(name: str, values: np.ndarray) -> onnx.TensorProto:
    """The ONNX tensor of `values`, raw_data packed the ONNX way (4-bit types: two per byte, low nibble first)."""
    return onnx.numpy_helper.from_array(np.ascontiguousarray(values), name)


def per_axis(qw: QuantizedWeight) -> bool:
    """INT8 per channel takes DequantizeLinear's per-axis form; everything else its blocked form."""
    return qw.bits == 8 and qw.blocks == 1


def per_block_layout(values: np.ndarray, qw: QuantizedWeight) -> np.ndarray:
    """[N, blocks] -> the layout DequantizeLinear reads along [K, N]: [N] per axis, [blocks, N] blocked."""
    return values[:, 0] if per_axis(qw) else values.T


def dequantize_linear_inputs(qw: QuantizedWeight, weight_name: str,
                             dtype: np.dtype) -> tuple[list[onnx.TensorProto], dict]:
    """DequantizeLinear's x, x_scale (, x_zero_point) tensors in [K, N] layout, and its attributes."""
    if qw.zero_points is None:
        x = (qw.unpadded_codes.T.astype(np.int16) - (1 << (qw.bits - 1))).astype(SIGNED[qw.bits])  # [K, N]
    else:
        x = qw.unpadded_codes.T.astype(UNSIGNED[qw.bits])
    tensors = [packed_tensor(f"{weight_name}_q{qw.bits}", x),
               packed_tensor(f"{weight_name}_scale", per_block_layout(qw.scales, qw).astype(dtype))]
    if qw.zero_points is not None:
        zero_points = per_block_layout(qw.zero_points, qw).astype(UNSIGNED[qw.bits])
        tensors.append(packed_tensor(f"{weight_name}_zero_point", zero_points))
    attrs = {"axis": 1} if per_axis(qw) else {"axis": 0, "block_size": qw.block_size}
    return tensors, attrs


def rewrite_dequantize_linear(graph: gs.Graph, matmul: gs.Node, qw: QuantizedWeight, weight_name: str,
                              dtype: np.dtype, cache: dict) -> int:
    """Replace matmul's constant B input by DequantizeLinear(codes, scale[, zero_point]) -> the same MatMul.
    Returns the number of bytes the new constants store. `cache` maps weight_name -> the DequantizeLinear
    output variable, so a weight shared by several MatMuls is stored and dequantized once (0 bytes the
    second time). The old float constant stays in the graph until the caller's cleanup() drops it."""
    opset = default_opset(graph)
    if opset < MIN_OPSET:
        raise ValueError(f"DequantizeLinear with INT4 / blocked scales needs opset >= {MIN_OPSET}; "
                         f"the graph imports opset {opset}")
    if weight_name in cache:
        matmul.inputs[1] = cache[weight_name]
        return 0
    tensors, attrs = dequantize_linear_inputs(qw, weight_name, dtype)
    # LazyValues: graphsurgeon exports the proto as it is, keeping 4-bit raw_data packed (see the docstring).
    constants = [gs.Constant(t.name, gs.ir.tensor.LazyValues(t)) for t in tensors]
    weight = gs.Variable(f"{weight_name}_dequantized", dtype=np.dtype(dtype), shape=[qw.k, qw.n])
    graph.nodes.append(gs.Node("DequantizeLinear", name=f"{weight_name}_DequantizeLinear", attrs=attrs,
                               inputs=constants, outputs=[weight]))
    matmul.inputs[1] = weight
    cache[weight_name] = weight
    return sum(len(t.raw_data) for t in tensors)
