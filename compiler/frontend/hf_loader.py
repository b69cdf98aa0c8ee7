"""Load a Hugging Face model folder (config.json + *.safetensors [+ tokenizer.json]) into a `LoadedModel`.

This module owns the mapping from Hugging Face's config.json keys to DecoderConfig, including the defaults
transformers applies when a key is absent, and reading (possibly sharded) safetensors as float32.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import re

import torch

from compiler.errors import BuildError
from compiler.frontend import hub_id_hint
from compiler.frontend.config import SUPPORTED_ARCHITECTURES, DecoderConfig, LoadedModel
from compiler.frontend.generation_defaults import from_generation_config
from compiler.frontend.random_init import check_state_dict

# q/k/v biases per model type. transformers reads config.json's attention_bias for Llama only (where it puts a bias
# on o_proj too); its Mistral never has them and its Qwen2 always does, whatever that key says.
ATTENTION_BIAS_DEFAULT = {"llama": False, "mistral": False, "qwen2": True}
# transformers' config defaults when config.json has no max_position_embeddings (LlamaConfig, MistralConfig, Qwen2Config)
MAX_POSITIONS_DEFAULT = {"llama": 2048, "mistral": 131072, "qwen2": 32768}
# transformers' num_key_value_heads when config.json has no such key: LlamaConfig takes num_attention_heads (plain
# multi-head attention), MistralConfig 8 and Qwen2Config 32 (an explicit null means num_attention_heads in all three)
NUM_KV_HEADS_DEFAULT = {"mistral": 8, "qwen2": 32}
# safetensors dtypes read as weights (float8 and integer tensors are a quantized checkpoint's codes)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
LFS_POINTER = b"version https://git-lfs"  # how a Git LFS pointer file starts (the file's place in a clone without LFS)


def check_hf_folder(path: str) -> str:
    """The recipe's model folder, absolute, holding config.json; or BuildError saying what it is instead."""
    folder = os.path.abspath(path)
    if os.path.isfile(folder):
        hint = " (a GGUF file is model.source: gguf)" if folder.endswith(".gguf") else ""
        raise BuildError(f"{folder}: a file, not a folder; model.path names the Hugging Face model folder (with "
                         f"config.json and the safetensors weights){hint}")
    if not os.path.isdir(folder):
        raise BuildError(f"Hugging Face model folder not found: {folder}. Check the model path in the recipe."
                         f"{hub_id_hint(folder, 'hf')}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise BuildError(f"{folder}: config.json is missing; a Hugging Face model folder needs config.json.")
    return folder


def load_hf_folder(path: str) -> LoadedModel:
    folder = check_hf_folder(path)
    config_path = os.path.join(folder, "config.json")
    # The config first: an unsupported architecture is the more useful message than missing weights.
    hf_config = _read_json(config_path)
    generation_path = os.path.join(folder, "generation_config.json")
    has_generation = os.path.isfile(generation_path)
    generation = _read_json(generation_path) if has_generation else {}
    config = decoder_config_from_hf(hf_config, generation, config_path)
    refuse_quantized_checkpoint(hf_config, config_path)
    for token_id in ([config.bos_token_id] if config.bos_token_id is not None else []) + list(config.eos_token_ids):
        if not 0 <= token_id < config.vocab_size:  # an end token the model can never produce: it would never stop
            raise BuildError(f"{config_path}: special token id {token_id} (bos_token_id / eos_token_id) is outside "
                             f"the vocabulary (vocab_size {config.vocab_size}); fix the id in config.json or "
                             f"generation_config.json")
    weight_paths = _weight_files(folder)
    state_dict = _read_safetensors(weight_paths)
    head, table = state_dict.get("lm_head.weight"), state_dict.get("model.embed_tokens.weight")
    if config.tie_word_embeddings and head is not None and table is None:
        # the tied pair's one stored copy saved under the head's name: transformers loads it into both
        state_dict["model.embed_tokens.weight"] = table = state_dict.pop("lm_head.weight")
        head = None
    if config.tie_word_embeddings and head is not None:
        if table is not None and head.shape == table.shape and torch.equal(head, table):
            del state_dict["lm_head.weight"]  # some checkpoints save the tied head anyway
        else:  # as transformers does: the checkpoint's own head is used, so the model is not tied after all
            config = dataclasses.replace(config, tie_word_embeddings=False)
    check_state_dict(config, state_dict, folder)
    tokenizer_path = os.path.join(folder, "tokenizer.json")
    tokenizer_json = None
    if os.path.isfile(tokenizer_path):
        tokenizer_json = _read_tokenizer(tokenizer_path)
    chat_template, template_path, template_tokens = _chat_template(folder)
    files = [config_path, *([generation_path] if has_generation else []), *weight_paths] + (
        [tokenizer_path] if tokenizer_json is not None else []) + ([template_path] if template_path else [])
    defaults, warnings = from_generation_config(generation, "generation_config.json")
    return LoadedModel(
        config=config,
        state_dict=state_dict,
        tokenizer_json=tokenizer_json,
        chat_template=chat_template,
        template_tokens=template_tokens,
        generation_defaults=defaults,
        warnings=warnings,
        source={"kind": "hf", "path": folder, "files": [_file_record(folder, f) for f in files]},
    )


def missing_tokenizer_message(folder: str) -> str:
    """Why a folder without tokenizer.json does not build, and how to get one: many Llama 2 / Mistral 7B era folders
    ship only SentencePiece's tokenizer.model, which transformers converts."""
    message = f"{folder}: no tokenizer.json in the folder; add the model's tokenizer.json beside config.json"
    if os.path.isfile(os.path.join(folder, "tokenizer.model")):
        message += (f". The folder has tokenizer.model (SentencePiece), which aotlm does not read; transformers "
                    f"converts it (with the sentencepiece package installed): python -c \"from transformers import "
                    f"AutoTokenizer; AutoTokenizer.from_pretrained('{folder}').save_pretrained('{folder}')\"")
    return message


def config_before_weights(path: str) -> DecoderConfig | None:
    """A build's look at the folder before any weight is read (a 7B model's take minutes and 28 GB as float32): the
    model's config, for the checks that need only it; a folder without tokenizer.json is refused here. None where
    the loader names the trouble first (no folder, no config.json)."""
    folder = os.path.abspath(path)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        return None
    hf_config = _read_json(config_path)
    config = decoder_config_from_hf(hf_config, {}, config_path)
    refuse_quantized_checkpoint(hf_config, config_path)
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise BuildError(missing_tokenizer_message(folder))
    return config


def refuse_quantized_checkpoint(hf_config: dict, config_path: str) -> None:
    """A pre-quantized checkpoint's tensors are codes and scales under other names: say so, not which names are
    missing (the build) or plan it as the float model it is not (`aotlm plan`)."""
    quantization = hf_config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise BuildError(f"{config_path}: quantization_config{f' ({method})' if method else ''}: a pre-quantized "
                         f"checkpoint, which aotlm does not read; point model.path at the model's float checkpoint "
                         f"(float32, float16 or bfloat16) and let the recipe's quantize pass quantize it")


def stored_tensor_names(folder: str) -> set[str] | None:
    """The tensor names a folder's safetensors hold, from the index or the files' headers (no tensor is read);
    None when the folder has no weights to read (a config.json alone can still be planned)."""
    from safetensors import safe_open

    try:
        paths = _weight_files(folder)
    except BuildError:
        return None
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        return set(_read_json(index_path)["weight_map"])
    names = set()
    for path in paths:
        try:
            with safe_open(path, framework="numpy") as handle:
                names.update(handle.keys())
        except Exception:  # noqa: BLE001 -- an LFS pointer or a cut file: the build names it; plan reads on
            return None
    return names


def _read_tokenizer(path: str) -> str:
    """tokenizer.json's text, once the tokenizers library reads it (it raises a bare Exception on a bad file)."""
    from tokenizers import Tokenizer

    with open(path, "rb") as handle:
        data = handle.read()
    if data.startswith(LFS_POINTER):
        raise BuildError(f"{path}: a Git LFS pointer, not the tokenizer; run `git lfs pull` in the model folder")
    try:
        text = data.decode("utf-8")
        Tokenizer.from_str(text)
    except Exception as error:  # noqa: BLE001 -- UnicodeDecodeError, or the library's bare Exception
        raise BuildError(f"{path}: cannot read the tokenizer ({str(error)[:200]}); use the model's own tokenizer.json, "
                         f"saved by a tokenizers release no newer than this one's") from None
    return text


def _chat_template(folder: str) -> tuple[str | None, str | None, dict]:
    """The chat template, the file it came from, and the special tokens' texts tokenizer_config.json gives the
    template (bos, eos, unk, pad and the additional ones, as transformers' special_tokens_map passes them):
    chat_template.jinja (transformers >= 4.43 saves it there), else tokenizer_config.json's chat_template (a
    string, or named templates: the one called "default")."""
    config_path = os.path.join(folder, "tokenizer_config.json")
    tokenizer_config = _read_json(config_path) if os.path.isfile(config_path) else {}
    def text(value):
        return value.get("content") if isinstance(value, dict) else value  # a serialized AddedToken

    tokens = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if isinstance(text(tokenizer_config.get(name)), str):
            tokens[name] = text(tokenizer_config.get(name))
    additional = tokenizer_config.get("additional_special_tokens")
    if isinstance(additional, list) and all(isinstance(text(value), str) for value in additional):
        tokens["additional_special_tokens"] = [text(value) for value in additional]
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as handle:
                return handle.read(), path, tokens
        except UnicodeDecodeError as error:
            raise BuildError(f"{path}: not UTF-8 text ({error}); save the template as UTF-8") from None
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = template
        template = next((t.get("template") for t in named if isinstance(t, dict) and t.get("name") == "default"),
                        None)
        names = [t.get("name") for t in named if isinstance(t, dict)]
        if template is None and names:  # transformers refuses to pick one too ("no default specified")
            raise BuildError(f"{config_path}: chat_template holds {len(names)} named templates "
                             f"({', '.join(map(str, names))}) and none named 'default'; save the one chats should use "
                             f"as chat_template.jinja in the folder (it wins over tokenizer_config.json's, as in "
                             f"transformers)")
    return (template, config_path, tokens) if isinstance(template, str) and template else (None, None, {})


def decoder_config_from_hf(hf: dict, generation: dict, origin: str) -> DecoderConfig:
    """DecoderConfig from a config.json dict (and generation_config.json's, for extra eos ids)."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise BuildError(
            f"{origin}: model_type {model_type!r} is not supported; the compiler supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama-family decoders)."
        )
    if model_type == "llama" and hf.get("attention_bias"):
        raise BuildError(f"{origin}: attention_bias: true ({model_type}) puts a bias on o_proj too, which the decoder "
                         f"does not implement (it takes q/k/v biases only, as in qwen2).")
    if model_type == "llama" and hf.get("mlp_bias"):  # transformers reads it for Llama only, as attention_bias
        raise BuildError(f"{origin}: mlp_bias: true (biases on the MLP projections) is not supported; the decoder's "
                         f"MLP projections have no bias.")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' ACT2FN maps both to SiLU
        raise BuildError(f"{origin}: hidden_act {hf['hidden_act']!r} is not supported; the MLP is SiLU-gated.")
    # transformers 5 moved rope_theta and rope_scaling into rope_parameters; read either spelling. A rope_scaling
    # given beside rope_parameters replaces it whole in transformers 5 (convert_rope_params_to_dict), and 4.x never
    # read rope_parameters: what rope_parameters says and rope_scaling does not is dropped (its rope_theta too,
    # 10000 then), so a config where that changes the model is refused rather than built either way.
    parameters, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    for name, value in (("rope_parameters", parameters), ("rope_scaling", scaling)):
        if not isinstance(value, dict):  # "rope_scaling": "llama3" was a TypeError from a dict merge
            raise BuildError(f"{origin}: {name} is {value!r}, not a mapping of its settings (e.g. "
                             f"{{\"rope_type\": \"llama3\", \"factor\": 8.0, ...}}); fix config.json")
    if parameters and scaling:
        dropped = {key: value for key, value in parameters.items()  # the type is what rope_scaling is for
                   if key not in ("type", "rope_type") and scaling.get(key, hf.get(key)) != value}
        if dropped:
            raise BuildError(f"{origin}: config.json gives both rope_parameters and rope_scaling, and transformers "
                             f"reads rope_scaling alone: rope_parameters' {json.dumps(dropped)} would be dropped "
                             f"(rope_theta {hf.get('rope_theta') or 10000.0} then); keep one of the two, with every "
                             f"setting the model was trained with")
    rope = scaling or parameters
    rope_type = _rope_kind(rope)
    if rope_type == "dynamic":  # NTK scaling raises theta only past max_position_embeddings, which
        rope_type = "default"   # export.max_context never exceeds (check_max_positions): plain RoPE up to there
    if rope_type not in ("default", "llama3"):
        raise BuildError(f"{origin}: rope scaling {rope_type!r} is not supported; the decoder takes plain RoPE, "
                         f"Llama 3.1's 'llama3' scaling, and 'dynamic' (plain RoPE within max_position_embeddings).")
    def size(key: str, default=None) -> int:  # a missing required key: the KeyError below names it
        # the default only for a key absent or null: a 0 (head_dim, max_position_embeddings) had quietly become it
        value = hf[key] if default is None else default if hf.get(key) is None else hf[key]
        if not isinstance(value, int) or isinstance(value, bool):  # 64.5 was cut to 64, "64" read as 64
            raise BuildError(f"{origin}: {key} {json.dumps(value)} must be an integer")
        return value

    try:
        hidden, heads = size("hidden_size"), size("num_attention_heads")
        if heads < 1:  # divided by just below; DecoderConfig checks the rest
            raise ValueError(f"num_attention_heads: {heads} must be >= 1")
        head_dim, theta = size("head_dim", hidden // heads), _rope_theta(hf, rope, origin)
        return DecoderConfig(
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=size("num_key_value_heads", heads if "num_key_value_heads" in hf
                              else NUM_KV_HEADS_DEFAULT.get(model_type, heads)),
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=_number(hf, "rms_norm_eps", 1e-6, origin),  # 1e-6: transformers' default for all three
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=size("max_position_embeddings", MAX_POSITIONS_DEFAULT[model_type]),
            attention_bias=ATTENTION_BIAS_DEFAULT[model_type],
            bos_token_id=_token_id(hf.get("bos_token_id"), "bos_token_id", origin),
            eos_token_ids=_eos_ids((hf.get("eos_token_id"), origin),
                                   (generation.get("eos_token_id"), os.path.join(os.path.dirname(origin),
                                                                                 "generation_config.json"))),
            architecture=model_type,
            sliding_window=_sliding_window(hf, model_type),
            rope_freq_factors=llama3_rope_factors(_llama3_parameters(hf, rope, origin), head_dim, theta, origin)
            if rope_type == "llama3" else None,
        )
    except KeyError as error:
        raise BuildError(f"{origin}: required key {error.args[0]!r} is missing.")
    except (TypeError, ValueError) as error:  # DecoderConfig's checks, in config.json's names
        said = str(error)
        for ours, theirs in CONFIG_JSON_NAMES.items():
            said = re.sub(rf"\b{ours}\b", theirs, said)
        raise BuildError(f"{origin}: invalid model config: {said}")


# DecoderConfig's field names, as a Hugging Face config.json spells them (a refusal names the key the user can see)
CONFIG_JSON_NAMES = {"num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
                     "num_layers": "num_hidden_layers"}


def _number(hf: dict, key: str, default: float, origin: str) -> float:
    """A float setting of config.json: its default when absent or null, else a number (not a string or a bool)."""
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BuildError(f"{origin}: {key} {json.dumps(value)} must be a number")
    return float(value)


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _llama3_parameters(hf: dict, rope: dict, origin: str) -> dict:
    """The rope scaling's parameters; transformers 5 takes original_max_position_embeddings from the top level of
    config.json when it is there: refused when the two disagree, as rope_theta is."""
    top, nested = hf.get("original_max_position_embeddings"), rope.get("original_max_position_embeddings")
    if top is not None and nested is not None and top != nested:
        raise BuildError(f"{origin}: original_max_position_embeddings {top} and the rope scaling's {nested} disagree "
                         f"(transformers 5 reads the first, earlier versions the second); keep the one the model was "
                         f"trained with")
    return {**rope, "original_max_position_embeddings": nested if nested is not None else top}


def llama3_rope_factors(rope: dict, head_dim: int, theta: float, origin: str) -> tuple[float, ...]:
    """Llama 3.1's rope scaling as one divisor per rotary frequency (what llama.cpp stores as rope_freqs).

    Wavelengths (2 pi / inverse frequency) up to original_max_position_embeddings / high_freq_factor keep their
    frequency; those beyond original_max_position_embeddings / low_freq_factor are slowed by `factor`; in between,
    the inverse frequency moves smoothly from one to the other with original_max_position_embeddings / wavelength.
    """
    missing = [key for key in LLAMA3_ROPE_KEYS if not isinstance(rope.get(key), (int, float))
               or isinstance(rope.get(key), bool)]
    if missing:
        raise BuildError(f"{origin}: rope scaling 'llama3' needs numbers for {', '.join(LLAMA3_ROPE_KEYS)}; "
                         f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing or not a number")
    factor, low, high, original = (float(rope[key]) for key in LLAMA3_ROPE_KEYS)
    if not (factor >= 1 and 0 < low < high and original > 0) or not all(map(math.isfinite, (factor, high, original))):
        raise BuildError(f"{origin}: rope scaling 'llama3' with factor {factor}, low_freq_factor {low}, "
                         f"high_freq_factor {high}, original_max_position_embeddings {original}: it needs factor >= 1 and "
                         f"0 < low_freq_factor < high_freq_factor, all finite")
    factors = []
    for index in range(head_dim // 2):
        wavelength = 2 * math.pi * theta ** (2 * index / head_dim)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:  # inverse frequency (1 - s) / factor + s of the plain one, s from 0 (long) to 1 (short wavelengths)
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


QWEN2_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config default
MISTRAL_WINDOW = 4096  # transformers' MistralConfig and Qwen2Config default, when config.json has no sliding_window key


def _rope_theta(hf: dict, rope: dict, origin: str) -> float:
    """rope_theta from the top level (transformers < 5) or rope_parameters / rope_scaling (5, which prefers it)."""
    top, nested = hf.get("rope_theta"), rope.get("rope_theta")
    if top is not None and nested is not None and float(top) != float(nested):
        raise BuildError(f"{origin}: rope_theta {top} and rope_parameters.rope_theta {nested} disagree (transformers 5 "
                         f"reads the second, earlier versions the first); keep the one the model was trained with")
    return float(nested if nested is not None else top if top is not None else 10000.0)


def _rope_kind(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def _sliding_window(hf: dict, model_type: str) -> int | None:
    """The attention window in tokens, when any layer uses one (Mistral's sliding_window; Qwen2's with
    use_sliding_window, on layers from max_window_layers on, or as layer_types says); None for full attention.
    transformers' Llama never reads sliding_window: a Llama config that carries one attends to everything."""
    if model_type not in ("mistral", "qwen2"):
        return None
    window = hf.get("sliding_window", MISTRAL_WINDOW)  # null: no window; left out: 4096, Qwen2Config's default too
    if window is None or (model_type == "qwen2" and not hf.get("use_sliding_window", False)):
        return None
    layers = int(hf.get("num_hidden_layers", 0))
    layer_types = hf.get("layer_types")
    if isinstance(layer_types, list):
        sliding = "sliding_attention" in layer_types
    elif model_type == "qwen2":  # transformers: layer i slides when i >= max_window_layers (default 28)
        sliding = int(hf.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS)) < layers
    else:
        sliding = True
    return int(window) if sliding else None


def _token_id(value, key: str, origin: str) -> int | None:
    """A special token id as config.json gives it: an integer, or null for none. Anything else is refused by name
    (a string had reached load_hf_folder's vocabulary range check as a TypeError traceback)."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        return value
    raise BuildError(f"{origin}: {key} {json.dumps(value)} is not a token id; it must be an integer (or null)")


def _eos_ids(*values: tuple) -> tuple[int, ...]:
    """config.json's eos ids, then generation_config.json's (chat models often add end-of-turn there); each
    value is (eos_token_id: an id, a list of ids or null, the file it came from)."""
    ids: list[int] = []
    for value, origin in values:
        for token_id in value if isinstance(value, list) else [] if value is None else [value]:
            token_id = _token_id(token_id, "eos_token_id", origin)
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def _weight_files(folder: str) -> list[str]:
    """The checkpoint's safetensors files, in transformers' order: model.safetensors alone (a variant beside it,
    model.fp16.safetensors, is another copy; a stale index too), else those its index lists, else model*.safetensors,
    else every *.safetensors (a folder may also hold another format's copy, e.g. Mistral's consolidated.safetensors)."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise BuildError(f"{index_path}: no weight_map; re-download the model")
        bad = next((name for name, file in weight_map.items() if not isinstance(file, str) or not file), None)
        if bad is not None:
            raise BuildError(f"{index_path}: weight_map[{bad!r}] is {weight_map[bad]!r}, not a file name; re-download "
                             f"the model")
        paths = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        missing = [path for path in paths if not os.path.isfile(path)]
        if missing:
            raise BuildError(f"{missing[0]}: listed in model.safetensors.index.json but missing; download it")
        return paths
    paths = sorted(glob.glob(os.path.join(folder, "model*.safetensors"))) or \
        sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not paths:
        raise BuildError(
            f"{folder}: no *.safetensors files; only safetensors weights are read "
            f"(load a pytorch_model.bin folder with transformers and save_pretrained it: that writes safetensors)."
        )
    return paths


def _read_safetensors(paths: list[str]) -> dict:
    from safetensors.torch import load_file

    state_dict, stored_in = {}, {}
    for path in paths:
        if is_lfs_pointer(path):  # a clone without git-lfs: safetensors' own error says "header too large"
            raise BuildError(f"{path}: a Git LFS pointer, not the weights; run `git lfs pull` in the model folder")
        try:
            tensors = load_file(path)
        except Exception as error:  # a truncated or foreign file: say which one
            raise BuildError(f"{path}: cannot read safetensors ({error}). Re-download the file.")
        for name, tensor in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved RoPE's inverse frequencies as a buffer
                continue
            if tensor.dtype not in FLOAT_DTYPES:  # .float() would turn integer codes into plausible-looking weights
                raise BuildError(f"{path}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}; aotlm reads "
                                 f"float weights (float32, float16, bfloat16 or float64), not a quantized checkpoint's: point "
                                 f"model.path at the model's float checkpoint")
            if name in stored_in:  # two weight sets in one folder: the later file's would win, silently
                raise BuildError(f"{path}: tensor {name} is also in {os.path.basename(stored_in[name])}: the folder "
                                 f"holds two copies of the weights; keep one set (or a model.safetensors.index.json "
                                 f"naming the files to read)")
            stored_in[name] = path
            state_dict[name] = tensor.float()
    return state_dict


def is_lfs_pointer(path: str) -> bool:
    """Whether the file is a Git LFS pointer left where the data should be (a clone without git-lfs); False for one
    that cannot be read, whose reader then says why."""
    try:
        with open(path, "rb") as handle:
            return handle.read(len(LFS_POINTER)) == LFS_POINTER
    except OSError:
        return False


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError, RecursionError) as error:  # ValueError: bad JSON or UTF-8, a 5000-digit number
        raise BuildError(f"{path}: cannot read JSON ({str(error)[:200]}).")
    if not isinstance(data, dict):
        raise BuildError(f"{path}: expected a JSON object, found a {type(data).__name__}.")
    return data


def _file_record(folder: str, path: str) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return {"name": os.path.relpath(path, folder), "size_bytes": os.path.getsize(path), "sha256": digest.hexdigest()}
