"""One onnxruntime GroupQueryAttention node with a float32 or an int8 KV cache: why quantize_kv_cache keeps the
float flash kernel in prefill and the int8 cache in decode; and rotary inside the node or in two RotaryEmbedding
nodes before it: why lower_onnxruntime keeps it inside (its `rotary` option).

    .venv/bin/python benchmarks/kv_cache_attention.py [--threads 2] [--runs 50]

SmolLM2-135M's shapes (9 query heads, 3 kv heads, head_dim 64, a 2048-token cache buffer), one layer, 2 threads.
Prefill: a whole prompt, no past, on the float flash kernel (past and present of the prompt's length, as the
prefill graph runs it after the pass) against the int8 cache buffer (onnxruntime's quantized path). Decode: one
query over `context` cached tokens, past and present sharing one buffer, float (on the GEMM path, as
lower_onnxruntime sets it: scale 1, qk_output) against the same with an int8 per-channel cache. The third
column is the float32 node with do_rotary 0 after com.microsoft.RotaryEmbedding on q and k (lower_onnxruntime's
`rotary: separate`), timed as the three nodes. Medians of --runs runs for decode, of max(3, --runs / 10) for
prefill (a prompt's run takes ~100x a step's). A table on the console, JSON in
benchmarks/results/kv_cache_attention.json (--out).
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
from onnx import TensorProto, helper  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import output_file, thread_count  # noqa: E402
from compiler.console import print_table  # noqa: E402  (after the path insert: this checkout's)
from runtime.results import write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, CACHE = 9, 3, 64, 2048
RESULTS = Path(__file__).resolve().parent / "results"
INT8_ATTRIBUTES = {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 8}


def attention_model(queries: int, cache: str, shared: bool, decode_gemm: bool, rotary_separate: bool = False) -> bytes:
    """One node. cache: "float32" | "int8"; shared: past/present are the 2048-token buffer (else no past);
    rotary_separate: q and k rotated by RotaryEmbedding nodes at input `positions` first (do_rotary 0)."""
    value = helper.make_tensor_value_info
    element = TensorProto.INT8 if cache == "int8" else TensorProto.FLOAT
    inputs = [value("q", TensorProto.FLOAT, [1, queries, HEADS * HEAD_DIM]),
              value("k", TensorProto.FLOAT, [1, queries, KV_HEADS * HEAD_DIM]),
              value("v", TensorProto.FLOAT, [1, queries, KV_HEADS * HEAD_DIM]),
              value("seqlens_k", TensorProto.INT32, [1]), value("total", TensorProto.INT32, []),
              value("cos", TensorProto.FLOAT, [CACHE, HEAD_DIM // 2]), value("sin", TensorProto.FLOAT, [CACHE, HEAD_DIM // 2])]
    names = ["q", "k", "v", "past_key" if shared else "", "past_value" if shared else "", "seqlens_k", "total", "cos", "sin"]
    attributes = {"num_heads": HEADS, "kv_num_heads": KV_HEADS, "do_rotary": 0 if rotary_separate else 1}
    nodes = []
    if rotary_separate:
        inputs.append(value("positions", TensorProto.INT64, [1, queries]))
        for name, heads in (("q", HEADS), ("k", KV_HEADS)):
            nodes.append(helper.make_node("RotaryEmbedding", [name, "positions", "cos", "sin"], [f"{name}_rotated"],
                                          domain="com.microsoft", num_heads=heads))
        names[:2] = ["q_rotated", "k_rotated"]
        names[7:9] = ["", ""]
    outputs = ["out", "present_key", "present_value"]
    if shared:
        inputs += [value("past_key", element, [1, KV_HEADS, CACHE, HEAD_DIM]), value("past_value", element, [1, KV_HEADS, CACHE, HEAD_DIM])]
    if cache == "int8":
        names += ["", "", "", "k_scale", "v_scale"]
        inputs += [value("k_scale", TensorProto.FLOAT, [KV_HEADS * HEAD_DIM]), value("v_scale", TensorProto.FLOAT, [KV_HEADS * HEAD_DIM])]
        attributes.update(INT8_ATTRIBUTES)
    if decode_gemm:
        attributes.update(scale=1.0, qk_output=1)
        outputs.append("qk")
    nodes.append(helper.make_node("GroupQueryAttention", names, outputs, domain="com.microsoft", **attributes))
    types = {"present_key": element if shared else TensorProto.FLOAT, "present_value": element if shared else TensorProto.FLOAT}
    graph = helper.make_graph(nodes, "attention", inputs,
                              [value(name, types.get(name, TensorProto.FLOAT), None) for name in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def time_node(queries: int, context: int, cache: str, shared: bool, decode_gemm: bool, threads: int, runs: int,
              rotary_separate: bool = False) -> tuple[float, str]:
    """The node's median time in seconds over `runs` runs, and the element type of the cache it wrote (its
    present_key output, "tensor(int8)" for the int8 cache): the row records what was timed."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(attention_model(queries, cache, shared, decode_gemm, rotary_separate), options,
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    angles = np.arange(CACHE)[:, None] * (1e4 ** (-np.arange(HEAD_DIM // 2) / (HEAD_DIM // 2)))[None]
    binding = session.io_binding()
    for name, width in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
        binding.bind_cpu_input(name, rng.standard_normal((1, queries, width * HEAD_DIM), dtype=np.float32))
    binding.bind_cpu_input("seqlens_k", np.array([context - 1], np.int32))
    binding.bind_cpu_input("total", np.array(context, np.int32))
    binding.bind_cpu_input("cos", np.cos(angles).astype(np.float32))
    binding.bind_cpu_input("sin", np.sin(angles).astype(np.float32))
    if rotary_separate:  # the new tokens' positions: after the cached ones
        binding.bind_cpu_input("positions", np.arange(context - queries, context, dtype=np.int64)[None])
    buffers = []
    if shared:  # one buffer bound as past and present, as the runtime binds the cache
        dtype = np.int8 if cache == "int8" else np.float32
        for kind in ("key", "value"):
            filled = rng.integers(-100, 100, (1, KV_HEADS, CACHE, HEAD_DIM)).astype(dtype) * dtype(1 if cache == "int8" else 0.01)
            buffers.append(ort.OrtValue.ortvalue_from_numpy(filled))
            binding.bind_ortvalue_input(f"past_{kind}", buffers[-1])
            binding.bind_ortvalue_output(f"present_{kind}", buffers[-1])
    else:
        binding.bind_output("present_key")
        binding.bind_output("present_value")
    if cache == "int8":
        for name in ("k_scale", "v_scale"):
            binding.bind_cpu_input(name, np.full(KV_HEADS * HEAD_DIM, 0.02, np.float32))
    binding.bind_output("out")
    if decode_gemm:
        binding.bind_output("qk")
    for _ in range(3):
        session.run_with_iobinding(binding)
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        session.run_with_iobinding(binding)
        seconds.append(time.perf_counter() - started)
    present_key = next(output for output in session.get_outputs() if output.name == "present_key")
    return float(np.median(seconds)), present_key.type


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--prompts", default="512,2000")
    parser.add_argument("--contexts", default="64,512,2047")
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_cache_attention.json")
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the work, not a traceback after it
    if args.runs < 1:  # --runs 0 wrote NaN medians as the table and the JSON
        parser.error(f"--runs must be >= 1, got {args.runs}")
    try:
        prompts = [int(p) for p in args.prompts.split(",") if p]
        contexts = [int(c) for c in args.contexts.split(",") if c]
    except ValueError:
        parser.error(f"--prompts {args.prompts!r} / --contexts {args.contexts!r}: give comma-separated token counts")
    if any(not 1 <= p <= CACHE for p in prompts) or any(not 1 <= c < CACHE for c in contexts):
        parser.error(f"--prompts must be in 1..{CACHE} and --contexts in 1..{CACHE - 1} (the node's cache holds "
                     f"{CACHE} tokens), got {args.prompts} and {args.contexts}")
    rows = []

    def row(phase: str, tokens: int, queries: int, shared: bool, decode_gemm: bool, runs: int) -> dict:
        """float32 and int8 caches, and the float32 cache with rotary in separate nodes: ms and the cache types."""
        timings = {"float": time_node(queries, tokens, "float32", shared, decode_gemm, args.threads, runs),
                   "int8": time_node(queries, tokens, "int8", True, decode_gemm, args.threads, runs),
                   "rotary_separate": time_node(queries, tokens, "float32", shared, decode_gemm, args.threads, runs,
                                                rotary_separate=True)}
        milliseconds = {f"{name}_ms": 1e3 * seconds for name, (seconds, _) in timings.items()}
        return {"phase": phase, "tokens": tokens, **milliseconds,
                "cache_types": {name: cache_type for name, (_, cache_type) in timings.items()}}

    for prompt in prompts:
        rows.append(row("prefill", prompt, prompt, False, False, max(3, args.runs // 10)))
    for context in contexts:
        rows.append(row("decode", context, 1, True, True, args.runs))
    table = Table(title=f"one GroupQueryAttention node, SmolLM2-135M shapes, {args.threads} threads (medians)")
    for column in ("phase", "prompt / context", "float32 cache ms", "int8 cache ms", "int8 / float32",
                   "rotary separate ms", "separate / inside"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["phase"], str(row["tokens"]), f"{row['float_ms']:.3f}", f"{row['int8_ms']:.3f}",
                      f"{row['int8_ms'] / row['float_ms']:.2f}x", f"{row['rotary_separate_ms']:.3f}",
                      f"{row['rotary_separate_ms'] / row['float_ms']:.2f}x")
    print_table(table, Console())
    result = {"threads": args.threads, "runs": args.runs, "prefill_runs": max(3, args.runs // 10),
              "onnxruntime": ort.__version__, "rows": rows}
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
