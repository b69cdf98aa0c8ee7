"""Where a decode step's time goes, per operator type, for artifacts and for onnxruntime-genai's model of the same weights.

    .venv/bin/python benchmarks/decode_profile.py [--artifacts A,B] [--genai FOLDER] [--contexts 64,590]
                                                  [--rows 1] [--steps 30] [--threads N] [--out F]

Each decode graph runs as its runtime runs it: batch 1 (--rows: sequences per step, as the scheduler's batched
steps run them, every row at the same context), the KV cache bound once as the past input and the aliased
present output (one buffer, updated in place), one token per step. The cache first holds `context` tokens of
random values, written into every row of the buffer: attention's arithmetic does not depend on the values, but its
memory traffic depends on the pages having been written. A never-written buffer of zeros (np.zeros) maps every
page to the kernel's one shared zero page, read from the CPU's cache: at context 576 our INT4 graph's attention
took 1.39 against 1.92 ms a step that way (profiled), and its step 5.00 against 5.35 ms with zeros written into
the buffer and 5.23 with random values (scratch runs, session 23). In the runtime the prefill has written the rows
that decode reads. 10 warm-up steps, then `--steps` timed steps, twice: once plain
(the step time, median) and once with onnxruntime's profiler, whose per-node kernel times are summed per operator
type and divided by the steps. The profiler adds a little per node, so its sum exceeds the plain step time; it says
where the time goes, the plain run how much there is.

The graphs are run with onnxruntime directly, not through aotlm's Engine or genai's Generator, so the comparison
is of the graphs and their kernels, with the same loop around both. genai's model (`--genai`, default: the int4
CPU build that benchmarks/quantization.py caches) reads its cache length from the attention mask, as genai
binds it; its buffer holds context + steps tokens, as genai sizes it for a request (max_length).
A table on the console, JSON in benchmarks/results/decode_profile.json (--out).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # before onnxruntime loads (aotlm's packages do it later)

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from arguments import output_file, thread_count, usable_cpus  # noqa: E402  (puts this checkout first on the path)
from generate import REPO, RESULTS, write_result  # benchmarks/ is on the path when run as a script
from compiler.console import print_table  # noqa: E402  (after arguments: this checkout's)

WARMUP_STEPS = 10
ELEMENT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}


def written_cache_buffer(shape: tuple[int, ...], dtype: type, rng: np.random.Generator) -> np.ndarray:
    """A cache buffer whose every page has been written (see the module's docstring: never-written zeros read
    faster than a real cache). Values of the scale keys and values have: about 0.1 in floats, +-100 as int8 codes."""
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-100, 101, shape).astype(dtype)
    return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


class DecodeGraph:
    """One decode graph with its cache bound: past_key_values.* as input, present.* as the same buffer's output."""

    def __init__(self, name: str, path: Path, kv_heads: int, head_dim: int, capacity: int | None, threads: int,
                 profile_prefix: str | None = None, rows: int = 1):
        self.name, self.rows = name, rows
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        if profile_prefix:
            options.enable_profiling = True
            options.profile_file_prefix = profile_prefix
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.binding = self.session.io_binding()
        self.inputs = {value.name for value in self.session.get_inputs()}
        self.buffers: list[ort.OrtValue] = []
        rng = np.random.default_rng(0)
        for value in self.session.get_inputs():
            if not value.name.startswith("past_key_values."):
                continue
            length = value.shape[2] if isinstance(value.shape[2], int) else capacity  # ours: the max context
            buffer = ort.OrtValue.ortvalue_from_numpy(
                written_cache_buffer((rows, kv_heads, length, head_dim), ELEMENT_TYPES[value.type], rng))
            self.buffers.append(buffer)
            self.binding.bind_ortvalue_input(value.name, buffer)
            self.binding.bind_ortvalue_output(value.name.replace("past_key_values.", "present."), buffer)
            self.capacity = length
        self.binding.bind_output("logits", "cpu")

    def step(self, length: int) -> float:
        """One token per row at position `length` (the cache holds `length` tokens before it); returns seconds."""
        self.binding.bind_cpu_input("input_ids", np.full((self.rows, 1), 42, np.int64))
        self.binding.bind_cpu_input("attention_mask", np.ones((self.rows, length + 1), np.int64))
        if "position_ids" in self.inputs:
            self.binding.bind_cpu_input("position_ids", np.full((self.rows, 1), length, np.int64))
        started = time.perf_counter()
        self.session.run_with_iobinding(self.binding)
        return time.perf_counter() - started


def measure(name: str, path: Path, kv_heads: int, head_dim: int, context: int, steps: int, threads: int,
            rows: int = 1) -> dict:
    """Plain median step ms, and the profiled ms per step of each operator type."""
    capacity = context + WARMUP_STEPS + steps + 1
    plain = DecodeGraph(name, path, kv_heads, head_dim, capacity, threads, rows=rows)
    if plain.capacity < capacity:
        raise SystemExit(f"{name}: context {context} + {WARMUP_STEPS + steps} steps exceed its cache ({plain.capacity})")
    times = [plain.step(context + step) for step in range(WARMUP_STEPS + steps)][WARMUP_STEPS:]
    del plain
    with tempfile.TemporaryDirectory() as folder:
        profiled = DecodeGraph(name, path, kv_heads, head_dim, capacity, threads, profile_prefix=f"{folder}/profile",
                               rows=rows)
        for step in range(WARMUP_STEPS + steps):
            profiled.step(context + step)
        events = json.loads(Path(profiled.session.end_profiling()).read_text())
    per_op = collections.Counter()
    for event in events:  # every step's kernels, the warm-up's included: divided by all steps run
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_op[event["args"]["op_name"]] += event["dur"]  # microseconds
    runs = WARMUP_STEPS + steps
    ops = {op: micros / 1e3 / runs for op, micros in per_op.most_common()}
    return {"graph": name, "path": str(path), "rows": rows, "context": context, "step_ms": 1e3 * float(np.median(times)),
            "profiled_sum_ms": sum(ops.values()), "ops_ms": ops}


def default_genai(artifact: Path) -> Path | None:
    """generate.genai_model's int4 build for the installed genai of the artifact's model (its layers, hidden size and
    vocabulary, as genai_config.json says them), in any baseline cache (quantization.py builds it under its fp32
    variant's, bench-fp32-*, a name that does not say which model); the newest. None where there is none."""
    try:
        import onnxruntime_genai
    except ImportError:
        return None
    config = json.loads((artifact / "manifest.json").read_text())["model"]["config"]
    shape = (config["num_layers"], config["hidden_size"], config["vocab_size"])
    found = []
    for path in (RESULTS / "cache").glob(f"*/genai-{onnxruntime_genai.__version__}-int4-cpu/genai_config.json"):
        model = json.loads(path.read_text())["model"]
        if (model["decoder"]["num_hidden_layers"], model["decoder"]["hidden_size"], model["vocab_size"]) == shape:
            found.append(path)
    found.sort(key=lambda path: path.stat().st_mtime, reverse=True)
    return found[0].parent if found else None


def graphs_to_profile(args) -> list[tuple[str, Path, int, int]]:
    """(name, decode graph path, kv heads, head dim) per artifact and for genai's model."""
    graphs = []
    for artifact in args.artifacts:
        manifest = json.loads((artifact / "manifest.json").read_text())
        config = manifest["model"]["config"]
        graphs.append((manifest["name"], artifact / manifest["engines"]["decode"]["file"], config["num_kv_heads"],
                       config["head_dim"]))
    if args.genai:
        decoder = json.loads((args.genai / "genai_config.json").read_text())["model"]["decoder"]
        graphs.append((f"genai {args.genai.name}", args.genai / decoder["filename"], decoder["num_key_value_heads"],
                       decoder["head_size"]))
    return graphs


def render(rows: list[dict], console: Console, threads: int, steps: int) -> None:
    for batch, context in sorted({(row["rows"], row["context"]) for row in rows}):
        at = [row for row in rows if (row["rows"], row["context"]) == (batch, context)]
        table = Table(title=f"decode step of {batch} row{'s' if batch > 1 else ''} at context {context}: ms per step by "
                            f"operator type (onnxruntime profiler, {steps} steps, {threads} threads)")
        table.add_column("operator")
        for row in at:
            table.add_column(row["graph"], justify="right")
        ops = sorted({op for row in at for op in row["ops_ms"]}, key=lambda op: -max(r["ops_ms"].get(op, 0) for r in at))
        for op in ops:
            table.add_row(op, *[f"{row['ops_ms'][op]:.3f}" if op in row["ops_ms"] else "-" for row in at])
        table.add_row("sum (profiled)", *[f"{row['profiled_sum_ms']:.2f}" for row in at], style="bold")
        table.add_row("step, not profiled (median)", *[f"{row['step_ms']:.2f}" for row in at], style="bold")
        print_table(table, console)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", default=str(REPO / "artifacts" / "smollm2-135m-int4"),
                        help="artifact folders, comma separated")
    parser.add_argument("--genai", type=Path, default=None,
                        help="an onnxruntime-genai model folder (default: the cached int4 CPU build, if any)")
    parser.add_argument("--no-genai", action="store_true", help="profile the artifacts only")
    parser.add_argument("--contexts", default="64,590", help="cached tokens before the timed steps, comma separated")
    parser.add_argument("--rows", default="1", help="sequences per step (batched decode), comma separated")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=thread_count, default=usable_cpus())
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/decode_profile.json)")
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the work, not a traceback after it
    args.artifacts = [Path(a) for a in args.artifacts.split(",") if a]
    for artifact in args.artifacts:
        if not (artifact / "manifest.json").is_file():
            parser.error(f"{artifact}: not an artifact folder (build it with aotlm build)")
    args.genai = None if args.no_genai else (args.genai or (default_genai(args.artifacts[0]) if args.artifacts else None))
    if args.genai is not None and not (args.genai / "genai_config.json").is_file():
        parser.error(f"{args.genai}: no genai_config.json (run benchmarks/quantization.py once to build genai's int4)")
    contexts = [int(c) for c in args.contexts.split(",") if c]
    batches = [int(r) for r in args.rows.split(",") if r]
    if args.steps < 1 or not contexts or min(contexts) < 1 or not batches or min(batches) < 1:
        parser.error("--steps, every context and every --rows value must be >= 1")
    console = Console(width=None if sys.stdout.isatty() else 160)

    rows = []
    graphs = graphs_to_profile(args)
    with console.status("profiling") as status:
        cells = [(batch, context) for batch in batches for context in contexts]
        order = list(enumerate(graphs))
        for index, (batch, context) in enumerate(cells):
            measured = {}
            for position, (name, path, kv_heads, head_dim) in order[::-1] if index % 2 else order:  # first by turns
                status.update(f"profiling {name}, {batch} rows at context {context}")
                measured[position] = measure(name, path, kv_heads, head_dim, context, args.steps, args.threads, batch)
            rows += [measured[position] for position in range(len(graphs))]  # the table's columns in one order
    render(rows, console, args.threads, args.steps)
    report = {"settings": {"artifacts": [str(a) for a in args.artifacts], "genai": str(args.genai) if args.genai else None,
                           "contexts": contexts, "rows": batches, "steps": args.steps, "threads": args.threads,
                           "warmup_steps": WARMUP_STEPS},
              "onnxruntime": ort.__version__, "rows": rows}
    console.print(f"wrote {write_result('decode_profile.json', report, args.out)}")
    return report


if __name__ == "__main__":
    main()
