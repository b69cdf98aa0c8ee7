"""Load test of the scheduler: many requests at a fixed concurrency; nothing lost, nothing broken, no memory creep.

    .venv/bin/python benchmarks/load_test.py [--artifact DIR] [--requests 1000] [--concurrency 32] [--slots N]
        [--batching continuous|static] [--cancel-fraction 0.0] [--check 16] [--seed 0] [--out PATH]
        [--prefix-caching] [--shared-prefixes K]

Without --artifact, builds recipes/tiny-random.yaml once under benchmarks/results/cache/ (seconds). A closed loop
keeps --concurrency requests in flight through `Engine.submit`: each completion lets the next request in. Prompts
of 4..48 random token ids, 1..48 output tokens, half greedy, half sampled with their own seed; stop tokens
disabled, so a complete output has exactly the tokens asked. --cancel-fraction of the requests are cancelled
after their first token and must end "cancelled" (or complete, if they finished first). --prefix-caching serves
with Engine.load(prefix_caching=True), and --shared-prefixes K starts each prompt with one of K random 24-token
prefixes (then 4..24 tokens of its own), so that requests find their starts in other slots, running or left; the
greedy requests checked are then re-served alone on an engine without prefix caching. Counted:
    lost         submitted, but no result by the deadline (--timeout)
    errors       refused at submit, or failed
    incomplete   a result that is not "length" with every asked token (or not "cancelled", for a cancelled one)
    mismatched   of the first --check greedy requests, tokens that differ from the same request served alone
    RSS growth   resident memory at the last completion vs at the 100th (10% of --requests if fewer than 1,000)
Passes with 0 lost, 0 errors, 0 incomplete, 0 mismatched and RSS growth under 5%; writes JSON
(benchmarks/results/load-test.json by default); exit status 1 when a requirement fails.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere
from runtime import Engine, RequestError  # noqa: E402
from compiler.console import print_table  # noqa: E402
from runtime.results import write_json  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling arguments.py, run from anywhere
from arguments import artifact_manifest, output_file, require_at_least_one, thread_count  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
MAX_RSS_GROWTH = 0.05


def resident_bytes() -> int:
    """This process's resident set size now (Linux /proc; elsewhere the peak, from getrusage)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tiny_artifact() -> Path:
    """recipes/tiny-random.yaml, built once under benchmarks/results/cache/load-test/."""
    folder = RESULTS / "cache" / "load-test"
    if not (folder / "tiny-random" / "manifest.json").is_file():
        from compiler.build import build
        from compiler.recipe import load_recipe

        return build(load_recipe(REPO / "recipes" / "tiny-random.yaml"), folder)
    return folder / "tiny-random"


SHARED_PREFIX_TOKENS = 24


def make_requests(count: int, vocab: int, max_context: int, seed: int, shared_prefixes: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, vocab, size=SHARED_PREFIX_TOKENS).tolist() for _ in range(shared_prefixes)]
    requests = []
    for index in range(count):
        if prefixes:
            prompt = prefixes[index % len(prefixes)] + rng.integers(3, vocab, size=int(rng.integers(4, 25))).tolist()
        else:
            prompt = rng.integers(3, vocab, size=int(rng.integers(4, 49))).tolist()
        output = min(int(rng.integers(1, 49)), max_context + 1 - len(prompt))
        sampling = {} if index % 2 == 0 else {"temperature": 0.9, "top_k": 40, "seed": index}
        requests.append({"prompt": prompt, "max_new_tokens": output, "sampling": sampling})
    return requests


def cancel_after_first_piece(handle) -> None:
    try:
        next(iter(handle), None)
    except Exception:  # a failed request: counted among the errors by its done callback
        return
    handle.cancel()


FINISH = ("pending", "length", "stop", "cancelled", "max_context", "error")


class Ledger:
    """Per-request outcomes in arrays allocated up front: the harness's own memory does not grow with the requests,
    so the RSS check measures the runtime."""

    def __init__(self, count: int, checked: list[int]):
        self.finish = np.zeros(count, dtype=np.int8)  # index into FINISH
        self.tokens = np.zeros(count, dtype=np.int32)  # returned (token_ids), a final stop token included
        self.timed_tokens = np.zeros(count, dtype=np.int32)  # what its timings counted: must equal tokens
        self.cached = np.zeros(count, dtype=np.int32)  # prompt tokens taken from the cache (prefix caching)
        self.times = np.full((count, 4), np.nan)  # arrival, first token, last token, finish (perf_counter seconds)
        self.rss = np.zeros(count + 1, dtype=np.int64)  # resident bytes when n requests had completed
        self.token_ids: dict[int, list[int] | None] = dict.fromkeys(checked)  # re-served alone afterwards
        self.errors: list[str] = []
        self.completed = 0
        self.lock = threading.Lock()
        self.all_done = threading.Event()

    def record(self, index: int, handle) -> None:
        error = handle.exception()
        with self.lock:
            if error is not None:
                self.finish[index] = FINISH.index("error")
                self.errors.append(repr(error))
            else:
                result = handle.result()
                self.finish[index] = FINISH.index(result.finish_reason)
                self.tokens[index] = len(result.token_ids) + (result.stop_token_id is not None)
                if result.timings is not None:
                    trace = result.timings.trace
                    self.timed_tokens[index] = trace.output_tokens
                    self.cached[index] = trace.cached_prompt_tokens
                    self.times[index] = trace.arrival, trace.first_token, trace.token_times[-1], trace.finish
                if index in self.token_ids:
                    self.token_ids[index] = result.token_ids
            self.count_one()

    def refuse(self, index: int, error: Exception) -> None:
        with self.lock:
            self.finish[index] = FINISH.index("error")
            self.errors.append(f"refused: {error}")
            self.count_one()

    def count_one(self) -> None:  # the lock is held
        self.completed += 1
        self.rss[self.completed] = resident_bytes()
        if self.completed == self.finish.size:
            self.all_done.set()


def run(engine: Engine, requests: list[dict], ledger: Ledger, *, concurrency: int, cancel: set[int],
        timeout: float) -> float:
    """Closed loop at `concurrency`: each completion lets the next request in. Returns the seconds it took."""
    slots_free = threading.Semaphore(concurrency)

    def finished(index: int, handle) -> None:
        ledger.record(index, handle)
        slots_free.release()

    started = time.perf_counter()
    for index, request in enumerate(requests):
        slots_free.acquire()
        try:
            handle = engine.submit(request["prompt"], max_new_tokens=request["max_new_tokens"], ignore_eos=True,
                                   **request["sampling"])
        except RequestError as error:
            ledger.refuse(index, error)
            slots_free.release()
            continue
        if index in cancel:  # after its first token, from a thread of its own, as a client would
            threading.Thread(target=cancel_after_first_piece, args=(handle,), daemon=True).start()
        handle.add_done_callback(lambda h, index=index: finished(index, h))
    ledger.all_done.wait(timeout)
    return time.perf_counter() - started


def judge(engine: Engine, requests: list[dict], ledger: Ledger, cancel: set[int]) -> dict:
    """engine: serves the checked requests alone (the batch-1 path), the reference for their tokens."""
    finish = [FINISH[code] for code in ledger.finish]
    asked = [r["max_new_tokens"] for r in requests]
    # what the request returned, and what its timings counted (the figures the summary reports) agree with it
    complete = lambda i: finish[i] == "length" and ledger.tokens[i] == ledger.timed_tokens[i] == asked[i]  # noqa: E731
    cancelled_early = lambda i: i in cancel and finish[i] == "cancelled" and ledger.tokens[i] < asked[i]  # noqa: E731
    done = [i for i, f in enumerate(finish) if f not in ("pending", "error")]
    mismatched = [i for i, ids in ledger.token_ids.items() if ids is not None and ids != engine.generate(
        requests[i]["prompt"], max_new_tokens=asked[i], ignore_eos=True).token_ids]
    return {"lost": [i for i, f in enumerate(finish) if f == "pending"],
            "errors": [i for i, f in enumerate(finish) if f == "error"],
            "incomplete": [i for i in done if not (complete(i) or cancelled_early(i))],
            "checked": sum(ids is not None for ids in ledger.token_ids.values()), "mismatched": mismatched,
            "cancelled": finish.count("cancelled")}


def latency_summary(ledger: Ledger) -> dict | None:
    """Output tokens/s over first arrival -> last finish; TTFT and TPOT p50/p99 in ms (vLLM's definitions), over
    the requests that finished (length, stop or the context's end): a cancelled one's partial tokens, its TTFT and
    its cancel time would count as served work (vLLM counts successful requests only)."""
    finished = np.isin(ledger.finish, [FINISH.index(reason) for reason in ("length", "stop", "max_context")])
    timed = ~np.isnan(ledger.times[:, 0]) & finished
    if not timed.any():
        return None
    times, tokens = ledger.times[timed], ledger.tokens[timed]
    duration = np.nanmax(times[:, 3]) - np.nanmin(times[:, 0])
    ttft = 1e3 * (times[:, 1] - times[:, 0])
    many = tokens > 1
    tpot = 1e3 * (times[many, 2] - times[many, 1]) / (tokens[many] - 1)
    stats = lambda values: {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))} \
        if values.size else {"p50": None, "p99": None}  # noqa: E731
    return {"duration_s": float(duration), "output_tokens": int(tokens.sum()),
            "output_tokens_per_s": float(tokens.sum() / duration), "ttft_ms": stats(ttft), "tpot_ms": stats(tpot)}


def main(argv: list[str] | None = None, console: Console | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default=None, help="default: recipes/tiny-random.yaml, built once")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--slots", type=int, default=None, help="cache slots (default: --concurrency)")
    parser.add_argument("--batching", choices=("continuous", "static"), default="continuous")
    parser.add_argument("--cancel-fraction", type=float, default=0.0, help="requests cancelled after one token")
    parser.add_argument("--check", type=int, default=16, help="greedy requests re-served alone and compared")
    parser.add_argument("--threads", type=thread_count, default=None, help="intra-op threads (default: onnxruntime's)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every result")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-caching", action="store_true", help="serve with Engine.load(prefix_caching=True)")
    parser.add_argument("--shared-prefixes", type=int, default=0, metavar="K",
                        help=f"prompts begin with one of K {SHARED_PREFIX_TOKENS}-token prefixes (default 0: none)")
    parser.add_argument("--out", default=str(RESULTS / "load-test.json"))
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the work, not a traceback after it
    require_at_least_one(parser, args, "--requests", "--concurrency")
    if args.slots is not None and args.slots < 1:
        parser.error(f"--slots must be >= 1, got {args.slots}")
    if not 0 <= args.cancel_fraction <= 1:
        parser.error(f"--cancel-fraction must be in [0, 1], got {args.cancel_fraction}")
    if args.shared_prefixes < 0:
        parser.error(f"--shared-prefixes must be >= 0, got {args.shared_prefixes}")
    if args.check < 0 or not args.timeout > 0:
        parser.error(f"--check must be >= 0 and --timeout > 0, got {args.check} and {args.timeout}")
    console = console or Console(stderr=True)
    if args.artifact:
        artifact_manifest(parser, Path(args.artifact))
    artifact = Path(args.artifact) if args.artifact else tiny_artifact()
    engine = Engine.load(artifact, intra_op_threads=args.threads, prefix_caching=args.prefix_caching,
                         generation_config="none")  # greedy: outputs compared with runs alone
    slots = args.slots or args.concurrency
    engine.start_scheduler(slots=slots, batching=args.batching, max_queue=args.concurrency)
    vocab = engine.manifest["model"]["config"]["vocab_size"]
    requests = make_requests(args.requests, vocab, engine.max_context, args.seed, args.shared_prefixes)
    rng = np.random.default_rng([args.seed, 1])
    cancel = set(np.flatnonzero(rng.random(args.requests) < args.cancel_fraction).tolist())
    greedy = [i for i, r in enumerate(requests) if not r["sampling"] and i not in cancel]
    ledger = Ledger(args.requests, greedy[:args.check])
    with console.status(f"{args.requests} requests at concurrency {args.concurrency} on {slots} slots"):
        seconds = run(engine, requests, ledger, concurrency=args.concurrency, cancel=cancel, timeout=args.timeout)
    # the reference: the batch-1 path, without prefix caching (whose reuse is what is checked)
    alone = (Engine.load(artifact, intra_op_threads=args.threads, generation_config="none") if args.prefix_caching
             else engine)
    verdict = judge(alone, requests, ledger, cancel)  # before close(), which fails whatever is still pending
    engine.close()
    rss_from = min(100, max(1, args.requests // 10))
    rss_start, rss_end = int(ledger.rss[rss_from]), int(ledger.rss[ledger.completed])
    growth = (rss_end - rss_start) / rss_start if rss_start and ledger.completed > rss_from else None
    passed = (not (verdict["lost"] or verdict["errors"] or verdict["incomplete"] or verdict["mismatched"])
              and growth is not None and growth < MAX_RSS_GROWTH)
    step = max(1, args.requests // 20)
    report = {
        "settings": {"artifact": str(artifact), "requests": args.requests, "concurrency": args.concurrency,
                     "slots": slots, "batching": args.batching, "cancel_fraction": args.cancel_fraction,
                     "seed": args.seed, "threads": args.threads, "prefix_caching": args.prefix_caching,
                     "shared_prefixes": args.shared_prefixes},
        **{key: len(value) if isinstance(value, list) else value for key, value in verdict.items()},
        "lost_requests": verdict["lost"], "error_requests": verdict["errors"],
        "incomplete_requests": verdict["incomplete"], "mismatched_requests": verdict["mismatched"],
        "errors_seen": sorted(set(ledger.errors))[:5],
        "rss_from_request": rss_from, "rss_start_bytes": rss_start, "rss_end_bytes": rss_end, "rss_growth": growth,
        "rss_curve_bytes": {n: int(ledger.rss[n]) for n in range(step, ledger.completed + 1, step)},
        "cached_prompt_tokens": int(ledger.cached.sum()), "prompt_tokens": sum(len(r["prompt"]) for r in requests),
        "duration_s": seconds, "summary": latency_summary(ledger), "passed": passed,
    }
    print_table(table(report), console)
    out = write_json(args.out, report)
    console.print(f"wrote {out}")
    return report


def table(report: dict) -> Table:
    s = report["settings"]
    t = Table(title=f"load test: {s['requests']} requests, concurrency {s['concurrency']}, {s['slots']} slots "
                    f"({s['batching']})")
    t.add_column("check")
    t.add_column("value", justify="right")
    t.add_column("required", justify="right")
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f} MiB"  # noqa: E731
    growth = report["rss_growth"]
    rows = [("lost", report["lost"], "0"), ("errors", report["errors"], "0"),
            ("incomplete", report["incomplete"], "0"), ("cancelled (asked)", report["cancelled"], ""),
            (f"mismatched of {report['checked']} checked", report["mismatched"], "0"),
            (f"RSS at request {report['rss_from_request']}", mib(report["rss_start_bytes"]), ""),
            ("RSS at the last", mib(report["rss_end_bytes"]), ""),
            ("RSS growth", "-" if growth is None else f"{100 * growth:+.2f}%", f"< {100 * MAX_RSS_GROWTH:.0f}%"),
            ("prompt tokens from the cache", f"{report['cached_prompt_tokens']} of {report['prompt_tokens']}", "")]
    if report["summary"]:
        summary = report["summary"]
        rows += [("output tok/s", f"{summary['output_tokens_per_s']:.0f}", ""),
                 ("TTFT p50 / p99 ms", f"{summary['ttft_ms']['p50']:.1f} / {summary['ttft_ms']['p99']:.1f}", ""),
                 ("TPOT p50 / p99 ms", "-" if summary["tpot_ms"]["p50"] is None else
                  f"{summary['tpot_ms']['p50']:.2f} / {summary['tpot_ms']['p99']:.2f}", "")]
    for name, value, required in rows:
        t.add_row(name, str(value), required)
    t.caption = "PASSED" if report["passed"] else "FAILED"
    return t


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
