"""Per-request latency traces and benchmark summaries, with vLLM's metric definitions (`vllm bench serve`).

A `RequestTrace` holds raw time.perf_counter timestamps (seconds) for one request; every metric is derived from
them here, once, so the engine, the CLI and the benchmarks agree. Per request (seconds; `t_i` = token_times[i],
N = output_tokens, the first token and a final stop token included):

    ttft   = first_token - arrival                  queueing + tokenization + prefill + first sampling
    queue  = prefill_start - arrival                waiting, tokenization, cache setup: everything before prefill
    e2e    = t_{N-1} - arrival                      to the LAST OUTPUT TOKEN, not to `finish` (see below)
    tpot   = (e2e - ttft) / (N - 1)                 None when N == 1 (see below)
    itl    = [t_i - t_{i-1} for i in 1..N-1]        every gap between consecutive tokens; sum(itl) == e2e - ttft
    prefill_seconds      = prefill_end - prefill_start   (first_token - prefill_start when prefill_end is absent,
                           which then includes sampling the first token)
    prefill_tokens_per_s = (prompt_tokens - cached_prompt_tokens) / prefill_seconds   (a cached prefix is not computed)
    decode_seconds_per_step         = mean(decode_step_s) if per-step durations were recorded, else
                                      (t_{N-1} - t_0) / (N - 1)  (one token per step: equals tpot)
    decode_seconds_per_output_token = sum(decode_step_s) / (N - 1) if recorded, else tpot

Choices, stated:
- E2E ends at the last output token, as a streaming client's latency does in vLLM (its stream ends with the last
  chunk). `finish` (the request fully done: final detokenization and stop-string trimming) is kept in the trace
  and bounds the benchmark duration, but is not a latency metric. With this choice TPOT is exactly the mean ITL.
- TPOT of a one-token output is undefined (there is no decode interval): `tpot` is None and the request is left
  out of TPOT statistics, as vLLM leaves it out of its `tpots`. For goodput, vLLM counts it as 0 (it always meets
  a TPOT SLO); so do we. (`runtime.results.Timings.tpot_s` reports 0.0 for compatibility.)
- ITL is pooled across requests (every gap of every request is one sample), as in vLLM.
- Percentiles: numpy's default `np.percentile` (method="linear": linear interpolation between closest ranks),
  as vLLM. E.g. [1, 2, 3, 4] -> p50 2.5, p99 3.97. Median == p50.
- Throughput over the benchmark duration, by default first arrival -> last finish (`aotlm bench` passes the run's
  start instead, which a Poisson run's first gap precedes, as vLLM's benchmark_duration): output tokens/s, total
  (prompt + output) tokens/s, requests/s. Goodput: requests/s (and the fraction of requests) meeting every
  given SLO, `slo={"ttft_ms": .., "tpot_ms": .., "e2e_ms": ..}`, a request meets a limit when metric <= limit.
- queued_share (ours, not vLLM's): the part of first arrival -> last finish (not of a duration passed in) during
  which at least one request
  had arrived and not begun its prefill. Near 1 the server was the bottleneck throughout, and tokens/s is its
  capacity; well below 1 it served requests as they came, and tokens/s is the arrival rate. Two servers compared
  on throughput are compared on capacity only if both shares are high (benchmarks/batching.py once compared a
  continuous scheduler that had queued for 29-52% of its runs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

PERCENTILES = (50, 90, 95, 99)  # np.percentile, linear interpolation
STATS = ("mean", "median", "p90", "p95", "p99", "max")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e", "queue", "prefill")  # summary keys: "<name>_ms"
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


@dataclass
class RequestTrace:
    """Raw timestamps of one request (seconds, time.perf_counter clock) and its token counts."""

    arrival: float  # the request was received (Engine.stream called)
    prefill_start: float
    first_token: float  # the first output token was chosen; == token_times[0]
    token_times: list[float]  # one per output token, the first included
    finish: float  # the request is complete (after the last token and any post-processing)
    prompt_tokens: int
    output_tokens: int  # every token produced, a final stop token included; == len(token_times)
    prefill_end: float | None = None  # the prefill graph run returned (before sampling the first token)
    decode_step_s: list[float] | None = None  # optional per-step decode durations (seconds)
    cached_prompt_tokens: int = 0  # the prompt's first tokens found in the cache (prefix caching): not prefilled

    def __post_init__(self) -> None:
        if self.output_tokens < 1 or len(self.token_times) != self.output_tokens:
            raise ValueError(f"a trace needs one token time per output token (>= 1): output_tokens="
                             f"{self.output_tokens}, {len(self.token_times)} token times")
        if self.token_times[0] != self.first_token:
            raise ValueError(f"token_times[0] ({self.token_times[0]}) must be first_token ({self.first_token})")
        if not self.arrival <= self.prefill_start <= self.first_token <= self.token_times[-1] <= self.finish:
            raise ValueError("timestamps out of order: need arrival <= prefill_start <= first_token "
                             "<= last token time <= finish")

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def queue(self) -> float:
        return self.prefill_start - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itl(self) -> list[float]:
        times = self.token_times
        return [times[i] - times[i - 1] for i in range(1, len(times))]

    @property
    def prefill_seconds(self) -> float:
        return (self.first_token if self.prefill_end is None else self.prefill_end) - self.prefill_start

    @property
    def prefill_tokens_per_s(self) -> float | None:
        seconds = self.prefill_seconds  # over the tokens computed: a cached prefix is not
        return (self.prompt_tokens - self.cached_prompt_tokens) / seconds if seconds > 0 else None

    @property
    def decode_seconds_per_step(self) -> float | None:
        if self.decode_step_s:
            return sum(self.decode_step_s) / len(self.decode_step_s)
        return self.tpot

    @property
    def decode_seconds_per_output_token(self) -> float | None:
        if self.output_tokens < 2:
            return None
        if self.decode_step_s:
            return sum(self.decode_step_s) / (self.output_tokens - 1)
        return self.tpot


def _stats_ms(seconds: Sequence[float]) -> dict:
    """count, mean, median, p90, p95, p99, max in milliseconds (None each when there are no samples)."""
    if len(seconds) == 0:
        return {"count": 0, **{name: None for name in STATS}}
    values = np.asarray(seconds, dtype=np.float64) * 1e3
    p50, p90, p95, p99 = np.percentile(values, PERCENTILES)  # method="linear", numpy's default (as vLLM)
    return {"count": int(values.size), "mean": float(values.mean()), "median": float(p50), "p90": float(p90),
            "p95": float(p95), "p99": float(p99), "max": float(values.max())}


def queued_share(traces: Sequence[RequestTrace]) -> float:
    """The part of first arrival -> last finish during which some request waited (the union of their `queue`
    intervals). A scheduler that admits at the start of its next iteration shows waits of up to one step even
    when it has room."""
    waits = sorted((t.arrival, t.prefill_start) for t in traces)
    span = max(t.finish for t in traces) - waits[0][0]
    covered, reach = 0.0, waits[0][0]
    for start, end in waits:
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered / span if span > 0 else 0.0


def summarize(traces: Sequence[RequestTrace], duration: float | None = None, slo: dict | None = None,
              failed: int = 0) -> dict:
    """Latency statistics (ms), throughput and optional goodput over a benchmark's completed requests.

    duration: seconds the benchmark ran (default: first arrival -> last finish).
    slo: {"ttft_ms": .., "tpot_ms": .., "e2e_ms": ..}, any subset; adds summary["goodput"].
    failed: requests that failed besides these: they meet no SLO (goodput's fraction counts them).
    """
    traces = list(traces)
    if not traces:
        raise ValueError("summarize() needs at least one RequestTrace; got none (did every request fail?)")
    if duration is None:
        duration = max(t.finish for t in traces) - min(t.arrival for t in traces)
    if not duration > 0:
        raise ValueError(f"the benchmark duration must be > 0 seconds, got {duration}")
    prompt_tokens = sum(t.prompt_tokens for t in traces)
    output_tokens = sum(t.output_tokens for t in traces)
    samples = {
        "ttft": [t.ttft for t in traces],
        "tpot": [t.tpot for t in traces if t.tpot is not None],  # one-token outputs have no TPOT
        "itl": [gap for t in traces for gap in t.itl],  # pooled across requests
        "e2e": [t.e2e for t in traces],
        "queue": [t.queue for t in traces],
        "prefill": [t.prefill_seconds for t in traces],
    }
    summary = {
        "requests": len(traces), "failed": failed, "duration_s": float(duration),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "cached_prompt_tokens": sum(t.cached_prompt_tokens for t in traces),  # reused from the cache, not prefilled
        "requests_per_s": len(traces) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / duration,
        "queued_share": queued_share(traces),
    }
    summary.update({f"{name}_ms": _stats_ms(samples[name]) for name in LATENCY_METRICS})
    if slo is not None:
        summary["goodput"] = _goodput(traces, duration, slo, failed)
    return summary


def _goodput(traces: list[RequestTrace], duration: float, slo: dict, failed: int = 0) -> dict:
    unknown = sorted(set(slo) - set(SLO_KEYS))
    if unknown or not slo:
        raise ValueError(f"slo keys must be a non-empty subset of {list(SLO_KEYS)}; got {sorted(slo)}")
    per_request = {  # seconds; a one-token output's TPOT counts as 0 here, as in vLLM
        "ttft_ms": lambda t: t.ttft, "tpot_ms": lambda t: t.tpot or 0.0, "e2e_ms": lambda t: t.e2e,
    }
    good = sum(all(per_request[key](t) <= limit / 1e3 for key, limit in slo.items()) for t in traces)
    return {"slo": dict(slo), "good_requests": good, "fraction": good / (len(traces) + failed),
            "requests_per_s": good / duration}


def format_table(summary: dict):
    """A rich Table of a summarize() result: one row per latency metric, throughput and goodput in the caption."""
    from rich.table import Table  # imported here: building traces and summaries needs only numpy

    def cell(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    cached = summary.get("cached_prompt_tokens")
    table = Table(title=f"{summary['requests']} requests in {summary['duration_s']:.2f} s "
                        f"({summary['prompt_tokens']} prompt"
                        f"{f' ({cached} reused from the cache)' if cached else ''} and "
                        f"{summary['output_tokens']} output tokens in all)")
    table.add_column("metric (ms)")
    for column in ("count", *STATS):
        table.add_column(column, justify="right")
    for name in LATENCY_METRICS:
        stats = summary[f"{name}_ms"]
        table.add_row(name.upper() if name in ("ttft", "tpot", "itl", "e2e") else name, str(stats["count"]),
                      *(cell(stats[stat]) for stat in STATS))
    caption = (f"{summary['requests_per_s']:.2f} req/s, {summary['output_tokens_per_s']:.1f} output tok/s, "
               f"{summary['total_tokens_per_s']:.1f} total tok/s; requests queued {summary['queued_share']:.0%} "
               "of the run")
    if summary.get("failed"):
        caption += f"; {summary['failed']} request(s) failed (not in these figures)"
    if "goodput" in summary:
        goodput = summary["goodput"]
        limits = ", ".join(f"{key} <= {value:g}" for key, value in goodput["slo"].items())
        caption += (f"; goodput {goodput['requests_per_s']:.2f} req/s ({100 * goodput['fraction']:.0f}% "
                    f"of requests meet {limits})")
    table.caption = caption
    return table
