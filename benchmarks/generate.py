"""Single-request generation latency: aotlm's runtime beside transformers (eager) and onnxruntime-genai.

    .venv/bin/python benchmarks/generate.py [--artifact artifacts/smollm2-135m] [--prompt-tokens 512]
        [--new-tokens 128] [--repeats 3] [--baselines transformers,onnxruntime-genai] [--threads N]

Each backend gets the same weights (the artifact's recipe `model` section, loaded with compiler.frontend and
written once as a Hugging Face folder under benchmarks/results/cache/), the same prompt token ids (Python's
own documentation, pydoc_data.topics, cut to exactly --prompt-tokens), batch 1 and greedy decoding that
never stops early, so every run makes exactly --new-tokens tokens. All backends are loaded first; one warm-up
run each, then --repeats rounds, each running every backend once (never two at once) in an order that rotates
from round to round; per backend each metric's own median over the rounds is reported (not one run's metrics), and
ratios between backends are the median of each round's ratio. aotlm's sessions are
opened with `aotlm run`'s thread setting (SINGLE_STREAM_SPIN: the decode session keeps its threads spinning).

Metrics (vLLM's definitions): TTFT = request start -> first new token chosen; TPOT = (E2E - TTFT) / (M - 1);
ITL = gaps between consecutive new tokens; decode tok/s = 1 / TPOT. Prefill = the prompt's forward pass
alone (aotlm: the prefill graph run; transformers: one separately timed forward; genai: append_tokens).
Writes benchmarks/results/generate.json (each run's ITLs too) and, beside it, generate-itl.png: the ITL distribution
per backend.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere
from arguments import artifact_manifest, output_file, require_at_least_one, thread_count, usable_cpus  # noqa: E402
from contention import OtherCores, contention_line  # noqa: E402
from compiler.artifact import tool_versions  # noqa: E402
from runtime import bench  # noqa: E402
from runtime.manifest import sha256_file  # noqa: E402
from runtime.results import write_json  # noqa: E402
from runtime.engine import SINGLE_STREAM_SPIN as ENGINE_SINGLE_STREAM_SPIN  # noqa: E402
from compiler.console import print_table  # noqa: E402
RESULTS = REPO / "benchmarks" / "results"
WARMUP_RUNS = 1
AGREE_TOKENS = 32  # greedy tokens every backend must share
TOOLS = ("aotlm", "torch", "transformers", "onnxruntime", "onnxruntime-genai", "numpy", "tokenizers")
# Batch-1 runs give aotlm's sessions `aotlm run`'s thread setting (runtime.engine.SINGLE_STREAM_SPIN): the decode
# session's threads spin on between steps. onnxruntime's default, which onnxruntime-genai's one session keeps, spins
# on after every run. (Huge pages stay on, Engine.load's default, where `aotlm run` turns them off to load faster.)
# A list: what the results' JSON settings record.
SINGLE_STREAM_SPIN = list(ENGINE_SINGLE_STREAM_SPIN)


@dataclass
class Run:
    """One timed request; times in seconds since the request started."""

    prefill_s: float
    token_times_s: list[float]  # one per new token
    token_ids: list[int]

    def metrics(self) -> dict:
        ttft, e2e = self.token_times_s[0], self.token_times_s[-1]
        if len(self.token_times_s) < 2:  # main() refuses --new-tokens < 2: a run this short has no gaps to time
            raise ValueError(f"a run of {len(self.token_times_s)} token(s) has no TPOT or ITL")
        tpot = (e2e - ttft) / (len(self.token_times_s) - 1)
        itl_ms = 1e3 * np.diff(self.token_times_s)
        return {
            "ttft_ms": 1e3 * ttft, "prefill_ms": 1e3 * self.prefill_s, "tpot_ms": 1e3 * tpot, "e2e_ms": 1e3 * e2e,
            **{f"itl_p{q}_ms": float(np.percentile(itl_ms, q)) for q in (50, 95, 99)},
            "decode_tokens_per_s": 1.0 / tpot if tpot > 0 else 0.0, "new_tokens": len(self.token_ids),
        }


# -- backends: setup() loads, run(prompt_ids, new_tokens) -> Run ----------------------------------------
class Aotlm:
    name = "aotlm"

    def __init__(self, artifact: Path, threads: int):
        from runtime import Engine

        self.engine = Engine.load(artifact, intra_op_threads=threads, spin_after_run=SINGLE_STREAM_SPIN,
                                  generation_config="none")  # greedy, as the baselines: not a model's defaults

    def run(self, prompt_ids: list[int], new_tokens: int) -> Run:
        result = self.engine.generate(prompt_ids, max_new_tokens=new_tokens, ignore_eos=True)  # greedy
        timings = result.timings
        return Run(timings.prefill_s, list(timings.token_times_s), list(result.token_ids))


class Transformers:
    name = "transformers"

    def __init__(self, hf_folder: Path, threads: int):
        import torch
        from transformers import LlamaForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        if not sys.stderr.isatty():  # its "Loading weights" bar wrote a \r line per update into logs
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
        self.model = LlamaForCausalLM.from_pretrained(hf_folder, attn_implementation="eager", dtype=torch.float32).eval()
        # one id: transformers 5 refuses a list (the default model's config ends at ids [2, 0]); no batch pads anyway
        eos = self.model.config.eos_token_id
        self.pad_token_id = eos[0] if isinstance(eos, list) else eos

    def run(self, prompt_ids: list[int], new_tokens: int) -> Run:
        from transformers.generation.streamers import BaseStreamer

        class TokenClock(BaseStreamer):  # generate() calls put() with the prompt, then once per new token
            def __init__(self):
                self.times, self.seen_prompt = [], False

            def put(self, value):
                if self.seen_prompt:
                    self.times.append(time.perf_counter() - started)
                self.seen_prompt = True

            def end(self):
                pass

        input_ids = self.torch.tensor([prompt_ids])
        with self.torch.inference_mode():
            prefill_started = time.perf_counter()
            self.model(input_ids, use_cache=True, logits_to_keep=1)  # as generate() does: last position only
            prefill_s = time.perf_counter() - prefill_started
            clock = TokenClock()
            started = time.perf_counter()
            output = self.model.generate(
                input_ids, attention_mask=self.torch.ones_like(input_ids), do_sample=False, streamer=clock,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=self.pad_token_id,
            )
        return Run(prefill_s, clock.times, output[0, len(prompt_ids):].tolist())


class Genai:
    name = "onnxruntime-genai"

    def __init__(self, genai_folder: Path, threads: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(genai_folder))
        config.clear_providers()  # CPU
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.tokenizer = og.Tokenizer(self.model)

    def run(self, prompt_ids: list[int], new_tokens: int) -> Run:
        params = self.og.GeneratorParams(self.model)
        total = len(prompt_ids) + new_tokens  # min_length = max_length: end-of-sequence cannot end it early
        params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=1)
        generator = self.og.Generator(self.model, params)
        started = time.perf_counter()
        generator.append_tokens(np.asarray(prompt_ids, dtype=np.int32))
        prefill_s = time.perf_counter() - started
        times, tokens = [], []
        for _ in range(new_tokens):
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            times.append(time.perf_counter() - started)
        return Run(prefill_s, times, tokens)


# -- inputs: weights folders, prompt -------------------------------------------------------------------------
def baseline_cache(manifest: dict) -> Path:
    """The folder the baselines' models of this artifact's weights are cached in (benchmarks/results/cache/...),
    keyed on the recipe's model section, the source the build read and the frontend's code, which reads the weights
    and writes them as a Hugging Face folder (a fix there left the baselines on a folder written before it); genai's
    builds live inside, so they follow."""
    from compiler.artifact import sources_sha256

    frontend = sources_sha256(REPO, folders=("compiler/frontend",))
    key = hashlib.sha256(json.dumps([manifest["recipe"]["model"], manifest["model"]["source"], frontend],
                                    sort_keys=True).encode()).hexdigest()
    return RESULTS / "cache" / f"{manifest['name']}-{key[:12]}"


def prepare_folders(manifest: dict, console: Console, want_genai: bool) -> tuple[Path, Path | None]:
    """The artifact's weights as a Hugging Face folder and, where wanted, as a genai fp32 CPU model (genai_model),
    built once and cached under baseline_cache(manifest)."""
    model_section = manifest["recipe"]["model"]
    cache = baseline_cache(manifest)
    hf_folder, genai_folder = cache / "hf", None
    if model_section["source"] == "hf":  # the model's own folder: its config says what ours may not (llama3 rope)
        hf_folder = Path(model_section["path"])
    if not (hf_folder / "config.json").is_file():
        from compiler.frontend import load_model
        from compiler.frontend.config import DecoderConfig
        from compiler.frontend.hf_writer import write_hf_folder

        console.log(f"writing the weights as a Hugging Face folder: {hf_folder}")
        config = DecoderConfig.from_dict(model_section["config"]) if model_section.get("config") else None
        loaded = load_model(model_section["source"], model_section.get("path"), config, model_section.get("seed", 0))
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="hf.partial-", dir=cache))  # its own: two runs may write at once
        try:
            write_hf_folder(loaded, staging)
            os.replace(staging, hf_folder)
        except OSError:
            if not (hf_folder / "config.json").is_file():  # not another run's folder, renamed in first
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if want_genai:
        genai_folder = genai_model(hf_folder, cache, "fp32", console)
    return hf_folder, genai_folder


GENAI_BUILD_RECORD = "aotlm-genai-build.json"  # in each genai model folder: how it was built (genai_build_record)


def genai_model(hf_folder: Path, cache: Path, precision: str, console: Console, **extra_options: str) -> Path:
    """onnxruntime-genai's own CPU build of a Hugging Face folder: its builder's defaults for `precision`, changed by
    `extra_options` (the builder's `--extra_options key=value`). Built once and cached in `cache` (baseline_cache:
    never beside an `hf` source's own folder), under a name that holds genai's version and the options: a folder
    found by a fixed name was timed after a genai upgrade (or with other options) while the results named the new
    version. Built into a temporary folder and renamed, with GENAI_BUILD_RECORD in it, so a failed build is never
    taken for a model."""
    import onnxruntime_genai

    version = onnxruntime_genai.__version__
    cache.mkdir(parents=True, exist_ok=True)
    folder = cache / f"genai-{version}-{precision}-cpu{''.join(f'-{k}-{v}' for k, v in sorted(extra_options.items()))}"
    if (folder / GENAI_BUILD_RECORD).is_file():
        return folder
    options = ", ".join(f"{key}={value}" for key, value in sorted(extra_options.items())) or "its defaults"
    console.log(f"building onnxruntime-genai {version}'s {precision} CPU model ({options}): {folder}")
    staging = Path(tempfile.mkdtemp(prefix=f"{folder.name}.partial-", dir=cache))
    try:
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o", str(staging),
                   "-p", precision, "-e", "cpu", "-c", str(cache / "builder-cache")]
        if extra_options:
            command += ["--extra_options", *(f"{key}={value}" for key, value in sorted(extra_options.items()))]
        # cwd: `python -m` puts the working directory first on sys.path, and the builder's own `quantization`
        # module lost to benchmarks/quantization.py when run from benchmarks/ (ImportError: QuantConfig)
        built = subprocess.run(command, capture_output=True, text=True, cwd=cache)
        if built.returncode:  # its progress bars are noise, but on failure its output is the diagnosis
            raise SystemExit(f"onnxruntime-genai's builder failed:\n{built.stdout[-3000:]}{built.stderr[-3000:]}")
        files = {path.name: sha256_file(path) for path in sorted(staging.iterdir()) if path.suffix in (".onnx", ".data")}
        write_json(staging / GENAI_BUILD_RECORD, {
            "onnxruntime_genai": version, "precision": precision, "execution_provider": "cpu",
            "extra_options": dict(sorted(extra_options.items())), "hf_folder": str(hf_folder),
            "builder_command": [*command[:6], str(folder), *command[7:]], "files_sha256": files})
        staging.chmod(0o755)  # mkdtemp's 0700: the cached model readable as any folder the builder makes
        try:
            os.replace(staging, folder)
        except OSError:
            if not (folder / GENAI_BUILD_RECORD).is_file():  # not another run's build, renamed in first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


GLIBC_HUGE_PAGES = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: malloc advises transparent huge pages for its memory


def glibc_huge_pages(parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """A script's --glibc-huge-pages: start it again under GLIBC_TUNABLES=glibc.malloc.hugetlb=1, so that what every
    backend allocates through malloc (onnxruntime-genai's weights included, which otherwise stay on 4 KiB pages
    where the kernel's transparent huge pages are in madvise mode) may sit on 2 MiB pages, as aotlm's engines put
    theirs. glibc reads its tunables when the process starts: they cannot be set from inside."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    chosen = [tunable for tunable in tunables.split(":") if tunable.startswith("glibc.malloc.hugetlb=")]
    if chosen and chosen[-1] == "glibc.malloc.hugetlb=0":  # glibc takes the last
        parser.error(f"--glibc-huge-pages, but GLIBC_TUNABLES={tunables} turns them off: unset one of the two")
    if chosen:
        return  # set (=1), or the user's own choice (=2: hugetlbfs pages), which the results record
    version = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else None
    if not version or tuple(int(part) for part in version.split()[-1].split(".")[:2]) < (2, 35):
        parser.error(f"--glibc-huge-pages needs glibc 2.35 or later (its malloc.hugetlb tunable); this is "
                     f"{version or 'not glibc'}")
    if argv is not None:  # called as a function (tests): the process is not this script's to replace
        parser.error(f"--glibc-huge-pages starts the script again: run it from the command line, or set "
                     f"GLIBC_TUNABLES={GLIBC_HUGE_PAGES} before starting Python")
    env = {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, GLIBC_HUGE_PAGES]))}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def anonymous_huge_page_bytes() -> int | None:
    """The process's memory on transparent huge pages now (/proc/self/smaps_rollup's AnonHugePages); None where
    unreadable."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def artifact_identity(artifact: Path) -> dict:
    """What names an artifact's exact build in a result: its manifest's sha256 (the manifest lists every file's)."""
    return {"path": str(artifact), "manifest_sha256": sha256_file(artifact / "manifest.json")}


def genai_build_record(folder: Path) -> dict:
    """How genai_model built `folder`: genai's version, precision, options, the builder's command, its files' sha256
    (what the results record, so a reader knows which model was timed)."""
    return json.loads((folder / GENAI_BUILD_RECORD).read_text())


def prompt_token_ids(artifact: Path, manifest: dict, count: int) -> list[int]:
    """Exactly `count` token ids of real English text (Python's docs), with the artifact's tokenizer."""
    from pydoc_data.topics import topics

    from runtime.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(artifact / manifest["tokenizer"]["file"], manifest["tokenizer"].get("bos_token_id"))
    text = "\n\n".join(topics[name] for name in sorted(topics))
    characters = 8 * count  # tokenize only what is needed; ~4 characters per token in English
    while True:
        ids = tokenizer.encode(text[:characters])
        if len(ids) > count or characters >= len(text):
            break
        characters *= 2
    if len(ids) < count:
        raise SystemExit(f"the prompt text has only {len(ids)} tokens; ask for fewer --prompt-tokens")
    return ids[:count]


# -- driver ---------------------------------------------------------------------------------------------------
def measure_all(backends: dict, prompt_ids: list[int], new_tokens: int, repeats: int, progress: Progress,
                tasks: dict) -> dict:
    """Per backend name: each metric's median over the runs, every run's metrics and ITLs, and the first run's
    tokens (greedy: every run's are the same).

    The repeats are interleaved: repeat r runs every backend once, in an order rotated by r. These shared 2-core
    VMs change speed by a third from one minute to the next (single-stream TPOT 10.4 against 13.9 ms in two runs
    of the same build); backends measured one after another compared the machine's moods as much as themselves."""
    names = list(backends)
    for name in names:
        for _ in range(WARMUP_RUNS):
            backends[name].run(prompt_ids, new_tokens)
            progress.advance(tasks[name])
    runs: dict[str, list] = {name: [] for name in names}
    other_cores: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            with OtherCores() as others:
                runs[name].append(backends[name].run(prompt_ids, new_tokens))
            other_cores[name].append(others.cores)
            progress.advance(tasks[name])
    results = {}
    for name, made in runs.items():
        for run in made:
            if len(run.token_ids) != new_tokens:
                raise RuntimeError(f"{name} made {len(run.token_ids)} tokens, not {new_tokens}")
        # each run's metrics, and the cores other processes used meanwhile (contention.py)
        metrics = [{**run.metrics(), "other_cores": cores} for run, cores in zip(made, other_cores[name])]
        # each metric's own median over the repeats (not one run's metrics: the run of median E2E need not have
        # the median TTFT); ratios between backends are paired per repeat (paired_ratios)
        results[name] = {"median": {key: float(np.median([m[key] for m in metrics])) for key in metrics[0]},
                         "runs": metrics, "token_ids": made[0].token_ids,
                         "itl_ms": [(1e3 * np.diff(run.token_times_s)).tolist() for run in made]}  # per run, for plots
    return results


def paired_ratios(results: dict, reference: str, keys=("tpot_ms", "ttft_ms")) -> dict[str, dict[str, float]]:
    """Per backend, per key: the median over repeats of its run r over the reference's run r (measure_all runs every
    backend once per repeat, back to back, so a pair saw the same minute of the host, which drifts by a third)."""
    runs = results[reference]["runs"]
    return {name: {key: paired_median([run[key] for run in result["runs"]], [ref[key] for ref in runs]) for key in keys}
            for name, result in results.items()}


def agreement(results: dict, tokens: int = AGREE_TOKENS) -> dict:
    reference = results["aotlm"]["token_ids"][:tokens]
    report = {}
    for name, result in results.items():
        made = result["token_ids"][:tokens]
        first = next((i for i, (a, b) in enumerate(zip(reference, made)) if a != b), None)
        report[name] = {"agrees": made == reference, "first_difference": first}
    return report


def render(results: dict, console: Console) -> None:
    table = Table(title="generation latency (each metric's median over the repeats; ratios paired per repeat)")
    for column in ("backend", "TTFT ms", "prefill ms", "TPOT ms", "ITL p50 ms", "ITL p95 ms", "ITL p99 ms",
                   "decode tok/s", "TPOT / genai", "TTFT / genai"):
        table.add_column(column, justify="left" if column == "backend" else "right")
    ratios_to_genai = paired_ratios(results, Genai.name) if Genai.name in results else {}
    for name, result in results.items():
        m = result["median"]
        ratios = [f"{ratios_to_genai[name][k]:.2f}x" if ratios_to_genai else "-" for k in ("tpot_ms", "ttft_ms")]
        table.add_row(name, f"{m['ttft_ms']:.1f}", f"{m['prefill_ms']:.1f}", f"{m['tpot_ms']:.2f}",
                      f"{m['itl_p50_ms']:.2f}", f"{m['itl_p95_ms']:.2f}", f"{m['itl_p99_ms']:.2f}",
                      f"{m['decode_tokens_per_s']:.1f}", *ratios)
    print_table(table, console)


def machine_info() -> dict:
    """The machine a result came from (runtime.bench.machine: the CPU and the ISA its kernels use, the huge-pages mode
    aotlm's engines collapse their weights under, versions), the commit that ran and the load."""
    from runtime.bench import machine

    return {**machine(), "git_commit": _git_commit(),
            "load_average_1_5_15_min": os.getloadavg()}  # at the end: above the thread count means a shared CPU


def _git_commit() -> str | None:
    """HEAD of the checkout that ran, "+changes" when its tracked files differ from it; None outside a checkout."""
    import subprocess

    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD"], timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+changes" if dirty else "")


def versions() -> dict:
    return tool_versions(TOOLS)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=REPO / "artifacts" / "smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baselines", default="transformers,onnxruntime-genai")
    parser.add_argument("--threads", type=thread_count, default=usable_cpus())
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/generate.json)")
    args = parser.parse_args(argv)
    output_file(parser, args.out or RESULTS / "generate.json")
    console = Console(width=None if sys.stdout.isatty() else 150)  # a pipe gets 80 columns: too few
    baselines = [name for name in args.baselines.split(",") if name]
    unknown = set(baselines) - {Transformers.name, Genai.name}
    if unknown:
        parser.error(f"unknown baselines {sorted(unknown)}; known: {Transformers.name}, {Genai.name}")
    if Genai.name in baselines:
        try:
            import onnxruntime_genai  # noqa: F401
        except ImportError as error:
            console.log(f"[yellow]skipping {Genai.name}: {error}")
            baselines.remove(Genai.name)

    manifest = artifact_manifest(parser, args.artifact)
    max_context = manifest["kv_cache"]["max_context"]
    require_at_least_one(parser, args, "--repeats")
    if args.new_tokens < 2:  # TPOT and ITL are gaps between output tokens: one token has none
        parser.error(f"--new-tokens must be >= 2 (TPOT and ITL need two tokens), got {args.new_tokens}")
    if args.prompt_tokens < 1:
        parser.error(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    if args.prompt_tokens + args.new_tokens > max_context:  # genai's generator takes prompt + new tokens
        parser.error(f"--prompt-tokens + --new-tokens must fit the artifact's max context ({max_context})")
    prompt_ids = prompt_token_ids(args.artifact, manifest, args.prompt_tokens)
    # The baselines' weights folders (written once, cached): none without baselines.
    hf_folder, genai_folder = prepare_folders(manifest, console, Genai.name in baselines) if baselines else (None, None)
    makers = {"aotlm": lambda: Aotlm(args.artifact, args.threads),
              Transformers.name: lambda: Transformers(hf_folder, args.threads),
              Genai.name: lambda: Genai(genai_folder, args.threads)}

    backends, setup_s = {}, {}
    with Progress(console=console) as progress:
        for name in ["aotlm", *baselines]:  # all loaded at once (~2 GB for the default model): runs interleave
            setup_started = time.perf_counter()
            backends[name] = makers[name]()
            setup_s[name] = time.perf_counter() - setup_started
        tasks = {name: progress.add_task(f"{name:18}", total=WARMUP_RUNS + args.repeats) for name in backends}
        measured = measure_all(backends, prompt_ids, args.new_tokens, args.repeats, progress, tasks)
    results = {name: {"setup_s": setup_s[name], **measured[name]} for name in backends}
    huge_pages = backends["aotlm"].engine.huge_pages  # genai's weights stay on the pages it put them on
    del backends

    render(results, console)
    console.print(contention_line([run["other_cores"] for result in results.values() for run in result["runs"]],
                                  "timed runs"))
    compared = min(AGREE_TOKENS, args.new_tokens)  # --new-tokens 8 compares 8 tokens, not 32
    agree = agreement(results, compared)
    same = all(entry["agrees"] for entry in agree.values())
    console.print(f"first {compared} greedy tokens agree across {', '.join(agree)}: {'yes' if same else 'NO'}")
    for name, entry in agree.items():
        if not entry["agrees"]:
            console.print(f"  {name}: first difference from aotlm at new token {entry['first_difference']}")
    report = {
        "settings": {"artifact": str(args.artifact), "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                     "repeats": args.repeats, "warmup_runs": WARMUP_RUNS, "threads": args.threads, "batch": 1,
                     "aotlm_spin_after_run": SINGLE_STREAM_SPIN,
                     "decoding": "greedy, stop tokens disabled", "prompt_source": "pydoc_data.topics (sorted, joined)",
                     "hf_folder": str(hf_folder) if hf_folder else None, "genai_folder": str(genai_folder) if Genai.name in baselines else None,
                     "aotlm_artifact": artifact_identity(args.artifact), "aotlm_huge_pages": huge_pages,
                     "genai_build": genai_build_record(genai_folder) if Genai.name in baselines else None},
        "machine": machine_info(), "versions": versions(),
        "prompt_token_ids": prompt_ids, "results": results,
        "agreement": {"tokens_compared": compared, "all_agree": same, "backends": agree},
    }
    path = write_result("generate.json", report, args.out)
    plot = bench.write_cdf_plot(path.with_name(f"{path.stem}-itl.png"), {
        f"ITL, {args.prompt_tokens}-token prompt, every run's gaps": {
            name: [gap for run in result["itl_ms"] for gap in run] for name, result in results.items()}}, "ms")
    console.print(f"wrote {path}" + (f", {plot}" if plot else f"; {bench.PLOT_SKIPPED}"), markup=False)
    return report


def paired_median(values: Sequence[float], references: Sequence[float]) -> float:
    """The median of value i / reference i: each pair measured in the same repeat or round, minutes apart at most,
    so the host's drift between repeats (a third in single-stream speed) moves both numbers of a ratio."""
    return float(np.median([value / reference for value, reference in zip(values, references, strict=True)]))


def write_result(name: str, report: dict, out: Path | None = None) -> Path:
    """Pretty JSON at `out` (a script's --out), else benchmarks/results/<name> (git-ignored)."""
    path = Path(out) if out else RESULTS / name
    return write_json(path, report)  # whole or not at all: a full disk left an empty file over the last result


if __name__ == "__main__":
    main()
