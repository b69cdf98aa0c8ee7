"""The canonical decoder's configuration: the Llama family (Llama, Mistral, Qwen2, SmolLM)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# Architectures whose weights map onto the canonical decoder. Checked by every loader.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # Qwen2 has biases on the q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "llama"
    sliding_window: int | None = None  # tokens a query attends back (Mistral, Qwen2); None = the whole context
    # Per rotary frequency (head_dim / 2 of them), the number its inverse frequency is divided by: llama.cpp's
    # rope_freqs tensor, which is how Llama 3.1+'s "llama3" rope scaling reaches the decoder. None = plain RoPE.
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 1")
        if self.head_dim % 2:  # rotary embedding turns pairs of channels
            raise ValueError(f"head_dim: {self.head_dim} must be even (rotary embedding rotates pairs of channels)")
        if not 0 < self.rope_theta < math.inf or not 0 < self.rms_norm_eps < math.inf:  # `not`: NaN fails too
            raise ValueError(f"rope_theta ({self.rope_theta}) and rms_norm_eps ({self.rms_norm_eps}) must be finite "
                             f"and > 0")
        factors = self.rope_freq_factors
        if factors is not None and (len(factors) != self.head_dim // 2 or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < math.inf for f in factors)):
            raise ValueError(f"rope_freq_factors: {len(factors)} values; it needs head_dim / 2 = {self.head_dim // 2} "
                             f"finite numbers > 0 (one per rotary frequency), or null for plain RoPE")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window: {self.sliding_window} must be >= 1 (tokens a query attends back), "
                             f"or null for the whole context")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture: {self.architecture!r} is not one of {', '.join(SUPPORTED_ARCHITECTURES)} "
                             f"(the Llama family, which the canonical decoder implements)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 bytes one token adds to the KV cache (keys and values, all layers)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.rope_freq_factors is not None:
            d["rope_freq_factors"] = list(self.rope_freq_factors)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        if d.get("rope_freq_factors") is not None:
            d["rope_freq_factors"] = tuple(d["rope_freq_factors"])
        return cls(**d)



@dataclass
class LoadedModel:
    """What every frontend loader returns.

    state_dict uses Hugging Face Llama names (model.embed_tokens.weight,
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, model.layers.{i}.mlp.{gate,up,down}_proj.weight,
    model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight, lm_head.weight
    unless tie_word_embeddings), float32 torch tensors, Q/K rows in Hugging Face (rotate_half) order.
    """

    config: DecoderConfig
    state_dict: dict
    tokenizer_json: str | None  # the contents of a tokenizers' tokenizer.json, when the source has one
    source: dict  # what was loaded, for the manifest: kind, path, file sha256/size, ...
    chat_template: str | None = None  # the model's Jinja chat template (instruct models), when the source has one
    # the text the template gets as bos_token / eos_token when the source names it (tokenizer_config.json: it may
    # differ from the config's ids, as in Llama 3.1 whose template ends turns with <|eot_id|>)
    template_tokens: dict = field(default_factory=dict)
    # the sampling defaults the source ships with (compiler/frontend/generation_defaults.py), for the manifest, and
    # the warnings about values it holds that no request could take
    generation_defaults: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)
