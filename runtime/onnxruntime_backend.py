"""ONNX Runtime execution of an artifact's prefill and decode graphs over one preallocated KV cache.

The cache is allocated once per batch size: per layer one key and one value OrtValue of shape
[batch, kv_heads, max_context, head_dim], float32 or int8 as the manifest's kv_cache.dtype says. Each is bound
as the `past` input AND the aliased `present` output of both graphs (IOBinding), so a step writes its new
keys/values in place and never copies or reallocates the cache. Only the small per-step tensors (ids, positions,
mask, logits) are rebound.
`SlotCache` is the scheduler's cache: many independent sequences, one slot each (see its docstring).
"""
from __future__ import annotations

import ctypes
import time
import warnings
from pathlib import Path
from typing import Collection

import numpy as np
import onnxruntime as ort

from runtime import forking
from runtime.cpus import cgroup_memory_left, cpus, default_intra_op_threads, restriction, usable_cpus
from runtime.errors import AotlmRuntimeError, AotlmWarning, ArtifactError, RequestError
from runtime.huge_pages import advise
from runtime.manifest import required_features, utf8_path
from runtime.versions import pip_install, release


def _one_onnxruntime() -> None:
    """onnxruntime and onnxruntime-gpu install the same `onnxruntime` module: with both, the files of the one
    installed last overlay the other's, versions mixed (pip warns of neither). Said once, at import."""
    from importlib import metadata

    installed = []
    for name in ("onnxruntime", "onnxruntime-gpu"):
        try:
            installed.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    if len(installed) == 2:
        warnings.warn(f"both {' and '.join(installed)} are installed, into one `onnxruntime` module; uninstall both "
                      f"(pip uninstall -y onnxruntime onnxruntime-gpu) and install one: aotlm[cpu] or aotlm[gpu]",
                      AotlmWarning, stacklevel=2)


_one_onnxruntime()


def installed_distribution() -> str:
    """The pip distribution that provides the `onnxruntime` module here, for install advice: a GPU install told to
    `pip install -U onnxruntime` got both packages in one module (see _one_onnxruntime). onnxruntime-gpu,
    -openvino, -directml, ... each install it; with several (or none found), the CPU package's name."""
    from importlib import metadata

    providers = metadata.packages_distributions().get("onnxruntime", [])
    return providers[0] if len(set(providers)) == 1 else "onnxruntime"


# Said by Engine.load where onnxruntime is a CUDA build (onnxruntime-gpu; it lists CUDA with or without a GPU): the
# runtime creates CPU sessions only
CPU_ONLY_NOTICE = ("this onnxruntime is a CUDA build (onnxruntime-gpu), and aotlm runs onnxruntime artifacts on the "
                   "CPU: their graphs are lowered for onnxruntime's CPU kernels (its CUDA GroupQueryAttention takes no "
                   "float32); for a GPU, build a TensorRT artifact (recipes/smollm2-135m-tensorrt.yaml)")

OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
# The manifest's kv_cache.dtype: float32, or int8 when the build ran quantize_kv_cache (the graphs hold the scales).
CACHE_DTYPES = {"float32": np.float32, "int8": np.int8}


def cache_dtype(kv_spec: dict) -> type:
    dtype = kv_spec.get("dtype", "float32")
    if dtype not in CACHE_DTYPES:
        raise ArtifactError(f"kv_cache.dtype {dtype!r}: the onnxruntime runtime keeps {', '.join(CACHE_DTYPES)} caches; "
                            f"rebuild the artifact for backend onnxruntime")
    return CACHE_DTYPES[dtype]


# onnxruntime's intra-op threads keep spinning for a while after a run returns, waiting for more work. An engine
# has two sessions (prefill and decode), each with its own pool on the same cores: after a 512-token prefill its
# pool's spinning thread took a core from the decode steps that followed (the first 10 gaps 9.2-10.9 ms against
# 6.1-7.7 stopped, INT4 on 2 cores), and the scheduler, which alternates the two, served 7-23% more tokens/s with
# INT4 weights (fp32: 0-8%) with the spinning stopped (benchmarks/thread_spinning.py, README). Stopped when a run
# returns, the pool still spins during a run. One stream alone (decode after decode) gains from a decode pool left
# spinning (TPOT 3-5% lower): Engine.load(spin_after_run=["decode"]), which `aotlm run` uses.
STOP_SPINNING_AFTER_RUN = "session.force_spinning_stop"
# While a run is in progress the pool's threads spin between its operators' pieces of work. On a host whose cores
# other processes keep busy, a spinning thread holds a core they want and waits for one they hold: beside a process
# busy on one core of 2, the default model's TPOT was 0.68x with spinning off and the continuous scheduler's tokens/s
# 1.42x; on an idle host 1.00x and 1.01x (benchmarks/thread_spinning.py --busy-cores, README "Threads after a run").
# Engine.load(spin_during_run=False), `--no-spin`, turns it off.
ALLOW_SPINNING = "session.intra_op.allow_spinning"


def session_options(settings: dict, intra_op_threads: int | None, config: dict | None = None,
                    where: str = "manifest", spin_after_run: bool = False,
                    notices: list[str] | None = None, spin_during_run: bool = True) -> ort.SessionOptions:
    """The backend's session settings, plus `config`: an engine's session config entries (manifest
    engines.<phase>.session_config, recorded by the passes that need them, e.g. dequantize_weights).
    spin_after_run: leave onnxruntime's threads spinning after a run (its default); see STOP_SPINNING_AFTER_RUN.
    spin_during_run: False: its threads never spin, during a run either (ALLOW_SPINNING), for a shared host.
    notices: where a warning goes (Engine.load gives it, once, at its caller's line), else warnings.warn."""
    options = ort.SessionOptions()
    level = settings.get("graph_optimization_level", "all")
    if level not in OPTIMIZATION_LEVELS:
        raise ArtifactError(f"manifest backend.session.graph_optimization_level: {level!r} is not one of "
                            f"{', '.join(OPTIMIZATION_LEVELS)}; the manifest was edited: rebuild the artifact")
    options.graph_optimization_level = OPTIMIZATION_LEVELS[level]
    threads = settings.get("intra_op_threads", 0) if intra_op_threads is None else intra_op_threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ArtifactError(f"manifest backend.session.intra_op_threads: {threads!r} must be an integer >= 0; the "
                            f"manifest was edited: rebuild the artifact")
    cores = usable_cpus()
    if threads > cores:  # the recipe's count, set for the build machine: more threads than cores only contend
        notice = (f"the artifact's recipe sets backend.intra_op_threads: {threads}, more than the {cpus(cores)} this "
                  f"process may use{restriction()}; running with {cores} (pass intra_op_threads / --threads to choose)")
        if notices is None:
            warnings.warn(notice, AotlmWarning, stacklevel=2)
        else:
            notices.append(notice)
        threads = cores
    # 0: onnxruntime's default on a machine this process may use whole; else the CPUs it may use (runtime/cpus.py)
    options.intra_op_num_threads = threads or default_intra_op_threads()
    options.log_severity_level = 3  # warnings about unused initializers etc. are ours to report, not ORT's
    if config is not None and not (isinstance(config, dict) and all(
            isinstance(key, str) and isinstance(value, str) for key, value in config.items())):
        raise ArtifactError(f"{where}: session_config must map onnxruntime config keys to strings, got {config!r}; "
                            f"the manifest was edited: rebuild the artifact")
    if not spin_after_run and STOP_SPINNING_AFTER_RUN not in (config or {}):  # an engine's own entry wins
        options.add_session_config_entry(STOP_SPINNING_AFTER_RUN, "1")
    if not spin_during_run and ALLOW_SPINNING not in (config or {}):
        options.add_session_config_entry(ALLOW_SPINNING, "0")
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    return options


class KVCache:
    """The cache buffers for one batch size, in the graphs' past-input order: views of one numpy block (`block`),
    wrapped zero-copy as OrtValues. One block is one mapping of its own, which freeing gives back to the system:
    a buffer each (1.5 MiB for the default model's) came from the heap, and release_single_stream_cache "freed"
    90 MiB that stayed resident. It is not touched here: pages become resident as tokens fill them."""

    def __init__(self, past_names: list[str], shape: tuple[int, ...], dtype: type = np.float32):
        self.past_names = past_names
        self.shape = shape
        self.dtype = dtype
        self.block = np.empty((len(past_names), *shape), dtype=dtype)
        self.buffers = [ort.OrtValue.ortvalue_from_numpy(part) for part in self.block]

    @property
    def batch(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize * len(self.buffers)


ORT_ELEMENT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64",
                     "tensor(int32)": "int32", "tensor(int8)": "int8"}  # as the manifest spells them


def check_io(session: ort.InferenceSession, engine: dict, path: Path) -> None:
    """The graph's inputs and outputs must be the manifest's I/O spec: names, order, element types, ranks and fixed
    sizes (symbolic sizes are not compared). A graph swapped for another would otherwise fail inside onnxruntime at
    the first step."""
    for kind, values in (("inputs", session.get_inputs()), ("outputs", session.get_outputs())):
        spec = engine.get(kind)
        if not isinstance(spec, list):
            continue  # an older manifest without the spec: nothing to compare
        found = [(v.name, ORT_ELEMENT_TYPES.get(v.type, v.type), [d if isinstance(d, int) else None for d in v.shape])
                 for v in values]
        expected = [(s.get("name"), s.get("dtype"), [d if isinstance(d, int) else None for d in s.get("shape", [])])
                    for s in spec]
        mismatch = next((pair for pair in zip(found, expected) if pair[0] != pair[1]), None)
        if len(found) != len(expected) or mismatch:
            got, want = mismatch or (len(found), len(expected))
            raise ArtifactError(f"{path}: the graph's {kind} differ from the manifest's I/O spec (graph {got}, manifest "
                                f"{want}): the file is not the engine the manifest describes; rebuild the artifact")


# The oldest onnxruntime whose GroupQueryAttention has the outputs lower_onnxruntime declares (output_qk, 1.23; an
# older one built artifacts that not even it could load), and whose standard Attention groups heads right (1.23.0's
# gave other tokens for every grouped-query model lowered with lower_onnx_attention): pyproject's floor.
MIN_ONNXRUNTIME = "1.23.1"
# Features (manifest `requires`) that need a newer onnxruntime than the floor, and why. The int8 cache's
# GroupQueryAttention inputs: 1.23 and 1.24 refuse the graph, 1.25 and 1.26 load it and fail at the first step.
FEATURE_ONNXRUNTIME = {"int8_kv_cache": ("1.27", "an int8 KV cache (GroupQueryAttention's int8 cache inputs)")}


def check_installed(installed: str, features=()) -> None:
    """The installed onnxruntime against aotlm's floor and against what the features (manifest `requires`) need."""
    if release(installed) < release(MIN_ONNXRUNTIME):
        raise ArtifactError(f"onnxruntime {installed} is installed; aotlm's graphs need {MIN_ONNXRUNTIME} or later "
                            f"(GroupQueryAttention's outputs, Attention's grouped heads): "
                            + pip_install(f"-U '{installed_distribution()}>={MIN_ONNXRUNTIME}'"))
    for feature in features:
        if feature in FEATURE_ONNXRUNTIME and release(installed) < release(FEATURE_ONNXRUNTIME[feature][0]):
            needed, what = FEATURE_ONNXRUNTIME[feature]
            raise ArtifactError(f"onnxruntime {installed} is installed; {what} needs {needed} or later: "
                                + pip_install(f"-U '{installed_distribution()}>={needed}'"))


def check_version(built: str | None, installed: str, features=()) -> str | None:
    """The installed onnxruntime against aotlm's floor (refused below it) and against the one that built the graphs:
    an older one may lack their operators or inputs (com.microsoft contrib ops gain them release by release: an int8
    cache's GroupQueryAttention fails to load on 1.23), or may run them (a float artifact built with 1.32 gives the
    same tokens on 1.23.2, the newest release for Intel Macs): tried, and the note returned for a warning and for
    the error where it cannot load them. None where it is as new. features: the manifest's `requires`."""
    check_installed(installed, features)
    if built is not None and not (built[:1].isdigit() and "." in built):  # "abc" read as 0.0.0: anything passed
        raise ArtifactError(f"backend.version {built!r} in the manifest is not an onnxruntime version; the manifest "
                            f"was edited: rebuild the artifact")
    if built and release(installed) < release(built):
        return (f"this artifact was built with onnxruntime {built}, and {installed} is installed (older): install "
                f"{installed_distribution()}>={built}, or rebuild the artifact here (`aotlm build RECIPE`)")
    return None


class OnnxRuntimeBackend:
    def __init__(self, artifact_dir: Path, manifest: dict, intra_op_threads: int | None = None, *,
                 spinning_phases: Collection[str] = (), spin_during_run: bool = True):
        """spinning_phases: the phases whose sessions' threads keep spinning after a run (STOP_SPINNING_AFTER_RUN);
        spin_during_run: False, none spins while a run waits either (ALLOW_SPINNING)."""
        older = check_version(manifest["backend"].get("version"), ort.__version__, required_features(manifest))
        self.notices: list[str] = []  # warnings for Engine.load to give its caller, each once
        if "CUDAExecutionProvider" in ort.get_available_providers():
            self.notices.append(CPU_ONLY_NOTICE)
        self.manifest = manifest
        settings = manifest["backend"].get("session", {})
        self.kv_spec = manifest["kv_cache"]
        self.cache_dtype = cache_dtype(self.kv_spec)  # an unknown cache type fails at load, not at the first step
        aliases = self.kv_spec["output_aliases_input"]  # present name -> past name
        self.present_for_past = {past: present for present, past in aliases.items()}
        self.sessions: dict[str, ort.InferenceSession] = {}
        self.bindings: dict[str, ort.IOBinding] = {}
        self.steps: dict[str, StepBuffers] = {}  # per phase: what run_bound reuses between decode steps
        self.huge_pages = False  # set by Engine.load(huge_pages=True): the slot cache asks for them too
        for phase, engine in manifest["engines"].items():
            options = session_options(settings, intra_op_threads, engine.get("session_config"),
                                      f"manifest engines.{phase}", phase in spinning_phases, self.notices,
                                      spin_during_run=spin_during_run)
            path = Path(artifact_dir) / engine["file"]
            try:
                session = ort.InferenceSession(utf8_path(path), options, providers=["CPUExecutionProvider"])
                check_io(session, engine, path)
            except Exception as error:  # onnxruntime raises its own Fail/InvalidGraph types
                if "pthread_create failed" in str(error):  # its thread pool: the process's limit, not the graph
                    raise AotlmRuntimeError(
                        f"onnxruntime could not start its threads for {path.name} (a pthread_create failed): this "
                        f"process is at its thread limit (a container's pids.max, ulimit -u); load with fewer "
                        f"threads (--threads 1, Engine.load(intra_op_threads=1)) or raise the limit") from None
                if older:  # most likely why: say the fix first
                    raise ArtifactError(f"{path}: onnxruntime cannot load this graph; {older} ({error})") from None
                if isinstance(error, ArtifactError):
                    raise
                raise ArtifactError(f"{path}: onnxruntime cannot load this graph ({error})") from None
            self.sessions[phase] = session
            self.bindings[phase] = session.io_binding()
            self.steps[phase] = StepBuffers()
        if older:  # it loaded: most such artifacts run (the same tokens, where checked); say so once
            self.notices.append(f"{older}; it loaded, and runs")
        self.notices = list(dict.fromkeys(self.notices))  # the same notice from both phases' sessions: once
        self.past_names = [i.name for i in self.sessions["decode"].get_inputs() if i.name in self.present_for_past]
        self.cache: KVCache | None = None
        self.runs = 0  # graph runs on the batch-1 cache, failed ones too: what it holds changed (prefix caching)
        # The prefill graph runs a chunk after cached tokens (the rest of a prompt whose start is cached) where the
        # build found it attends to the cache (manifest engines.prefill.takes_past; compiler/backends/onnxruntime.py)
        self.prefill_takes_past = manifest["engines"].get("prefill", {}).get("takes_past") is True
        # onnxruntime runs any batch and any number of tokens per decode call (TensorRT's engines have limits)
        self.max_batch: int | None = None
        self.max_decode_tokens: int | None = None

    @property
    def bytes_per_sequence(self) -> int:
        """KV cache bytes of one sequence at the max context (every layer's key and value)."""
        return int(np.prod(self.kv_spec["shape"][1:])) * np.dtype(self.cache_dtype).itemsize * len(self.past_names)

    @property
    def int8_cache(self) -> bool:
        """The cache is int8 already: the memory refusals do not advise one."""
        return self.cache_dtype == np.int8

    def check_slots(self, slots: int, reclaimable: int = 0) -> None:
        """Refuse a slot cache that does not fit in memory, counting `reclaimable` bytes (a cache about to be freed)
        as available: called before a running scheduler is closed to make room for the new one."""
        check_slot_memory(slots, self.bytes_per_sequence, reclaimable=reclaimable,
                          int8_cache=self.int8_cache)

    def allocate_cache(self, batch: int) -> KVCache:
        """Allocate (once per batch size) and bind the cache to both graphs' past inputs and present outputs."""
        if self.cache is not None and self.cache.batch == batch:
            return self.cache
        shape = tuple(batch if dim == "batch" else dim for dim in self.kv_spec["shape"])
        check_slot_memory(batch, self.bytes_per_sequence, what="batch", int8_cache=self.int8_cache)
        self.cache = allocate_checked(lambda: KVCache(self.past_names, shape, self.cache_dtype), batch,
                                      self.bytes_per_sequence, what="batch", int8_cache=self.int8_cache)
        if self.huge_pages:  # before its first touch (a new batch size's, or after release_cache)
            self._advise_cache()
        for phase, binding in self.bindings.items():
            binding.clear_binding_outputs()
            self.steps[phase] = StepBuffers()  # what it had bound is gone
            # logits first: get_outputs() lists outputs in binding order; onnxruntime allocates it per run
            binding.bind_output("logits", "cpu")
            for name, buffer in zip(self.cache.past_names, self.cache.buffers):
                binding.bind_ortvalue_input(name, buffer)
                binding.bind_ortvalue_output(self.present_for_past[name], buffer)
        return self.cache

    def use_huge_pages(self) -> None:
        """Engine.load(huge_pages=True), after collapsing what the load wrote: the batch-1 cache (not written yet, so
        left out of the collapse) and the scheduler's slot cache take 2 MiB pages as they are first touched."""
        self.huge_pages = True
        if self.cache is not None:
            self._advise_cache()

    def _advise_cache(self) -> None:
        """The cache's block as a whole: one buffer alone (1.5 MiB for the default model's) holds no whole 2 MiB page
        to mark."""
        advise(self.cache.block)

    def release_cache(self) -> None:
        """Free the batch-1 cache: the bindings let go of its buffers (allocate_cache binds a new one)."""
        for phase, binding in self.bindings.items():
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            self.steps[phase] = StepBuffers()
        self.cache = None

    def run(self, phase: str, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """One step over the bound cache. Arrays are int64 [batch, sequence] / [batch, total]; returns logits."""
        self.runs += 1
        return run_bound(self.sessions[phase], self.bindings[phase], input_ids, position_ids, attention_mask,
                         self.steps[phase])

    def allocate_slots(self, slots: int) -> "SlotCache":
        """A cache of `slots` sequences for the scheduler, beside (not replacing) the batch-1 cache."""
        return SlotCache(self, slots)


class StepBuffers:
    """What run_bound keeps with one binding between single-token steps (decode): per input shape, one logits array
    onnxruntime writes into and one array each for input_ids and position_ids, bound once and then overwritten in
    place (onnxruntime reads a bound numpy array's own memory at every run). Each bind is a call into onnxruntime,
    and right after a run these calls take far longer than when timed alone (1-4 us each; presumably the caches are
    cold from the weights the run streamed): on the INT4 build (scratch, session 26) a bare loop of steps spent
    125-140 us a step outside the run binding all four inputs anew, 58-69 us binding only the mask (its length
    changes every step)."""

    def __init__(self):
        self.logits: dict[tuple, np.ndarray] = {}  # by input_ids' shape
        self.inputs: dict[tuple, np.ndarray] = {}  # by (name, shape)
        self.bound: dict[str, np.ndarray | None] = {}  # name -> the array bound now (None: somebody else's)

    def bind_logits(self, binding: ort.IOBinding, shape: tuple) -> np.ndarray | None:
        logits = self.logits.get(shape)
        if logits is None:
            # A binding keeps the logits OrtValue of its last run, and onnxruntime refuses to write another shape into
            # it (a decode step after a multi-token chunk): ask for a fresh one. Rebinding by name keeps the logits
            # the first output.
            binding.bind_output("logits", "cpu")
            self.bound["logits"] = None
        elif self.bound.get("logits") is not logits:
            binding.bind_output("logits", "cpu", element_type=logits.dtype, shape=logits.shape,
                                buffer_ptr=logits.ctypes.data)
            self.bound["logits"] = logits
        return logits

    def bind_input(self, binding: ort.IOBinding, name: str, values: np.ndarray) -> None:
        array = self.inputs.get((name, values.shape))
        if array is None:
            array = self.inputs[(name, values.shape)] = np.empty(values.shape, np.int64)
        np.copyto(array, values)
        if self.bound.get(name) is not array:
            binding.bind_cpu_input(name, array)
            self.bound[name] = array


# A run of many tokens (a prefill, a prompt's piece) gives the arena memory it grew back at its end: onnxruntime's
# arena kept the peak of the longest prompt for good (4 prompts of 1800 tokens on the default model: +296 MiB held,
# +28-45 with this; a 512-token prefill took as long, 0.98x paired). Single-token decode steps keep theirs.
SHRINK_ARENA = ort.RunOptions()
SHRINK_ARENA.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")


class FreedMemory:
    """What the shrinkage frees goes back to glibc's heap, which keeps it: past its first large free, glibc serves
    blocks of up to 32 MiB from the heap, not from mappings of their own, and a prompt of each new length left its
    free blocks there. With prompt lengths over the whole context, resident memory grew 37-52% from the 100th to the
    1,000th request on a tiny model (the load test's 4-48-token prompts did not show it; in use: flat), and the
    default model's went on climbing (1512 -> 1550 MB over 24 requests). malloc_trim(0) gives the free pages back: at
    most once a second, after a run of many tokens (1-4 ms for the default model's heap; a 300-900-token prefill after
    one took 1.00x its time, paired). Not on a C library without it (musl, macOS): `trim` is then None."""

    INTERVAL_S = 1.0

    def __init__(self):
        try:  # CDLL(None): the process's own symbols, glibc's on Linux (Windows refuses None: TypeError)
            self.trim = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError, TypeError):
            self.trim = None
        self.clock = time.monotonic
        self.last = -self.INTERVAL_S

    def after_shrink(self) -> None:
        if self.trim is not None and (now := self.clock()) - self.last >= self.INTERVAL_S:
            self.last = now
            self.trim(0)


FREED_MEMORY = FreedMemory()


def run_bound(session: ort.InferenceSession, binding: ort.IOBinding, input_ids: np.ndarray, position_ids: np.ndarray,
              attention_mask: np.ndarray, step: StepBuffers | None = None) -> np.ndarray:
    """Bind the per-step inputs and run over whatever cache the binding already holds; returns the logits.

    step: the StepBuffers the caller keeps with this binding. Single-token steps (decode) then reuse its arrays (see
    StepBuffers): the returned logits are valid until the next single-token run of the same shape on this binding
    (every caller samples from them at once). That also spares asking onnxruntime for all of the binding's outputs
    (the cache buffers too) just to reach the logits, ~0.1-0.2 ms a step here.
    """
    reuse = step is not None and input_ids.shape[1] == 1
    logits = step.bind_logits(binding, input_ids.shape) if reuse else None
    if reuse:
        step.bind_input(binding, "input_ids", input_ids)
        step.bind_input(binding, "position_ids", position_ids)
    else:
        if step is not None:  # these bindings now hold the caller's arrays and a logits output of onnxruntime's
            step.bound.clear()
        binding.bind_output("logits", "cpu")
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("position_ids", position_ids)
    binding.bind_cpu_input("attention_mask", attention_mask)
    forking.say_threads_lost(session)  # in a forked child, at an inherited session's first run
    gate = forking.RUNS  # an os.fork() waits for the run (runtime/forking.py): no Python call between the count and
    gate.enter()  # the try, nor in the finally (a KeyboardInterrupt there would leave it counted)
    try:
        session.run_with_iobinding(binding, None if reuse else SHRINK_ARENA)
    finally:
        with gate.lock:
            gate.running -= 1
    if not reuse:
        FREED_MEMORY.after_shrink()
    if logits is not None:
        return logits
    logits = binding.get_outputs()[0].numpy()  # holds its own reference to onnxruntime's buffer
    if reuse:  # from the next step of this shape on, onnxruntime writes straight into it
        step.logits[input_ids.shape] = np.empty_like(logits)
    else:  # let go of it: a slot's binding that sits idle after a scored prompt piece held [1, 128, vocab] floats
        binding.bind_output("logits", "cpu")  # (24 MiB at SmolLM2's vocabulary) until its next run
    return logits


def available_memory_bytes() -> int | None:
    """Memory a new allocation may take now: the kernel's estimate of what is available without swapping (Linux's
    MemAvailable), or less where this process has an address-space limit (`ulimit -v`, `prlimit --as`: RLIMIT_AS),
    past which an allocation fails whatever the machine has free, or a container's memory limit (its cgroup's: the
    machine's MemAvailable does not see it, and past it the OOM killer ends the process as the cache is zeroed);
    None where none is known."""
    known = [bytes_ for bytes_ in (_meminfo_available(), _address_space_left(), cgroup_memory_left())
             if bytes_ is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _address_space_left() -> int | None:
    """RLIMIT_AS's soft limit less this process's virtual size now; None without a limit (or off Linux)."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm", encoding="ascii") as statm:
            size = int(statm.read().split()[0]) * resource.getpagesize()
    except (ImportError, OSError, ValueError, IndexError):
        return None
    return max(limit - size, 0)


def check_slot_memory(slots: int, bytes_per_slot: int, what: str = "slots", reclaimable: int = 0,
                      int8_cache: bool = False) -> None:
    """Refuse a cache of `slots` sequences larger than the memory available now (+ `reclaimable`, about to be freed):
    fail at once with the largest count that fits, not after filling the machine (or with onnxruntime's bad_alloc).
    `what`: the setting, for the message."""
    available = available_memory_bytes()
    available = None if available is None else available + reclaimable - WORKING_MEMORY_BYTES
    slots, bytes_per_slot = int(slots), int(bytes_per_slot)  # Python's: a numpy product wraps
    if available is not None and slots * bytes_per_slot > available:
        raise RequestError(slot_memory_message(slots, bytes_per_slot, what, max(0, available), int8_cache))


# What onnxruntime takes beyond the caches once requests run (its arena keeps what a run took): a review in a 1.5 GiB
# memory cgroup measured ~300 MiB kept after four 1800-token SmolLM2 prompts, and 65 MiB for one; the four slots the
# check had allowed, with 18 MiB to spare, were ended by the OOM killer. The check keeps this much free.
WORKING_MEMORY_BYTES = 384 << 20


def slot_memory_message(slots: int, bytes_per_slot: int, what: str, available: int | None,
                        int8_cache: bool = False) -> str:
    """What check_slot_memory and allocate_checked say: the setting, the bytes it needs, and what fits if known
    (int8_cache: the artifact's cache is int8 already, so that is no advice)."""
    needed = slots * bytes_per_slot
    room = f"{binary_size(WORKING_MEMORY_BYTES)} for onnxruntime's own work"
    if available is not None and available < bytes_per_slot:
        fits = (f"this process can allocate {binary_size(available)} now beside {room}, not one sequence's cache: raise "
                f"its memory limit")
    elif available is not None and available < needed:
        fits = (f"this process can allocate {binary_size(available)} now beside {room}; use at most "
                f"{available // bytes_per_slot}")
    else:  # the allocation failed under a limit this process cannot read
        fits = "allocating them ran out of memory; use fewer"
    if what == "batch":  # the single-stream cache, which Engine.load allocates (batch 1)
        what = "the batch-1 cache Engine.load allocates" if slots == 1 else f"a batch-{slots} cache"
    return (f"{what}: {slots} sequences need {binary_size(needed)} of KV cache ({binary_size(bytes_per_slot)} "
            f"each), and {fits}, or build with a smaller export.max_context"
            + ("" if int8_cache else " or an int8 cache (quantize_kv_cache)"))


def binary_size(count: int) -> str:
    """Bytes in the largest binary unit that leaves a whole number before the point (a tiny model's 32 KiB read
    "0.0 MiB")."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.1f} {unit}"
    return f"{count} B"


def allocate_checked(allocate, slots: int, bytes_per_slot: int, what: str = "slots", int8_cache: bool = False):
    """allocate(), with a failed allocation (numpy's MemoryError names one layer's array) refused as check_slot_memory
    refuses: the setting, the bytes it needs and what fits. Memory can run out between the check and the allocation,
    or under a limit the check cannot read."""
    try:
        return allocate()
    except MemoryError:
        available = available_memory_bytes()
        raise RequestError(slot_memory_message(slots, bytes_per_slot, what, None if available is None else max(
            0, available - WORKING_MEMORY_BYTES), int8_cache)) from None


class SlotCache:
    """The KV cache of the scheduler (runtime/scheduler.py): `slots` sequences, one slot each, allocated once.

    Per layer one key and one value array [slots, kv_heads, max_context, head_dim], owned by numpy and wrapped
    zero-copy as OrtValues. Rows lo:hi of such an array are one contiguous block, so a slot (j:j+1) or a prefix
    of slots (0:k) is bound as both the past input and the aliased present output with no copy: a prefill
    writes straight into its slot, and a decode step runs over the prefix of slots that holds every active
    sequence. One IOBinding per (phase, rows) is made on first use and kept, so a step rebinds only the small
    ids / positions / mask tensors.
    """

    def __init__(self, backend: OnnxRuntimeBackend, slots: int):
        self.backend = backend
        self.slots = slots
        shape = tuple(slots if dim == "batch" else dim for dim in backend.kv_spec["shape"])
        check_slot_memory(slots, backend.bytes_per_sequence, int8_cache=backend.int8_cache)
        self.arrays = allocate_checked(lambda: [np.empty(shape, dtype=backend.cache_dtype) for _ in backend.past_names],
                                       slots, backend.bytes_per_sequence, int8_cache=backend.int8_cache)
        for array in self.arrays:
            if backend.huge_pages:  # before the first touch: its page faults then take 2 MiB pages
                advise(array)
            array.fill(0)  # touch every page now, so resident memory does not creep up as slots fill
        self._bindings: dict[tuple[str, int, int], tuple[ort.IOBinding, list[ort.OrtValue], StepBuffers]] = {}

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.arrays)

    def copy_rows(self, source: int, target: int, start: int, stop: int) -> None:
        """Copy the keys and values of slot `source`'s positions start:stop into slot `target` (prefix sharing between
        requests, runtime/scheduler.py); the OrtValues bound over these arrays see it at once."""
        for array in self.arrays:
            array[target, :, start:stop] = array[source, :, start:stop]

    def views(self, start: int, stop: int) -> list[ort.OrtValue]:
        """OrtValues over rows start:stop of every buffer, sharing the numpy memory (no copy)."""
        return [ort.OrtValue.ortvalue_from_numpy(array[start:stop]) for array in self.arrays]

    def run(self, phase: str, rows: tuple[int, int], input_ids: np.ndarray, position_ids: np.ndarray,
            attention_mask: np.ndarray) -> np.ndarray:
        """One graph run over the cache rows rows[0]:rows[1] (the batch); arrays as OnnxRuntimeBackend.run."""
        key = (phase, *rows)
        if key not in self._bindings:
            binding = self.backend.sessions[phase].io_binding()
            binding.bind_output("logits", "cpu")  # first, as in allocate_cache: get_outputs()[0] is the logits
            views = self.views(*rows)  # kept with the binding: the OrtValues must outlive it
            for name, view in zip(self.backend.past_names, views):
                binding.bind_ortvalue_input(name, view)
                binding.bind_ortvalue_output(self.backend.present_for_past[name], view)
            self._bindings[key] = (binding, views, StepBuffers())
        binding, _, step = self._bindings[key]
        return run_bound(self.backend.sessions[phase], binding, input_ids, position_ids, attention_mask, step)
