"""Continuous batching on the default model, in one run: output throughput by concurrency, and continuous vs
static batching under Poisson arrivals.

    .venv/bin/python benchmarks/batching.py [--artifact artifacts/smollm2-135m] [--concurrency 1,4,8,16]
        [--rate auto|R] [--load 1.5] [--poisson-requests 64] [--slots 16]

Part 1 (closed loop): N clients each send a request (128-token prompt of Python's documentation, 64 greedy new
tokens, stop tokens disabled) and the next as soon as theirs finishes; the scheduler has N slots; 4N requests, at
least --min-requests (16): with 4 the single stream ran ~3 s, and two runs' single-stream TPOT differed by a third.
Part 2 (open loop): requests arrive as a Poisson process at --rate per second, prompts of 128 tokens, output
lengths drawn uniformly from 16..256 (same draws and arrival times for both modes), served by a 16-slot
scheduler with batching "static" (fixed batches run to completion) and then "continuous".
--rate auto (default) offers --load (1.5) times what part 1 served at its highest concurrency: its output
tokens/s over the mean output length, in requests/s. Below capacity both modes serve what arrives and their
throughputs match whatever the batching; a fixed rate saturated the slow VMs this ran on but left a faster one
idle half the time (2/s there: 1.05x). Over capacity the queue grows in both modes and throughput is capacity.
Both use runtime.bench (the code behind `aotlm bench`): same workloads, same metrics (vLLM's definitions).
Writes benchmarks/results/batching.json (+ TTFT/TPOT CDF and timeline plots of part 2).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import REPO, RESULTS, machine_info, versions, write_result  # noqa: E402

from runtime import Engine, bench  # noqa: E402


def serve(engine: Engine, workload, batching: str, slots: int, progress: Progress, label: str) -> list:
    task = progress.add_task(f"{label:28}", total=len(workload.requests) + len(workload.warmup))
    server = bench.ScheduledServer(engine, batching, slots, max_queue=len(workload.requests) + 1)
    try:
        return bench.run_workload(server, workload, on_done=lambda: progress.advance(task))
    finally:
        server.close()


def ms(value: float | None) -> str:
    """A latency cell; TPOT is None when no request made two tokens."""
    return "-" if value is None else f"{value:.1f}"


def poisson_rate(args, closed: dict) -> tuple[float, str]:
    """Part 2's arrival rate (requests/s) and how it was chosen: --rate as given, or --load x part 1's capacity."""
    if args.rate != "auto":
        return float(args.rate), "--rate"
    top = max(closed)
    low, high = bench.parse_range(args.poisson_output_tokens, "--poisson-output-tokens")
    capacity = closed[top]["summary"]["output_tokens_per_s"] / ((low + high) / 2)
    note = "" if top >= args.slots else f"; part 1 stopped below the {args.slots} slots, so this underestimates it"
    return args.load * capacity, (f"--rate auto: {args.load} x {capacity:.2f} requests/s, part 1's output tokens/s at "
                                  f"concurrency {top} over the mean output of {(low + high) / 2:g} tokens{note}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=REPO / "artifacts" / "smollm2-135m")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--rate", default="auto", help="Poisson requests per second, or auto (see --load)")
    parser.add_argument("--load", type=float, default=1.5,
                        help="with --rate auto: the rate offered, as a multiple of part 1's capacity")
    parser.add_argument("--poisson-requests", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--prompt-tokens", default="128")
    parser.add_argument("--new-tokens", default="64", help="closed loop's output tokens")
    parser.add_argument("--min-requests", type=int, default=16, help="closed loop: requests per level, at least")
    parser.add_argument("--poisson-output-tokens", default="16:256")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: benchmarks/results/batching.json); the Poisson run's JSON and plots "
                             "go beside it, named <stem>-poisson*")
    args = parser.parse_args(argv)
    if args.rate != "auto":
        try:
            valid = float(args.rate) > 0
        except ValueError:
            valid = False
        if not valid:
            parser.error(f"--rate: {args.rate!r} is neither a positive number of requests per second nor auto")
    if not args.load > 0:
        parser.error(f"--load: {args.load} must be positive")
    if args.min_requests < 1:
        parser.error(f"--min-requests: {args.min_requests} must be >= 1")
    console = Console(width=None if sys.stdout.isatty() else 160)
    engine = Engine.load(args.artifact, intra_op_threads=args.threads)
    encode, max_context = engine.tokenizer.encode, engine.max_context
    levels = [int(level) for level in args.concurrency.split(",")]

    closed, open_loop = {}, {}
    with Progress(console=console) as progress:
        for level in levels:
            workload = bench.make_workload(encode, max_context=max_context, requests=max(4 * level, args.min_requests),
                                           arrival="concurrency",
                                           concurrency=level, prompt_tokens=args.prompt_tokens,
                                           output_tokens=args.new_tokens, warmup=1)
            started = time.perf_counter()
            traces = serve(engine, workload, "continuous", level, progress, f"concurrency {level}")
            closed[level] = {"wall_s": time.perf_counter() - started, **bench.report({}, {"run": traces})["backends"]["run"]}
        rate, rate_source = poisson_rate(args, closed)
        console.log(f"Poisson arrivals: {rate:.2f} requests/s ({rate_source})")
        workload = bench.make_workload(encode, max_context=max_context, requests=args.poisson_requests,
                                       arrival="poisson", rate=rate, prompt_tokens=args.prompt_tokens,
                                       output_tokens=args.poisson_output_tokens,
                                       warmup=1, seed=0)
        for mode in ("static", "continuous"):
            open_loop[mode] = serve(engine, workload, mode, args.slots, progress, f"poisson {rate:.2f}/s {mode}")

    single = closed[levels[0]]["summary"]["output_tokens_per_s"]
    table = Table(title=f"closed loop: {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, N clients, "
                        f"N slots (continuous)")
    for column in ("concurrency", "requests", "out tok/s", f"vs concurrency {levels[0]}", "TTFT p50 ms", "TPOT p50 ms",
                   "TPOT p99 ms"):
        table.add_column(column, justify="right")
    for level, entry in closed.items():
        s = entry["summary"]
        table.add_row(str(level), str(s["requests"]), f"{s['output_tokens_per_s']:.1f}",
                      f"{s['output_tokens_per_s'] / single:.2f}x", ms(s["ttft_ms"]["median"]),
                      ms(s["tpot_ms"]["median"]), ms(s["tpot_ms"]["p99"]))
    console.print(table)
    poisson = bench.report({"arrival": "poisson", "rate": rate, "rate_source": rate_source, "slots": args.slots,
                            **workload.settings()}, open_loop)
    console.print(bench.compare_table(poisson))
    result = {"settings": {**{k: str(v) for k, v in vars(args).items()}, "decoding": "greedy, stop tokens disabled"},
              "machine": machine_info(), "versions": versions(),
              "closed_loop": {str(level): {"wall_s": e["wall_s"], "summary": e["summary"]} for level, e in closed.items()},
              "poisson_rate": {"requests_per_s": rate, "source": rate_source},
              "poisson": {mode: entry["summary"] for mode, entry in poisson["backends"].items()}}
    out = args.out or RESULTS / "batching.json"
    written = bench.write_outputs(poisson, out.with_name(f"{out.stem}-poisson.json"))
    console.print(f"wrote {write_result('batching.json', result, out)}, " + ", ".join(map(str, written)))
    return result


if __name__ == "__main__":
    main()
