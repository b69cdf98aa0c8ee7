"""Errors the runtime raises for bad input; the command line prints their message without a traceback."""


class AotlmWarning(RuntimeWarning):
    """A notice from aotlm itself (a thread count lowered, a fork's lost threads, a folder not flushed): a library user's
    `-W error` or pytest's filterwarnings raise it; the command line prints it as a `warning:` line whatever -W says."""


class AotlmRuntimeError(Exception):
    """Base of the runtime's user-facing errors."""


class ArtifactError(AotlmRuntimeError):
    """The artifact folder is missing, tampered with, truncated, or of another format or backend version."""


class RequestError(AotlmRuntimeError):
    """A generation request cannot be served as asked (e.g. the prompt does not fit the max context)."""


class QueueFullError(RequestError):
    """The scheduler's queue of waiting requests is full: the request was refused now, and may succeed later (an HTTP
    server answers 503, not 400)."""


class ThreadLimitError(RequestError):
    """No thread could start for the request (the process is at its thread limit): refused now, nothing was queued,
    and it may succeed later (an HTTP server answers 503)."""


class ModelOutputError(AotlmRuntimeError):
    """The model's logits for a step cannot be sampled (NaN, or every entry -inf): the artifact is broken, not
    the request; the scheduler fails only the request that met it."""
