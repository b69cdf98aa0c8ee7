"""The sampling defaults a model ships with, as the manifest records them (`generation_defaults`) and the runtime
applies them to a request's unset options (runtime/engine.py, Engine.load(generation_config="auto")).

- A Hugging Face folder's generation_config.json: repetition_penalty and max_new_tokens always; temperature, top_p,
  top_k and min_p only where do_sample is true (transformers decodes greedily otherwise and ignores them). Only the
  keys the file sets: vLLM's reading (`--generation-config auto`, its default); transformers also fills in its own
  defaults (top_k 50), which are not the model's.
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
    keys = ALWAYS_KEYS + (SAMPLING_KEYS if generation.get("do_sample") is True else ())
    return checked({key: generation[key] for key in keys if generation.get(key) is not None}, source)


def from_gguf(field, source: str) -> tuple[dict, list[str]]:
    """The same from a GGUF's metadata; `field(key)` reads one (None where missing)."""
    values = {name: field(key) for key, name in GGUF_KEYS.items() if field(key) is not None}
    # float32 in the file: its shortest repr (0.6, not 0.6000000238418579) is what the model's authors wrote
    return checked({name: float(str(np.float32(value))) if isinstance(value, float) else value
                    for name, value in values.items()}, source)


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


def describe(defaults: dict) -> str:
    """'temperature 0.7, top_p 0.8 (generation_config.json)', or '' for none."""
    values = (defaults or {}).get("values") or {}
    if not values:
        return ""
    return f"{', '.join(f'{name} {value}' for name, value in values.items())} ({defaults.get('source')})"
