"""The `aotlm` command: build a recipe, run or inspect an artifact.

`run` and `inspect` only use `runtime/` (imported when called), as a deployed artifact would. Bad input
exits with status 2 and one line naming the problem; tracebacks are for bugs only.
"""
from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from rich.table import Table

console = Console(stderr=True)  # progress and tables on stderr; generated text alone on stdout


def _build(args) -> None:
    from compiler.build import build
    from compiler.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    started = time.perf_counter()
    last = [started]

    def progress(message: str) -> None:
        now = time.perf_counter()
        console.log(f"[dim]+{now - last[0]:5.1f}s[/dim] {message}")
        last[0] = now

    with console.status(f"building {recipe.name}"):
        path = build(recipe, args.output, progress=progress)
    console.print(f"[green]built[/green] {path} in {time.perf_counter() - started:.1f} s")


def _run(args) -> None:
    from runtime import Engine

    engine = Engine.load(args.artifact, intra_op_threads=args.threads)
    generation = engine.stream(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    sys.stdout.write(args.prompt)
    for piece in generation:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    timings = generation.result.timings
    table = Table(title=f"{engine.manifest['name']}: {timings.prompt_tokens} prompt tokens, "
                        f"{timings.output_tokens} output tokens ({generation.result.finish_reason})")
    for column in ("TTFT ms", "prefill ms", "TPOT ms", "decode tok/s", "E2E ms"):
        table.add_column(column, justify="right")
    table.add_row(f"{1e3 * timings.ttft_s:.1f}", f"{1e3 * timings.prefill_s:.1f}", f"{1e3 * timings.tpot_s:.2f}",
                  f"{timings.tokens_per_s:.1f}", f"{1e3 * timings.e2e_s:.1f}")
    console.print(table)


def _inspect(args) -> None:
    from runtime.manifest import check_files, read_manifest

    manifest = read_manifest(args.artifact)
    check_files(args.artifact, manifest, verify_hashes=args.verify)
    config = manifest["model"]["config"]
    console.print(f"[bold]{manifest['name']}[/bold]  format v{manifest['format_version']}, built {manifest['created']}")
    console.print(f"model: {config['architecture']}, {config['num_layers']} layers, hidden {config['hidden_size']}, "
                  f"heads {config['num_heads']}/{config['num_kv_heads']} kv, vocab {config['vocab_size']}; "
                  f"source {manifest['model']['source'].get('kind')} {manifest['model']['source'].get('path', '')}")
    kv = manifest["kv_cache"]
    console.print(f"kv cache: {kv['layout']}, max context {kv['max_context']}, "
                  f"{kv['bytes_per_token'] / 1024:.1f} KiB per token")
    backend = manifest["backend"]
    console.print(f"backend: {backend['name']} {backend['version']}, session {backend.get('session')}")
    engines = Table(title="engines")
    for column in ("phase", "file", "inputs", "outputs"):
        engines.add_column(column)
    for phase, engine in manifest["engines"].items():
        describe = lambda items: ", ".join(f"{i['name']}{i['shape']}" for i in items[:3]) + (  # noqa: E731
            f" (+{len(items) - 3} kv)" if len(items) > 3 else "")
        engines.add_row(phase, engine["file"], describe(engine["inputs"]), describe(engine["outputs"]))
    console.print(engines)
    passes = Table(title="passes")
    for column in ("pass", "phase", "seconds", "summary"):
        passes.add_column(column)
    for result in manifest["passes"]:
        report = result["report"]
        summary = ", ".join(f"{k}={v}" for k, v in report.items() if isinstance(v, (int, float, str)))[:100]
        passes.add_row(result["name"], result["phase"], f"{result['seconds']:.2f}", summary)
    console.print(passes)
    files = Table(title="files" + (" (sha256 verified)" if args.verify else " (sizes checked; --verify hashes)"))
    files.add_column("file")
    files.add_column("MiB", justify="right")
    for name, record in manifest["files"].items():
        files.add_row(name, f"{record['bytes'] / 2**20:.2f}")
    console.print(files)


def _plan(args) -> None:
    import json

    from compiler.plan import plan, render

    result = plan(args.source, device=args.device, precision=args.precision, kv_dtype=args.kv_dtype,
                  context=args.context, concurrency=args.concurrency, prompt=args.prompt, remeasure=args.remeasure)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        render(result, console)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="aotlm", description="Ahead-of-time compiler for language-model inference")
    commands = root.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build a recipe into artifacts/<name>/")
    build.add_argument("recipe")
    build.add_argument("--output", default="artifacts", help="folder that receives <name>/ (default: artifacts)")
    build.set_defaults(handler=_build)
    run = commands.add_parser("run", help="generate from an artifact, then print timings")
    run.add_argument("artifact")
    run.add_argument("--prompt", required=True)
    run.add_argument("--max-new-tokens", type=int, default=64)
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: artifact's)")
    run.set_defaults(handler=_run)
    inspect = commands.add_parser("inspect", help="summarize an artifact's manifest")
    inspect.add_argument("artifact")
    inspect.add_argument("--verify", action="store_true", help="also check every file's sha256")
    inspect.set_defaults(handler=_inspect)
    plan = commands.add_parser("plan", help="memory and lower-bound latency of a model on a device")
    plan.add_argument("source", help="a recipe (.yaml), a Hugging Face config.json (or its folder), a .gguf file, "
                                     "or an artifact folder")
    plan.add_argument("--device", required=True,
                      help="H100, H200, A100, L40S, L4, RTX4090, or cpu (this machine, measured)")
    plan.add_argument("--precision", choices=("fp32", "fp16", "bf16", "int8", "int4"), default=None,
                      help="weight precision (default: fp16 on GPUs, fp32 on cpu)")
    plan.add_argument("--kv-dtype", choices=("fp32", "fp16", "int8"), default=None,
                      help="KV-cache dtype (default: fp16 on GPUs, fp32 on cpu)")
    plan.add_argument("--context", type=int, default=None,
                      help="tokens per request (default: the recipe's or artifact's max context, else the model's)")
    plan.add_argument("--concurrency", type=int, default=1, help="sequences decoded together (default: 1)")
    plan.add_argument("--prompt", type=int, default=None,
                      help="prompt tokens for the prefill bound (default: min(512, context))")
    plan.add_argument("--remeasure", action="store_true", help="cpu: measure again instead of using the cached figures")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON on stdout")
    plan.set_defaults(handler=_plan)
    return root


def main(argv: list[str] | None = None) -> int:
    from compiler.errors import BuildError
    from runtime.errors import AotlmRuntimeError

    args = parser().parse_args(argv)
    try:
        args.handler(args)
    except (BuildError, AotlmRuntimeError) as error:
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
