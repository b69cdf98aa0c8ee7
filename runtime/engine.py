"""The runtime's front door: load an artifact, generate or stream text, time every phase.

    engine = Engine.load("artifacts/smollm2-135m")
    result = engine.generate("The lighthouse keeper", max_new_tokens=32)   # greedy, unless the model ships defaults
    result.text, result.token_ids, result.timings

Phases per request: tokenize -> prefill (the prompt, or its uncached rest; first token sampled) -> one decode-graph
step per token (`_generate`).
Timings use time.perf_counter from the moment the request is received (`stream()` called; TTFT includes
tokenization): every result carries its raw timestamps as `result.timings.trace` (a runtime.metrics.RequestTrace,
which runtime.metrics.summarize aggregates over many requests).

Many requests at once: `engine.submit(prompt, **sampling)` (or `generate([...prompts])`) queues them for the
scheduler (runtime/scheduler.py: continuous batching over a slot-based KV cache); `generate(prompt)` and
`stream(prompt)` keep the one-request, batch-1 path above.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import inspect
import operator
import os
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Collection, Iterator, Sequence

import numpy as np

from runtime import evaluate, forking
from runtime.cpus import cpus, restriction, usable_cpus
from runtime.errors import AotlmRuntimeError, AotlmWarning, ArtifactError, RequestError
from runtime.manifest import check_files, check_utf8_path, read_manifest
from runtime.metrics import RequestTrace
from runtime.prefix_cache import rest_piece_tokens, reusable_prefix, scored_rows_reusable
from runtime.results import GenerationResult, Timings, received_at
from runtime.request_handle import RequestHandle
from runtime.sampling import Sampler, SamplingParams, last_token_logits, model_defaults, sampling_params
from runtime.scheduler import Scheduler
from runtime.tokenizer import TextTokenizer
from runtime.versions import pip_install

# Engine.load's spin_after_run for one stream at a time, no scheduler (`aotlm run`, the batch-1 benchmarks): the
# decode session's threads keep spinning between its steps (TPOT 3-5% lower, paired; README "Threads after a run").
SINGLE_STREAM_SPIN = ("decode",)
# A text prompt longer than max_context x this many characters is refused untokenized: text averages about 4
# characters a token, and runs of spaces or symbols a few dozen; no prompt that fits comes near it.
MAX_CHARACTERS_PER_TOKEN = 256
_NO_THREADS: frozenset = frozenset()  # no thread holds the batch-1 cache (Engine._batch_one_threads)
_ENGINES: weakref.WeakSet = weakref.WeakSet()  # every engine alive, for _start_over_in_forked_child
_huge_page_loads = threading.Lock()  # Engine.load(huge_pages=True): one at a time (see load)


def _start_over_in_forked_child() -> None:
    """A forked child has only the thread that forked: a lock another thread held then (a stream on the batch-1
    cache, a first submit starting the scheduler) is held for good in the child, where its next generate waited
    forever. Each engine's locks start free; what the batch-1 cache held is not reused (its rows may be half
    written). The scheduler starts over by its own handler (runtime/scheduler.py). Loads under way in other threads
    do not go on in the child: its exit must not wait for them (nor their lock be held)."""
    global _loads, _loads_lock, _huge_page_loads
    _loads, _loads_lock, _huge_page_loads = 0, threading.Lock(), threading.Lock()
    me = threading.current_thread()
    for engine in list(_ENGINES):
        sessions = list(getattr(engine.backend, "sessions", {}).values())  # onnxruntime's (runtime/forking.py)
        forking.keep_forever(sessions)
        for session in sessions:
            forking.note_threads_lost(session, session.get_session_options().intra_op_num_threads)
        engine._scheduler_lock = threading.Condition()
        engine._restarting = 0
        engine._stepping = False  # a step another thread ran at the fork never ends here: the exit must not wait for it
        if me in engine._batch_one_threads:  # the forking thread's own stream goes on in the child: it holds them
            continue
        engine._batch_one = threading.Lock()
        engine._batch_one_threads = _NO_THREADS
        engine._cached_ids = None
        engine._batch_one_epoch += 1  # a stream another thread of the parent had open fails if the child resumes it


if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(after_in_child=_start_over_in_forked_child)

EXIT_WAIT_S = 30.0  # how long the interpreter's exit waits for a graph run under way on a batch-1 cache, or a load
_exiting = False  # set by _stop_batch_one_at_exit: no batch-1 step or load starts after it
_loads = 0  # Engine.load calls inside the backend (sessions, caches), which the exit waits for as for a step
_loads_lock = threading.Lock()


@atexit.register
def _stop_batch_one_at_exit() -> None:
    """At the interpreter's exit, let a step under way on a batch-1 cache (a daemon thread's request) finish, and
    start no other. Left running, a daemon thread's generate was inside onnxruntime as the interpreter tore it down,
    and the process aborted ("terminate called without an active exception", SIGABRT): the handlers of a
    ThreadingHTTPServer, whose threads are daemons, say. (The scheduler's worker is stopped by its own handler,
    runtime/scheduler.py.) _exiting is set before each engine's _stepping is read, and a step sets _stepping before
    it reads _exiting: either the step sees the exit or the exit sees the step."""
    global _exiting
    with _loads_lock:
        _exiting = True
    deadline = time.monotonic() + EXIT_WAIT_S
    while _loads and time.monotonic() < deadline:  # a daemon thread's load (a server's): it aborted too
        time.sleep(0.005)
    for engine in list(_ENGINES):
        while engine._stepping and time.monotonic() < deadline:
            time.sleep(0.005)


def _stop_at_exit(refusal: str = "no request runs on the batch-1 cache any more") -> None:
    """A batch-1 step or a load asked for after the exit began: a daemon thread waits for the end of the process (a
    traceback printed mid-teardown would be all it could give); the main thread (an exit handler's) is refused."""
    if threading.current_thread() is threading.main_thread():
        raise RequestError(f"the interpreter is exiting: {refusal}")
    threading.Event().wait()


@contextlib.contextmanager
def _loading():
    """Engine.load's work inside onnxruntime or TensorRT, which the interpreter's exit waits for: a daemon thread
    loading the default model as the main thread ended aborted the process (std::bad_alloc, "terminate called
    without an active exception") 4 times in 16."""
    global _loads
    with _loads_lock:
        refused = _exiting
        if not refused:
            _loads += 1
    if refused:
        _stop_at_exit("no engine loads any more")
    try:
        with forking.RUNS.share():  # an os.fork() waits for it: a child forked mid-load hung in its own load
            yield
    finally:
        with _loads_lock:
            _loads -= 1


class Generation:
    """An iterator of text pieces as tokens are decoded; `.result` is set when it ends (iterate to the end, or wait()).

    It holds the batch-1 cache, one sequence at a time, until it ends, is closed (`close()`, or leaving a `with`
    block) or is garbage-collected. A loop left early (break) leaves it open, to resume like any Python iterator
    (`next(generation)` for the first piece, then `for piece in generation` reads on); a loop over a stream nothing
    else refers to (`for piece in engine.stream(...)`) frees the cache when it ends. A closed stream has no result."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.result: GenerationResult | None = None
        self._closed = False
        self._error: BaseException | None = None

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> str:
        if self.result is not None:  # read to the end already: nothing more to yield
            raise StopIteration
        if self._error is not None:
            raise self._error
        if self._closed:
            self._pieces.close()  # closed from another thread while this one read: its generator ends here
            raise RequestError("this stream was closed before it finished, so it has no result; iterate it to the "
                               "end, or call wait(), before closing it")
        try:
            return next(self._pieces)
        except StopIteration as done:
            self.result = done.value
            raise StopIteration from None
        except BaseException as error:  # the request failed (its generator is finished): say so at every call
            self._error = error
            raise

    def close(self) -> None:
        """End the request now if it has not ended, freeing the batch-1 cache (it then has no result). From another
        thread while one reads it (a server's watcher of a client that left), the reader's next call ends it."""
        if self.result is None:  # again after a close from another thread: that one may not have closed it
            self._closed = True
            try:
                self._pieces.close()
            except ValueError:  # "generator already executing": it ends at the reader's next call, which frees the
                pass  # cache (left held, every later generate waited for as long as anything referred to this)

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def wait(self) -> GenerationResult:
        for _ in self:
            pass
        return self.result

    def __reduce__(self):
        raise TypeError("a Generation belongs to the process and engine that started it: send its text or its "
                        "`result` (a GenerationResult pickles) instead")

    def __repr__(self) -> str:
        state = ("done" if self.result is not None else "failed" if self._error is not None else
                 "closed" if self._closed else "open")
        return f"<Generation {state}>"


LOAD_RETRIES_AFTER_SWAP = 2  # Engine.load starts over this many times when a build replaced the folder meanwhile


def _folder_identity(folder: Path) -> tuple[int, int] | None:
    """(device, inode) of the artifact folder (a link followed): a build's swap puts another folder at the path."""
    try:
        status = os.stat(folder)
    except OSError:
        return None
    return status.st_dev, status.st_ino


class Engine:
    """A built artifact, loaded: make one with Engine.load(path), not with this constructor.

    One stream at a time on a batch-1 cache: generate(prompt), stream(prompt), chat(messages). Many at once through
    continuous batching: submit(prompt) -> RequestHandle, generate([prompts]); start_scheduler sets its slots. close()
    (or a `with` block) stops the scheduler, freeing its slot cache and failing what is unfinished; the sessions and
    the batch-1 cache (release_single_stream_cache) go with the engine.

    Attributes: max_context (prompt + output tokens a sequence may hold), eos_token_ids (the tokens that end a
    generation), tokenizer (a TextTokenizer: encode, decode), manifest (the artifact's manifest.json, read),
    huge_pages (Engine.load's report on putting the weights on 2 MiB pages, None when not asked), prefix_caching
    (as Engine.load was given it), scheduler (the running Scheduler, or None).
    """

    def __del__(self):
        """Dropped: the scheduler (whose slot cache binds the sessions) goes first, then the backend, and then what
        they held goes back to the system: glibc kept it in its heap (230-320 MB of the default model's stayed
        resident until some engine ran a prefill; runtime/onnxruntime_backend.py, FreedMemory)."""
        try:
            self.__dict__.pop("_scheduler", None)
            self.__dict__.pop("backend", None)
            backend_module = sys.modules.get("runtime.onnxruntime_backend")
            if backend_module is not None and backend_module.FREED_MEMORY.trim is not None:
                backend_module.FREED_MEMORY.trim(0)
        except Exception:  # noqa: BLE001 -- a half-made engine, or the interpreter's exit: nothing to give back
            pass

    def __copy__(self):
        raise TypeError("an Engine is not copied: share the one you have (it is thread-safe), or Engine.load the "
                        "artifact again for an independent one")

    def __deepcopy__(self, memo):
        return self.__copy__()

    def __reduce__(self):
        """multiprocessing pickles what it sends: onnxruntime's sessions said "cannot pickle 'InferenceSession'"."""
        raise TypeError("an Engine cannot be sent to another process: load it there (Engine.load in a multiprocessing "
                        "Pool's initializer, or in each worker), or send prompts and results instead")

    def __repr__(self) -> str:  # getattr: a debugger shows an engine whose __init__ failed part way too
        scheduler = getattr(self, "_scheduler", None)
        running = "no scheduler" if scheduler is None or scheduler.closed else f"scheduler of {scheduler.slots} slots"
        manifest = getattr(self, "manifest", None) or {}
        return (f"<Engine {manifest.get('name')!r} ({(manifest.get('backend') or {}).get('name')}, max context "
                f"{getattr(self, 'max_context', None)}, {running})>")

    def __init__(self, artifact_dir: Path, manifest: dict, backend, tokenizer: TextTokenizer):
        self.artifact_dir = artifact_dir
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = tokenizer
        self.max_context = manifest["kv_cache"]["max_context"]
        self.eos_token_ids = tuple(manifest["tokenizer"]["eos_token_ids"])
        self.backend.allocate_cache(batch=1)  # once, here: not inside any request's timing
        self.huge_pages: dict | None = None  # Engine.load's report (runtime/huge_pages.py), None when not asked
        self._scheduler: Scheduler | None = None  # continuous batching, started by submit / start_scheduler
        self._scheduler_lock = threading.Condition()  # two first submits from two threads start one scheduler
        self._restarting = 0  # start_scheduler calls under way: submits wait for the scheduler they start
        self._batch_one = threading.Lock()  # stream/generate: one sequence at a time on the batch-1 cache
        self._stepping = False  # a batch-1 step (a graph run) is under way: the interpreter's exit waits for it
        # The threads (objects: a finished thread's id is given to the next one) that resumed the request inside it.
        self._batch_one_threads: set[threading.Thread] | frozenset = _NO_THREADS
        # Counts the forks that took the batch-1 cache from a stream of the parent (_start_over_in_forked_child)
        self._batch_one_epoch = 0
        self._chat_template: str | None = None  # the artifact's chat template, read by load (prepare_chat)
        self.prefix_caching = False  # set by Engine.load: see _reusable_prefix
        # The model's own sampling defaults (manifest generation_defaults), which Engine.load(generation_config="auto")
        # applies: {} where the model has none or the caller chose "none"
        self.generation_defaults: dict = {}
        # What the batch-1 cache holds after the last request: (the cache, the backend's run count then, the token
        # ids whose keys and values fill its first rows). Any other run on it (evaluation, a benchmark) changes
        # the count, and then nothing is reused.
        self._cached_ids: tuple[weakref.ref, int, list[int]] | None = None
        _ENGINES.add(self)

    @classmethod
    def load(cls, artifact_dir: str | Path, *, verify: bool = False, intra_op_threads: int | None = None,
             huge_pages: bool = True, spin_after_run: bool | Collection[str] = False,
             prefix_caching: bool = False, generation_config: str = "auto",
             spin_during_run: bool = True) -> "Engine":
        """Check the manifest (format version, file sizes; sha256 too if verify) and open both graphs.

        intra_op_threads: threads per onnxruntime session, at most the CPUs this process may use; None: the recipe's
        backend.intra_op_threads; 0 (also the recipe's default): onnxruntime's default, or the CPUs this process may
        use where a CPU limit or affinity restricts it (runtime/cpus.py).
        huge_pages: then put the memory onnxruntime allocated while loading (its weights) on 2 MiB pages
        (runtime/huge_pages.py: decode steps 5-8% faster, load 0.5-2.4 s longer for the default model's INT4 and
        fp32 builds); `engine.huge_pages` reports what was done.
        spin_after_run: let onnxruntime's threads spin on after each run, its default: True for both sessions,
        or a list of the phases ("prefill", "decode") whose sessions keep spinning (a bare string is refused).
        Off here: the prefill and decode sessions each have a thread pool on the same cores, and one spinning after
        its run slows the other (runtime/onnxruntime_backend.py, STOP_SPINNING_AFTER_RUN). ["decode"] suits one
        stream at a time (TPOT 3-5% lower, `aotlm run` uses it), not the scheduler, which runs prefills between
        decode steps. An engine whose manifest session_config sets that key keeps its own value.
        spin_during_run: False: onnxruntime's threads never spin, during a run either, for a host whose cores other
        processes use (TPOT 0.68x beside one busy core of 2, 1.00x on an idle host: runtime/onnxruntime_backend.py,
        ALLOW_SPINNING). False overrides spin_after_run. The spinning flags apply to onnxruntime artifacts only.
        generation_config: "auto" (the default, as vLLM's): a request's unset sampling options take the model's own
        defaults where its source ships them (generation_config.json's temperature, top_p, top_k and min_p with
        do_sample, and repetition_penalty; a GGUF's general.sampling; `engine.sampling_defaults` shows what they
        apply, `engine.generation_defaults` and `aotlm inspect` all the model ships, max_new_tokens too, which only
        the server applies); "none": aotlm's (greedy). A SamplingParams passed whole is used as it is.
        prefix_caching: a request whose prompt begins with the tokens a previous one left in the cache (its prompt
        and output: the next turn of a chat) prefills only the rest (result.timings.cached_prompt_tokens says how
        many it reused): on the batch-1 path (generate, stream, chat) after the request before, and in the
        scheduler's slots (submit) after the request that left a free slot. The rest runs through the prefill graph
        where the artifact's takes a past (its logits then equal a whole prefill's), else through the decode graph
        (equal within float rounding). Off by default: repeated prompts would then time a cache hit, not a
        prefill."""
        # An engine dropped after its scheduler ran is in a cycle with it, which only Python's cycle collector frees:
        # a model switcher that `del`s its engine kept every earlier model until a full collection (4 switches of the
        # default model: 2.0 -> 8.0 GB resident). Collected before this load takes its memory, where an engine with a
        # scheduler is alive (or unreachable, not yet collected) and the host has not turned collection off: a
        # collection holds the GIL (~10 ms in a small process, 0.9 s in one holding millions of objects).
        if gc.isenabled() and any(getattr(engine, "_scheduler", None) is not None for engine in list(_ENGINES)):
            gc.collect()
        if isinstance(artifact_dir, os.PathLike):  # pathlib's pure paths, and any other path object
            artifact_dir = os.fspath(artifact_dir)
        if not isinstance(artifact_dir, (str, Path)):
            raise ArtifactError(f"artifact_dir must be a path (str or pathlib.Path), got {type(artifact_dir).__name__}"
                                + ("; decode it to str first" if isinstance(artifact_dir, bytes) else ""))
        if intra_op_threads is not None and (isinstance(intra_op_threads, bool) or not isinstance(intra_op_threads, int)
                                             or intra_op_threads < 0):
            raise RequestError(f"intra_op_threads must be an integer >= 0 (0: onnxruntime's default) or None, got "
                               f"{intra_op_threads!r}")
        cores = usable_cpus()
        if intra_op_threads is not None and intra_op_threads > cores:  # they only contend; thousands hang
            raise RequestError(f"intra_op_threads: {intra_op_threads} is more than the {cpus(cores)} this process may "
                               f"use{restriction()}; give at most {cores}, or 0 for the default")
        if generation_config not in ("auto", "none"):
            raise RequestError(f"generation_config must be 'auto' (the model's sampling defaults) or 'none' (aotlm's), "
                               f"got {generation_config!r}")
        for name, flag in (("verify", verify), ("huge_pages", huge_pages), ("prefix_caching", prefix_caching),
                           ("spin_during_run", spin_during_run)):
            if not isinstance(flag, bool):
                raise RequestError(f"{name} must be True or False, got {flag!r}")
        if not (isinstance(spin_after_run, bool) or isinstance(spin_after_run, (list, tuple, set, frozenset))
                and all(isinstance(phase, str) for phase in spin_after_run)):
            raise RequestError(f"spin_after_run must be True, False or a list of phases (\"prefill\", \"decode\"), "
                               f"got {spin_after_run!r}")
        if isinstance(artifact_dir, str) and not artifact_dir.strip():
            read_manifest(artifact_dir)  # its refusal: an empty path is no folder (Path("") would read ".")
        folder = Path(artifact_dir)
        # A build replaces an artifact by renaming a new folder over it: one that did so while this load read the
        # manifest and opened the files had given an engine of two builds (its manifest one's, its graphs the
        # other's; verify=True passed). The folder's identity before and after tells; the load then starts over.
        swapped = (f"{folder}: a build replaced it while it loaded, {1 + LOAD_RETRIES_AFTER_SWAP} times; load it "
                   f"again once the builds finish")
        for attempt in range(1 + LOAD_RETRIES_AFTER_SWAP):
            before = _folder_identity(folder)
            try:
                engine = cls._load_once(folder, verify, generation_config, spin_after_run, intra_op_threads,
                                        huge_pages, prefix_caching, spin_during_run)
            except ArtifactError as refused:
                # A swap during the load mixes two builds' files: the checks refuse them as a damaged artifact
                # ("rebuild the artifact") when both builds are whole. The folder's identity tells; start over.
                if _folder_identity(folder) == before:
                    raise
                if attempt == LOAD_RETRIES_AFTER_SWAP:
                    raise ArtifactError(swapped) from refused
                continue
            if _folder_identity(folder) == before:
                break
            engine.close()
        else:
            raise ArtifactError(swapped)
        for notice in getattr(engine.backend, "notices", ()):  # at the caller's line, once (not per session)
            warnings.warn(notice, AotlmWarning, stacklevel=2)
        return engine

    @classmethod
    def _load_once(cls, folder: Path, verify: bool, generation_config: str, spin_after_run, intra_op_threads,
                   huge_pages: bool, prefix_caching: bool, spin_during_run: bool) -> "Engine":
        """One attempt of Engine.load (its arguments checked): the manifest, the files, the sessions."""
        manifest = read_manifest(folder)
        check_utf8_path(folder)  # before seconds of loading: onnxruntime and tokenizers take no other paths
        phases = list(manifest["engines"])  # checked before check_files, which may hash every file
        spinning_phases = set(phases if spin_after_run is True else () if spin_after_run is False else
                              spin_after_run)
        unknown = sorted(spinning_phases - set(phases))
        if unknown:
            raise RequestError(f"spin_after_run names {', '.join(map(repr, unknown))}, not a phase of this "
                               f"artifact ({', '.join(phases)})")
        check_files(folder, manifest, verify_hashes=verify)
        defaults = model_defaults(manifest) if generation_config == "auto" else {}  # a bad one: before the load
        # Loads on 2 MiB pages one at a time: each counts what appeared in the process while it loaded as its
        # own (two concurrent loads each reported, and collapsed, both engines' memory)
        with _loading(), (_huge_page_loads if huge_pages else contextlib.nullcontext()):
            engine = cls._open(folder, manifest, intra_op_threads, huge_pages, spinning_phases, prefix_caching,
                               spin_during_run)
        engine.generation_defaults = defaults
        return engine

    @property
    def sampling_defaults(self) -> dict:
        """The model's defaults a request's unset keywords take (generate, stream, chat, submit): all of
        generation_defaults but max_new_tokens, which the server applies, capped to what the context leaves (here a
        model's 2048 would have the scheduler refuse every prompt of a 2048-token artifact)."""
        return {name: value for name, value in self.generation_defaults.items() if name != "max_new_tokens"}

    @classmethod
    def _open(cls, folder: Path, manifest: dict, intra_op_threads: int | None, huge_pages: bool,
              spinning_phases: set[str], prefix_caching: bool, spin_during_run: bool = True) -> "Engine":
        """Engine.load's sessions, tokenizer and batch-1 cache, once the manifest and files are checked."""
        backend_name = manifest["backend"]["name"]
        if huge_pages and backend_name == "onnxruntime":  # TensorRT's weights live in GPU memory
            from runtime.huge_pages import collapse_large_mappings, private_anonymous_mappings

            existing = set(private_anonymous_mappings(0))  # what the engine allocates is what appears after this
        if backend_name == "tensorrt":  # imported here: torch and tensorrt only for TensorRT artifacts
            from runtime.tensorrt_backend import TensorRTBackend

            backend = TensorRTBackend(folder, manifest)
        elif backend_name == "onnxruntime":
            try:
                from runtime.onnxruntime_backend import OnnxRuntimeBackend
            except ModuleNotFoundError as missing:
                if missing.name != "onnxruntime":
                    raise
                raise ArtifactError(f"{folder}: its engines run on onnxruntime, which is not installed: "
                                    + pip_install("'aotlm[cpu]'") + " (they run on the CPU, on any machine)") from None

            backend = OnnxRuntimeBackend(folder, manifest, intra_op_threads, spin_during_run=spin_during_run,
                                         spinning_phases=spinning_phases if spin_during_run else ())
        else:
            raise ArtifactError(f"{folder}: built for backend {backend_name!r}; this runtime runs 'onnxruntime' and "
                                f"'tensorrt' artifacts")
        tokenizer_info = manifest["tokenizer"]
        tokenizer = TextTokenizer(folder / tokenizer_info["file"], tokenizer_info.get("bos_token_id"),
                                  manifest["model"]["config"]["vocab_size"],
                                  (manifest.get("tools") or {}).get("tokenizers"))
        engine = cls(folder, manifest, backend, tokenizer)
        engine.prefix_caching = prefix_caching
        try:
            engine.prepare_chat()
        except ArtifactError:  # a broken template (or no jinja2) fails chat requests (chat_prompt_ids says why), not
            pass  # the load
        if huge_pages and backend_name == "onnxruntime":
            engine.huge_pages = collapse_large_mappings(exclude=existing)
            backend.use_huge_pages()  # the caches, written later, ask for them as their pages are first touched
        return engine

    # -- chat ---------------------------------------------------------------------------------------------
    def prepare_chat(self) -> None:
        """Read and compile the chat template, if the artifact has one, so that the first chat request's TTFT does
        not carry importing Jinja and compiling the template (~20 ms; a 38-token INT4 prefill takes ~50).
        ArtifactError for a template that is not UTF-8 or does not parse: load leaves that to chat_prompt_ids to
        report, so that plain prompts still run."""
        from runtime import chat

        file = self.manifest["tokenizer"].get("chat_template")
        if not file or self._chat_template is not None:
            return
        path = Path(self.artifact_dir) / file
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as error:
            raise ArtifactError(f"{path}: the chat template cannot be read as UTF-8 text ({error}); rebuild the "
                                f"artifact") from None
        self._chat_template = text  # read once: every chat request renders it
        chat.compiled(text)

    def chat_prompt_ids(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """The prompt's token ids for chat messages ([{"role": "user", "content": "..."}, ...]; a content may also be
        OpenAI's list of text parts), rendered by the model's chat template (runtime/chat.py); pass them to generate
        / stream / submit like any prompt."""
        from runtime import chat

        if not isinstance(add_generation_prompt, bool):  # a string such as "no" would read as True
            raise RequestError(f"add_generation_prompt must be True or False, got {add_generation_prompt!r}")
        flat = chat.flat_messages(messages)  # a non-text part is the request's fault, template or not
        if isinstance(flat, (list, tuple)):  # else check_messages says what it is
            if len(flat) > self.max_context:  # a template marks each message with a token or more
                raise RequestError(f"messages: {len(flat):,} of them cannot fit this artifact's max context of "
                                   f"{self.max_context} tokens; send fewer")
            self.check_text_length(sum(len(m["content"]) for m in flat if isinstance(m, dict)
                                        and isinstance(m.get("content"), str)), "messages' content")
        file = self.manifest["tokenizer"].get("chat_template")
        if not file:
            raise RequestError(f"{self.manifest['name']} has no chat template (its model source carried none); "
                               f"format the prompt yourself and pass it as text")
        self.prepare_chat()  # load did this, unless the template is broken: then this says why
        texts = self.special_token_texts()
        text = chat.render(self._chat_template, messages, add_generation_prompt=add_generation_prompt, **texts)
        if self.manifest["model"].get("source", {}).get("kind") == "gguf" and self.tokenizer.encode(""):
            # A GGUF file means what llama.cpp does with it: its chat code (common/chat.cpp) cuts the BOS text off
            # the front of the rendered prompt and tokenizes it with add_special, so the prompt starts with BOS
            # when the file's add_bos_token says so, whether or not the template writes bos_token (TinyLlama's and
            # ChatML templates do not) -- and once, when it does.
            text = text.removeprefix(texts["bos_token"] or "")
            return self.prompt_ids(self.tokenizer.encode(text, add_special_tokens=True))
        return self.prompt_ids(self.tokenizer.encode(text, add_special_tokens=False))

    def special_token_texts(self) -> dict[str, str | None]:
        """{"bos_token": text, "eos_token": text, ...} as a chat template reads them: the texts the model's
        tokenizer_config names (unk_token, pad_token and additional_special_tokens too, where it names them), as
        transformers passes them; else the config's bos and eos ids spelled by the tokenizer (GGUF files, as
        llama.cpp reads them); None where the model has none."""
        info, token_text = self.manifest["tokenizer"], self.tokenizer.tokenizer.id_to_token
        named = info.get("template_tokens") or {}
        bos, eos = info.get("bos_token_id"), info.get("eos_token_ids")
        return {**named, "bos_token": named.get("bos_token", token_text(bos) if bos is not None else None),
                "eos_token": named.get("eos_token", token_text(eos[0]) if eos else None)}

    @property
    def chat_template(self) -> str | None:
        """The chat template's text, None if the artifact has none (ArtifactError if it cannot be read)."""
        self.prepare_chat()
        return self._chat_template

    def chat(self, messages: Sequence[dict], params: SamplingParams | None = None, *, arrival: float | None = None,
             add_generation_prompt: bool = True, **sampling) -> GenerationResult:
        """One chat turn to the end: the assistant's reply to `messages` (see chat_prompt_ids, which takes
        add_generation_prompt). Its timings count from this call, or from `arrival` when earlier (as `stream`'s):
        rendering the template and tokenizing are inside TTFT, and inside timings.tokenize_s."""
        started = time.perf_counter()
        received = received_at(arrival, started)
        prompt_ids = self.chat_prompt_ids(messages, add_generation_prompt)
        params = sampling_params(params, sampling, self.sampling_defaults)
        with self._stream(prompt_ids, params, received, started) as generation:
            return generation.wait()  # closed on the way out: see generate

    # -- requests ---------------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]], params: SamplingParams | None = None,
                 *, arrival: float | None = None, **sampling) -> GenerationResult | list[GenerationResult]:
        """Run one request to the end. Sampling options as keywords (see SamplingParams) or as `params`.

        A list of prompts (strings or token-id lists) runs through the scheduler (continuous batching, see
        `submit`), each with the same sampling options; returns their results in order.
        """
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, list, tuple, np.ndarray)):
            params = sampling_params(params, sampling, self.sampling_defaults)
            arrival = time.perf_counter() if arrival is None else arrival  # a later prompt's wait for room counts
            handles = []
            try:
                for index, one in enumerate(prompt):
                    try:
                        handles.append(self.submit(one, params, arrival=arrival, block=True))
                    except RequestError as error:  # which of the list (of hundreds, say) it is
                        raise type(error)(f"prompts[{index}]: {error}") from None
            except BaseException:  # one prompt refused: none of the list runs
                for handle in handles:
                    handle.cancel()
                raise
            results = []
            try:
                for index, handle in enumerate(handles):
                    try:
                        results.append(handle.result())
                    except AotlmRuntimeError as error:  # which of the list failed, as a refusal says
                        raise type(error)(f"prompts[{index}]: {error}") from error
                return results
            except BaseException:  # one failed, or the caller was interrupted: the rest stop too
                for handle in handles:
                    handle.cancel()
                raise
        # Closed on the way out: a Ctrl-C between two pieces (outside the generator) left this stream, which no name
        # holds, owning the batch-1 cache for as long as the REPL's traceback kept it alive ("this thread is still
        # iterating another stream" at every later generate until a garbage collection)
        with self.stream(prompt, params, arrival=arrival, **sampling) as generation:
            return generation.wait()

    def start_scheduler(self, **options) -> "Scheduler":
        """(Re)start the scheduler that `submit` uses: slots, batching ("continuous" or "static"), max_queue,
        prefill_chunk, idle_exit_s (runtime/scheduler.py's Scheduler says what each means).

        Bad options are refused with a RequestError before anything stops. Otherwise a running scheduler is closed
        first (its unfinished requests fail); its cache is freed with it.
        """

        known = [name for name in inspect.signature(Scheduler.checked_slots).parameters if name != "engine"]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise RequestError(f"start_scheduler: unknown option {', '.join(map(repr, unknown))}; the options are "
                               f"{', '.join(known)}")
        slots = Scheduler.checked_slots(self, **options)
        check_memory = getattr(self.backend, "check_slots", None)  # onnxruntime's host memory (TensorRT: none)
        if check_memory is not None:  # before the running scheduler stops; its cache will be freed for this one
            running = self._scheduler
            check_memory(slots, reclaimable=running.cache.nbytes if running is not None and running.cache else 0)
        # Submits from other threads meanwhile wait for the new scheduler: one would otherwise start a default
        # scheduler (a max-context cache per slot) between the close and the new one, and lose its requests to it
        with self._scheduler_lock:
            self._restarting += 1
        scheduler = None
        try:
            self.close()  # first: its slot cache is freed before the new one is allocated
            scheduler = Scheduler(self, **options)
        finally:
            with self._scheduler_lock:
                self._restarting -= 1
                displaced = None
                if scheduler is not None:
                    displaced, self._scheduler = self._scheduler, scheduler
                self._scheduler_lock.notify_all()
        if displaced is not None:  # another thread started one meanwhile: never left running unreferenced
            displaced.close()
        return scheduler

    def release_single_stream_cache(self) -> int:
        """Free the batch-1 KV cache that generate and stream run on (allocated at load: one sequence at the max
        context) where only the scheduler serves, as `aotlm serve`'s; returns the bytes freed. A later generate or
        stream allocates it again."""
        self._batch_one_caller()  # a stream this thread holds open would have it wait on itself, for ever
        with self._batch_one:  # not under a stream of another thread
            cache = self.backend.cache
            if cache is None:
                return 0
            self.backend.release_cache()
            self._cached_ids = None
            return cache.nbytes

    @property
    def scheduler(self) -> "Scheduler | None":
        """The scheduler that `submit` uses now; None before the first submit or start_scheduler, and after close."""
        return self._scheduler

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               arrival: float | None = None, block: bool = False, **sampling) -> "RequestHandle":
        """Queue a request for continuous batching and return its RequestHandle (iterate it for text pieces, `async
        for` in a coroutine, `.result()`, `.cancel()`). Thread-safe. Starts a default scheduler (8 slots, or the
        engines' max batch if smaller) on first use; engine.start_scheduler sets slots and the queue's size.

        Raises QueueFullError when the queue is full, unless block=True, which waits for room instead; RequestError
        for a request that can never fit the context, or bad sampling options. arrival: a time.perf_counter() value
        the request's latencies count from (default: now), as in stream(). Sampling options as in generate()."""
        for attempt in range(2):
            with self._scheduler_lock:  # a scheduler closed directly (Scheduler.close()) is replaced by a default one
                while self._restarting:  # start_scheduler is replacing it: this request goes to the new one
                    self._scheduler_lock.wait()
                scheduler = self._scheduler
                if scheduler is None or scheduler.closed:
                    scheduler = self._scheduler = Scheduler(self)
            try:
                return scheduler.submit(prompt, params, arrival=arrival, block=block, **sampling)
            except RequestError:
                # close() (or start_scheduler) on another thread closed it between the lock and the submit: the
                # request goes to the next one, as a later submit would
                if attempt or not scheduler.closed:
                    raise

    def close(self) -> None:
        """Stop the scheduler, if one runs (its worker thread and slot cache)."""
        with self._scheduler_lock:
            scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:  # after the lock: its requests' done-callbacks may submit while it stops
            scheduler.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info) -> None:
        """`with Engine.load(...) as engine:` stops its scheduler at the end of the block (close())."""
        self.close()

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               arrival: float | None = None, **sampling) -> Generation:
        """Start a request; iterating the returned Generation yields text pieces as they are decoded.

        Safe to call from several threads: the requests take turns on the batch-1 cache (for concurrent requests
        batched together, use `submit`). Within one thread, finish (or close) a stream before iterating another.

        arrival: when the request was received (time.perf_counter), if earlier than this call, e.g. when it
        waited in a queue (runtime/bench.py); the trace's latencies then count from it. Default: now.

        The request runs as the Generation is read: each next piece's decode step starts when the caller asks for
        it, so time the caller spends between pieces (writing to a slow client, say) counts in the timings' ITL,
        TPOT and E2E, as in onnxruntime-genai's generator loop. `submit` runs the request on the scheduler's thread,
        ahead of its reader (as vLLM's engine does): its timings are the engine's alone.
        """
        params = sampling_params(params, sampling, self.sampling_defaults)
        started = time.perf_counter()
        return self._stream(prompt, params, received_at(arrival, started), started)

    def _stream(self, prompt, params: SamplingParams, received: float, started: float) -> Generation:
        """stream's request; its timings' tokenize_s counts from `started` (chat's: before rendering its template)."""
        prompt_ids = self.prompt_ids(prompt)
        tokenize_s = time.perf_counter() - started
        self._check_request(prompt_ids, params)
        return Generation(self._run(prompt_ids, params, received, tokenize_s))

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids: a string is tokenized; either way the ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            self.check_text_length(len(prompt), "the prompt")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (bytes, bytearray, memoryview)):  # iterating them gives byte values, not token ids
            raise RequestError(f"the prompt is {type(prompt).__name__}; decode it to str first (e.g. prompt.decode())")
        elif isinstance(prompt, (dict, set, frozenset)):  # iterating them gives keys, or ids in no given order
            chat = isinstance(prompt, dict) and "role" in prompt
            raise RequestError(f"the prompt must be a string or a list of token ids, got a {type(prompt).__name__}"
                               + ("; for chat messages use engine.chat([message]), or engine.chat_prompt_ids("
                                  "[message]) as the prompt" if chat else ""))
        else:
            try:
                tokens = list(prompt)
            except TypeError:
                raise RequestError(f"the prompt must be a string or a list of token ids, got {type(prompt).__name__}") \
                    from None
            if any(isinstance(t, np.ndarray) for t in tokens):  # input_ids [1, n], as tokenizers hand them out
                arrays = f"{np.ndim(prompt)}-D array" if isinstance(prompt, np.ndarray) else "list of arrays"
                raise RequestError(f"the prompt must be one flat list of token ids; got a {arrays}: pass ids[0] for "
                                   f"one prompt, or a list of prompts to engine.generate for a batch")
            # operator.index: Python and numpy integers pass; 3.7 is refused, where int() would quietly make it 3
            position = next((i for i, t in enumerate(tokens) if isinstance(t, bool) or
                             not hasattr(type(t), "__index__")), None)  # an index: the bad id itself may be None
            if position is not None:
                bad = tokens[position]
                if isinstance(bad, dict) and "role" in bad:
                    raise RequestError("the prompt is a list of chat messages: use engine.chat(messages), or pass "
                                       "engine.chat_prompt_ids(messages) as the prompt")
                raise RequestError(f"prompt token ids must be integers; got {bad!r} ({type(bad).__name__}) at "
                                   f"position {position}")
            ids = [operator.index(token) for token in tokens]
        bad, vocab = self._outside_vocabulary(ids), self.manifest["model"]["config"]["vocab_size"]
        if bad is not None and isinstance(prompt, str):  # an artifact built before the build checked its tokenizer
            raise RequestError(f"the tokenizer gave id {bad}, outside this model's vocabulary (0..{vocab - 1}): the "
                               f"artifact's tokenizer does not match its model; rebuild it with the model's own tokenizer")
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside this model's vocabulary (0..{vocab - 1})")
        return ids

    def _outside_vocabulary(self, ids) -> int | None:
        """The first id that is not a row of this model's embedding table, or None."""
        vocab = self.manifest["model"]["config"]["vocab_size"]
        return next((token for token in ids if not 0 <= token < vocab), None)

    def check_text_length(self, characters: int, what: str) -> None:
        """Refuse text far too long to fit before tokenizing it (MAX_CHARACTERS_PER_TOKEN): tokenizers holds the GIL
        while it encodes, and a 15 MB prompt stalled a server's every thread (its /health too) for 25 s before it was
        refused. `what`: the text, as the message names it."""
        most = self.max_context * MAX_CHARACTERS_PER_TOKEN
        if characters > most:
            raise RequestError(f"{what} has {characters:,} characters: more than {most:,} ({MAX_CHARACTERS_PER_TOKEN} "
                               f"a token) cannot fit this artifact's max context of {self.max_context} tokens; "
                               f"shorten it")

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """What the batch-1 path and the scheduler both refuse before running anything."""
        bad = self._outside_vocabulary(params.stop_token_ids)
        if bad is not None:  # it could never stop anything
            raise RequestError(f"stop_token_ids: {bad} is outside this model's vocabulary "
                               f"(0..{self.manifest['model']['config']['vocab_size'] - 1})")
        bad = self._outside_vocabulary(token for token, _ in params.logit_bias or ())
        if bad is not None:
            raise RequestError(f"logit_bias: token {bad} is outside this model's vocabulary "
                               f"(0..{self.manifest['model']['config']['vocab_size'] - 1})")
        if not prompt_ids:
            raise RequestError("the prompt is empty: give at least one token")
        if len(prompt_ids) > self.max_context:  # a prompt that fills the cache still gets the token its prefill samples
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens, but this artifact's max context is {self.max_context} "
                f"(prompt + generated tokens); shorten the prompt or rebuild with a larger export.max_context"
            )

    def _run(self, prompt_ids: list[int], params: SamplingParams, received: float, tokenize_s: float):
        """One request on the batch-1 cache (see `batch_one`); waiting for it counts in the TTFT, as queueing.

        The lock is taken by a `with` on the lock itself, whose release is C code, not through batch_one(): Ctrl-C
        raises KeyboardInterrupt at the next Python call, and one that landed in a Python context manager's
        __exit__ as the request returned (before it released the lock) left the lock held by a finished stream, so
        every later request waited forever."""
        me = self._batch_one_caller()
        with self._batch_one:
            epoch = self._batch_one_epoch
            try:
                self._batch_one_threads = {me}
                steps = self._generate(prompt_ids, params, received, tokenize_s)
                while True:
                    if self._batch_one_epoch != epoch:  # resumed in a forked child, where it is not the cache's
                        raise RequestError("this stream was started by another thread of the parent process before "
                                           "os.fork(): a forked child does not go on with it (the cache is the "
                                           "child's now); start the request again in the child")
                    # Every thread that resumes the stream is bound to it until it ends: one that took it over and
                    # starts another request inside its loop is refused (it would wait on itself), as is one it was
                    # handed back to.
                    self._batch_one_threads.add(threading.current_thread())
                    self._stepping = True  # before reading _exiting (see _stop_batch_one_at_exit)
                    try:
                        if _exiting:
                            self._stepping = False  # no step: the exit goes on
                            _stop_at_exit()
                        piece = next(steps)
                    except StopIteration as done:
                        return done.value
                    finally:
                        self._stepping = False
                    yield piece
            finally:
                if self._batch_one_epoch == epoch:  # else the child's own requests hold the cache now
                    self._batch_one_threads = _NO_THREADS  # a constant: no Python call here for an interrupt to land in

    def _batch_one_caller(self) -> threading.Thread:
        """This thread, unless it has resumed a stream of this engine still open (see batch_one)."""
        me = threading.current_thread()
        if me in self._batch_one_threads:
            raise RequestError("this thread is still iterating another stream of this engine (one sequence at a time "
                               "on its batch-1 cache): finish or close that stream first, or use engine.submit / "
                               "engine.generate([...]) for concurrent requests")
        return me

    @contextlib.contextmanager
    def batch_one(self) -> Iterator:
        """Hold the batch-1 cache, which holds one sequence; yields the backend.

        `stream`, `generate(prompt)` and runtime.evaluate.decode_logits_for(engine) run inside it: requests from
        other threads wait their turn, and a second use started in a thread that has resumed a stream still open
        is refused (interleaving the two would mix their caches; waiting, it would wait on itself). The scheduler's
        slot cache is separate."""
        me = self._batch_one_caller()
        with self._batch_one:
            self._batch_one_threads = {me}
            try:
                yield self.backend
            finally:
                self._batch_one_threads = _NO_THREADS

    def _reusable_prefix(self, prompt_ids: list[int]) -> int:
        """How many of the prompt's first tokens the batch-1 cache holds already, if reusing them is worth it (see
        reusable_prefix); 0 when prefix caching is off or the cache was used otherwise since."""
        if not self.prefix_caching or self._cached_ids is None:
            return 0
        cache, runs, ids = self._cached_ids
        if cache() is not self.backend.cache or runs != self.backend.runs:
            return 0
        return reusable_prefix(ids, prompt_ids, self.backend)

    def _prefill_rest(self, prompt_ids: list[int], start: int, mask: np.ndarray, written: list[int]) -> np.ndarray:
        """The prompt after its first `start` tokens (held in the cache); the last position's logits [vocab]. Through
        the prefill graph in one run where it takes a past (backend.prefill_takes_past: the same logits as a whole
        prefill's), else through the decode graph in runs of at most PREFIX_REST_TOKENS (and the engine's
        decode_max_tokens), which computes the lm_head at every position."""
        if self.backend.prefill_takes_past:
            end = len(prompt_ids)
            logits = self.backend.run("prefill", np.array([prompt_ids[start:]], dtype=np.int64),
                                      np.arange(start, end, dtype=np.int64)[None], mask[:, :end])
            self._remember(written, prompt_ids[start:])
            return last_token_logits(logits, [end - start])[0]
        step = rest_piece_tokens(self.backend)
        while start < len(prompt_ids):
            end = min(start + step, len(prompt_ids))
            logits = self.backend.run("decode", np.array([prompt_ids[start:end]], dtype=np.int64),
                                      np.arange(start, end, dtype=np.int64)[None], mask[:, :end])
            self._remember(written, prompt_ids[start:end])
            start = end
        return logits[0, -1]

    def _remember(self, written: list[int], ids: Sequence[int]) -> None:
        """A run on the batch-1 cache wrote `ids` after `written`: record it (with prefix caching only)."""
        if self.prefix_caching:
            written.extend(ids)
            # a weak reference: a cache the backend replaced (another batch size) is freed, not kept for this
            self._cached_ids = (weakref.ref(self.backend.cache), self.backend.runs, written)

    def _generate(self, prompt_ids: list[int], params: SamplingParams, received: float, tokenize_s: float):
        sampler = Sampler(params, prompt_ids, self.eos_token_ids)
        stop_ids = params.stop_ids(self.eos_token_ids)
        decoder = self.tokenizer.stream_decoder(params.stop_strings, prompt_ids, params.min_new_tokens)
        self.backend.allocate_cache(batch=1)
        length = len(prompt_ids)
        mask = np.ones((1, self.max_context), dtype=np.int64)  # every cached row is real: one view per step
        scored = params.prompt_logprobs is not None  # every position's logits: no prefix reused, no prefill graph
        recording = not scored or scored_rows_reusable(self.backend)  # what the cache then holds, for a later prompt
        reused = 0 if scored else self._reusable_prefix(prompt_ids)
        written = list(prompt_ids[:reused])  # the ids whose keys and values the cache holds, in order

        prefill_start = time.perf_counter()
        prompt_entries = None
        if scored:  # the decode graph fills the cache as a prefill would (evaluate.decode_logit_pieces); the prefill
            # time (TTFT) then holds every position's lm_head and log-softmax
            pieces = evaluate.decode_logit_pieces(self.backend, prompt_ids, evaluate.PROMPT_PIECE_TOKENS)
            prompt_entries, logits = evaluate.scored_prompt(pieces, prompt_ids, params.prompt_logprobs)
            if recording:
                self._remember(written, prompt_ids)
            else:
                self._cached_ids = None
        elif reused:
            logits = self._prefill_rest(prompt_ids, reused, mask, written)
        else:
            logits = last_token_logits(self.backend.run("prefill", np.array([prompt_ids], dtype=np.int64),
                                                        np.arange(length, dtype=np.int64)[None], mask[:, :length]),
                                       [length])[0]
            self._remember(written, prompt_ids)
        prefill_end = time.perf_counter()
        output: list[int] = []
        token_times: list[float] = []
        finish_reason, stop_token = "length", None
        token = sampler(logits)
        while True:
            token_times.append(time.perf_counter())  # absolute; the trace derives the rest
            if token in stop_ids:
                finish_reason, stop_token = "stop", token
                break
            output.append(token)
            piece = decoder.push(token)
            if piece:
                yield piece
            if decoder.stopped:  # a stop string: the text ends before it
                finish_reason = "stop"
                break
            if len(output) >= params.max_new_tokens:
                break
            if length >= self.max_context:
                finish_reason = "max_context"
                break
            logits = self.backend.run("decode", np.array([[token]], dtype=np.int64),
                                      np.array([[length]], dtype=np.int64), mask[:, : length + 1])
            if recording:
                self._remember(written, (token,))
            length += 1
            token = sampler(logits[0, -1])
        tail = decoder.finish()  # text held back in case it began a stop string
        if tail:
            yield tail
        if decoder.stopped:  # the last token completed a stop string inside a UTF-8 character, held back till now
            finish_reason = "stop"
        text = decoder.streamed_text  # what was streamed: ends before a stop string
        trace = RequestTrace(
            arrival=received, prefill_start=prefill_start, first_token=token_times[0], token_times=token_times,
            finish=time.perf_counter(), prompt_tokens=len(prompt_ids), output_tokens=len(token_times),
            prefill_end=prefill_end, cached_prompt_tokens=reused,
        )
        timings = Timings(trace, tokenize_s)
        logged = params.logprobs is not None
        return GenerationResult(text, output, prompt_ids, finish_reason, timings,
                                sampler.logprobs[:len(output)] if logged else None, stop_token,
                                sampler.logprobs[len(output)] if logged and stop_token is not None else None,
                                prompt_entries, decoder.stop_string)
