"""Does a long prompt stall running decodes? The scheduler with and without chunked prefill, on the default model.

    .venv/bin/python benchmarks/chunked_prefill.py [--artifact artifacts/smollm2-135m] [--chunks none,128,256,512]
        [--decoders 4] [--decode-tokens 192] [--long-prompt 1536] [--long-at 1.5] [--repeats 2]

Workload (the same for every setting): --decoders requests with 32-token prompts and --decode-tokens (192) new tokens arrive at
t=0 and decode together; at t=--long-at seconds a request with a --long-prompt-token prompt (Python's docs) and 16
new tokens arrives. Unchunked, its whole prefill runs between two decode steps, so every running request waits
for it; with `prefill_chunk: N` the scheduler prefills at most N prompt tokens per iteration and decodes the others
in between. Measured per setting (median over --repeats runs): the running requests' longest inter-token gap and
p99 ITL, the longest gap that ends between the long request's arrival and 0.5 s after its first token (its prefill, and
the decode steps chunking moves just past it), their TPOT, the long request's TTFT, and output tokens/s. Greedy, stop tokens disabled, 8 slots.
Writes benchmarks/results/chunked_prefill.json and, beside it, chunked_prefill-itl.png: the running requests' ITL
distribution per prefill_chunk.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import artifact_manifest, output_file, require_at_least_one, thread_count, usable_cpus  # noqa: E402
from generate import REPO, RESULTS, machine_info, versions, write_result  # noqa: E402

from runtime import Engine, bench  # noqa: E402
from compiler.console import print_table  # noqa: E402


SHORT_PROMPT, LONG_OUTPUT = 32, 16  # the running requests' prompt tokens; the long request's new tokens


def workload(encode, decoders: int, decode_tokens: int, long_prompt: int, long_at: float) -> bench.Workload:
    short = bench.text_token_ids(encode, SHORT_PROMPT)
    long = bench.text_token_ids(encode, long_prompt)
    requests = [bench.Request(short, decode_tokens) for _ in range(decoders)] + [bench.Request(long, LONG_OUTPUT)]
    return bench.Workload(requests=requests, warmup=[bench.Request(short, 4)], arrival="poisson", concurrency=0,
                          rate=None, seed=0, offsets=[0.0] * decoders + [long_at])


def median_of(values: list) -> float | None:
    """The median of the values a run had (a run whose decoders all finished before the long prompt has no
    "during its prefill" gap), or None when no run had one."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def measure(engine: Engine, load: bench.Workload, chunk: int | None, long_at: float) -> dict:
    server = bench.ScheduledServer(engine, "continuous", slots=8, max_queue=16, prefill_chunk=chunk)
    try:
        traces = bench.run_workload(server, load)
    finally:
        server.close()
    decoding, long = traces[:-1], traces[-1]
    gaps = np.concatenate([np.diff(trace.token_times) for trace in decoding])
    t0 = min(trace.arrival for trace in traces)
    during = [gap for trace in decoding for gap, at in zip(np.diff(trace.token_times), trace.token_times[1:])
              if long.arrival <= at <= long.first_token + 0.5]  # gaps that end while the long prompt is prefilled
    wall = max(trace.finish for trace in traces) - t0
    return {"itl_ms": (1e3 * gaps).tolist(), "max_itl_ms": 1e3 * float(gaps.max()), "p99_itl_ms": 1e3 * float(np.percentile(gaps, 99)),
            "p50_itl_ms": 1e3 * float(np.percentile(gaps, 50)),
            "max_itl_during_long_prefill_ms": 1e3 * float(max(during)) if during else None,
            "tpot_ms": 1e3 * statistics.median(trace.tpot for trace in decoding),
            "long_ttft_ms": 1e3 * long.ttft, "output_tokens_per_s": sum(t.output_tokens for t in traces) / wall}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=REPO / "artifacts" / "smollm2-135m")
    parser.add_argument("--chunks", default="none,128,256,512")
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=192, help="new tokens of each running request")
    parser.add_argument("--long-prompt", type=int, default=1536)
    parser.add_argument("--long-at", type=float, default=1.5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=thread_count, default=usable_cpus())
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/chunked_prefill.json)")
    args = parser.parse_args(argv)
    output_file(parser, args.out or RESULTS / "chunked_prefill.json")  # before the work, not a traceback after it
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be >= 2: the running requests' inter-token gaps are what is measured")
    require_at_least_one(parser, args, "--decoders", "--long-prompt", "--repeats")
    if not args.long_at >= 0:
        parser.error(f"--long-at must be >= 0 seconds, got {args.long_at}")
    try:
        chunks = [None if text == "none" else int(text) for text in args.chunks.split(",")]
    except ValueError:
        chunks = [0]
    if not chunks or any(chunk is not None and chunk < 1 for chunk in chunks):
        parser.error(f"--chunks {args.chunks!r}: give comma-separated token counts >= 1 or none, e.g. none,128,256")
    limit = artifact_manifest(parser, args.artifact)["kv_cache"]["max_context"]
    if args.long_prompt + LONG_OUTPUT - 1 > limit:  # the engine's rule: prompt + new tokens - 1 positions
        parser.error(f"--long-prompt {args.long_prompt} + its {LONG_OUTPUT} new tokens need "
                     f"{args.long_prompt + LONG_OUTPUT - 1} positions; this artifact's max context is {limit}: use "
                     f"--long-prompt {limit + 1 - LONG_OUTPUT} or less")
    if SHORT_PROMPT + args.decode_tokens - 1 > limit:
        parser.error(f"--decode-tokens {args.decode_tokens} after a {SHORT_PROMPT}-token prompt need "
                     f"{SHORT_PROMPT + args.decode_tokens - 1} positions; this artifact's max context is {limit}: use "
                     f"--decode-tokens {limit + 1 - SHORT_PROMPT} or less")
    console = Console(width=None if sys.stdout.isatty() else 160)
    engine = Engine.load(args.artifact, intra_op_threads=args.threads, generation_config="none")  # greedy
    load = workload(engine.tokenizer.encode, args.decoders, args.decode_tokens, args.long_prompt, args.long_at)
    results: dict[str, list[dict]] = {str(chunk): [] for chunk in chunks}
    for repeat in range(args.repeats):  # settings interleaved, so machine noise spreads over all of them
        for chunk in chunks:
            console.print(f"repeat {repeat + 1}/{args.repeats}: prefill_chunk {chunk}")
            results[str(chunk)].append(measure(engine, load, chunk, args.long_at))
    medians = {chunk: {key: median_of([run[key] for run in runs]) for key in runs[0] if key != "itl_ms"}
               for chunk, runs in results.items()}
    table = Table(title=f"{args.decoders} requests decoding; a {args.long_prompt}-token prompt arrives at "
                        f"{args.long_at} s (medians of {args.repeats})")
    for column in ("prefill_chunk", "max ITL ms", "max ITL, arrival to TTFT + 0.5 s", "p99 ITL ms", "p50 ITL ms",
                   "TPOT ms", "long TTFT ms", "out tok/s"):
        table.add_column(column, justify="right")
    for chunk, m in medians.items():
        during = m["max_itl_during_long_prefill_ms"]
        table.add_row(chunk, f"{m['max_itl_ms']:.0f}", "-" if during is None else f"{during:.0f}",
                      f"{m['p99_itl_ms']:.0f}", f"{m['p50_itl_ms']:.1f}", f"{m['tpot_ms']:.1f}",
                      f"{m['long_ttft_ms']:.0f}", f"{m['output_tokens_per_s']:.1f}")
    print_table(table, console)
    result = {"settings": {k: str(v) for k, v in vars(args).items()}, "machine": machine_info(),
              "versions": versions(), "runs": results, "medians": medians}
    path = write_result("chunked_prefill.json", result, args.out)
    plot = bench.write_cdf_plot(path.with_name(f"{path.stem}-itl.png"), {
        f"ITL of the {args.decoders} running requests, every repeat": {
            f"prefill_chunk {chunk}": [gap for run in runs for gap in run["itl_ms"]] for chunk, runs in results.items()}},
        "ms")
    console.print(f"wrote {path}" + (f", {plot}" if plot else f"; {bench.PLOT_SKIPPED}"), markup=False)
    return result


if __name__ == "__main__":
    main()
