"""Lowering of a `QuantizedWeight` to onnxruntime's contrib kernels (domain com.microsoft).

    A ---> MatMul ---> Y                 A ---> MatMulNBits(K, N, bits, block_size[, accuracy_level]) ---> Y
    W [K, N] --^                  =>     B [N, blocks, block_size*bits/8], scales [N, blocks] (, zero_points) --^

    E [V, H] ---> Gather ---> Y          data [V, H*bits/8], scales [V, H/block] (, zero_points)
    ids ----------^               =>     ids ---> GatherBlockQuantized(gather_axis=0, quantize_axis=1) ---> Y

A tied embedding table is the lm_head's weight read row by row (V output channels, blocks along H), so the
gather's data holds the same bytes as the lm_head's MatMulNBits B: the artifact writer stores equal contents
once (with a partial last block the gathered rows are padded too, and a Slice trims them). Both ops default to the midpoint zero point when none is given, as the representation does.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from passes.quantized_weights import QuantizedWeight, kernel_block, pack_matmulnbits

MICROSOFT_DOMAIN = "com.microsoft"


def for_matmulnbits(qw: QuantizedWeight, per_channel_block: int | None = None) -> QuantizedWeight:
    """qw in blocks MatMulNBits accepts (a power of two from 16 to 256). INT8 per channel (one block of K, e.g. 576
    or 2048) is re-expressed exactly: the channel's scale repeated over power-of-two blocks (per_channel_block, or the
    largest <= 256 dividing K), a partial last block padded."""
    size = qw.block_size
    per_channel = qw.bits == 8 and -(-qw.k // size) == 1  # INT8 per channel: one block spans K
    # kept only in blocks kernel_block could give (16 to 256): an INT8 channel over a power-of-two K > 256 is
    # re-expressed, as Options.int8_kernel_block's default and compiler/plan.py's count have it
    if 16 <= size <= 256 and size & (size - 1) == 0 and not (per_channel and per_channel_block not in (None, size)):
        return qw
    size = kernel_block(qw.k, per_channel_block)
    blocks = -(-qw.k // size)
    fill = (1 << (qw.bits - 1)) if qw.zero_points is None else qw.zero_points  # the code of 0 in each row
    codes = np.empty((qw.n, blocks * size), np.uint8)
    codes[:, :] = fill if np.isscalar(fill) else fill[:, :1]
    codes[:, : qw.k] = qw.unpadded_codes
    zero_points = None if qw.zero_points is None else np.repeat(qw.zero_points[:, :1], blocks, axis=1)
    return QuantizedWeight(codes, np.repeat(qw.scales[:, :1], blocks, axis=1), zero_points, qw.bits, size, qw.k, qw.n)


def matmulnbits_constants(name: str, qw: QuantizedWeight, dtype: np.dtype) -> list[gs.Constant]:
    """MatMulNBits' B, scales (in A's float type) and, when asymmetric, zero_points."""
    blob, scales, zero_points = pack_matmulnbits(qw)
    constants = [gs.Constant(f"{name}_q{qw.bits}", blob), gs.Constant(f"{name}_scales", scales.astype(dtype))]
    if zero_points is not None:
        constants.append(gs.Constant(f"{name}_zero_points", zero_points))
    return constants


def rewrite_matmulnbits(graph: gs.Graph, node: gs.Node, activation: gs.Variable, qw: QuantizedWeight,
                        constants: list[gs.Constant], accuracy_level: int) -> None:
    """Replace `node` (a MatMul, or a Gemm already known to compute activation @ W) by MatMulNBits."""
    output = node.outputs[0]
    name = f"{node.name or output.name}_q{qw.bits}"  # an unnamed MatMul: two nodes named "_q4" fail the checker
    node.outputs.clear()
    node.inputs.clear()
    attrs = {"K": qw.k, "N": qw.n, "bits": qw.bits, "block_size": qw.block_size}
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    graph.nodes.append(gs.Node("MatMulNBits", name=name, domain=MICROSOFT_DOMAIN,
                               attrs=attrs, inputs=[activation, *constants], outputs=[output]))


def rewrite_gather_block_quantized(graph: gs.Graph, gather: gs.Node, qw: QuantizedWeight, dtype: np.dtype) -> int:
    """Replace Gather(table [V, H], ids) by GatherBlockQuantized over qw (K = H, N = V); returns bytes stored.

    The data is MatMulNBits' B viewed as [V, blocks * block_size * bits / 8], the same bytes as a tied lm_head's,
    so the table is stored once. With a partial last block that row is wider than H: a Slice keeps the first H.
    """
    blob, scales, zero_points = pack_matmulnbits(qw)
    name = gather.inputs[0].name
    constants = [gs.Constant(f"{name}_gather_q{qw.bits}", blob.reshape(qw.n, -1)),
                 gather.inputs[1], gs.Constant(f"{name}_gather_scales", scales.astype(dtype))]
    if zero_points is not None:
        constants.append(gs.Constant(f"{name}_gather_zero_points", zero_points))
    output = gather.outputs[0]
    gather.outputs.clear()
    gather.inputs.clear()
    gathered = output
    if qw.padded:
        gathered = gs.Variable(f"{output.name}_padded", dtype=output.dtype)
        bounds = [gs.Constant(f"{name}_gather_{what}", np.array([value], np.int64))
                  for what, value in (("starts", 0), ("ends", qw.k), ("axes", -1))]
        graph.nodes.append(gs.Node("Slice", name=f"{gather.name}_unpad", inputs=[gathered, *bounds], outputs=[output]))
    graph.nodes.append(gs.Node(
        "GatherBlockQuantized", name=f"{gather.name}_q{qw.bits}", domain=MICROSOFT_DOMAIN,
        attrs={"gather_axis": 0, "quantize_axis": 1, "block_size": qw.block_size, "bits": qw.bits},
        inputs=constants, outputs=[gathered]))
    return sum(int(c.values.nbytes) for c in constants if isinstance(c, gs.Constant))
