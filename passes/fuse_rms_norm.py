"""fuse_rms_norm: RMSNorm subgraphs -> onnxruntime's SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization.

The pattern, as the TorchScript exporter writes the canonical decoder's RMSNorm (and, with the bracketed
Casts, Hugging Face's LlamaRMSNorm; the dynamo exporter writes the Reciprocal form):

    x ─[Cast to float]─┬─► Pow(., 2) or Mul(x, x) ─► ReduceMean(axes=[-1], keepdims=1) ─► Add(., eps) ─► Sqrt ─┐
                       │                                                                                      │
                       │          ┌─────────────────────── Div(1, .) or Reciprocal ◄──────────────────────────┘
                       │          ▼
                       └────► Mul(x, .) ─[Cast back]─► Mul(weight, .) ─► y
                              (or Sqrt ─► Div(x, .) in place of the inverse and this Mul)

    ->  x ─► SimplifiedLayerNormalization(axis=-1, epsilon=eps, stash_type=1)(x, weight) ─► y

When x is a residual sum `Add(a, b)` (same shapes, rank 2 or 3) and `skip_fusion` is on, the Add goes too:

    a, b ─► Add ─► s ─► RMSNorm ─► y          ->   a, b ─► com.microsoft.SkipSimplifiedLayerNormalization(a, b, weight)
            └─► s (next residual, graph output)         ─► outputs (y, "", "", s)    (s only when read elsewhere)

ONNX's own RMSNormalization (opset 23; the dynamo exporter writes it there) over the last axis becomes the same
fused node, so that its residual Add is taken over too (it was left alone, unreported, and lost that fusion).

Operand order of the commutative Adds and Muls does not matter. A Cast to float before the norm and the Cast
back after it (Hugging Face's fp16 path; float->float no-ops in fp32 graphs) are absorbed: the kernel computes
in float (stash_type=1) whatever x's type. Every ReduceMean of a square is a candidate; a candidate that fails
a check is left as it is and listed in the report with its reason.

Pure: the input ModelProto is never mutated. Graph inputs and outputs keep their names and order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes.cleanup import export_like
from passes.graph_patterns import unique_name

MICROSOFT_DOMAIN = "com.microsoft"
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


@dataclass(frozen=True)
class Options:
    skip_fusion: bool = True  # also fuse a residual Add before the norm (SkipSimplifiedLayerNormalization)
    max_rewrites: int | None = None  # stop after this many fusions (bisecting a parity failure)


@dataclass(frozen=True)
class Match:
    root: gs.Tensor  # the tensor normalized (before any Cast to float)
    weight: gs.Constant  # [hidden]
    epsilon: float
    output: gs.Tensor  # the weight Mul's output: the fused node writes it
    nodes: tuple[gs.Node, ...]  # the pattern, from the square to the weight Mul
    upcast: gs.Node | None  # the Cast between root and the square, when the fused node reads past it


@dataclass(frozen=True)
class Skip:
    node: str
    reason: str  # "<name>: <detail>"


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    """Returns a copy of `model` with its RMSNorms fused, and a report of what was fused and what was not."""
    graph = gs.import_onnx(model).toposort()
    # gs keeps `model.opset_import` itself as its domain list and export appends com.microsoft to it: own a copy.
    graph.import_domains = [onnx.helper.make_opsetid(entry.domain, entry.version) for entry in model.opset_import]
    nodes_before = len(graph.nodes)
    report: dict = {"fused": 0, "fused_with_skip": 0, "skipped": [], "skip_form_declined": []}
    graph_outputs = {tensor.name for tensor in graph.outputs}
    taken_names = {node.name for node in graph.nodes}
    graph_inputs = {value.name for value in model.graph.input}
    candidates = [node for node in graph.nodes if (node.op == "ReduceMean" and _square_input(node) is not None)
                  or (node.op == "RMSNormalization" and node.domain in ("", None, "ai.onnx"))]
    for reduce_mean in candidates:
        if options.max_rewrites is not None and report["fused"] + report["fused_with_skip"] >= options.max_rewrites:
            reason = f"max_rewrites={options.max_rewrites}"
            report["skipped"].append({"node": reduce_mean.name, "reason": reason})
            continue
        if reduce_mean.op == "RMSNormalization":
            found = match_onnx_op(reduce_mean, graph_inputs)
        else:
            found = match(reduce_mean, graph_outputs, graph_inputs)
        if isinstance(found, Skip):
            report["skipped"].append({"node": found.node, "reason": found.reason})
            continue
        residual = _residual_add(found, graph_outputs) if options.skip_fusion else None
        if isinstance(residual, Skip):
            report["skip_form_declined"].append({"node": residual.node, "reason": residual.reason})
            residual = None
        rewrite(graph, found, residual, graph_outputs, taken_names)
        report["fused_with_skip" if residual is not None else "fused"] += 1
    graph.cleanup().toposort()  # the disconnected pattern nodes (and Casts nothing reads now) go
    result = export_like(graph, model)  # keeps an initializer that is also a graph input (an overridable default)
    report["nodes"] = {"before": nodes_before, "after": len(result.graph.node)}
    return result, report


def match(reduce_mean: gs.Node, graph_outputs: set[str], graph_inputs: frozenset[str] = frozenset()) -> Match | Skip:
    """Walks forward from the ReduceMean of a square to the weight Mul; the first failed check is the Skip."""
    def skip(reason: str) -> Skip:
        return Skip(reduce_mean.name, reason)

    square = reduce_mean.inputs[0].inputs[0]
    x = _square_input(reduce_mean)
    if len(square.outputs[0].outputs) != 1 or square.outputs[0].name in graph_outputs:
        return skip("square_used_elsewhere: the squared input is read outside the norm")
    if reduce_mean.attrs.get("keepdims", 1) != 1:
        return skip("keepdims_0: ReduceMean drops the reduced axis; the kernel keeps it")
    axes = _reduce_axes(reduce_mean)
    rank = len(x.shape) if x.shape is not None else None
    if axes is None:
        return skip("axes_unknown: ReduceMean axes are not a constant")
    if len(axes) != 1 or not (axes[0] == -1 or (rank is not None and axes[0] == rank - 1)):
        return skip(f"reduce_axis_not_last: ReduceMean axes {axes}, rank {rank}; RMSNorm reduces the last axis only")

    add_eps = _only_consumer(reduce_mean, "Add", graph_outputs)
    epsilon = _constant_operand(add_eps, reduce_mean.outputs[0]) if add_eps is not None else None
    exponent = [square.inputs[1]] if square.op == "Pow" else []  # Mul(x, x) reads x twice: no exponent
    constants = [*exponent, add_eps.inputs[0], add_eps.inputs[1]] if add_eps is not None else []
    if any(tensor.name in graph_inputs for tensor in constants):  # baked into the fused node, a fed value is ignored
        return skip("constant_is_graph_input: the exponent or epsilon is an initializer that the graph's caller may "
                    "override")
    if epsilon is None or not _scalar(epsilon):  # a [1, 1, 1, 1] epsilon would broadcast a rank-3 norm to rank 4
        return skip("no_epsilon: ReduceMean is not followed by Add(scalar constant)")
    sqrt = _only_consumer(add_eps, "Sqrt", graph_outputs)
    if sqrt is None:
        return skip("no_sqrt: Add(eps) is not followed by Sqrt")
    nodes = [square, reduce_mean, add_eps, sqrt]

    after_sqrt = _only_consumer(sqrt, ("Div", "Reciprocal"), graph_outputs)
    if after_sqrt is None:
        return skip("no_reciprocal: Sqrt is not followed by Div or Reciprocal")
    if after_sqrt.op == "Div" and after_sqrt.inputs[1] is sqrt.outputs[0] and after_sqrt.inputs[0] is x:
        normalized = after_sqrt  # Div(x, sqrt)
    else:
        if after_sqrt.op == "Div" and not _is_constant_one(after_sqrt.inputs[0]):
            return skip("no_reciprocal: Div after Sqrt is neither Div(1, .) nor Div(x, .)")
        if after_sqrt.op == "Div" and after_sqrt.inputs[0].name in graph_inputs:
            return skip("constant_is_graph_input: the 1 of Div(1, .) is an initializer that the graph's caller may "
                        "override")
        normalized = _only_consumer(after_sqrt, "Mul", graph_outputs)
        if normalized is None or _other_operand(normalized, after_sqrt.outputs[0]) is not x:
            return skip("normalized_input_differs: 1/rms does not multiply the tensor that was squared")
        nodes.append(after_sqrt)
    nodes.append(normalized)

    weight_mul = _only_consumer(normalized, ("Mul", "Cast"), graph_outputs)
    cast_back = weight_mul if weight_mul is not None and weight_mul.op == "Cast" else None
    if cast_back is not None:
        weight_mul = _only_consumer(cast_back, "Mul", graph_outputs)
    if weight_mul is None:
        return skip("no_weight_mul: the normalized tensor is not multiplied by a weight alone")
    weight = _other_operand(weight_mul, (cast_back or normalized).outputs[0])
    if not isinstance(weight, gs.Constant):
        return skip("weight_not_constant: the scale of the final Mul is not an initializer")
    if weight.name in graph_inputs:  # fused, the value fed for it would be ignored
        return skip("weight_is_graph_input: the scale is an initializer that the graph's caller may override")
    hidden = x.shape[-1] if x.shape else None
    if not isinstance(hidden, int) or tuple(weight.shape) != (hidden,):
        return skip(f"weight_shape: weight {tuple(weight.shape)} vs last dim of the input {hidden}")
    nodes += [cast_back, weight_mul] if cast_back is not None else [weight_mul]

    root, upcast = _root(x, cast_back, weight)
    if root is None:
        return skip("dtype_mismatch: the weight's type differs from the normalized tensor's")
    return Match(root, weight, float(epsilon.reshape(-1)[0]), weight_mul.outputs[0], tuple(nodes), upcast)


def match_onnx_op(node: gs.Node, graph_inputs: frozenset[str] = frozenset()) -> Match | Skip:
    """ONNX's RMSNormalization(x, scale) over the last axis, computed in float (stash_type 1), with a constant
    scale of x's type and size: the fused node's meaning exactly."""
    def skip(reason: str) -> Skip:
        return Skip(node.name, reason)

    x, weight = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    rank = len(x.shape) if x.shape is not None else None
    axis = int(node.attrs.get("axis", -1))
    if not (axis == -1 or (rank is not None and axis == rank - 1)):
        return skip(f"reduce_axis_not_last: RMSNormalization axis {axis}, rank {rank}; the kernel normalizes the last "
                    f"axis only")
    if int(node.attrs.get("stash_type", 1)) != 1:
        return skip("stash_type: RMSNormalization computes in its input's type; the kernel computes in float")
    if not isinstance(weight, gs.Constant):
        return skip("weight_not_constant: the scale is not an initializer")
    if weight.name in graph_inputs:
        return skip("weight_is_graph_input: the scale is an initializer that the graph's caller may override")
    hidden = x.shape[-1] if x.shape else None
    if not isinstance(hidden, int) or tuple(weight.shape) != (hidden,):
        return skip(f"weight_shape: scale {tuple(weight.shape)} vs last dim of the input {hidden}")
    if x.dtype is None or x.dtype != weight.dtype:
        return skip("dtype_mismatch: the scale's type differs from the normalized tensor's")
    return Match(x, weight, float(node.attrs.get("epsilon", 1e-5)), node.outputs[0], (node,), None)


def rewrite(graph: gs.Graph, found: Match, residual: gs.Node | None, graph_outputs: set[str],
            taken_names: set[str]) -> None:
    """Disconnects the pattern (and the residual Add) and inserts the fused node writing the same output."""
    anchor = found.nodes[1] if len(found.nodes) > 1 else found.nodes[0]  # the ReduceMean, or RMSNormalization itself
    prefix = anchor.name.rpartition("/")[0] or anchor.name
    attrs = {"epsilon": found.epsilon}
    if residual is None:
        op, domain, inputs, outputs = "SimplifiedLayerNormalization", None, [found.root, found.weight], [found.output]
        attrs.update(axis=-1, stash_type=1)
    else:
        op, domain = "SkipSimplifiedLayerNormalization", MICROSOFT_DOMAIN
        inputs = [residual.inputs[0], residual.inputs[1], found.weight]
        sum_output = found.root if _sum_read_elsewhere(found, graph_outputs) else gs.Variable.empty()
        outputs = [found.output, gs.Variable.empty(), gs.Variable.empty(), sum_output]  # output, mean, inv_std_var, sum
        residual.inputs.clear()
        residual.outputs.clear()  # the sum, if read elsewhere, is now written by the fused node
    for node in found.nodes:
        node.inputs.clear()
        node.outputs.clear()
    name = unique_name(f"{prefix}/{op}", taken_names)
    graph.nodes.append(gs.Node(op, name=name, domain=domain, attrs=attrs, inputs=inputs, outputs=outputs))


def _sum_read_elsewhere(found: Match, graph_outputs: set[str]) -> bool:
    """Whether anything but the pattern (and an upcast only the pattern reads) reads the residual sum."""
    pattern = _ids(found.nodes)
    readers = [node for node in found.root.outputs if id(node) not in pattern]
    upcast = found.upcast
    if (upcast is not None and upcast in readers and upcast.outputs[0].name not in graph_outputs
            and all(id(node) in pattern for node in upcast.outputs[0].outputs)):
        readers.remove(upcast)
    return found.root.name in graph_outputs or bool(readers)


def _residual_add(found: Match, graph_outputs: set[str]) -> gs.Node | Skip | None:
    """The Add(a, b) writing the norm's input, when SkipSimplifiedLayerNormalization can take it over."""
    producers = found.root.inputs
    if len(producers) != 1 or producers[0].op != "Add" or len(producers[0].inputs) != 2:
        return None  # not a residual: nothing to decline
    add = producers[0]
    a, b = add.inputs
    if isinstance(a, gs.Constant) or isinstance(b, gs.Constant):
        return Skip(add.name, "constant_operand: a bias Add is not a residual")
    if not _same_known_shape(a.shape, b.shape) or len(a.shape) not in (2, 3):
        # An unknown dimension (None) may differ at run time: the Add would broadcast, the kernel would not.
        return Skip(add.name, f"shapes: {a.shape} + {b.shape}; the kernel needs equal 2-D or 3-D shapes, known to "
                              f"be equal (sizes or the same named dimension)")
    if not (a.dtype == b.dtype == found.weight.dtype):
        return Skip(add.name, f"dtypes: {a.dtype} + {b.dtype} with weight {found.weight.dtype}")
    return add


def _square_input(reduce_mean: gs.Node) -> gs.Tensor | None:
    """x when the ReduceMean reads Pow(x, 2) or Mul(x, x), else None (not an RMSNorm candidate)."""
    producers = reduce_mean.inputs[0].inputs if reduce_mean.inputs else []
    if len(producers) != 1:
        return None
    square = producers[0]
    if square.op == "Mul" and len(square.inputs) == 2 and square.inputs[0] is square.inputs[1]:
        return square.inputs[0]
    if square.op == "Pow" and len(square.inputs) == 2:
        exponent = _constant_value(square.inputs[1])
        if exponent is not None and _scalar(exponent) and float(exponent.reshape(-1)[0]) == 2.0:
            return square.inputs[0]
    return None


def _reduce_axes(reduce_mean: gs.Node) -> list[int] | None:
    if len(reduce_mean.inputs) > 1 and reduce_mean.inputs[1].name:  # opset 18+: axes is an input
        axes = _constant_value(reduce_mean.inputs[1])
        return None if axes is None else [int(axis) for axis in axes.reshape(-1)]
    axes = reduce_mean.attrs.get("axes")
    return None if axes is None else [int(axis) for axis in axes]


def _root(x: gs.Tensor, cast_back: gs.Node | None, weight: gs.Constant) -> tuple[gs.Tensor | None, gs.Node | None]:
    """The fused node's input and the Cast it reads past: what a Cast to float read, when that has the weight's
    type (the kernel upcasts itself: stash_type=1), else x when x has the weight's type, else None."""
    producers = x.inputs
    if len(producers) == 1 and producers[0].op == "Cast" and producers[0].attrs.get("to") in FLOAT_TYPES:
        before_cast = producers[0].inputs[0]
        if before_cast.dtype is not None and before_cast.dtype == weight.dtype:
            return before_cast, producers[0]
    if cast_back is None:  # without a Cast before the weight Mul, ONNX typing makes x's type the weight's
        return x, None
    return (x, None) if x.dtype is not None and x.dtype == weight.dtype else (None, None)


def _only_consumer(node: gs.Node, ops: str | tuple[str, ...], graph_outputs: set[str]) -> gs.Node | None:
    """The single node reading `node`'s single output, if its op is one of `ops` and no graph output needs it."""
    ops = (ops,) if isinstance(ops, str) else ops
    if len(node.outputs) != 1 or node.outputs[0].name in graph_outputs or len(node.outputs[0].outputs) != 1:
        return None
    consumer = node.outputs[0].outputs[0]
    return consumer if consumer.op in ops else None


def _other_operand(node: gs.Node, tensor: gs.Tensor) -> gs.Tensor | None:
    if len(node.inputs) != 2:
        return None
    if node.inputs[0] is tensor:
        return node.inputs[1]
    return node.inputs[0] if node.inputs[1] is tensor else None


def _constant_operand(node: gs.Node, tensor: gs.Tensor) -> np.ndarray | None:
    other = _other_operand(node, tensor)
    return None if other is None else _constant_value(other)


def _constant_value(tensor: gs.Tensor) -> np.ndarray | None:
    """An initializer's values, or a Constant node's (graphs not yet through cleanup still have those)."""
    if isinstance(tensor, gs.Constant):
        return np.asarray(tensor.values)
    if len(tensor.inputs) == 1 and tensor.inputs[0].op == "Constant":
        value = tensor.inputs[0].attrs.get("value")
        return np.asarray(value.values) if isinstance(value, gs.Constant) else None
    return None


def _is_constant_one(tensor: gs.Tensor) -> bool:
    value = _constant_value(tensor)
    return value is not None and _scalar(value) and float(value.reshape(-1)[0]) == 1.0


def _scalar(value: np.ndarray) -> bool:
    """One value of rank 0 or 1: it broadcasts without raising the rank of what it meets."""
    return value.size == 1 and value.ndim <= 1


def _same_known_shape(a, b) -> bool:
    return (a is not None and b is not None and len(a) == len(b)
            and all(isinstance(x, (int, str)) and x == y for x, y in zip(a, b)))


def _ids(nodes) -> set[int]:
    return {id(node) for node in nodes}

