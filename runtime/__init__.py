"""aotlm's runtime: loads an artifact folder and serves it (needs only onnxruntime, tokenizers, numpy)."""
from runtime.engine import Engine, Generation, GenerationResult, Timings
from runtime.errors import AotlmRuntimeError, ArtifactError, ModelOutputError, RequestError
from runtime.sampling import SamplingParams
from runtime.scheduler import RequestHandle, Scheduler

__all__ = [
    "Engine", "Generation", "GenerationResult", "Timings", "SamplingParams", "RequestHandle", "Scheduler",
    "AotlmRuntimeError", "ArtifactError", "ModelOutputError", "RequestError",
]
