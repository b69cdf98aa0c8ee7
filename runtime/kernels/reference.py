"""Plain torch float64 meaning of the attention kernels in `flash_attention.py` (no Triton): the check beside them.

Same contract as the kernels: the `aotlm.FlashAttention` op (passes/flash_attention_op.py) after rotary was
applied to q and k outside the kernel. Written for reading, not speed: one sequence and one new token at a time.
"""
from __future__ import annotations

import torch


def new_token_positions(seqlen_k: int, total: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache position of each of the seq_len new tokens of one sequence, and which of them are real (not padding).

    seqlen_k is that sequence's seqlens_k entry: (valid tokens once this step is in the cache) - 1.
    """
    if seqlen_k < 0:  # a negative index would write the cache's last row
        raise ValueError(f"seqlens_k entry {seqlen_k}: must be >= 0 (every sequence has a token)")
    valid_tokens = seqlen_k + 1
    if seq_len == total:  # first prompt: token i at position i, rows past the sequence's end are right padding
        positions = torch.arange(seq_len)
        return positions, positions < valid_tokens
    # decode or a later chunk: the new tokens follow the ones already cached
    return torch.arange(valid_tokens - seq_len, valid_tokens), torch.ones(seq_len, dtype=torch.bool)


def attention_reference(q, k, v, k_cache, v_cache, seqlens_k, total, num_heads: int, kv_heads: int,
                        scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 (output [B, S, H*D], k_cache, v_cache after this step); inputs are left untouched.

    Output rows of right padding are zeros here (the op leaves them unspecified).
    """
    batch, seq_len, _ = q.shape
    head_dim = q.shape[-1] // num_heads
    group = num_heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    total = int(torch.as_tensor(total).reshape(-1)[0])
    kv_head_of = torch.arange(num_heads) // group  # query head h reads kv head h // group
    keys_all, values_all = k_cache.double().cpu().clone(), v_cache.double().cpu().clone()
    output = torch.zeros(batch, seq_len, num_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        positions, valid = new_token_positions(int(seqlens_k[b]), total, seq_len)
        new_keys = k[b].double().cpu().reshape(seq_len, kv_heads, head_dim)
        new_values = v[b].double().cpu().reshape(seq_len, kv_heads, head_dim)
        keys_all[b][:, positions[valid]] = new_keys[valid].transpose(0, 1)  # [KV, valid, D]
        values_all[b][:, positions[valid]] = new_values[valid].transpose(0, 1)
        queries = q[b].double().cpu().reshape(seq_len, num_heads, head_dim)
        for i in torch.nonzero(valid).flatten().tolist():
            visible = int(positions[i]) + 1  # causal: keys at positions j <= p
            keys = keys_all[b, kv_head_of, :visible]  # [H, visible, D]
            values = values_all[b, kv_head_of, :visible]
            scores = scale * torch.einsum("hd,hjd->hj", queries[i], keys)
            weights = torch.softmax(scores, dim=-1)
            output[b, i] = torch.einsum("hj,hjd->hd", weights, values)
    return output.reshape(batch, seq_len, num_heads * head_dim), keys_all, values_all
