"""Engine.load(huge_pages=True) against False: decode and prefill times, load time and memory, per artifact.

    .venv/bin/python benchmarks/huge_pages.py [--artifacts artifacts/smollm2-135m,artifacts/smollm2-135m-int4-rtn]
        [--repeats 3] [--contexts 64,2000] [--steps 32] [--prompt 512] [--threads N] [--out PATH]

Each measurement is a fresh process (a process's pages are what is compared), and the two arms alternate, so a
machine that speeds up or slows down during the run moves both. In a process: Engine.load timed, then for each
context C the batch-1 cache is filled with C real tokens (one prefill), 4 warm-up decode steps, then --steps
timed steps (graph + argmax), median; then the prompt's prefill, median of 5 after one warm-up; resident and peak
memory from /proc. Reported: medians over the repeats, and huge / 4 KiB per figure. Prompt tokens are Python's
documentation (pydoc_data.topics), as the other benchmarks use. Writes benchmarks/results/huge_pages.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import artifact_manifest, count_list, output_file, thread_count, usable_cpus  # noqa: E402
from generate import REPO, machine_info, paired_median, prompt_token_ids, versions, write_result  # noqa: E402

from compiler.console import print_table  # noqa: E402  (after arguments: this checkout's)

WARMUP_STEPS = 4
ARMS = ("4 KiB", "huge")


def proc_status_mb(field: str) -> float:
    """A /proc/self/status figure in MB (10**6 bytes, as pass_ab.py's): the file's "kB" are KiB."""
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) * 1024 / 1e6 for line in status if line.startswith(field + ":"))


def child(args) -> dict:
    """One process: load with or without huge pages, then time decode and prefill."""
    from runtime import Engine

    started = time.perf_counter()
    engine = Engine.load(args.artifact, intra_op_threads=args.threads, huge_pages=args.huge)
    load_s = time.perf_counter() - started
    backend, limit = engine.backend, engine.max_context
    ids = prompt_token_ids(args.artifact, engine.manifest, max(args.contexts + [args.prompt]))
    mask = np.ones((1, limit), dtype=np.int64)

    def step(graph: str, tokens: list[int], start: int) -> tuple[float, int]:
        batch = np.array([tokens], dtype=np.int64)
        positions = np.arange(start, start + len(tokens), dtype=np.int64)[None]
        begun = time.perf_counter()
        logits = backend.run(graph, batch, positions, mask[:, : start + len(tokens)])
        return time.perf_counter() - begun, int(logits.reshape(-1, logits.shape[-1])[-1].argmax())

    decode = {}
    for context in args.contexts:
        _, token = step("prefill", ids[:context], 0)
        times = []
        for index in range(WARMUP_STEPS + args.steps):
            seconds, token = step("decode", [token], context + index)
            times.append(seconds)
        decode[context] = 1e3 * float(np.median(times[WARMUP_STEPS:]))
    prefill = [step("prefill", ids[: args.prompt], 0)[0] for _ in range(6)][1:]
    return {"load_s": load_s, "decode_ms": decode, "prefill_ms": 1e3 * float(np.median(prefill)),
            "resident_mb": proc_status_mb("VmRSS"), "peak_mb": proc_status_mb("VmHWM"),
            "huge_pages": engine.huge_pages}


def measure(artifact: Path, huge: bool, args) -> dict:
    command = [sys.executable, __file__, "--child", "--artifact", str(artifact), "--threads", str(args.threads),
               "--contexts", ",".join(map(str, args.contexts)), "--steps", str(args.steps), "--prompt",
               str(args.prompt)] + (["--huge"] if huge else [])
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"the measuring process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", default="artifacts/smollm2-135m,artifacts/smollm2-135m-int4-rtn")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contexts", type=count_list, default=[64, 2000])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--threads", type=thread_count, default=usable_cpus())
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/huge_pages.json)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--artifact", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--huge", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the work, not a traceback after it
    if args.child:
        print(json.dumps(child(args)))
        return {}
    if args.repeats < 1 or args.steps < 1 or not args.contexts:
        parser.error("--repeats and --steps must be >= 1, and --contexts must name at least one context")
    artifacts = [REPO / name if not Path(name).is_absolute() else Path(name) for name in args.artifacts.split(",")]
    for artifact in artifacts:
        limit = artifact_manifest(parser, artifact)["kv_cache"]["max_context"]
        if max(args.contexts) + WARMUP_STEPS + args.steps > limit or args.prompt > limit:
            parser.error(f"{artifact} holds {limit} tokens: every context + {WARMUP_STEPS + args.steps} steps, and "
                         f"the prompt, must fit")
    console = Console(width=None if sys.stdout.isatty() else 200)
    runs = {str(artifact): {arm: [] for arm in ARMS} for artifact in artifacts}
    for repeat in range(args.repeats):
        for artifact in artifacts:
            for arm in (ARMS if repeat % 2 == 0 else ARMS[::-1]):  # alternate which arm goes first
                runs[str(artifact)][arm].append(measure(artifact, arm == "huge", args))
                console.log(f"repeat {repeat + 1}/{args.repeats} {artifact.name} {arm}: "
                            f"{runs[str(artifact)][arm][-1]['decode_ms']}")
    table = Table(title=f"Engine.load(huge_pages=...): medians of {args.repeats} processes per arm, {args.threads} "
                        f"threads; huge / 4 KiB paired per repeat (the two processes run back to back)")
    for column in ("artifact", "figure", *ARMS, "huge / 4 KiB"):
        table.add_column(column, justify="right")
    summary = {}
    for artifact, arms in runs.items():
        figures = {f"decode ms at {c}": lambda r, c=c: r["decode_ms"][str(c)] for c in args.contexts}
        figures.update({f"prefill ms, {args.prompt} tokens": lambda r: r["prefill_ms"], "load s": lambda r: r["load_s"],
                        "resident MB": lambda r: r["resident_mb"], "peak MB": lambda r: r["peak_mb"]})
        summary[artifact] = {}
        for name, read in figures.items():
            medians = {arm: float(np.median([read(r) for r in arms[arm]])) for arm in ARMS}
            paired = paired_median([read(r) for r in arms["huge"]], [read(r) for r in arms["4 KiB"]])
            summary[artifact][name] = {**medians, "ratio": paired,
                                       "ratio_of_medians": medians["huge"] / medians["4 KiB"]}
            table.add_row(Path(artifact).name, name, *(f"{medians[arm]:.2f}" for arm in ARMS), f"{paired:.3f}x")
    print_table(table, console)
    result = {"settings": {k: str(v) for k, v in vars(args).items() if k not in ("child", "artifact", "huge")},
              "machine": machine_info(), "versions": versions(), "summary": summary, "runs": runs}
    console.print(f"wrote {write_result('huge_pages.json', result, args.out)}")
    return result


if __name__ == "__main__":
    main()
