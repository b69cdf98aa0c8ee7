"""fuse_rotary: each rotary-embedding subgraph -> one standard ONNX RotaryEmbedding node (opset 23).

For graphs whose attention is not fused (a recipe without fuse_attention, or a layer it skipped). Rotate-half
layout, t [B, heads, S, D], as the canonical decoder and Hugging Face's Llama trace it:

    t ──┬──────────────────────────────────────► Mul(., cos) ──┐
        ├─► Slice(split:) ─► Neg ─┐                            ├─► Add ─► rotated
        └─► Slice(:split) ────────┴─► Concat(axis -1) ─► Mul(., sin)
    cos = Cos(positions * inv_freq) [* scaling], sin likewise

    ->  t ─► RotaryEmbedding(t, cos_cache, sin_cache, positions; interleaved=0) ─► rotated

cos_cache/sin_cache [rows, D/2] are built from the inv_freq constant under Cos (`flash_attention_op.rotary_tables`);
rows = option `rotary_cache_length`, else the KV cache's max context (`past_key_values.0.key` dim 2). positions
[B, S] int64: the graph input `position_ids`, else the int64 [B, S] tensor the Cos computation reads (expanded
to t's batch when it has batch 1). Every `Add(Mul, Mul(Concat, .))` is a candidate; one that fails a check stays
as it is and is listed in the report with its reason. The last checks run each match on a probe
(passes/rotary_probe.py): t's layout, the sin operand and positions scaled on the way to Cos show only there; and the
graph's cos and sin over the table's rows, where positions clamped or frequencies switched past the probe show.
The Cos/Sin math goes when no other node reads it.

Pure: the input ModelProto is never mutated. The default opset becomes >= 23 and the IR version >= 10.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes.graph_export import export_onnx
from passes.graph_patterns import (SkipReason, constant, layer_name, parse_inv_freq, parse_rotary_terms, producer,
                                   rotary_table_constants)
from passes.opset import raise_opset, unchanged
from passes.rotary_probe import check_rotaries, check_tables

OPSET = 23


@dataclass(frozen=True)
class Options:
    # table rows; default: the KV cache's max context, the only value a recipe takes (export.max_context)
    rotary_cache_length: int | None = None
    max_rewrites: int | None = None  # fuse only the first N (bisect a parity failure)


@dataclass
class Match:
    add: gs.Node  # its output becomes the RotaryEmbedding's output
    source: gs.Tensor  # t [B, heads, S, D]
    inv_freq: np.ndarray
    scaling: float
    positions: gs.Tensor
    rows: int
    tables: tuple[gs.Tensor, gs.Tensor]  # the graph's cos and sin, checked over every row the fused tables hold


def is_candidate(node: gs.Node) -> bool:
    """Add(Mul, Mul) with a Concat under one of the Muls: the rotary shape, before any check."""
    muls = [producer(t) for t in node.inputs]
    return node.op == "Add" and len(muls) == 2 and all(m is not None and m.op == "Mul" for m in muls) and any(
        producer(t) is not None and producer(t).op == "Concat" for m in muls for t in m.inputs)


def _rotate_half(add: gs.Node, source: gs.Tensor) -> SkipReason | None:
    """Concat(Neg(t[split:]), t[:split]) on the last axis, both slices of t split at the same point."""
    concat = next(producer(t) for m in (producer(t) for t in add.inputs) for t in m.inputs
                  if producer(t) is not None and producer(t).op == "Concat"
                  and producer(producer(t).inputs[0]) is not None and producer(producer(t).inputs[0]).op == "Neg")
    rank = len(source.shape) if source.shape is not None else None
    if len(concat.inputs) != 2 or concat.attrs.get("axis") not in (-1, rank - 1 if rank else -1):
        return SkipReason("rotary: the rotate-half Concat is not of two halves on the last axis")
    negated, kept = producer(producer(concat.inputs[0]).inputs[0]), producer(concat.inputs[1])
    if kept is None or kept.op != "Slice" or kept.inputs[0] is not source:
        return SkipReason("rotary: the Concat's second operand is not a Slice of the rotated tensor")
    starts = constant(kept.inputs[1])
    split_shared = negated.inputs[1] is kept.inputs[2] or (
        constant(negated.inputs[1]) is not None and constant(kept.inputs[2]) is not None
        and np.array_equal(constant(negated.inputs[1]), constant(kept.inputs[2])))
    if starts is None or np.any(starts != 0) or not split_shared:
        return SkipReason("rotary: the two Slices are not t[..., split:] and t[..., :split]")
    return None


def _cos_node(cos: gs.Tensor) -> gs.Node:
    """The Cos above the cos table (parse_inv_freq has checked the way up)."""
    node = producer(cos)
    while node.op != "Cos":
        node = producer(next(t for t in node.inputs if constant(t) is None) if node.op == "Mul" else node.inputs[0])
    return node


def _positions(graph: gs.Graph, cos: gs.Node) -> gs.Tensor | SkipReason:
    given = next((t for t in graph.inputs if t.name == "position_ids"), None)
    if given is not None:
        return given if given.dtype in (None, np.int64) else SkipReason(f"position_ids is {given.dtype}, not int64")
    frontier, seen = [cos.inputs[0]], set()
    while frontier:  # breadth-first: the nearest int64 [B, S] tensor under Cos
        tensor = frontier.pop(0)
        if (constant(tensor) is None and tensor.dtype == np.int64 and tensor.shape is not None and len(tensor.shape) == 2
                and tensor.name != "attention_mask"):  # which tokens are real, not where they are
            return tensor
        upstream = producer(tensor)
        # Shape reads only its input's shape (a dynamo trace sizes the positions from attention_mask's): its input
        # holds no positions.
        if upstream is not None and id(upstream) not in seen and upstream.op != "Shape":
            seen.add(id(upstream))
            frontier.extend(upstream.inputs)
    return SkipReason("rotary: no position_ids input and no int64 [B, S] positions tensor under Cos")


def match(graph: gs.Graph, add: gs.Node, rows: int | None) -> Match | SkipReason:
    parsed = parse_rotary_terms(add.outputs[0])
    if isinstance(parsed, SkipReason):
        return parsed
    source, cos, sin = parsed
    reason = _rotate_half(add, source)
    if reason is not None:
        return reason
    rotary = parse_inv_freq(cos)
    if isinstance(rotary, SkipReason):
        return rotary
    inv_freq, scaling = rotary
    shape = source.shape
    if shape is not None and (len(shape) != 4 or (isinstance(shape[3], int) and shape[3] != 2 * inv_freq.size)):
        return SkipReason(f"rotary: input shape {source.shape} is not [B, heads, S, {2 * inv_freq.size}]")
    positions = _positions(graph, _cos_node(cos))
    if isinstance(positions, SkipReason):
        return positions
    if not isinstance(rows, int):
        return SkipReason("no rotary table length: the graph has no past_key_values.0.key; give rotary_cache_length in "
                          "the pass's options")
    return Match(add, source, inv_freq, scaling, positions, rows, (cos, sin))


class Tables:
    """cos/sin caches [rows, D/2] (one pair per inv_freq/scaling/rows) and batch-expanded positions, built once."""

    def __init__(self, graph: gs.Graph):
        self.graph, self.tables, self.expanded = graph, {}, {}

    def caches(self, found: Match) -> tuple[gs.Tensor, gs.Tensor]:
        """In the rotated tensor's type: float32 tables in a float16 / bfloat16 graph made one onnxruntime refuses."""
        key = (found.inv_freq.tobytes(), found.scaling, found.rows, str(found.source.dtype))
        if key not in self.tables:
            self.tables[key] = rotary_table_constants(self.graph, f"rotary_{len(self.tables)}_", found.inv_freq,
                                                      found.rows, found.scaling, found.source.dtype)
        return self.tables[key]

    def positions(self, found: Match) -> gs.Tensor:
        """RotaryEmbedding wants [B, S]; HF traces positions [1, S]: expand to t's batch."""
        positions = found.positions
        if positions.shape is None or positions.shape[0] != 1 or (found.source.shape or [None])[0] == 1:
            return positions
        if positions.name not in self.expanded:
            name = f"rotary_positions_{len(self.expanded)}"
            shape = self.graph.layer(op="Shape", inputs=[found.source], outputs=[f"{name}_source_shape"])[0]
            batch = self.graph.layer(op="Slice", inputs=[shape, *(gs.Constant(f"{name}_{n}", np.array([v], np.int64))
                                                              for n, v in (("start", 0), ("end", 1)))],
                                     outputs=[f"{name}_batch"])[0]
            width = self.graph.layer(op="Shape", inputs=[positions], outputs=[f"{name}_shape"], attrs={"start": 1})[0]
            target = self.graph.layer(op="Concat", inputs=[batch, width], outputs=[f"{name}_target"], attrs={"axis": 0})[0]
            self.expanded[positions.name] = self.graph.layer(op="Expand", inputs=[positions, target], outputs=[name])[0]
            self.expanded[positions.name].dtype = np.int64
        return self.expanded[positions.name]


def rewrite(graph: gs.Graph, found: Match, tables: Tables) -> None:
    cos, sin = tables.caches(found)
    rotated = found.add.outputs[0]
    found.add.outputs.clear()  # the Mul/Concat/Neg/Slice math becomes dead; cleanup() removes it
    graph.nodes.append(gs.Node("RotaryEmbedding", name=f"{found.add.name}/RotaryEmbedding", attrs={"interleaved": 0},
                               inputs=[found.source, cos, sin, tables.positions(found)], outputs=[rotated]))


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    graph = gs.import_onnx(model)
    nodes_before = len(graph.nodes)
    past_key = next((t for t in graph.inputs if t.name == "past_key_values.0.key"), None)
    rows = options.rotary_cache_length or (past_key.shape[2] if past_key is not None and past_key.shape else None)
    matches, skipped = [], []
    found = [(add, match(graph, add, rows)) for add in graph.nodes if is_candidate(add)]
    structural = [m for _, m in found if not isinstance(m, SkipReason)]
    verdicts = dict(zip(map(id, structural), check_rotaries(graph, structural)))  # what the structure cannot show
    # The probe runs 7 positions; the tables serve `rows`: positions clamped or frequencies switched past the probe
    # show only in the graph's own cos and sin over those rows.
    tabled = [m for m in structural if verdicts[id(m)] is None]
    table_verdicts = check_tables(graph, [(*m.tables, m.inv_freq, m.scaling) for m in tabled], length=rows)
    verdicts.update({id(m): verdict for m, verdict in zip(tabled, table_verdicts)})
    for add, result in found:
        reason = str(result) if isinstance(result, SkipReason) else verdicts[id(result)]
        if reason is None and options.max_rewrites is not None and len(matches) >= options.max_rewrites:
            reason = f"max_rewrites={options.max_rewrites}"
        if reason is not None:
            skipped.append({"node": add.name, "layer": layer_name(add), "reason": reason})
        else:
            matches.append(result)
    report = {"rewrites": len(matches), "skipped": skipped}
    if not matches:  # nothing to rewrite: the graph, opset included, stays as it was
        return unchanged(model), {**report, "nodes": {"before": nodes_before, "after": nodes_before}}
    raise_opset(graph, model, OPSET, "fuse_rotary")
    tables = Tables(graph)
    for found in matches:
        rewrite(graph, found, tables)
    graph.cleanup().toposort()
    fused = export_onnx(graph)
    fused.ir_version = max(fused.ir_version, 10)  # IR 10 with opset 23, as torch.onnx writes it (onnx 1.23 lists 11)
    return fused, {**report, "nodes": {"before": nodes_before, "after": len(fused.graph.node)}}
