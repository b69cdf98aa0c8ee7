"""The server's counters and latency histograms, and the scheduler's load, in Prometheus' text format (GET /metrics),
so that the dashboards and alerts serving engineers keep for vLLM work here too (the names follow vLLM's, prefixed
`aotlm:`). Written out by hand: the format is a few lines of text, and the runtime stays free of a client library.

Token counters are the scheduler's, moving as tokens are made (a long request's too, a cancelled one's included).
Per finished choice (one scheduler request) the latencies are the engine's own (runtime/metrics.py, vLLM's
definitions), in seconds: TTFT, E2E and queue time once per request; every gap between its tokens
(inter_token_latency_seconds, and again under vLLM's older name for the same gaps, time_per_output_token_seconds);
its mean gap once per request of two tokens or more (request_time_per_output_token_seconds); its prompt's and its
output's lengths in tokens (vLLM's request_prompt_tokens and request_generation_tokens, in 1-2-5 buckets up to the
engine's context). Per HTTP request: its route and status. Gauges are read when scraped: requests running and waiting, the scheduler's slots.
"""
from __future__ import annotations

import bisect
import threading

from runtime.results import GenerationResult

# Seconds; vLLM's TTFT buckets, which span a CPU's slow prefills too.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0, 640.0, 2560.0)
HISTOGRAMS = {
    "time_to_first_token_seconds": "Time to first token: request received to its first token chosen.",
    "inter_token_latency_seconds": "Time between two consecutive tokens of a request: every gap.",
    "time_per_output_token_seconds": "The gaps of inter_token_latency_seconds, under vLLM's older name for them.",
    "request_time_per_output_token_seconds": "Mean time per output token after the first, once per request.",
    "e2e_request_latency_seconds": "Request received to its last token chosen.",
    "request_queue_time_seconds": "Request received to its prefill's start.",
    # vLLM's request phases: prefill (its start to the prefill run's end), decode (first token to last) and both
    "request_prefill_time_seconds": "The prefill's start to its end (the prompt's graph runs).",
    "request_decode_time_seconds": "First token to last.",
    "request_inference_time_seconds": "The prefill's start to the last token.",
}
LENGTH_HISTOGRAMS = {  # tokens per request (choice), bucketed 1, 2, 5, 10, 20, 50, ... up to the context (vLLM's)
    "request_prompt_tokens": "Prompt tokens of a request, a cached prefix included.",
    "request_generation_tokens": "Tokens a request generated (a final stop token included).",
}
FINISHED_REASONS = {"cancelled": "abort"}  # a result's finish_reason as vLLM's request_success_total labels it
COUNTERS = {  # the scheduler's counts (Scheduler.token_counts), as the tokens are made: a running request's count
    "prompt_tokens_total": "Prompt tokens of requests that made their first token.",
    "generation_tokens_total": "Tokens generated, as they are (a final stop token included).",
    # vLLM's names: dashboards take the hit rate as hits / queries
    "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache (with prefix caching on).",
    "prefix_cache_hits_total": "Prompt tokens of those found in the cache, reused instead of prefilled.",
}


def length_buckets(max_context: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... while <= max_context (vLLM's build_1_2_5_buckets)."""
    bounds, power = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * power > max_context:
                return tuple(bounds)
            bounds.append(mantissa * power)
        power *= 10


class _Histogram:
    def __init__(self, bounds: tuple):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bucket (+Inf only)
        self.sum = 0

    def observe(self, value) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class ServerMetrics:
    """Thread-safe: every connection's thread records into it."""

    def __init__(self, max_context: int):
        self._lock = threading.Lock()
        self._histograms = {name: _Histogram(LATENCY_BUCKETS) for name in HISTOGRAMS}
        self._histograms.update({name: _Histogram(length_buckets(max_context)) for name in LENGTH_HISTOGRAMS})
        self._requests: dict[tuple[str, int], int] = {}  # (route, status) -> HTTP requests answered
        self._finished: dict[str, int] = {}  # finished_reason -> requests (choices) that ended so
        self._failures = 0  # requests (choices) that failed: a graph run raised, the server stopped
        self._refused_connections = 0  # at --max-connections, or no thread could start: answered 503 and closed

    def answered(self, route: str, status: int) -> None:
        with self._lock:
            self._requests[route, status] = self._requests.get((route, status), 0) + 1

    def refused_connection(self) -> None:
        with self._lock:
            self._refused_connections += 1

    def ended(self, handle) -> None:
        """A request's outcome, from its handle once done (a done-callback): a failure, or its result."""
        error = handle.exception()
        if error is not None:
            with self._lock:
                self._failures += 1
            return
        self.finished(handle.result())

    def finished(self, result: GenerationResult) -> None:
        reason = FINISHED_REASONS.get(result.finish_reason, result.finish_reason)
        with self._lock:
            self._finished[reason] = self._finished.get(reason, 0) + 1
            if result.timings is None:  # cancelled before its first token
                return
            trace = result.timings.trace
            self._histograms["request_prompt_tokens"].observe(trace.prompt_tokens)
            self._histograms["request_generation_tokens"].observe(trace.output_tokens)
            self._histograms["time_to_first_token_seconds"].observe(trace.ttft)
            self._histograms["e2e_request_latency_seconds"].observe(trace.e2e)
            self._histograms["request_queue_time_seconds"].observe(trace.queue)
            self._histograms["request_prefill_time_seconds"].observe(trace.prefill_seconds)
            self._histograms["request_decode_time_seconds"].observe(trace.token_times[-1] - trace.first_token)
            self._histograms["request_inference_time_seconds"].observe(trace.token_times[-1] - trace.prefill_start)
            if trace.tpot is not None:
                self._histograms["request_time_per_output_token_seconds"].observe(trace.tpot)
            for gap in trace.itl:
                self._histograms["inter_token_latency_seconds"].observe(gap)
                self._histograms["time_per_output_token_seconds"].observe(gap)

    def render(self, model_name: str, scheduler, in_progress: int = 0) -> str:
        """The exposition text; scheduler: the engine's (its gauges), or None before the first request;
        in_progress: the server's requests being answered."""
        label = f'model_name="{_escaped(model_name)}"'
        lines = []
        running, waiting = scheduler.counts() if scheduler is not None else (0, 0)
        made = scheduler.token_counts() if scheduler is not None else {}
        for name, value, text in (("num_requests_running", running, "Requests in a KV-cache slot."),
                                  ("num_requests_waiting", waiting, "Requests waiting for a slot."),
                                  ("kv_cache_slots", scheduler.slots if scheduler is not None else 0,
                                   "Sequences the scheduler's KV cache holds at once."),
                                  ("kv_cache_usage_perc", running / scheduler.slots if scheduler is not None else 0.0,
                                   "The KV cache's slots in use, 0 to 1 (vLLM's name; its blocks are slots here)."),
                                  ("http_requests_in_progress", in_progress,
                                   "HTTP requests (POSTs) being answered, bodies still arriving included.")):
            lines += [f"# HELP aotlm:{name} {text}", f"# TYPE aotlm:{name} gauge", f"aotlm:{name}{{{label}}} {value}"]
        with self._lock:
            lines += ["# HELP aotlm:http_requests_total HTTP requests answered, by route and status.",
                      "# TYPE aotlm:http_requests_total counter"]
            for (route, status), count in sorted(self._requests.items()):
                lines.append(f'aotlm:http_requests_total{{{label},route="{_escaped(route)}",status="{status}"}} '
                             f'{count}')
            lines += ["# HELP aotlm:request_success_total Requests (each choice) that ended, by finished_reason "
                      "(stop, length; abort: cancelled, the client left).",
                      "# TYPE aotlm:request_success_total counter"]
            for reason, count in sorted(self._finished.items()):
                lines.append(f'aotlm:request_success_total{{{label},finished_reason="{_escaped(reason)}"}} {count}')
            lines += ["# HELP aotlm:request_failure_total Requests (each choice) that failed in the scheduler.",
                      "# TYPE aotlm:request_failure_total counter", f"aotlm:request_failure_total{{{label}}} "
                      f"{self._failures}",
                      "# HELP aotlm:http_connections_refused_total Connections answered 503 and closed unread: "
                      "--max-connections were open, or no thread could start.",
                      "# TYPE aotlm:http_connections_refused_total counter",
                      f"aotlm:http_connections_refused_total{{{label}}} {self._refused_connections}"]
            for name, text in COUNTERS.items():
                lines += [f"# HELP aotlm:{name} {text}", f"# TYPE aotlm:{name} counter",
                          f"aotlm:{name}{{{label}}} {made.get(name.removesuffix('_total'), 0)}"]
            for name, text in {**HISTOGRAMS, **LENGTH_HISTOGRAMS}.items():
                histogram = self._histograms[name]
                lines += [f"# HELP aotlm:{name} {text}", f"# TYPE aotlm:{name} histogram"]
                cumulative = 0
                for bound, count in zip(histogram.bounds, histogram.counts):
                    cumulative += count
                    lines.append(f'aotlm:{name}_bucket{{{label},le="{bound}"}} {cumulative}')
                total = cumulative + histogram.counts[-1]
                lines += [f'aotlm:{name}_bucket{{{label},le="+Inf"}} {total}',
                          f"aotlm:{name}_sum{{{label}}} {histogram.sum!r}", f"aotlm:{name}_count{{{label}}} {total}"]
        return "\n".join(lines) + "\n"


def _escaped(value: str) -> str:
    """A label value as the text format escapes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
