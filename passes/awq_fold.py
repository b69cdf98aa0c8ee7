"""AWQ's input scales per group of MatMuls that read one activation: one search for the group
(`search_awq_scales`), then where the scaling goes (`fold_awq_scales`): the MatMuls read x / s, so 1/s must be
applied before them.

Folded into the op that produces x when it is linear per channel and feeds only the group (free at run time):

    (Skip)SimplifiedLayerNormalization(x, [skip,] gamma) -> y        gamma <- gamma / s
    Mul(y, c) with a constant c of K values                          c     <- c / s
    Mul(a, MatMul(h, U)) (SwiGLU's gate * up, down's input)          U     <- U diag(1/s)  (up's output columns)
    Mul(a, Split(MatMul(h, [G | U]))) (gate/up packed by pack_projections)  U's columns of the packed weight
    Reshape(y, [..., K]) of any of the above (lm_head after the final norm)
    Attention(q, k, v) -> o, with v = MatMul(h, V) (o_proj's input)  V     <- V diag(1/t)  (the value columns)

The last one holds because attention mixes value rows with weights that do not depend on V: scaling the value
channel (kv head g, d) by 1/t scales output channel (h, d) of every query head h reading kv head g by 1/t. So
o_proj's scales must be tied, s[h, d] = t[h // group, d]; `attention_value_tie` says when that fold exists, and
the AWQ search then ties them (the KV cache holds V / t, the same in prefill and decode). Otherwise an explicit
Mul(x, 1/s) is inserted before the group: one elementwise op per step, still exact. The returned string says
which happened, for the report.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes.calibration import digest
from passes.quantize_algorithms import awq_search

NORMALIZATION_GAMMA_INPUT = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2}
ATTENTION_OPS = ("GroupQueryAttention", "FlashAttention")  # same inputs: query, key, value, ... (packed: key = value = "")


@dataclass(frozen=True)
class ValueColumns:
    """Where an attention output's values come from: columns of a MatMul's private constant weight."""
    weight: gs.Constant
    columns: slice
    kv_heads: int
    group: int       # query heads per kv head
    head_dim: int

    @property
    def tie(self) -> tuple[int, int, int]:
        """The output channels' layout [kv_heads, group, head_dim]: scales must be equal along `group`."""
        return self.kv_heads, self.group, self.head_dim


def attention_value_tie(activation: gs.Variable, kept: frozenset = frozenset()) -> ValueColumns | None:
    """When `activation` is an attention node's output and its values come straight from a MatMul whose weight only
    that MatMul reads (v_proj, or the value columns of pack_projections' packed q/k/v), that weight's columns.
    kept: names of tensors whose values must not change (the graph's outputs): a value tensor among them is not."""
    producer = activation.inputs[0] if activation.inputs else None
    if producer is None or producer.op not in ATTENTION_OPS or producer.outputs[0] is not activation:
        return None
    heads, kv_heads = int(producer.attrs.get("num_heads", 0)), int(producer.attrs.get("kv_num_heads", 0))
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        return None
    value = producer.inputs[2] if len(producer.inputs) > 2 else None
    packed = value is None or not value.name  # GroupQueryAttention reading packed q/k/v from its query input
    source = producer.inputs[0] if packed else value
    if source.name in kept:
        return None
    if not packed and len(source.outputs) == 1 and source.inputs and source.inputs[0].op == "Split":
        return _split_value_columns(source, heads, kv_heads, kept)  # v as the last part of a packed projection
    if len(source.outputs) != 1 or not source.inputs or source.inputs[0].op != "MatMul":
        return None
    weight = source.inputs[0].inputs[1]
    if not (isinstance(weight, gs.Constant) and len(weight.outputs) == 1 and len(weight.shape) == 2):
        return None
    width = weight.shape[1]
    head_dim, remainder = divmod(width, heads + 2 * kv_heads if packed else kv_heads)
    if remainder or head_dim == 0:
        return None
    columns = slice(width - kv_heads * head_dim, width)  # packed: [q | k | v]; else all of v_proj
    return ValueColumns(weight, columns, kv_heads, heads // kv_heads, head_dim)


def _split_value_columns(value: gs.Variable, heads: int, kv_heads: int, kept: frozenset) -> ValueColumns | None:
    """v as the last output of a Split (last axis) of a MatMul that only the Split reads: pack_projections' q/k/v
    when the attention reads q and k rotated apart (lower_onnxruntime's rotary "separate")."""
    split = value.inputs[0]
    packed = split.inputs[0]
    sizes = split.inputs[1] if len(split.inputs) > 1 else None
    axis, rank = split.attrs.get("axis", 0), len(packed.shape) if packed.shape is not None else None
    if (split.outputs[-1] is not value or (axis != -1 and axis != (rank or 0) - 1) or len(packed.outputs) != 1
            or packed.name in kept or not packed.inputs or packed.inputs[0].op != "MatMul"
            or not isinstance(sizes, gs.Constant)):
        return None
    weight = packed.inputs[0].inputs[1]
    if not (isinstance(weight, gs.Constant) and len(weight.outputs) == 1 and len(weight.shape) == 2):
        return None
    width, value_width = weight.shape[1], int(np.asarray(sizes.values)[-1])
    head_dim, remainder = divmod(value_width, kv_heads)
    if remainder or head_dim == 0:
        return None
    return ValueColumns(weight, slice(width - value_width, width), kv_heads, heads // kv_heads, head_dim)


def apply_input_scales(graph: gs.Graph, activation: gs.Variable, group: list[gs.Node], scales: np.ndarray) -> str:
    """Make every node of `group` read activation / scales; returns how (for the report)."""
    inverse = (1.0 / scales).astype(np.float32)
    only_group = {id(node) for node in activation.outputs} == {id(node) for node in group}
    producer = activation.inputs[0] if activation.inputs else None
    kept = graph_outputs(graph)
    if only_group and producer is not None and activation.name not in kept:
        folded = _fold_into_producer(producer, activation, inverse, kept)
        if folded:
            return folded
    scaled = gs.Variable(f"{activation.name}_awq_scaled", dtype=activation.dtype, shape=activation.shape)
    constant = gs.Constant(f"{activation.name}_awq_inverse_scales", inverse.astype(_dtype(activation)))
    graph.nodes.append(gs.Node("Mul", name=f"{activation.name}_awq_Mul", inputs=[activation, constant],
                               outputs=[scaled]))
    for node in group:
        node.inputs[0] = scaled
    return "Mul inserted before the group"


def graph_outputs(graph: gs.Graph) -> frozenset:
    """Names of the tensors a fold must not rescale: the graph's outputs (a caller reads them as they are)."""
    return frozenset(tensor.name for tensor in graph.outputs)


def _dtype(variable: gs.Variable) -> np.dtype:
    """graphsurgeon names bfloat16 by its ONNX number (16), which numpy cannot read."""
    if variable.dtype is None:
        return np.dtype(np.float32)
    if isinstance(variable.dtype, int):
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(variable.dtype))
    return np.dtype(variable.dtype)


def _private_constant(tensor, size: int) -> bool:
    """A constant of `size` values (any leading 1-axes) that only one node reads, so changing it is local."""
    return (isinstance(tensor, gs.Constant) and len(tensor.outputs) == 1 and tensor.values.size == size
            and tensor.values.shape[-1] == size)


def _keeps_last_axis(reshape: gs.Node, size: int) -> bool:
    shape = reshape.inputs[1]
    return isinstance(shape, gs.Constant) and shape.values.size > 0 and int(shape.values.reshape(-1)[-1]) == size


def _fold_into_producer(producer: gs.Node, activation: gs.Variable, inverse: np.ndarray,
                        kept: frozenset) -> str | None:
    """Fold 1/s into what produces `activation` (which only the group reads, and no caller: not in `kept`); each
    tensor the fold rescales on the way must be read only there and not be in `kept` either."""
    size = len(inverse)
    if producer.op in ATTENTION_OPS:
        return _fold_into_values(activation, inverse, kept)
    if producer.op == "Reshape" and _keeps_last_axis(producer, size):
        # lm_head reads the final norm through a Reshape to [-1, K]: the channels are the same ones.
        source = producer.inputs[0]
        value_readers = [node for node in source.outputs if node.op != "Shape"]  # Shape reads only the shape
        if value_readers == [producer] and source.inputs and source.name not in kept:
            return _fold_into_producer(source.inputs[0], source, inverse, kept)
        return None
    gamma_input = NORMALIZATION_GAMMA_INPUT.get(producer.op)
    if gamma_input is not None and producer.outputs[0] is activation:
        gamma = producer.inputs[gamma_input]
        if _private_constant(gamma, size):
            gamma.values = (gamma.values * inverse.astype(gamma.values.dtype)).astype(gamma.values.dtype)
            return f"folded into {producer.op} {producer.name!r} (gamma)"
        return None
    if producer.op != "Mul":
        return None
    for operand in producer.inputs:
        if _private_constant(operand, size):
            operand.values = (operand.values * inverse.astype(operand.values.dtype)).astype(operand.values.dtype)
            return f"folded into Mul {producer.name!r} (constant operand)"
    for operand in producer.inputs:
        source = operand.inputs[0] if operand.inputs else None
        if source is None or len(operand.outputs) != 1 or operand.name in kept:
            continue
        columns = slice(0, size)
        if source.op == "Split":  # gate and up packed into one MatMul (pack_projections): up's columns of it
            columns = _split_columns(source, operand, size)
            packed = source.inputs[0]
            source = (packed.inputs[0] if columns is not None and len(packed.outputs) == 1 and packed.inputs
                      and packed.name not in kept else None)
        if source is None or source.op != "MatMul":
            continue
        weight = source.inputs[1]
        if isinstance(weight, gs.Constant) and len(weight.outputs) == 1 and weight.values.ndim == 2 \
                and weight.values.shape[1] >= columns.stop:
            values = weight.values.copy()
            values[:, columns] *= inverse[None, :].astype(values.dtype)
            if columns.stop - columns.start == values.shape[1]:
                weight.values = values
                return f"folded into MatMul {source.name!r} (output columns)"
            weight.values = values
            return f"folded into MatMul {source.name!r} (output columns {columns.start}:{columns.stop})"
    return None


def _fold_into_values(activation: gs.Variable, inverse: np.ndarray, kept: frozenset) -> str | None:
    values = attention_value_tie(activation, kept)
    if values is None or len(inverse) != np.prod(values.tie):
        return None
    tied = inverse.reshape(values.tie)
    if not np.array_equal(tied, np.broadcast_to(tied[:, :1], tied.shape)):
        return None  # scales differ between query heads that read one kv head: no single value scale works
    weight = values.weight.values.copy()
    weight[:, values.columns] *= tied[:, 0].reshape(1, -1).astype(weight.dtype)
    values.weight.values = weight
    return (f"folded into the attention's value projection (columns {values.columns.start}:{values.columns.stop}, "
            f"scales tied across the {values.group} query heads of each kv head)")


def _split_columns(split: gs.Node, part: gs.Variable, size: int) -> slice | None:
    """Which columns of the Split's input (last axis) `part` is, when the sizes are constant."""
    sizes = split.inputs[1] if len(split.inputs) > 1 else None
    if split.attrs.get("axis") not in (-1, 2) or not isinstance(sizes, gs.Constant):
        return None
    index = next(i for i, output in enumerate(split.outputs) if output is part)
    start = int(sizes.values[:index].sum())
    if int(sizes.values[index]) != size:
        return None
    return slice(start, start + size)


def search_awq_scales(targets: list, statistics, memo: dict, kept: frozenset = frozenset()) -> None:
    """Set each AWQ target's input scales: one search per group of targets that read the same activation, so that
    1/s folds once into what produces it; per-layer overrides may give the group's members different formats.
    kept: the graph's outputs (graph_outputs), which no fold may rescale."""
    groups: dict[str, list] = {}
    for target in targets:
        if target.settings.method in ("awq", "awq_gptq") and not target.shared_table:
            groups.setdefault(target.input_name, []).append(target)
    for index, group in enumerate(groups.values(), 1):
        values = attention_value_tie(group[0].activation, kept)  # o_proj: tied scales fold into the values, no Mul
        tie = values.tie if values is not None else None
        formats = [(t.settings.bits, t.settings.block_size, t.settings.symmetric, t.settings.full_range) for t in group]
        # The layers are in the key: equal weights in two layers (a depth-upscaled model) get their own search.
        key = ("awq", tie, *formats, *(t.layer for t in group), *(digest(t.weight) for t in group))
        # progress only for searches that run (the second phase takes the first's results from the memo)
        if key not in memo and index % max(1, len(groups) // 4) == 0 and statistics.calibration is not None:
            statistics.calibration.say(f"awq: scale search {index}/{len(groups)} input groups")
        if key not in memo:
            stats = statistics(group[0])
            bits, blocks, symmetric, full_range = (list(values) for values in zip(*formats))
            memo[key] = awq_search([t.weight.astype(np.float32) for t in group], stats.hessian, stats.mean_abs,
                                   bits, blocks, symmetric, tie, full_range)
        scales, record = memo[key]
        for target in group:
            target.input_scales = scales
            target.scaling = f"alpha={record['alpha']:.2f}"


def fold_awq_scales(graph: gs.Graph, targets: list) -> None:
    """After every search (which must see the unscaled weights), apply each group's 1/s before its MatMuls."""
    groups: dict[str, list] = {}
    for target in targets:
        if target.input_scales is not None:
            groups.setdefault(target.input_name, []).append(target)
    for group in groups.values():
        how = apply_input_scales(graph, group[0].activation, [t.node for t in group], group[0].input_scales)
        for target in group:
            target.scaling += f", {how}"
