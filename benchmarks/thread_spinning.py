"""Engine.load(spin_after_run=False), the default, against ["decode"] (the prefill session stops, the decode
session spins on), spin_during_run=False (no spinning at all, `--no-spin`) and True (onnxruntime's own default for
both): whether an engine's intra-op threads keep spinning after a run returns, while its prefill and decode sessions
share the cores, and whether they should spin at all where other processes use the cores (--busy-cores N runs N
processes that each keep a core busy while everything is measured: co-located work).

    .venv/bin/python benchmarks/thread_spinning.py [--artifacts artifacts/smollm2-135m,artifacts/smollm2-135m-int4]
        [--repeats 3] [--prompt 512] [--new-tokens 128] [--requests 64] [--request-prompt 128]
        [--request-outputs 16:256] [--slots 16] [--threads N] [--busy-cores 0] [--out PATH]

Each artifact is loaded once per arm in one process, each without huge pages (Engine.load's huge_pages: how
much of an engine's memory the kernel collapses varies from one load to the next, by about what is measured here),
and each arm serves a short single stream and scheduler workload first. Each measurement below then runs in every
arm back to back (the order rotates every repeat, and a pause of --pause seconds comes before each run, so that a
pool still spinning from the previous arm's last run has stopped):
  single stream  a --prompt-token prompt of Python's documentation, --new-tokens greedy tokens (Engine.generate):
                 TTFT, TPOT, and the mean of the first --early gaps between output tokens against that of the rest
                 (right after the prefill, its pool's spinning thread competes with the decode steps);
  scheduler      --requests requests submitted at once (--request-prompt-token prompts, output lengths drawn from
                 --request-outputs with seed 0, the same in every arm) to a --slots-slot scheduler, continuous and then
                 static batching:
                 output tokens/s from the first submit to the last result (prefills and decode steps alternate).
Medians over the repeats, a table on the console, JSON in benchmarks/results/thread_spinning.json (--out) and a plot
beside it of the mean gap by token index, every arm.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import output_file, thread_count, usable_cpus  # noqa: E402
from generate import REPO, RESULTS, machine_info, paired_median, prompt_token_ids, versions, write_result  # noqa: E402

from runtime import Engine  # noqa: E402
from runtime.bench import BenchError, parse_range  # noqa: E402
from runtime.manifest import read_manifest  # noqa: E402
from compiler.console import print_table  # noqa: E402

# label: Engine.load's spinning keywords; the last arm is what the table's ratios divide by
ARMS = {"stop after run": {"spin_after_run": False}, "decode spins on": {"spin_after_run": ["decode"]},
        "never spin": {"spin_during_run": False}, "spin after run": {"spin_after_run": True}}


def busy_core() -> subprocess.Popen:
    """A process that keeps one core busy until killed (--busy-cores: the co-located work), or until this process
    ends: a SIGTERM (`timeout`) or kill -9 skips the `finally` that kills it, and it spun on at 95% of a core, as the
    child of init. Ctrl-C is this process's to handle."""
    loop = (f"import os, signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            f"while os.getppid() == {os.getpid()}: pass")
    return subprocess.Popen([sys.executable, "-c", loop])


def single_stream(engine: Engine, prompt_ids: list[int], new_tokens: int, early: int) -> dict:
    timings = engine.generate(prompt_ids, max_new_tokens=new_tokens, ignore_eos=True).timings
    gaps_ms = 1e3 * np.diff(timings.token_times_s)
    return {"ttft_ms": 1e3 * timings.ttft_s, "tpot_ms": 1e3 * timings.tpot_s, "gaps_ms": gaps_ms.tolist(),
            "early_gap_ms": float(gaps_ms[:early].mean()), "later_gap_ms": float(gaps_ms[early:].mean())}


def scheduler_workload(text_ids: list[int], requests: int, prompt_tokens: int, outputs: tuple[int, int]) \
        -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) per request: windows of the text one token apart, lengths drawn with seed 0."""
    if len(text_ids) < prompt_tokens + requests - 1:
        raise ValueError(f"{len(text_ids)} text tokens for {requests} prompts of {prompt_tokens}")
    lengths = np.random.default_rng(0).integers(outputs[0], outputs[1] + 1, requests)
    return [(text_ids[i:i + prompt_tokens], int(n)) for i, n in enumerate(lengths)]


def scheduled(engine: Engine, workload, batching: str, slots: int) -> float:
    """Output tokens/s of the whole workload through a fresh scheduler of `slots` slots."""
    engine.start_scheduler(slots=slots, batching=batching, max_queue=len(workload))
    started = time.perf_counter()
    handles = [engine.submit(ids, max_new_tokens=n, ignore_eos=True) for ids, n in workload]
    made = sum(len(handle.result().token_ids) for handle in handles)
    seconds = time.perf_counter() - started
    if made != sum(n for _, n in workload):
        raise RuntimeError(f"the scheduler made {made} tokens, not {sum(n for _, n in workload)}")
    return made / seconds


def check_artifact(artifact: Path, args) -> dict:
    """The artifact's manifest, if both workloads fit it; else a SystemExit saying what to change."""
    if not (artifact / "manifest.json").is_file():
        raise SystemExit(f"{artifact}: not an artifact; build it first (aotlm build recipes/{artifact.name}.yaml)")
    manifest = read_manifest(artifact)
    if manifest["backend"]["name"] != "onnxruntime":  # TensorRT has no intra-op pools: the arms would be one
        raise SystemExit(f"{artifact}: a {manifest['backend']['name']} artifact; the setting is onnxruntime's")
    if set(manifest["engines"]) != {"prefill", "decode"}:
        raise SystemExit(f"{artifact}: engines {', '.join(manifest['engines'])}; the arms name prefill and decode")
    context = manifest["kv_cache"]["max_context"]
    for what, needed in (("--prompt + --new-tokens - 1", args.prompt + args.new_tokens - 1),
                         ("--request-prompt + the longest --request-outputs - 1",
                          args.request_prompt + args.request_outputs[1] - 1)):
        if needed > context:
            raise SystemExit(f"{artifact}: {what} = {needed} cache positions, above its max context {context}")
    return manifest


def measure(artifact: Path, manifest: dict, args, console: Console) -> dict:
    engines = {label: Engine.load(artifact, intra_op_threads=args.threads, huge_pages=False, generation_config="none",
                                 **spinning)
               for label, spinning in ARMS.items()}
    busy = [busy_core() for _ in range(args.busy_cores)]
    try:
        return measure_engines(artifact, manifest, engines, args, console)
    finally:
        for process in busy:
            process.kill()
            process.wait()
        for engine in engines.values():
            engine.close()


def measure_engines(artifact: Path, manifest: dict, engines: dict, args, console: Console) -> dict:
    prompt_ids = prompt_token_ids(artifact, manifest, args.prompt)
    text_ids = prompt_token_ids(artifact, manifest, args.request_prompt + args.requests)
    workload = scheduler_workload(text_ids, args.requests, args.request_prompt, args.request_outputs)
    for engine in engines.values():  # warm-up: first runs allocate, fault in pages, make the batched bindings
        single_stream(engine, prompt_ids, 8, 1)
        scheduled(engine, workload[:args.slots], "continuous", args.slots)
    runs = {label: [] for label in engines}
    for repeat in range(args.repeats):
        labels = list(engines)
        order = labels[repeat % len(labels):] + labels[:repeat % len(labels)]
        made = {label: {} for label in engines}
        for kind in ("single", "continuous", "static"):  # the arms back to back: the machine drifts over minutes
            for label in order:
                time.sleep(args.pause)
                made[label][kind] = single_stream(engines[label], prompt_ids, args.new_tokens, args.early) \
                    if kind == "single" else scheduled(engines[label], workload, kind, args.slots)
        for label in engines:
            runs[label].append(made[label])
            console.log(f"{artifact.name} repeat {repeat + 1}/{args.repeats} {label}: TPOT "
                        f"{made[label]['single']['tpot_ms']:.2f} ms, continuous {made[label]['continuous']:.1f} "
                        f"tokens/s")
    return {"artifact": str(artifact), "runs": runs, "median": {label: summary(made) for label, made in runs.items()}}


def summary(runs: list[dict]) -> dict:
    median = lambda values: float(np.median(values))  # noqa: E731
    return {"ttft_ms": median([r["single"]["ttft_ms"] for r in runs]),
            "tpot_ms": median([r["single"]["tpot_ms"] for r in runs]),
            "early_gap_ms": median([r["single"]["early_gap_ms"] for r in runs]),
            "later_gap_ms": median([r["single"]["later_gap_ms"] for r in runs]),
            "continuous_tokens_per_s": median([r["continuous"] for r in runs]),
            "static_tokens_per_s": median([r["static"] for r in runs])}


def render(results: list[dict], args, console: Console) -> None:
    beside = f", {args.busy_cores} other processes each keeping a core busy" if args.busy_cores else ""
    table = Table(title=f"onnxruntime threads after a run: stopped (default), decode only spinning, never spinning, "
                        f"both spinning{beside}; medians of {args.repeats} rotating repeats, ratios paired per repeat")
    columns = (("TTFT ms", "ttft_ms"), ("TPOT ms", "tpot_ms"), (f"gap, first {args.early} ms", "early_gap_ms"),
               ("gap, later ms", "later_gap_ms"), ("continuous tok/s", "continuous_tokens_per_s"),
               ("static tok/s", "static_tokens_per_s"))
    for heading in ("artifact", "threads after a run", *(name for name, _ in columns)):
        table.add_column(heading, justify="left" if heading in ("artifact", "threads after a run") else "right")
    for result in results:
        *others, base = ARMS
        for label, values in result["median"].items():
            table.add_row(Path(result["artifact"]).name, label, *(f"{values[key]:.2f}" for _, key in columns))
        for label in others:  # paired: each repeat ran every arm back to back
            ratios = {key: paired_median([summary([run])[key] for run in result["runs"][label]],
                                         [summary([run])[key] for run in result["runs"][base]]) for _, key in columns}
            table.add_row("", f"{label} / {base}", *(f"{ratios[key]:.2f}x" for _, key in columns), style="bold")
    print_table(table, console)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for axis, result in zip(axes[0], results):
        for label, runs in result["runs"].items():
            gaps = np.mean([run["single"]["gaps_ms"] for run in runs], axis=0)
            axis.plot(np.arange(2, len(gaps) + 2), gaps, label=label)
        axis.set(title=Path(result["artifact"]).name, xlabel="output token", ylabel="gap before it, ms (mean)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None, console: Console | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", default=",".join(str(REPO / "artifacts" / name) for name in
                                                        ("smollm2-135m", "smollm2-135m-int4")))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--early", type=int, default=10, help="decode gaps counted as right after the prefill")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--request-prompt", type=int, default=128, help="scheduler requests' prompt tokens")
    parser.add_argument("--request-outputs", default="16:256", help="scheduler requests' output tokens, LOW:HIGH")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--pause", type=float, default=0.5, help="seconds before each run")
    parser.add_argument("--threads", type=thread_count, default=usable_cpus())
    parser.add_argument("--busy-cores", type=int, default=0,
                        help="processes that each keep a core busy while the arms are measured (co-located work)")
    parser.add_argument("--out", type=Path, default=RESULTS / "thread_spinning.json")
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the work, not a traceback after it
    console = console or Console()
    for name in ("repeats", "prompt", "early", "requests", "request_prompt", "slots"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.busy_cores <= usable_cpus():
        raise SystemExit(f"--busy-cores must be 0 to {usable_cpus()} (the CPUs this process may use), got "
                         f"{args.busy_cores}")
    if args.new_tokens <= args.early:
        raise SystemExit(f"--new-tokens ({args.new_tokens}) must exceed --early ({args.early})")
    try:
        args.request_outputs = parse_range(args.request_outputs, "--request-outputs")
    except BenchError as error:
        raise SystemExit(str(error)) from None
    artifacts = [Path(a) for a in args.artifacts.split(",") if a]
    manifests = [check_artifact(artifact, args) for artifact in artifacts]  # all of them before any slow work
    results = [measure(artifact, manifest, args, console) for artifact, manifest in zip(artifacts, manifests)]
    render(results, args, console)
    report = {"settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "arms": ARMS},
              "machine": machine_info(), "versions": versions(), "results": results}
    path = write_result("thread_spinning.json", report, args.out)
    plot(results, path.with_suffix(".png"))
    console.print(f"wrote {path} and {path.with_suffix('.png')}", markup=False)
    return report


if __name__ == "__main__":
    main()
