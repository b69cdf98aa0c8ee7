"""aotlm's runtime: loads an artifact folder and serves it (needs only onnxruntime, tokenizers, numpy)."""
from runtime.engine import Engine, Generation, GenerationResult, Timings
from runtime.errors import AotlmRuntimeError, ArtifactError, RequestError
from runtime.sampling import SamplingParams

__all__ = [
    "Engine", "Generation", "GenerationResult", "Timings", "SamplingParams",
    "AotlmRuntimeError", "ArtifactError", "RequestError",
]
