"""What a library user reads: help() and type hints of the public Python API resolve and say something."""
from __future__ import annotations

import inspect
import typing

import pytest

from runtime.engine import Engine, Generation
from runtime.evaluate import Evaluation
from runtime.request_handle import RequestHandle
from runtime.results import GenerationResult, Timings
from runtime.sampling import SamplingParams
from runtime.scheduler import Scheduler
from runtime.tokenizer import TextTokenizer

PUBLIC_CLASSES = [Engine, Generation, RequestHandle, Scheduler, SamplingParams, GenerationResult, Timings,
                  TextTokenizer, Evaluation]


def public_callables(cls):
    for name, member in vars(cls).items():
        if name.startswith("_") and name not in ("__iter__", "__aiter__"):  # constructors: internal
            continue
        function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if inspect.isfunction(function):
            yield f"{cls.__name__}.{name}", function


@pytest.mark.parametrize("cls", PUBLIC_CLASSES, ids=lambda cls: cls.__name__)
def test_type_hints_of_the_public_api_resolve(cls):
    """Names imported only for a type checker left get_type_hints (FastAPI, pydantic, sphinx) a NameError:
    Engine.submit's RequestHandle, Engine.scheduler's Scheduler, RequestHandle.result's GenerationResult."""
    typing.get_type_hints(cls)
    for name, function in public_callables(cls):
        try:
            typing.get_type_hints(function)
        except NameError as error:
            pytest.fail(f"{name}: {error}")


@pytest.mark.parametrize("cls", [Engine, SamplingParams, GenerationResult, TextTokenizer, Timings, RequestHandle,
                                 Scheduler], ids=lambda cls: cls.__name__)
def test_the_classes_a_user_meets_first_say_what_they_are(cls):
    """help(Engine) opened with its internal constructor, and SamplingParams' options were only # comments."""
    assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), cls  # a dataclass's generated one
    if cls is SamplingParams:
        described = {name for name in SamplingParams.__dataclass_fields__ if name in cls.__doc__}
        assert described == set(SamplingParams.__dataclass_fields__)


def test_start_scheduler_names_every_option_it_takes():
    options = [name for name in inspect.signature(Scheduler.checked_slots).parameters if name != "engine"]
    assert all(name in Engine.start_scheduler.__doc__ for name in options), options


def test_what_a_notebook_shows_is_short_and_says_the_state(tiny_artifact):
    """Timings' repr listed a clock reading per token and none of its documented fields; a result's repr held every
    logprobs entry (36,326 characters for one SmolLM2 request); engines, handles and streams said nothing."""
    engine = Engine.load(tiny_artifact)
    try:
        assert repr(engine) == "<Engine 'tiny-random' (onnxruntime, max context 128, no scheduler)>"
        result = engine.generate([1, 5, 9], max_new_tokens=30, ignore_eos=True, logprobs=5, prompt_logprobs=5)
        shown = repr(result)
        assert "ttft_ms=" in shown and "logprobs=[" not in shown and len(shown) < 1500, shown
        assert repr(result.timings).startswith("<Timings prompt_tokens=3, output_tokens=30, ttft_ms=")
        assert "tokenize_ms=" in repr(result.timings)
        handle = engine.submit([1, 5, 9], max_new_tokens=2, ignore_eos=True)
        handle.result(timeout=30)
        assert repr(handle) == f"<RequestHandle {handle.id} finished (length)>"
        stream = engine.stream([1, 5], max_new_tokens=2)
        assert repr(stream) == "<Generation open>"
        stream.wait()
        assert repr(stream) == "<Generation done>"
    finally:
        engine.close()


def test_a_half_built_engine_can_still_be_shown():
    """A debugger (pdb, pytest --showlocals) shows the locals of an Engine whose __init__ raised: repr raised too."""
    engine = Engine.__new__(Engine)
    assert repr(engine) == "<Engine None (None, max context None, no scheduler)>"
