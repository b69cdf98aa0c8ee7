"""TensorRT execution of an artifact's prefill and decode engines, torch CUDA tensors as I/O.

One execution context per phase, on one non-default CUDA stream. The KV cache is allocated once per batch size
(per layer one key and one value tensor [batch, kv_heads, max_context, head_dim]) and bound as both the `past`
input and its aliased `present` output, so the plugins write the new rows in place and no step copies the cache.

Decode steps are replayed as CUDA graphs, one per (rows of the cache) bucket: a graph freezes shapes and
addresses, so a decode step binds a full-width attention mask (max_context columns, zeros past each sequence's
length) into static input buffers; the fused graph derives per-sequence lengths from the mask's sum, never from
its width. A graph also freezes the execution context it was captured from, so each bucket captures from a
context of its own (never rebound afterwards), run once eagerly and synchronized before the capture; the phase
contexts serve the eager steps. Prefill runs eagerly (its length changes every request). `last_device_ms` is the
last run's GPU time, from CUDA events around the enqueue (or the replay) on the backend's stream.

An engine runs only with the TensorRT version that built it and on a GPU of the same compute capability:
`check_compatible` refuses anything else with what to do. Written against TensorRT's Python API (10.x / 11.x)
and not yet run on a GPU: tests/runtime/test_tensorrt_backend.py runs the engine tests where tensorrt and a GPU
exist and checks the compatibility rules everywhere.
"""
from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np

from runtime.errors import ArtifactError
from runtime.versions import release


def _wheels(version: str) -> str:
    """The wheel(s) that install exactly this TensorRT: from 10.13.3 on, the bare `tensorrt` is the CUDA 13 build (it
    requires tensorrt_cu13), and CUDA 12 drivers take `tensorrt-cu12` (the `gpu` extra asks only for a floor)."""
    if release(version) >= (10, 13, 3):
        return f"tensorrt=={version} (a CUDA 13 driver, r580 or newer) or tensorrt-cu12=={version} (a CUDA 12 driver)"
    return f"tensorrt=={version}"


def check_compatible(built: dict, installed_version: str | None, capability: tuple[int, int] | None,
                     gpu_name: str | None) -> None:
    """Raise ArtifactError unless this machine can run engines described by the manifest's backend section."""
    if installed_version is None:
        raise ArtifactError(f"this artifact holds TensorRT {built['version']} engines, and tensorrt is not installed: "
                            f"install {_wheels(built['version'])} on a machine with an NVIDIA GPU")
    if capability is None:
        raise ArtifactError("this artifact holds TensorRT engines, and this machine has no CUDA GPU")
    if release(installed_version) != release(built["version"]):  # engines are tied to major.minor.patch, not build
        raise ArtifactError(f"engines built with TensorRT {built['version']}, but {installed_version} is installed; "
                            f"install {_wheels(built['version'])}, or rebuild the artifact here (`aotlm build RECIPE`)")
    here = f"{capability[0]}.{capability[1]}"
    if here != built["compute_capability"]:
        raise ArtifactError(f"engines built for a GPU of compute capability {built['compute_capability']} "
                            f"({built.get('gpu')}), but this GPU ({gpu_name}) is {here}; rebuild the artifact on this GPU")


class TensorRTBackend:
    def __init__(self, artifact_dir: Path, manifest: dict):
        try:
            import tensorrt as trt
        except ImportError:
            check_compatible(manifest["backend"], None, None, None)
        try:
            import torch
        except ImportError as error:
            raise ArtifactError(f"this artifact holds TensorRT engines, whose runtime binds torch CUDA tensors, and "
                                f"torch is not importable ({error}): install torch with CUDA (the `gpu` extra)") from None
        cuda = torch.cuda.is_available()
        check_compatible(manifest["backend"], trt.__version__, torch.cuda.get_device_capability() if cuda else None,
                         torch.cuda.get_device_name() if cuda else None)
        self.trt, self.torch = trt, torch
        self.manifest = manifest
        self.kv_spec = manifest["kv_cache"]
        aliases = self.kv_spec["output_aliases_input"]
        self.present_for_past = {past: present for present, past in aliases.items()}
        self.cuda_graphs = manifest["backend"].get("cuda_graphs", True)
        self.stream = torch.cuda.Stream()
        self.dtype = getattr(torch, self.kv_spec["dtype"])
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        self.engines, self.contexts = {}, {}
        for phase, record in manifest["engines"].items():
            engine = runtime.deserialize_cuda_engine((Path(artifact_dir) / record["file"]).read_bytes())
            if engine is None:
                raise ArtifactError(f"{record['file']}: TensorRT could not deserialize this engine; rebuild the artifact")
            self.engines[phase] = engine
            self.contexts[phase] = new_context(engine, phase)
        decode = self.engines["decode"]
        names = [decode.get_tensor_name(i) for i in range(decode.num_io_tensors)]
        self.past_names = [name for name in names if name in self.present_for_past]
        bound = {**dict.fromkeys(STEP_INPUTS, torch.int64), **dict.fromkeys(self.past_names, self.dtype)}
        self.input_names = {phase: engine_inputs(phase, engine, trt, bound) for phase, engine in self.engines.items()}
        for phase, engine in self.engines.items():
            check_binding_types(phase, engine, trt, torch, bound)
        # The decode engine's optimization profile bounds its rows (export.max_batch) and its tokens per call
        # (backend.tensorrt.decode_max_tokens): the scheduler and evaluation read these limits.
        largest = decode.get_tensor_profile_shape("input_ids", 0)[2]  # [min, opt, max] shapes of profile 0
        self.max_batch, self.max_decode_tokens = int(largest[0]), int(largest[1])
        self.prefill_takes_past = False  # not built or checked for it: a prompt's rest after a past runs the decode engine
        self.cache: DeviceCache | None = None
        self.runs = 0  # graph runs on the batch-1 cache, failed ones too: what it holds changed (prefix caching)
        self.last_device_ms = 0.0
        # One step at a time over all caches: the one-request cache and the scheduler's share the per-phase
        # execution contexts and the stream, and a context is not safe to bind from two threads at once.
        self.run_lock = threading.Lock()

    # -- the cache --------------------------------------------------------------------------------------
    def allocate_cache(self, batch: int) -> "DeviceCache":
        if self.cache is None or self.cache.rows != batch:
            self.cache = DeviceCache(self, batch)
        return self.cache

    def release_cache(self) -> None:
        """Free the batch-1 cache (its buffers and the CUDA graphs captured over them) for torch's allocator to reuse."""
        with self.run_lock:
            self.cache = None

    def allocate_slots(self, slots: int) -> "DeviceCache":
        """The scheduler's cache: rows lo:hi of every buffer are bound as one contiguous batch (no copy)."""
        return DeviceCache(self, slots)

    def run(self, phase: str, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        cache = self.cache or self.allocate_cache(input_ids.shape[0])
        self.runs += 1
        return cache.run(phase, (0, input_ids.shape[0]), input_ids, position_ids, attention_mask)


class DeviceCache:
    """KV buffers [rows, kv_heads, max_context, head_dim] on the GPU, and the per-step static inputs."""

    def __init__(self, backend: TensorRTBackend, rows: int):
        torch = backend.torch
        self.backend, self.rows = backend, rows
        shape = tuple(rows if dim == "batch" else dim for dim in backend.kv_spec["shape"])
        row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=backend.dtype).element_size()
        if rows > 1 and row_bytes % 256:  # rows lo:hi are bound at lo whole rows in (an artifact built before the
            # build checked this: compiler/backends/tensorrt.py check_cache_rows)
            raise ArtifactError(f"a sequence's KV cache rows take {row_bytes} bytes, not a multiple of 256: the "
                                f"scheduler's slots would start at addresses TensorRT refuses; rebuild the artifact "
                                f"(the build now names a max_context that fits)")
        # Zeroed on the stream the engines read and write them on, and under the step lock: another thread's step
        # may be capturing a CUDA graph on that stream, and a capture records whatever is queued on its stream, from
        # any thread (the zero fill would land in that graph and run on every replay, never here).
        with backend.run_lock, torch.cuda.stream(backend.stream):
            self.buffers = [torch.zeros(shape, dtype=backend.dtype, device="cuda") for _ in backend.past_names]
        self.max_context = backend.kv_spec["max_context"]
        self._graphs: dict[tuple[int, int], tuple] = {}  # (lo, hi) -> (CUDAGraph, static inputs, logits, context)

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers)

    def copy_rows(self, source: int, target: int, start: int, stop: int) -> None:
        """Copy the keys and values of row `source`'s positions start:stop into row `target` (prefix sharing between
        the scheduler's requests), on the stream the engines run on, so it lands before the next run."""
        with self.backend.run_lock, self.backend.torch.cuda.stream(self.backend.stream):
            for buffer in self.buffers:
                buffer[target, :, start:stop].copy_(buffer[source, :, start:stop])

    def _bind(self, phase: str, context, rows: tuple[int, int], inputs: dict) -> object:
        """Set the shape and address of every input (cache views included) of one step on `context`, then the
        aliased present outputs and the logits; returns the logits tensor."""
        backend, torch = self.backend, self.backend.torch
        engine = backend.engines[phase]
        lo, hi = rows
        caches = {name: buffer[lo:hi] for name, buffer in zip(backend.past_names, self.buffers)}  # contiguous rows
        tensors = {**inputs, **caches}
        for name in backend.input_names[phase]:
            tensor = tensors[name]
            if not context.set_input_shape(name, tuple(tensor.shape)):  # False: outside the engine's profile
                raise ValueError(f"{phase} engine: input {name} shape {tuple(tensor.shape)} is outside the "
                                 f"optimization profile it was built with ({_profile_shapes(engine, name)})")
            _bind_address(context, name, tensor.data_ptr())
        for name, view in caches.items():
            _bind_address(context, backend.present_for_past[name], view.data_ptr())  # aliased: in place
        shape = tuple(context.get_tensor_shape("logits"))  # known once every input shape is set
        if any(dim < 0 for dim in shape):
            raise RuntimeError(f"TensorRT {phase}: logits shape {shape} is not determined by the input shapes")
        logits = torch.empty(shape, dtype=_torch_dtype(torch, backend.trt, engine.get_tensor_dtype("logits")),
                             device="cuda")
        _bind_address(context, "logits", logits.data_ptr())
        return logits

    def run(self, phase: str, rows: tuple[int, int], input_ids: np.ndarray, position_ids: np.ndarray,
            attention_mask: np.ndarray) -> np.ndarray:
        with self.backend.run_lock:
            return self._run(phase, rows, input_ids, position_ids, attention_mask)

    def _run(self, phase: str, rows: tuple[int, int], input_ids: np.ndarray, position_ids: np.ndarray,
             attention_mask: np.ndarray) -> np.ndarray:
        backend, torch = self.backend, self.backend.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graphed = phase == "decode" and backend.cuda_graphs and input_ids.shape[1] == 1
        if graphed:  # one shape per bucket: a full-width mask, zeros past each sequence's length
            full = np.zeros((attention_mask.shape[0], self.max_context), dtype=np.int64)
            full[:, : attention_mask.shape[1]] = attention_mask
            attention_mask = full
        host = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
        with torch.cuda.stream(backend.stream):
            if graphed and rows in self._graphs:
                graph, static, logits, _ = self._graphs[rows]
                for name, array in host.items():
                    static[name].copy_(torch.from_numpy(array), non_blocking=False)
                start.record(backend.stream)
                graph.replay()
                end.record(backend.stream)
            else:
                # the bucket's own context when this step will be captured: the graph keeps its shapes and state
                context = new_context(backend.engines[phase], phase) if graphed else backend.contexts[phase]
                static = {name: torch.from_numpy(np.ascontiguousarray(array)).to("cuda") for name, array in host.items()}
                logits = self._bind(phase, context, rows, static)
                start.record(backend.stream)
                if not context.execute_async_v3(backend.stream.cuda_stream):
                    raise RuntimeError(f"TensorRT {phase} step failed (execute_async_v3 returned False)")
                end.record(backend.stream)
                if graphed:  # after one eager run with these shapes, and a sync, capture the bucket's graph
                    backend.stream.synchronize()
                    self._graphs[rows] = (capture(torch, backend.stream, context, phase), static, logits, context)
        end.synchronize()
        backend.last_device_ms = start.elapsed_time(end)
        return logits.float().cpu().numpy()


def new_context(engine, phase: str):
    """An execution context, or a clear error: create_execution_context returns None (not an exception) when
    TensorRT cannot allocate the context's device memory, and the next set_input_shape would fail on None."""
    context = engine.create_execution_context()
    if context is None:
        raise RuntimeError(f"TensorRT could not create a {phase} execution context (its log above says why; usually "
                           f"GPU memory: each context holds the activation memory of the engine's largest profile "
                           f"shapes, and each CUDA-graph bucket has its own; set backend.tensorrt.cuda_graphs: false "
                           f"or a smaller export.max_batch)")
    return context


def capture(torch, stream, context, phase: str):
    """One enqueue of `context` captured as a CUDA graph on `stream`. A CUDA call that capture forbids (TensorRT
    returns False, and the invalidated capture makes capture_end raise as the `with` closes, before any return value
    could be read) is reported either way with the setting that avoids graphs. The step then fails, and with it the
    requests in it (its eager run had already written their cache rows); no graph is kept for the bucket.

    capture_error_mode thread_local: only this thread's unsafe CUDA calls are refused while it captures; under the
    default "global" one in another thread (TensorRT freeing a dropped context's memory, a server thread's
    allocation) fails and invalidates this capture."""
    graph = torch.cuda.CUDAGraph()
    advice = f"TensorRT {phase} step could not be captured as a CUDA graph"
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            captured = context.execute_async_v3(stream.cuda_stream)
    except RuntimeError as error:
        raise RuntimeError(f"{advice} ({error}); set backend.tensorrt.cuda_graphs: false") from error
    if not captured:
        raise RuntimeError(f"{advice} (execute_async_v3 returned False); set backend.tensorrt.cuda_graphs: false")
    return graph


def _profile_shapes(engine, name: str) -> str:
    """The engine's [min, opt, max] shapes of an input (profile 0), for error messages."""
    try:
        return ", ".join(str(tuple(shape)) for shape in engine.get_tensor_profile_shape(name, 0))
    except Exception:  # noqa: BLE001 - only for a message; the shape error is what matters
        return "profile unavailable"


STEP_INPUTS = ("input_ids", "position_ids", "attention_mask")  # bound from the caller's int64 arrays


def engine_inputs(phase: str, engine, trt, bound) -> tuple[str, ...]:
    """The engine's own inputs, each one the runtime binds (`bound`: step inputs and caches); refused at load if
    one is not. An ONNX input no node reads (position_ids, once lower_tensorrt derives positions from the mask) may
    be missing from the engine, and set_input_shape on a name it lacks fails as if the shape were out of profile."""
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = tuple(name for name in names if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT)
    unknown = [name for name in inputs if name not in bound]
    if unknown:
        raise ArtifactError(f"{phase} engine: inputs {unknown} are not bound by this runtime; rebuild the artifact")
    return inputs


def check_binding_types(phase: str, engine, trt, torch, expected: dict) -> None:
    """The types the runtime binds (int64 step inputs, the manifest's cache dtype) against the engine's own: a
    mismatch would be read as other numbers, not refused, at the first step."""
    names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
    for name, wanted in expected.items():
        if name not in names:
            continue
        have = _torch_dtype(torch, trt, engine.get_tensor_dtype(name))
        if have != wanted:
            raise ArtifactError(f"{phase} engine: tensor {name} is {have}, but the runtime binds {wanted} (its "
                                f"manifest's record); rebuild the artifact")


def _torch_dtype(torch, trt, dtype):
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int32: torch.int32, trt.int64: torch.int64, trt.bool: torch.bool, trt.int8: torch.int8}
    return table[dtype]


def _bind_address(context, name: str, address: int) -> None:
    """set_tensor_address returns False for an address it refuses (misaligned, an unknown name): the context would
    keep its previous binding, another step's tensor."""
    if not context.set_tensor_address(name, address):
        raise RuntimeError(f"TensorRT refused the address {address:#x} for tensor {name} (it wants 256-byte "
                           f"alignment)")
