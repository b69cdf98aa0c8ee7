"""Calibrated weight quantizers: AWQ's activation-aware scales and GPTQ's error-compensated rounding.

Both read only the second-moment statistics of a layer's input, H = E[x xᵀ] ([K, K], from
`passes.calibration`), never the activations themselves. For a weight W [K, N] (Y = X W) and any quantized
W', the layer's mean squared output error over the calibration rows is exactly

    E ||x (W' - W)||² = Σ_n ΔW[:, n]ᵀ H ΔW[:, n] = sum((H @ ΔW) * ΔW),    ΔW = W' - W,

so AWQ's scale search and the report's per-layer error are computed from H alone (`output_error`).

AWQ (Lin et al., 2023): inputs channels that carry large activations matter most, so scale them up before
rounding: W' = diag(1/s) Q(diag(s) W), with s = mean|x|^α and α searched on a grid to minimise the output
error of every weight that reads the same input. The 1/s is folded into the op before (the quantize pass's
job), so the graph computes (x / s) Q(diag(s) W).

GPTQ (Frantar et al., 2022): quantize W one input row k at a time (a column of the [N, K] matrix GPTQ
writes) and spread each row's rounding error over the rows not yet quantized, weighted by the inverse
Hessian, so the output error rather than the weight error is minimised. Blocks of `block_size` take their
scale when GPTQ reaches them, from the weights compensated so far, every earlier column's updates included. The
reference implementations (IST-DASLab's gptq.py, AutoGPTQ) take it from W before the updates of earlier columns of
the same lazy batch: a review (session 59) found 8-13% of INT4 block-32 codes different and the output error within
a few percent either way. The damping is GPTQ_DAMP of the mean Hessian diagonal over live inputs only (the reference
averages after setting dead inputs' diagonal to 1).
"""
from __future__ import annotations

import numpy as np

from passes.quantized_weights import QuantizedWeight, block_parameters, decode, dequantize, encode, pad_k, quantize_rtn

AWQ_GRID = 20          # α in {0, 1/20, ..., 19/20}, as in the AWQ reference implementation
GPTQ_DAMP = 0.01       # fraction of mean(diag(H)) added to the diagonal: H is often singular (dead channels)
GPTQ_LAZY_BLOCK = 128  # rows updated together; a multiple of every INT4 block up to 128 (256 widens it: `lazy`)


def output_error(weight: np.ndarray, approximation: np.ndarray, hessian: np.ndarray) -> float:
    """Mean squared output error E||x (approximation - weight)||² summed over outputs, for E[x xᵀ] = hessian."""
    delta = (approximation.astype(np.float64) - weight.astype(np.float64))
    return float(np.sum((hessian @ delta) * delta))


def relative_output_error(weight: np.ndarray, approximation: np.ndarray, hessian: np.ndarray) -> float:
    """output_error over the output's own mean square, E||x W||²: 0 is exact, 1 is as large as the output."""
    energy = float(np.sum((hessian @ weight.astype(np.float64)) * weight))
    return output_error(weight, approximation, hessian) / max(energy, 1e-30)


# -- AWQ --------------------------------------------------------------------------------------------------
def awq_search(weights: list[np.ndarray], hessian: np.ndarray, mean_abs: np.ndarray, bits: int | list[int],
               block_size: int | list[int], symmetric: bool | list[bool], tie: tuple[int, ...] | None = None,
               full_range: bool | list[bool] = False) -> tuple[np.ndarray, dict]:
    """Per-input-channel scales s [K] for the weights that share one input; returns (s, search record).

    The format (bits, block_size, symmetric, full_range) is one for all the weights, or a list with one per weight:
    weights that read one input share its scales (1/s folds into what produces it), whatever their formats.

    α = 0 is s = 1, plain round-to-nearest, so the result is never worse than RTN on the calibration data.
    tie: the input's layout (a, g, b) with a * g * b = K when the scales must be equal along axis g (o_proj's input,
    whose channels (kv head, query head in its group, d) fold into the value projection per (kv head, d));
    E|x| is then averaged along g.
    """
    hessian32 = hessian.astype(np.float32)
    base = np.maximum(mean_abs.astype(np.float32), 1e-8)
    if tie is not None:
        grouped = base.reshape(tie)
        base = np.broadcast_to(grouped.mean(axis=1, keepdims=True), grouped.shape).reshape(-1)
    formats = [(bits, block_size, symmetric, full_range)] * len(weights)
    if any(isinstance(value, list) for value in (bits, block_size, symmetric, full_range)):
        formats = list(zip(*(value if isinstance(value, list) else [value] * len(weights)
                             for value in (bits, block_size, symmetric, full_range))))
    losses = []
    best = (np.inf, 0.0, np.ones_like(base))
    for step in range(AWQ_GRID):
        alpha = step / AWQ_GRID
        scales = base ** alpha
        scales = scales / np.sqrt(scales.max() * scales.min())  # keep s around 1: the norm's gamma absorbs 1/s
        loss = 0.0
        for weight, (weight_bits, block, weight_symmetric, weight_full_range) in zip(weights, formats):
            effective = scaled_dequantized(weight, scales, weight_bits, block, weight_symmetric, weight_full_range)
            delta = effective - weight
            loss += float(np.sum((hessian32 @ delta) * delta))
        losses.append(loss)
        if loss < best[0]:
            best = (loss, alpha, scales)
    _, alpha, scales = best
    return scales.astype(np.float32), {"alpha": alpha, "loss_rtn": losses[0], "loss_best": best[0]}


def scaled_dequantized(weight: np.ndarray, scales: np.ndarray, bits: int, block_size: int, symmetric: bool,
                       full_range: bool = False) -> np.ndarray:
    """diag(1/s) Q(diag(s) W): what the graph computes with x / s feeding the quantized diag(s) W."""
    qw = quantize_rtn(weight * scales[:, None], bits, block_size, symmetric, full_range)
    return dequantize(qw) / scales[:, None]


# -- GPTQ -------------------------------------------------------------------------------------------------
def quantize_gptq(weight: np.ndarray, hessian: np.ndarray, bits: int, block_size: int, symmetric: bool,
                  damp: float = GPTQ_DAMP, act_order: bool = False, full_range: bool = False,
                  refit: bool = True) -> QuantizedWeight:
    """GPTQ of a [K, N] weight with input statistics hessian = E[x xᵀ] [K, K]; blocks of block_size along K.

    act_order: round the input channels in order of decreasing E[x²] (GPTQ's "act-order"), so the channels that
    matter most are rounded first, while the most error can still be compensated. Block scales are then fixed
    before the loop ("static groups": each block's scales from AWQ's clipping search on the weight), since a
    block's columns are no longer rounded together.
    refit: finally re-solve the block scales for the codes GPTQ chose (`refit_scales`).
    """
    true_k, n = weight.shape
    k = -(-true_k // block_size) * block_size  # a partial last block: padded with inputs that are always 0
    work = pad_k(weight.astype(np.float64), k).T.copy()  # [N, K]: GPTQ's orientation, one column per input channel
    h = np.zeros((k, k))
    h[:true_k, :true_k] = hessian
    dead = np.diag(h) == 0  # an input that is always 0: its weights cannot matter, quantize them as 0
    if dead[:true_k].all():  # no data at all (the mean damping below would be NaN): nothing to weigh the error by
        return quantize_rtn(weight, bits, block_size, symmetric, full_range)
    damping = damp * np.mean(np.diag(h)[~dead])
    h[dead, dead] = 1.0
    work[:, dead] = 0.0
    h[np.diag_indices(k)] += damping
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    # static groups from the weight with its dead inputs' rows zeroed, as they are rounded below (the reference's
    # static groups come after W[:, dead] = 0): a dead input's large weight had widened its whole block's scale
    live_weight = np.where(dead[:true_k, None], 0, weight).astype(weight.dtype)
    static = quantize_clipped(live_weight, hessian, bits, block_size, symmetric, full_range) if act_order else None
    work, h = work[:, order], h[np.ix_(order, order)]
    inverse_factor = np.linalg.cholesky(np.linalg.inv(h)).T

    blocks = k // block_size
    codes = np.zeros((n, k), np.uint8)
    scales = np.zeros((n, blocks), np.float32) if static is None else static.scales.copy()
    zero_points = (None if symmetric else np.zeros((n, blocks), np.uint8)) if static is None else static.zero_points
    lazy = max(GPTQ_LAZY_BLOCK, block_size) if block_size < k else GPTQ_LAZY_BLOCK
    for start in range(0, k, lazy):
        end = min(start + lazy, k)
        chunk = work[:, start:end].copy()
        errors = np.zeros_like(chunk)
        chunk_inverse = inverse_factor[start:end, start:end]
        for i in range(end - start):
            column = order[start + i]  # the input channel (original index) rounded at this step
            block = column // block_size
            if static is None and column % block_size == 0:  # a new block: its scale from the weights so far
                group = chunk[:, i:i + block_size] if i + block_size <= end - start else work[:, column:column + block_size]
                block_scales, block_zeros = block_parameters(group.astype(np.float32), bits, symmetric, full_range)
                scales[:, block] = block_scales
                if zero_points is not None:
                    zero_points[:, block] = block_zeros
            zero = None if zero_points is None else zero_points[:, block]
            codes[:, column] = encode(chunk[:, i], scales[:, block], zero, bits)
            quantized = decode(codes[:, column], scales[:, block], zero, bits)
            error = (chunk[:, i] - quantized) / chunk_inverse[i, i]
            chunk[:, i:] -= np.outer(error, chunk_inverse[i, i:])
            errors[:, i] = error
        work[:, end:] -= errors @ inverse_factor[start:end, end:]
    qw = QuantizedWeight(codes, scales, zero_points, bits, block_size, true_k, n)
    return refit_scales(weight, qw, hessian) if refit else qw


def refit_scales(weight: np.ndarray, qw: QuantizedWeight, hessian: np.ndarray) -> QuantizedWeight:
    """The same codes with each output channel's block scales re-solved for the least output error.

    With the codes fixed, W' = C s is linear in one output channel's block scales s [blocks], so the scales that
    minimise E||x (W' - W)||² = (C s - w)ᵀ H (C s - w) solve the small system (Cᵀ H C) s = Cᵀ H w; the coupling
    between blocks through H is exact. GPTQ chose each block's scale before (or while) rounding it, from weights
    it had already shifted; this fits the scales to the final codes. A channel keeps its old scales unless the new
    ones have the same signs (a positive scale stays positive, as TensorRT needs) and a lower error.
    """
    n, blocks, size = qw.n, qw.blocks, qw.block_size
    padded_k = blocks * size
    w = pad_k(weight.astype(np.float64), padded_k)  # [Kp, N]
    h = np.zeros((padded_k, padded_k))
    h[:qw.k, :qw.k] = hessian
    zero = None if qw.zero_points is None else qw.zero_points[..., None]
    steps = decode(qw.codes.reshape(n, blocks, size), np.float32(1.0), zero, qw.bits)  # codes - zero point
    c = steps.reshape(n, padded_k).T.astype(np.float64)  # [Kp, N]: W' = c * (each element's block scale)
    gram = np.empty((n, blocks, blocks))  # per channel Cᵀ H C
    for block in range(blocks):
        rows = slice(block * size, (block + 1) * size)
        h_c = h[:, rows] @ c[rows]  # H's columns of this block times its codes: [Kp, N]
        gram[:, :, block] = (c * h_c).reshape(blocks, size, n).sum(axis=1).T
    target = (c * (h @ w)).reshape(blocks, size, n).sum(axis=1).T  # Cᵀ H w: [N, blocks]
    diagonal = np.einsum("nbb->nb", gram)
    ridge = 1e-9 * np.maximum(diagonal.max(axis=1, keepdims=True), 1e-30)
    solved = np.linalg.solve(gram + ridge[..., None] * np.eye(blocks), target[..., None])[..., 0]
    old = qw.scales.astype(np.float64)
    new = np.where(diagonal > 0, solved, old)  # a block whose codes are all 0 (or never seen) keeps its scale

    def errors(scales: np.ndarray) -> np.ndarray:
        delta = c * np.repeat(scales.T, size, axis=0) - w
        return np.sum((h @ delta) * delta, axis=0)

    # A flipped sign is refused (TensorRT takes positive scales only); the error test guards against the ridge and
    # round-off only: an exact least-squares solve is never worse.
    better = np.all(np.sign(new) == np.sign(old), axis=1) & (errors(new) < errors(old))
    scales = np.where(better[:, None], new, old).astype(np.float32)
    return QuantizedWeight(qw.codes, scales, qw.zero_points, qw.bits, qw.block_size, qw.k, qw.n)


# -- AWQ's clipping search ----------------------------------------------------------------------------------
CLIP_RATIOS = np.linspace(1.0, 0.5, 11)  # shrink each block's range by up to half, as AWQ's auto_clip does


def quantize_clipped(weight: np.ndarray, hessian: np.ndarray, bits: int, block_size: int,
                     symmetric: bool, full_range: bool = False) -> QuantizedWeight:
    """Round to nearest with each block's range shrunk by the ratio that minimises that block's output error.

    A block's error is Δ_bᵀ H_bb Δ_b (its own rows of E[x xᵀ]); clipping a few outliers buys a finer step for
    the rest. Ratio 1 is plain RTN, so no block gets worse than RTN by this measure.
    """
    k, n = weight.shape
    plain = quantize_rtn(weight, bits, block_size, symmetric, full_range)
    blocks, padded_k = plain.blocks, plain.blocks * block_size
    blocked = pad_k(weight.astype(np.float32), padded_k).T.reshape(n, blocks, block_size)
    h = np.zeros((padded_k, padded_k), np.float32)
    h[:k, :k] = hessian
    diagonal_blocks = np.stack([h[b * block_size:(b + 1) * block_size, b * block_size:(b + 1) * block_size]
                                for b in range(blocks)])  # [blocks, bs, bs]
    best_error = np.full((n, blocks), np.inf, np.float32)
    codes = np.zeros((n, blocks, block_size), np.uint8)
    scales = np.zeros((n, blocks), np.float32)
    zero_points = None if symmetric else np.zeros((n, blocks), np.uint8)
    for ratio in CLIP_RATIOS:
        ratio_scales, ratio_zeros = block_parameters(blocked * np.float32(ratio), bits, symmetric, full_range)
        zeros = None if ratio_zeros is None else ratio_zeros[..., None]
        ratio_codes = encode(blocked, ratio_scales[..., None], zeros, bits)
        delta = decode(ratio_codes, ratio_scales[..., None], zeros, bits) - blocked  # [N, blocks, bs]
        error = np.einsum("nbi,nbi->nb", np.einsum("nbi,bij->nbj", delta, diagonal_blocks), delta)
        better = error < best_error
        best_error[better] = error[better]
        codes[better], scales[better] = ratio_codes[better], ratio_scales[better]
        if zero_points is not None:
            zero_points[better] = ratio_zeros[better]
    return QuantizedWeight(codes.reshape(n, padded_k), scales, zero_points, bits, block_size, k, n)
