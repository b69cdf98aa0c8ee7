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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from passes import flash_attention_op as op
from passes.errors import PassError

MICROSOFT_DOMAIN = "com.microsoft"
KEPT_ATTRIBUTES = ("num_heads", "kv_num_heads", "scale", "do_rotary", "rotary_interleaved")
DECODE_KERNELS = ("gemm", "flash")


@dataclass(frozen=True)
class Options:
    max_rewrites: int | None = None
    decode_kernel: str = "gemm"  # "gemm" | "flash": onnxruntime's CPU path for the decode graph's attention


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    if options.decode_kernel not in DECODE_KERNELS:
        raise PassError(f"decode_kernel: {options.decode_kernel!r} is not one of {', '.join(DECODE_KERNELS)}")
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    graph = lowered.graph
    decode_gemm = graph.name == "decode" and options.decode_kernel == "gemm"
    count, scale_folds = 0, {}
    table_widths = {t.name: t.dims[-1] for t in graph.initializer if len(t.dims) == 2}
    for node in list(graph.node):
        if node.domain != op.DOMAIN or node.op_type != op.OP_TYPE:
            continue
        if options.max_rewrites is not None and count >= options.max_rewrites:
            break
        head_dim = 2 * table_widths.get(node.input[op.INPUTS.index("cos_cache")], 0)
        if head_dim % 16:
            raise PassError(f"{node.name}: onnxruntime's GroupQueryAttention needs head_dim % 16 == 0, "
                            f"this model has head_dim {head_dim}; leave lower_onnxruntime out of the recipe")
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        scale = float(attributes.get("scale") or head_dim ** -0.5)
        query_width = int(attributes["num_heads"]) * head_dim
        node.op_type, node.domain = "GroupQueryAttention", MICROSOFT_DOMAIN
        kept = [a for a in node.attribute if a.name in KEPT_ATTRIBUTES and a.name != "scale"]
        del node.attribute[:]
        node.attribute.extend(kept)
        fold = fold_query_scale(graph, node, scale, query_width)
        scale_folds[fold] = scale_folds.get(fold, 0) + 1
        node.attribute.append(onnx.helper.make_attribute("scale", 1.0 if fold != "none" else scale))
        if decode_gemm and fold != "none":
            node.attribute.append(onnx.helper.make_attribute("qk_output", 1))
            del node.output[len(op.OUTPUTS):]
            node.output.append(f"{node.name}/unused_qk")  # never read: it only selects the GEMM path
        count += 1
    remaining = sum(1 for n in graph.node if n.domain == op.DOMAIN)
    imports = [o for o in lowered.opset_import if o.domain != op.DOMAIN or remaining]
    if count and not any(o.domain == MICROSOFT_DOMAIN for o in imports):
        imports.append(onnx.helper.make_opsetid(MICROSOFT_DOMAIN, 1))
    del lowered.opset_import[:]
    lowered.opset_import.extend(imports)
    kernel = "gemm" if decode_gemm and "none" not in scale_folds else "flash"
    return lowered, {"lowered": count, "target": f"{MICROSOFT_DOMAIN}.GroupQueryAttention", "left_unlowered": remaining,
                     "phase_graph": graph.name, "attention_kernel": kernel, "scale_folded_into": scale_folds}


def fold_query_scale(graph: onnx.GraphProto, node: onnx.NodeProto, scale: float, query_width: int) -> str:
    """Multiply the node's query by `scale` upstream; returns where: "weight", "mul" or "none" (left in the op).

    A packed q/k/v input (key and value empty) can only take it in the weight's first query_width columns."""
    query = node.input[0]
    packed = len(node.input) > 2 and not node.input[1] and not node.input[2]
    producer = next((n for n in graph.node if query in n.output), None)
    # A graph output is a reader too: scaling the weight would change what it returns.
    consumers = sum(name == query for n in graph.node for name in n.input) + sum(o.name == query for o in graph.output)
    initializers = {t.name: t for t in graph.initializer}
    weight = None
    if producer is not None and producer.op_type == "MatMul" and producer.domain == "" and consumers == 1:
        candidate = initializers.get(producer.input[1])
        readers = sum(name == producer.input[1] for n in graph.node for name in n.input) + \
            sum(o.name == producer.input[1] for o in graph.output)
        if candidate is not None and len(candidate.dims) == 2 and readers == 1:
            weight = candidate
    if weight is not None and (weight.dims[1] == query_width or packed):
        values = numpy_helper.to_array(weight).copy()
        values[:, :query_width] *= np.asarray(scale, values.dtype)
        weight.CopyFrom(numpy_helper.from_array(values, weight.name))
        return "weight"
    if packed:
        return "none"
    table = initializers.get(node.input[op.INPUTS.index("cos_cache")])  # the rotary tables are in the graph's type
    dtype = np.float32 if table is None else onnx.helper.tensor_dtype_to_np_dtype(table.data_type)
    factor = numpy_helper.from_array(np.asarray(scale, dtype=dtype), f"{node.name}/query_scale")
    graph.initializer.append(factor)
    scaled = f"{node.name}/scaled_query"
    position = list(graph.node).index(node)
    graph.node.insert(position, onnx.helper.make_node("Mul", [query, factor.name], [scaled], name=f"{node.name}/query_scale"))
    node.input[0] = scaled
    return "mul"
