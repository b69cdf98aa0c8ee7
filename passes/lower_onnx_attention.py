"""Lower `aotlm.FlashAttention` to standard ONNX (opset 23): RotaryEmbedding, ScatterElements, Attention.

The portable target: any runtime with opset 23 (and TensorRT >= 10.14's parser) runs it. Per node:

    query -> RotaryEmbedding(positions) -> [B,S,H,D] -> [B,H,S,D] ----------------------------.
    key   -> RotaryEmbedding(positions) -> [B,KV,S,D] -> ScatterElements(past_key, positions) -> Slice(:total) -> Attention
    value ---------------------------------> [B,KV,S,D] -> ScatterElements(past_value, ...)   -> Slice(:total) -'   |
                                                           (present_key / present_value: in place)    mask [B,1,S,T]
    Attention -> [B,S,H,D] -> output [B,S,H*D]

Positions and the visibility mask follow the op's meaning (passes/flash_attention_op.py) and are built once
per graph (per seqlens_k and total_sequence_length pair; every layer's queries cover the same tokens): first prompt
(S == total) -> positions 0..S-1, else seqlens_k + 1 - S + i; key j is visible to a query at position p iff
j <= p and j <= seqlens_k. The mask is explicit, not is_causal: each sequence has its own length, which is_causal
cannot say, and the cache rows reach Attention as its K and V (no past_key), so the spec's bottom-right offset
(onnx 1.23's text; the first text of Attention-23 aligned causal masks to the top-left) would be 0. ScatterElements writes
every new row, a first prompt's padding tokens too (the op leaves those rows unspecified), and masked cache rows are
multiplied by weight 0, so they must be finite (the runtime's caches start zeroed).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes import flash_attention_op as op
from passes.errors import PassError
from passes.graph_export import export_onnx
from passes.opset import raise_opset, unchanged

OPSET = 23


@dataclass(frozen=True)
class Options:
    max_rewrites: int | None = None


def _const(name: str, values) -> gs.Constant:
    return gs.Constant(name, np.asarray(values, dtype=np.int64))


class Shared:
    """Positions [B,S] and mask [B,1,S,T] from (query, seqlens_k, total_sequence_length), built once per graph:
    queries whose sequence dimension is the same (a number, or a symbol: ONNX names one unknown size once) share
    the first one's, and only a query of unknown shape gets its own. (Built per query, it made 30 masks a step on
    SmolLM2, which onnxruntime's optimizer did not merge.)"""

    def __init__(self, graph: gs.Graph, prefix: str = "onnx_attention"):
        self.graph, self.prefix = graph, prefix  # prefix: the names of the nodes built here (lower_tensorrt shares them)
        self.built: dict[tuple, tuple[gs.Variable, gs.Variable, gs.Variable]] = {}

    def layer(self, op_type: str, inputs: list, name: str, **attrs) -> gs.Variable:
        return self.graph.layer(op=op_type, inputs=inputs, outputs=[name], attrs=attrs)[0]

    def positions_and_mask(self, query: gs.Tensor, seqlens: gs.Tensor, total: gs.Tensor):
        length = query.shape[1] if query.shape is not None and len(query.shape) == 3 else None
        known = isinstance(length, int) or (isinstance(length, str) and length != "")
        key = (seqlens.name, total.name, ("dim", length) if known else ("query", query.name))
        if key not in self.built:
            L = self.layer  # noqa: N806 - a short local name keeps the recipe of nodes readable
            p = f"{self.prefix}_{len(self.built)}"
            length = L("Gather", [L("Shape", [query], f"{p}_query_shape"), _const(f"{p}_one", 1)], f"{p}_length")
            total64 = L("Cast", [total], f"{p}_total", to=onnx.TensorProto.INT64)
            last = L("Cast", [seqlens], f"{p}_last", to=onnx.TensorProto.INT64)  # [B]: index of the last valid key
            first_prompt = L("Equal", [length, total64], f"{p}_first_prompt")
            cached = L("Sub", [L("Add", [last, _const(f"{p}_one_b", 1)], f"{p}_valid"), length], f"{p}_cached")
            start = L("Where", [first_prompt, _const(f"{p}_zero", 0), cached], f"{p}_start")  # [B]
            steps = L("Range", [_const(f"{p}_r0", 0), length, _const(f"{p}_r1", 1)], f"{p}_steps")  # [S]
            positions = L("Add", [L("Unsqueeze", [start, _const(f"{p}_ax1", [1])], f"{p}_start_col"), steps],
                          f"{p}_positions")  # [B, S]
            keys = L("Range", [_const(f"{p}_k0", 0), total64, _const(f"{p}_k1", 1)], f"{p}_key_index")  # [T]
            causal = L("LessOrEqual", [keys, L("Unsqueeze", [positions, _const(f"{p}_ax2", [2])], f"{p}_pos3")],
                       f"{p}_causal")  # [B, S, T]
            valid = L("LessOrEqual", [keys, L("Unsqueeze", [last, _const(f"{p}_ax12", [1, 2])], f"{p}_last3")],
                      f"{p}_valid_keys")  # [B, 1, T]
            mask = L("Unsqueeze", [L("And", [causal, valid], f"{p}_visible"), _const(f"{p}_ax1b", [1])], f"{p}_mask")
            positions.dtype, mask.dtype, total64.dtype = np.int64, bool, np.int64
            self.built[key] = (positions, mask, total64)
        return self.built[key]


def _heads(shared: Shared, tensor: gs.Tensor, heads: int, head_dim: int, name: str) -> gs.Variable:
    """[B, S, heads*D] -> [B, heads, S, D]"""
    split = shared.layer("Reshape", [tensor, _const(f"{name}_shape", [0, 0, heads, head_dim])], f"{name}_bshd")
    return shared.layer("Transpose", [split], f"{name}_bhsd", perm=[0, 2, 1, 3])


def _write_cache(shared: Shared, past, present, heads_tensor, positions, name):
    """ScatterElements the new rows at their positions; returns the cache rows to attend over."""
    index = shared.layer("Expand", [shared.layer("Unsqueeze", [positions, _const(f"{name}_ax13", [1, 3])], f"{name}_p4"),
                                    shared.layer("Shape", [heads_tensor], f"{name}_shape")], f"{name}_index")
    node = gs.Node("ScatterElements", name=f"{name}_write", attrs={"axis": 2},
                   inputs=[past, index, heads_tensor], outputs=[present])
    shared.graph.nodes.append(node)
    return present


def lower(shared: Shared, node: gs.Node, index: int) -> None:
    query, key, value, past_key, past_value, seqlens, total, cos, sin = node.inputs
    output, present_key, present_value = (list(node.outputs) + [None, None])[:3]
    heads, kv_heads = node.attrs["num_heads"], node.attrs["kv_num_heads"]
    head_dim = 2 * cos.shape[1]
    name = f"{node.name or 'attention'}_{index}"
    node.outputs.clear()
    positions, mask, total64 = shared.positions_and_mask(query, seqlens, total)
    q = shared.layer("RotaryEmbedding", [query, cos, sin, positions], f"{name}_q_rot", num_heads=heads)
    k = shared.layer("RotaryEmbedding", [key, cos, sin, positions], f"{name}_k_rot", num_heads=kv_heads)
    q, k, v = _heads(shared, q, heads, head_dim, f"{name}_q"), _heads(shared, k, kv_heads, head_dim, f"{name}_k"), \
        _heads(shared, value, kv_heads, head_dim, f"{name}_v")
    if past_key is not None and past_key.name:  # write in place, then attend over the first `total` rows
        rows = [_const(f"{name}_s0", [0]), shared.layer("Unsqueeze", [total64, _const(f"{name}_ax0", [0])], f"{name}_t1"),
                _const(f"{name}_ax", [2])]
        k = shared.layer("Slice", [_write_cache(shared, past_key, present_key, k, positions, f"{name}_k"), *rows],
                         f"{name}_keys")
        v = shared.layer("Slice", [_write_cache(shared, past_value, present_value, v, positions, f"{name}_v"), *rows],
                         f"{name}_values")
    scale = op.node_scale(node, head_dim)
    if not scale > 0:  # onnxruntime refused the model at load ("scale must be greater than 0"), not the build
        raise PassError(f"{node.name or 'a FlashAttention node'}: scale {scale}; ONNX's Attention takes a scale > 0 "
                        f"(lower it with lower_onnxruntime, which folds any scale into the query)")
    attended = shared.layer("Attention", [q, k, v, mask], f"{name}_attended", scale=scale)
    back = shared.layer("Transpose", [attended], f"{name}_bshd_out", perm=[0, 2, 1, 3])
    shared.graph.nodes.append(gs.Node("Reshape", name=f"{name}_merge_heads",
                                      inputs=[back, _const(f"{name}_merge", [0, 0, heads * head_dim])], outputs=[output]))


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    graph = gs.import_onnx(model)
    nodes = [n for n in graph.nodes if n.domain == op.DOMAIN and n.op == op.OP_TYPE]
    if options.max_rewrites is not None:
        nodes = nodes[: options.max_rewrites]
    if not nodes:  # nothing to lower: the graph, opset included, stays as it was
        return unchanged(model), {"lowered": 0, "target": "ai.onnx Attention-23 + RotaryEmbedding-23 + ScatterElements",
                                  "left_unlowered": 0}
    for node in nodes:
        op.check_rotary_layout(node, "lower_onnx_attention")  # RotaryEmbedding-23 here rotates the half layout
    raise_opset(graph, model, OPSET, "lower_onnx_attention")
    graph.import_domains = [o for o in graph.import_domains if o.domain != op.DOMAIN]
    shared = Shared(graph)
    for index, node in enumerate(nodes):
        lower(shared, node, index)
    graph.cleanup().toposort()
    remaining = sum(1 for n in graph.nodes if n.domain == op.DOMAIN)
    if remaining:
        graph.import_domains.append(onnx.helper.make_opsetid(op.DOMAIN, op.VERSION))
    lowered = export_onnx(graph)
    lowered.ir_version = max(lowered.ir_version, 10)  # IR 10 with opset 23, as torch.onnx writes it (onnx 1.23 lists 11)
    return lowered, {"lowered": len(nodes), "target": "ai.onnx Attention-23 + RotaryEmbedding-23 + ScatterElements",
                     "left_unlowered": remaining}
