"""`aotlm.FlashAttention`: the project's one fused attention op, its meaning written down once.

    FlashAttention(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                   cos_cache, sin_cache) -> (output, present_key, present_value)          domain "aotlm", v1

Inputs
  query      [B, S, H*D]   the q projection's output for the S new tokens of each sequence (before rotary)
  key        [B, S, KV*D]  the k projection's output (before rotary)
  value      [B, S, KV*D]  the v projection's output
  past_key   [B, KV, M, D] the key cache buffer (M = max context); optional ("" = no cache: S is everything)
  past_value [B, KV, M, D] the value cache buffer; optional with past_key
  seqlens_k  [B] int32     per sequence: (valid tokens once this step's tokens are in the cache) - 1
  total_sequence_length [] int32   the widest sequence's valid tokens after this step (attention_mask width)
  cos_cache, sin_cache [P, D/2]    rotary tables: cos/sin(position * inv_freq), P >= M positions
Outputs
  output     [B, S, H*D]   attention output, heads concatenated (what the o projection reads)
  present_key/present_value  the cache buffers with this step's rotated keys / values written at their
             positions. They alias past_key/past_value: a runtime binds one buffer to both, updated in place.
Attributes
  num_heads H, kv_num_heads KV (H % KV == 0: query head h reads kv head h // (H/KV)), scale (default D^-0.5),
  do_rotary 1 (rotate-half layout, rotary_interleaved 0).
Meaning, per sequence b, for new token i in [0, S): a first prompt (S == total_sequence_length) puts it at
position i, and rows i > seqlens_k[b] are right padding (ignored, their output unspecified); otherwise (decode,
or a later chunk) it sits at position seqlens_k[b] + 1 - S + i, after the tokens already cached. q and k are
rotated by their position; the new k, v are written at those positions; a query at position p attends to cached
keys j <= p (causal, the same rule in prefill and in decode, where queries are fewer than keys) with
softmax(scale * q.k). seqlens_k[b] >= 0: every sequence has a token (no lowering defines an empty one).

Unspecified, and so not relied on: the output of padding rows, and the cache rows at padding positions after a
first prompt (`reference` and the Triton kernels leave them; GroupQueryAttention, the opset-23 lowering's
ScatterElements and TensorRT's KV-cache update write the padding tokens there; no query ever attends them, and the
next request in that slot overwrites them). Cache rows past a sequence's length must hold finite numbers for the
opset-23 lowering (its masked weights multiply them by 0; GroupQueryAttention never reads them): the runtime's
caches start zeroed.

Limits of the onnxruntime lowering (its CPU kernel): head_dim % 16 == 0, and a chunk of S > 1 new tokens
after a cached prefix only with batch 1. Within these, the contract of onnxruntime's
com.microsoft.GroupQueryAttention with shared past/present buffers, which `lower_onnxruntime` emits; `reference`
below is the plain numpy meaning, used by the tests.
"""
from __future__ import annotations

import numpy as np

from passes.errors import PassError

DOMAIN = "aotlm"
OP_TYPE = "FlashAttention"
VERSION = 1
INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
          "cos_cache", "sin_cache")
OUTPUTS = ("output", "present_key", "present_value")


def node_scale(node, head_dim: int) -> float:
    """A FlashAttention node's softmax scale: its attribute, or D^-0.5 where it has none (0 is a scale too)."""
    scale = node.attrs.get("scale")
    return head_dim**-0.5 if scale is None else float(scale)


def check_rotary_layout(node, lowering: str) -> None:
    """The op's meaning fixes do_rotary 1 and the rotate-half layout (rotary_interleaved 0); a lowering that rotates
    that way only refuses a node that says otherwise (a hand-made or foreign one) rather than rotate it wrongly."""
    for attribute, meant in (("do_rotary", 1), ("rotary_interleaved", 0)):
        value = node.attrs.get(attribute, meant)
        if int(value) != meant:
            raise PassError(f"{node.name or 'a FlashAttention node'}: {attribute}={value}, and {lowering} implements "
                            f"the op's meaning ({attribute}={meant}); lower it with lower_onnxruntime, which passes "
                            f"the attribute to GroupQueryAttention")


def rotary_tables(inv_freq: np.ndarray, positions: int, scaling: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches [positions, D/2] for the rotate-half layout."""
    angles = np.arange(positions, dtype=np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
    return (np.cos(angles) * scaling).astype(np.float32), (np.sin(angles) * scaling).astype(np.float32)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x [..., S, heads, D]; cos/sin [S, D/2]: rotate-half, as RotaryEmbedding (interleaved=0) computes it
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([first * c - second * s, second * c + first * s], axis=-1)


def reference(query, key, value, past_key, past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache,
              num_heads, kv_num_heads, scale=None):
    """float64 numpy meaning of the op; returns (output, present_key, present_value)."""
    batch, length, _ = query.shape
    head_dim = query.shape[-1] // num_heads
    group = num_heads // kv_num_heads
    scale = head_dim**-0.5 if scale is None else scale
    if np.any(np.asarray(seqlens_k) < 0):
        raise ValueError(f"seqlens_k {list(np.asarray(seqlens_k))}: each must be >= 0 (a sequence has a token)")
    if past_key is None:  # no cache: this step's S tokens are everything, written into a fresh one of S rows
        past_key = past_value = np.zeros((batch, kv_num_heads, length, head_dim))
    present_key, present_value = past_key.astype(np.float64).copy(), past_value.astype(np.float64).copy()
    output = np.zeros((batch, length, num_heads * head_dim))
    for b in range(batch):
        total = int(seqlens_k[b]) + 1
        if length == total_sequence_length:  # first prompt: positions 0..S-1, right padding past `total`
            positions = np.arange(length)
            valid = positions < total
        else:
            positions = np.arange(total - length, total)
            valid = np.ones(length, dtype=bool)
        q = query[b].reshape(length, num_heads, head_dim).astype(np.float64)
        k = key[b].reshape(length, kv_num_heads, head_dim).astype(np.float64)
        v = value[b].reshape(length, kv_num_heads, head_dim).astype(np.float64)
        cos, sin = cos_cache[np.clip(positions, 0, None)], sin_cache[np.clip(positions, 0, None)]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        present_key[b][:, positions[valid]] = k[valid].transpose(1, 0, 2)
        present_value[b][:, positions[valid]] = v[valid].transpose(1, 0, 2)
        for i in np.flatnonzero(valid):
            for h in range(num_heads):
                keys = present_key[b, h // group, : positions[i] + 1]  # causal: j <= p
                scores = scale * keys @ q[i, h]
                weights = np.exp(scores - scores.max())
                output[b, i, h * head_dim : (h + 1) * head_dim] = (weights / weights.sum()) @ present_value[
                    b, h // group, : positions[i] + 1]
    return output, present_key, present_value
