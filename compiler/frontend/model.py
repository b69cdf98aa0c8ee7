"""The canonical Llama-family decoder in torch, written to be traced to ONNX.

One module covers Llama, Mistral, Qwen2 and SmolLM: RMSNorm, rotary embedding (rotate-half layout, the
config's theta), grouped-query attention, gated SiLU MLP, tied or separate lm_head. Parameter names are
Hugging Face's, so a `LoadedModel.state_dict` loads with `strict=True`.

The KV cache is an argument, not module state: per layer one key and one value buffer of shape
[batch, kv_heads, max_context, head_dim]. A forward writes the new keys/values at their positions
(`scatter`, which the runtime runs in place: each `present` output is bound to its `past` input buffer) and
returns the updated buffers. Attention then reads either the new keys only (prefill: nothing is cached yet)
or the first `total_length` cache rows (decode; total_length = attention_mask.shape[1]).

Visibility rule, for both phases: query at position p of sequence b sees key j iff j <= p and
attention_mask[b, j] == 1. Prompts are right-padded; padded rows write junk at positions >= their length,
which decode overwrites before any query can see it.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from compiler.frontend.config import DecoderConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        # float16/bfloat16: normalize in float32, as Hugging Face does (a float16 sum of squares overflows 65504
        # on real hidden states). A branch, not casts that a float32 trace would keep as Cast nodes.
        x32 = x.to(torch.float32)
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotary_cos_sin(position_ids: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    # position_ids: [B, T] -> cos, sin: [B, 1, T, head_dim] (broadcast over heads)
    freqs = position_ids.unsqueeze(-1).to(inv_freq.dtype) * inv_freq  # [B, T, head_dim/2]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def visibility_bias(position_ids: Tensor, attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive bias [B, 1, 1, T, L]: 0 where query position p may see key j (j <= p, mask[j] == 1), else min."""
    key_positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    visible = (key_positions.view(1, 1, -1) <= position_ids.unsqueeze(-1)) & (attention_mask.unsqueeze(1) > 0)
    bias = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)
    return bias[:, None, None]  # broadcast over kv heads and the query heads of each group


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, bias, position_ids, key_cache, value_cache, attend_to_cache: bool):
        batch, length, _ = x.shape
        group = self.num_heads // self.num_kv_heads
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, KV, T, D]
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        # Write this step's keys/values at their positions; the runtime aliases present to past (in place).
        write_index = position_ids[:, None, :, None].expand(batch, self.num_kv_heads, length, self.head_dim)
        key_cache = key_cache.scatter(2, write_index, k)
        value_cache = value_cache.scatter(2, write_index, v)
        if attend_to_cache:
            total_length = bias.shape[-1]
            keys, values = key_cache[:, :, :total_length], value_cache[:, :, :total_length]  # [B, KV, L, D]
        else:
            keys, values = k, v

        # Grouped heads without repeating the cache: query head h = kv_head * group + g.
        q = q.reshape(batch, self.num_kv_heads, group, length, self.head_dim)  # [B, KV, G, T, D]
        scores = q @ keys.unsqueeze(2).transpose(-1, -2) * self.head_dim**-0.5  # [B, KV, G, T, L]
        probs = torch.softmax(scores + bias, dim=-1)
        out = probs @ values.unsqueeze(2)  # [B, KV, G, T, D]
        out = out.reshape(batch, self.num_heads, length, self.head_dim).transpose(1, 2)
        return self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim)), key_cache, value_cache


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, bias, position_ids, key_cache, value_cache, attend_to_cache: bool):
        attn_out, key_cache, value_cache = self.self_attn(
            self.input_layernorm(x), cos, sin, bias, position_ids, key_cache, value_cache, attend_to_cache
        )
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, key_cache, value_cache


class DecoderBody(nn.Module):
    """Holds `model.*` parameters (Hugging Face's LlamaModel names)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Decoder(nn.Module):
    """forward(input_ids [B,T], position_ids [B,T], attention_mask [B,L], caches) -> logits, caches.

    attend_to_cache=False is prefill as traced (no past: L == T; once its attention is lowered to onnxruntime's
    GroupQueryAttention it also takes a chunk after cached tokens, L = cached + new); True is decode (L = cached + new).
    logits: "last" gives [B, V] at each row's last valid token (prefill), "all" gives [B, T, V].
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # On the CPU whatever the default device: build_decoder makes the module on "meta", and this is no weight
        steps = torch.arange(0, config.head_dim, 2, dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / config.rope_theta ** (steps / config.head_dim)
        if config.rope_freq_factors is not None:  # Llama 3.1+'s "llama3" scaling, as llama.cpp applies rope_freqs
            inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32, device="cpu")
        # A plain attribute, not a buffer: Module.to(float16) must not round the rotary frequencies (at position
        # 2000 a float16 inv_freq is off by up to a radian). The trace embeds it as a float32 constant.
        self.inv_freq = inv_freq

    def lm_head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids, position_ids, attention_mask, key_caches, value_caches,
                attend_to_cache: bool, logits: str = "all"):
        x = self.model.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(position_ids, self.inv_freq)  # angles in float32, then the model's dtype
        if x.dtype != cos.dtype:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        bias = visibility_bias(position_ids, attention_mask, x.dtype)
        new_keys, new_values = [], []
        for layer, key_cache, value_cache in zip(self.model.layers, key_caches, value_caches):
            x, key_cache, value_cache = layer(x, cos, sin, bias, position_ids, key_cache, value_cache, attend_to_cache)
            new_keys.append(key_cache)
            new_values.append(value_cache)
        if logits == "last":
            # [B]: index of each row's last valid token among this run's. When the graph runs a chunk after cached
            # tokens (onnxruntime's GroupQueryAttention reads them), the mask covers them too: its width minus the
            # run's length is subtracted. That is one row's past: the runtime runs such a chunk at batch 1, and a
            # right-padded batch of whole prompts has none.
            past = attention_mask.shape[-1] - input_ids.shape[-1]
            last = (attention_mask.sum(-1) - 1 - past).clamp(min=0)
            x = x[torch.arange(x.shape[0]), last]  # [B, hidden]
        x = self.model.norm(x)
        weight = self.lm_head_weight()
        # A tied table is also the embedding: the TorchScript exporter writes Gemm(x, table, bias, transB=1) over it
        # as stored only for a 2-D product with a bias; without one it folds a transposed copy into the graph, a
        # second vocab x hidden matrix (1.05 GB for Llama-3.2-1B) that the build then held and compared against the
        # table. load_traced drops the zero bias again.
        bias = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device) if self.config.tie_word_embeddings \
            else None
        logits = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return logits.reshape(*x.shape[:-1], logits.shape[-1]), new_keys, new_values


def build_decoder(config: DecoderConfig, state_dict: dict) -> Decoder:
    """The decoder holding state_dict's weights (as float32, as its parameters are declared). Made on the meta device
    and given the tensors themselves: initialised on the CPU, every weight was drawn at random only to be overwritten
    (1.25 s for SmolLM2-135M's shape), held beside the state dict (a second copy of the model), and the draws used up
    the caller's global torch generator (a host that seeded torch got other numbers after a build)."""
    with torch.device("meta"):
        decoder = Decoder(config)
    weights = {name: tensor if tensor.dtype == torch.float32 else tensor.to(torch.float32)
               for name, tensor in state_dict.items()}
    decoder.load_state_dict(weights, strict=True, assign=True)
    return decoder.eval()
