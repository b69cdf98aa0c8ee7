"""Tests for compiler/frontend/hf_writer.py: write a tiny random model as a Hugging Face folder, read it back.

Needs no backend: the round trip goes through our own loader and through transformers.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from compiler.frontend.config import DecoderConfig
from compiler.frontend.hf_loader import load_hf_folder
from compiler.frontend.hf_writer import write_hf_folder
from compiler.frontend.model import build_decoder
from compiler.frontend.random_init import random_model

TINY = DecoderConfig(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, rope_theta=50000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
    bos_token_id=1, eos_token_ids=(2,),
)
# Tied embeddings, head_dim * heads != hidden, and two eos ids (the second one only in generation_config).
TINY_TIED = dataclasses.replace(TINY, num_kv_heads=4, head_dim=8, tie_word_embeddings=True, eos_token_ids=(2, 3))
TINY_QWEN2 = dataclasses.replace(TINY, architecture="qwen2", attention_bias=True)
CONFIGS = {"llama": TINY, "llama-tied": TINY_TIED, "qwen2": TINY_QWEN2,
           # a window is written as read, so the folder's reader (ours, transformers) attends within it too
           "mistral-window": dataclasses.replace(TINY, architecture="mistral", sliding_window=64),
           "qwen2-window": dataclasses.replace(TINY_QWEN2, sliding_window=64)}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_round_trip_gives_identical_config_and_tensors(tmp_path, config):
    loaded = random_model(config, seed=3)
    folder = write_hf_folder(loaded, tmp_path / "hf")
    again = load_hf_folder(str(folder))
    assert again.config == loaded.config
    assert sorted(again.state_dict) == sorted(loaded.state_dict)
    for name, tensor in loaded.state_dict.items():
        assert again.state_dict[name].dtype == torch.float32
        assert torch.equal(again.state_dict[name], tensor), name
    assert again.tokenizer_json == loaded.tokenizer_json


def test_tied_model_has_no_lm_head_and_names_its_special_tokens(tmp_path):
    from safetensors import safe_open

    folder = write_hf_folder(random_model(TINY_TIED, seed=0), tmp_path / "hf")
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        assert "lm_head.weight" not in weights.keys()
    hf = json.loads((folder / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["tie_word_embeddings"] is True
    assert hf["eos_token_id"] == [2, 3]
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<s>", "</s>")


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_transformers_loads_the_folder_and_matches_the_canonical_decoder(tmp_path, config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = random_model(config, seed=5)
    folder = write_hf_folder(loaded, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    assert type(model).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    assert model.config.tie_word_embeddings == config.tie_word_embeddings
    assert AutoTokenizer.from_pretrained(folder).eos_token_id == config.eos_token_ids[0]

    token_ids = [1, 17, 200, 42, 9, 120]
    length = len(token_ids)
    decoder = build_decoder(loaded.config, loaded.state_dict)
    empty = [torch.zeros(1, config.num_kv_heads, length, config.head_dim) for _ in range(config.num_layers)]
    with torch.no_grad():
        ours, _, _ = decoder(torch.tensor([token_ids]), torch.arange(length)[None], torch.ones(1, length, dtype=torch.long),
                             empty, empty, attend_to_cache=False, logits="all")
        theirs = model(torch.tensor([token_ids])).logits
    max_difference = (ours - theirs).abs().max().item()
    assert max_difference < 1e-4, f"logits differ by up to {max_difference:.2e}"


def test_per_frequency_rotary_divisors_are_refused_not_dropped(tmp_path):
    """transformers' config spells Llama 3.1's scaling by its four parameters, which a GGUF's rope_freqs divisors do
    not give back: writing the folder without them would hand other tools a model with plain RoPE."""
    config = dataclasses.replace(TINY, rope_freq_factors=(1.0, 2.0) + (8.0,) * 6)
    with pytest.raises(ValueError, match=r"rope_freq_factors .* have no Hugging Face config.json spelling"):
        write_hf_folder(random_model(config, seed=0), tmp_path / "m")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("architecture, bias", [("llama", True), ("mistral", True), ("qwen2", False)])
def test_biases_the_architecture_cannot_have_are_refused_not_written(tmp_path, architecture, bias):
    """A random recipe's llama or mistral with q/k/v biases (or a qwen2 without) was written anyway: transformers then
    dropped the biases (Mistral), added one to o_proj (Llama) or expected them (Qwen2), and a benchmark compared
    against another model (logits 0.12 apart); aotlm's own loader refused the folder it wrote."""
    config = dataclasses.replace(TINY, architecture=architecture, attention_bias=bias)
    with pytest.raises(ValueError, match=rf"q/k/v biases {'on' if bias else 'off'} with architecture "
                                         rf"'{architecture}'.* use architecture {'qwen2' if bias else 'llama'}"):
        write_hf_folder(random_model(config, seed=0), tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_the_written_files_hold_what_transformers_reads(tmp_path):
    from safetensors import safe_open

    from compiler.frontend.hf_writer import hf_config_dict

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    loaded = dataclasses.replace(random_model(TINY_TIED, seed=0), chat_template=template)
    folder = write_hf_folder(loaded, tmp_path / "hf")
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        assert weights.metadata() == {"format": "pt"}  # transformers checks it
    assert json.loads((folder / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": [2, 3]}
    assert json.loads((folder / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": TINY_TIED.max_position_embeddings, "clean_up_tokenization_spaces": False,
        "chat_template": template}
    assert load_hf_folder(str(folder)).chat_template == template
    hf = hf_config_dict(TINY)
    assert hf["eos_token_id"] == 2  # one end id is a number, as transformers writes it
    assert hf["rope_theta"] == hf["rope_parameters"]["rope_theta"] == TINY.rope_theta  # both transformers' spellings
    assert hf["rope_parameters"]["rope_type"] == "default"
