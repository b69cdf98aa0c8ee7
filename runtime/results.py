"""What a request returns: its text and tokens, why it ended, and its timings (derived from the raw trace that
runtime/metrics.py aggregates); and results as a JSON file (write_json)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import RequestError
from runtime.metrics import RequestTrace


def shown_path(path: str | Path) -> str:
    """A written path as a notice names it: "-" is standard output ("wrote -" read as a file named -)."""
    return "standard output" if str(path) == "-" else str(path)


_STANDARD_STREAMS = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}
_DESCRIPTOR = re.compile(r"^/(?:dev/fd|proc/self/fd|proc/thread-self/fd)/(\d+)$")
_OTHER_DESCRIPTOR = re.compile(r"^/proc/[^/]+/fd/\d+$")


def own_descriptor(path: str | Path) -> int | None:
    """The number of this process's file descriptor that `path` names through its links (/dev/stdout,
    /dev/fd/3, /proc/self/fd/1, or a link to one), else None."""
    for hop in _link_chain(path):
        if hop in _STANDARD_STREAMS:
            return _STANDARD_STREAMS[hop]
        if match := _DESCRIPTOR.match(hop):
            return int(match.group(1))
    return None


def is_stream(path: str | Path) -> bool:
    """Whether path names a stream to write into, not a file to replace: "-" (stdout), a descriptor (/dev/stdout,
    /dev/fd/3, /proc/self/fd/1, or a link to one), a pipe (a shell's >(jq .)), a terminal, /dev/null. Renamed over,
    /dev/stdout had become a file of JSON for every process of a container run as root (and a link to
    /proc/self/fd/1 a file). A file under /dev that is a file (/dev/shm's) is one: any path under /dev had counted
    as a stream, so a new one was refused and an old one appended to."""
    if str(path) == "-":
        return True
    # /dev/stdout -> /proc/self/fd/1 -> the file a shell redirected stdout to: a regular file at the end of the
    # links, but a stream to write into (renamed over, the link itself became a file of JSON)
    if own_descriptor(path) is not None or any(_OTHER_DESCRIPTOR.match(hop) for hop in _link_chain(path)):
        return True
    try:
        mode = os.stat(path).st_mode  # a link followed
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
        return True
    except (OSError, ValueError, AttributeError):  # pytest's capture, a closed stream
        return False


def _link_chain(path: str | Path, most: int = 40) -> list[str]:
    """path made absolute, then each symbolic link's target in turn (relative ones read from the link's folder)."""
    hop = os.path.abspath(path)
    chain = [hop]
    for _ in range(most):
        try:
            target = os.readlink(hop)
        except (OSError, ValueError):  # not a link (or not there): the chain ends
            break
        hop = os.path.normpath(os.path.join(os.path.dirname(hop), target))
        chain.append(hop)
    return chain


def json_text(payload) -> str:
    """payload as indented JSON and a newline, a non-finite number as null: json.dumps writes Infinity and NaN,
    which JSON has not (a broken build's perplexity, past 1e308, made `aotlm eval --json` unreadable to strict
    parsers: JavaScript's, Go's, Rust's)."""
    return json.dumps(_finite_or_null(payload), indent=2, allow_nan=False) + "\n"


def _finite_or_null(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value


def write_json(path: str | Path, payload: dict) -> Path:
    """Write payload as indented JSON at path (its folder made if missing), whole or not at all: into a temporary file
    beside it, then renamed over it. A full disk or a refused write raises OSError and leaves no empty or cut-short
    file (nor the temporary one) behind. A stream (is_stream: "-", /dev/stdout, a pipe) is written into instead."""
    text = json_text(payload)
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return Path("-")
    try:
        if (descriptor := own_descriptor(path)) is not None:
            # written through a copy of the descriptor, not opened by its path: a socket (systemd's journal on a
            # service's stdout) cannot be opened so (ENXIO, after the whole run), and a file a shell redirected
            # stdout to keeps what the program wrote before (opened anew with "w" it was truncated)
            for stream in (sys.stdout, sys.stderr):  # what Python holds for that descriptor goes first
                if _has_fileno(stream) and stream.fileno() == descriptor:
                    stream.flush()
            with os.fdopen(os.dup(descriptor), "a", encoding="utf-8") as stream:
                stream.write(text)
            return Path(path)
        if is_stream(path):
            # appended: a stream opened with "w" (a named pipe, a file another process truncated) is not truncated
            with open(path, "a", encoding="utf-8") as stream:
                stream.write(text)
            return Path(path)
        path = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)  # a link stays a link
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.chmod(temporary, 0o666 & ~process_umask())  # mkstemp makes it private: as open() would make it
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as problem:  # a full disk's write names no file: the error line says which
        problem.filename = problem.filename or str(path)
        raise
    return path


def process_umask() -> int:
    """The process's umask: /proc's (Linux 4.7+), else read by setting it back at once (not thread-safe)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status", encoding="utf-8") as status:
            return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def received_at(arrival: float | None, now: float) -> float:
    """When a request was received: `arrival` (a time.perf_counter reading) if given and not later than now."""
    if arrival is None:
        return now
    if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not math.isfinite(arrival):
        raise RequestError(f"arrival: {arrival!r} must be a finite time.perf_counter() reading")
    if arrival <= 0:  # 0.0, an "unset" placeholder, gave a TTFT of the machine's uptime
        raise RequestError(f"arrival: {arrival!r} is no time.perf_counter() reading (that clock counts from about the "
                           f"machine's start, never 0 or below); give one, or None for now")
    if arrival > now + ARRIVAL_SKEW_S:  # time.time() (seconds since 1970) is far past perf_counter (since boot)
        raise RequestError(f"arrival: {arrival!r} is {arrival - now:,.0f} s after time.perf_counter() now; give a "
                           f"time.perf_counter() reading (time.time() is another clock)")
    return min(float(arrival), now)  # a reading another thread took a moment after this one


ARRIVAL_SKEW_S = 1.0  # an arrival this far past now is another clock's reading, not another thread's


@dataclass
class Timings:
    """One request's timings, all derived from its `trace` (runtime/metrics.py holds the formulas, vLLM's).

    Seconds; `*_s` latencies count from when the request was received: the call that took it (generate, stream,
    chat, submit), or its `arrival` if one was given. tpot = (e2e - ttft) / (output tokens - 1), reported as 0.0 for
    a one-token output (the trace says None). e2e ends at the last output token. tokenize_s: the time spent turning
    the prompt into token ids (a chat's template rendered too).
    """

    trace: RequestTrace
    tokenize_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens, a cached prefix included."""
        return self.trace.prompt_tokens

    @property
    def output_tokens(self) -> int:
        """Every token the model produced, a final stop token included."""
        return self.trace.output_tokens

    @property
    def prefill_s(self) -> float:
        """From the start of the prompt's first prefill run to the end of its last (compute + logits), tokenization
        and sampling excluded. With the scheduler's prefill_chunk, the other requests' decode steps between its
        chunks are inside it, as in vLLM's prefill time."""
        return self.trace.prefill_seconds

    @property
    def ttft_s(self) -> float:
        """Request received -> first output token chosen (tokenization and prefill included)."""
        return self.trace.ttft

    @property
    def e2e_s(self) -> float:
        """Request received -> last output token chosen."""
        return self.trace.e2e

    @property
    def token_times_s(self) -> list[float]:
        """One per output token, seconds since the request was received."""
        arrival = self.trace.arrival
        return [t - arrival for t in self.trace.token_times]

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive output tokens."""
        return self.trace.itl

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first: (e2e - ttft) / (output tokens - 1); 0.0 for a one-token output."""
        tpot = self.trace.tpot
        return 0.0 if tpot is None else tpot

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of decode (after the first token); 0 for one-token outputs."""
        return 1.0 / self.tpot_s if self.tpot_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens computed (a cached prefix is not) over prefill_s: with prefill_chunk, a rate that counts
        the other requests' steps between the chunks."""
        return self.trace.prefill_tokens_per_s or 0.0

    @property
    def cached_prompt_tokens(self) -> int:
        """The prompt's first tokens reused from the cache (Engine.load(prefix_caching=True)); 0 otherwise."""
        return self.trace.cached_prompt_tokens

    def summary(self) -> dict:
        """The timings as numbers in milliseconds (*_ms) and rates (per second), for printing or JSON; queue_ms:
        received -> its first prefill began (tokenization and waiting for a slot)."""
        return {
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "ttft_ms": 1e3 * self.ttft_s, "prefill_ms": 1e3 * self.prefill_s, "tpot_ms": 1e3 * self.tpot_s,
            "e2e_ms": 1e3 * self.e2e_s, "queue_ms": 1e3 * self.trace.queue, "decode_tokens_per_s": self.tokens_per_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s, "cached_prompt_tokens": self.cached_prompt_tokens,
        }

    def __repr__(self) -> str:
        """The summary's figures (a notebook shows this): the dataclass's own repr listed the trace's raw clock
        readings, one per token, and none of the documented fields."""
        figures = {**self.summary(), "tokenize_ms": 1e3 * self.tokenize_s}
        shown = ", ".join(f"{key}={value:.2f}" if isinstance(value, float) else f"{key}={value}"
                          for key, value in figures.items())
        return f"<Timings {shown}>"  # not a constructor's call: a Timings is made from its trace


@dataclass
class GenerationResult:
    """One request's output. text: the output's text (stop strings and stop tokens left out); token_ids: its tokens;
    prompt_token_ids: the prompt's; finish_reason: "stop" (a stop token or string), "length" (max_new_tokens),
    "max_context" (the context is full) or "cancelled"; timings: its Timings (None for a request cancelled before its
    first token); logprobs, stop_token_id, stop_token_logprobs, prompt_logprobs, stop_string: as the comments below
    say."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (stop token or string), "length" (max_new_tokens), "max_context", "cancelled"
    timings: Timings | None  # None only for a request cancelled before its first token
    # With the logprobs sampling option: one {token id: log-probability} per token of token_ids (itself first,
    # then the likeliest alternatives); None without it.
    logprobs: list[dict[int, float]] | None = field(default=None, repr=False)  # (a repr of thousands of entries)
    # The stop token (an end-of-sequence token or one of stop_token_ids) that ended the request: sampled and counted
    # in the timings' output tokens, but not part of token_ids or the text; None if none did. With logprobs, its
    # entry (an API reports the token's log-probability as vLLM does).
    stop_token_id: int | None = None
    stop_token_logprobs: dict[int, float] | None = None
    # With the prompt_logprobs sampling option: per prompt token, its entry as in logprobs (None for the first).
    prompt_logprobs: list[dict[int, float] | None] | None = field(default=None, repr=False)
    # The stop string that ended the text (of several, the one that completed first); None if none did. With
    # stop_token_id, what vLLM's stop_reason reports, so that a caller passing several stops knows which one fired.
    stop_string: str | None = None
