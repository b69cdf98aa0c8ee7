"""Quantization, in one run: size, speed and accuracy of fp32 / int8 / int4 (RTN and AWQ, blocks 32 and 128)
builds of the default model, beside onnxruntime-genai's int4 build of the same weights.

    .venv/bin/python benchmarks/quantization.py [--prompt-tokens 512] [--new-tokens 128] [--repeats 3]
        [--eval-tokens 4096] [--window 512] [--stride 256] [--variants fp32,int8,...]
        [--genai-builds onnxruntime-genai-int4[,onnxruntime-genai-int4-b128]] [--no-genai] [--glibc-huge-pages]
        [--out quantization.json (a path; a bare file name goes under benchmarks/results/)]

Each variant is a recipe under recipes/ with a few quantize options changed (VARIANTS), built once
into benchmarks/results/quantization/ (the build's own accuracy report is skipped: this script measures every
variant the same way). Per variant:
  size      bytes of the artifact's engine files (graphs + weights.bin); genai: its model folder's .onnx + data
  TTFT/TPOT batch 1, a --prompt-tokens prompt of Python's documentation, --new-tokens greedy tokens, median of
            --repeats runs after a warm-up, every variant and genai loaded at once and their runs interleaved
            (benchmarks/generate.py's measure_all), with `aotlm run`'s thread setting (decode spinning)
  perplexity on the held-out 10% of Python's documentation (`builtin:pydoc-held-out`, never used to calibrate),
            first --eval-tokens tokens, sliding windows (runtime.evaluate.window_spans)
  top-1     agreement of the next-token argmax with the fp32 artifact on the same scored positions
The table's TTFT and TPOT are each the median over the repeats of that metric (measure_all: not one run's pair);
"paired" is the median over repeats of each run's TPOT over genai's in the same repeat, steadier on a host whose
speed drifts (paired_ratio). Each run records the cores other processes used meanwhile (benchmarks/contention.py),
and the console counts the contended runs.
The baseline is onnxruntime-genai's default int4 build (block 32, a float KV cache); aotlm's fastest int4 builds use
blocks of 64 or 128 and an int8 cache. genai's builder offers both (block_size; an int8 cache from a calibrated
scale file), so these ratios compare settings as much as engines: `--genai-builds ...,onnxruntime-genai-int4-b128`
times genai at block 128 too. aotlm's engines put their weights on 2 MiB pages, genai's stay on 4 KiB pages unless
--glibc-huge-pages (settings.aotlm_huge_pages, settings.process_huge_page_bytes_after_loads).
Writes benchmarks/results/quantization.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # generate.py, whether imported or run from anywhere
from generate import (REPO, RESULTS, SINGLE_STREAM_SPIN, Aotlm, Genai, anonymous_huge_page_bytes,  # noqa: E402
                      artifact_identity, baseline_cache, genai_build_record, genai_model, glibc_huge_pages,
                      machine_info, measure_all, paired_median, prepare_folders, prompt_token_ids, versions,
                      write_result)
from arguments import output_file, require_at_least_one, thread_count, usable_cpus  # noqa: E402
from contention import contention_line  # noqa: E402

from compiler.build import build  # noqa: E402
from compiler.recipe import AccuracySpec, load_recipe  # noqa: E402
from passes.quantize import Override  # noqa: E402
from runtime.evaluate import EvaluationError, builtin_text, encode_text, log_softmax, window_spans  # noqa: E402
from compiler.console import print_table  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "quantization"
VARIANTS = {  # name: (recipe file, quantize options changed for this variant)
    "fp32": ("smollm2-135m.yaml", {}),
    "int8": ("smollm2-135m-int8.yaml", {}),  # AWQ + GPTQ (act-order); int8 activations quantized per block of 16
    "int8-rtn": ("smollm2-135m-int8-rtn.yaml", {}),
    "int8-acc4-b64": ("smollm2-135m-int8-rtn.yaml", {"int8_kernel_block": None}),  # ... per block of 64 / 256
    "int8-float-act": ("smollm2-135m-int8-rtn.yaml", {"accuracy_level": 0, "int8_kernel_block": None}),
    "int8-awq": ("smollm2-135m-int8.yaml", {"method": "awq", "gptq_act_order": False}),  # act-order: GPTQ's
    "int8-gptq": ("smollm2-135m-int8.yaml", {"method": "gptq"}),
    "int8-gptq-no-act-order": ("smollm2-135m-int8.yaml", {"method": "gptq", "gptq_act_order": False}),
    "int4-rtn-b32": ("smollm2-135m-int4-rtn.yaml", {}),
    "int4-rtn-b128": ("smollm2-135m-int4-rtn.yaml", {"block_size": 128}),
    "int4-awq-b32": ("smollm2-135m-int4.yaml", {"method": "awq", "gptq_act_order": False}),
    "int4-awq-b128": ("smollm2-135m-int4.yaml", {"method": "awq", "block_size": 128, "gptq_act_order": False}),
    "int4-gptq-b32": ("smollm2-135m-int4.yaml", {"method": "gptq", "gptq_act_order": False}),
    "int4-gptq_act-b32": ("smollm2-135m-int4.yaml", {"method": "gptq", "gptq_act_order": True}),
    "int4-awq_gptq-b32": ("smollm2-135m-int4.yaml", {"method": "awq_gptq", "gptq_act_order": False}),
    "int4-awq_gptq-b128": ("smollm2-135m-int4.yaml", {"method": "awq_gptq", "block_size": 128, "gptq_act_order": False}),
    "int4-awq_gptq_act-b32": ("smollm2-135m-int4.yaml", {"method": "awq_gptq", "gptq_act_order": True}),
    "int4-awq_gptq_act-b128": ("smollm2-135m-int4.yaml", {"method": "awq_gptq", "block_size": 128,
                                                          "gptq_act_order": True}),
    # block 64: half block 32's scales, and K = 576 is 9 whole blocks (block 128 pads its fifth from 64 to 128)
    "int4-awq_gptq_act-b64": ("smollm2-135m-int4.yaml", {"method": "awq_gptq", "block_size": 64, "gptq_act_order": True}),
    "int4-awq_gptq_act-b64-head32": ("smollm2-135m-int4-b64.yaml", {}),  # ... the table in blocks of 32: the recipe
    # block 128 with a zero point per block (asymmetric): 16 levels over each block's own [min, max]
    "int4-awq_gptq_act-b128-asym": ("smollm2-135m-int4.yaml", {"method": "awq_gptq", "block_size": 128,
                                                               "gptq_act_order": True, "symmetric": False}),
    # block 128, but the tied lm_head / embedding table in blocks of 32 (+1 MB): it dominates block 128's loss
    "int4-awq_gptq_act-b128-head32": ("smollm2-135m-int4.yaml", {
        "method": "awq_gptq", "block_size": 128, "gptq_act_order": True,
        "overrides": (Override("model.embed_tokens.weight", block_size=32),)}),
    # ... or in blocks of 16 (+4.5 MB)
    "int4-awq_gptq_act-b128-head16": ("smollm2-135m-int4.yaml", {
        "method": "awq_gptq", "block_size": 128, "gptq_act_order": True,
        "overrides": (Override("model.embed_tokens.weight", block_size=16),)}),
    # int8 round to nearest with one kind of projection kept float: where its +0.35% comes from (benchmarks/RESULTS.md)
    **{f"int8-rtn-float-{kind}": ("smollm2-135m-int8-rtn.yaml", {"overrides": (Override(pattern, skip=True),)})
       for kind, pattern in (("lm_head", "*lm_head*"), ("qkv", "*q_proj+k_proj+v_proj*"), ("o", "*o_proj*"),
                             ("gate_up", "*gate_proj+up_proj*"), ("down", "*down_proj*"))},
    # fp32 and the int4 recipe with an int8 KV cache (quantize_kv_cache in the recipe): a quarter of the cache bytes
    "fp32-kv8": ("smollm2-135m-kv8.yaml", {}),
    "int4-awq_gptq_act-b32-kv8": ("smollm2-135m-int4-kv8.yaml", {"method": "awq_gptq", "gptq_act_order": True}),
    # ... and with the projections in blocks of 64 (the recipe) or 128, the table in blocks of 32
    "int4-awq_gptq_act-b64-head32-kv8": ("smollm2-135m-int4-b64-kv8.yaml", {}),
    "int4-awq_gptq_act-b128-head32-kv8": ("smollm2-135m-int4-kv8.yaml", {
        "method": "awq_gptq", "block_size": 128, "gptq_act_order": True,
        "overrides": (Override("model.embed_tokens.weight", block_size=32),)}),
}
DEFAULT_VARIANTS = ("fp32", "int8", "int8-rtn", "int4-rtn-b32", "int4-rtn-b128", "int4-awq_gptq_act-b32",
                    "int4-awq_gptq_act-b128", "int4-awq_gptq_act-b128-asym", "int4-awq_gptq_act-b128-head32",
                    "int4-awq_gptq_act-b128-head16")
GENAI_INT4 = "onnxruntime-genai-int4"


def out_path(out: str) -> Path:
    """--out as a path, the way the other benchmarks take it, except that a bare file name (no folder) still goes
    under benchmarks/results/, where this script has always written it: `--out benchmarks/results/q.json` once
    landed in benchmarks/results/benchmarks/results/."""
    path = Path(out)
    return RESULTS / path if path.parent == Path(".") else path


def variant_recipe(name: str):
    file, changes = VARIANTS[name]
    recipe = load_recipe(REPO / "recipes" / file)
    passes = tuple(dataclasses.replace(p, options=dataclasses.replace(p.options, **changes))
                   if p.name == "quantize" else p for p in recipe.passes)
    return dataclasses.replace(recipe, name=f"bench-{name}", passes=passes, accuracy=AccuracySpec(enabled=False))


def variant_settings(name: str) -> dict:
    """A variant as JSON: its recipe file and the quantize options it changes (overrides as plain dicts)."""
    file, changes = VARIANTS[name]
    plain = {key: [dataclasses.asdict(o) for o in value] if key == "overrides" else value
             for key, value in changes.items()}
    return {"recipe": file, "quantize": plain}


@functools.cache  # once per run: the source does not change while the variants build
def build_code_digest() -> str:
    """sha256 of what builds an artifact: the sources a build runs (compiler.artifact.sources_sha256: compiler/,
    passes/ and runtime/, whose manifest writer and calibration a build uses) and the tools' versions (onnxruntime
    folds constants and calibrates). A cached variant built by other code is stale; runtime/ and the tools were left
    out before."""
    from compiler.artifact import sources_sha256, tool_versions

    return hashlib.sha256(json.dumps([sources_sha256(REPO), tool_versions()], sort_keys=True).encode()).hexdigest()


def built(name: str, console: Console) -> Path:
    """The variant's artifact under OUT (see built_recipe)."""
    return built_recipe(variant_recipe(name), OUT, console, label=name)


def built_recipe(recipe, root: Path, console: Console, label: str | None = None) -> Path:
    """root/<recipe name>, rebuilt when missing, or when its recipe or the code that builds it changed
    (build_code_digest)."""
    label = label or recipe.name
    folder = root / recipe.name
    manifest = folder / "manifest.json"
    source = root / f"{recipe.name}.source-sha256"  # beside the artifact, not in it: its manifest lists its files
    digest = build_code_digest()
    if manifest.is_file() and json.loads(manifest.read_text())["recipe"] == json.loads(json.dumps(recipe.to_dict())) \
            and source.is_file() and source.read_text() == digest:
        return folder
    console.log(f"building {label}")
    started = time.perf_counter()
    build(recipe, root, progress=lambda message: console.log(f"  {label}: {message}"))
    source.write_text(digest)
    console.log(f"built {label} in {time.perf_counter() - started:.0f} s")
    return folder


# onnxruntime-genai's own int4 CPU builds of the same Hugging Face folder -> its builder's extra options. The issue's
# baseline is its defaults (RTN, symmetric, block 32, the tied embedding quantized too); block 128 (genai's
# block_size option) times genai at the block size of aotlm's fastest int4 builds, which genai offers too.
# (Its int8 KV cache needs a scale file from a calibration genai's builder does not run: not an arm here.)
GENAI_INT4_BUILDS = {GENAI_INT4: {}, f"{GENAI_INT4}-b128": {"block_size": "128"}}


def genai_logits_for(folder: Path, threads: int):
    """genai's model.onnx as a logits function: a fresh sequence per call (empty past), all positions."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    empty_past = np.zeros((1, decoder["num_key_value_heads"], 0, decoder["head_size"]), np.float32)

    def logits_for(token_ids: np.ndarray) -> np.ndarray:
        n = len(token_ids)
        feeds = {"input_ids": token_ids[None].astype(np.int64), "attention_mask": np.ones((1, n), np.int64)}
        if "position_ids" in inputs:
            feeds["position_ids"] = np.arange(n, dtype=np.int64)[None]
        feeds.update({name: empty_past for name in inputs if name.startswith("past_key_values")})
        return session.run(["logits"], feeds)[0][0]

    return logits_for


def score(logits_for, tokens: np.ndarray, spans, reference_argmax: list | None) -> dict:
    """Perplexity over the spans' scored tokens, each span's argmax, and top-1 agreement with the reference."""
    nll, count, agree, argmaxes = 0.0, 0, 0, []
    for index, (start, end, first_scored) in enumerate(spans):
        logits = logits_for(tokens[start:end])[first_scored - 1 - start:end - 1 - start]
        targets = tokens[first_scored:end]
        nll -= float(log_softmax(logits)[np.arange(len(targets)), targets].sum())
        count += len(targets)
        argmaxes.append(logits.argmax(axis=-1))
        if reference_argmax is not None:
            agree += int((argmaxes[-1] == reference_argmax[index]).sum())
    return {"perplexity": float(np.exp(nll / count)), "tokens_scored": count,
            "top1_agreement": agree / count if reference_argmax is not None else None, "argmax": argmaxes}


def folder_bytes(folder: Path, suffixes=(".onnx", ".data", ".bin")) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in suffixes)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--threads", type=thread_count, default=usable_cpus())
    parser.add_argument("--no-genai", action="store_true")
    parser.add_argument("--genai-builds", default=GENAI_INT4,
                        help=f"genai int4 builds timed beside the variants, from {', '.join(GENAI_INT4_BUILDS)} "
                             f"(ratios are against {GENAI_INT4})")
    parser.add_argument("--glibc-huge-pages", action="store_true",
                        help="run under GLIBC_TUNABLES=glibc.malloc.hugetlb=1: genai's weights may then sit on 2 MiB "
                             "pages too (aotlm's engines put theirs there in any case)")
    parser.add_argument("--out", default="quantization.json",
                        help="JSON path; a bare file name goes under benchmarks/results/ (see out_path)")
    args = parser.parse_args(argv)
    output_file(parser, out_path(args.out))  # before the work, not a traceback after it
    if args.glibc_huge_pages:
        glibc_huge_pages(parser, argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    names = [n for n in args.variants.split(",") if n]
    if "fp32" not in names:
        parser.error("--variants must include fp32 (the reference for top-1 agreement)")
    names = ["fp32"] + [n for n in names if n != "fp32"]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    require_at_least_one(parser, args, "--prompt-tokens", "--repeats")  # every check here comes before the builds
    if args.new_tokens < 2:  # TPOT is the mean gap between output tokens: one token has none
        parser.error(f"--new-tokens must be >= 2 (TPOT needs two tokens), got {args.new_tokens}")
    if args.eval_tokens < 2:
        parser.error(f"--eval-tokens must be >= 2 (perplexity scores each token after the first), "
                     f"got {args.eval_tokens}")
    try:
        window_spans(args.eval_tokens, args.window, args.stride)
    except EvaluationError as error:
        parser.error(f"--window/--stride: {error}")
    genai_names = [] if args.no_genai else [n for n in args.genai_builds.split(",") if n]
    if [n for n in genai_names if n not in GENAI_INT4_BUILDS] or (genai_names and GENAI_INT4 not in genai_names):
        parser.error(f"--genai-builds: from {', '.join(GENAI_INT4_BUILDS)}, {GENAI_INT4} among them (the "
                     f"ratios' reference), got {args.genai_builds!r}; or pass --no-genai")
    if genai_names and importlib.util.find_spec("onnxruntime_genai") is None:  # before minutes of builds
        parser.error(f"{GENAI_INT4} is a baseline here and onnxruntime-genai is not installed: "
                     f"pip install 'aotlm[bench]', or pass --no-genai")

    artifacts = {name: built(name, console) for name in names}
    manifest = json.loads((artifacts["fp32"] / "manifest.json").read_text())
    hf_folder, _ = prepare_folders(manifest, console, want_genai=False)
    genai_folders = {name: genai_model(hf_folder, baseline_cache(manifest), "int4", console,
                                       **GENAI_INT4_BUILDS[name]) for name in genai_names}

    from runtime import Engine

    tokenizer = Engine.load(artifacts["fp32"], huge_pages=False).tokenizer  # only its tokenizer
    tokens = np.array(encode_text(tokenizer, builtin_text("pydoc-held-out"))[:args.eval_tokens])
    spans = window_spans(len(tokens), args.window, args.stride)
    prompt_ids = prompt_token_ids(artifacts["fp32"], manifest, args.prompt_tokens)
    results, reference_argmax = {}, None
    with Progress(console=console) as progress:
        # Timing first, every variant loaded and the repeats interleaved (generate.measure_all); then accuracy.
        backends = {name: Aotlm(artifacts[name], args.threads) for name in names}
        huge_pages = {name: backend.engine.huge_pages for name, backend in backends.items()}
        backends.update({name: Genai(folder, args.threads) for name, folder in genai_folders.items()})
        huge_page_bytes = anonymous_huge_page_bytes()  # every backend loaded: genai's pages count only here
        tasks = {name: progress.add_task(f"{name:24}", total=1 + args.repeats) for name in backends}
        timings = measure_all(backends, prompt_ids, args.new_tokens, args.repeats, progress, tasks)
        for name in list(backends):
            if name in genai_folders:
                size, logits_for = folder_bytes(genai_folders[name]), genai_logits_for(genai_folders[name], args.threads)
            else:
                from runtime.evaluate import decode_logits_for
                size, logits_for = folder_bytes(artifacts[name]), decode_logits_for(backends[name].engine)
            accuracy = score(logits_for, tokens, spans, reference_argmax)
            if name == "fp32":
                reference_argmax = accuracy["argmax"]
            del accuracy["argmax"], backends[name], logits_for  # free its weights before the next one is scored
            results[name] = {"bytes": size, **timings[name]["median"], **accuracy, "runs": timings[name]["runs"]}

    if GENAI_INT4 in results:
        for result in results.values():
            for key in ("tpot_ms", "ttft_ms"):
                result[f"{key[:4]}_vs_genai_paired"] = paired_ratio(result["runs"], results[GENAI_INT4]["runs"], key)
    render(results, console)
    console.print(contention_line([run["other_cores"] for result in results.values() for run in result["runs"]],
                                  "timed runs"))
    report = {"settings": {**vars(args), "eval_text": "builtin:pydoc-held-out", "spans": len(spans),
                           "aotlm_spin_after_run": SINGLE_STREAM_SPIN,
                           "variants": {n: variant_settings(n) for n in names},
                           "artifacts": {n: artifact_identity(artifacts[n]) for n in names},
                           "genai_builds": {n: genai_build_record(folder) for n, folder in genai_folders.items()},
                           "prompt_token_ids": prompt_ids, "aotlm_huge_pages": huge_pages,
                           "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
                           "process_huge_page_bytes_after_loads": huge_page_bytes},
              "machine": machine_info(), "versions": versions(), "results": results}
    console.print(f"wrote {write_result('quantization.json', report, out_path(args.out))}")
    return report


def paired_ratio(runs: list[dict], reference_runs: list[dict], key: str) -> float:
    """The median over repeats of run r's `key` over the reference's run r. measure_all runs every backend once per
    repeat, back to back, so each pair saw the same minute of the host; its speed drifts by more than the
    differences measured here from one minute to the next."""
    return paired_median([run[key] for run in runs], [reference[key] for reference in reference_runs])


def render(results: dict, console: Console) -> None:
    fp32 = results["fp32"]
    genai = results.get(GENAI_INT4)
    table = Table(title="quantization: size on disk, speed (batch 1; medians over the repeats, ratios paired per "
                        "repeat) and accuracy (held-out Python docs)")
    for column in ("variant", "MB", "TTFT ms", "TPOT ms", "TTFT / genai int4", "TPOT / genai int4", "perplexity",
                   "vs fp32", "top-1 vs fp32"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for name, r in results.items():
        table.add_row(name, f"{r['bytes'] / 1e6:.1f}", f"{r['ttft_ms']:.1f}", f"{r['tpot_ms']:.2f}",
                      f"{r['ttft_vs_genai_paired']:.2f}x" if genai else "-",
                      f"{r['tpot_vs_genai_paired']:.2f}x" if genai else "-", f"{r['perplexity']:.3f}",
                      f"{100 * (r['perplexity'] / fp32['perplexity'] - 1):+.2f}%",
                      "-" if r["top1_agreement"] is None else f"{100 * r['top1_agreement']:.2f}%")
    print_table(table, console)


if __name__ == "__main__":
    main()
