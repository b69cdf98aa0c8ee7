"""The TensorRT runtime: compatibility rules everywhere; engines only where tensorrt and an NVIDIA GPU exist."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from runtime.errors import ArtifactError
from runtime.tensorrt_backend import check_compatible

BUILT = {"name": "tensorrt", "version": "10.13.0.35", "gpu": "NVIDIA H200", "compute_capability": "9.0"}


def test_same_release_and_gpu_generation_run():
    check_compatible(BUILT, "10.13.0.40", (9, 0), "NVIDIA H100 80GB HBM3")  # build number and model may differ


@pytest.mark.parametrize("installed, capability, message", [
    (None, (9, 0), "tensorrt is not installed: install tensorrt==10.13.0.35"),
    ("10.13.0.35", None, "this machine has no CUDA GPU"),
    ("10.14.1.48", (9, 0), "built with TensorRT 10.13.0.35, but 10.14.1.48 is installed"),
    ("10.13.1.35", (9, 0), "built with TensorRT 10.13.0.35, but 10.13.1.35 is installed"),  # a patch release too
    ("10.13.0.35", (8, 9), "compute capability 9.0 (NVIDIA H200), but this GPU (L4) is 8.9; rebuild"),
])
def test_an_engine_for_another_version_or_gpu_is_refused_with_the_fix(installed, capability, message):
    with pytest.raises(ArtifactError) as error:
        check_compatible(BUILT, installed, capability, "L4")
    assert message in str(error.value)


@pytest.mark.parametrize("built", ["10.15.1.29", "11.4.1.3"])
@pytest.mark.parametrize("installed", [None, "10.14.1.48"])
def test_engines_name_the_wheel_for_each_cuda_driver(built, installed):
    """From 10.13.3 the bare `tensorrt` wheel is the CUDA 13 build (it requires tensorrt_cu13): a CUDA 12 host needs
    tensorrt-cu12."""
    with pytest.raises(ArtifactError) as error:
        check_compatible({**BUILT, "version": built}, installed, (9, 0), "H100")
    assert f"install tensorrt=={built} (a CUDA 13 driver, r580 or newer) or tensorrt-cu12=={built}" in str(error.value)


@pytest.mark.parametrize("installed, fix", [
    (None, "install tensorrt==10.13.0.35 on a machine with an NVIDIA GPU"),
    ("10.14.1.48", "install tensorrt==10.13.0.35, or rebuild the artifact here (`aotlm build RECIPE`)"),
])
def test_engines_before_10_13_3_name_only_the_bare_wheel(installed, fix):
    """Its bare wheel was still the CUDA 12 build: no CUDA 13 advice."""
    with pytest.raises(ArtifactError) as error:
        check_compatible(BUILT, installed, (9, 0), "H100")
    assert str(error.value).endswith(fix) and "cu12" not in str(error.value)


def test_an_engine_for_another_gpu_of_the_same_major_generation_is_refused():
    built_on_a10 = {**BUILT, "gpu": "NVIDIA A10", "compute_capability": "8.6"}
    with pytest.raises(ArtifactError, match=r"compute capability 8.6 \(NVIDIA A10\), but this GPU \(L4\) is 8.9"):
        check_compatible(built_on_a10, "10.13.0.35", (8, 9), "L4")


def test_slot_rows_off_tensorrts_address_alignment_are_refused_before_any_allocation():
    """An artifact built before the build checked it: the scheduler's rows would start at refused addresses."""
    import threading
    from types import SimpleNamespace

    import torch

    from runtime.tensorrt_backend import DeviceCache

    backend = SimpleNamespace(torch=torch, dtype=torch.float16, kv_spec={"shape": ["batch", 3, 2001, 64]})
    with pytest.raises(ArtifactError, match="cache rows take 768384 bytes, not a multiple of 256.*rebuild"):
        DeviceCache(backend, rows=4)
    # one sequence is bound at row 0 only, the buffer's own (aligned) address: such an artifact still runs one request
    one = SimpleNamespace(torch=torch, dtype=torch.float16, stream=None, past_names=[], run_lock=threading.Lock(),
                          kv_spec={"shape": ["batch", 3, 2001, 64], "max_context": 2001})  # no layers: nothing is allocated on a GPU here
    assert (DeviceCache(one, rows=1).rows, DeviceCache(one, rows=1).nbytes) == (1, 0)


def test_an_address_tensorrt_refuses_stops_the_step():
    from runtime.tensorrt_backend import _bind_address

    class Context:  # IExecutionContext.set_tensor_address returns False for an address it refuses
        def set_tensor_address(self, name, address):
            return address % 256 == 0

    _bind_address(Context(), "past_key_values.0.key", 4096)
    with pytest.raises(RuntimeError, match="refused the address 0x1080 for tensor past_key_values.0.key"):
        _bind_address(Context(), "past_key_values.0.key", 4224)


def test_an_engine_whose_binding_types_differ_from_the_runtimes_is_refused_at_load():
    from types import SimpleNamespace

    import torch

    from runtime.tensorrt_backend import STEP_INPUTS, check_binding_types

    trt = SimpleNamespace(float32="f32", float16="f16", bfloat16="bf16", int32="i32", int64="i64", bool="b", int8="i8")

    class Engine:  # ICudaEngine's tensor listing and types
        def __init__(self, types):
            self.types = types
            self.num_io_tensors = len(types)

        def get_tensor_name(self, index):
            return list(self.types)[index]

        def get_tensor_dtype(self, name):
            return self.types[name]

    assert STEP_INPUTS == ("input_ids", "position_ids", "attention_mask")  # every input a step binds from the host
    expected = {**dict.fromkeys(STEP_INPUTS, torch.int64), "past_key_values.0.key": torch.float16}
    good = {**dict.fromkeys(STEP_INPUTS, "i64"), "past_key_values.0.key": "f16", "logits": "f32"}
    check_binding_types("decode", Engine(good), trt, torch, expected)
    check_binding_types("prefill", Engine({k: v for k, v in good.items() if k != "position_ids"}), trt, torch, expected)
    with pytest.raises(ArtifactError, match="decode engine: tensor input_ids is torch.int32, but the runtime binds "
                                            "torch.int64"):
        check_binding_types("decode", Engine({**good, "input_ids": "i32"}), trt, torch, expected)
    with pytest.raises(ArtifactError, match="past_key_values.0.key is torch.bfloat16"):
        check_binding_types("decode", Engine({**good, "past_key_values.0.key": "bf16"}), trt, torch, expected)


def _tensorrt_and_gpu() -> str | None:
    """Why the engine tests cannot run here, or None when they can."""
    if importlib.util.find_spec("tensorrt") is None:
        return "tensorrt is not installed (it needs an NVIDIA GPU; install the `gpu` extra there)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    return None


needs_gpu = pytest.mark.skipif(_tensorrt_and_gpu() is not None, reason=str(_tensorrt_and_gpu()))
LOGIT_TOLERANCE = 2e-2  # per logit: float16 engines against the float32 onnxruntime build


def assert_greedy_within_rounding(reference, prompt: list[int], tokens: list[int]) -> None:
    """`tokens`, generated greedily by a float16 engine after `prompt`, are the float32 `reference` engine's greedy
    choices up to rounding: fed the same tokens (teacher forcing), the reference gives each a logit within twice
    LOGIT_TOLERANCE of its own largest (each of the two logits may be off by that much). Where the reference's top
    two are closer than that, either may win; a wrong token beyond rounding, or a mixed-up cache, fails. (Asking for
    equal tokens would fail on such near ties.)"""
    from runtime.evaluate import decode_logits_for

    logits = decode_logits_for(reference)(np.array(prompt + tokens, dtype=np.int64))
    for step, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + step]
        assert row[token] >= row.max() - 2 * LOGIT_TOLERANCE, (
            f"token {step} ({token}): logit {row[token]:.4f}, the reference's largest {row.max():.4f} "
            f"(token {int(row.argmax())})")


def test_the_rounding_check_takes_the_references_own_tokens_and_refuses_another(tiny_engine):
    """The check the GPU tests below compare tokens with, run here on the reference itself."""
    prompt = [1, 5, 9, 200]
    tokens = tiny_engine.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids
    assert_greedy_within_rounding(tiny_engine, prompt, tokens)
    from runtime.evaluate import decode_logits_for

    row = decode_logits_for(tiny_engine)(np.array(prompt))[-1]
    unlikely = int(row.argmin())  # far beyond rounding from the largest
    with pytest.raises(AssertionError, match=f"token 0 \\({unlikely}\\)"):
        assert_greedy_within_rounding(tiny_engine, prompt, [unlikely, *tokens[1:]])


@pytest.fixture(scope="module")
def tensorrt_tiny(tmp_path_factory):
    """The tiny model built for TensorRT (float16, Triton FlashAttention plugins) beside its onnxruntime build."""
    from compiler.build import build
    from compiler.recipe import load_recipe, parse_recipe
    from tests.conftest import TINY_RECIPE

    data = load_recipe(TINY_RECIPE).to_dict()
    data["name"] = "tiny-tensorrt"
    data["export"].update(dtype="float16", max_batch=4)
    data["passes"] = ["cleanup", {"fuse_attention": {"required": True}}, {"lower_tensorrt": {"decode_kv_splits": 4}}]
    data["backend"] = {"name": "tensorrt", "tensorrt": {"workspace_gib": 2, "decode_max_tokens": 1}}
    return build(parse_recipe(data), tmp_path_factory.mktemp("tensorrt"))


@needs_gpu
def test_tensorrt_logits_match_onnxruntime_float32(tensorrt_tiny, tiny_engine):
    from runtime import Engine

    engine = Engine.load(tensorrt_tiny)
    assert engine.manifest["backend"]["name"] == "tensorrt"
    tokens = [1, 17, 99, 4, 250, 31, 8]
    ones = np.ones((1, engine.max_context), np.int64)
    for backend in (engine.backend, tiny_engine.backend):
        backend.allocate_cache(batch=1)
    got = engine.backend.run("prefill", np.array([tokens]), np.arange(7)[None], ones[:, :7])
    want = tiny_engine.backend.run("prefill", np.array([tokens]), np.arange(7)[None], ones[:, :7])
    assert np.abs(got - want).max() < 2e-2, f"prefill logits: max |diff| {np.abs(got - want).max():.3e}"
    for step in range(3):  # decode steps (CUDA graphs after the first) read and extend the in-place cache
        token, length = 5 + step, 7 + step
        got = engine.backend.run("decode", np.array([[token]]), np.array([[length]]), ones[:, : length + 1])
        want = tiny_engine.backend.run("decode", np.array([[token]]), np.array([[length]]), ones[:, : length + 1])
        assert np.abs(got - want).max() < 2e-2, f"decode step {step}: max |diff| {np.abs(got - want).max():.3e}"


@needs_gpu
def test_tensorrt_greedy_tokens_equal_onnxruntime(tensorrt_tiny, tiny_engine):
    from runtime import Engine

    engine = Engine.load(tensorrt_tiny)
    ours = engine.generate([1, 5, 9, 200], max_new_tokens=8, ignore_eos=True)
    assert len(ours.token_ids) == 8
    assert_greedy_within_rounding(tiny_engine, [1, 5, 9, 200], ours.token_ids)
    assert engine.backend.last_device_ms > 0


@needs_gpu
def test_tensorrt_scheduler_and_evaluation_stay_within_the_engine_profile(tensorrt_tiny, tiny_engine):
    """max_batch 4 and decode_max_tokens 1 in this build: the default scheduler takes 4 slots (batched steps at row
    offsets), 5 slots are refused, and evaluation feeds a window one token per decode call."""
    from runtime import Engine, RequestError
    from runtime.evaluate import decode_logits_for

    engine = Engine.load(tensorrt_tiny)
    assert (engine.backend.max_batch, engine.backend.max_decode_tokens) == (4, 1)
    with pytest.raises(RequestError, match="at most 4 sequences per step"):
        engine.start_scheduler(slots=5)
    prompts = [[1, 5, 9, 200], [1, 7], [1, 30, 31, 32, 33, 34], [1, 8, 8], [1, 2, 3]]
    ours = [r.token_ids for r in engine.generate(prompts, max_new_tokens=6, ignore_eos=True)]
    assert engine._scheduler.slots == 4 and all(len(tokens) == 6 for tokens in ours)
    for prompt, tokens in zip(prompts, ours):
        assert_greedy_within_rounding(tiny_engine, prompt, tokens)
    tokens = np.array([1, 17, 99, 4, 250, 31, 8, 5, 6, 7], dtype=np.int64)
    got, want = decode_logits_for(engine)(tokens), decode_logits_for(tiny_engine)(tokens)
    assert np.abs(got - want).max() < 2e-2, f"evaluation logits: max |diff| {np.abs(got - want).max():.3e}"
    engine.close()


@needs_gpu
def test_tensorrt_one_request_and_the_scheduler_at_once_give_their_own_tokens(tensorrt_tiny, tiny_engine):
    """The one-request cache and the scheduler's share the engines' execution contexts: steps from two threads must
    not bind over each other (the backend's run_lock), so each request's tokens are its onnxruntime reference's
    greedy choices (up to rounding) in every round; the one request alone, the same batch-1 shapes each time, makes
    the same tokens every round (the scheduler's batches vary with timing, and TensorRT promises no equality
    across batch sizes)."""
    import threading

    from runtime import Engine

    engine = Engine.load(tensorrt_tiny)
    prompts = [[1, 30 + i, 31, 32, 33, 34, 35, 36] for i in range(4)]
    alone = [1, 5, 9, 200, 7, 7]
    rounds, got_alone = [], []
    for _ in range(3):
        handles = [engine.submit(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
        thread = threading.Thread(target=lambda: got_alone.append(
            engine.generate(alone, max_new_tokens=12, ignore_eos=True).token_ids))
        thread.start()
        rounds.append([h.result(timeout=120).token_ids for h in handles])
        thread.join(timeout=120)
    assert got_alone == [got_alone[0]] * 3 and len(got_alone) == 3
    for prompt, tokens in [*((p, r[i]) for r in rounds for i, p in enumerate(prompts)), (alone, got_alone[0])]:
        assert len(tokens) == 12
        assert_greedy_within_rounding(tiny_engine, prompt, tokens)
    engine.close()


def test_a_missing_torch_is_named_not_reported_as_a_missing_tensorrt(monkeypatch):
    """One try imported tensorrt and torch: a missing torch said "tensorrt is not installed", whose fix (the gpu
    extra) brought no torch."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from runtime.tensorrt_backend import TensorRTBackend

    monkeypatch.setitem(sys.modules, "tensorrt", SimpleNamespace(__version__="10.15.1.29"))  # importable
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    manifest = {"backend": {"name": "tensorrt", "version": "10.15.1.29", "compute_capability": "9.0"}}
    with pytest.raises(ArtifactError, match=r"binds torch CUDA tensors, and torch is not importable .*install torch "
                                            r"with CUDA \(the `gpu` extra\)"):
        TensorRTBackend(Path("."), manifest)


def test_a_step_binds_only_the_inputs_the_engine_has_and_one_it_lacks_is_refused_at_load():
    """position_ids is read by no node once lower_tensorrt derives positions from the mask; an engine without it
    would have been told its shape was "outside the optimization profile" at the first step."""
    from types import SimpleNamespace

    from runtime.tensorrt_backend import engine_inputs

    trt = SimpleNamespace(TensorIOMode=SimpleNamespace(INPUT="in", OUTPUT="out"))

    class Engine:  # ICudaEngine's I/O listing, position_ids dropped as unused
        def __init__(self, *extra):
            self.modes = {"input_ids": "in", "attention_mask": "in", "past_key_values.0.key": "in", "logits": "out",
                          "present.0.key": "out", **dict.fromkeys(extra, "in")}
            self.num_io_tensors = len(self.modes)

        def get_tensor_name(self, index):
            return list(self.modes)[index]

        def get_tensor_mode(self, name):
            return self.modes[name]

    bound = ("input_ids", "position_ids", "attention_mask", "past_key_values.0.key")
    assert engine_inputs("decode", Engine(), trt, bound) == ("input_ids", "attention_mask", "past_key_values.0.key")
    with pytest.raises(ArtifactError, match=r"decode engine: inputs \['cache_position'\] are not bound by this "
                                            r"runtime; rebuild the artifact"):
        engine_inputs("decode", Engine("cache_position"), trt, bound)


def test_an_execution_context_tensorrt_cannot_create_is_named_not_used_as_none():
    """create_execution_context returns None when TensorRT cannot allocate the context (GPU memory): the first
    step then failed with "'NoneType' object has no attribute 'set_input_shape'"."""
    from runtime.tensorrt_backend import new_context

    class Engine:
        def __init__(self, context):
            self.context = context

        def create_execution_context(self):
            return self.context

    assert new_context(Engine("a context"), "decode") == "a context"
    with pytest.raises(RuntimeError, match=r"could not create a decode execution context .* backend.tensorrt.cuda_graphs: false"):
        new_context(Engine(None), "decode")


def test_cache_buffers_are_allocated_under_the_step_lock():
    """The buffers are zeroed on the backend's stream; a step of another thread capturing a CUDA graph on that stream
    would record the fill into its graph (a capture takes what is queued on its stream from any thread)."""
    import contextlib
    import threading
    from types import SimpleNamespace

    from runtime.tensorrt_backend import DeviceCache

    lock, held = threading.Lock(), []

    def zeros(shape, dtype, device):
        held.append(lock.locked())
        return SimpleNamespace(shape=shape)

    torch = SimpleNamespace(empty=lambda shape, dtype: SimpleNamespace(element_size=lambda: 2), zeros=zeros,
                            cuda=SimpleNamespace(stream=lambda stream: contextlib.nullcontext()))
    backend = SimpleNamespace(torch=torch, dtype="float16", stream="the backend's stream", run_lock=lock,
                              past_names=["past_key_values.0.key", "past_key_values.0.value"],
                              kv_spec={"shape": ["batch", 2, 128, 16], "max_context": 128})
    DeviceCache(backend, rows=2)
    assert held == [True, True] and not lock.locked()


def test_a_step_that_cannot_be_captured_as_a_cuda_graph_names_the_setting_either_way():
    """An invalidated capture raises from torch.cuda.graph's exit (capture_end), before the check of
    execute_async_v3's False was reached: the message naming cuda_graphs: false never showed. The capture refuses
    only this thread's unsafe calls (thread_local), so another thread's allocation does not invalidate it."""
    import contextlib
    from types import SimpleNamespace

    from runtime.tensorrt_backend import capture

    modes = []

    def fake_torch(fail_on_exit):
        @contextlib.contextmanager
        def graph(cuda_graph, stream, capture_error_mode):
            modes.append(capture_error_mode)
            yield
            if fail_on_exit:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return SimpleNamespace(cuda=SimpleNamespace(CUDAGraph=lambda: "graph", graph=graph))

    class Context:
        def __init__(self, result):
            self.result = result

        def execute_async_v3(self, stream):
            return self.result

    stream = SimpleNamespace(cuda_stream=7)
    assert capture(fake_torch(False), stream, Context(True), "decode") == "graph"
    with pytest.raises(RuntimeError, match=r"returned False\); set backend.tensorrt.cuda_graphs: false"):
        capture(fake_torch(False), stream, Context(False), "decode")
    with pytest.raises(RuntimeError, match=r"\(CUDA error: operation not permitted .*\); set backend.tensorrt."
                                           r"cuda_graphs: false"):
        capture(fake_torch(True), stream, Context(False), "decode")
    assert modes == ["thread_local"] * 3
