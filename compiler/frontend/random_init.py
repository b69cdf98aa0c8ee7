"""Random-init models for tests, and the canonical state-dict layout every loader is checked against.

`expected_shapes(config)` is the one place that says which tensors the canonical decoder has (Hugging Face
Llama names) and their shapes; `random_model` fills exactly those, and `check_state_dict` lets the GGUF and
Hugging Face loaders refuse a file whose tensors do not fit its own config, before anything is traced.

The random tokenizer is byte-level BPE over the 256 byte symbols with no merges (every byte is one token),
plus the special tokens "<s>" and "</s>". Its ids follow the config so tokenizer and model never disagree:
  - "<s>" sits at config.bos_token_id and "</s>" at config.eos_token_ids[0]; further eos ids get
    "<|eos_1|>", "<|eos_2|>", ...; when the config names no bos / eos, "<s>" / "</s>" take the first
    free ids after the bytes (256 and 257 unless the config's ids are there);
  - the 256 byte symbols take the lowest ids that are not special, in byte order;
  - every id left up to vocab_size is a plain "<|unused_N|>" token, so any id a random model samples decodes.
"""
from __future__ import annotations

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from compiler.errors import BuildError
from compiler.frontend.config import DecoderConfig, LoadedModel
from runtime.tokenizer import BYTE_OF_SYMBOL

INIT_STD = 0.02  # the usual Llama initializer range
NORM_NOISE_STD = 0.1  # norms are 1 + noise, so a graph that drops or misplaces a norm gives different outputs
MIN_RANDOM_VOCAB = 258  # 256 byte symbols + "<s>" + "</s>"


def expected_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the canonical decoder, by Hugging Face name, with its (out, in) shape."""
    c = config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, c.hidden_size)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, q_rows)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def check_state_dict(config: DecoderConfig, state_dict: dict, origin: str) -> None:
    """Raise BuildError when state_dict's names or shapes do not match config (origin names the file)."""
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = [
        f"{name}: {tuple(state_dict[name].shape)} (config says {shape})"
        for name, shape in expected.items()
        if name in state_dict and tuple(state_dict[name].shape) != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_first(missing)}")
    if unexpected:
        problems.append(f"tensors the Llama-family decoder does not use: {_first(unexpected)}")
    if wrong:
        problems.append(f"shapes that do not match the config: {_first(wrong)}")
    if problems:
        raise BuildError(f"{origin}: the weights do not fit the model config; " + "; ".join(problems))
    # A damaged or badly converted checkpoint: every logit would be NaN, and the build would not say why
    not_finite = [name for name, tensor in state_dict.items() if not torch.isfinite(tensor).all()]
    if not_finite:
        raise BuildError(f"{origin}: NaN or infinite values in {_first(not_finite)}; the checkpoint is damaged or was "
                         f"converted wrongly: download or convert it again")


def _first(items: list[str], count: int = 5) -> str:
    more = f" (and {len(items) - count} more)" if len(items) > count else ""
    return ", ".join(items[:count]) + more


def random_model(config: DecoderConfig, seed: int) -> LoadedModel:
    """A deterministic random decoder (same config and seed, same tensors) with a byte-level tokenizer."""
    if config.vocab_size < MIN_RANDOM_VOCAB:
        raise BuildError(
            f"random model: vocab_size {config.vocab_size} is too small; the random byte-level tokenizer needs "
            f"at least {MIN_RANDOM_VOCAB} ids (256 bytes + <s> + </s>). Set vocab_size >= {MIN_RANDOM_VOCAB}."
        )
    generator = torch.Generator().manual_seed(seed)
    state_dict = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            tensor = 1.0 + NORM_NOISE_STD * torch.randn(shape, generator=generator)
        else:  # linear weights, biases, embeddings
            tensor = INIT_STD * torch.randn(shape, generator=generator)
        state_dict[name] = tensor.float()
    return LoadedModel(
        config=config,
        state_dict=state_dict,
        tokenizer_json=random_tokenizer_json(config),
        source={"kind": "random", "seed": seed},
    )


def special_token_ids(config: DecoderConfig) -> dict[int, str]:
    """id -> special token text, following the scheme in the module docstring."""
    for token_id in ([config.bos_token_id] if config.bos_token_id is not None else []) + list(config.eos_token_ids):
        if not 0 <= token_id < config.vocab_size:
            raise BuildError(
                f"random model: special token id {token_id} is outside the vocabulary (vocab_size "
                f"{config.vocab_size}); set bos_token_id / eos_token_ids below vocab_size."
            )
    specials: dict[int, str] = {}
    if config.bos_token_id is not None:
        specials[config.bos_token_id] = "<s>"
    for index, token_id in enumerate(config.eos_token_ids):
        specials.setdefault(token_id, "</s>" if index == 0 else f"<|eos_{index}|>")
    free_ids = (i for i in range(256, config.vocab_size) if i not in specials)
    for text in ("<s>", "</s>"):
        if text not in specials.values():
            free_id = next(free_ids, None)
            if free_id is not None:  # with vocab_size >= 258 there is always room unless bos == eos
                specials[free_id] = text
    return specials


def random_tokenizer_json(config: DecoderConfig) -> str:
    """tokenizer.json text for the random model (see the module docstring for the id scheme)."""
    specials = special_token_ids(config)
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of_symbol)
    plain_ids = [i for i in range(config.vocab_size) if i not in specials]
    if len(plain_ids) < len(byte_symbols):
        raise BuildError(
            f"random model: vocab_size {config.vocab_size} leaves {len(plain_ids)} ids for the 256 byte tokens "
            f"after {len(specials)} special tokens; raise vocab_size or name fewer eos_token_ids."
        )
    vocab = {symbol: token_id for symbol, token_id in zip(byte_symbols, plain_ids)}
    vocab.update({f"<|unused_{token_id}|>": token_id for token_id in plain_ids[len(byte_symbols):]})
    vocab.update({text: token_id for token_id, text in specials.items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Specials are matched whole in the text and skipped by decode(skip_special_tokens=True).
    tokenizer.add_special_tokens([AddedToken(text, normalized=False, special=True) for text in specials.values()])
    return tokenizer.to_str()


def _byte_of_symbol(symbol: str) -> int:
    """GPT-2's byte-to-unicode map: printable bytes are themselves, the other 68 are shifted to 256 + n."""
    return BYTE_OF_SYMBOL[symbol]

