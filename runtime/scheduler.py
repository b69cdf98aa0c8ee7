"""Continuous batching: many requests share one slot-based KV cache; prefill and decode are scheduled apart.

    engine.start_scheduler(slots=8)                        # optional: engine.submit starts a default one
    handle = engine.submit("Once upon", max_new_tokens=32, temperature=0.8, seed=1)
    for piece in handle: print(piece, end="")              # text pieces as tokens arrive
    handle.result()                                        # GenerationResult; handle.cancel() stops it early

The front is thread-safe and blocking, not asyncio: `submit` may be called from any thread and returns at once;
one background worker thread owns the cache and runs every graph (started on demand, it exits after
`idle_exit_s` with nothing to do; math.inf: never, and then the running worker keeps its engine alive until
engine.close(): close it, or use `with Engine.load(...)`; at interpreter exit every scheduler is closed, _close_at_exit).
Each iteration of the worker (`_step`):
  1. admit waiting requests into free slots, lowest slot first, so the busy slots stay packed at the front;
  2. prefill admitted requests straight into their slots' rows of the cache: whole prompts of requests in
     neighbouring slots as one right-padded batch, others alone (batch 1); with
     `prefill_chunk` at most that many prompt tokens per iteration while other requests are decoding, so a long
     prompt does not stall their tokens (onnxruntime's GroupQueryAttention takes a chunk after a past at batch 1).
     A chunk after a past runs through the prefill graph where it takes one (backend.prefill_takes_past), the rest
     in one run once nothing decodes; else through the decode graph, the rest in chunks of that size;
     chunks happen only while others decode, so with an int8 KV cache (quantize_kv_cache) a prompt's greedy tokens
     can depend on the load: a later chunk reads the earlier ones' keys and values rounded to int8, a whole
     prompt attends to its own in float (a rounding difference, ~2e-3 in the tiny model's logits, enough on
     SmolLM2 to change most seeded replies: README, "quantize_kv_cache"; prefill_attention int8 removes it);
  3. one batched decode step over slots 0..k-1 (k = the highest decoding slot + 1), each row with its own
     position and mask length; a row that is not decoding writes one throw-away key/value at its next free
     position, which its next prefill overwrites before anything reads it;
  4. sample per request (its own Sampler and seed), check its stops, hand text to its handle; a request that
     finishes frees its slot at once, a cancelled one at the start of the next iteration. A request whose
     sampling fails (NaN logits in its row) fails alone; a graph run that fails fails the requests in it (a prompt's
     prefill: that request; a decode step: the decoding ones), and the rest go on.
A request with prompt_logprobs (SamplingParams: every prompt token's log-probability, how lm-evaluation-harness
scores) prefills through the decode graph, which gives every position's logits, in pieces of PROMPT_PIECE_TOKENS
(reduced to entries piece by piece), alone and from its first token: it reuses no cached prefix.
batching="static" admits only when every slot is free: fixed batches run to completion (for comparison).
With Engine.load(prefix_caching=True), a slot a request leaves keeps a record of the tokens its rows hold; a new
request goes to the free slot holding most of its prompt's start and prefills only the rest (runtime/prefix_cache.py
says when that pays), as a chunk after a past (above). A prompt's start that another slot holds (a
running request's, or a free slot's record) is copied into the request's slot instead of computed; requests admitted
together that share a start (a system prompt) wait for the first one's prefill and copy from it, and the requests
admitted after a waiting one wait with it, so that none overtakes it (_share_prefixes). A scored prompt
(prompt_logprobs) neither copies nor waits to copy, but waits with those admitted before it.

Capacity: a request needs prompt + max_new_tokens - 1 cache positions (the last token is never fed back); one
that can never fit is refused at submit with a RequestError, as is a request that finds the queue of waiting
requests full (`max_queue`), unless submitted with block=True. An accepted request is never dropped.
"""
from __future__ import annotations

import atexit
import bisect
import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

from runtime import evaluate
from runtime.errors import QueueFullError, RequestError, ThreadLimitError
from runtime.metrics import RequestTrace
from runtime.prefix_cache import (PREFILL_PIECE_MIN_TOKENS, PREFIX_MIN_TOKENS, prefix_key, rest_piece_tokens,
                                  reusable_prefix, scored_rows_reusable)
from runtime.request_handle import COMPLETING, END, CallbackThread, LoggedPiece, RequestHandle
from runtime.results import GenerationResult, Timings, received_at
from runtime.sampling import Sampler, SamplingParams, is_integer, last_token_logits, sampling_params
from runtime.tokenizer import StreamDecoder

LOGGER = logging.getLogger(__name__)

BATCHING = ("continuous", "static")
DEFAULT_SLOTS = 8
CALLBACK_RETRY_S = 0.1  # how often an idle worker tries again to start the done-callbacks' thread
# Prompts of neighbouring slots are prefilled as one right-padded batch only while its rows (longest x count) stay
# within this many times their real tokens: a long prompt beside short ones is run on its own instead
PREFILL_BATCH_MAX_ROWS_PER_TOKEN = 1.25
_STARTED: weakref.WeakSet[Scheduler] = weakref.WeakSet()  # every scheduler that started a worker (_close_at_exit)
_STARTED_LOCK = threading.Lock()  # _STARTED and _exiting: daemon threads may still submit while the handler runs
_exiting = False  # set by _close_at_exit: no worker starts after it


@atexit.register
def _close_at_exit() -> None:
    """Close every scheduler as the interpreter exits: its worker stops after the step under way, and the requests it
    held fail, as at close(). The worker is a daemon thread, which must not keep a program alive; but left running, it
    was still inside a graph run while the interpreter tore down onnxruntime, and the process aborted ("terminate
    called without an active exception", SIGABRT) instead of exiting: a script that ended, or was stopped with Ctrl-C
    (engine.generate([...]) interrupted), while its requests ran. Exit handlers run after the non-daemon threads
    ended, so a thread of the program still waiting on a request had it finish first. A daemon thread that submits
    from here on (a done-callback resubmitting a failed request) is refused, not given a worker that would run graphs
    during the teardown."""
    global _exiting
    with _STARTED_LOCK:
        _exiting = True
        started = list(_STARTED)
    for scheduler in started:
        scheduler.close()


def _start_over_in_forked_child() -> None:
    """A forked child (a pre-fork server such as gunicorn, which loads the app and then forks its workers) has only
    the thread that forked: no scheduler's worker or callback thread, and maybe a lock one of them held then. Each
    scheduler that had a worker starts over empty, so that the child's first submit starts a worker of its own (its
    copy named the parent's worker, so none started and every request waited forever). The requests the parent
    held are the parent's: the child drops its copies of them."""
    global _STARTED_LOCK
    _STARTED_LOCK = threading.Lock()
    for scheduler in list(_STARTED):
        scheduler._start_over_after_fork()
    _STARTED.clear()


if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(after_in_child=_start_over_in_forked_child)


@dataclass(eq=False)
class _Sequence:
    """A request's state in the scheduler: its slot, how much of it is cached, what it has produced."""

    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    stop_ids: frozenset[int]
    decoder: StreamDecoder
    arrival: float
    tokenize_s: float
    slot: int | None = None
    prefilled: int = 0  # prompt tokens in the cache
    cached: int = 0  # of them, found in its slot at admission (prefix caching)
    next_token: int | None = None  # sampled, not yet fed back: set while the sequence is decoding
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    prefill_start: float | None = None
    prefill_end: float | None = None
    logged: int = 0  # output tokens whose logprobs went out with a piece (a request with logprobs)
    stop_token: int | None = None  # the stop token that ended it (not in output)
    # With prompt_logprobs: the prompt tokens' entries so far (the first None), filled piece by piece as the decode
    # graph prefills the prompt; None for a request without.
    prompt_entries: list[dict[int, float] | None] | None = None
    _held: np.ndarray | None = field(default=None, repr=False)  # held_ids() past the prompt, for one length

    @property
    def scored(self) -> bool:
        return self.prompt_entries is not None

    def piece(self, text: str, final: bool = False) -> str:
        """The text piece to stream; with logprobs, carrying the tokens sampled since the last piece."""
        if self.params.logprobs is None:
            return text
        start, self.logged = self.logged, len(self.output)
        return LoggedPiece(text, self.output[start:], self.sampler.logprobs[start:self.logged], final)

    @property
    def length(self) -> int:
        """Tokens in the cache = the position the next fed token is written at."""
        return self.prefilled + max(len(self.token_times) - 1, 0)

    @cached_property
    def prompt_array(self) -> np.ndarray:
        """prompt_ids as an array, made once: prefix caching compares prompts with every slot's ids at each step a
        request waits for its prefill (converting the lists each time took most of a 32-slot step)."""
        return np.asarray(self.prompt_ids, dtype=np.int64)

    @cached_property
    def prompt_key(self) -> bytes | None:
        return prefix_key(self.prompt_array)

    def held_key(self) -> bytes | None:
        """prefix_key of held_ids(), without making them where the prompt covers the key."""
        if self.length < PREFIX_MIN_TOKENS:
            return None
        return self.prompt_key if len(self.prompt_ids) >= PREFIX_MIN_TOKENS else prefix_key(self.held_ids())

    def held_ids(self) -> np.ndarray:
        """The token ids whose keys and values the sequence's cache rows hold, in order: its prompt as far as
        prefilled, then its output but the last token (sampled, not fed back yet). Made once per length."""
        length = self.length
        if length <= len(self.prompt_ids):
            return self.prompt_array[:length]  # a view
        if self._held is None or len(self._held) != length:
            self._held = np.concatenate([self.prompt_array, np.asarray(self.output, dtype=np.int64)])[:length]
        return self._held


def _check_engine_limits(backend, slots: int, prefill_chunk: int | None) -> None:
    """TensorRT's engines run at most max_batch rows and max_decode_tokens tokens per decode call (onnxruntime:
    no limit, None); a later prompt chunk runs through the decode engine."""
    if backend.max_batch is not None and slots > backend.max_batch:
        raise RequestError(f"slots: {slots}, but this artifact's engines run at most {backend.max_batch} sequences "
                           f"per step; use slots <= {backend.max_batch}, or rebuild with export.max_batch: {slots}")
    if prefill_chunk is not None and backend.max_decode_tokens is not None and prefill_chunk > backend.max_decode_tokens:
        raise RequestError(f"prefill_chunk: {prefill_chunk}, but this artifact's decode engine takes at most "
                           f"{backend.max_decode_tokens} tokens per call; use prefill_chunk <= "
                           f"{backend.max_decode_tokens}, or rebuild with backend.tensorrt.decode_max_tokens: "
                           f"{prefill_chunk}")


class Scheduler:
    """slots: sequences in the cache at once (its memory: slots x max context x the manifest's KV bytes per token);
    batching: "continuous" or "static"; max_queue: requests allowed to wait for a slot; prefill_chunk: prompt
    tokens prefilled per step while others decode (None: whole prompts); idle_exit_s: the worker's idle life.
    slots defaults to 8, or fewer when the engines run fewer sequences per step (TensorRT's export.max_batch)."""

    def __init__(self, engine, *, slots: int | None = None, batching: str = "continuous", max_queue: int = 256,
                 prefill_chunk: int | None = None, idle_exit_s: float = 1.0):
        slots = self.checked_slots(engine, slots=slots, batching=batching, max_queue=max_queue,
                                   prefill_chunk=prefill_chunk, idle_exit_s=idle_exit_s)
        # The engine holds its scheduler too: a cycle, which Python's cycle collector frees, and Engine.load runs it
        # (a caller may keep the scheduler alone: engine.start_scheduler()'s result)
        self.engine = engine
        # Python ints: a numpy int32 max_queue of 2**31 - 1 wrapped in its + 1 (every submit refused as full)
        max_queue, prefill_chunk = int(max_queue), None if prefill_chunk is None else int(prefill_chunk)
        self.slots, self.batching, self.max_queue, self.prefill_chunk = slots, batching, max_queue, prefill_chunk
        self.idle_exit_s = idle_exit_s
        self.cache = engine.backend.allocate_slots(slots)  # once: requests only take and free slots
        self._running: list[_Sequence | None] = [None] * slots  # by slot; touched by the worker thread only
        # Prefix caching (Engine.load(prefix_caching=True)): per free slot, the token ids whose keys and values its
        # rows hold from the request that left it; None for a slot in use or holding nothing known. Worker only.
        self._slot_ids: list[np.ndarray | None] = [None] * slots  # what each free slot's rows hold (prefix caching)
        self._slot_released = [0] * slots  # when each slot's prefix was left, in releases counted
        self._scored_rows_reusable = scored_rows_reusable(engine.backend)
        self._releases = itertools.count(1)
        self._waiting: deque[_Sequence] = deque()
        self._blocked: list[object] = []  # submit(block=True) calls waiting for room, in the order they came
        # Tokens as they are made (a server's /metrics counters move every step, as vLLM's do, not at a request's end):
        # prompt tokens, those looked up in the prefix cache and those found there (vLLM's prefix_cache_queries and
        # _hits, in tokens), counted at a request's first token; tokens chosen, a final stop token included. Written
        # by the worker only.
        self._token_counts = {"prompt_tokens": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                              "generation_tokens": 0}
        self._lock = threading.Condition()  # guards _waiting, _worker, _closed
        self._worker: threading.Thread | None = None
        self._callbacks = CallbackThread()
        self._closed = False
        self._ids = itertools.count()

    @staticmethod
    def checked_slots(engine, *, slots: int | None = None, batching: str = "continuous", max_queue: int = 256,
                      prefill_chunk: int | None = None, idle_exit_s: float = 1.0) -> int:
        """Refuse bad options with a RequestError (Engine.start_scheduler checks them before it closes the running
        scheduler); returns the slots, the default resolved: 8, within what the engines run per step."""
        if slots is None:
            slots = min(DEFAULT_SLOTS, engine.backend.max_batch or DEFAULT_SLOTS)
        if batching not in BATCHING:
            raise RequestError(f"batching: {batching!r} is not one of {', '.join(BATCHING)}")
        for name, value in (("slots", slots), ("max_queue", max_queue), ("prefill_chunk", prefill_chunk)):
            if (value is not None or name == "max_queue") and (not is_integer(value) or value < 1):
                raise RequestError(f"{name}: {value!r} must be an integer >= 1")
        if isinstance(idle_exit_s, bool) or not isinstance(idle_exit_s, (int, float)) or not idle_exit_s >= 0 or (
                threading.TIMEOUT_MAX < idle_exit_s < math.inf):  # inf: never; a finite wait past it overflows
            raise RequestError(f"idle_exit_s: {idle_exit_s!r} must be a number of seconds from 0 to "
                               f"{threading.TIMEOUT_MAX:.0f}, or math.inf (the worker never exits)")
        slots = int(slots)  # a numpy int8 of 100 overflowed in the memory check, an int32 of 300 wrapped past it
        _check_engine_limits(engine.backend, slots, prefill_chunk)
        return slots

    # -- the front: any thread ------------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               arrival: float | None = None, block: bool = False, pieces=None, **sampling) -> RequestHandle:
        """Queue a request; returns its handle at once. block=True waits for room instead of refusing. pieces: an
        object with put() that receives the text pieces and then request_handle.END, instead of the handle."""
        if not isinstance(block, bool):  # a string such as "no" would read as True
            raise RequestError(f"block must be True or False, got {block!r}")
        params = sampling_params(params, sampling, getattr(self.engine, "sampling_defaults", None))
        started = time.perf_counter()
        received = received_at(arrival, started)
        prompt_ids = self.engine.prompt_ids(prompt)
        tokenize_s = time.perf_counter() - started
        self._check_fits(prompt_ids, params)
        eos = self.engine.eos_token_ids
        decoder = self.engine.tokenizer.stream_decoder(params.stop_strings, prompt_ids, params.min_new_tokens)
        sequence = _Sequence(RequestHandle(self, -1, prompt_ids, pieces), prompt_ids, params,
                             Sampler(params, prompt_ids, eos), params.stop_ids(eos), decoder, received, tokenize_s,
                             prompt_entries=None if params.prompt_logprobs is None else [None])
        with self._lock:
            full = len(self._waiting) >= self.max_queue + self._free_slots()
            if not self._closed and (full or self._blocked):  # room goes to blocked submitters first, in turn
                if not block:
                    raise QueueFullError(f"the request queue is full ({self._fullness()}); retry later, submit "
                                         f"with block=True, or raise max_queue")
                self._wait_in_turn()
            if self._closed:
                raise RequestError("the scheduler is closed; start another with engine.start_scheduler()")
            sequence.handle.id = next(self._ids)  # in the order accepted: prefills and prefix sharing go by it
            # A worker that is not alive never started: an interrupt (Ctrl-C in a notebook) came between its
            # creation and start(), and every later request would wait for it for ever. One that ends sets None.
            working = self._worker is not None and self._worker.is_alive()
            if not working:
                with _STARTED_LOCK:
                    if _exiting:
                        raise RequestError("the program is exiting: no request starts now")
                    _STARTED.add(self)
            if not working:  # started before the request is queued: one that cannot start leaves nothing behind
                worker = threading.Thread(target=self._work, name="aotlm-scheduler", daemon=True)
                try:
                    worker.start()  # it waits for the lock this holds
                except RuntimeError as error:  # "can't start new thread": a pids or ulimit -u limit, or no memory
                    raise ThreadLimitError(f"the scheduler's worker thread could not start ({error}): this process "
                                           f"is at its thread limit (a container's pids.max, ulimit -u); the request "
                                           f"was not queued: retry, or raise the limit") from None
                self._worker = worker
            self._waiting.append(sequence)
            self._lock.notify_all()
        return sequence.handle

    def _wait_in_turn(self) -> None:
        """Wait (the lock is held) until this submitter is the first blocked one and there is room: blocked
        submitters get in in the order they came, and no new one gets ahead of them (notify_all woke every one
        at once, and whichever ran first took the room)."""
        ticket = object()
        self._blocked.append(ticket)
        try:
            while not self._closed and (self._blocked[0] is not ticket or
                                        len(self._waiting) >= self.max_queue + self._free_slots()):
                self._lock.wait()
        finally:
            self._blocked.remove(ticket)
            self._lock.notify_all()  # the next one's turn

    def fullness(self) -> str:
        """What fills the queue now, for a refusal (a server's 503)."""
        with self._lock:
            return self._fullness()

    def _fullness(self) -> str:
        """What fills the queue, for its refusal (the lock is held)."""
        busy = sum(sequence is not None for sequence in self._running)
        why = "; static batching admits only when the running batch ends" if self.batching == "static" else ""
        blocked = f", {len(self._blocked)} submitters blocked for room" if self._blocked else ""
        # Requests the free slots will take at the worker's next admission wait, but not in the queue: counted as
        # queued, the message read "4 of 2 queue places taken, 0 of 2 slots busy".
        admitting = min(len(self._waiting), self._free_slots())
        about = f", {admitting} about to take free slots" if admitting else ""
        return (f"{len(self._waiting) - admitting} of {self.max_queue} queue places taken, {busy} of {self.slots} "
                f"slots busy{about}{blocked}{why}")

    def _free_slots(self) -> int:
        """Slots the next admission can fill (the lock is held): requests for them are not queueing, only waiting for
        the worker's next iteration. Static batching admits only into an empty cache."""
        free = sum(sequence is None for sequence in self._running)
        return free if self.batching == "continuous" or free == self.slots else 0

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine._check_request(prompt_ids, params)  # stop ids; empty, or a prompt alone longer than the cache
        needed = len(prompt_ids) + params.max_new_tokens - 1
        most = self.engine.max_context + 1 - len(prompt_ids)  # the last output token is never fed back: no row
        if needed > self.engine.max_context:
            raise RequestError(
                f"the prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) need {needed} "
                f"cache positions, but this artifact's max context is {self.engine.max_context}; ask for at most "
                f"{most} new token{'s' if most != 1 else ''} or shorten the prompt")

    def _cancel(self, handle: RequestHandle) -> None:
        with self._lock:
            if handle.done():  # finished already: its result stands
                return
            handle.cancelled = True
            waiting = next((s for s in self._waiting if s.handle is handle), None)
            if waiting is not None:  # never admitted: leaves the queue now, making room
                self._waiting.remove(waiting)
                self._lock.notify_all()
        if waiting is not None:  # after the lock: done-callbacks run here and may wait on other requests
            self._finish(waiting, "cancelled")

    @property
    def closed(self) -> bool:
        return self._closed

    def token_counts(self) -> dict[str, int]:
        """Tokens this scheduler has taken in and made so far (see _token_counts); from any thread."""
        return dict(self._token_counts)

    def counts(self) -> tuple[int, int]:
        """(requests in a slot, requests waiting for one) now; from any thread (a server's /metrics)."""
        with self._lock:
            waiting = len(self._waiting)
        return sum(sequence is not None for sequence in self._running), waiting

    def close(self) -> None:
        """Refuse new requests, fail the waiting and running ones with a RequestError, stop the worker."""
        with self._lock:
            self._closed = True
            worker = self._worker
            self._lock.notify_all()
        if worker is not None and worker.ident is None:  # never started (see submit): it fails what waits, now
            worker.start()
        if worker is not None:  # no user code runs on it (done-callbacks have their own thread): it cannot be us
            worker.join()
        if worker is None:  # else the worker freed it as it exited
            self.cache = None  # handles keep the scheduler alive; its slot cache must not outlive close()

    def _start_over_after_fork(self) -> None:
        """In a forked child (_start_over_in_forked_child): no worker, nothing waiting or running, fresh locks."""
        self._lock = threading.Condition()
        self._worker = None
        orphans = [*self._waiting, *(sequence for sequence in self._running if sequence is not None)]
        self._waiting.clear()
        self._running = [None] * self.slots
        for sequence in orphans:  # a handle the child holds would wait forever: it fails now, saying why
            sequence.handle._fail_after_fork(RequestError(
                "this request was submitted in the parent process before os.fork(): a forked child does not serve "
                "the parent's requests; submit it again in the child"))
        self._slot_ids = [None] * self.slots  # the parent's requests may have written the rows since their records
        self._callbacks = CallbackThread()

    # -- the worker thread -------------------------------------------------------------------------------------
    def _work(self) -> None:
        """Serve until idle or closed. Whatever stops it otherwise (a done-callback raising SystemExit, say) fails
        every request it held, so that none waits forever, and lets a later submit start a new worker."""
        COMPLETING.requests = True  # done-callbacks never run on this thread (CallbackThread.call)
        try:
            self._serve()
        except BaseException as error:
            with self._lock:
                self._worker = None
                unfinished = [*self._waiting, *filter(None, self._running)]
                self._waiting.clear()
                self._running = [None] * len(self._running)  # a worker a submit starts now must not serve them
                self._slot_ids = [None] * len(self._slot_ids)  # what the rows hold is not known now
                self._lock.notify_all()
            stopped = RequestError(f"the scheduler's worker thread stopped ({error!r}) before this request finished")
            for sequence in unfinished:
                if not sequence.handle.done():
                    self._fail(sequence, stopped)
            raise
        finally:
            if self._closed:
                self.cache = None

    def _serve(self) -> None:
        idle_wait = None if self.idle_exit_s == math.inf else self.idle_exit_s
        while True:
            unfinished: list[_Sequence] = []
            # done-callbacks whose thread could not start (a thread limit): tried again each iteration, and the
            # worker stays (waking every CALLBACK_RETRY_S) until they have one
            callbacks_waiting = self._callbacks.retry()
            with self._lock:
                busy = lambda: self._waiting or any(self._running)  # noqa: E731
                if not self._closed and not busy():
                    self._lock.wait_for(lambda: self._waiting or self._closed, timeout=CALLBACK_RETRY_S
                                        if callbacks_waiting else idle_wait)
                if self._closed:
                    unfinished = [*self._waiting, *filter(None, self._running)]
                    self._waiting.clear()
                stop = self._closed or not (busy() or callbacks_waiting)
                retrying = not stop and not busy()  # nothing to run: only the callbacks' thread to start again
                if stop:
                    self._worker = None  # under the lock: a submit after this starts a new worker
                elif not retrying:
                    self._admit()
                    self._lock.notify_all()  # room in the queue for blocked submitters
            if stop:  # failed after the lock is released: their done-callbacks may call into the scheduler
                closed = RequestError("the scheduler was closed before this request finished")
                for sequence in unfinished:
                    self._fail(sequence, closed)
                return
            if retrying:
                continue
            try:
                self._step()
            except Exception as error:  # outside any graph run (those fail their own requests): fail the running
                for sequence in filter(None, self._running):
                    self._fail(sequence, error)

    def _admit(self) -> None:
        """Move waiting requests into free slots (the lock is held). Static: only into an empty cache."""
        if self.batching == "static" and any(self._running):
            return
        free = [slot for slot in range(self.slots) if self._running[slot] is None]
        donors: set[int] = set()  # records a request admitted now will copy from: later ones here leave them be
        # What each request this admission can place would reuse in each free slot's record (one comparison each)
        placing = list(itertools.islice(self._waiting, len(free))) if self.engine.prefix_caching else []
        backend = self.engine.backend
        records: dict[bytes, list[int]] = {}  # free slots by their record's first ids: only those can be reused
        for slot in free if placing else ():
            if self._slot_ids[slot] is not None:
                records.setdefault(prefix_key(self._slot_ids[slot]), []).append(slot)
        reuse = {(id(request), slot): reusable_prefix(self._slot_ids[slot], request.prompt_array, backend)
                 for request in placing if not request.scored for slot in records.get(request.prompt_key, ())}
        # Each request's records worth reusing, the best first: (tokens, -slot), so ties go to the lowest slot. Slots
        # only leave `free` here, so a request's best left is found by moving past taken ones (a max over them all,
        # for every request at every placement, took 1.4 s for a burst of 256 on 256 slots, the lock held)
        wants: dict[int, list[tuple[int, int]]] = {}
        for (request, slot), tokens in reuse.items():
            if tokens:
                wants.setdefault(request, []).append((tokens, -slot))
        for entries in wants.values():
            entries.sort(reverse=True)
        best_left = dict.fromkeys(wants, 0)  # index into wants[request] of its best record still free
        while self._waiting and free:
            sequence = self._waiting.popleft()
            slot, reused = free[0], 0  # the lowest: busy slots stay packed at the front
            if self.engine.prefix_caching:  # the slot that holds most of this prompt's start, if any holds enough;
                # else the lowest holding nothing, else the one left longest ago (its prefix the least likely wanted).
                # A scored prompt reuses nothing: every position's logits are wanted.
                holding = [] if sequence.scored else [s for s in free if self._slot_ids[s] is not None]
                mine = {s: reuse.get((id(sequence), s), 0) for s in holding}
                reused, slot = max(((mine[s], -s) for s in holding), default=(0, -slot))
                slot = -slot
                # A record a request placed after this one reuses much more of (a conversation's next turn, where
                # this prompt shares only the chat template's header) is left to it: else each turn took the
                # next conversation's slot for the header, and no conversation found its own record
                claimed = set()  # each later request's own best record, where it reuses much more than this one
                still_free = set(holding)
                for request in placing if holding else ():  # (none while a scored request is placed: it holds
                    # nothing, and would move every pointer past every record)
                    if request.slot is None and request is not sequence and id(request) in wants:
                        entries, index = wants[id(request)], best_left[id(request)]
                        while index < len(entries) and -entries[index][1] not in still_free:
                            index += 1
                        best_left[id(request)] = index
                        if index < len(entries) and entries[index][0] > mine[-entries[index][1]] + PREFIX_MIN_TOKENS:
                            claimed.add(-entries[index][1])
                unwanted = min([s for s in free if s not in donors | claimed] or free,
                               key=lambda s: (self._slot_ids[s] is not None, self._slot_released[s], s))
                # A slot whose record goes well past the shared start (a long conversation) is kept if another free
                # slot's is less wanted: the request goes there and copies the shared rows (_share_prefixes), as a
                # block cache would add blocks beside them. The record must outlive this admission: a request
                # placed after this one reuses it in place (claimed), or a free slot is left for each waiting one
                if reused and unwanted != slot and (slot in claimed or len(self._slot_ids[slot]) > reused +
                                                    PREFIX_MIN_TOKENS and len(free) - 1 > len(self._waiting)):
                    reused = 0
                    donors.add(slot)
                slot = slot if reused else unwanted
            free.remove(slot)
            sequence.slot, sequence.prefilled, sequence.cached = slot, reused, reused
            self._slot_ids[slot] = None  # its rows are the sequence's now
            self._running[slot] = sequence

    def _step(self) -> None:
        cancelled = [sequence for sequence in filter(None, self._running) if sequence.handle.cancelled]
        for sequence in cancelled:
            self._finish(sequence, "cancelled")
        if cancelled and self._waiting:  # their slots are free now: a waiting request starts in this step, not the next
            with self._lock:
                self._admit()
                self._lock.notify_all()
        waiting = self._share_prefixes() if self.engine.prefix_caching else set()
        decoding = any(s is not None and s.next_token is not None for s in self._running)
        self._prefill(budget=self.prefill_chunk if self.prefill_chunk and decoding else None, deferred=waiting)
        self._decode()

    def _share_prefixes(self) -> set[_Sequence]:
        """Prefix caching across slots: a request about to be prefilled whose prompt begins with what another slot
        holds (a running request's prompt and output so far, or a free slot's record), beyond what its own slot
        held, gets those rows copied into its slot and prefills only the rest: requests that share a system prompt
        compute it once, however many arrive together. Copying the keys and values of P tokens costs what reading
        them does; computing them costs a prefill.

        Returns the requests not to prefill this iteration: one whose prompt shares at least PREFIX_MIN_TOKENS more
        with a request admitted before it that is still being prefilled waits for that prefill, to copy from it at
        the next iteration; and so do the requests admitted after it, so that none overtakes it (first come, first
        served, as without sharing). A scored request (prompt_logprobs) copies nothing, as it computes every
        position's logits, and so waits only behind a waiting request admitted before it."""
        backend = self.engine.backend
        deferred: set[_Sequence] = set()
        pending = sorted((s for s in self._running if s is not None and s.prefill_start is None),
                         key=lambda s: s.handle.id)
        holders: dict[bytes, list[int]] = {}  # slots by the first ids their rows hold: only those can be reused
        prompts: dict[bytes, list[_Sequence]] = {}  # running requests by their prompt's first ids
        for slot, other in enumerate(self._running if pending else ()):
            if other is None:
                key = None if self._slot_ids[slot] is None else prefix_key(self._slot_ids[slot])
            else:
                prompts.setdefault(other.prompt_key, []).append(other)
                key = None if other.scored and not self._scored_rows_reusable else other.held_key()  # its rule
            holders.setdefault(key, []).append(slot)
        for sequence in pending:
            shared, donor = sequence.prefilled, None
            # a scored prompt computes every position: it has no donor
            for slot in () if sequence.scored or sequence.prompt_key is None else holders.get(sequence.prompt_key, ()):
                other = self._running[slot]
                held = self._slot_ids[slot] if other is None else other.held_ids()
                if other is sequence or held is None:  # (a request whose copy failed left its slot empty)
                    continue
                common = reusable_prefix(held, sequence.prompt_array, backend)
                if common > shared:
                    shared, donor = common, slot
            if donor is not None:
                if self._graph_run([sequence], lambda: self.cache.copy_rows(
                        donor, sequence.slot, sequence.prefilled, shared) or True) is None:
                    continue  # the copy failed this request alone
                sequence.prefilled = sequence.cached = shared
                # a donor now for later ones, as every slot holding rows is (its donor holds them too: a tie goes to
                # the lower slot)
                if sequence.slot not in holders.setdefault(sequence.held_key(), []):
                    bisect.insort(holders[sequence.held_key()], sequence.slot)
            if deferred or not sequence.scored and sequence.prompt_key is not None and any(
                    other is not sequence and other.handle.id < sequence.handle.id
                    and other.prefilled < len(other.prompt_ids)
                    and reusable_prefix(other.prompt_array, sequence.prompt_array, backend)
                    >= shared + PREFIX_MIN_TOKENS
                    for other in prompts.get(sequence.prompt_key, ()) if self._running[other.slot] is other):
                deferred.add(sequence)
        return deferred

    def _prefill(self, budget: int | None, deferred: set[_Sequence] = frozenset()) -> None:
        """Prefill admitted requests, first come first served, at most `budget` prompt tokens in all (None: all);
        not the `deferred` ones (waiting for another's prefill to share, _share_prefixes)."""
        if budget is None:
            self._prefill_together(deferred)
        prefilling = [s for s in self._running
                      if s is not None and s.prefilled < len(s.prompt_ids) and s not in deferred]
        for sequence in sorted(prefilling, key=lambda s: s.handle.id):
            while sequence.prefilled < len(sequence.prompt_ids) and budget != 0:
                start = sequence.prefilled
                remaining = len(sequence.prompt_ids) - start
                count = remaining if budget is None else min(budget, remaining)
                by_decode_graph = sequence.scored or (start > 0 and not self.engine.backend.prefill_takes_past)
                if sequence.scored:  # every position's logits, PROMPT_PIECE_TOKENS rows of them at a time
                    count = min(count, rest_piece_tokens(self.engine.backend, evaluate.PROMPT_PIECE_TOKENS))
                elif by_decode_graph:  # the decode graph takes the rest of a chunked prompt (or of one after a cached
                    # prefix), in pieces however idle the slots: its runs over many tokens hold memory that grows
                    # faster than their count (the default model's onnxruntime arena: +177 MB after 250 tokens,
                    # +1.5 GB after 1000), and TensorRT's profile bounds its tokens per call (to no fewer than
                    # prefill_chunk: _check_engine_limits). A prefill graph that takes a past runs it instead.
                    count = min(count, rest_piece_tokens(self.engine.backend, self.prefill_chunk))
                elif remaining > 1:  # through the prefill graph: no piece of one row (PREFILL_PIECE_MIN_TOKENS),
                    # taken now or left for last, even if the step's budget is passed by a token or two
                    count = max(count, PREFILL_PIECE_MIN_TOKENS)
                    if 0 < remaining - count < PREFILL_PIECE_MIN_TOKENS:
                        count = count - 1 if count > PREFILL_PIECE_MIN_TOKENS else remaining
                budget = None if budget is None else max(0, budget - count)
                ids = np.array([sequence.prompt_ids[start:start + count]], dtype=np.int64)
                positions = np.arange(start, start + count, dtype=np.int64)[None]
                mask = np.ones((1, start + count), dtype=np.int64)
                rows = (sequence.slot, sequence.slot + 1)
                if sequence.prefill_start is None:
                    sequence.prefill_start = time.perf_counter()
                if not by_decode_graph:  # the prefill graph (after a past where it takes one): the last row's logits
                    logits = self._graph_run([sequence], lambda: last_token_logits(
                        self.cache.run("prefill", rows, ids, positions, mask), [count])[0])
                else:  # a scored piece, or a chunk after a past: the decode graph at batch 1, logits [1, count, vocab]
                    logits = self._graph_run([sequence], lambda: self._decode_piece(sequence, rows, ids, positions,
                                                                                    mask))
                if logits is None:  # the run failed this request
                    break
                sequence.prefilled += count
                if sequence.prefilled == len(sequence.prompt_ids):
                    sequence.prefill_end = time.perf_counter()
                    sequence.handle.prompt_logprobs = sequence.prompt_entries  # None unless scored
                    self._take(sequence, logits)
            if budget == 0:
                break

    def _decode_piece(self, sequence: _Sequence, rows, ids, positions, mask) -> np.ndarray:
        """A prompt piece through the decode graph; the last position's logits. A scored prompt's rows become its
        prompt tokens' entries first (evaluate.prompt_entries)."""
        logits = self.cache.run("decode", rows, ids, positions, mask)[0]  # [count, vocab]
        if sequence.scored:
            sequence.prompt_entries += evaluate.prompt_entries(logits, sequence.prompt_ids, int(positions[0, 0]),
                                                               sequence.params.prompt_logprobs)
        return logits[-1]

    def _prefill_together(self, deferred: set[_Sequence]) -> None:
        """Whole prompts of requests admitted into neighbouring slots, as one right-padded prefill batch.

        One graph run over B prompts multiplies bigger matrices than B runs of one (and stalls the decoding
        requests once, not B times); each row's mask covers its own prompt, and the prefill graph returns each
        row's logits at its last real token. Slots must be neighbours: the batch is a contiguous block of rows.
        """
        fresh = [s for s in self._running
                 if s is not None and s.prefilled == 0 and s not in deferred and not s.scored]
        runs: list[list[_Sequence]] = []
        for sequence in fresh:  # in slot order
            run = runs[-1] if runs else None
            if run and run[-1].slot + 1 == sequence.slot:
                lengths = [len(s.prompt_ids) for s in (*run, sequence)]
                # Padding bounded: seven 8-token prompts beside a 384-token one made an [8 x 384] run, and every
                # prompt in it (and every decoding request) waited 6.0 s for what takes 0.09 s and 0.64 s alone
                if max(lengths) * len(lengths) <= PREFILL_BATCH_MAX_ROWS_PER_TOKEN * sum(lengths):
                    run.append(sequence)
                    continue
            runs.append([sequence])
        for run in (r for r in runs if len(r) > 1):
            lengths = np.array([len(s.prompt_ids) for s in run])
            width = int(lengths.max())
            ids = np.zeros((len(run), width), dtype=np.int64)
            for row, sequence in enumerate(run):
                ids[row, :lengths[row]] = sequence.prompt_ids
            positions = np.tile(np.arange(width, dtype=np.int64), (len(run), 1))
            mask = (positions < lengths[:, None]).astype(np.int64)  # right padded
            started = time.perf_counter()
            try:
                logits = last_token_logits(self.cache.run(
                    "prefill", (run[0].slot, run[-1].slot + 1), ids, positions, mask), lengths)  # [B, vocab]
            except Exception:  # noqa: BLE001 - not theirs to fail: _prefill runs each alone next, and what fails then
                continue  # fails alone (a batch padded to its longest prompt is what ran out of memory, say)
            ended = time.perf_counter()
            for row, sequence in enumerate(run):
                sequence.prefill_start, sequence.prefill_end = started, ended
                sequence.prefilled = len(sequence.prompt_ids)
                self._take(sequence, logits[row])

    def _decode(self) -> None:
        """One decode step for every decoding sequence, batched over the prefix of slots that holds them all."""
        rows = [slot for slot, s in enumerate(self._running) if s is not None and s.next_token is not None]
        if not rows:
            return
        batch = rows[-1] + 1
        lengths = np.zeros(batch, dtype=np.int64)  # per row: cached tokens = where its new key/value goes
        ids = np.zeros((batch, 1), dtype=np.int64)
        for slot in range(batch):
            sequence = self._running[slot]
            if sequence is not None:  # decoding, or mid-prefill (a throw-away write its next chunk overwrites)
                lengths[slot] = sequence.length
                ids[slot, 0] = 0 if sequence.next_token is None else sequence.next_token
            elif self._slot_ids[slot] is not None:  # free, holding a prefix: its throw-away write goes after it
                lengths[slot] = len(self._slot_ids[slot])
        mask = (np.arange(lengths.max() + 1)[None] <= lengths[:, None]).astype(np.int64)  # right padded
        decoding = [self._running[slot] for slot in rows]  # mid-prefill rows' throw-away writes do not fail them
        logits = self._graph_run(decoding, lambda: self.cache.run("decode", (0, batch), ids, lengths[:, None], mask))
        if logits is None:
            return
        for slot in rows:
            sequence = self._running[slot]
            self._take(sequence, logits[slot, -1])

    def _graph_run(self, sequences: list[_Sequence], run):
        """run(), a graph run over these sequences' cache rows; if it raises, it fails them alone and returns None:
        the other requests' rows were not in it, and they go on (a long prompt's out-of-memory prefill, say)."""
        try:
            return run()
        except Exception as error:
            for sequence in sequences:
                self._fail(sequence, error)
            return None

    def _take(self, sequence: _Sequence, logits: np.ndarray) -> None:
        """Sample this sequence's next token from its row of logits and accept it. An error here (its logits are
        NaN, its text fails to decode) is its own: it fails this request alone, and the rest of the batch, whose
        rows are fine, goes on; a failing graph run fails the requests in it (_graph_run)."""
        try:
            self._accept(sequence, sequence.sampler(logits))
        except Exception as error:
            self._fail(sequence, error)

    def _accept(self, sequence: _Sequence, token: int) -> None:
        """A sampled token: record it, stream its text, stop or keep decoding (the stops of Engine.stream)."""
        sequence.token_times.append(time.perf_counter())
        sequence.next_token = None
        params = sequence.params
        counts = self._token_counts
        if len(sequence.token_times) == 1:  # its first token: its whole prompt is in
            counts["prompt_tokens"] += len(sequence.prompt_ids)
            if self.engine.prefix_caching and not sequence.scored:  # a scored prompt does not look (_admit)
                counts["prefix_cache_queries"] += len(sequence.prompt_ids)
                counts["prefix_cache_hits"] += sequence.cached
        counts["generation_tokens"] += 1
        if token in sequence.stop_ids:
            sequence.stop_token = token
            return self._finish(sequence, "stop")
        sequence.output.append(token)
        piece = sequence.decoder.push(token)
        if piece:
            sequence.handle._pieces.put(sequence.piece(piece))  # a sink that raises fails this request (_take)
        if sequence.decoder.stopped:  # a stop string: the text ends before it
            return self._finish(sequence, "stop")
        if len(sequence.output) >= params.max_new_tokens:
            return self._finish(sequence, "length")
        if sequence.length >= self.engine.max_context:  # submit's capacity check makes this unreachable; should a
            # request ever get past it, it ends here, not in a decode step whose failure every running request shares
            return self._finish(sequence, "max_context")
        sequence.next_token = token  # fed back at position `length` by the next decode step

    def _release(self, sequence: _Sequence, failed: bool = False) -> None:
        if sequence.slot is not None and self._running[sequence.slot] is sequence:
            self._running[sequence.slot] = None
            kept = not sequence.scored or self._scored_rows_reusable
            if self.engine.prefix_caching and not failed and kept:  # what its rows hold, for a later prompt that
                # begins so; short of the last position, where a decode step's throw-away write for a free row goes
                held = sequence.held_ids()[:self.engine.max_context - 1]
                self._slot_ids[sequence.slot] = held if len(held) else None
                self._slot_released[sequence.slot] = next(self._releases)
        sequence.next_token = None

    def _finish(self, sequence: _Sequence, reason: str) -> None:
        self._release(sequence)
        try:
            result = self._result(sequence, reason)
        except Exception as error:  # the slot is free already: the handle must still complete
            self._fail(sequence, error)
            return
        try:
            sequence.handle._pieces.put(END)
        except Exception as error:  # noqa: BLE001 -- a caller's `pieces` sink (its event loop closed): this request
            return self._fail(sequence, error)  # fails, no other (the worker's catch-all had failed them all)
        sequence.handle._future.set_result(result)

    def _result(self, sequence: _Sequence, reason: str) -> GenerationResult:
        tail = sequence.decoder.finish()  # text held back in case it began a stop string
        if tail:
            sequence.handle._pieces.put(sequence.piece(tail, final=True))
        if sequence.decoder.stopped and reason in ("length", "max_context"):  # the stop ended inside a character
            reason = "stop"
        text = sequence.decoder.streamed_text  # what was streamed: ends before a stop string
        timings = None
        if sequence.token_times:
            trace = RequestTrace(
                arrival=sequence.arrival, prefill_start=sequence.prefill_start, first_token=sequence.token_times[0],
                token_times=sequence.token_times, finish=time.perf_counter(), prompt_tokens=len(sequence.prompt_ids),
                output_tokens=len(sequence.token_times), prefill_end=sequence.prefill_end,
                cached_prompt_tokens=sequence.cached)
            timings = Timings(trace, sequence.tokenize_s)
        logged, ended_by = sequence.params.logprobs is not None, sequence.stop_token
        logprobs = sequence.sampler.logprobs[:len(sequence.output)] if logged else None
        stop_entry = sequence.sampler.logprobs[len(sequence.output)] if logged and ended_by is not None else None
        scored = sequence.prompt_entries if sequence.prefilled == len(sequence.prompt_ids) else None  # cancelled
        return GenerationResult(text, sequence.output, sequence.prompt_ids, reason, timings, logprobs, ended_by,
                                stop_entry, scored, sequence.decoder.stop_string)

    def _fail(self, sequence: _Sequence, error: BaseException) -> None:
        self._release(sequence, failed=True)  # a failed run may have written its rows partly
        try:
            sequence.handle._pieces.put(END)
        except Exception:  # noqa: BLE001 -- a caller's sink that fails (its event loop closed): the handle still ends
            LOGGER.exception("request %s: its pieces sink raised", sequence.handle.id)
        if not sequence.handle.done():
            sequence.handle._future.set_exception(error)
