"""slice_packed_weights: a packed projection's MatMul + Split -> one MatMul per part, over its columns of the weight.

    x ─► MatMul(W [K, N1+N2]) ─► Split(last axis; N1, N2) ─┬─► gate
                                                           └─► up
                                 =>
    x ─┬─► MatMul(Slice(W, columns 0..N1))       ─► gate
       └─► MatMul(Slice(W, columns N1..N1+N2))   ─► up

Why: pack_projections gives gate/up one MatMul, which decode wants (a step over a few rows runs one product instead
of two). Prefill multiplies hundreds or thousands of rows, and the Split then copies the packed product's
[tokens, 2 x intermediate] output apart: in SmolLM2-135M's prefill of 16 prompts of 128 tokens the Splits took 3.4%
of the profiled time, and the graph rewritten this way ran 0.905x the packed one's time (paired, 24 runs; one
512-token prompt 0.98x, within noise; scratch, session 24). Recipes run it with `phases: [prefill]`. The quantized
recipes do not: after dequantize_weights the float weight it slices is folded at load and then freed, and freed
memory stays in glibc's heap. The INT4 build's engine held 1195 MB against 733 for a 0.92-0.93x batched prefill
(session 25); trimming the heap gave the memory back but left the holed heap off huge pages (README).

The weight stays the one initializer the decode graph reads, so the artifact does not grow: each Slice reads only
constants, and onnxruntime's constant folding cuts the column blocks once, when the session loads (the fp32 prefill
session of SmolLM2-135M then held 747 MB against 680 MB). A weight computed from constants, such as
dequantize_weights' DequantizeLinear chain, is sliced after that chain and folds the same way.

Rewritten: a Split on the last axis with constant sizes (an input, or the `split` attribute before opset 13) whose
input is read by nothing else and comes from a MatMul whose weight B is 2-D and constant, or computed from constants
only. Everything else is kept, with the reason in the report. Pure: the input model is never mutated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes.cleanup import apply_shapes, export_like, inferred_value_info
from passes.errors import PassError

PHASES = ("prefill", "decode")
STANDARD_DOMAINS = {"", "ai.onnx"}


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
            kept.append({"node": split.name, "reason": "max_rewrites_reached"})
            continue
        matmul, sizes = found
        _rewrite(graph, split, matmul, sizes)
        rewritten.append({"node": matmul.name, "widths": sizes})
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
    """(the MatMul, the part widths), or why the Split is kept."""
    packed = split.inputs[0]
    producer = packed.inputs[0] if packed.inputs else None
    if producer is None or producer.op != "MatMul" or (producer.domain or "") not in STANDARD_DOMAINS:
        return "its input does not come from a MatMul"
    if len(packed.outputs) != 1 or packed.name in graph_outputs:
        return "the MatMul's output is read by more than the Split"
    weight = producer.inputs[1]
    if weight.shape is None or len(weight.shape) != 2 or not all(isinstance(d, int) for d in weight.shape):
        return f"the MatMul's weight has shape {weight.shape}, not a known 2-D [K, N]"
    if not _from_constants(weight):
        return "the MatMul's weight is computed from a graph input: a Slice of it would run at every step"
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
    if not widths or len(widths) != len(split.outputs) or sum(widths) != weight.shape[1]:
        return f"sizes {widths} do not cut the weight's {weight.shape[1]} columns into its {len(split.outputs)} outputs"
    return producer, widths


def _weight_shape_unknown(split: gs.Node) -> bool:
    producer = split.inputs[0].inputs[0] if split.inputs and split.inputs[0].inputs else None
    return producer is not None and producer.op == "MatMul" and producer.inputs[1].shape is None


def _from_constants(tensor: gs.Tensor) -> bool:
    """True when `tensor` is a constant, or every input of the subgraph that computes it is one."""
    if isinstance(tensor, gs.Constant):
        return True
    if not tensor.inputs:  # a graph input
        return False
    return all(_from_constants(t) for t in tensor.inputs[0].inputs if t.name)


def _rewrite(graph: gs.Graph, split: gs.Node, matmul: gs.Node, widths: list[int]) -> None:
    activation, weight = matmul.inputs[:2]
    prefix = matmul.name or matmul.outputs[0].name
    start = 0
    for index, (part, width) in enumerate(zip(list(split.outputs), widths)):
        columns = gs.Variable(f"{prefix}_columns{index}", dtype=weight.dtype, shape=[weight.shape[0], width])
        bounds = [gs.Constant(f"{prefix}_columns{index}_{what}", np.array([value], np.int64))
                  for what, value in (("start", start), ("end", start + width), ("axis", 1))]
        graph.nodes.append(gs.Node("Slice", f"{prefix}_slice{index}", inputs=[weight, *bounds], outputs=[columns]))
        graph.nodes.append(gs.Node("MatMul", f"{prefix}_part{index}", inputs=[activation, columns], outputs=[part]))
        start += width
    split.outputs.clear()  # the parts now come from the new MatMuls; cleanup drops the Split and the packed MatMul
