"""Write a `LoadedModel` as a Hugging Face model folder: the inverse of `hf_loader.load_hf_folder`.

    folder/config.json              LlamaForCausalLM (or Mistral / Qwen2, after config.architecture), every
                                    DecoderConfig field under transformers' name
    folder/model.safetensors        the float32 state dict; a tied model has no lm_head.weight
    folder/tokenizer.json           when the source has one, with a minimal tokenizer_config.json
    folder/generation_config.json   bos / eos ids (several eos ids live here, as in chat models)

Used to hand our weights to other tools (transformers, onnxruntime-genai's model builder) so that
benchmarks and parity checks compare the same numbers; `load_hf_folder(write_hf_folder(m, d))` gives back
m's config and tensors exactly.
"""
from __future__ import annotations

import json
from pathlib import Path

from compiler.frontend.config import DecoderConfig, LoadedModel
from compiler.frontend.hf_loader import ATTENTION_BIAS_DEFAULT

# config.architecture -> transformers' class name (config.json "architectures")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
WEIGHTS_FILE = "model.safetensors"


def hf_config_dict(config: DecoderConfig) -> dict:
    """config.json's contents for `config`, in transformers' names. ValueError for a config that transformers'
    classes cannot express: they would run another model under the same weights (a peer in a benchmark, say)."""
    biased = ATTENTION_BIAS_DEFAULT[config.architecture]  # as transformers (and so hf_loader) reads them
    if config.attention_bias != biased:
        raise ValueError(f"q/k/v biases {'on' if config.attention_bias else 'off'} with architecture "
                         f"{config.architecture!r}: transformers' {HF_ARCHITECTURES[config.architecture]} "
                         f"{'always has' if biased else 'has no'} such biases (its Llama adds one to o_proj too), so "
                         f"a Hugging Face folder would hold another model; use architecture "
                         f"{'qwen2' if config.attention_bias else 'llama'} for this one")
    eos = list(config.eos_token_ids)
    hf = {
        "architectures": [HF_ARCHITECTURES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        # transformers < 5 reads rope_theta, transformers 5 rope_parameters; write both spellings.
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": config.attention_bias,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if config.architecture in ("mistral", "qwen2"):
        # The window as read; every layer slides (Qwen2: from layer 0). The build keeps contexts within it, where
        # the canonical decoder's whole-context attention is the same math.
        hf["sliding_window"] = config.sliding_window
        hf["use_sliding_window"] = config.sliding_window is not None
        if config.architecture == "qwen2":
            hf["max_window_layers"] = 0
    return hf


def write_hf_folder(loaded: LoadedModel, folder: str | Path) -> Path:
    """Write `loaded` into `folder` (created if needed; files of the same name are replaced); return it."""
    from safetensors.torch import save_file

    config = loaded.config
    if config.architecture not in HF_ARCHITECTURES:
        raise ValueError(f"architecture {config.architecture!r}: known ones are {', '.join(HF_ARCHITECTURES)}")
    if config.rope_freq_factors is not None:  # transformers takes llama3's four parameters, not the divisors
        raise ValueError("rope_freq_factors (per-frequency rotary divisors, e.g. from a GGUF's rope_freqs) have no "
                         "Hugging Face config.json spelling; write the original model's folder instead")
    hf_config = hf_config_dict(config)  # before any file: a config it refuses leaves no folder
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().float().contiguous()
        for name, tensor in loaded.state_dict.items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})  # "pt": transformers checks it
    _write_json(folder / "config.json", hf_config)
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    _write_json(folder / "generation_config.json", generation)
    if loaded.tokenizer_json is not None:
        (folder / "tokenizer.json").write_text(loaded.tokenizer_json, encoding="utf-8")
        tokenizer_config = _tokenizer_config(loaded.tokenizer_json, config)
        if loaded.chat_template is not None:
            tokenizer_config["chat_template"] = loaded.chat_template
        _write_json(folder / "tokenizer_config.json", tokenizer_config)
    return folder


def _tokenizer_config(tokenizer_json: str, config: DecoderConfig) -> dict:
    """Just enough for transformers' AutoTokenizer: the fast tokenizer class and the special tokens' text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)

    def text(token_id: int | None) -> str | None:
        return tokenizer.id_to_token(token_id) if token_id is not None else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(config.bos_token_id),
        "eos_token": text(config.eos_token_ids[0] if config.eos_token_ids else None),
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
