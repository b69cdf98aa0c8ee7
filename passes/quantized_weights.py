"""The compiler's one representation of a weight-only quantized matrix, its round-to-nearest quantizer, its
numpy dequantization (the reference every lowering is checked against), and its packing for onnxruntime's
`com.microsoft.MatMulNBits`.

A float weight W is [K, N] (MatMul's B: K is the reduction axis). The codes are stored transposed, [N, K], the
way MatMulNBits and DequantizeLinear-per-channel both read them: one row per output channel, blocks along K.
When the block size does not divide K, the last block is partial: the codes are padded with the code of 0 to
blocks * block_size columns (MatMulNBits' layout); DequantizeLinear reads the first K, and GatherBlockQuantized
reads the padded rows, a Slice after it keeping the first K.

    W[k, n] ~= (codes[n, k] - zero_point[n, k // block_size]) * scale[n, k // block_size]

When `zero_points` is None the zero point is the format's midpoint, 2**(bits-1) (8 for INT4, 128 for INT8),
which is also MatMulNBits' default when its zero_points input is absent, so symmetric weights need no tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class QuantizedWeight:
    codes: np.ndarray               # uint8 [N, blocks * block_size], unpacked unsigned codes in [0, 2**bits)
    scales: np.ndarray              # float32 [N, blocks]
    zero_points: np.ndarray | None  # uint8 [N, blocks], or None for the midpoint 2**(bits-1)
    bits: int
    block_size: int
    k: int
    n: int

    @property
    def blocks(self) -> int:
        return -(-self.k // self.block_size)  # ceil: a partial last block is padded

    @property
    def padded(self) -> bool:
        return self.k % self.block_size != 0

    @property
    def unpadded_codes(self) -> np.ndarray:
        """[N, K]: the codes of the weight's own elements."""
        return self.codes[:, : self.k]

    def zero_points_or_midpoint(self) -> np.ndarray:
        if self.zero_points is not None:
            return self.zero_points
        return np.full((self.n, self.blocks), 1 << (self.bits - 1), np.uint8)


def block_parameters(blocked: np.ndarray, bits: int, symmetric: bool,
                     full_range: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Scales and zero points (None when symmetric) of float blocks [..., block_size], reduced over the last axis.

    Symmetric: scale = max|w| / (2**(bits-1) - 1), codes offset by the midpoint (no zero-point tensor); the
    most negative code (0) is unused so that +max and -max are both exact. With full_range, all 2**bits codes are
    used, as onnxruntime's own blockwise quantizer does: the element of largest magnitude, with its sign, lands
    on code 0 (scale = that element / -2**(bits-1), negative when it is positive) and the other side reaches
    (2**(bits-1) - 1) / 2**(bits-1) of it, clipped beyond; a step 8/7 finer at 4 bits. TensorRT needs strictly
    positive scales, so only the onnxruntime lowering uses it. Asymmetric: the block's range, widened to include
    0 so that 0 stays exact, over 2**bits - 1 steps, with a rounded integer zero point.
    """
    levels = (1 << bits) - 1
    if symmetric and full_range:
        largest = np.take_along_axis(blocked, np.abs(blocked).argmax(axis=-1)[..., None], axis=-1)[..., 0]
        scales = largest / -float(1 << (bits - 1))
        return np.where(scales == 0, 1.0, scales).astype(np.float32), None
    if symmetric:
        scales = np.abs(blocked).max(axis=-1) / ((1 << (bits - 1)) - 1)
        return np.where(scales == 0, 1.0, scales).astype(np.float32), None  # an all-zero block: any scale is exact
    low, high = np.minimum(blocked.min(axis=-1), 0), np.maximum(blocked.max(axis=-1), 0)
    scales = np.where(high == low, 1.0, (high - low) / levels).astype(np.float32)
    zero_points = np.clip(np.rint(-low / scales), 0, levels).astype(np.uint8)
    return scales, zero_points


def encode(values: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, bits: int) -> np.ndarray:
    """Codes of `values` (broadcast against scales/zero points), rounded to nearest and clipped to the format."""
    zero = (1 << (bits - 1)) if zero_points is None else zero_points.astype(np.float32)
    return np.clip(np.rint(values / scales) + zero, 0, (1 << bits) - 1).astype(np.uint8)


def decode(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, bits: int) -> np.ndarray:
    """The float values of codes (broadcast like `encode`); encode(decode(c)) == c."""
    zero = (1 << (bits - 1)) if zero_points is None else zero_points.astype(np.float32)
    return (codes.astype(np.float32) - zero) * scales


def quantize_rtn(weight: np.ndarray, bits: int, block_size: int, symmetric: bool,
                 full_range: bool = False) -> QuantizedWeight:
    """Round-to-nearest quantization of a [K, N] float weight, blocks of `block_size` along K.

    Every element is within |scale|/2 of its dequantized value, or with full_range within |scale| (an element
    opposite the largest one and nearly as large is clipped); see `block_parameters` for the schemes.
    INT8 per channel is block_size = K. A partial last block is padded with zeros (which encode exactly).
    """
    if bits not in (4, 8):
        raise ValueError(f"bits={bits}: only 4 and 8 are supported")
    k, n = weight.shape
    blocks = -(-k // block_size)
    # [K, N] -> [N, blocks, block_size]: one row per output channel, split into blocks along K.
    blocked = pad_k(weight.astype(np.float32), blocks * block_size).T.reshape(n, blocks, block_size)
    scales, zero_points = block_parameters(blocked, bits, symmetric, full_range)
    codes = encode(blocked, scales[..., None], None if zero_points is None else zero_points[..., None], bits)
    return QuantizedWeight(codes.reshape(n, blocks * block_size), scales, zero_points, bits, block_size, k, n)


def pad_k(weight: np.ndarray, k: int) -> np.ndarray:
    """[K, N] with zero rows appended up to k."""
    return weight if weight.shape[0] == k else np.pad(weight, [(0, k - weight.shape[0]), (0, 0)])


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """The numpy reference: back to a [K, N] float32 weight."""
    codes = qw.codes.reshape(qw.n, qw.blocks, qw.block_size)
    zero_points = None if qw.zero_points is None else qw.zero_points[..., None]
    blocked = decode(codes, qw.scales[..., None], zero_points, qw.bits)
    return blocked.reshape(qw.n, qw.blocks * qw.block_size)[:, : qw.k].T.copy()


def pack_low_first(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 values along the last axis, 8/bits per byte, the first value in the lowest bits."""
    if bits == 8:
        return values.astype(np.uint8)
    per_byte = 8 // bits
    padding = -values.shape[-1] % per_byte  # a ragged tail (zero points of an odd block count) packs with 0s
    values = np.pad(values.astype(np.uint8), [(0, 0)] * (values.ndim - 1) + [(0, padding)])
    grouped = values.reshape(*values.shape[:-1], -1, per_byte)
    packed = np.zeros(grouped.shape[:-1], np.uint8)
    for position in range(per_byte):
        packed |= grouped[..., position] << (bits * position)
    return packed


def pack_matmulnbits(qw: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """MatMulNBits' B, scales and zero_points inputs.

    B: uint8 [N, blocks, block_size * bits / 8], codes low-first along K (INT4: element 2i in the low nibble).
    scales: [N, blocks] (the op also accepts the same values flattened to [N * blocks]).
    zero_points: uint8 [N, ceil(blocks * bits / 8)], packed low-first per row of N like B, or None.
    """
    blob = pack_low_first(qw.codes.reshape(qw.n, qw.blocks, qw.block_size), qw.bits)
    zero_points = None if qw.zero_points is None else pack_low_first(qw.zero_points, qw.bits)
    return blob, qw.scales, zero_points


def kernel_block(k: int, block: int | None = None) -> int:
    """The block MatMulNBits stores a K-long product's scales in: `block` (else the largest power of two <= 256
    dividing K, 128 when none does), no larger than the power of two that holds K."""
    block = block or next((b for b in (256, 128, 64, 32, 16) if k % b == 0), 128)
    return min(block, max(16, 1 << (k - 1).bit_length()))
