"""Lower `aotlm.FlashAttention` to onnxruntime's `com.microsoft.GroupQueryAttention`.

The two share their contract (passes/flash_attention_op.py): same inputs in the same order, per-sequence
`seqlens_k` and `total_sequence_length`, rotary applied inside from cos/sin tables, and past/present cache
buffers that onnxruntime updates in place when the runtime binds one buffer to both (its
past_present_share_buffer mode). So the rewrite is the op's name, domain and attributes, plus two choices
of onnxruntime's CPU kernel path:

- The softmax scale is folded into the query (exactly, for head_dim 64: 1/8), and the op gets scale=1.0.
  Rotary is linear, so scaling q before it is the same as scaling q·k after. The fold goes into the q
  projection's weight when the query comes straight from a MatMul by a weight nothing else reads (the same
  weight in every phase's graph, so the phases still share it), or else into a Mul before the op.
- decode_kernel "gemm" (default): in the graph named "decode", the node also asks for its q·k scores (the
  optional output_qk, qk_output=1, unused). onnxruntime 1.32 then takes its GEMM path instead of its CPU flash
  kernel, whose single-query loops are not vectorised; with scale 1.0 the q·kᵀ product of one query is MLAS's
  vectorised M=1 kernel (it needs alpha == 1). Measured on the 2-core CPU, one layer at 2047 cached tokens:
  368 µs flash, 167 µs GEMM path (README). The prefill graph keeps the flash kernel, faster there.
  "flash": onnxruntime's default path in both graphs.
- rotary "inside" (default): the op rotates q and k itself (do_rotary=1) from the cos/sin tables.
  "separate": two com.microsoft.RotaryEmbedding nodes rotate q and k before it (do_rotary=0), at the positions
  the op's meaning gives (0..S-1 for a first prompt, else after the cached tokens), computed once per graph from
  seqlens_k and total_sequence_length. Inside was as fast or faster in
  `benchmarks/kv_cache_attention.py` (README), so it stays the default; separate is there to measure.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes import flash_attention_op as op
from passes.cleanup import export_like
from passes.errors import PassError

MICROSOFT_DOMAIN = "com.microsoft"
KEPT_ATTRIBUTES = ("num_heads", "kv_num_heads", "do_rotary", "rotary_interleaved")
DECODE_KERNELS = ("gemm", "flash")
ROTARY_PLACES = ("inside", "separate")


@dataclass(frozen=True)
class Options:
    max_rewrites: int | None = None
    decode_kernel: Literal["gemm", "flash"] = "gemm"  # onnxruntime's CPU path for the decode graph's attention
    rotary: Literal["inside", "separate"] = "inside"  # rotate q and k in the attention op, or in RotaryEmbedding nodes


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    if options.decode_kernel not in DECODE_KERNELS:
        raise PassError(f"decode_kernel: {options.decode_kernel!r} is not one of {', '.join(DECODE_KERNELS)}")
    if options.rotary not in ROTARY_PLACES:
        raise PassError(f"rotary: {options.rotary!r} is not one of {', '.join(ROTARY_PLACES)}")
    graph = gs.import_onnx(model)
    # graphsurgeon keeps the model's own opset_import list and appends to it on export: copy it (pure pass).
    graph.import_domains = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]
    decode_gemm = graph.name == "decode" and options.decode_kernel == "gemm"
    nodes = [n for n in graph.nodes if n.domain == op.DOMAIN and n.op == op.OP_TYPE]
    chosen = nodes if options.max_rewrites is None else nodes[: options.max_rewrites]
    scale_folds = {}
    graph_outputs = {t.name for t in graph.outputs}
    graph_inputs = {value.name for value in model.graph.input}  # gs leaves out initializers listed as inputs
    positions: dict[tuple[str, str], gs.Variable] = {}
    for node in chosen:
        head_dim = _head_dim(node)
        scale = op.node_scale(node, head_dim)
        fold = fold_query_scale(graph, node, scale, int(node.attrs["num_heads"]) * head_dim, graph_outputs,
                                graph_inputs)
        if fold == "none" and not scale > 0:  # GroupQueryAttention reads scale 0 as "the default"
            raise PassError(f"{node.name or 'a FlashAttention node'}: scale {scale} cannot be folded into its query "
                            f"(the query has no MatMul of its own), and GroupQueryAttention takes a scale > 0")
        scale_folds[fold] = scale_folds.get(fold, 0) + 1
        node.op, node.domain = "GroupQueryAttention", MICROSOFT_DOMAIN
        node.attrs = {name: node.attrs[name] for name in KEPT_ATTRIBUTES if name in node.attrs}
        node.attrs["scale"] = 1.0 if fold != "none" else scale
        if options.rotary == "separate":
            rotate_before(graph, node, positions)
        if decode_gemm and fold != "none":
            node.attrs["qk_output"] = 1
            while len(node.outputs) > len(op.OUTPUTS):
                node.outputs.pop()
            node.outputs.append(gs.Variable(f"{node.name}/unused_qk"))  # never read: it only selects the GEMM path
    remaining = len(nodes) - len(chosen)
    if not remaining:
        graph.import_domains = [o for o in graph.import_domains if o.domain != op.DOMAIN]
    if chosen and not any(o.domain == MICROSOFT_DOMAIN for o in graph.import_domains):
        graph.import_domains.append(onnx.helper.make_opsetid(MICROSOFT_DOMAIN, 1))
    graph.cleanup().toposort()
    kernel = "gemm" if decode_gemm and "none" not in scale_folds else "flash"
    return export_like(graph, model), {"lowered": len(chosen), "target": f"{MICROSOFT_DOMAIN}.GroupQueryAttention",
                                   "left_unlowered": remaining, "phase_graph": graph.name, "attention_kernel": kernel,
                                   "scale_folded_into": scale_folds, "rotary": options.rotary}


# onnxruntime's CPU GroupQueryAttention takes head sizes in multiples of 16 (passes/flash_attention_op.py).
HEAD_DIM_MULTIPLE = 16
HEAD_DIM_ADVICE = (f"onnxruntime's GroupQueryAttention (lower_onnxruntime) needs a head_dim that is a multiple of "
                   f"{HEAD_DIM_MULTIPLE}, and this model's is {{head_dim}}: lower the fused attention with "
                   f"lower_onnx_attention instead (the opset-23 Attention, which onnxruntime runs too), or leave "
                   f"fuse_attention and lower_onnxruntime out of the recipe")


def _head_dim(node: gs.Node) -> int:
    cos = node.inputs[op.INPUTS.index("cos_cache")]  # [positions, head_dim / 2], maybe through a Cast (float16)
    width = cos.shape[-1] if cos.shape else None
    if not isinstance(width, int):
        raise PassError(f"{node.name}: the rotary table's width (head_dim / 2) is not known; run shape inference "
                        f"(the cleanup pass) before lower_onnxruntime")
    head_dim = 2 * width
    if head_dim % HEAD_DIM_MULTIPLE:
        raise PassError(f"{node.name}: {HEAD_DIM_ADVICE.format(head_dim=head_dim)}")
    return head_dim


def fold_query_scale(graph: gs.Graph, node: gs.Node, scale: float, query_width: int, graph_outputs: set[str],
                     graph_inputs: set[str] = frozenset()) -> str:
    """Multiply the node's query by `scale` upstream; returns where: "weight", "mul" or "none" (left in the op).

    A packed q/k/v input (key and value empty) can only take it in the weight's first query_width columns."""
    query = node.inputs[0]
    packed = len(node.inputs) > 2 and node.inputs[1].is_empty() and node.inputs[2].is_empty()
    producer = query.inputs[0] if query.inputs else None
    # A graph output is a reader too: scaling the weight would change what it returns.
    sole_reader = len(query.outputs) == 1 and query.name not in graph_outputs

    def own(constant) -> bool:  # read by this product alone; a graph input (an overridable default) stays as fed
        return (isinstance(constant, gs.Constant) and len(constant.outputs) == 1
                and constant.name not in graph_outputs and constant.name not in graph_inputs)

    # q = x @ W, or x @ W + b (Qwen2's biased projections: a Mul there kept the query out of the packed q/k/v and
    # left skip_unused_rows without the query's shape)
    bias = None
    if sole_reader and producer is not None and producer.op == "Add" and len(producer.inputs) == 2:
        product, bias = sorted(producer.inputs, key=lambda tensor: isinstance(tensor, gs.Constant))
        sole_product = len(product.outputs) == 1 and product.name not in graph_outputs
        if own(bias) and len(bias.shape) == 1 and sole_product and product.inputs:
            producer = product.inputs[0]
        else:
            producer, bias = None, None
    weight = producer.inputs[1] if producer is not None and producer.op == "MatMul" and producer.domain in ("", None) \
        else None
    if (sole_reader and own(weight) and len(weight.shape) == 2 and (weight.shape[1] == query_width or packed)
            and (bias is None or bias.shape[0] == weight.shape[1])):
        for constant in (weight, *([bias] if bias is not None else [])):
            values = np.array(constant.values)  # a copy: the input model's weight is left as it was
            values[..., :query_width] *= np.asarray(scale, values.dtype)
            constant.values = values
        return "weight"
    if packed:
        return "none"
    table = node.inputs[op.INPUTS.index("cos_cache")]  # the rotary tables are in the graph's type
    dtype = np.dtype(table.dtype) if table.dtype is not None and not isinstance(table.dtype, int) else np.float32
    factor = gs.Constant(f"{node.name}/query_scale", np.asarray(scale, dtype=dtype))
    scaled = graph.layer(op="Mul", name=f"{node.name}/query_scale", inputs=[query, factor],
                         outputs=[gs.Variable(f"{node.name}/scaled_query", dtype=query.dtype, shape=query.shape)])[0]
    node.inputs[0] = scaled
    return "mul"


def rotate_before(graph: gs.Graph, node: gs.Node, positions: dict) -> None:
    """q and k through com.microsoft.RotaryEmbedding before the node, which then gets do_rotary=0 and no tables.

    The positions, [B, S] int64, are shared by every node that reads the same seqlens_k and total_sequence_length
    (the layers of one graph see the same tokens)."""
    heads, kv_heads = int(node.attrs["num_heads"]), int(node.attrs["kv_num_heads"])
    if node.inputs[1].is_empty():
        raise PassError(f"{node.name}: q, k and v come packed in one input; rotary 'separate' rotates q and k "
                        f"apart, so run lower_onnxruntime before pack_projections or keep rotary 'inside'")
    seqlens, total = node.inputs[op.INPUTS.index("seqlens_k")], node.inputs[op.INPUTS.index("total_sequence_length")]
    key = (seqlens.name, total.name)
    if key not in positions:
        positions[key] = _positions(graph, node.inputs[0], seqlens, total, f"{node.name}/rotary_positions")
    cos, sin = node.inputs[op.INPUTS.index("cos_cache")], node.inputs[op.INPUTS.index("sin_cache")]
    interleaved = int(node.attrs.get("rotary_interleaved", 0))
    for index, count, part in ((0, heads, "query"), (1, kv_heads, "key")):
        rotated = gs.Variable(f"{node.name}/rotated_{part}", dtype=node.inputs[index].dtype,
                              shape=node.inputs[index].shape)  # skip_unused_rows reads the rows through it
        graph.layer(op="RotaryEmbedding", name=f"{node.name}/rotary_{part}", domain=MICROSOFT_DOMAIN,
                    inputs=[node.inputs[index], positions[key], cos, sin], outputs=[rotated],
                    attrs={"num_heads": count, "interleaved": interleaved})
        node.inputs[index] = rotated
    while len(node.inputs) > op.INPUTS.index("cos_cache"):  # graphsurgeon's input list has no slice deletion
        node.inputs.pop()
    node.attrs["do_rotary"] = 0


def _positions(graph: gs.Graph, query: gs.Tensor, seqlens: gs.Tensor, total: gs.Tensor, name: str) -> gs.Variable:
    """position_ids [B, S] of the op's meaning: i for a first prompt (S == total), else seqlens_k + 1 - S + i."""
    count = itertools.count()

    def step(op_type, inputs, attrs=None, dtype=np.int64):
        index = next(count)
        output = gs.Variable(f"{name}/{op_type}_{index}", dtype=dtype)
        return graph.layer(op=op_type, name=f"{name}/{op_type}_{index}", inputs=inputs, attrs=attrs or {},
                           outputs=[output])[0]
    shape = step("Shape", [query], {"start": 1, "end": 2})  # [S]
    length = step("Squeeze", [shape, gs.Constant(f"{name}/axis0", np.array([0], np.int64))])  # S, a scalar
    zero, one = gs.Constant(f"{name}/zero", np.array(0, np.int64)), gs.Constant(f"{name}/one", np.array(1, np.int64))
    first_prompt = step("Equal", [length, step("Cast", [total], {"to": onnx.TensorProto.INT64})], dtype=np.bool_)
    after_cache = step("Sub", [step("Add", [step("Cast", [seqlens], {"to": onnx.TensorProto.INT64}), one]), length])
    start = step("Where", [first_prompt, zero, after_cache])  # [B]
    offsets = step("Range", [zero, length, one])  # [S]
    return step("Add", [step("Unsqueeze", [start, gs.Constant(f"{name}/axis1", np.array([1], np.int64))]), offsets])
