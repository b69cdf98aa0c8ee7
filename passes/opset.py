"""Raising a graph's default-domain opset for a pass that emits newer operators (RotaryEmbedding-23, Attention-23).

The rest of the graph keeps its nodes as they are: that is exact from opset 18 on for every operator but three,
since the operators whose inputs changed (ReduceMean and the other reductions took `axes` as an attribute before 18)
read the same from 18 to 23. The three (MEANING_CHANGED, found by comparing every default-domain schema at 18 with
the one in force at 23) mean something else once relabelled: GroupNormalization-21 takes scale and bias per channel,
not per group; DFT-20 takes `axis` as an input; GridSample-20 calls `bilinear` `linear`. A graph holding one of them
at its old version, or an older graph, is refused rather than silently changed. (None is in a Llama decoder.)
"""
from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

from passes.errors import PassError

EXACT_FROM = 18  # the oldest opset whose nodes mean the same at 23, but MEANING_CHANGED's
MEANING_CHANGED = {"GroupNormalization": 21, "DFT": 20, "GridSample": 20}  # operator -> the opset that changed it


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def raise_opset(graph: gs.Graph, model: onnx.ModelProto, opset: int, pass_name: str) -> None:
    """Set `graph` (imported from `model`) to at least `opset` in the default domain; other domains keep theirs."""
    current = default_opset(model)
    if current < EXACT_FROM:
        raise PassError(f"{pass_name} emits opset-{opset} operators, and this graph is at opset {current}; export it at "
                        f"opset {EXACT_FROM} or later (export.opset), or convert it with onnx.version_converter first")
    changed = sorted({node.op for node in graph.nodes if (node.domain or "") in ("", "ai.onnx")
                      and current < MEANING_CHANGED.get(node.op, 0) <= opset})
    if changed:
        raise PassError(f"{pass_name} emits opset-{opset} operators, and this graph's {', '.join(changed)} at opset "
                        f"{current} means something else at {opset}; convert the graph with onnx.version_converter "
                        f"to opset {opset} first")
    graph.import_domains = [onnx.helper.make_opsetid(o.domain, max(o.version, opset) if o.domain in ("", "ai.onnx")
                                                     else o.version) for o in model.opset_import]
    graph.opset = max(graph.opset, opset)


def unchanged(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model`, for a pass that changed nothing. Passes never mutate their input; skip_unused_rows,
    slice_packed_weights and dequantize_weights return it itself when they change nothing (a copy would hold the
    weights twice), so a caller that edits a pass's result copies it first."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy
