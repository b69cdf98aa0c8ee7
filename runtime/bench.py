"""`aotlm bench`: a serving workload (arrivals, prompt and output lengths) run through one engine, timed per request.

Two kinds of server. A blocking one (`aotlm_server`: the batch-1 engine path; the baselines) serves one request at
a time, so requests go through a single worker thread fed by a queue. A `ScheduledServer` submits each request to
the engine's scheduler (runtime/scheduler.py, continuous or static batching over S cache slots) the moment it
arrives, so many are in flight at once. Either way a request's `arrival` is when it was due (all: the start;
concurrency: when its client's last request ended and the runner sent it; poisson: its scheduled time, not when the
runner got to send it): time spent waiting shows in its TTFT and `queue`, and so does any lateness of the runner's
thread (vLLM's `bench serve` times from the actual send instead; the runner shares the server's process and GIL: its
lateness measured p99 6.7 ms, median 0.12 ms, on the tiny model at 150 requests/s; each Poisson run records its own,
`send_lateness_ms`). Arrivals:
    all          every request enters the queue at once
    concurrency  closed loop: C clients, each sends its next request when its previous one finishes
    poisson      a seeded Poisson process of `rate` requests/s: N exponential gaps rescaled as vLLM's get_request
                 rescales them, so the first request arrives one gap after the run starts and the last at N / rate;
                 the run's duration starts there too, so a server that keeps up reports `rate` requests/s (timed
                 from the first arrival instead, it reported N / (N - 1) times that: +33% at 4 requests)
Outputs never stop early (stop tokens disabled), so every request makes exactly its asked output tokens.
Metrics are runtime.metrics' (vLLM's definitions). Also times the prefill and decode graphs alone (`time_phase`)
against peaks the caller passes in (the runtime does not import the compiler). Needs numpy and rich; matplotlib
(the `bench` extra) only for the plots, imported when they are drawn.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from runtime.cpus import cgroup_cpu_quota, usable_cpus
from runtime.errors import RequestError
from runtime.metrics import RequestTrace, summarize
from runtime.results import is_stream, write_json
from runtime.text_files import TextFile, TextFileError, text_prefix, text_problem
from runtime.versions import pip_install

ARRIVALS = ("all", "concurrency", "poisson")
BASELINES = ("transformers", "onnxruntime-genai")  # their runners: benchmarks/baselines.py (a source checkout)
Serve = Callable[[list, int, float], RequestTrace]  # (prompt_ids, output_tokens, arrival) -> trace
OnDone = Callable[[RequestTrace | BaseException], None]


class BenchError(RequestError):
    """A benchmark cannot run as asked (bad rate, concurrency, lengths, baseline name...)."""


@dataclass
class Request:
    prompt_ids: list[int]
    output_tokens: int


@dataclass
class Workload:
    requests: list[Request]
    warmup: list[Request]  # served one at a time before the measured requests; excluded from every statistic
    arrival: str
    concurrency: int
    rate: float | None
    seed: int
    offsets: list[float] | None  # poisson: seconds after the run's start when each request arrives (the first > 0)
    shared_prefix: int = 0  # tokens every prompt begins with (a system prompt), before its own text

    def settings(self) -> dict:
        return {"requests": len(self.requests), "warmup": len(self.warmup), "arrival": self.arrival,
                "shared_prefix_tokens": self.shared_prefix,
                "concurrency": self.concurrency if self.arrival == "concurrency" else None,
                "rate": self.rate if self.arrival == "poisson" else None, "seed": self.seed,
                "prompt_tokens": [len(r.prompt_ids) for r in self.requests],
                "output_tokens": [r.output_tokens for r in self.requests], "arrival_offsets_s": self.offsets}


def _fitting_lengths(max_context: int, shared_prefix: int, prompt: tuple[int, int],
                     output: tuple[int, int]) -> str:
    """What to ask for instead, each suggestion one that fits (prompt + output - 1 positions after the prefix):
    outputs that fit the longest prompt, else prompts that fit the longest output, else both together."""
    if shared_prefix > max_context - 1:  # a one-token prompt and one output token need one position after it
        return f"--shared-prefix {shared_prefix} leaves no room for the prompts; use at most {max_context - 1}"
    outputs = max_context + 1 - shared_prefix - prompt[1]
    if outputs >= 1:
        return f"ask for --output-tokens {outputs} or fewer with these prompts"
    prompts = max_context + 1 - shared_prefix - output[1]
    if prompts >= 1:
        return f"ask for --prompt-tokens {prompts} or fewer with these output tokens"
    return f"ask for --prompt-tokens and --output-tokens of at most {max_context + 1 - shared_prefix} together"


def parse_range(text: str, what: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64:256' -> (64, 256), drawn uniformly (both ends included)."""
    try:
        low, _, high = str(text).partition(":")
        bounds = (int(low), int(high or low))
    except ValueError:
        raise BenchError(f"{what}: {text!r} is not a token count N or a range LOW:HIGH") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise BenchError(f"{what}: {text!r} needs 1 <= LOW <= HIGH")
    return bounds


def check_baselines(names: Sequence[str]) -> list[str]:
    unknown = [name for name in names if name not in BASELINES]
    if unknown:
        raise BenchError(f"unknown baseline {unknown[0]!r}; known baselines: {', '.join(BASELINES)}")
    return list(dict.fromkeys(names))


def parse_sizes(text: str, max_context: int, option: str = "sizes") -> list[int]:
    """'128,512' -> [128, 512]; each must be >= 1 and below the max context. `option` names the flag in errors."""
    try:
        sizes = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise BenchError(f"{option} {text!r}: give comma-separated token counts, e.g. 128,512") from None
    bad = [size for size in sizes if not 1 <= size < max_context]
    if not sizes or bad:
        raise BenchError(f"{option} {text!r}: each must be >= 1 and below this artifact's max context ({max_context})")
    return sizes


def sizes_that_fit(defaults: str, largest: int) -> list[int]:
    """The default sizes up to `largest` (what the artifact's max context leaves room for); `largest` itself when
    none of them fit (a small artifact)."""
    return [size for size in parse_sizes(defaults, 1 << 62) if size <= largest] or [max(largest, 1)]


def read_prompt_file(path: str | None) -> TextFile | None:
    """--prompt-file, opened as `aotlm eval --text` opens a file (runtime/text_files.py): read later, only as far as
    the prompts need."""
    if path is None:
        return None
    try:
        return TextFile(path, f"--prompt-file {path}")
    except (OSError, TextFileError) as error:
        raise BenchError(str(error) if isinstance(error, TextFileError) else f"--prompt-file {path}: {error}") from None


def text_token_ids(encode: Callable[[str], list[int]], count: int, text: str | TextFile | None = None) -> list[int]:
    """At least `count` token ids of `text` (default: Python's docs, pydoc_data.topics), repeated if it is short."""
    if text is None:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[name] for name in sorted(topics))
    characters = 8 * count  # read and tokenize only what is needed; ~4 characters per token in English
    while True:
        try:
            part, whole = text_prefix(text, characters)
        except (OSError, TextFileError) as error:
            raise BenchError(str(error) if isinstance(error, TextFileError) else f"--prompt-file: {error}") from None
        if whole and not part.strip():
            raise BenchError("the prompt text is empty (--prompt-file): give a file with some text, or drop the flag "
                             "for Python's documentation")
        problem = text_problem(part)
        if problem:
            raise BenchError(f"the prompt text (--prompt-file) {problem}")
        ids = encode(part)
        if len(ids) >= count or whole:
            break
        characters *= 2
    return (ids * (count // len(ids) + 1))[:count] if ids else ids


def make_workload(encode: Callable[[str], list[int]], *, max_context: int, requests: int, arrival: str = "all",
                  concurrency: int | None = None, rate: float | None = None, prompt_tokens: str | tuple = "128",
                  output_tokens: str | tuple = "64", warmup: int = 0, seed: int = 0,
                  text: str | None = None, shared_prefix: int = 0) -> Workload:
    """Prompts are consecutive cuts of the text's tokens; lengths and Poisson gaps come from `seed`.
    concurrency: clients of the closed loop (arrival "concurrency", default 1); refused with the other arrivals.
    shared_prefix: every prompt begins with the text's first that many tokens (as a system prompt would), then its
    own cut of the text after them; --prompt-tokens counts the cut alone."""
    if arrival not in ARRIVALS:
        raise BenchError(f"unknown arrival {arrival!r}; known: {', '.join(ARRIVALS)}")
    if concurrency is not None and arrival != "concurrency":
        raise BenchError(f"--concurrency applies to --arrival concurrency, not {arrival}")
    concurrency = 1 if concurrency is None else concurrency
    for bad, message in ((requests < 1, f"--requests must be >= 1, got {requests}"),
                         (warmup < 0, f"--warmup must be >= 0, got {warmup}"),
                         (shared_prefix < 0, f"--shared-prefix must be >= 0, got {shared_prefix}"),
                         (concurrency < 1, f"--concurrency must be >= 1, got {concurrency}"),
                         (arrival == "concurrency" and concurrency > requests,
                          f"--concurrency {concurrency} exceeds --requests {requests}: some clients would send nothing"),
                         (rate is not None and not 0 < rate < float("inf"), f"--rate must be a finite number > 0 requests/s, got {rate}"),
                         (arrival == "poisson" and rate is None, "--arrival poisson needs --rate (requests/s)"),
                         (arrival != "poisson" and rate is not None, f"--rate applies to --arrival poisson, not {arrival}")):
        if bad:
            raise BenchError(message)
    prompt = prompt_tokens if isinstance(prompt_tokens, tuple) else parse_range(prompt_tokens, "--prompt-tokens")
    output = output_tokens if isinstance(output_tokens, tuple) else parse_range(output_tokens, "--output-tokens")
    if shared_prefix + prompt[1] + output[1] - 1 > max_context:  # the engine's rule: the last output token is never
        prefix = f"--shared-prefix ({shared_prefix}) + " if shared_prefix else ""  # fed back
        raise BenchError(f"{prefix}--prompt-tokens ({prompt[1]}) + --output-tokens ({output[1]}) need "
                         f"{shared_prefix + prompt[1] + output[1] - 1} cache positions (prompt + output - 1); this "
                         f"artifact's max context is {max_context}; "
                         f"{_fitting_lengths(max_context, shared_prefix, prompt, output)}")
    # The measured requests' lengths and the warm-up's come from separate streams, and the measured prompts are the
    # text's first cuts: --warmup does not change what is measured.
    measured_rng, warmup_rng = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 2])
    prompt_lengths = np.concatenate([measured_rng.integers(prompt[0], prompt[1] + 1, size=requests),
                                     warmup_rng.integers(prompt[0], prompt[1] + 1, size=warmup)])
    output_lengths = np.concatenate([measured_rng.integers(output[0], output[1] + 1, size=requests),
                                     warmup_rng.integers(output[0], output[1] + 1, size=warmup)])
    total = requests + warmup
    ids = text_token_ids(encode, shared_prefix + int(prompt_lengths.sum()), text)
    prefix, ids = ids[:shared_prefix], ids[shared_prefix:]
    cuts = np.concatenate([[0], np.cumsum(prompt_lengths)])
    made = [Request(prefix + ids[cuts[i]:cuts[i + 1]], int(output_lengths[i])) for i in range(total)]
    offsets = None
    if arrival == "poisson":
        # N exponential gaps, rescaled as vLLM's get_request rescales them so that the realized rate is the asked
        # one: the last of N requests arrives at N / rate, the first one gap after the start. Unscaled, a run's rate is
        # off by sampling noise: seed 0 offered 0.87x --rate with 32 requests, 0.72x with 16. Scaled exponential gaps
        # are the spacings of uniform points: a Poisson process conditioned on its Nth arrival at N / rate.
        gaps = np.random.default_rng([seed, 0]).exponential(1.0 / rate, size=requests)
        gaps *= requests / rate / gaps.sum()
        offsets = np.cumsum(gaps).tolist()
    return Workload(made[:requests], made[requests:], arrival, concurrency, rate, seed, offsets, shared_prefix)


def aotlm_server(engine) -> Serve:
    def serve(prompt_ids: list[int], output_tokens: int, arrival: float) -> RequestTrace:
        return engine.generate(prompt_ids, max_new_tokens=output_tokens, ignore_eos=True, arrival=arrival).timings.trace
    return serve


def _trace_or_error(handle) -> RequestTrace | BaseException:
    """A finished handle's trace, or the error to raise in the main thread. Never raises: an exception inside a
    done-callback is logged and dropped by concurrent.futures, and run_workload would then wait forever."""
    try:
        error = handle.exception()
        if error is not None:
            return error
        timings = handle.result().timings
        if timings is None or timings.trace is None:
            return BenchError(f"request {handle.id} ended without timings (it made no token: cancelled before its first?)")
        return timings.trace
    except BaseException as error:  # noqa: BLE001 -- handed to the main thread, which raises it
        return error


class ScheduledServer:
    """Serves through the engine's scheduler: `submit` returns at once, the trace comes back through `on_done`."""

    def __init__(self, engine, batching: str = "continuous", slots: int = 8, max_queue: int = 4096,
                 prefill_chunk: int | None = None):
        self.scheduler = engine.start_scheduler(slots=slots, batching=batching, max_queue=max_queue,
                                                prefill_chunk=prefill_chunk)

    def submit(self, prompt_ids: list[int], output_tokens: int, arrival: float, on_done: OnDone) -> None:
        handle = self.scheduler.submit(prompt_ids, max_new_tokens=output_tokens, ignore_eos=True, arrival=arrival)
        handle.add_done_callback(lambda h: on_done(_trace_or_error(h)))

    def __call__(self, prompt_ids: list[int], output_tokens: int, arrival: float) -> RequestTrace:
        """One request, waited for (the warm-up)."""
        return self.scheduler.submit(prompt_ids, max_new_tokens=output_tokens, ignore_eos=True,
                                     arrival=arrival).result().timings.trace

    def close(self) -> None:
        self.scheduler.close()


def run_workload(serve: Serve | ScheduledServer, workload: Workload, on_done: Callable[[], None] | None = None,
                 failures: list[dict] | None = None, lateness: list[float] | None = None) -> list[RequestTrace | None]:
    """Serve the warm-up requests one by one, then the workload (through one worker thread for a blocking server,
    submitted on arrival to a ScheduledServer); traces in request order. A request that fails raises its error,
    unless `failures` is given: then it is recorded there ({"request": index, "error": text, "arrival": and
    "failed": perf_counter times}, as vLLM's bench counts failed requests), its trace is None, and the run goes on
    (a closed loop's client sends its next one); the run's duration counts its time (report). `lateness`, if given,
    receives each Poisson request's send time minus its scheduled arrival, in seconds (report's send_lateness_ms)."""
    for request in workload.warmup:
        try:
            serve(request.prompt_ids, request.output_tokens, time.perf_counter())
        except Exception as error:  # before anything is measured: one line, not the engine's traceback
            raise BenchError(f"the warm-up request failed ({type(error).__name__}: {error}); nothing was "
                             f"measured") from error
        on_done and on_done()
    requests, pending, done, stop = workload.requests, queue.Queue(), queue.Queue(), threading.Event()
    arrivals: list[float | None] = [None] * len(requests)  # a failed request's, which has no trace to hold it
    if isinstance(serve, ScheduledServer):
        def submit(index: int, arrival: float) -> None:
            serve.submit(requests[index].prompt_ids, requests[index].output_tokens, arrival,
                         lambda result: done.put((index, result)))
    else:
        submit = lambda index, arrival: pending.put((index, arrival))  # noqa: E731

    def send(index: int, arrival: float) -> None:
        arrivals[index] = arrival
        submit(index, arrival)

    def worker() -> None:
        while (item := pending.get()) is not None and not stop.is_set():
            index, arrival = item
            try:
                done.put((index, serve(requests[index].prompt_ids, requests[index].output_tokens, arrival)))
            except BaseException as error:  # handed to the main thread, which raises it
                done.put((index, error))

    thread = threading.Thread(target=worker, name="bench-worker", daemon=True)
    if not isinstance(serve, ScheduledServer):
        thread.start()
    start = time.perf_counter()
    first = {"all": len(requests), "concurrency": workload.concurrency, "poisson": 0}[workload.arrival]
    for index in range(first):  # these arrive together, at the start
        send(index, start)
    traces: list[RequestTrace | None] = [None] * len(requests)
    sent, completed = first, 0
    try:
        while completed < len(requests):
            timeout = None
            if workload.arrival == "poisson" and sent < len(requests):
                due = start + workload.offsets[sent]
                timeout = due - time.perf_counter()
                if timeout <= 0:  # arrival = the scheduled time: a late main thread does not shorten queueing
                    if lateness is not None:
                        lateness.append(-timeout)
                    send(sent, due)
                    sent += 1
                    continue
            try:  # a wait past threading.TIMEOUT_MAX overflows (a rate of 1e-10/s): waited in hours, re-checked
                index, result = done.get(timeout=None if timeout is None else min(timeout, 3600.0))
            except queue.Empty:  # the next Poisson arrival is due
                continue
            if isinstance(result, Exception) and failures is not None:
                failures.append({"request": index, "error": f"{type(result).__name__}: {result}",
                                 "arrival": arrivals[index], "failed": time.perf_counter()})
            elif isinstance(result, BaseException):
                raise result
            else:
                if result.output_tokens != requests[index].output_tokens:
                    raise BenchError(f"request {index} made {result.output_tokens} tokens, not the "
                                     f"{requests[index].output_tokens} asked")
                traces[index] = result
            completed += 1
            on_done and on_done()
            if workload.arrival == "concurrency" and sent < len(requests):  # that client sends its next one
                send(sent, time.perf_counter())
                sent += 1
    finally:
        stop.set()
        pending.put(None)
        if thread.is_alive():
            thread.join()
    return traces


def trace_record(trace: RequestTrace, t0: float, request: int) -> dict:
    """A trace as JSON: the request's index in the workload, timestamps in seconds since t0 (the run's start),
    its derived metrics."""
    record = {k: (None if v is None else [t - t0 for t in v] if k == "token_times" else v - t0)
              for k, v in asdict(trace).items() if k in ("arrival", "prefill_start", "prefill_end", "first_token",
                                                          "finish", "token_times")}
    return {"request": request, "prompt_tokens": trace.prompt_tokens,
            "cached_prompt_tokens": trace.cached_prompt_tokens, "output_tokens": trace.output_tokens, **record,
            "ttft_ms": 1e3 * trace.ttft, "tpot_ms": None if trace.tpot is None else 1e3 * trace.tpot,
            "e2e_ms": 1e3 * trace.e2e, "queue_ms": 1e3 * trace.queue, "prefill_ms": 1e3 * trace.prefill_seconds}


def report(settings: dict, runs: dict[str, list[RequestTrace | None]], slo: dict | None = None,
           failures: dict[str, list[dict]] | None = None, lateness: dict[str, list[float]] | None = None) -> dict:
    """{settings, machine, backends: {name: {summary, traces, failed, errors[, send_lateness_ms]}}}; the first
    backend is the reference for ratios. runs: each backend's traces in request order (run_workload's: None for a
    failed request); failures and lateness: run_workload's, per backend. The duration runs from the run's start (its
    first arrival; with Poisson arrivals, settings' arrival_offsets_s, the first gap before it, as vLLM's
    benchmark_duration) to the last request's end, failed ones included (vLLM's bench: the whole run's wall time): a
    failure late in the run is part of it."""
    offsets = settings.get("arrival_offsets_s") or [0.0]
    backends = {}
    for name, traces in runs.items():
        completed = [(index, trace) for index, trace in enumerate(traces) if trace is not None]
        failed = (failures or {}).get(name, [])
        starts = [t.arrival for _, t in completed] + [f["arrival"] for f in failed if f.get("arrival") is not None]
        ends = [t.finish for _, t in completed] + [f["failed"] for f in failed if f.get("failed") is not None]
        t0 = min(starts) - offsets[0]  # request 0 arrives first, at the start + offsets[0]
        errors = [{**f, **{key: f[key] - t0 for key in ("arrival", "failed") if f.get(key) is not None}}
                  for f in failed[:10]]
        backends[name] = {"summary": summarize([t for _, t in completed], duration=max(ends) - t0, slo=slo,
                                               failed=len(failed)),
                          "failed": len(failed), "errors": errors,
                          "traces": [trace_record(t, t0, index) for index, t in completed]}
        if (lateness or {}).get(name):
            late = 1e3 * np.asarray(lateness[name])
            backends[name]["send_lateness_ms"] = {"p50": float(np.percentile(late, 50)),
                                                  "p99": float(np.percentile(late, 99)), "max": float(late.max())}
    return {"settings": settings, "machine": machine(), "backends": backends}


def late_sends(entry: dict) -> str | None:
    """A warning where a Poisson run's requests were sent late enough to matter: a request's arrival is its scheduled
    time, so the runner's lateness (its thread shares the server's process) counts in TTFT and queueing."""
    late, ttft = entry.get("send_lateness_ms"), entry["summary"]["ttft_ms"]["median"]
    if late is None or late["p99"] <= max(1.0, 0.1 * ttft):
        return None
    return (f"the runner sent requests late (p99 {late['p99']:.1f} ms, max {late['max']:.1f} ms after their scheduled "
            f"arrival, against a median TTFT of {ttft:.1f} ms): a busy host or a --rate the runner cannot keep; TTFT "
            f"and queueing include it")


ISA_FLAGS = {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile"}  # MLAS picks kernels by


def machine() -> dict:
    """What a run's numbers depend on besides its settings: the CPU and its vector extensions (onnxruntime's
    kernels), the huge-pages mode, the Python and onnxruntime versions."""
    import os
    import platform

    from runtime.huge_pages import thp_mode

    cpuinfo = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                cpuinfo.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(cpuinfo.get("flags", "").split())
    try:
        import onnxruntime
        runtime_version = onnxruntime.__version__
    except ImportError:
        runtime_version = None
    return {"cpu": cpuinfo.get("model name") or platform.processor(), "cpu_count": os.cpu_count(),
            "usable_cpus": usable_cpus(), "cgroup_cpu_quota": cgroup_cpu_quota(),  # a container's share of them
            "cpu_family_model": f"{cpuinfo.get('cpu family', '?')}/{cpuinfo.get('model', '?')}",
            "isa_flags": sorted(flags & ISA_FLAGS),
            "transparent_hugepage": thp_mode(), "platform": platform.platform(), "python": platform.python_version(),
            "onnxruntime": runtime_version}


def compare_table(result: dict):
    """One row per backend: TTFT, TPOT, E2E p50/p99 (ms), output tok/s, and ratios to the first backend's."""
    from rich.table import Table

    summaries = {name: entry["summary"] for name, entry in result["backends"].items()}
    ref_name, ref = next(iter(summaries.items()))
    # A closed loop sends a client's next request when its last one ends: the send times follow each backend.
    sent = {"all": ", the same send times", "poisson": ", the same send times",
            "concurrency": ", each sent as its client's last request ended"}.get(result["settings"].get("arrival"), "")
    # aotlm serves through its scheduler; the baselines have no scheduler here and serve one request at a time, so
    # their TTFT includes waiting for the requests before them and their TPOT is a one-row step's.
    slots = result["settings"].get("slots")
    peers = [name for name in result["settings"].get("baselines") or () if name in summaries]
    served = f"; aotlm: {slots} slots, {', '.join(peers)}: one request at a time" if slots and peers else ""
    table = Table(title=f"{ref['requests']} requests per backend: same prompt ids and output lengths{sent}{served}")
    for column in ("backend", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "E2E p99", "out tok/s",
                   "queued", f"TTFT p50 / {ref_name}", f"TPOT p50 / {ref_name}", f"tok/s / {ref_name}"):
        table.add_column(column, justify="left" if column == "backend" else "right")
    for name, s in summaries.items():
        cells = [s[f"{m}_ms"][stat] for m in ("ttft", "tpot", "e2e") for stat in ("median", "p99")]
        ratios = [s[f"{m}_ms"]["median"] / ref[f"{m}_ms"]["median"] if s[f"{m}_ms"]["median"] and ref[f"{m}_ms"][
            "median"] else None for m in ("ttft", "tpot")] + [s["output_tokens_per_s"] / ref["output_tokens_per_s"]]
        table.add_row(name, *("-" if c is None else f"{c:.{2 if c < 10 else 1}f}" for c in cells), f"{s['output_tokens_per_s']:.1f}",
                      f"{s['queued_share']:.0%}", *("-" if r is None else f"{r:.2f}x" for r in ratios))
    table.caption = ("latencies in ms (p50 = median); a ratio > 1 is slower for latencies, faster for tok/s; queued: the "
                     "part of the run some request waited (high in both: tok/s compares capacities)")
    return table


def write_outputs(result: dict, out: Path) -> list[Path]:
    """The JSON at `out`, then two PNGs beside it: <stem>-cdf.png (TTFT, TPOT) and <stem>-timeline.png. A previous
    run's plots go first: a run stopped (or without matplotlib) between the JSON and its plots left the old ones
    beside the new JSON, looking like its own."""
    if is_stream(out):  # "-", /dev/stdout, a pipe: the JSON alone (plots beside a stream have no place)
        return [write_json(out, result)]
    out = Path(out)
    for old_plot in (out.with_name(f"{out.stem}-cdf.png"), out.with_name(f"{out.stem}-timeline.png")):
        old_plot.unlink(missing_ok=True)
    out = write_json(out, result)
    backends = result["backends"]
    panels = {f"{metric} CDF (requests)": {name: [t[key] for t in entry["traces"] if t[key] is not None]
                                           for name, entry in backends.items()}
              for metric, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))}  # no TPOT: every output had one token
    cdf = write_cdf_plot(out.with_name(f"{out.stem}-cdf.png"), panels, "ms")
    if cdf is None:
        raise BenchError(f"wrote {out}; {PLOT_SKIPPED}")
    import matplotlib.pyplot as plt

    timeline = out.with_name(f"{out.stem}-timeline.png")
    n = max(len(entry["traces"]) + entry.get("failed", 0) for entry in backends.values())
    figure, axes = plt.subplots(len(backends), 1, squeeze=False, figsize=(11, len(backends) * (1.2 + 0.22 * min(n, 60))))
    for axis, (name, entry) in zip(axes[:, 0], backends.items()):
        # each row at its request's index: a failed request has no trace, and its row shows its failure (the first
        # ten's, as `errors` keeps them) or stays empty, so later rows keep their numbers
        rows = np.array([t["request"] for t in entry["traces"]])
        marks = {key: np.array([t[key] for t in entry["traces"]]) for key in ("arrival", "prefill_start", "first_token")}
        marks["last_token"] = np.array([t["token_times"][-1] for t in entry["traces"]])
        for (start, end), color, label in ((("arrival", "prefill_start"), "lightgray", "queue"),
                                           (("prefill_start", "first_token"), "tab:orange", "prefill"),
                                           (("first_token", "last_token"), "tab:blue", "decode")):
            axis.barh(rows, marks[end] - marks[start], left=marks[start], height=0.8, color=color, label=label)
        failed = [e for e in entry.get("errors", []) if e.get("arrival") is not None and e.get("failed") is not None]
        if failed:
            axis.barh([e["request"] for e in failed], [e["failed"] - e["arrival"] for e in failed],
                      left=[e["arrival"] for e in failed], height=0.8, color="tab:red", label="failed")
        last_row = max([*rows.tolist(), *(e["request"] for e in entry.get("errors", []))], default=0)
        axis.set_ylim(last_row + 0.5, -0.5)  # request 0 on top
        axis.set(title=name, xlabel="seconds since the run's start", ylabel="request")
        axis.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        axis.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    save_figure(figure, timeline)
    plt.close("all")
    return [out, cdf, timeline]


PLOT_SKIPPED = f"plot skipped: matplotlib is not installed ({pip_install(repr('aotlm[bench]'))})"


def write_cdf_plot(path: Path, panels: dict[str, dict[str, Sequence[float]]], xlabel: str) -> Path | None:
    """One PNG of empirical CDFs: a panel per title, a line per label (values in the unit `xlabel` names). The
    distributions a table reduces to percentiles. None without matplotlib (the bench extra): the results written
    before it stand, and the caller says the plot was skipped (PLOT_SKIPPED)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), squeeze=False, figsize=(5.5 * len(panels), 4.2))
    for axis, (title, series) in zip(axes[0], panels.items()):
        for label, values in series.items():
            values = np.sort(np.asarray(values, dtype=float))
            axis.step(values, np.arange(1, values.size + 1) / max(values.size, 1), where="post",
                      label=f"{label} ({values.size})")
        if not any(len(values) for values in series.values()):
            axis.text(0.5, 0.5, "no values", ha="center", transform=axis.transAxes)
        axis.set(xlabel=xlabel, ylabel="fraction", ylim=(0, 1.02), title=title)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)
    return Path(path)


def save_figure(figure, path: Path) -> None:
    """figure as a PNG at path, or no file there: a full disk left a cut-short PNG, and an error naming no file."""
    try:
        figure.savefig(path, dpi=110)
    except OSError as problem:
        Path(path).unlink(missing_ok=True)
        problem.filename = problem.filename or str(path)
        raise


def write_phase_plot(rows: list[dict], phase: str, out: Path) -> Path | None:
    """<stem>-steps.png beside `out`: the distribution of each size's timed runs (prefill) or steps (decode)."""
    key, size, unit = ("runs_ms", "prompt_tokens", "prompt") if phase == "prefill" else ("steps_ms", "context", "context")
    series = {f"{unit} {row[size]}": row[key] for row in rows}
    title = f"{phase}, batch {rows[0]['batch']}: " + ("each timed run" if phase == "prefill" else "each timed step")
    return write_cdf_plot(Path(out).with_name(f"{Path(out).stem}-steps.png"), {title: series}, "ms")


# -- the graphs alone ---------------------------------------------------------------------------------------------
DECODE_WARMUP_STEPS = 4


def time_phase(engine, phase: str, sizes: Sequence[int], prompt_ids: list[int], *, batch: int = 1, runs: int = 5,
               steps: int = 32, warmup: int = DECODE_WARMUP_STEPS, flops_for, peaks: dict,
               weight_bytes_per_step: float | None = None) -> list[dict]:
    """Prefill: median of `runs` runs (after one warm-up) per prompt length; achieved FLOP/s = flops_for(tokens) / s.
    Decode: the cache filled with C real tokens by one prefill, `warmup` steps, then `steps` timed steps (graph +
    greedy choice) per context C; achieved (weight_bytes_per_step + KV bytes/token x C x batch) / step, bytes/s.
    weight_bytes_per_step: what a step reads of the weights (`compiler.plan.artifact_step_weight_bytes`: an
    embedding table it only gathers rows from left out); the manifest's whole weights file when not given.
    `peaks`: this machine's {"flops": .., "bandwidth": ..}, measured by the caller."""
    backend, limit, manifest = engine.backend, engine.max_context, engine.manifest
    if weight_bytes_per_step is None:  # the whole weights file; unknown where the engines hold them (TensorRT)
        weight_bytes_per_step = (manifest["backend"].get("weights") or {}).get("bytes")
    extra = 0 if phase == "prefill" else warmup + steps
    for size in sizes:
        if size < 1 or size + extra > limit or size > len(prompt_ids):
            also = f" with --steps ({steps}) + {warmup} warm-up steps after it" if extra else ""
            raise BenchError(f"{phase} at {size} tokens{also} does not fit this artifact's max context ({limit}); "
                             f"give sizes up to {limit - extra}" + (", or fewer --steps" if extra else ""))
    for flag, value in (("--batch", batch), ("--runs", runs), ("--steps", steps)):
        if value < 1:
            raise BenchError(f"{flag} must be >= 1, got {value}")
    largest = getattr(backend, "max_batch", None)
    if largest is not None and batch > largest:  # TensorRT's profiles bound a run's rows (onnxruntime's: None)
        raise BenchError(f"--batch {batch} exceeds the {largest} sequences these engines run at once "
                         f"(export.max_batch); use at most {largest}, or rebuild with a larger max_batch")

    def run(graph: str, ids: np.ndarray, start: int) -> tuple[float, np.ndarray]:  # -> seconds, next tokens
        positions = np.tile(np.arange(start, start + ids.shape[1], dtype=np.int64), (batch, 1))
        started = time.perf_counter()
        logits = backend.run(graph, ids, positions, mask[:, : start + ids.shape[1]])
        tokens = logits.reshape(batch, -1, logits.shape[-1])[:, -1].argmax(-1)  # [batch, (seq,) vocab]
        return time.perf_counter() - started, tokens.reshape(batch, 1).astype(np.int64)

    rows = []
    with engine.batch_one():  # the engine's own cache: its generate/stream calls wait meanwhile
        backend.allocate_cache(batch=batch)  # first: it refuses a batch whose cache the memory cannot hold
        mask = np.ones((batch, limit), dtype=np.int64)
        try:
            for size in sizes:
                prompt = np.array([prompt_ids[:size]] * batch, dtype=np.int64)
                if phase == "prefill":
                    times = [run("prefill", prompt, 0)[0] for _ in range(runs + 1)][1:]
                    seconds = float(np.median(times))
                    flops = flops_for(size) * batch / seconds
                    rows.append({"prompt_tokens": size, "batch": batch, "median_ms": 1e3 * seconds,
                                 "tokens_per_s": size * batch / seconds, "flops_per_s": flops,
                                 "fraction_of_peak": flops / peaks["flops"], "runs_ms": [1e3 * t for t in times]})
                    continue
                _, tokens = run("prefill", prompt, 0)
                times = []
                for step in range(warmup + steps):
                    elapsed, tokens = run("decode", tokens, size + step)
                    times += [elapsed] if step >= warmup else []
                seconds = float(np.median(times))
                moved = (None if weight_bytes_per_step is None else
                         weight_bytes_per_step + manifest["kv_cache"]["bytes_per_token"] * size * batch)
                rows.append({"context": size, "batch": batch, "median_ms": 1e3 * seconds,
                             "p90_ms": 1e3 * float(np.percentile(times, 90)), "tokens_per_s": batch / seconds,
                             "bytes_per_step": moved, "bytes_per_s": None if moved is None else moved / seconds,
                             "fraction_of_peak": None if moved is None else moved / seconds / peaks["bandwidth"],
                             "steps_ms": [1e3 * t for t in times]})
        finally:
            backend.allocate_cache(batch=1)  # the engine's own requests run at batch 1
    return rows


def phase_table(phase: str, rows: list[dict], peaks: dict):
    from rich.table import Table

    prefill = phase == "prefill"
    peak = f"{peaks['flops'] / 1e9:.1f} GFLOP/s" if prefill else f"{peaks['bandwidth'] / 1e9:.1f} GB/s"
    table = Table(title=f"{phase}, batch {rows[0]['batch']}: achieved vs this machine's measured peak ({peak})")
    columns = ([("prompt tokens", "prompt_tokens", 1, "d"), ("median ms", "median_ms", 1, ".1f"),
                ("tok/s", "tokens_per_s", 1, ".0f"), ("GFLOP/s", "flops_per_s", 1e-9, ".1f")] if prefill else
               [("context", "context", 1, "d"), ("median ms/step", "median_ms", 1, ".2f"), ("p90 ms", "p90_ms", 1, ".2f"),
                ("tok/s", "tokens_per_s", 1, ".1f"), ("MB read/step", "bytes_per_step", 1e-6, ".0f"),
                ("GB/s", "bytes_per_s", 1e-9, ".1f")]) + [("% of peak", "fraction_of_peak", 100, ".0f")]
    for header, *_ in columns:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*("-" if row[key] is None else format(row[key] * scale if scale != 1 else row[key], spec)
                        for _, key, scale, spec in columns))
    table.caption = ("FLOPs as `aotlm plan` counts them: the projections for every prompt token (the last layer's on "
                     "the returned rows only, with skip_unused_rows), causal attention (scores and weighted sum) and "
                     "the output projection for the returned positions" if prefill else
                     "bytes = the weights a step reads (as `aotlm plan` counts them: not an embedding table it only "
                     "gathers rows from) + KV bytes/token x context, per step (activations not counted)")
    return table
