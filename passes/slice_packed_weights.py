"""slice_packed_weights: a packed projection's MatMul (or MatMulNBits) + Split -> one product per part, over its
columns of the weight (of the quantized codes).

    x ─► MatMul(W [K, N1+N2]) ─► Split(last axis; N1, N2) ─┬─► gate
                                                           └─► up
                                 =>
    x ─┬─► MatMul(Slice(W, columns 0..N1))       ─► gate
       └─► MatMul(Slice(W, columns N1..N1+N2))   ─► up

Why: pack_projections gives gate/up one MatMul, which decode wants (a step over a few rows runs one product instead
of two). Prefill multiplies hundreds or thousands of rows, and the Split then copies the packed product's
[tokens, 2 x intermediate] output apart: in SmolLM2-135M's prefill of 16 prompts of 128 tokens the Splits took 3.4%
of the profiled time, and the graph rewritten this way ran 0.905x the packed one's time (paired, 24 runs; one
512-token prompt 0.98x, within noise; scratch, session 24). Recipes run it with `phases: [prefill]`.

The weight stays the one initializer the decode graph reads, so the artifact does not grow: each Slice reads only
constants, and onnxruntime's constant folding cuts the column blocks once, when the session loads (the fp32 prefill
session of SmolLM2-135M then held 747 MB against 680 MB).

Quantized products: a MatMulNBits + Split becomes one MatMulNBits per part over row slices of its B, scales, zero
points and bias (each laid out by output column first), so what is cut is the codes. The quantized recipes list the
pass before dequantize_weights (the pipeline refuses it after), which then unpacks each part's codes to its own
float weight. SmolLM2-135M, paired A/B of the prefill graphs (16 x 128 tokens, 16 interleaved runs each way):
INT4 0.929x and 0.941x, INT8 (round to nearest) 0.915x and 0.929x, logits identical; one 512-token prompt 0.983x
(INT4, noise); the loaded engine held the same (INT4 752 against 755 MB, 672 against 674 MB of it on huge pages;
INT8 895-897 against 891-892 MB), its peak while loading 38 MB more (INT4). Cut after dequantize_weights instead,
the Slices would read the packed float weight folded at load, which is then freed and stays in glibc's heap: that
INT4 engine held 1195 MB against 733 (session 25).

Rewritten: a Split on the last axis with constant sizes (an input, or the `split` attribute before opset 13) whose
input is read by nothing else and comes from a MatMul whose weight B is 2-D and constant, or computed from constants
only, or from a MatMulNBits (no g_idx) whose per-column inputs are. Everything else is kept, with the reason in the
report. Pure: the input model is never mutated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes.cleanup import apply_shapes, export_like, inferred_value_info
from passes.errors import PassError
from passes.graph_patterns import computed_from_constants, is_present

PHASES = ("prefill", "decode")
STANDARD_DOMAINS = {"", "ai.onnx"}
MICROSOFT_DOMAIN = "com.microsoft"
# MatMulNBits(A, B [N, blocks, bytes], scales [N * blocks] or [N, blocks], zero_points [N * bytes] or [N, bytes]
# (uint8, packed) or [N * blocks] (scales' type), g_idx [K], bias [N]): the inputs laid out by output column first,
# by position
NBITS_INPUTS = {1: "B", 2: "scales", 3: "zero_points", 5: "bias"}
PER_COLUMN_POSITIONS = tuple(NBITS_INPUTS)


@dataclass(frozen=True)
class Options:
    phases: tuple[Literal["prefill", "decode"], ...] = ("prefill",)  # the graphs it rewrites (the pipeline reads it)
    max_rewrites: int | None = None  # stop after this many (bisecting a parity failure)


def check_options(options: Options) -> None:
    if not options.phases or len(set(options.phases)) != len(options.phases) or set(options.phases) - set(PHASES):
        raise PassError(f"phases: {list(options.phases)} must name each of {', '.join(PHASES)} at most once, and one "
                        f"at least (the pass is meant for prefill: phases: [prefill])")


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    check_options(options)
    graph = gs.import_onnx(model)
    if any(_weight_shape_unknown(split) for split in graph.nodes if split.op == "Split"):
        # a computed weight (dequantize_weights' chain) carries no shape unless inferred; the sizes must be checked.
        # cleanup's inference runs on the graph without its large weights (no copies of them, no 2 GB limit)
        apply_shapes(graph, inferred_value_info(model, {}))
    graph.import_domains = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]
    nodes_before = len(graph.nodes)
    graph_outputs = {tensor.name for tensor in graph.outputs}
    rewritten, kept = [], []
    for split in [n for n in graph.nodes if n.op == "Split" and (n.domain or "") in STANDARD_DOMAINS]:
        found = _match(split, graph_outputs)
        if isinstance(found, str):
            kept.append({"node": split.name, "reason": found})
            continue
        if options.max_rewrites is not None and len(rewritten) >= options.max_rewrites:
            kept.append({"node": split.name, "reason": f"max_rewrites={options.max_rewrites}"})
            continue
        product, sizes = found
        _rewrite(graph, split, product, sizes)
        rewritten.append({"node": product.name, "widths": sizes})
    report = {"applied": bool(rewritten), "rewritten": rewritten, "kept": kept,
              "reason": None if rewritten else "no packed MatMul + Split to slice"}
    if not rewritten:
        report["nodes"] = {"before": nodes_before, "after": nodes_before}
        return model, report
    graph.cleanup().toposort()  # drops the packed MatMuls and the Splits
    result = export_like(graph, model)
    report["nodes"] = {"before": nodes_before, "after": len(result.graph.node)}
    return result, report


def _match(split: gs.Node, graph_outputs: set[str]) -> tuple[gs.Node, list[int]] | str:
    """(the product, the part widths), or why the Split is kept."""
    packed = split.inputs[0]
    producer = packed.inputs[0] if packed.inputs else None
    if producer is not None and producer.op == "MatMulNBits" and producer.domain == MICROSOFT_DOMAIN:
        columns = _quantized_columns(producer)
    elif producer is not None and producer.op == "MatMul" and (producer.domain or "") in STANDARD_DOMAINS:
        columns = _float_columns(producer)
    else:
        return "its input does not come from a MatMul or MatMulNBits"
    if isinstance(columns, str):
        return columns
    if len(packed.outputs) != 1 or packed.name in graph_outputs:
        return "the MatMul's output is read by more than the Split"
    axis = int(split.attrs.get("axis", 0))
    if axis != -1:
        if packed.shape is None:
            return f"splits axis {axis} of an output whose rank is unknown (the last axis would be -1)"
        if axis != len(packed.shape) - 1:
            return f"splits axis {axis}, not the last one (the weight's columns)"
    sizes = split.inputs[1] if len(split.inputs) > 1 else None
    if sizes is not None and not isinstance(sizes, gs.Constant):
        return "its sizes are computed, not constant"
    widths = [int(w) for w in (sizes.values if sizes is not None else split.attrs.get("split", []))]
    if not widths or len(widths) != len(split.outputs) or sum(widths) != columns:
        return f"sizes {widths} do not cut the weight's {columns} columns into its {len(split.outputs)} outputs"
    return producer, widths


def _float_columns(matmul: gs.Node) -> int | str:
    weight = matmul.inputs[1]
    if weight.shape is None or len(weight.shape) != 2 or not all(isinstance(d, int) for d in weight.shape):
        return f"the MatMul's weight has shape {weight.shape}, not a known 2-D [K, N]"
    if not computed_from_constants(weight):
        return "the MatMul's weight is computed from a graph input: a Slice of it would run at every step"
    return weight.shape[1]


def _quantized_columns(node: gs.Node) -> int | str:
    """N, when every per-column input (B, scales, zero points, bias) is computed from constants only and holds the
    rows MatMulNBits' layout gives N columns."""
    if len(node.inputs) > 4 and is_present(node.inputs[4]):
        return "the MatMulNBits has a g_idx input (groups out of order), which aotlm's quantize does not emit"
    columns = int(node.attrs["N"])
    for position, tensor in _per_column_inputs(node):
        name = NBITS_INPUTS[position]
        if not computed_from_constants(tensor):
            return f"the MatMulNBits' {name} is computed from a graph input: a Slice of it would run at every step"
        rows = _rows_per_column(node, position, tensor)
        if tensor.shape is None or not tensor.shape or tensor.shape[0] != columns * rows:
            return (f"the MatMulNBits' {name} has shape {tensor.shape}, not {columns * rows} rows first "
                    f"({rows} per column for N = {columns})")
    return columns


def _rows_per_column(node: gs.Node, position: int, tensor: gs.Tensor) -> int:
    """Rows of a per-column input that belong to one output column: 1 where the input is [N, ...]; a flat scales or
    float zero points input holds each column's blocks in a row, a flat uint8 zero points input its padded bytes."""
    if position in (1, 5) or tensor.shape is None or len(tensor.shape) != 1:
        return 1
    blocks = -(-int(node.attrs["K"]) // int(node.attrs["block_size"]))
    if position == 3 and tensor.dtype == np.uint8:  # packed, each column padded to whole bytes
        return -(-blocks * int(node.attrs["bits"]) // 8)
    return blocks


def _weight_shape_unknown(split: gs.Node) -> bool:
    producer = split.inputs[0].inputs[0] if split.inputs and split.inputs[0].inputs else None
    if producer is None:
        return False
    if producer.op == "MatMulNBits":
        return any(tensor.shape is None for _, tensor in _per_column_inputs(producer))
    return producer.op == "MatMul" and producer.inputs[1].shape is None


def _rewrite(graph: gs.Graph, split: gs.Node, product: gs.Node, widths: list[int]) -> None:
    prefix = product.name or product.outputs[0].name
    start = 0
    for index, (part, width) in enumerate(zip(list(split.outputs), widths)):
        name = f"{prefix}_part{index}"
        if product.op == "MatMul":
            activation, weight = product.inputs[:2]
            columns = _sliced(graph, weight, 1, start, width, f"{prefix}_columns{index}")
            graph.nodes.append(gs.Node("MatMul", name, inputs=[activation, columns], outputs=[part]))
        else:  # each per-column input's rows for these columns; the activation and omitted inputs as they are
            inputs = list(product.inputs)
            for position, tensor in _per_column_inputs(product):
                rows = _rows_per_column(product, position, tensor)
                inputs[position] = _sliced(graph, tensor, 0, start * rows, width * rows,
                                           f"{name}_{NBITS_INPUTS[position]}")
            graph.nodes.append(gs.Node("MatMulNBits", name, domain=product.domain, attrs={**product.attrs, "N": width},
                                       inputs=inputs, outputs=[part]))
        start += width
    split.outputs.clear()  # the parts now come from the new products; cleanup drops the Split and the packed one


def _sliced(graph: gs.Graph, tensor: gs.Tensor, axis: int, start: int, width: int, name: str) -> gs.Variable:
    """Slice(tensor, start..start + width on axis): constant inputs only, so folded when the session loads."""
    shape = list(tensor.shape)
    shape[axis] = width
    sliced = gs.Variable(name, dtype=tensor.dtype, shape=shape)
    bounds = [gs.Constant(f"{name}_{what}", np.array([value], np.int64))
              for what, value in (("start", start), ("end", start + width), ("axis", axis))]
    graph.nodes.append(gs.Node("Slice", f"{name}_slice", inputs=[tensor, *bounds], outputs=[sliced]))
    return sliced


def _per_column_inputs(node: gs.Node) -> list[tuple[int, gs.Tensor]]:
    """MatMulNBits' inputs laid out by output column first: (position, tensor) for B, scales, zero points, bias."""
    return [(position, node.inputs[position]) for position in PER_COLUMN_POSITIONS
            if position < len(node.inputs) and is_present(node.inputs[position])]
