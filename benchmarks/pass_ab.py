"""Does a pass change prefill time? A recipe built with and without one pass, prefill graphs timed alternately.

    .venv/bin/python benchmarks/pass_ab.py [--recipe recipes/smollm2-135m.yaml] [--without skip_unused_rows]
        [--prompt-lengths 128,512,1024] [--runs 40] [--threads N] [--out F]

Builds the recipe twice under benchmarks/results/pass_ab/ (rebuilt when the recipe or the code that builds
it changed): as it is, and with the pass named by --without left out. For each prompt length both prefill graphs
run on the same real prompt (Python's docs), batch 1, through the runtime's onnxruntime backend (the KV cache
bound once as past and present; the prefill graph alone, AotlmPhases.graph_prefill): one warm-up each, then --runs
timed runs each, alternating which goes first. Prints, per length, both medians, the ratio of medians (with /
without), the ratio of the fastest runs, and the largest logit difference between the two (0 for a pass that
changes no logit). On a shared 2-core VM a few percent is within the run-to-run spread: read the ratio next to the
run count.
With --reference ARTIFACT (say the fp32 build of the same model), also how far each variant's last-token distribution
lies from the reference's: mean KL(reference || variant) and top-1 agreement over --reference-prompts windows of
--reference-tokens tokens of held-out text (for a pass that changes logits, as dequantize_weights does).
Also what each artifact costs to load (a pass may trade memory for speed, as dequantize_weights does): in a fresh
Python process per artifact, the seconds its imports and `Engine.load` take, and the process's resident memory
after it and at its peak (`--load-runs` processes each, medians). Writes benchmarks/results/pass_ab.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import output_file, thread_count, usable_cpus  # noqa: E402
from generate import REPO, machine_info, prompt_token_ids, versions, write_result  # noqa: E402
from phases import AotlmPhases  # noqa: E402
from quantization import built_recipe  # noqa: E402

from compiler.console import print_table  # noqa: E402

from compiler.recipe import AccuracySpec, load_recipe  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "pass_ab"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "smollm2-135m.yaml")
    parser.add_argument("--without", default="skip_unused_rows", help="the pass left out of the baseline build")
    parser.add_argument("--prompt-lengths", default="128,512,1024")
    parser.add_argument("--runs", type=int, default=40, help="timed runs per graph and length")
    parser.add_argument("--threads", type=thread_count, default=usable_cpus())
    parser.add_argument("--reference", type=Path, default=None, help="an artifact to measure each variant against")
    parser.add_argument("--reference-prompts", type=int, default=16)
    parser.add_argument("--reference-tokens", type=int, default=256)
    parser.add_argument("--load-runs", type=int, default=3, help="fresh processes per artifact timing Engine.load")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/pass_ab.json)")
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the work, not a traceback after it
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
    loading = {kind: load_cost(folder, args.threads, args.load_runs) for kind, folder in folders.items()}
    graphs = {kind: AotlmPhases(kind, folder, args.threads) for kind, folder in folders.items()}
    prompt = prompt_token_ids(folders["with"], json.loads((folders["with"] / "manifest.json").read_text()), max(lengths))

    results = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("prefill A/B", total=len(lengths) * args.runs)
        for length in lengths:
            ids = prompt[:length]
            logits = {kind: graph.graph_prefill(ids)[1] for kind, graph in graphs.items()}  # also the warm-up
            difference = float(np.abs(logits["with"] - logits["without"]).max())
            seconds = {kind: [] for kind in graphs}
            for run in range(args.runs):
                for kind in (("without", "with") if run % 2 == 0 else ("with", "without")):
                    seconds[kind].append(graphs[kind].graph_prefill(ids)[0])
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
    print_table(table, console)
    distance = None
    if args.reference is not None:
        distance = reference_distance(graphs, AotlmPhases("reference", args.reference, args.threads),
                                      args.reference_prompts, args.reference_tokens)
        table = Table(title=f"last-token distribution against {args.reference.name} ({args.reference_prompts} windows "
                            f"of {args.reference_tokens} held-out tokens)")
        for column in ("artifact", "mean KL(reference || it)", "top-1 agreement"):
            table.add_column(column, justify="right")
        for kind, d in distance.items():
            table.add_row(f"{kind} {args.without}", f"{d['mean_kl']:.4f}", f"{d['top1_agreement']:.3f}")
        print_table(table, console)
    table = Table(title=f"Engine.load in a fresh process (medians of {args.load_runs})")
    for column in ("artifact", "files MB", "load s", "resident MB after", "peak resident MB"):
        table.add_column(column, justify="right")
    for kind, cost in loading.items():
        table.add_row(f"{kind} {args.without}", f"{cost['files_mb']:.1f}", f"{cost['seconds']:.2f}",
                      f"{cost['resident_mb']:.0f}", f"{cost['peak_resident_mb']:.0f}")
    print_table(table, console)
    report = {"settings": {"recipe": str(args.recipe), "without": args.without, "prompt_lengths": lengths,
                           "runs": args.runs, "load_runs": args.load_runs, "threads": args.threads,
                           "artifacts": {k: str(v) for k, v in folders.items()}},
              "machine": machine_info(), "versions": versions(), "results": results, "loading": loading,
              "reference": None if distance is None else {"artifact": str(args.reference), "windows": args.reference_prompts,
                                                          "tokens": args.reference_tokens, **distance}}
    console.print(f"wrote {write_result('pass_ab.json', report, args.out)}")
    return report


def reference_distance(graphs: dict, reference: AotlmPhases, windows: int, tokens: int) -> dict:
    """Mean KL(reference || variant) of the last-token distributions after prefill, and top-1 agreement, over
    `windows` windows of held-out text (runtime.evaluate's held-out part of Python's docs)."""
    from runtime.evaluate import builtin_text, encode_text

    tokenizer_file = lambda engine: engine.artifact_dir / engine.manifest["tokenizer"]["file"]  # noqa: E731
    for kind, graph in graphs.items():
        if tokenizer_file(graph.engine).read_bytes() != tokenizer_file(reference.engine).read_bytes():
            raise SystemExit(f"--reference {reference.engine.artifact_dir}: another tokenizer than the {kind} build's")
    text = encode_text(reference.engine.tokenizer, builtin_text("pydoc-held-out"))
    step = max(1, (len(text) - tokens) // max(1, windows - 1))
    starts = [i * step for i in range(windows) if i * step + tokens <= len(text)]
    if len(starts) < windows:
        raise SystemExit(f"the held-out text has {len(text)} tokens: too few for {windows} windows of {tokens}")
    log_softmax = lambda x: x - x.max() - np.log(np.exp(x - x.max()).sum())  # noqa: E731
    last = lambda logits: (logits[0, -1] if logits.ndim == 3 else logits[0]).astype(np.float64)  # prefill_logits: all
    found = {kind: {"kl": [], "top1": []} for kind in graphs}
    for start in starts:
        ids = text[start:start + tokens]
        expected = log_softmax(last(reference.graph_prefill(ids)[1]))
        for kind, graph in graphs.items():
            got = log_softmax(last(graph.graph_prefill(ids)[1]))
            found[kind]["kl"].append(float((np.exp(expected) * (expected - got)).sum()))
            found[kind]["top1"].append(float(got.argmax() == expected.argmax()))
    return {kind: {"mean_kl": statistics.fmean(f["kl"]), "top1_agreement": statistics.fmean(f["top1"])}
            for kind, f in found.items()}


# Linux's /proc: VmRSS now and VmHWM, this process's peak (getrusage's ru_maxrss would carry the forking
# benchmark's own peak into the child).
LOAD_PROBE = """
import json, sys, time
started = time.perf_counter()
from runtime import Engine
Engine.load(sys.argv[1], intra_op_threads=int(sys.argv[2]))
seconds = time.perf_counter() - started
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
kib = lambda key: int(status[key].split()[0])
print(json.dumps({"seconds": seconds, "resident_mb": kib("VmRSS") * 1024 / 1e6, "peak_resident_mb": kib("VmHWM") * 1024 / 1e6}))
"""


def load_cost(folder: Path, threads: int, runs: int) -> dict:
    """Medians over `runs` fresh processes of Engine.load's seconds (imports included) and resident memory."""
    samples = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", LOAD_PROBE, str(folder), str(threads)], cwd=REPO,
                              capture_output=True, text=True, check=True)
        samples.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cost = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    cost["files_mb"] = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 1e6
    return cost


if __name__ == "__main__":
    main()
