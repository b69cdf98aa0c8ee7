"""Continuous batching on the default model, in one run: output throughput by concurrency, and continuous vs
static batching under Poisson arrivals.

    .venv/bin/python benchmarks/batching.py [--artifact artifacts/smollm2-135m] [--concurrency 1,4,8,16]
        [--rounds 4] [--rate auto|R] [--load 3] [--poisson-requests 128] [--slots 16]

Part 1 (closed loop): N clients each send a request (128-token prompt of Python's documentation, 64 greedy new
tokens, stop tokens disabled) and the next as soon as theirs finishes; the scheduler has N slots; 4N requests, at
least --min-requests (16): with 4 the single stream ran ~3 s, and two runs' single-stream TPOT differed by a third.
Part 2 (open loop): requests arrive as a Poisson process at --rate per second, prompts of 128 tokens, output
lengths drawn uniformly from 16..256 (same draws and arrival times for both modes), served by a 16-slot
scheduler with batching "static" (fixed batches run to completion) and with "continuous".
--rate auto (default) offers --load (3) times what part 1 served at its highest concurrency: its output
tokens/s over the mean output length, in requests/s. Below capacity both modes serve what arrives and their
throughputs match whatever the batching; a fixed rate saturated the slow VMs this ran on but left a faster one
idle half the time (2/s there: 1.05x). Over capacity the queue grows in both modes and throughput is capacity.
At --load 1.5 (the default until session 25) requests queued for only 29-52% of a continuous run (session 24's
four plotted rounds; static: 78-86%): the first draws came sparse, it served what arrived, and its tokens/s
measured the arrival rate and the drain more than its capacity. Each mode's "queued share"
(runtime.metrics.queued_share: the part of its run, first arrival to last finish, during which some request
waited for a slot) is reported, with a warning below one half. --poisson-requests (128, 64 until session 25)
makes the final drain, where the last requests finish with slots idle in either mode, a smaller part of the run.
Both use runtime.bench (the code behind `aotlm bench`): same workloads, same metrics (vLLM's definitions).
--rounds (4) runs all of it that many times, interleaved: each round runs every concurrency level and then both
Poisson modes, in the order given in rounds 1 and 4 (1, 4, 8, 16; static, continuous) and reversed in rounds 2 and
3 (ABBA, repeated for more rounds), so a ratio's two numbers come from the same round and, over four rounds, a host
that speeds up or slows down steadily favours neither side. The shared 2-core hosts this ran on drift by a third
in single-stream speed from one minute to the next, and part 1 used to run its levels one after another: the
single stream and 16 clients then met different machines. Ratios are paired: the median over rounds of each
round's ratio (numpy's: the mean of the middle two for an even count). The rate (--rate auto) comes from the first
round; every round serves the same Poisson workload.
Writes benchmarks/results/batching.json (+ part 2's JSON, TTFT/TPOT CDF and timeline plots, of its median round:
the round whose continuous/static ratio is the median, the upper of the middle two for an even count).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import REPO, RESULTS, machine_info, paired_median, versions, write_result  # noqa: E402
from arguments import artifact_manifest, output_file, require_at_least_one, thread_count, usable_cpus  # noqa: E402
from contention import OtherCores, contention_line  # noqa: E402

from runtime import Engine, bench  # noqa: E402
from compiler.console import print_table  # noqa: E402


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


def paired(values: list[float], references: list[float]) -> dict:
    """Round-by-round ratios and their median: both numbers of a ratio come from the same round, minutes apart at
    most, so a host that is faster in one round than in another moves both (the ABBA order, `run_order`, balances
    a steady drift within rounds)."""
    return {"median": paired_median(values, references),
            "rounds": [value / reference for value, reference in zip(values, references)]}


def run_order(items: list, round_index: int) -> list:
    """ABBA: the given order in rounds 1 and 4 (indices 0 and 3), reversed in rounds 2 and 3, and so on."""
    return list(items) if round_index % 4 in (0, 3) else list(items)[::-1]


def median_round(values: list[float]) -> int:
    """The index of the round whose value is the median (the upper one of an even count)."""
    return sorted(range(len(values)), key=values.__getitem__)[len(values) // 2]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=REPO / "artifacts" / "smollm2-135m")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--rounds", type=int, default=4,
                        help="times every measurement runs, interleaved (see the module's docstring)")
    parser.add_argument("--rate", default="auto", help="Poisson requests per second, or auto (see --load)")
    parser.add_argument("--load", type=float, default=3.0,
                        help="with --rate auto: the rate offered, as a multiple of part 1's capacity")
    parser.add_argument("--poisson-requests", type=int, default=128)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--prompt-tokens", default="128")
    parser.add_argument("--new-tokens", default="64", help="closed loop's output tokens")
    parser.add_argument("--min-requests", type=int, default=16, help="closed loop: requests per level, at least")
    parser.add_argument("--poisson-output-tokens", default="16:256")
    parser.add_argument("--threads", type=thread_count, default=usable_cpus())
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: benchmarks/results/batching.json); the Poisson run's JSON and plots "
                             "go beside it, named <stem>-poisson*")
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the work, not a traceback after it
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
    if args.rounds < 1:
        parser.error(f"--rounds: {args.rounds} must be >= 1")
    require_at_least_one(parser, args, "--poisson-requests", "--slots")
    try:
        levels = [int(level) for level in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency: {args.concurrency!r} is not comma-separated counts, e.g. 1,4,8,16")
    if min(levels) < 1 or len(set(levels)) != len(levels):
        parser.error(f"--concurrency: {args.concurrency!r}: each level must be >= 1 and given once")
    artifact_manifest(parser, args.artifact)
    console = Console(width=None if sys.stdout.isatty() else 160)
    engine = Engine.load(args.artifact, intra_op_threads=args.threads, generation_config="none")  # greedy
    encode, max_context = engine.tokenizer.encode, engine.max_context

    def closed_loop_workload(level: int) -> bench.Workload:
        return bench.make_workload(
            encode, max_context=max_context, requests=max(4 * level, args.min_requests), arrival="concurrency",
            concurrency=level, prompt_tokens=args.prompt_tokens, output_tokens=args.new_tokens, warmup=1)

    def poisson_workload(rate: float) -> bench.Workload:
        return bench.make_workload(encode, max_context=max_context, requests=args.poisson_requests,
                                   arrival="poisson", rate=rate, prompt_tokens=args.prompt_tokens,
                                   output_tokens=args.poisson_output_tokens, warmup=1, seed=0)

    try:  # part 2's workload is made after part 1 has run for minutes: every workload is checked now
        for level in levels:
            closed_loop_workload(level)
        poisson_workload(1.0)
    except bench.BenchError as error:  # its flags are bench's: say which of this script's they are
        parser.error(f"{error} (here: --prompt-tokens with --new-tokens for the closed loop, "
                     f"--poisson-output-tokens for the Poisson part)")
    modes = ["static", "continuous"]
    closed: dict[int, list[dict]] = {level: [] for level in levels}
    open_loop: dict[str, list[list]] = {mode: [] for mode in modes}
    open_loop_cores: dict[str, list[float]] = {mode: [] for mode in modes}  # other processes' (contention.py)
    orders, rate, rate_source, workload = [], None, None, None
    with Progress(console=console) as progress:
        for round_index in range(args.rounds):
            level_order, mode_order = run_order(levels, round_index), run_order(modes, round_index)
            orders.append({"closed_loop": level_order, "poisson": mode_order})
            label = f"round {round_index + 1}/{args.rounds}"
            for level in level_order:
                closed_workload = closed_loop_workload(level)
                started = time.perf_counter()
                with OtherCores() as others:
                    traces = serve(engine, closed_workload, "continuous", level, progress,
                                   f"{label} concurrency {level}")
                # the scheduler's start, the warm-up request and the close included: not the served run's duration
                closed[level].append({"wall_with_setup_s": time.perf_counter() - started,
                                      "other_cores": others.cores,
                                      **bench.report({}, {"run": traces})["backends"]["run"]})
            if workload is None:  # the first round's closed loop sets the rate; every round then serves the same
                rate, rate_source = poisson_rate(args, {level: runs[0] for level, runs in closed.items()})
                console.log(f"Poisson arrivals: {rate:.2f} requests/s ({rate_source})")
                workload = poisson_workload(rate)
            for mode in mode_order:
                with OtherCores() as others:
                    open_loop[mode].append(serve(engine, workload, mode, args.slots, progress,
                                                 f"{label} poisson {rate:.2f}/s {mode}"))
                open_loop_cores[mode].append(others.cores)

    def tokens_per_s(summary: dict) -> float:
        return summary["output_tokens_per_s"]

    first = levels[0]
    vs_first = {level: paired([tokens_per_s(e["summary"]) for e in runs],
                              [tokens_per_s(e["summary"]) for e in closed[first]]) for level, runs in closed.items()}
    render_closed(console, args, closed, vs_first, first)
    settings = {"arrival": "poisson", "rate": rate, "rate_source": rate_source, "slots": args.slots,
                **workload.settings()}
    reports = [bench.report({**settings, "round": r + 1}, {mode: open_loop[mode][r] for mode in modes})
               for r in range(args.rounds)]
    summaries = {mode: [report["backends"][mode]["summary"] for report in reports] for mode in modes}
    queued = {mode: [s["queued_share"] for s in summaries[mode]] for mode in modes}
    continuous_over_static = {
        "output_tokens_per_s": paired([tokens_per_s(s) for s in summaries["continuous"]],
                                      [tokens_per_s(s) for s in summaries["static"]]),
        "ttft_p99": paired([s["ttft_ms"]["p99"] for s in summaries["continuous"]],
                           [s["ttft_ms"]["p99"] for s in summaries["static"]])}
    shown = median_round(continuous_over_static["output_tokens_per_s"]["rounds"])
    console.print(bench.compare_table(reports[shown]))
    render_open(console, summaries, queued, continuous_over_static, shown)
    if min(queued["continuous"]) < 0.5:
        console.print(f"[bold yellow]warning:[/] requests queued for only {min(queued['continuous']):.0%} of a "
                      "continuous run: it served what arrived, so its tokens/s is the arrival rate, not its capacity; "
                      "raise --load or --rate")
    console.print(contention_line([run["other_cores"] for runs in closed.values() for run in runs]
                                  + [cores for mode in modes for cores in open_loop_cores[mode]], "runs"))
    result = {"settings": {**{k: str(v) for k, v in vars(args).items()}, "decoding": "greedy, stop tokens disabled"},
              "machine": machine_info(), "versions": versions(), "orders": orders,
              "closed_loop": {str(level): {**median_entry(runs), "rounds": runs_without_traces(runs),
                                           # the table's "out tok/s (median)": of an even count, the middle two's mean
                                           "output_tokens_per_s_median": median_tokens_per_s(runs)}
                              for level, runs in closed.items()},
              "closed_loop_vs_first_level": {str(level): ratios for level, ratios in vs_first.items()},
              "poisson_rate": {"requests_per_s": rate, "source": rate_source},
              "poisson": {mode: {"summary": summaries[mode][shown], "rounds": summaries[mode],
                                 "queued_share": queued[mode], "other_cores": open_loop_cores[mode]}
                          for mode in modes},
              "poisson_continuous_over_static": continuous_over_static,
              "poisson_plotted_round": shown + 1}
    out = args.out or RESULTS / "batching.json"
    written = bench.write_outputs(reports[shown], out.with_name(f"{out.stem}-poisson.json"))
    console.print(f"wrote {write_result('batching.json', result, out)}, " + ", ".join(map(str, written)))
    return result


def median_entry(runs: list[dict]) -> dict:
    """The closed loop's median round (by output tokens/s): its wall time and summary."""
    entry = runs[median_round([e["summary"]["output_tokens_per_s"] for e in runs])]
    return {"wall_with_setup_s": entry["wall_with_setup_s"], "summary": entry["summary"]}


def median_tokens_per_s(runs: list[dict]) -> float:
    return float(np.median([e["summary"]["output_tokens_per_s"] for e in runs]))


def runs_without_traces(runs: list[dict]) -> list[dict]:
    return [{"wall_with_setup_s": e["wall_with_setup_s"], "other_cores": e["other_cores"], "summary": e["summary"]}
            for e in runs]


def rounds_cell(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values)


def render_closed(console: Console, args, closed: dict, vs_first: dict, first: int) -> None:
    table = Table(title=f"closed loop: {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, N clients, "
                        f"N slots (continuous), {args.rounds} rounds")
    for column in ("concurrency", "requests", "out tok/s (median)", "per round", f"vs concurrency {first} (paired)",
                   "per round", "TTFT p50 ms", "TPOT p50 ms", "TPOT p99 ms"):
        table.add_column(column, justify="right")
    for level, runs in closed.items():
        s = median_entry(runs)["summary"]
        per_round = [e["summary"]["output_tokens_per_s"] for e in runs]
        table.add_row(str(level), str(s["requests"]), f"{median_tokens_per_s(runs):.1f}", rounds_cell(per_round, ".1f"),
                      f"{vs_first[level]['median']:.2f}x", rounds_cell(vs_first[level]["rounds"], ".2f"),
                      ms(s["ttft_ms"]["median"]), ms(s["tpot_ms"]["median"]), ms(s["tpot_ms"]["p99"]))
    table.caption = ("the median round's requests and latencies (the upper middle one for an even count); 'paired': "
                     "the median over rounds of that round's tokens/s over the "
                     f"same round's at concurrency {first}")
    print_table(table, console)


def render_open(console: Console, summaries: dict, queued: dict, continuous_over_static: dict, shown: int) -> None:
    table = Table(title=f"Poisson arrivals, every round (the table above is round {shown + 1}, the median round)")
    for column in ("", "static", "continuous", "continuous / static (paired median)", "per round"):
        table.add_column(column, justify="right")
    for label, key, get in (("out tok/s", "output_tokens_per_s", lambda s: s["output_tokens_per_s"]),
                            ("TTFT p99 ms", "ttft_p99", lambda s: s["ttft_ms"]["p99"])):
        table.add_row(label, rounds_cell([get(s) for s in summaries["static"]], ".1f"),
                      rounds_cell([get(s) for s in summaries["continuous"]], ".1f"),
                      f"{continuous_over_static[key]['median']:.2f}x", rounds_cell(continuous_over_static[key]["rounds"], ".2f"))
    table.add_row("queued share", *(rounds_cell(queued[mode], ".0%") for mode in ("static", "continuous")), "", "")
    table.caption = ("queued share: the part of the run during which some request waited for a slot (near 100%: "
                     "tokens/s is the server's capacity)")
    print_table(table, console)


if __name__ == "__main__":
    main()
