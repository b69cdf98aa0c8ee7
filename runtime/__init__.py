"""aotlm's runtime: loads an artifact folder and serves it (needs only onnxruntime, tokenizers, numpy).

The names below are imported on first use (PEP 562), not with the package: `runtime.errors`, `runtime.kernels` or
`runtime.manifest` alone then cost what they import themselves, not onnxruntime and the tokenizer (~0.3 s), and
`runtime.kernels` (the TensorRT backend's, on a GPU image) needs no tokenizers."""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

# onnxruntime (1.32) records every import in a telemetry database under ~/.cache, and warns on each command where the
# home folder is read-only (a container's): off, unless the user set ORT_DISABLE_TELEMETRY themselves. Here, so that
# it precedes any runtime module's import of onnxruntime.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

_MODULE_OF = {
    "Engine": "runtime.engine", "Generation": "runtime.engine",
    "GenerationResult": "runtime.results", "Timings": "runtime.results",
    "SamplingParams": "runtime.sampling",
    "RequestHandle": "runtime.request_handle", "LoggedPiece": "runtime.request_handle",
    "Scheduler": "runtime.scheduler",
    **dict.fromkeys(("AotlmRuntimeError", "AotlmWarning", "ArtifactError", "ModelOutputError", "QueueFullError",
                     "RequestError", "ThreadLimitError"), "runtime.errors"),
}
__all__ = [  # spelled out, for linters; the test checks it against _MODULE_OF
    "Engine", "Generation", "GenerationResult", "Timings", "SamplingParams", "RequestHandle", "LoggedPiece",
    "Scheduler",
    "AotlmRuntimeError", "AotlmWarning", "ArtifactError", "ModelOutputError", "QueueFullError", "RequestError",
    "ThreadLimitError",
]

if TYPE_CHECKING:  # what type checkers and editors see
    from runtime.engine import Engine, Generation
    from runtime.errors import (AotlmRuntimeError, AotlmWarning, ArtifactError, ModelOutputError, QueueFullError,
                                RequestError, ThreadLimitError)
    from runtime.request_handle import LoggedPiece, RequestHandle
    from runtime.results import GenerationResult, Timings
    from runtime.sampling import SamplingParams
    from runtime.scheduler import Scheduler
else:  # at run time only: a module __getattr__ types every unknown name as Any (mypy stopped catching runtime.Engin)
    def __getattr__(name: str):
        module = _MODULE_OF.get(name)
        if module is None:  # `from runtime import bench` then imports the submodule, as Python does for any package
            raise AttributeError(f"module 'runtime' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
