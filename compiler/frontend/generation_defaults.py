"""The sampling defaults a model ships with, as the manifest records them (`generation_defaults`) and the runtime
applies them to a request's unset options (runtime/engine.py, Engine.load(generation_config="auto")).

- A Hugging Face folder's generation_config.json: repetition_penalty and max_new_tokens always; temperature, top_p,
  top_k and min_p only where do_sample is true (transformers decodes greedily otherwise and ignores them; vLLM's
  `--generation-config auto` takes them whatever do_sample says), with temperature 1 where do_sample is true and the
  file names none (both peers' default). Otherwise only the keys the file sets, as vLLM reads it; transformers also
  fills in its own defaults (top_k 50), which are not the model's.
- A GGUF's general.sampling.* hints (temp, top_k, top_p, min_p, penalty_repeat), which llama.cpp applies.

Ignored, aotlm decoded greedily with its own defaults, where transformers and vLLM sampled at the model's settings
(a review, session 56: Qwen2.5, Llama 3.x Instruct and Gemma ship such files).
"""
from __future__ import annotations

import numpy as np

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")  # generation_config.json's, applied with do_sample only
ALWAYS_KEYS = ("repetition_penalty", "max_new_tokens")
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
             "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}


def from_generation_config(generation: dict, source: str) -> tuple[dict, list[str]]:
    """(the manifest's generation_defaults, warnings) from a generation_config.json's contents."""
    sampling = generation.get("do_sample") is True
    keys = ALWAYS_KEYS + (SAMPLING_KEYS if sampling else ())
    values = {key: generation[key] for key in keys if generation.get(key) is not None}
    if sampling:  # a file that asks to sample and names no temperature samples at 1 (transformers' and vLLM's
        values.setdefault("temperature", 1.0)  # default; Gemma 3's file), where aotlm's own default is greedy
    return checked(values, source)


LLAMA_CPP_TEMPERATURE = 0.8  # llama.cpp's default temp, where a GGUF's hints name none


def from_gguf(field, source: str) -> tuple[dict, list[str]]:
    """The same from a GGUF's metadata as llama.cpp applies it; `field(key)` reads one (None where missing)."""
    values = {name: field(key) for key, name in GGUF_KEYS.items() if field(key) is not None}
    # float32 in the file: its shortest repr (0.6, not 0.6000000238418579) is what the model's authors wrote
    values = {name: float(str(np.float32(value))) if isinstance(value, float) else value
              for name, value in values.items()}
    notes = []
    if values and "temperature" not in values and set(values) & set(SAMPLING_KEYS):  # llama.cpp samples at its own
        values["temperature"] = LLAMA_CPP_TEMPERATURE
    last_n = field("general.sampling.penalty_last_n")
    if last_n is not None and int(last_n) == 0:  # llama.cpp: 0 turns the penalty off
        values.pop("repetition_penalty", None)
    elif "repetition_penalty" in values:
        notes.append(f"{source}: penalty_repeat {values['repetition_penalty']} is applied over the whole sequence, as "
                     f"transformers and vLLM apply it; llama.cpp applies it to the last penalty_last_n tokens "
                     f"({'64 by default' if last_n is None else int(last_n)})")
    if field("general.sampling.mirostat"):
        notes.append(f"{source}: mirostat {field('general.sampling.mirostat')} is not a sampler aotlm has; left out")
    kept, warnings = checked(values, source)
    return kept, notes + warnings


def checked(values: dict, source: str) -> tuple[dict, list[str]]:
    """The values SamplingParams takes, as {"source": ..., "values": {...}} ({} for none), and a warning for each it
    refuses (the build goes on without that one: the model's file, not the user's recipe, holds it)."""
    from runtime.errors import RequestError
    from runtime.sampling import SamplingParams

    kept, warnings = {}, []
    for name, value in values.items():
        value = value.item() if hasattr(value, "item") else value  # a GGUF's numpy scalars
        try:
            SamplingParams(**{name: value})
        except RequestError as error:
            warnings.append(f"{source}: {error}; that default is left out")
            continue
        kept[name] = value
    return ({"source": source, "values": kept} if kept else {}), warnings


# a manifest without generation_defaults (every build writes them since session 60, {} values for none): from
# ea7d399 on builds left them out where the model ships none; before it they were not read at all
UNRECORDED = ("not recorded (aotlm left them out where a model ships none, and did not read them before commit "
              "ea7d399): rebuild it to apply any the model ships")


def describe(defaults: dict) -> str:
    """'temperature 0.7, top_p 0.8 (generation_config.json)', or '' for none."""
    values = (defaults or {}).get("values") or {}
    if not values:
        return ""
    return f"{', '.join(f'{name} {value}' for name, value in values.items())} ({defaults.get('source')})"
