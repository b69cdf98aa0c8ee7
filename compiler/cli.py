"""The `aotlm` command: build a recipe; run, inspect, benchmark or evaluate an artifact.

`run`, `inspect`, `eval` and `compare` only use `runtime/` (imported when called), as a deployed artifact
would. Bad input exits with status 2 and one line naming the problem; tracebacks are for bugs only.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from compiler.cli_chat import add_chat_parser
from compiler.cli_serve import add_serve_parser
from compiler.cli_evaluate import add_evaluation_options, compare_command, eval_command
from compiler.cli_sampling import add_sampling_options, sampling_options
from compiler.console import (ReaderAwareConsole, console, error, message, print_table, warning,
                              whole_writes_to_stdout)
from compiler.errors import (NO_SPIN_HELP, UsageError, check_output_file, exception_chain, nonnegative_int,
                             positive_float, positive_int, text_argument, thread_count, user_path)
from runtime.errors import AotlmWarning

DEFAULT_PROMPT_LENGTHS = "128,512,1024"  # bench --phase prefill
INSPECT_SUMMARY_CHARACTERS = 240  # a pass's summary in `aotlm inspect`'s table; --json prints the whole report
# The extra that installs a module a command may need beyond the runtime's (pyproject.toml)
EXTRAS = {**dict.fromkeys(("onnx", "onnxscript", "onnx_graphsurgeon", "torch", "gguf", "safetensors", "yaml"),
                          "compiler"), "onnxruntime": "cpu", "matplotlib": "bench", "onnxruntime_genai": "bench"}
DEFAULT_CONTEXTS = "64,512,1024,2000"  # bench --phase decode
# bench flags that apply to one kind of run only, with their defaults (argparse's are None: "given" is not None)
BENCH_SERVED = {"requests": 32, "arrival": "all", "concurrency": None, "rate": None, "prompt_tokens": "128",
                "output_tokens": "64", "warmup": 1, "slo_ttft_ms": None, "slo_tpot_ms": None, "slo_e2e_ms": None, "batching": None,
                "slots": None, "prefill_chunk": None, "seed": 0, "shared_prefix": 0, "prefix_caching": False}
BENCH_PHASE = {"prompt_lengths": ("prefill", None), "runs": ("prefill", 5), "contexts": ("decode", None),
               "steps": ("decode", 32), "batch": (None, 1)}  # None: both phases


def _build(args) -> None:
    from compiler.build import build
    from compiler.recipe import find_recipe, ignored_settings, load_recipe

    if not args.output.strip():  # an unset $OUT: it built into the current folder
        raise UsageError("--output is empty (an unset variable?); give the folder that receives <name>/, e.g. "
                         "artifacts")
    path = find_recipe(args.recipe)
    if not Path(args.recipe).is_file():  # a name: say which file it is
        message(f"recipe {escape(args.recipe)}: {escape(str(path))} (it comes with aotlm)")
    recipe = load_recipe(path)
    for text in ignored_settings(recipe):
        warning(text)
    started = time.perf_counter()
    last = [started]

    def progress(step: str) -> None:
        now = time.perf_counter()
        # One line per step, however narrow a pipe (console.log's columns cut it in two and named this file's line)
        message(f"[dim]{time.strftime('%H:%M:%S')} +{now - last[0]:5.1f}s[/dim] {escape(step)}")
        last[0] = now

    manifest: dict = {}  # what this build wrote: another build of the name may have replaced it by the time it prints
    swap: dict = {}  # whether it replaced an artifact, as the swap found it (one another build made meanwhile too)
    try:
        with console.status(f"building {escape(recipe.name)}"):
            path = build(recipe, args.output, progress=progress, dump_dir=args.dump_passes, written=manifest,
                         swap=swap)
    except OSError as full:  # a write's error names no file: say which disks the build writes
        if full.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or full.filename:
            raise
        raise OSError(full.errno, full.strerror, f"{args.output}, where the artifact is written (replacing one needs "
                                                 f"room for both), or the temporary folder {tempfile.gettempdir()}, "
                                                 f"where the graphs are traced (TMPDIR)") from None
    from compiler.pass_reports import PassResult, format_accuracy, format_reports, idle_passes, partly_fused

    passes = [PassResult(**result) for result in manifest["passes"]]
    if passes:
        console.print(format_reports(passes), highlight=False)
        for text in idle_passes(passes) + partly_fused(passes):
            warning(text)
    if "accuracy" in manifest:
        # one line per line however narrow a pipe (a grep of CI logs for "perplexity:.*KL"), and not markup: it
        # names the user's text file
        console.print(format_accuracy(manifest["accuracy"]), highlight=False, soft_wrap=True, markup=False)
    replaced = " (it replaced the artifact that was there)" if swap.get("replaced") else ""
    message(f"[green]built[/green] {escape(str(path))} in {time.perf_counter() - started:.1f} s{replaced}")


def _shortened(text: str, limit: int = INSPECT_SUMMARY_CHARACTERS) -> str:
    """At most `limit` characters, cut after a whole word and marked as cut."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(",") + " …"


def _run(args) -> None:
    from runtime import Engine
    from runtime.engine import SINGLE_STREAM_SPIN
    from runtime.manifest import read_manifest

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.system is not None and args.chat is None:
        raise UsageError("--system goes with --chat (a system message for the chat template)")
    from compiler.cli_chat import checked_system

    checked_system(args.system)
    manifest = read_manifest(args.artifact)
    sampling = sampling_options(args, manifest)  # flags greedy decoding would ignore, bad values: refused before loading
    if args.chat is not None and not manifest["tokenizer"].get("chat_template"):
        raise UsageError(f"{args.artifact}: its model has no chat template; use --prompt for plain text")

    # One request: rebuilding the weights on huge pages (seconds) would cost more than its faster steps save. Its
    # decode session keeps spinning between steps (no scheduler alternates it with prefills here): single-stream
    # TPOT 0.95-0.97x with it, paired over 12-30 rounds (README, "Threads after a run").
    engine = Engine.load(args.artifact, intra_op_threads=args.threads, huge_pages=False,
                         spin_after_run=SINGLE_STREAM_SPIN, generation_config=args.generation_config,
                         spin_during_run=not args.no_spin)
    received = time.perf_counter()  # TTFT counts from here: a chat template's rendering is inside it
    if args.chat is not None:  # the reply alone: the prompt is the template's formatting of the messages
        # --system "": an empty system message, which keeps a template's default one out (SmolLM2's, Qwen's)
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
            {"role": "user", "content": args.chat}]
        prompt, shown = engine.chat_prompt_ids(messages), ""
    else:
        prompt, shown = args.prompt, args.prompt
    generation = engine.stream(prompt, arrival=received, **sampling)
    sys.stdout.write(shown)
    try:
        for piece in generation:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:  # the notice (stderr) goes on a line of its own, not after the text on a terminal
        with contextlib.suppress(OSError):  # a terminal that hung up takes no newline
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    sys.stdout.write("\n")
    timings = generation.result.timings
    count = lambda number, noun: f"{number} {noun}{'' if number == 1 else 's'}"  # noqa: E731
    table = Table(title=f"{escape(engine.manifest['name'])}: {count(timings.prompt_tokens, 'prompt token')}, "
                        f"{count(timings.output_tokens, 'output token')} ({generation.result.finish_reason})")
    for column in ("TTFT ms", "prefill ms", "TPOT ms", "decode tok/s", "E2E ms"):
        table.add_column(column, justify="right")
    decoded = timings.output_tokens >= 2  # TPOT and decode speed need a token after the first
    table.add_row(f"{1e3 * timings.ttft_s:.1f}", f"{1e3 * timings.prefill_s:.1f}",
                  f"{1e3 * timings.tpot_s:.2f}" if decoded else "-", f"{timings.tokens_per_s:.1f}" if decoded else "-",
                  f"{1e3 * timings.e2e_s:.1f}")
    print_table(table)
    if generation.result.finish_reason == "max_context":  # the batch-1 path runs to the cache's end, not refusing
        # prompt + generated is one more than the cache holds: the last token is sampled, never fed back
        message(f"[yellow]note:[/yellow] stopped at the artifact's max context of {engine.max_context} tokens, "
                f"where a {timings.prompt_tokens}-token prompt leaves room for "
                f"{len(generation.result.token_ids)} new tokens, before --max-new-tokens "
                f"{args.max_new_tokens}; ask for at most {engine.max_context + 1 - timings.prompt_tokens}, "
                f"shorten the prompt, or rebuild with a larger export.max_context")


def _inspect(args) -> None:
    from runtime.errors import ArtifactError
    from runtime.manifest import check_files, read_manifest
    from runtime.results import json_text

    manifest = read_manifest(args.artifact)
    check_files(args.artifact, manifest, verify_hashes=args.verify)
    if args.json:  # everything, pass reports whole: for a script, or a person reading what the table shortens
        sys.stdout.write(json_text(manifest))
        return
    # The summary is this command's output: stdout, as --json's (`aotlm inspect A | less`, `> summary.txt`); errors
    # stay on stderr. The stderr console's width: a terminal's, or the tests' wide one.
    out = ReaderAwareConsole(file=sys.stdout, width=console.width, emoji=False)
    try:
        with out.capture() as summary:  # all or nothing: not half a summary, then an error
            _summarize(manifest, args.verify, out)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as problem:  # read_manifest checks what the
        # runtime needs; the summary reads the rest (pass reports, accuracy...), which an edit can break
        raise ArtifactError(f"{args.artifact}/manifest.json: a field the summary reads is missing or malformed "
                            f"({type(problem).__name__}: {problem}); rebuild the artifact, or read the manifest as it "
                            f"is with `aotlm inspect --json`") from None
    sys.stdout.write(summary.get())


def _listed(values) -> str:
    """A manifest's list as a reader writes it: [batch, 3, 2048, 64], not Python's ['batch', 3, 2048, 64]."""
    return f"[{', '.join(map(str, values))}]" if isinstance(values, list) else str(values)


def _summarize(manifest: dict, verified: bool, out: Console) -> None:
    """`aotlm inspect`'s summary of a manifest, printed on `out`."""
    config = manifest["model"]["config"]
    from runtime.manifest import required_features

    # what this runtime enforces: a format-1 artifact's needs are read from its contents, not a `requires` list
    required = list(dict.fromkeys([*(manifest.get("requires") or []), *required_features(manifest)]))
    needs = f" (requires {', '.join(required)})" if required else ""
    out.print(f"[bold]{escape(str(manifest['name']))}[/bold]  format v{manifest['format_version']}{escape(needs)}, "
              f"built {manifest['created']}", highlight=False, soft_wrap=True)
    tools = manifest.get("tools") or {}
    source = tools.get("aotlm_source")
    built_by = f"built by aotlm {tools['aotlm']}" if isinstance(tools.get("aotlm"), str) else ""
    if isinstance(source, dict) and source.get("commit"):  # which compiler built it (older builds: unrecorded)
        built_by = ((built_by or "built by aotlm") + f" at commit {str(source['commit'])[:12]}"
                    + (" with uncommitted changes to compiler/, passes/ or runtime/" if source.get("modified") else ""))
    sources = tools.get("aotlm_sources_sha256")
    if isinstance(sources, str) and not (isinstance(source, dict) and source.get("commit")):
        built_by = (built_by or "built by aotlm") + f" (sources sha256 {sources[:12]})"  # a wheel's: no commit
    if built_by:  # a wheel's build records its version and no commit
        out.print(escape(built_by), highlight=False, soft_wrap=True)
    source = manifest["model"]["source"]
    source = " ".join(str(part) for part in (source.get("kind"), source.get("path")) if part)  # random: no path
    out.print(f"model: {config['architecture']}, {config['num_layers']} layers, hidden {config['hidden_size']}, "
              f"heads {config['num_heads']}/{config['num_kv_heads']} kv, vocab {config['vocab_size']}; "
              f"source {escape(source)}", highlight=False, soft_wrap=True)
    kv = manifest["kv_cache"]
    out.print(f"kv cache: {escape(_listed(kv['layout']))} {kv.get('dtype', 'float32')}, max context {kv['max_context']}, "
              f"{kv['bytes_per_token'] / 1024:.2f} KiB per token", soft_wrap=True)
    quantized = [r for r in manifest["passes"] if r["name"] == "quantize" and r["phase"] == "decode"]
    dtype = manifest.get("recipe", {}).get("export", {}).get("dtype", "float32")
    out.print(f"weights: {_quantized_formats(quantized[0]['report']) if quantized else dtype + ' (not quantized)'}",
                  highlight=False, soft_wrap=True)
    template = manifest["tokenizer"].get("chat_template")
    out.print(f"chat template: {escape(template) + ' (aotlm run --chat, Engine.chat)' if template else 'none'}",
                  highlight=False, soft_wrap=True)
    from compiler.frontend.generation_defaults import UNRECORDED as UNRECORDED_DEFAULTS
    from compiler.frontend.generation_defaults import describe as describe_defaults

    defaults = describe_defaults(manifest.get("generation_defaults"))
    stops = manifest["tokenizer"].get("eos_token_ids") or []
    out.print(escape(f"generation: stops at token ids {stops or 'none'}; model defaults "
                     + (f"{defaults}, applied to options a request leaves out (--generation-config none: aotlm's)"
                        if defaults else "none (aotlm's: greedy)" if "generation_defaults" in manifest else
                        f"{UNRECORDED_DEFAULTS} (meanwhile aotlm's: greedy)")), highlight=False, soft_wrap=True)
    backend = manifest["backend"]
    session = backend.get("session")
    session = ", ".join(f"{key} {value}" for key, value in session.items()) if isinstance(session, dict) else session
    out.print(escape(f"backend: {backend['name']} {backend['version']}, session: {session}"),
              highlight=False, soft_wrap=True)
    engines = Table(title="engines")
    for column in ("phase", "file", "inputs", "outputs"):
        engines.add_column(column)
    for phase, engine in manifest["engines"].items():
        describe = lambda items: ", ".join(f"{i['name']}{_listed(i['shape'])}" for i in items[:3]) + (  # noqa: E731
            f" (+{len(items) - 3} kv)" if len(items) > 3 else "")
        engines.add_row(*map(escape, (phase, engine["file"], describe(engine["inputs"]), describe(engine["outputs"]))))
    print_table(engines, out)
    if "prefill" in manifest["engines"]:
        takes_past = manifest["engines"]["prefill"].get("takes_past") is True
        out.print("prefill after cached tokens: " + ("yes (a prompt's rest after a cached prefix, and later chunks, "
                      "run through the prefill graph)" if takes_past else "no (they run through the decode graph)"),
                  soft_wrap=True)
    passes = Table(title="passes", caption="whole reports: aotlm inspect --json")
    for column in ("pass", "phase", "seconds", "summary"):
        passes.add_column(column)
    for result in manifest["passes"]:
        report = result["report"]
        flat = {**report, **report.get("totals", {})}  # quantize keeps its counts under totals
        summary = ", ".join(f"{k}={v}" for k, v in flat.items() if isinstance(v, (int, str))
                            or (isinstance(v, float) and not k.endswith("error")))
        passes.add_row(result["name"], result["phase"], f"{result['seconds']:.2f}", escape(_shortened(summary)))
    print_table(passes, out)
    from compiler.pass_reports import PassResult, format_accuracy, idle_passes, partly_fused

    results = [PassResult(**result) for result in manifest["passes"]]
    for text in idle_passes(results) + partly_fused(results):
        warning(text, out)
    if "accuracy" in manifest:
        out.print(format_accuracy(manifest["accuracy"]), highlight=False, soft_wrap=True, markup=False)
    files = Table(title="files" + (" (sha256 verified)" if verified else " (sizes checked; --verify hashes)"))
    files.add_column("file")
    files.add_column("MiB", justify="right")
    for name, record in manifest["files"].items():
        files.add_row(escape(name), f"{record['bytes'] / 2**20:.2f}")
    print_table(files, out)


def _quantized_formats(report: dict) -> str:
    """One line from a quantize report: how many MatMuls in which format, the embedding, bytes before -> after."""
    formats: dict[str, int] = {}
    for layer in report.get("layers", []):
        # INT8 is per output channel (its grid: one block of K; MatMulNBits repeats the channel's scale in blocks)
        grid = "per channel" if layer["bits"] == 8 else f"block {layer['block_size']}"
        kind = f"{layer['method']} int{layer['bits']} {grid}{'' if layer.get('symmetric', True) else ' asymmetric'}"
        formats[kind] = formats.get(kind, 0) + 1
    parts = [f"{count} x {kind}" for kind, count in formats.items()] or ["none quantized"]
    kept = sum(1 for skipped in report.get("skipped", [])
               if skipped["reason"].startswith(("kept float by", "excluded by")))
    if kept:  # what the recipe's skip and exclude kept float (not the products without a weight)
        parts.append(f"{kept} kept float")
    embedding = report.get("embedding", {})
    if embedding.get("quantized"):
        grid = "per row" if embedding["bits"] == 8 else f"block {embedding['block_size']}"
        parts.append(f"embedding int{embedding['bits']} {grid}")
    totals = report.get("totals", {})
    if "weight_bytes_before" in totals:
        parts.append(f"{totals['weight_bytes_before'] / 2**20:.1f} -> {totals['weight_bytes_after'] / 2**20:.1f} MiB")
    return "; ".join(parts)


def _plan(args) -> None:
    from compiler.plan import plan, render
    from runtime.results import json_text

    result = plan(args.source, device=args.device, precision=args.precision, kv_dtype=args.kv_dtype,
                  context=args.context, concurrency=args.concurrency, prompt=args.prompt, remeasure=args.remeasure)
    if args.json:
        sys.stdout.write(json_text(result))
    else:
        render(result)


def _check_bench_flags(args) -> None:
    """Refuse flags the chosen kind of run would ignore (they used to exit 0 as if used), then fill defaults."""
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    given = lambda names: [flag(n) for n in names if getattr(args, n) is not None]  # noqa: E731
    if args.phase:
        served = given(BENCH_SERVED)
        if served:
            raise UsageError(f"{', '.join(served)}: {'they shape' if len(served) > 1 else 'it shapes'} a served "
                             f"workload and {'do' if len(served) > 1 else 'does'} not apply to --phase {args.phase}; "
                             f"drop {'them' if len(served) > 1 else 'it'}, or drop --phase")
        other = given([name for name, (phase, _) in BENCH_PHASE.items() if phase not in (None, args.phase)])
        if other:
            raise UsageError(f"{', '.join(other)}: for --phase {'decode' if args.phase == 'prefill' else 'prefill'} "
                             f"only, not --phase {args.phase}")
    else:
        phase_only = given(BENCH_PHASE)
        if phase_only:
            raise UsageError(f"{', '.join(phase_only)}: for --phase prefill or decode (timing one graph), not a served "
                             f"workload; add --phase, or drop {'them' if len(phase_only) > 1 else 'it'}")
    for name, default in [*BENCH_SERVED.items(), *((n, d) for n, (_, d) in BENCH_PHASE.items())]:
        if getattr(args, name) is None:
            setattr(args, name, default)


def _bench(args) -> None:
    from rich.progress import Progress

    from runtime import Engine, bench
    from runtime.manifest import read_manifest
    from runtime.metrics import format_table
    from runtime.results import write_json
    from runtime.tokenizer import TextTokenizer

    _check_bench_flags(args)
    manifest = read_manifest(args.artifact)  # a folder that is not an artifact fails here, in one line
    record = _run_record(args.artifact, manifest)  # now: the JSON names the artifact the workload is sized for

    def load_engine(**options):
        """Engine.load, refused where a build replaced the artifact since bench read it (the workload was sized for
        that one, and the JSON names it)."""
        # greedy, as the workload says and the baselines run: not a model's sampling defaults
        engine = Engine.load(args.artifact, generation_config="none", spin_during_run=not args.no_spin, **options)
        if engine.manifest != manifest:
            engine.close()
            raise bench.BenchError(f"{args.artifact} was replaced (a build finished there) while bench ran; run "
                                   f"bench again once the build is done")
        return engine
    name, max_context = manifest["name"], manifest["kv_cache"]["max_context"]
    if not args.out:  # the default path, under the current folder, is checked before the work as a given one is
        args.out = f"benchmarks/results/bench-{name}{'-' + args.phase if args.phase else ''}.json"
    check_output_file(args.out, "--out")
    from runtime.results import is_stream, shown_path

    # the plots beside the JSON (none beside a stream): a folder by their names was a traceback after the whole run
    if not args.phase and not is_stream(args.out):
        stem = Path(args.out).with_suffix("")
        for plot in (f"{stem}-cdf.png", f"{stem}-timeline.png"):
            check_output_file(plot, "--out's plot")
    from runtime.cpus import usable_cpus

    threads = args.threads or usable_cpus()  # every backend gets the same count: the CPUs this process may use
    text = bench.read_prompt_file(args.prompt_file)
    baselines = bench.check_baselines(args.baseline or [])
    if args.phase and baselines:
        raise bench.BenchError("--baseline compares served workloads; it does not apply to --phase")
    if args.phase:
        from compiler.frontend.config import DecoderConfig
        from compiler.plan import artifact_step_weight_bytes, count_params, cpu_device, prefill_flops, prefill_shape

        option, given, default = (("--prompt-lengths", args.prompt_lengths, DEFAULT_PROMPT_LENGTHS)
                                  if args.phase == "prefill" else ("--contexts", args.contexts, DEFAULT_CONTEXTS))
        # a prefill of C tokens needs C < max context; a decode at context C also its warm-up and timed steps
        largest = max_context - 1 if args.phase == "prefill" else max_context - bench.DECODE_WARMUP_STEPS - args.steps
        if largest < 1:  # no context is left to time at: "decode size 1 does not fit" named a size nobody gave
            raise bench.BenchError(f"--steps {args.steps} + {bench.DECODE_WARMUP_STEPS} warm-up steps fill this "
                                   f"artifact's max context ({max_context}) with no context left to time them at; "
                                   f"give --steps {max_context - bench.DECODE_WARMUP_STEPS - 1} or fewer")
        sizes = bench.parse_sizes(given, max_context, option) if given else bench.sizes_that_fit(default, largest)
        device = cpu_device()  # measured once per machine, cached under ~/.cache/aotlm/
        peaks = {"flops": device["fp32"], "bandwidth": device["bandwidth"], "device": device["name"]}
        config = DecoderConfig.from_dict(manifest["model"]["config"])
        counts = count_params(config)
        params = counts["total"]
        engine = load_engine(intra_op_threads=threads)
        prompt_ids = bench.text_token_ids(engine.tokenizer.encode, max(sizes), text)
        with console.status(f"timing {args.phase} at {', '.join(map(str, sizes))}"):
            rows = bench.time_phase(engine, args.phase, sizes, prompt_ids, batch=args.batch, runs=args.runs,
                                    steps=args.steps, peaks=peaks,
                                    flops_for=lambda tokens: prefill_flops(counts, config, tokens,
                                                                           prefill_shape(manifest.get("recipe", {}))),
                                    weight_bytes_per_step=(artifact_step_weight_bytes(args.artifact)
                                                           if args.phase == "decode" else None))
        print_table(bench.phase_table(args.phase, rows, peaks))
        shown = f"peaks: {peaks['device']}; {params / 1e6:.1f} M params; {threads} threads" + (
            ", never spinning (--no-spin)" if args.no_spin else "")
        message(f"[dim]{escape(shown)}[/dim]")
        counted = {"runs": args.runs} if args.phase == "prefill" else {"steps": args.steps}  # what the phase used
        settings = {**record, "phase": args.phase, "batch": args.batch, **counted,
                    "threads": threads, "spin_during_run": not args.no_spin}
        out = write_json(args.out, {"settings": settings, "params": params, "peaks": peaks, "rows": rows})
        if is_stream(args.out):  # no plot beside a stream ("-" had left ./--steps.png)
            message(escape(f"wrote {shown_path(out)}"))
            return
        plot = bench.write_phase_plot(rows, args.phase, out)
        message(escape(f"wrote {out}" + (f", {plot}" if plot else f"; {bench.PLOT_SKIPPED}")))
        return
    tokenizer = TextTokenizer(Path(args.artifact) / manifest["tokenizer"]["file"], manifest["tokenizer"].get("bos_token_id"))
    workload = bench.make_workload(
        tokenizer.encode, max_context=max_context, requests=args.requests, arrival=args.arrival,
        concurrency=args.concurrency, rate=args.rate, prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens, warmup=args.warmup, seed=args.seed, text=text,
        shared_prefix=args.shared_prefix)
    slo = {key: value for key, value in (("ttft_ms", args.slo_ttft_ms), ("tpot_ms", args.slo_tpot_ms),
                                         ("e2e_ms", args.slo_e2e_ms)) if value is not None}
    modes = list(dict.fromkeys(args.batching or ["continuous"]))  # several: served one after another, compared
    slots = args.slots if args.slots is not None else workload.concurrency if args.arrival == "concurrency" else 8
    for flag, value in (("--slots", slots), ("--prefill-chunk", args.prefill_chunk)):
        if value is not None and value < 1:  # checked before the progress bar starts drawing
            raise bench.BenchError(f"{flag} must be >= 1, got {value}")
    if manifest["backend"]["name"] == "onnxruntime":  # the scheduler's slot cache, in this machine's memory
        from runtime.onnxruntime_backend import check_slot_memory

        check_slot_memory(slots, manifest["kv_cache"]["bytes_per_token"] * max_context,
                          int8_cache=manifest["kv_cache"]["dtype"] == "int8")
    queue_room = len(workload.requests) + len(workload.warmup)  # every request may wait: none is refused
    loaders = {("aotlm" if len(modes) == 1 else f"aotlm-{mode}"): (lambda mode=mode: bench.ScheduledServer(
        load_engine(intra_op_threads=threads, prefix_caching=args.prefix_caching), mode, slots,
        queue_room, args.prefill_chunk)) for mode in modes}
    if baselines:  # benchmarks/baselines.py (generate.py's model setup): a source checkout with the bench extras
        checkout = Path(__file__).resolve().parents[1] / "benchmarks"
        if not (checkout / "baselines.py").is_file():  # an installed package has no benchmarks/
            raise bench.BenchError(f"--baseline runs from a source checkout of aotlm ({checkout} is not there: "
                                   f"benchmarks/ is not installed with the package)")
        sys.path.insert(0, str(checkout))
        import baselines as peers

        peers.check_installed(baselines)  # before anything is served: aotlm's run is not lost to a missing peer
        loaders.update({peer: (lambda peer=peer: peers.load(peer, manifest, threads, console)) for peer in baselines})
    runs, failures, lateness = {}, {}, {}
    with Progress(console=console) as progress:
        for backend, load in loaders.items():  # one after another, never at once
            task = progress.add_task(f"{backend:18}", total=len(workload.requests) + len(workload.warmup))
            serve = load()
            failures[backend] = []  # a failed request is counted and said, as vLLM's bench does; the rest is measured
            lateness[backend] = []
            try:
                traces = bench.run_workload(serve, workload, on_done=lambda task=task: progress.advance(task),
                                            failures=failures[backend], lateness=lateness[backend])
            finally:
                getattr(serve, "close", lambda: None)()  # stop a scheduler's worker thread
                del serve  # free its weights before the next backend loads
            runs[backend] = traces  # None where a request failed: report keeps each trace's request index
            if failures[backend]:
                first = failures[backend][0]
                warning(f"{backend}: {len(failures[backend])} of {len(traces)} requests failed (request "
                        f"{first['request']}: {first['error']}); the metrics are the completed requests'")
            if all(trace is None for trace in traces):
                raise bench.BenchError(f"{backend}: every request failed; the first: {first['error']}")
    # --no-spin is aotlm's engine's: the baselines' onnxruntime threads spin as their own defaults have them
    settings = {**record, "threads": threads, "spin_during_run": not args.no_spin, "backends": list(runs),
                "baselines": baselines, "batching": modes,
                "slots": slots, "prefill_chunk": args.prefill_chunk, "prefix_caching": args.prefix_caching,
                "prompt_source": args.prompt_file or "pydoc_data.topics (sorted, joined)",
                "decoding": "greedy, stop tokens disabled", "slo": slo or None, "prompt_tokens_asked": args.prompt_tokens,
                "output_tokens_asked": args.output_tokens, **workload.settings()}
    result = bench.report(settings, runs, slo=slo or None, failures=failures, lateness=lateness)
    for backend, entry in result["backends"].items():
        if late := bench.late_sends(entry):
            warning(f"{backend}: {late}")
    # a pipe would get 80 columns; a reader that left loses the tables, not the JSON written after them
    wide = console if console.is_terminal else ReaderAwareConsole(stderr=True, width=160, emoji=False)
    for backend, entry in result["backends"].items():
        table = format_table(entry["summary"])
        table.title = f"{backend}: {table.title}"
        print_table(table, wide)
    if len(runs) > 1:
        print_table(bench.compare_table(result), wide)
    if len(runs) > 1:  # each backend served once, one after another: a shared host's drift is in the ratios
        wide.print("[dim]one run per backend, one after another: on a shared machine repeat the command and compare "
                   "medians (benchmarks/ pair their runs round by round)[/dim]", highlight=False)
    if baselines and args.prefix_caching:
        wide.print(f"[dim]aotlm served with prefix caching; {', '.join(baselines)} without it[/dim]", highlight=False)
    if baselines:  # a quantized artifact against float peers: say so beside the numbers
        from compiler.plan import quantized_dtypes

        built = quantized_dtypes(manifest.get("recipe", {}).get("passes", []))
        wide.print(f"[dim]{', '.join(baselines)}: float32 weights and cache, from the artifact's model source; "
                   f"{name}: {built.get('dtype', 'float32')} weights, {built.get('kv_dtype', 'float32')} cache[/dim]",
                   highlight=False)
    try:
        written = bench.write_outputs(result, Path(args.out))
    except bench.BenchError as problem:  # no matplotlib: the JSON is written, the plots are not
        warning(str(problem))
        return
    message("wrote " + escape(", ".join(map(shown_path, written))))


def _run_record(artifact: str, manifest: dict) -> dict:
    """What a bench JSON needs to say which run it is: when, on which artifact (its folder as given and resolved, its
    name and manifest's sha256: a rebuild at the same path is another artifact), by which aotlm, and how its numbers
    are made. manifest: the one bench read."""
    import hashlib
    from datetime import datetime, timezone

    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "artifact": str(artifact),
            "artifact_path": str(Path(artifact).resolve()), "artifact_name": manifest["name"],
            "manifest_sha256": hashlib.sha256((Path(artifact) / "manifest.json").read_bytes()).hexdigest(),
            # its files' hashes alone: two builds of one recipe have the same (their manifests' times differ)
            "artifact_files_sha256": hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest(),
            "aotlm": _aotlm_version(),
            "percentiles": "numpy's linear interpolation",
            "trace_times": "seconds since the backend's run started (its first arrival; with --arrival poisson, one "
                           "gap before it)"}


def _aotlm_version() -> str:
    """The package version, and the commit of a source checkout (with "+dirty" for uncommitted changes)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("aotlm")
    except PackageNotFoundError:
        installed = "not installed"
    repo = Path(__file__).resolve().parents[1]
    if not (repo / ".git").exists():  # an installed package: a git folder above it would be another project's
        return installed
    try:
        commit = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty=+dirty"], capture_output=True,
                                encoding="utf-8", errors="replace", timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{installed} ({commit})" if commit else installed


class _PrintVersion(argparse.Action):
    """--version, read only when asked for (a checkout's version runs git)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"aotlm {_aotlm_version()}", flush=True)  # a write error here reaches main's handlers
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse's, but a help or usage text that cannot be written raises (main turns it into an error line and
    status 2): argparse drops the OSError, so `aotlm --help > /dev/full` wrote nothing and exited 0."""

    def _print_message(self, message: str, file=None) -> None:
        file = file or sys.stderr
        if message and file is not None:  # a closed stderr (2>&-) is None: nothing to write to, as argparse's
            file.write(message)


def parser() -> argparse.ArgumentParser:
    root = _Parser(
        prog="aotlm", description="Ahead-of-time compiler for language-model inference",
        epilog="exit status: 0 done; 2 bad input or a refused write (one error: line); 130, 143, 129 after Ctrl-C, "
               "SIGTERM, SIGHUP; 141 when stdout's reader left; 1 (a traceback) is a bug")
    root.add_argument("--version", action=_PrintVersion, nargs=0, help="print aotlm's version and exit")
    commands = root.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build a recipe into artifacts/<name>/")
    build.add_argument("recipe", type=user_path, help="the recipe YAML file, or the name of one that comes with aotlm "
                                      "(smollm2-135m; an unknown name lists them)")
    build.add_argument("--output", type=user_path, default="artifacts", help="folder that receives <name>/ (default: artifacts)")
    build.add_argument("--dump-passes", type=user_path, metavar="DIR", default=None,
                       help="also write each pass's output graph per phase into DIR (NN-pass-phase.onnx), to bisect "
                            "a parity failure pass by pass; each takes about the weights' size")
    build.set_defaults(handler=_build)
    run = commands.add_parser("run", help="generate from an artifact, then print timings")
    run.add_argument("artifact", type=user_path, help="an artifact folder (built by `aotlm build`)")
    given = run.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", type=text_argument, help="the text to continue")
    given.add_argument("--chat", metavar="MESSAGE", type=text_argument,
                       help="a user message, formatted by the model's chat template; prints the assistant's reply")
    run.add_argument("--system", metavar="TEXT", type=text_argument, help="with --chat: a system message before it")
    run.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    add_sampling_options(run)
    run.add_argument("--threads", type=thread_count, default=None, help="onnxruntime intra-op threads (default: artifact's)")
    run.add_argument("--no-spin", action="store_true", help=NO_SPIN_HELP)
    run.set_defaults(handler=_run)
    add_chat_parser(commands)
    add_serve_parser(commands)
    inspect = commands.add_parser("inspect", help="summarize an artifact's manifest")
    inspect.add_argument("artifact", type=user_path, help="an artifact folder")
    inspect.add_argument("--verify", action="store_true", help="also check every file's sha256")
    inspect.add_argument("--json", action="store_true", help="print the whole manifest (every pass report) as JSON")
    inspect.set_defaults(handler=_inspect)
    plan = commands.add_parser("plan", help="memory and lower-bound latency of a model on a device")
    plan.add_argument("source", type=user_path, help="a recipe (.yaml), a Hugging Face config.json (or its folder), a .gguf file, "
                                     "or an artifact folder")
    plan.add_argument("--device", required=True,
                      help="H100, H200, A100, L40S, L4, RTX4090, or cpu (this machine, measured)")
    plan.add_argument("--precision", choices=("fp32", "fp16", "bf16", "int8", "int4"), default=None,
                      help="weight precision (default: an artifact's own, a recipe's quantized one; else fp16 on GPUs, "
                           "fp32 on cpu)")
    plan.add_argument("--kv-dtype", choices=("fp32", "fp16", "bf16", "int8"), default=None,
                      help="KV-cache dtype (default: an artifact's own, a recipe's int8 cache; else fp16 on GPUs, fp32 "
                           "on cpu)")
    plan.add_argument("--context", type=int, default=None,
                      help="tokens per request (default: the recipe's or artifact's max context, else the model's)")
    plan.add_argument("--concurrency", type=int, default=1, help="sequences decoded together (default: 1)")
    plan.add_argument("--prompt", type=int, default=None,
                      help="prompt tokens for the prefill bound (default: min(512, context))")
    plan.add_argument("--remeasure", action="store_true", help="cpu: measure again instead of using the cached figures")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON on stdout")
    plan.set_defaults(handler=_plan)
    bench = commands.add_parser("bench", help="serve a workload (or time prefill/decode) and report vLLM-style metrics")
    bench.add_argument("artifact", type=user_path, help="an artifact folder")
    bench.add_argument("--requests", type=int, default=None, help="requests in the workload (default 32)")
    bench.add_argument("--arrival", choices=("all", "concurrency", "poisson"), default=None,
                       help="(default) all at once; closed loop of --concurrency clients; Poisson at --rate req/s")
    bench.add_argument("--concurrency", type=int, default=None,
                       help="clients for --arrival concurrency (default 1): each sends its next request when the last one ends")
    bench.add_argument("--rate", type=float, default=None,
                       help="requests/s for --arrival poisson (the gaps rescaled so that the run realizes it, as vLLM's)")
    bench.add_argument("--seed", type=nonnegative_int, default=None, help="lengths and Poisson arrivals (default 0)")
    bench.add_argument("--prompt-tokens", default=None, help="N, or LOW:HIGH drawn uniformly (default: 128)")
    bench.add_argument("--output-tokens", default=None, help="N, or LOW:HIGH drawn uniformly (default: 64)")
    bench.add_argument("--prompt-file", type=user_path, default=None, help="text cut into prompts (default: Python's pydoc topics)")
    bench.add_argument("--warmup", type=int, default=None, help="requests served first and excluded (default: 1)")
    bench.add_argument("--slo-ttft-ms", type=positive_float, default=None, help="goodput: TTFT limit")
    bench.add_argument("--slo-tpot-ms", type=positive_float, default=None, help="goodput: TPOT limit")
    bench.add_argument("--slo-e2e-ms", type=positive_float, default=None, help="goodput: end-to-end latency limit")
    bench.add_argument("--baseline", action="append", default=None,
                       help="also serve the workload with transformers or onnxruntime-genai (repeatable)")
    bench.add_argument("--threads", type=thread_count, default=None, help="intra-op threads for every backend (default and 0: every CPU this process may use)")
    bench.add_argument("--no-spin", action="store_true", help=NO_SPIN_HELP + " (aotlm's engine)")
    bench.add_argument("--batching", action="append", choices=("continuous", "static"), default=None,
                       help="the scheduler's batching (default: continuous); repeat to serve with both and compare")
    bench.add_argument("--slots", type=positive_int, default=None,
                       help="KV-cache slots = sequences decoded together (default: --concurrency for "
                            "--arrival concurrency, else 8)")
    bench.add_argument("--prefill-chunk", type=positive_int, default=None,
                       help="prefill at most this many prompt tokens per step while others decode (default: whole)")
    bench.add_argument("--shared-prefix", type=int, default=None, metavar="N",
                       help="every prompt begins with the same N tokens, as a system prompt (default 0)")
    bench.add_argument("--prefix-caching", action="store_true", default=None,
                       help="serve with Engine.load(prefix_caching=True): a prompt's cached start is not prefilled")
    bench.add_argument("--out", type=user_path, default=None, help="JSON path, or - for stdout (default: benchmarks/results/bench-<name>[-<phase>].json)")
    bench.add_argument("--phase", choices=("prefill", "decode"), default=None,
                       help="time the prefill or decode graph alone instead of serving a workload")
    bench.add_argument("--prompt-lengths", default=None,
                       help=f"--phase prefill: prompt lengths (default: those of {DEFAULT_PROMPT_LENGTHS} that fit)")
    bench.add_argument("--contexts", default=None,
                       help=f"--phase decode: cached tokens (default: those of {DEFAULT_CONTEXTS} that fit)")
    bench.add_argument("--batch", type=int, default=None, help="--phase: sequences per graph run (default 1)")
    bench.add_argument("--runs", type=int, default=None, help="--phase prefill: timed runs per length, median (default 5)")
    bench.add_argument("--steps", type=int, default=None, help="--phase decode: timed steps per context (default 32)")
    bench.set_defaults(handler=_bench)
    evaluate = commands.add_parser("eval", help="perplexity of an artifact on a text (sliding windows)")
    evaluate.add_argument("artifact", type=user_path, help="an artifact folder")
    add_evaluation_options(evaluate)
    evaluate.set_defaults(handler=eval_command)
    compare = commands.add_parser("compare", help="perplexity of two artifacts, and B's top-1 agreement and KL "
                                                  "against A")
    compare.add_argument("reference", type=user_path, metavar="A", help="the reference artifact")
    compare.add_argument("candidate", type=user_path, metavar="B", help="the artifact compared against A (same tokenizer)")
    add_evaluation_options(compare)
    compare.set_defaults(handler=compare_command)
    return root


# end the program as Ctrl-C does, cleaning up on the way (Windows has no SIGHUP)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (an ssh session that dropped), raised where the program is, so that it unwinds through the
    build's cleanup as Ctrl-C does (SIGHUP's default ended a build with its temporary folders left behind)."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__()
        self.signum = signum


def _terminated(signum, frame) -> None:
    raise _Terminated(signum)


def _stopped_by(stop: _Terminated) -> int:
    """The exit status of a signal's stop (128 + its number, as a shell reports it), said in a word."""
    message("[yellow]hung up[/yellow]" if stop.signum == getattr(signal, "SIGHUP", None) else
            "[yellow]terminated[/yellow]")
    return 128 + stop.signum


REFUSED_WRITES = {errno.ENOSPC: "free space there, or write elsewhere", errno.EDQUOT: "free space there, or write "
                  "elsewhere", errno.EROFS: "write elsewhere", errno.EACCES: "check its permissions, or write elsewhere",
                  errno.EPERM: "check its permissions, or write elsewhere",
                  errno.ENAMETOOLONG: "shorten the name, or write elsewhere",
                  errno.ENXIO: "no process reads that pipe or device: start its reader first, or write elsewhere",
                  errno.EFBIG: "a file-size limit (ulimit -f) or the filesystem's largest file (FAT32: 4 GiB): raise "
                  "the limit, or write elsewhere"}


def refused_write(error: OSError) -> str:
    """One line for a write the machine refused, not a traceback after the work. (A build leaves no half-written
    artifact, nor a JSON output a cut-short file: both are written beside their place, then renamed into it.)"""
    where = f" ({error.filename})" if error.filename else ""
    return f"{error.strerror or error}{where}: {REFUSED_WRITES[error.errno]}"


def _unencodable_characters_replaced() -> None:
    """A terminal or pipe whose encoding is not UTF-8 (a Latin-1 locale, PYTHONIOENCODING=latin-1) cannot take every
    character a model writes or a table draws: shown as '?' there, not a UnicodeEncodeError mid-generation."""
    for stream in (sys.stdout, sys.stderr):
        # surrogateescape: an ASCII locale with Python's UTF-8 mode off (PYTHONUTF8=0 LC_ALL=C) writes only ASCII
        if getattr(stream, "errors", None) in ("strict", "surrogateescape") and \
                (stream.encoding or "").lower().replace("-", "") != "utf8":
            try:
                stream.reconfigure(errors="replace")
            except (AttributeError, ValueError, OSError):  # not a text file (a test's): left as it is
                pass


def _one_line_warnings(show):
    """warnings.showwarning for the commands: aotlm's own notices (AotlmWarning) as one `warning:` line, as its other
    warnings print, not Python's two lines with a source line from inside aotlm; anything else's (a library's
    DeprecationWarning, an EncodingWarning, even warned at an aotlm line) as `show` prints it, with its place and
    category."""
    def shown(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, AotlmWarning):
            return warning(str(message))
        return show(message, category, filename, lineno, file, line)
    return shown


def main(argv: list[str] | None = None) -> int:
    if sys.stdout is None:  # fd 1 closed (>&-): Python has no stdout, and the first write was an AttributeError
        error("standard output is closed (>&-); redirect it to a file or /dev/null")
        return 2
    whole_writes_to_stdout()
    _unencodable_characters_replaced()
    try:  # relative paths, torch's own libraries (oneMKL's fatal error) and plan's hints all need it
        os.getcwd()
    except FileNotFoundError:
        error("the working folder was deleted (another shell removed it); cd to a folder that exists and run again")
        return 2
    try:  # Ctrl-C while the modules load (the first ~0.2 s): a word, not a traceback
        from compiler.errors import BuildError
        from runtime.errors import AotlmRuntimeError

        try:
            args = parser().parse_args(argv)
        except SystemExit as done:  # --help's text still in stdout's buffer: its failure belongs here, not at exit
            if done.code in (0, None):
                sys.stdout.flush()
            raise
    except KeyboardInterrupt:
        message("[yellow]interrupted[/yellow]")
        return 130
    except BrokenPipeError:  # --version's line to a reader that left
        return _reader_left()
    except OSError as problem:  # --version's or --help's text to a full disk
        if problem.errno not in REFUSED_WRITES:
            raise
        error(refused_write(problem))
        return _output_dropped(problem)
    show, warnings.showwarning = warnings.showwarning, _one_line_warnings(warnings.showwarning)
    in_main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    # a signal ignored where the program started (nohup's SIGHUP) stays ignored
    previous = {number: signal.signal(number, _terminated) for number in STOP_SIGNALS
                if signal.getsignal(number) != signal.SIG_IGN} if in_main_thread else {}
    try:
        with warnings.catch_warnings():  # aotlm's own notices print as warnings under -W error too: a command that
            warnings.filterwarnings("default", category=AotlmWarning)  # raised them ended in a traceback (status 1)
            args.handler(args)
        sys.stdout.flush()  # what stdout's buffer holds fails here, in reach of the handlers below, not at exit
    except (BuildError, AotlmRuntimeError) as problem:
        error(str(problem))  # one line: a long path stays one string to copy or grep (compiler/console.py)
        return 2
    except _Terminated as stop:
        return _stopped_by(stop)
    except BrokenPipeError:  # stdout's reader left (`aotlm run ... | head`): stop quietly, as a killed writer would
        return _reader_left()
    except KeyboardInterrupt:
        message("[yellow]interrupted[/yellow]")
        return 130
    except MemoryError:  # numpy's, Python's: what ran out is the process's memory, not a bug to trace
        from compiler.export import OUT_OF_MEMORY

        error(f"out of memory during `aotlm {getattr(args, 'command', '')}`" +
              (f": {OUT_OF_MEMORY}" if getattr(args, "command", "") == "build" else
               "; free memory, or use a machine with more"))
        return 2
    except OSError as problem:  # the machine refused a write: a full disk, a read-only or forbidden folder
        if problem.errno == errno.EIO and not problem.filename and _on_a_terminal():  # it hung up (ssh dropped)
            for stream in (sys.stdout, sys.stderr):  # Python's exit flush must not fail again
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
            return 128 + getattr(signal, "SIGHUP", 1)
        if problem.errno not in REFUSED_WRITES:
            raise
        error(refused_write(problem))
        return _output_dropped(problem)
    except ImportError as problem:  # a signal inside a module's initialisation surfaces as its ImportError
        # _Terminated is a KeyboardInterrupt too
        stop = next((e for e in exception_chain(problem) if isinstance(e, KeyboardInterrupt)), None)
        missing = (getattr(problem, "name", None) or "").split(".")[0]
        if stop is None and isinstance(problem, ModuleNotFoundError) and missing in EXTRAS:
            # an install with the runtime only (a deployment) running a command that needs more
            from runtime.versions import pip_install

            error(f"`aotlm {getattr(args, 'command', '')}` needs {missing}, which is not installed: "
                  + pip_install(f"'aotlm[{EXTRAS[missing]}]'"))
            return 2
        if stop is None and isinstance(problem, ModuleNotFoundError) and missing == "fcntl":  # Windows
            error(f"`aotlm {getattr(args, 'command', '')}` needs a POSIX system (Linux or macOS; on Windows, WSL): "
                  f"the build locks its folders with fcntl; the runtime's commands (run, serve, bench, eval) run here")
            return 2
        if stop is None:
            raise
        if isinstance(stop, _Terminated):
            return _stopped_by(stop)
        message("[yellow]interrupted[/yellow]")
        return 130
    finally:  # a second Ctrl-C here (between two restores) would be a traceback: held until they are done
        warnings.showwarning = show
        with _signals_held([*previous, signal.SIGINT]):
            for number, handler in previous.items():
                signal.signal(number, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        if in_main_thread:  # last registered, so it runs first at exit, before the finalizers the command loaded
            atexit.unregister(_sigint_ends_the_exit)
            atexit.register(_sigint_ends_the_exit)
    return 0


def _sigint_ends_the_exit() -> None:
    """A Ctrl-C during the interpreter's exit, once the command is done (torch's and onnxruntime's finalizers run
    then), raised KeyboardInterrupt inside an atexit callback: a traceback, and exit status 0. From here it ends the
    process as an unhandled SIGINT does (status 130 to a shell), unless something else handles SIGINT."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def _output_dropped(problem: OSError) -> int:
    """2, after a refused write; one to stdout leaves its buffer to /dev/null, or Python's exit flush fails again
    (a traceback, status 120)."""
    if problem.filename == "standard output":
        _stdout_to_devnull()
    return 2


def _reader_left() -> int:
    """stdout's reader left: 141, as a writer killed by SIGPIPE ends."""
    _stdout_to_devnull()
    return 141


def _stdout_to_devnull() -> None:
    """Python's exit flush of what stdout still holds must not fail again (a traceback, status 120)."""
    with contextlib.suppress(OSError, ValueError):  # (a stdout that is no file, as under a test, has no fileno)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _on_a_terminal() -> bool:
    """Whether the program reads or writes a terminal (one that hung up still is one: its reads and writes fail EIO)."""
    for stream in (sys.stdin, sys.stdout):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            if os.isatty(stream.fileno()):
                return True
    return False


@contextlib.contextmanager
def _signals_held(numbers):
    """Hold the signals in numbers (pending ones arrive after, to the handlers then in place)."""
    if not numbers or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set(numbers))
    try:
        yield
    finally:
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        except KeyboardInterrupt:  # a Ctrl-C held above, now delivered to Python's default handler: stopped anyway
            pass

if __name__ == "__main__":
    sys.exit(main())
