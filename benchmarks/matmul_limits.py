"""How fast onnxruntime's matrix kernels stream a model's weights on this machine: the floor under decode.

    .venv/bin/python benchmarks/matmul_limits.py [--rows 1,12,16,24] [--layers 30] [--threads N] [--runs 15] [--out F]

One graph per weight format holds only the model's projections, chained: per layer q/k/v packed (hidden x
hidden + 2 kv_width), o (hidden x hidden), gate/up packed (hidden x 2 intermediate) and down (intermediate x
hidden), then the tied lm_head (hidden x vocab); a Slice between two products keeps the chain's widths. The
defaults are SmolLM2-135M's shapes, as the default artifact packs them (425 MB of fp32 layer weights and a
113 MB head, far more than the last-level cache, so every run reads them from memory). Formats: fp32 `MatMul`
(weights prepacked by onnxruntime), and `com.microsoft.MatMulNBits` with int8 activations (accuracy_level 4)
in 4 bits (blocks of 32) and 8 bits (blocks of 16), as the INT4 and INT8 recipes lower them (--accuracy-level
changes the activations' type). --rows is the
number of sequences in a step: 1 is batch-1 decode, 16 a 16-row batched decode step. The default rows show
onnxruntime's fp32 kernel (MLAS) working in tiles of rows: 12 on AVX-512, 6 with AVX2/FMA3, 4 with AVX (its
sgemm.cpp says so). On AVX-512, 16 rows take two passes over each weight panel, as 24 do (session 27: 27.2 ms at
12 rows, 35.6 at 16, 36.4 at 24; 17.7 at 1); with FMA3, 16 rows take three, as 18 do.

Per format and rows: median time of --runs runs after warm-up, the weight bytes read, GB/s (those bytes / time),
that as a fraction of this machine's measured bandwidth (`aotlm plan`'s cpu figure), and GFLOP/s (2 x rows x
parameters / time). A decode step of the whole model also runs attention, norms and activations, so it cannot be
faster than this chain; batched steps show when the kernels stop being limited by the bytes and start being
limited by the arithmetic. A table on the console, JSON in benchmarks/results/matmul_limits.json (--out).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # before onnxruntime loads (aotlm's packages do it later)

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from compiler.plan import cpu_device  # noqa: E402
from compiler.console import print_table  # noqa: E402
from runtime.results import write_json  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import count_list, output_file, thread_count, usable_cpus  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FORMATS = {"fp32": None, "int4": (4, 32), "int8": (8, 16)}  # (bits, block size) of MatMulNBits


def layer_shapes(hidden: int, intermediate: int, kv_width: int) -> list[tuple[int, int]]:
    """(K, N) of one layer's products in order; each N's first K_next columns feed the next product."""
    return [(hidden, hidden + 2 * kv_width), (hidden, hidden), (hidden, 2 * intermediate), (intermediate, hidden)]


def weight(rng: np.random.Generator, name: str, k: int, n: int, fmt: str) -> tuple[list, int]:
    """Initializers of one product's weight and the bytes they hold. Values keep activations near unit scale."""
    if FORMATS[fmt] is None:
        values = (rng.uniform(-1, 1, (k, n)) / np.sqrt(k)).astype(np.float32)
        return [numpy_helper.from_array(values, name)], values.nbytes
    bits, block = FORMATS[fmt]
    blocks = -(-k // block)
    codes = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)  # random nibbles / bytes
    # uniform codes around the default zero point (8 or 128) have a std of ~4.6 (4 bits) or ~74 (8 bits): these
    # scales give each weight a std of 1/sqrt(k), as the fp32 chain's, so the activations neither vanish nor blow up
    scales = np.full((n, blocks), 1.0 / (np.sqrt(k) * (4.6 if bits == 4 else 74.0)), dtype=np.float32)
    return [numpy_helper.from_array(codes, name), numpy_helper.from_array(scales, f"{name}_scales")], \
        codes.nbytes + scales.nbytes


def chain_model(fmt: str, rows: int, layers: int, hidden: int, intermediate: int, kv_width: int, vocab: int,
                seed: int = 0, accuracy_level: int = 4) -> tuple[bytes, int, int]:
    """The chained graph, its weight bytes and its parameter count."""
    rng = np.random.default_rng(seed)
    nodes, inits, weight_bytes, params = [], [], 0, 0
    ends = {}  # Slice end -> its constant's name
    x = "x"
    shapes = layer_shapes(hidden, intermediate, kv_width) * layers + [(hidden, vocab)]
    for index, (k, n) in enumerate(shapes):
        name = f"w{index}"
        tensors, size = weight(rng, name, k, n, fmt)
        inits += tensors
        weight_bytes, params = weight_bytes + size, params + k * n
        if FORMATS[fmt] is None:
            nodes.append(helper.make_node("MatMul", [x, name], [f"y{index}"]))
        else:
            bits, block = FORMATS[fmt]
            nodes.append(helper.make_node("MatMulNBits", [x, name, f"{name}_scales"], [f"y{index}"],
                                          domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
                                          accuracy_level=accuracy_level))
        x = f"y{index}"
        if index + 1 < len(shapes) and shapes[index + 1][0] != n:  # narrow to the next product's K
            end = shapes[index + 1][0]
            if end not in ends:
                ends[end] = f"end{end}"
                inits.append(numpy_helper.from_array(np.array([end], np.int64), ends[end]))
            nodes.append(helper.make_node("Slice", [x, "zero", ends[end], "last_axis"], [f"{x}_narrow"]))
            x = f"{x}_narrow"
    inits += [numpy_helper.from_array(np.array([0], np.int64), "zero"),
              numpy_helper.from_array(np.array([1], np.int64), "last_axis")]
    graph = helper.make_graph(nodes, f"chain_{fmt}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString(), weight_bytes, params


def time_chain(model: bytes, rows: int, hidden: int, threads: int, runs: int) -> float:
    """Median seconds of one pass over the chain, after two warm-up runs (prepacking, allocations)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    feed = {"x": np.random.default_rng(1).standard_normal((rows, hidden)).astype(np.float32)}
    for _ in range(2):
        session.run(None, feed)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=count_list, default=[1, 12, 16, 24], help="sequences per step, comma separated")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--kv-width", type=int, default=192, help="kv heads x head_dim")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=thread_count, default=usable_cpus())
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--accuracy-level", type=int, default=4, choices=(0, 1, 2, 3, 4),
                        help="MatMulNBits' accuracy_level: 4 = int8 activations (the recipes'), 0/1 = float")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="GB/s to compare with (default: this machine's, measured once and cached by aotlm plan)")
    parser.add_argument("--out", type=Path, default=RESULTS / "matmul_limits.json")
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the work, not a traceback after it
    if args.runs < 1:  # --runs 0 wrote NaN medians as the table and the JSON
        parser.error(f"--runs must be >= 1, got {args.runs}")
    formats = [f for f in args.formats.split(",") if f]
    unknown = set(formats) - set(FORMATS)
    if unknown or not formats:
        parser.error(f"unknown formats {sorted(unknown)}; known: {', '.join(FORMATS)}")
    row_counts = args.rows
    bandwidth = args.bandwidth * 1e9 if args.bandwidth else cpu_device()["bandwidth"]
    console = Console(width=None if sys.stdout.isatty() else 140)

    results = []
    with console.status("timing") as status:
        for fmt in formats:
            for rows in row_counts:
                status.update(f"timing {fmt}, {rows} rows")
                model, weight_bytes, params = chain_model(fmt, rows, args.layers, args.hidden, args.intermediate,
                                                          args.kv_width, args.vocab,
                                                          accuracy_level=args.accuracy_level)
                seconds = time_chain(model, rows, args.hidden, args.threads, args.runs)
                results.append({"format": fmt, "rows": rows, "ms": seconds * 1e3, "weight_bytes": weight_bytes,
                                "params": params, "gb_per_s": weight_bytes / seconds / 1e9,
                                "of_bandwidth": weight_bytes / seconds / bandwidth,
                                "gflop_per_s": 2 * rows * params / seconds / 1e9})

    table = Table(title=f"{args.layers} layers of chained projections + lm_head, {args.threads} threads, median of "
                        f"{args.runs}; this machine's bandwidth {bandwidth / 1e9:.1f} GB/s")
    for column in ("format", "rows", "ms", "weight MB", "GB/s", "of bandwidth", "GFLOP/s"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r["format"], str(r["rows"]), f"{r['ms']:.2f}", f"{r['weight_bytes'] / 1e6:.1f}",
                      f"{r['gb_per_s']:.1f}", f"{r['of_bandwidth']:.0%}", f"{r['gflop_per_s']:.1f}")
    print_table(table, console)
    report = {"settings": {k: str(v) for k, v in vars(args).items()}, "bandwidth_bytes_per_s": bandwidth,
              "onnxruntime": ort.__version__, "rows": results}
    write_json(args.out, report)
    console.print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
