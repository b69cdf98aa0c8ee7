"""pack_projections: sibling MatMuls that read one activation become one MatMul and a Split.

The Q/K/V projections (and the MLP's gate/up projections) each read the same normalized activation:

    x ─┬─► MatMul(W_q) ─► q                     x ─► MatMul([W_q | W_k | W_v]) ─► Split(axis=-1) ─┬─► q
       ├─► MatMul(W_k) ─► k           ->                                                         ├─► k
       └─► MatMul(W_v) ─► v                                                                      └─► v

    with biases (Qwen2's q/k/v), when every sibling has one:
    x ─┬─► MatMul(W_q) ─► Add(b_q) ─► q         x ─► MatMul([W_q|W_k|W_v]) ─► Add([b_q|b_k|b_v]) ─► Split ─► q, k, v
       └─► ...                        ->

Rules. A candidate group is the MatMuls (standard domain) that read one tensor as their first input. A sibling
joins the packed group when its weight is a 2-D initializer [K, N_i] that nothing else reads (so the originals
disappear and weight bytes do not grow) and that is not also a graph input (one could override it at run time);
every member has the group's K and dtype. The activation's rank does not matter: all siblings read the same
tensor and the Split is on the last axis. Biases are packed only when every member's output goes to exactly one
Add with a constant [N_i] bias; otherwise the Adds stay, reading the Split's outputs, and nothing is lost.
Refused siblings, and groups left smaller than `min_group`, are listed under "skipped" with a named reason.
A Split whose three parts are exactly a GroupQueryAttention's q, k and v goes away: the attention takes the
packed tensor (onnxruntime's packed-QKV form, key and value empty); "qkv_into_attention" counts them.

Report: packed groups (node names, widths N_i, whether biases were packed), skipped siblings, and weight_bytes
before/after: bytes of the floating-point initializers (the int64 split sizes, 8 bytes a part, are not weights).
Pure: the input ModelProto is never mutated; graph inputs and outputs are kept, names and order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes.cleanup import export_like, tensor_nbytes
from passes.errors import PassError
from passes.graph_patterns import uncached_values, unique_name

STANDARD_DOMAINS = {"", "ai.onnx"}
SPLIT_SIZES_AS_INPUT_OPSET = 13  # before opset 13, Split took its sizes as an attribute


@dataclass(frozen=True)
class Options:
    min_group: int = 2
    max_rewrites: int | None = None  # stop after this many packed groups (bisecting a parity failure)


@dataclass(frozen=True)
class GraphIO:
    inputs: set[str]  # an initializer listed as a graph input can be overridden at run time: not a constant
    outputs: set[str]


@dataclass
class Match:
    activation: gs.Tensor
    matmuls: list[gs.Node]
    weights: list[gs.Constant]
    bias_adds: list[gs.Node] = field(default_factory=list)  # empty, or one Add per MatMul, same order
    biases: list[gs.Constant] = field(default_factory=list)
    biases_left: str | None = None  # why biases that some members have were not packed

    @property
    def widths(self) -> list[int]:
        return [int(weight.shape[1]) for weight in self.weights]


def check_options(options: Options) -> None:
    """What needs no graph to refuse (the pipeline calls this before the export)."""
    if options.min_group < 2:
        raise PassError(f"min_group: {options.min_group} must be >= 2 (a group of one packs nothing)")


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    """Returns a copy of `model` with sibling projections packed, and a report of what was packed or refused."""
    check_options(options)
    graph = gs.import_onnx(model)
    graph_io = GraphIO({value.name for value in model.graph.input}, {value.name for value in model.graph.output})
    report: dict = {"packed": [], "skipped": [], "weight_bytes": {"before": _weight_bytes(model)}}
    taken_names = set(graph.tensors())
    for siblings in _sibling_groups(graph):
        found = match(siblings, graph_io, options.min_group, report["skipped"])
        if found is None:
            continue
        if options.max_rewrites is not None and len(report["packed"]) >= options.max_rewrites:
            report["skipped"] += [{"node": node.name, "reason": f"max_rewrites={options.max_rewrites}"} for node in found.matmuls]
            continue
        rewrite(graph, found, taken_names)
        report["packed"].append({"nodes": [node.name for node in found.matmuls], "widths": found.widths,
                                 "biases_packed": bool(found.biases), "biases_left": found.biases_left})
    report["qkv_into_attention"] = sum(_feed_packed_qkv(node) for node in list(graph.nodes)
                                       if node.op == "GroupQueryAttention")
    graph.cleanup().toposort()  # drops the original MatMuls, Adds and their weights (and bypassed Splits)

    result = export_like(graph, model)
    report["weight_bytes"]["after"] = _weight_bytes(result)
    return result, report


def _packed(weights: list[gs.Constant]) -> np.ndarray:
    """The weights side by side, [K, sum of widths], each read into place and dropped: the pass holds the packed
    weight and one part at a time, not every part beside it (a copy of the packed weights more, kept in the
    constants until the graph is collected, had Llama-3.2-1B's build peak here)."""
    packed, start = None, 0
    for weight in weights:
        part = uncached_values(weight)
        if packed is None:  # the part's own numpy type (gs names bfloat16 by its ONNX number, which numpy refuses)
            packed = np.empty((part.shape[0], sum(int(w.shape[1]) for w in weights)), dtype=part.dtype)
        packed[:, start:start + part.shape[1]] = part
        start += part.shape[1]
    return packed


def _feed_packed_qkv(attention: gs.Node) -> bool:
    """GroupQueryAttention reading q, k, v from one Split (in that order, nothing else reading them) takes the
    packed tensor itself: onnxruntime's packed-QKV form (query = [q | k | v], key and value empty), no Split."""
    parts = attention.inputs[:3]
    split = parts[0].inputs[0] if parts[0].inputs else None
    if split is None or split.op != "Split" or list(split.outputs) != list(parts):
        return False
    if any(len(part.outputs) != 1 for part in parts):
        return False
    attention.inputs[0] = split.inputs[0]
    attention.inputs[1] = gs.Variable.empty()
    attention.inputs[2] = gs.Variable.empty()
    return True


def _sibling_groups(graph: gs.Graph) -> list[list[gs.Node]]:
    """MatMuls grouped by the tensor they read as their first input, in graph order; groups of two or more."""
    groups: dict[int, list[gs.Node]] = {}
    for node in graph.nodes:
        if node.op == "MatMul" and (node.domain or "") in STANDARD_DOMAINS and len(node.inputs) == 2:
            groups.setdefault(id(node.inputs[0]), []).append(node)
    return [group for group in groups.values() if len(group) >= 2]


def match(siblings: list[gs.Node], graph_io: GraphIO, min_group: int, skipped: list[dict]) -> Match | None:
    """The packable part of one candidate group, or None; every refusal is appended to `skipped`."""
    members, weights = [], []
    for node in siblings:
        weight = node.inputs[1]
        reason = _weight_refusal(weight, node, graph_io)
        if reason is None and weights and (weight.shape[0] != weights[0].shape[0]):
            reason = "weight_k_mismatch"
        if reason is None and weights and weight.dtype != weights[0].dtype:
            reason = "weight_dtype_mismatch"
        if reason:
            skipped.append({"node": node.name, "reason": reason})
            continue
        members.append(node)
        weights.append(weight)
    if len(members) < min_group:
        skipped += [{"node": node.name, "reason": "group_too_small"} for node in members]
        return None
    found = Match(activation=siblings[0].inputs[0], matmuls=members, weights=weights)
    bias_pairs = [_constant_bias_add(node, int(weight.shape[1]), graph_io) for node, weight in zip(members, weights)]
    if all(pair is not None for pair in bias_pairs):
        found.bias_adds, found.biases = [add for add, _ in bias_pairs], [bias for _, bias in bias_pairs]
    elif any(pair is not None for pair in bias_pairs):
        found.biases_left = (f"{sum(pair is not None for pair in bias_pairs)} of {len(members)} products have a "
                             f"constant bias Add of their own; the Adds stay after the Split")
    return found


def _weight_refusal(weight: gs.Tensor, node: gs.Node, graph_io: GraphIO) -> str | None:
    if not isinstance(weight, gs.Constant):
        return "weight_not_constant"
    if weight.name in graph_io.inputs:
        return "weight_is_graph_input"
    if len(weight.shape) != 2:
        return "weight_not_2d"
    if any(reader is not node for reader in weight.outputs):
        return "weight_shared"  # its other reader would keep the original: weight bytes would grow
    return None


def _constant_bias_add(matmul: gs.Node, width: int, graph_io: GraphIO) -> tuple[gs.Node, gs.Constant] | None:
    """The Add of a constant [width] bias that is the MatMul output's only reader, if there is one."""
    product = matmul.outputs[0]
    if product.name in graph_io.outputs:  # packing the bias would drop this output
        return None
    if len(product.outputs) != 1 or product.outputs[0].op != "Add" or len(product.outputs[0].inputs) != 2:
        return None
    add = product.outputs[0]
    if (add.domain or "") not in STANDARD_DOMAINS:
        return None
    bias = add.inputs[1] if add.inputs[0] is product else add.inputs[0]
    if (not isinstance(bias, gs.Constant) or bias.name in graph_io.inputs or tuple(bias.shape) != (width,)
            or bias.dtype != matmul.inputs[1].dtype or len(bias.outputs) != 1):
        return None
    return add, bias


def rewrite(graph: gs.Graph, found: Match, taken_names: set[str]) -> None:
    """Inserts MatMul(packed weight) [-> Add(packed bias)] -> Split; the Split writes the original outputs."""
    prefix = _common_name([node.name or weight.name for node, weight in zip(found.matmuls, found.weights)])

    def name(suffix: str) -> str:
        return unique_name(prefix + suffix, taken_names)

    dtype = found.weights[0].dtype
    shape = None if found.activation.shape is None else [*found.activation.shape[:-1], sum(found.widths)]
    packed_weight = gs.Constant(name(".packed_weight"), _packed(found.weights))
    packed = gs.Variable(name(".packed_output"), dtype=dtype, shape=shape)
    graph.nodes.append(gs.Node("MatMul", name(".packed_MatMul"), inputs=[found.activation, packed_weight],
                               outputs=[packed]))
    if found.biases:
        packed_bias = gs.Constant(name(".packed_bias"), np.concatenate([bias.values for bias in found.biases]))
        biased = gs.Variable(name(".packed_biased_output"), dtype=dtype, shape=shape)
        graph.nodes.append(gs.Node("Add", name(".packed_Add"), inputs=[packed, packed_bias], outputs=[biased]))
        packed = biased

    parts = [node.outputs[0] for node in (found.bias_adds or found.matmuls)]
    for node in found.matmuls + found.bias_adds:  # disconnect the originals; cleanup() removes them
        node.inputs.clear()
        node.outputs.clear()
    split = gs.Node("Split", name(".packed_Split"), attrs={"axis": -1}, inputs=[packed], outputs=parts)
    if graph.opset >= SPLIT_SIZES_AS_INPUT_OPSET:
        split.inputs.append(gs.Constant(name(".split_sizes"), np.array(found.widths, dtype=np.int64)))
    else:
        split.attrs["split"] = found.widths
    graph.nodes.append(split)


def _common_name(names: list[str]) -> str:
    """'/l.0/attn/q_proj/MatMul', '/l.0/attn/k_proj/MatMul' -> '/l.0/attn/q_proj+k_proj': shared path, then the parts."""
    paths = [name.split("/") for name in names]
    shared = 0
    while all(len(path) > shared + 1 and path[shared] == paths[0][shared] for path in paths):
        shared += 1
    distinct = "+".join(path[shared] for path in paths)
    return "/".join(paths[0][:shared] + [distinct])


def _weight_bytes(model: onnx.ModelProto) -> int:
    floating = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    return sum(tensor_nbytes(tensor) for tensor in model.graph.initializer if tensor.data_type in floating)
