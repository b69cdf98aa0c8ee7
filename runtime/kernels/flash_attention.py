"""FlashAttention in Triton for the `aotlm.FlashAttention` op (rotary already applied), plus thin torch launchers.

Contract (checked against `reference.attention_reference`), all tensors contiguous:
    q [B, S, H*D], k/v [B, S, KV*D]  the S new tokens (q, k rotated)    seqlens_k [B] int32, total [1] int32
    k_cache/v_cache [B, KV, M, D]    written in place: this step's k/v rows land at their positions
    out [B, S, H*D]                  input dtype (fp16, bf16, or fp32 for debugging); fp32 accumulation
Positions (passes/flash_attention_op.py): if S == total (first prompt) token i sits at i and rows i > seqlens_k[b]
are right padding (not cached, output zeros); otherwise token i sits at seqlens_k[b] + 1 - S + i. A query at p
sees keys j <= p; query head h reads kv head h // (H // KV); softmax(scale * q.k).

Kernels (argument order fixed for the TensorRT AOT plugin: pointer inputs, int32 scalars, pointer outputs,
constexprs):
    attention_kernel     prefill / general; grid (cdiv(S, BLOCK_M), B * H); online softmax over key tiles
    decode_split_kernel  flash-decoding; grid (NUM_SPLITS, B * KV, cdiv(S * group, BLOCK_R)); each key tile is
                         loaded once for all query heads of its kv head -> normalized partials + log-sum-exp
    combine_kernel       merges the splits; grid (S, B * H)
Race-free in-place update: this step's keys/values are always read from the k/v inputs, only earlier positions
from the cache, so no program reads a cache row another program is writing. In TensorRT K_CACHE_OUT aliases
K_CACHE (same address); the launchers here pass the same tensor for both.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# tl.constexpr: jit code may read module globals only when they are constexprs (the interpreter does not check)
LOG2E = tl.constexpr(1.4426950408889634)  # scores are scaled by log2(e) so the softmax uses exp2, the GPU's native exp
LN2 = tl.constexpr(0.6931471805599453)


@dataclass(frozen=True)
class PrefillBlocks:
    block_m: int  # query rows per program
    block_n: int  # keys per tile
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class DecodeBlocks:
    block_n: int  # keys per tile
    block_r: int  # query rows per program: group heads x new tokens, padded (tl.dot needs >= 16)
    num_warps: int = 4


@dataclass(frozen=True)
class DecodeSplits:
    split_size: int  # cache positions per split
    num_splits: int  # a power of two (combine_kernel loads all splits as one tile); covers max_context


def prefill_blocks(head_dim: int) -> PrefillBlocks:
    """Tile sizes of attention_kernel (the usual FlashAttention-2 choice; not yet tuned on a GPU)."""
    if head_dim <= 64:
        return PrefillBlocks(block_m=128, block_n=64, num_warps=4, num_stages=3)
    return PrefillBlocks(block_m=128, block_n=64, num_warps=8, num_stages=2)


def decode_blocks(head_dim: int, group: int) -> DecodeBlocks:
    """Tile sizes of decode_split_kernel: one decode token's whole head group fits in one program's rows."""
    block_r = min(64, max(16, triton.next_power_of_2(group)))
    return DecodeBlocks(block_n=128 if head_dim <= 64 else 64, block_r=block_r)


def decode_splits(max_context: int, split_size: int | None = None) -> DecodeSplits:
    """Split the cache into up to ~16 parts of 64..512 positions (fewer under 1024 positions, max_context / 512
    past 8192); short sequences leave the later splits empty, and those programs exit after writing -inf."""
    if split_size is None:
        split_size = min(512, max(64, triton.next_power_of_2(triton.cdiv(max_context, 16))))
    if split_size < 1:
        raise ValueError(f"split_size must be >= 1, got {split_size}")
    return DecodeSplits(split_size, triton.next_power_of_2(triton.cdiv(max_context, split_size)))


@triton.jit
def _sequence_span(SEQLENS_K, TOTAL, b, seq_len):
    """(cache position of new token 0, number of real new tokens) for sequence b."""
    valid_tokens = tl.load(SEQLENS_K + b) + 1
    first_prompt = seq_len == tl.load(TOTAL)
    start = tl.where(first_prompt, 0, valid_tokens - seq_len)
    new_rows = tl.where(first_prompt, tl.minimum(valid_tokens, seq_len), seq_len)
    return start, new_rows


@triton.jit
def _attend_tile(q, k, v, mask, m_i, l_i, acc, QK_SCALE_LOG2: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """One online-softmax step: fold the key tile k/v [BLOCK_N, D] into the running (max, sum, acc) of q's rows.

    DOT_IN_FP32 exists because Triton's CPU interpreter computes bf16 arithmetic and bf16 tl.dot wrongly
    (garbage ~1e10), while loading bf16 and converting to fp32 right away works; fp32 operands also need
    input_precision="ieee", else tl.dot rounds them to tf32. On a GPU it is False for fp16/bf16, so both dots
    run on tensor cores in the input dtype, with P cast to the value dtype before P @ V as FlashAttention does.
    """
    if DOT_IN_FP32:
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(mask, scores * QK_SCALE_LOG2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays 0, never NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_IN_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def attention_kernel(Q, K, V, K_CACHE, V_CACHE, SEQLENS_K, TOTAL, seq_len, max_context,
                     OUT, K_CACHE_OUT, V_CACHE_OUT,
                     NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    GROUP: tl.constexpr = NUM_HEADS // KV_HEADS
    block = tl.program_id(0)
    b = tl.program_id(1) // NUM_HEADS
    head = tl.program_id(1) % NUM_HEADS
    kv_head = head // GROUP
    start, new_rows = _sequence_span(SEQLENS_K, TOTAL, b, seq_len)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # new-token index i; its position is start + i
    dims = tl.arange(0, HEAD_DIM)
    row_valid = rows < new_rows
    b64 = b.to(tl.int64)  # B * S * H * D can pass 2**31
    q = tl.load(Q + ((b64 * seq_len + rows[:, None]) * NUM_HEADS + head) * HEAD_DIM + dims[None, :],
                mask=row_valid[:, None], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    cache = (b64 * KV_HEADS + kv_head) * max_context * HEAD_DIM  # [B, KV, M, D]: this (b, kv_head) plane
    # 1) keys cached by earlier steps, positions [0, start): every query of this step sees all of them
    for n in range(0, start, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        col_valid = cols < start
        offsets = cache + cols[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(K_CACHE + offsets, mask=col_valid[:, None], other=0.0)
        v = tl.load(V_CACHE + offsets, mask=col_valid[:, None], other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, col_valid[None, :], m_i, l_i, acc, SCALE * LOG2E, DOT_IN_FP32)
    # 2) this step's keys, read from K/V (not the cache other programs write); tiles above the diagonal skipped
    causal_end = tl.where(block * BLOCK_M < new_rows, tl.minimum((block + 1) * BLOCK_M, new_rows), 0)
    for n in range(0, causal_end, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        col_valid = cols < causal_end
        offsets = ((b64 * seq_len + cols[:, None]) * KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
        k = tl.load(K + offsets, mask=col_valid[:, None], other=0.0)
        v = tl.load(V + offsets, mask=col_valid[:, None], other=0.0)
        mask = col_valid[None, :] & (cols[None, :] <= rows[:, None])
        m_i, l_i, acc = _attend_tile(q, k, v, mask, m_i, l_i, acc, SCALE * LOG2E, DOT_IN_FP32)
    out = tl.where(row_valid[:, None] & (l_i[:, None] > 0), acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(OUT + ((b64 * seq_len + rows[:, None]) * NUM_HEADS + head) * HEAD_DIM + dims[None, :],
             out.to(OUT.dtype.element_ty), mask=(rows < seq_len)[:, None])
    # the group's first query head writes this block's new rows of its kv head into the cache
    if head % GROUP == 0:
        positions = start + rows
        write = (row_valid & (positions >= 0) & (positions < max_context))[:, None]  # -1: an empty mask row
        source = ((b64 * seq_len + rows[:, None]) * KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
        target = cache + positions[:, None] * HEAD_DIM + dims[None, :]
        tl.store(K_CACHE_OUT + target, tl.load(K + source, mask=write, other=0.0), mask=write)
        tl.store(V_CACHE_OUT + target, tl.load(V + source, mask=write, other=0.0), mask=write)


@triton.jit
def decode_split_kernel(Q, K, V, K_CACHE, V_CACHE, SEQLENS_K, TOTAL, seq_len, max_context,
                        PARTIAL_OUT, PARTIAL_LSE, K_CACHE_OUT, V_CACHE_OUT,
                        NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        SCALE: tl.constexpr, SPLIT_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """Attention of every query head of one kv head over one split of the cache positions.

    PARTIAL_OUT [B, S, H, NUM_SPLITS, D] fp32 holds each split's *normalized* output and PARTIAL_LSE
    [B, S, H, NUM_SPLITS] fp32 its natural log-sum-exp of scale * q.k (-inf, with zeros, for an empty split).
    """
    GROUP: tl.constexpr = NUM_HEADS // KV_HEADS
    split = tl.program_id(0)
    b = tl.program_id(1) // KV_HEADS
    kv_head = tl.program_id(1) % KV_HEADS
    start, new_rows = _sequence_span(SEQLENS_K, TOTAL, b, seq_len)
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)  # row r = (new token r // GROUP, head r % GROUP)
    token = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = token < new_rows
    query_positions = start + token
    dims = tl.arange(0, HEAD_DIM)
    b64 = b.to(tl.int64)
    row_offsets = ((b64 * seq_len + token[:, None]) * NUM_HEADS + head[:, None]) * HEAD_DIM + dims[None, :]
    q = tl.load(Q + row_offsets, mask=row_valid[:, None], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    cache = (b64 * KV_HEADS + kv_head) * max_context * HEAD_DIM
    split_start = split * SPLIT_SIZE
    last_token = tl.minimum((tl.program_id(2) * BLOCK_R + BLOCK_R - 1) // GROUP, new_rows - 1)
    split_end = tl.minimum(split_start + SPLIT_SIZE, start + last_token + 1)  # causal end of this row block
    # 1) cached positions of this split, [split_start, min(split_end, start)): all before every query
    cached_end = tl.minimum(split_end, start)
    for n in range(split_start, cached_end, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        col_valid = cols < cached_end
        offsets = cache + cols[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(K_CACHE + offsets, mask=col_valid[:, None], other=0.0)
        v = tl.load(V_CACHE + offsets, mask=col_valid[:, None], other=0.0)
        mask = row_valid[:, None] & col_valid[None, :]
        m_i, l_i, acc = _attend_tile(q, k, v, mask, m_i, l_i, acc, SCALE * LOG2E, DOT_IN_FP32)
    # 2) this step's positions inside the split, read from K/V (the cache rows are being written meanwhile)
    for n in range(tl.maximum(split_start, start), split_end, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        col_valid = cols < split_end
        offsets = ((b64 * seq_len + (cols - start)[:, None]) * KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
        k = tl.load(K + offsets, mask=col_valid[:, None], other=0.0)
        v = tl.load(V + offsets, mask=col_valid[:, None], other=0.0)
        mask = row_valid[:, None] & col_valid[None, :] & (cols[None, :] <= query_positions[:, None])
        m_i, l_i, acc = _attend_tile(q, k, v, mask, m_i, l_i, acc, SCALE * LOG2E, DOT_IN_FP32)
    seen = l_i > 0
    partial = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    partial_row = ((b64 * seq_len + token) * NUM_HEADS + head) * NUM_SPLITS + split
    exists = token < seq_len
    tl.store(PARTIAL_OUT + partial_row[:, None] * HEAD_DIM + dims[None, :], partial, mask=exists[:, None])
    tl.store(PARTIAL_LSE + partial_row, lse, mask=exists)
    # the row of each token's first group head writes its k/v rows, in the split holding its position
    in_split = (query_positions >= split_start) & (query_positions < split_start + SPLIT_SIZE)
    write = (row_valid & (rows % GROUP == 0) & in_split & (query_positions < max_context))[:, None]
    source = ((b64 * seq_len + token[:, None]) * KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
    target = cache + query_positions[:, None] * HEAD_DIM + dims[None, :]
    tl.store(K_CACHE_OUT + target, tl.load(K + source, mask=write, other=0.0), mask=write)
    tl.store(V_CACHE_OUT + target, tl.load(V + source, mask=write, other=0.0), mask=write)


@triton.jit
def combine_kernel(PARTIAL_OUT, PARTIAL_LSE, seq_len, OUT,
                   NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """OUT[b, i, h] = sum over splits of exp(lse_s - lse) * partial_s; zeros where every split is empty."""
    b = tl.program_id(1) // NUM_HEADS
    head = tl.program_id(1) % NUM_HEADS
    row = (b.to(tl.int64) * seq_len + tl.program_id(0)) * NUM_HEADS + head
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(PARTIAL_LSE + row * NUM_SPLITS + splits)
    partials = tl.load(PARTIAL_OUT + (row * NUM_SPLITS + splits[:, None]) * HEAD_DIM + dims[None, :])
    lse_max = tl.max(lse, 0)
    weights = tl.exp(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # empty splits weigh 0
    weight_sum = tl.sum(weights, 0)
    out = tl.sum(partials * weights[:, None], 0) / tl.where(weight_sum > 0, weight_sum, 1.0)
    tl.store(OUT + row * HEAD_DIM + dims, out.to(OUT.dtype.element_ty))


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    seq_len: int
    head_dim: int
    max_context: int


def check_inputs(q, k, v, k_cache, v_cache, seqlens_k, total, num_heads: int, kv_heads: int) -> AttentionShape:
    """Validate the contract's shapes, dtypes and layouts; every error names the tensor and what is wrong."""
    if num_heads < 1 or kv_heads < 1 or num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of kv_heads ({kv_heads})")
    if q.dim() != 3 or q.shape[-1] % num_heads:
        raise ValueError(f"q must be [B, S, num_heads * D] with num_heads={num_heads}, got {tuple(q.shape)}")
    batch, seq_len, _ = q.shape
    head_dim = q.shape[-1] // num_heads
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 (tl.dot and tl.arange need it), got {head_dim}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [B, KV, M, D], got {tuple(k_cache.shape)}")
    max_context = k_cache.shape[2]
    new_rows, cache = (batch, seq_len, kv_heads * head_dim), (batch, kv_heads, max_context, head_dim)
    expected = {"k": new_rows, "v": new_rows, "k_cache": cache, "v_cache": cache}
    tensors = {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache}
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (B, S, KV, M, D from q and k_cache), "
                             f"got {tuple(tensors[name].shape)}")
    for name, tensor in tensors.items():
        if tensor.dtype != q.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from q's {q.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernels compute row-major offsets)")
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")
    if seq_len < 1 or seq_len > max_context:
        raise ValueError(f"S={seq_len} new tokens must be between 1 and the cache's max context M={max_context}")
    for name, tensor, shape in (("seqlens_k", seqlens_k, (batch,)), ("total", total, (1,))):
        if tuple(tensor.shape) != shape or tensor.dtype != torch.int32 or tensor.device != q.device:
            raise ValueError(f"{name} must be an int32 tensor of shape {shape} on {q.device}, "
                             f"got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
    return AttentionShape(batch, seq_len, head_dim, max_context)


def _dot_in_fp32(dtype: torch.dtype, override: bool | None) -> bool:
    # fp32 operands need the fp32 (ieee) dot; bf16 also does under the interpreter, whose bf16 math is wrong.
    # fp16 keeps the GPU path (fp16 dot, P cast to fp16) even there, since the interpreter gets fp16 dots right.
    if override is not None:
        return override
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    return dtype == torch.float32 or (interpreting and dtype == torch.bfloat16)


def flash_attention(q, k, v, k_cache, v_cache, seqlens_k, total, num_heads: int, kv_heads: int,
                    scale: float | None = None, *, blocks: PrefillBlocks | None = None,
                    dot_in_fp32: bool | None = None) -> torch.Tensor:
    """Attention of the S new tokens through attention_kernel (any S); writes k/v into the caches in place."""
    shape = check_inputs(q, k, v, k_cache, v_cache, seqlens_k, total, num_heads, kv_heads)
    blocks = blocks or prefill_blocks(shape.head_dim)
    out = torch.empty_like(q)
    grid = (triton.cdiv(shape.seq_len, blocks.block_m), shape.batch * num_heads)
    attention_kernel[grid](
        q, k, v, k_cache, v_cache, seqlens_k, total, shape.seq_len, shape.max_context, out, k_cache, v_cache,
        NUM_HEADS=num_heads, KV_HEADS=kv_heads, HEAD_DIM=shape.head_dim,
        SCALE=float(shape.head_dim**-0.5 if scale is None else scale), BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.block_n, DOT_IN_FP32=_dot_in_fp32(q.dtype, dot_in_fp32),
        num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    return out


def flash_decode(q, k, v, k_cache, v_cache, seqlens_k, total, num_heads: int, kv_heads: int,
                 scale: float | None = None, split_size: int | None = None, *, blocks: DecodeBlocks | None = None,
                 dot_in_fp32: bool | None = None) -> torch.Tensor:
    """Attention split along the cache (decode, S = 1, or a short chunk); writes k/v into the caches in place."""
    shape = check_inputs(q, k, v, k_cache, v_cache, seqlens_k, total, num_heads, kv_heads)
    group = num_heads // kv_heads
    blocks = blocks or decode_blocks(shape.head_dim, group)
    splits = decode_splits(shape.max_context, split_size)
    if blocks.block_r < 16 or blocks.block_n < 16:
        raise ValueError(f"block_r and block_n must be >= 16 for tl.dot, got {blocks}")
    rows = (shape.batch, shape.seq_len, num_heads, splits.num_splits)
    partial_out = torch.empty(*rows, shape.head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(*rows, dtype=torch.float32, device=q.device)
    grid = (splits.num_splits, shape.batch * kv_heads, triton.cdiv(shape.seq_len * group, blocks.block_r))
    decode_split_kernel[grid](
        q, k, v, k_cache, v_cache, seqlens_k, total, shape.seq_len, shape.max_context,
        partial_out, partial_lse, k_cache, v_cache,
        NUM_HEADS=num_heads, KV_HEADS=kv_heads, HEAD_DIM=shape.head_dim,
        SCALE=float(shape.head_dim**-0.5 if scale is None else scale), SPLIT_SIZE=splits.split_size,
        NUM_SPLITS=splits.num_splits, BLOCK_N=blocks.block_n, BLOCK_R=blocks.block_r,
        DOT_IN_FP32=_dot_in_fp32(q.dtype, dot_in_fp32), num_warps=blocks.num_warps)
    out = torch.empty_like(q)
    combine_kernel[(shape.seq_len, shape.batch * num_heads)](
        partial_out, partial_lse, shape.seq_len, out, NUM_HEADS=num_heads, HEAD_DIM=shape.head_dim,
        NUM_SPLITS=splits.num_splits)
    return out
