"""Does a pass change prefill time? A recipe built with and without one pass, prefill graphs timed alternately.

    .venv/bin/python benchmarks/pass_ab.py [--recipe recipes/smollm2-135m.yaml] [--without skip_unused_rows]
        [--prompt-lengths 128,512,1024] [--runs 40] [--threads N] [--out F]

Builds the recipe twice under benchmarks/results/pass_ab/ (rebuilt when the recipe or the compiler's source
changed): as it is, and with the pass named by --without left out. For each prompt length both prefill graphs
run on the same real prompt (Python's docs), batch 1, through the runtime's onnxruntime backend (the KV cache
bound once as past and present; phases.py's prefill timing): one warm-up each, then --runs timed runs each,
alternating which goes first. Prints, per length, both medians, the ratio of medians (with / without), the ratio of the
fastest runs, and the largest logit difference between the two (0 for a pass that changes no logit).
On a shared 2-core VM a few percent is within the run-to-run spread: read the ratio next to the run count.
Writes benchmarks/results/pass_ab.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import REPO, machine_info, prompt_token_ids, versions, write_result  # noqa: E402
from phases import AotlmPhases  # noqa: E402
from quantization import built_recipe  # noqa: E402

from compiler.recipe import AccuracySpec, load_recipe  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "pass_ab"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "smollm2-135m.yaml")
    parser.add_argument("--without", default="skip_unused_rows", help="the pass left out of the baseline build")
    parser.add_argument("--prompt-lengths", default="128,512,1024")
    parser.add_argument("--runs", type=int, default=40, help="timed runs per graph and length")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/pass_ab.json)")
    args = parser.parse_args(argv)
    console = Console()
    lengths = [int(n) for n in args.prompt_lengths.split(",")]
    recipe = load_recipe(args.recipe)
    if args.without not in [p.name for p in recipe.passes]:
        raise SystemExit(f"{args.recipe}: lists no pass {args.without!r} to leave out "
                         f"(it lists {', '.join(p.name for p in recipe.passes)})")
    with_pass = dataclasses.replace(recipe, name=f"{recipe.name}-with-{args.without}",
                                    accuracy=AccuracySpec(enabled=False))
    without = dataclasses.replace(with_pass, name=f"{recipe.name}-without-{args.without}",
                                  passes=tuple(p for p in recipe.passes if p.name != args.without))
    folders = {"without": built_recipe(without, OUT, console), "with": built_recipe(with_pass, OUT, console)}
    graphs = {kind: AotlmPhases(kind, folder, args.threads) for kind, folder in folders.items()}
    prompt = prompt_token_ids(folders["with"], json.loads((folders["with"] / "manifest.json").read_text()), max(lengths))

    results = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("prefill A/B", total=len(lengths) * args.runs)
        for length in lengths:
            ids = prompt[:length]
            logits = {kind: graph.timed_prefill(ids)[1] for kind, graph in graphs.items()}  # also the warm-up
            difference = float(np.abs(logits["with"] - logits["without"]).max())
            seconds = {kind: [] for kind in graphs}
            for run in range(args.runs):
                for kind in (("without", "with") if run % 2 == 0 else ("with", "without")):
                    seconds[kind].append(graphs[kind].prefill(ids))
                progress.advance(task)
            median = {kind: statistics.median(values) for kind, values in seconds.items()}
            results[str(length)] = {
                "median_ms": {kind: 1e3 * value for kind, value in median.items()},
                "min_ms": {kind: 1e3 * min(values) for kind, values in seconds.items()},
                "ratio_of_medians": median["with"] / median["without"],
                "ratio_of_minima": min(seconds["with"]) / min(seconds["without"]),
                "logits_max_difference": difference,
                "run_ms": {kind: [1e3 * s for s in values] for kind, values in seconds.items()}}

    table = Table(title=f"prefill, {recipe.name}: with / without {args.without} (batch 1, {args.runs} alternating runs each)")
    for column in ("prompt tokens", "without ms", "with ms", "with / without", "fastest runs", "logits max diff"):
        table.add_column(column, justify="right")
    for length, r in results.items():
        table.add_row(length, f"{r['median_ms']['without']:.1f}", f"{r['median_ms']['with']:.1f}",
                      f"{r['ratio_of_medians']:.3f}", f"{r['ratio_of_minima']:.3f}", f"{r['logits_max_difference']:.1e}")
    console.print(table)
    report = {"settings": {"recipe": str(args.recipe), "without": args.without, "prompt_lengths": lengths,
                           "runs": args.runs, "threads": args.threads, "artifacts": {k: str(v) for k, v in folders.items()}},
              "machine": machine_info(), "versions": versions(), "results": results}
    console.print(f"wrote {write_result('pass_ab.json', report, args.out)}")
    return report


if __name__ == "__main__":
    main()
