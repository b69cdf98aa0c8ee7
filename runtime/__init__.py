"""aotlm's runtime: loads an artifact folder and serves it (needs only onnxruntime, tokenizers, numpy)."""
from runtime.engine import Engine, Generation
from runtime.results import GenerationResult, Timings
from runtime.errors import AotlmRuntimeError, ArtifactError, ModelOutputError, QueueFullError, RequestError
from runtime.sampling import SamplingParams
from runtime.request_handle import LoggedPiece, RequestHandle
from runtime.scheduler import Scheduler

__all__ = [
    "Engine", "Generation", "GenerationResult", "Timings", "SamplingParams", "RequestHandle", "LoggedPiece",
    "Scheduler",
    "AotlmRuntimeError", "ArtifactError", "ModelOutputError", "QueueFullError", "RequestError",
]
