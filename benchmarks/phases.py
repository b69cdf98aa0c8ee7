"""Prefill and decode timed apart, by context length: aotlm unfused vs fused vs onnxruntime-genai.

    .venv/bin/python benchmarks/phases.py [--contexts 64,512,1024,2000] [--prompt-lengths 128,512,1024]
        [--steps 32] [--repeats 3] [--prefill-runs 5]
        [--backends aotlm-unfused,aotlm-fused,onnxruntime-genai,onnxruntime-genai-pruned] [--threads N]
        [--glibc-huge-pages]

Batch 1, fp32, the same weights everywhere (genai's models are generate.genai_model's cached builds of the fused
artifact's recipe `model` section) and real prompt tokens (Python's docs, pydoc_data.topics, as generate.py uses).
onnxruntime-genai is its builder's default fp32 CPU build (the issue's baseline), which computes the lm_head at
every prompt position; onnxruntime-genai-pruned is the same build with `--extra_options prune_lm_head=true`, the last
position only, as aotlm's prefill: the prefill ratio against it shows what remains without that difference.
The first repeat's greedy tokens of every backend are compared with the fused artifact's (token_agreement): the
same weights must give the same tokens, so a difference early on means a wrong or stale model was timed.

Decode at context C: the cache is filled with C real tokens (aotlm: one prefill-graph run; genai: append_tokens
on a fresh Generator, max_length 2100), then WARMUP_STEPS decode steps, then --steps timed consecutive steps,
each one token: forward over the cache + greedy choice of the next token (aotlm: the gaps between
Engine.generate's tokens, which also detokenize and check stops, as a user's tokens do; genai: generate_next_token,
which does not detokenize). The steps sit at positions C+k, as in real generation. Per measurement: median and p90
of the step times.
Prefill of L tokens: one warm-up run, then --prefill-runs timed runs (aotlm: Engine.generate's TTFT for the ids,
the prefill graph + the first token's choice; genai: append_tokens on a fresh Generator, created outside the
timing, which runs the prompt but does not choose a token yet); the median run counts. Both scopes put a little
more work on aotlm's side (until session 41 aotlm's timed the graphs + argmax alone).
aotlm's engines load with Engine.load's defaults, huge pages included (its weights on 2 MiB pages, 5-8% off a decode
step where the kernel's transparent huge pages are in madvise mode); genai's weights stay where it put them, on
4 KiB pages in that mode, unless --glibc-huge-pages runs the script under glibc's malloc.hugetlb=1 tunable, as a
genai user may. The JSON records the mode, what the engines got (settings.huge_pages) and the process's bytes on
huge pages after every backend loaded.

Noise: the 2-core VMs this runs on are shared, so the backends are interleaved -- for each context every
backend is measured in turn (the backends' and the contexts' orders rotate from one repeat to the next) -- and the
whole sweep is repeated --repeats times; reported times are medians over the repeats, and ratios are paired: the
median over repeats of each repeat's ratio (its two numbers measured minutes apart at most). Each measurement also
records how many cores everything else on the machine kept busy meanwhile (/proc/stat minus this process, steal
included); above --max-other-cores it waits and measures again (up to --retries times, keeping the least contended attempt).
Load averages are recorded before and after.

Bytes a decode step must read (each aotlm artifact): the weights a step reads (`aotlm plan`'s count: not an embedding
table it only gathers rows from) + kv_cache.bytes_per_token x C;
achieved GB/s = those bytes / median step time (a lower bound on traffic: activations and logits not counted).
The floor is those bytes at this machine's measured read bandwidth (`aotlm plan`'s cpu figure: every core summing
its part of a 512 MiB array, cached under ~/.cache/aotlm/): an estimate, not a hard bound.
Writes benchmarks/results/phases.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # generate.py, run as a script or imported
from generate import (REPO, SINGLE_STREAM_SPIN, Genai, anonymous_huge_page_bytes, artifact_identity,  # noqa: E402
                      baseline_cache, genai_build_record, genai_model, glibc_huge_pages, machine_info,
                      paired_median, prepare_folders, prompt_token_ids, versions, write_result)
from arguments import artifact_manifest, count_list, output_file, require_at_least_one, thread_count, usable_cpus  # noqa: E402

from contention import OTHER_CORES_LIMIT, OtherCores  # noqa: E402

from compiler.plan import artifact_step_weight_bytes, cpu_device  # noqa: E402
from compiler.console import print_table  # noqa: E402

WARMUP_STEPS = 4
PREFILL_WARMUPS = 1
GENAI_MAX_LENGTH = 2100  # every measurement's generator, or the model's context_length where that is less
UNFUSED, FUSED, GENAI = "aotlm-unfused", "aotlm-fused", Genai.name
# genai's builder computes the lm_head at every prompt position unless told `prune_lm_head=true` (its
# --extra_options), as aotlm's prefill does by default: the target's baseline is genai's default build, this arm
# shows how much of the TTFT ratio that one option accounts for.
GENAI_PRUNED = "onnxruntime-genai-pruned"
GENAI_BUILDS = {GENAI: {}, GENAI_PRUNED: {"prune_lm_head": "true"}}  # genai backend -> its builder's extra options
BACKENDS = (UNFUSED, FUSED, GENAI, GENAI_PRUNED)


def percentiles(seconds: list[float]) -> dict:
    ms = 1e3 * np.asarray(seconds)
    return {"median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90))}


# -- backends: decode(prompt_ids, steps) -> step seconds; prefill(prompt_ids) -> seconds ----------------------
class AotlmPhases:
    def __init__(self, name: str, artifact: Path, threads: int):
        from runtime import Engine

        self.name = name
        # allocates and binds the cache once; the decode session spins on between steps (`aotlm run`'s setting)
        self.engine = Engine.load(artifact, intra_op_threads=threads, spin_after_run=SINGLE_STREAM_SPIN,
                                  generation_config="none")  # greedy, as the baselines: not a model's defaults
        self.max_context = self.engine.max_context

    def graph_prefill(self, prompt_ids: list[int]) -> tuple[float, np.ndarray]:
        """The prefill graph alone over the bound cache: (seconds, logits). For A/B of graphs (pass_ab.py), where
        the engine's work around the graph is the same on both sides."""
        ids = np.array([prompt_ids], dtype=np.int64)
        positions = np.arange(len(prompt_ids), dtype=np.int64)[None]
        mask = np.ones((1, len(prompt_ids)), dtype=np.int64)
        with self.engine.batch_one():  # the engine's own cache, which its requests use too
            started = time.perf_counter()
            logits = self.engine.backend.run("prefill", ids, positions, mask)
            return time.perf_counter() - started, logits

    def prefill(self, prompt_ids: list[int]) -> float:
        """The engine's TTFT for the prompt's ids: prefill graph + the first token's choice, through Engine.generate
        (the product's path, no tokenization: ids are given)."""
        result = self.engine.generate(prompt_ids, max_new_tokens=1, ignore_eos=True)
        return result.timings.ttft_s

    def decode(self, prompt_ids: list[int], steps: int) -> tuple[list[float], list[int]]:
        """(step seconds, the tokens made), the steps being the gaps between the engine's tokens after the prompt
        (Engine.generate's timings): each a decode-graph run over the cache + the sampler's choice + detokenizing +
        the stop checks, all a user's token costs. Until session 41 this timed the graph + argmax alone, 0.1-0.2 ms a
        token less (RESULTS.md)."""
        length = len(prompt_ids)
        if length + WARMUP_STEPS + steps > self.max_context:
            raise SystemExit(f"{self.name}: context {length} + {WARMUP_STEPS + steps} steps exceed max context {self.max_context}")
        # the first token comes from the prefill; the k-th gap after it is the step at position length + k
        result = self.engine.generate(prompt_ids, max_new_tokens=WARMUP_STEPS + steps + 1, ignore_eos=True)
        if len(result.token_ids) != WARMUP_STEPS + steps + 1:
            raise RuntimeError(f"{self.name}: made {len(result.token_ids)} tokens, not {WARMUP_STEPS + steps + 1}")
        return result.timings.itl_s[WARMUP_STEPS:], list(result.token_ids)


class GenaiPhases:
    def __init__(self, name: str, genai_folder: Path, threads: int):
        self.name = name
        loaded = Genai(genai_folder, threads)  # generate.py's loader: CPU provider, thread count
        self.og, self.model = loaded.og, loaded.model
        self.max_length = genai_max_length(genai_folder)

    def generator(self, min_length: int = 0):
        """min_length: the tokens before which end-of-sequence cannot end it (generate_next_token would return at
        once, and a decode measurement time no-ops as steps)."""
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=self.max_length, min_length=min_length, batch_size=1)
        return self.og.Generator(self.model, params)

    def prefill(self, prompt_ids: list[int]) -> float:
        generator = self.generator()  # allocates its KV cache: outside the timing
        tokens = np.asarray(prompt_ids, dtype=np.int32)
        started = time.perf_counter()
        generator.append_tokens(tokens)
        return time.perf_counter() - started

    def decode(self, prompt_ids: list[int], steps: int) -> tuple[list[float], list[int]]:
        total = len(prompt_ids) + WARMUP_STEPS + steps
        if total > self.max_length:  # main() checks every context first
            raise SystemExit(f"{self.name}: context {len(prompt_ids)} + {WARMUP_STEPS + steps} steps exceed {self.max_length}")
        generator = self.generator(min_length=total)
        generator.append_tokens(np.asarray(prompt_ids, dtype=np.int32))
        # the first generate_next_token only picks from append_tokens' logits; each later one runs the model on
        # the previous token first. The first is among the warm-up steps.
        times = []
        for step in range(WARMUP_STEPS + steps):
            started = time.perf_counter()
            generator.generate_next_token()
            elapsed = time.perf_counter() - started
            if step >= WARMUP_STEPS:
                times.append(elapsed)
        if generator.is_done() and len(generator.get_sequence(0)) < total:  # a step that ran nothing was timed
            raise RuntimeError(f"{self.name}: stopped at {len(generator.get_sequence(0))} tokens, not {total}")
        return times, [int(token) for token in generator.get_sequence(0)[len(prompt_ids):]]


def genai_max_length(genai_folder: Path) -> int:
    """GENAI_MAX_LENGTH, or genai's model context_length where less (a Generator refuses a longer max_length)."""
    config = json.loads((genai_folder / "genai_config.json").read_text())
    return min(GENAI_MAX_LENGTH, int(config["model"]["context_length"]))


# -- driver ---------------------------------------------------------------------------------------------------
def guarded(measure, args, label: str, console: Console) -> dict:
    """Run measure() -> dict; when other processes (or steal) kept more than --max-other-cores busy on average
    meanwhile, wait and measure again, up to --retries times. The result records the contention it ran under."""
    attempts = []
    for attempt in range(args.retries + 1):
        with OtherCores() as other_cores:
            result = measure()
        others = result["other_cores"] = other_cores.cores  # mean cores used by everything else meanwhile
        attempts.append(result)
        if others <= args.max_other_cores:
            break
        if attempt < args.retries:
            console.log(f"[yellow]{label}: other processes used {others:.2f} cores; measuring again")
            time.sleep(5 * 2 ** attempt)
    best = min(attempts, key=lambda r: r["other_cores"])
    best["attempts"] = len(attempts)
    best["contended"] = best["other_cores"] > args.max_other_cores
    return best


def run_sweeps(backends: dict, prompt_ids: list[int], args, progress: Progress, console: Console) -> dict:
    names = list(backends)
    decode = {name: {ctx: [] for ctx in args.contexts} for name in names}  # one entry per repeat
    prefill = {name: {length: [] for length in args.prompt_lengths} for name in names}
    work = args.repeats * len(names) * (len(args.contexts) + len(args.prompt_lengths))
    task = progress.add_task("sweeps", total=work)

    def decode_once(backend, ctx):
        times, tokens = backend.decode(prompt_ids[:ctx], args.steps)
        return {**percentiles(times), "step_ms": [1e3 * t for t in times], "token_ids": tokens}

    def prefill_once(backend, length):
        for _ in range(PREFILL_WARMUPS):
            backend.prefill(prompt_ids[:length])
        runs = [backend.prefill(prompt_ids[:length]) for _ in range(args.prefill_runs)]
        return {"median_ms": 1e3 * float(np.median(runs)), "run_ms": [1e3 * r for r in runs]}

    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[: repeat % len(names)]  # rotate: no backend always first
        # and no context always first: the first decode measurement of a repeat (after the last one's 1024-token
        # prefills) ran slow for every backend in session 60's runs, which moves the context-2000-over-64 ratio
        contexts = args.contexts[repeat % len(args.contexts):] + args.contexts[: repeat % len(args.contexts)]
        for ctx in contexts:
            for name in order:
                label = f"[{repeat + 1}/{args.repeats}] decode  ctx {ctx:5} {name:18}"
                progress.update(task, description=label)
                decode[name][ctx].append(guarded(lambda: decode_once(backends[name], ctx), args, label, console))
                progress.advance(task)
        for length in args.prompt_lengths:
            for name in order:
                label = f"[{repeat + 1}/{args.repeats}] prefill len {length:5} {name:18}"
                progress.update(task, description=label)
                prefill[name][length].append(guarded(lambda: prefill_once(backends[name], length), args, label, console))
                progress.advance(task)
    return {"decode": decode, "prefill": prefill}


def summarize(raw: dict, args, manifests: dict, bandwidth: float, step_weights: dict) -> dict:
    decode, prefill = {}, {}
    for name, by_ctx in raw["decode"].items():
        decode[name] = {}
        for ctx, repeats in by_ctx.items():
            entry = {"median_ms": float(np.median([r["median_ms"] for r in repeats])),
                     "p90_ms": float(np.median([r["p90_ms"] for r in repeats])),
                     "repeats": repeats}
            entry["tokens_per_s"] = 1e3 / entry["median_ms"]
            if name in manifests:
                manifest = manifests[name]
                weights = step_weights[name]  # an embedding table a step only gathers rows from is left out
                kv = manifest["kv_cache"]["bytes_per_token"] * ctx
                entry.update(weights_bytes=weights, kv_bytes=kv, bytes_read=weights + kv,
                             achieved_gb_per_s=(weights + kv) / (entry["median_ms"] / 1e3) / 1e9,
                             floor_ms=(weights + kv) / bandwidth * 1e3)
                entry["of_floor"] = entry["median_ms"] / entry["floor_ms"]
            decode[name][ctx] = entry
    for name, by_length in raw["prefill"].items():
        prefill[name] = {}
        for length, repeats in by_length.items():
            median_ms = float(np.median([r["median_ms"] for r in repeats]))
            prefill[name][length] = {"median_ms": median_ms, "tokens_per_s": length / (median_ms / 1e3),
                                     "repeats": repeats}
    return {"decode": decode, "prefill": prefill}


def paired(results: dict, top: str, bottom: str, key, bottom_key=None) -> float | None:
    """The median over repeats of top / bottom in the same repeat (a repeat measures every backend in turn, so the
    two come from the same minutes; the host drifts between repeats). bottom_key: another key of the same backend
    (the context growth)."""
    if top not in results or bottom not in results:
        return None
    tops = results[top][key]["repeats"]
    bottoms = results[bottom][key if bottom_key is None else bottom_key]["repeats"]
    return paired_median([t["median_ms"] for t in tops], [b["median_ms"] for b in bottoms])


def paired_ratios(summary: dict, contexts: list[int], prompt_lengths: list[int]) -> dict:
    decode, prefill = summary["decode"], summary["prefill"]
    lo, hi = contexts[0], contexts[-1]
    return {
        "decode": {ctx: {"fused_vs_unfused": paired(decode, FUSED, UNFUSED, ctx),
                         "fused_vs_genai": paired(decode, FUSED, GENAI, ctx),
                         "fused_vs_genai_pruned": paired(decode, FUSED, GENAI_PRUNED, ctx)} for ctx in contexts},
        "prefill": {length: {"fused_vs_unfused": paired(prefill, FUSED, UNFUSED, length),
                             "fused_vs_genai": paired(prefill, FUSED, GENAI, length),
                             "fused_vs_genai_pruned": paired(prefill, FUSED, GENAI_PRUNED, length)}
                    for length in prompt_lengths},
        "decode_growth": {name: paired(decode, name, name, hi, bottom_key=lo) for name in decode},
    }


def token_agreement(raw: dict) -> dict:
    """Per context, each backend's greedy tokens in the first repeat against the fused artifact's: the index of the
    first that differs (None: all the shared ones agree). Every backend runs the same weights, so an early
    difference means a wrong or stale model was timed."""
    decode = raw["decode"]
    if FUSED not in decode:
        return {}
    agreement = {}
    for ctx, repeats in decode[FUSED].items():
        reference = repeats[0]["token_ids"]
        agreement[ctx] = {}
        for name in decode:
            tokens = decode[name][ctx][0]["token_ids"]
            shared = min(len(tokens), len(reference))
            agreement[ctx][name] = next((i for i in range(shared) if tokens[i] != reference[i]), None)
    return agreement


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


RATIO_COLUMNS = {"fused/unfused": "fused_vs_unfused", "fused/genai": "fused_vs_genai",
                 "fused/genai-pruned": "fused_vs_genai_pruned"}  # column -> paired_ratios' key


def render(summary: dict, pairs: dict, args, console: Console, bandwidth: float) -> list[str]:
    """The decode and prefill tables; pairs: paired_ratios(summary, ...). Returns the context-growth lines."""
    decode, prefill = summary["decode"], summary["prefill"]
    names = list(decode)
    table = Table(title=f"decode, ms per token (median over {args.repeats} repeats of {args.steps} steps; batch 1); "
                        f"floor = bytes read / this machine's {bandwidth / 1e9:.1f} GB/s")
    table.caption = "fused/unfused, fused/genai: the median over repeats of each repeat's ratio (paired)"
    table.add_column("context", justify="right")
    for name in names:
        table.add_column(f"{name} ms", justify="right")
        table.add_column(f"{name} p90", justify="right")
    for column in RATIO_COLUMNS:
        table.add_column(column, justify="right")
    if FUSED in decode:
        table.add_column("fused MB read", justify="right")
        table.add_column("fused GB/s", justify="right")
        table.add_column("fused floor ms", justify="right")
        table.add_column("fused/floor", justify="right")
    for ctx in args.contexts:
        row = [str(ctx)]
        for name in names:
            row += [f"{decode[name][ctx]['median_ms']:.2f}", f"{decode[name][ctx]['p90_ms']:.2f}"]
        row += [ratio(pairs["decode"][ctx][key]) for key in RATIO_COLUMNS.values()]
        if FUSED in decode:
            entry = decode[FUSED][ctx]
            row += [f"{entry['bytes_read'] / 1e6:.0f}", f"{entry['achieved_gb_per_s']:.1f}", f"{entry['floor_ms']:.2f}",
                    f"{entry['of_floor']:.2f}x"]
        table.add_row(*row)
    print_table(table, console)
    lo, hi = args.contexts[0], args.contexts[-1]
    growth = ", ".join(f"{name} {decode[name][hi]['median_ms'] / decode[name][lo]['median_ms']:.2f}x" for name in names)
    growth_paired = ", ".join(f"{name} {ratio(value)}" for name, value in pairs["decode_growth"].items())
    lines = [f"decode ms ctx{hi} / ctx{lo}: {growth}", f"paired (median of the repeats' ratios): {growth_paired}"]
    console.print("\n".join(lines))

    table = Table(title=f"prefill (median over {args.repeats} repeats of the median of {args.prefill_runs} runs; batch 1)")
    table.caption = "ratios paired, as in the decode table"
    table.add_column("prompt tokens", justify="right")
    for name in names:
        table.add_column(f"{name} ms", justify="right")
        table.add_column(f"{name} tok/s", justify="right")
    for column in RATIO_COLUMNS:
        table.add_column(column, justify="right")
    for length in args.prompt_lengths:
        row = [str(length)]
        for name in names:
            row += [f"{prefill[name][length]['median_ms']:.1f}", f"{prefill[name][length]['tokens_per_s']:.0f}"]
        row += [ratio(pairs["prefill"][length][key]) for key in RATIO_COLUMNS.values()]
        table.add_row(*row)
    print_table(table, console)
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=count_list, default=[64, 512, 1024, 2000])
    parser.add_argument("--prompt-lengths", type=count_list, default=[128, 512, 1024])
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="times the whole interleaved sweep runs")
    parser.add_argument("--prefill-runs", type=int, default=5, help="timed prefill runs per measurement")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--fused-artifact", type=Path, default=REPO / "artifacts" / "smollm2-135m")
    parser.add_argument("--unfused-artifact", type=Path, default=REPO / "artifacts" / "smollm2-135m-unfused")
    parser.add_argument("--threads", type=thread_count, default=usable_cpus())
    parser.add_argument("--max-other-cores", type=float, default=OTHER_CORES_LIMIT,
                        help="re-measure when other processes kept more cores than this busy on average")
    parser.add_argument("--retries", type=int, default=3, help="re-measurements allowed per contended measurement")
    parser.add_argument("--glibc-huge-pages", action="store_true",
                        help="run under GLIBC_TUNABLES=glibc.malloc.hugetlb=1: genai's weights may then sit on 2 MiB "
                             "pages too (aotlm's engines put theirs there in any case)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/phases.json)")
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the work, not a traceback after it
    if args.glibc_huge_pages:
        glibc_huge_pages(parser, argv)
    console = Console(width=None if sys.stdout.isatty() else 200)
    names = [name for name in args.backends.split(",") if name]
    unknown = set(names) - set(BACKENDS)
    if unknown or not names:
        parser.error(f"unknown backends {sorted(unknown)}; known: {', '.join(BACKENDS)}")
    require_at_least_one(parser, args, "--steps", "--repeats", "--prefill-runs")
    genai_names = [name for name in names if name in GENAI_BUILDS]
    if genai_names:  # the default backends include it: fail now, not after the other backends load
        try:
            import onnxruntime_genai  # noqa: F401
        except ImportError as error:
            parser.error(f"{GENAI} is not installed ({error}): pip install 'aotlm[bench]', or leave "
                         f"{', '.join(genai_names)} out of --backends (e.g. --backends {FUSED})")
    bandwidth = cpu_device()["bandwidth"]  # measured once per machine (all cores reading), then cached
    load_before = os.getloadavg()

    artifacts = {UNFUSED: args.unfused_artifact, FUSED: args.fused_artifact}
    manifests = {name: artifact_manifest(parser, artifacts[name]) for name in names if name in artifacts}
    for name, manifest in manifests.items():  # before any measurement: a sweep takes minutes
        limit = manifest["kv_cache"]["max_context"]
        if max(args.contexts) + WARMUP_STEPS + args.steps > limit or max(args.prompt_lengths) > limit:
            parser.error(f"{name} ({artifacts[name]}) holds {limit} tokens: every context + {WARMUP_STEPS + args.steps} "
                         f"decode steps, and every prompt length, must fit")
    reference = artifact_manifest(parser, args.fused_artifact)  # prompt tokens, genai's weights
    prompt_ids = prompt_token_ids(args.fused_artifact, reference, max(args.contexts + args.prompt_lengths))
    genai_folders, genai_limits = {}, {}
    if genai_names:
        hf_folder, _ = prepare_folders(reference, console, want_genai=False)
        for name in genai_names:
            genai_folders[name] = genai_model(hf_folder, baseline_cache(reference), "fp32", console,
                                              **GENAI_BUILDS[name])
            limit = genai_limits[name] = genai_max_length(genai_folders[name])
            if max(args.contexts) + WARMUP_STEPS + args.steps > limit or max(args.prompt_lengths) > limit:
                parser.error(f"{name}'s generators hold {limit} tokens: every context + "
                             f"{WARMUP_STEPS + args.steps} decode steps, and every prompt length, must fit")

    backends = {}
    setup_s = {}
    for name in names:
        started = time.perf_counter()
        backends[name] = (GenaiPhases(name, genai_folders[name], args.threads) if name in genai_folders
                          else AotlmPhases(name, artifacts[name], args.threads))
        setup_s[name] = time.perf_counter() - started
    huge_page_bytes = anonymous_huge_page_bytes()
    console.log(f"loaded {', '.join(names)}; load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}"
                + ("" if huge_page_bytes is None else f"; {huge_page_bytes / 2**20:.0f} MiB on huge pages"))

    started = time.perf_counter()
    with Progress(console=console) as progress:
        raw = run_sweeps(backends, prompt_ids, args, progress, console)
    sweep_s = time.perf_counter() - started
    load_after = os.getloadavg()
    summary = summarize(raw, args, manifests, bandwidth,
                        {name: artifact_step_weight_bytes(artifacts[name]) for name in manifests})
    pairs = paired_ratios(summary, args.contexts, args.prompt_lengths)
    lines = render(summary, pairs, args, console, bandwidth)
    measured = [r for phase in raw.values() for by in phase.values() for repeats in by.values() for r in repeats]
    retried = sum(r["attempts"] > 1 for r in measured)
    contended = sum(r["contended"] for r in measured)
    contention = (f"contention: {retried} of {len(measured)} measurements re-measured, {contended} still above "
                  f"{args.max_other_cores} other cores; median other cores {np.median([r['other_cores'] for r in measured]):.2f}")
    console.print(contention)
    agreement = token_agreement(raw)
    differing = {f"{name} at context {ctx}": index for ctx, by_name in agreement.items()
                 for name, index in by_name.items() if index is not None}
    console.print("greedy tokens (first repeat) against the fused artifact's: " +
                  ("all agree" if not differing else
                   "; ".join(f"{where} from token {index}" for where, index in differing.items())))
    console.print(f"load average (1/5/15 min) before {' '.join(f'{x:.2f}' for x in load_before)}, "
                  f"after {' '.join(f'{x:.2f}' for x in load_after)}; sweeps took {sweep_s:.0f} s")

    report = {
        "settings": {"contexts": args.contexts, "prompt_lengths": args.prompt_lengths, "steps": args.steps,
                     "warmup_steps": WARMUP_STEPS, "repeats": args.repeats, "prefill_runs": args.prefill_runs,
                     "prefill_warmups": PREFILL_WARMUPS, "threads": args.threads, "batch": 1, "backends": names,
                     "aotlm_spin_after_run": SINGLE_STREAM_SPIN,
                     "artifacts": {name: str(path) for name, path in artifacts.items() if name in names},
                     "artifact_identity": {name: artifact_identity(artifacts[name]) for name in manifests},
                     "genai_builds": {name: genai_build_record(folder) for name, folder in genai_folders.items()},
                     "genai_max_length": genai_limits, "prompt_token_ids": prompt_ids,
                     "prompt_source": "pydoc_data.topics (sorted, joined)", "interleaved": True,
                     "max_other_cores": args.max_other_cores, "retries": args.retries,
                     "machine_bandwidth_bytes_per_s": bandwidth,
                     "decode_step": "forward over the filled cache + greedy next token; positions C+k",
                     "aotlm_timing": "Engine.generate: TTFT for prefill, the gaps between tokens for decode",
                     "huge_pages": {name: backend.engine.huge_pages for name, backend in backends.items()
                                    if isinstance(backend, AotlmPhases)},
                     "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
                     "process_huge_page_bytes_after_loads": huge_page_bytes},
        "machine": {**machine_info(), "load_average_before": load_before, "load_average_after": load_after},
        "versions": versions(), "setup_s": setup_s, "sweep_s": sweep_s,
        "decode": {name: {str(k): v for k, v in by.items()} for name, by in summary["decode"].items()},
        "prefill": {name: {str(k): v for k, v in by.items()} for name, by in summary["prefill"].items()},
        "decode_growth": lines[0], "decode_growth_paired": lines[1], "contention": contention,
        "paired": {phase: {str(k): v for k, v in by.items()} for phase, by in pairs.items()},
        "token_agreement": {"first_difference_from_fused": {str(k): v for k, v in agreement.items()},
                            "compared": f"the first repeat's {WARMUP_STEPS + args.steps} tokens per context"},
    }
    console.print(f"wrote {write_result('phases.json', report, args.out)}")
    return report


if __name__ == "__main__":
    main()
