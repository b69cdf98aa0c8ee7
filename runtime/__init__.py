"""aotlm's runtime: loads an artifact folder and serves it (needs only onnxruntime, tokenizers, numpy)."""
import os

# onnxruntime (1.32) records every import in a telemetry database under ~/.cache, and warns on each command where the
# home folder is read-only (a container's): off, unless the user set ORT_DISABLE_TELEMETRY themselves
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from runtime.engine import Engine, Generation
from runtime.results import GenerationResult, Timings
from runtime.errors import (AotlmRuntimeError, AotlmWarning, ArtifactError, ModelOutputError, QueueFullError, RequestError,
                            ThreadLimitError)
from runtime.sampling import SamplingParams
from runtime.request_handle import LoggedPiece, RequestHandle
from runtime.scheduler import Scheduler

__all__ = [
    "Engine", "Generation", "GenerationResult", "Timings", "SamplingParams", "RequestHandle", "LoggedPiece",
    "Scheduler",
    "AotlmRuntimeError", "AotlmWarning", "ArtifactError", "ModelOutputError", "QueueFullError", "RequestError", "ThreadLimitError",
]
