"""Where AWQ's input scaling goes: the MatMuls of a group read x / s, so 1/s must be applied before them.

Folded into the op that produces x when it is linear per channel and feeds only the group (free at run time):

    (Skip)SimplifiedLayerNormalization(x, [skip,] gamma) -> y        gamma <- gamma / s
    Mul(y, c) with a constant c of K values                          c     <- c / s
    Mul(a, MatMul(h, U)) (SwiGLU's gate * up, down's input)          U     <- U diag(1/s)  (up's output columns)
    Mul(a, Split(MatMul(h, [G | U]))) (gate/up packed by pack_projections)  U's columns of the packed weight
    Reshape(y, [..., K]) of any of the above (lm_head after the final norm)

Otherwise (e.g. o_proj, whose input comes from attention) an explicit Mul(x, 1/s) is inserted before the
group: one elementwise op per step, still exact. The returned string says which happened, for the report.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

NORMALIZATION_GAMMA_INPUT = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2}


def apply_input_scales(graph: gs.Graph, activation: gs.Variable, group: list[gs.Node], scales: np.ndarray) -> str:
    """Make every node of `group` read activation / scales; returns how (for the report)."""
    inverse = (1.0 / scales).astype(np.float32)
    only_group = {id(node) for node in activation.outputs} == {id(node) for node in group}
    producer = activation.inputs[0] if activation.inputs else None
    if only_group and producer is not None and activation not in graph.outputs:
        folded = _fold_into_producer(producer, activation, inverse)
        if folded:
            return folded
    scaled = gs.Variable(f"{activation.name}_awq_scaled", dtype=activation.dtype, shape=activation.shape)
    constant = gs.Constant(f"{activation.name}_awq_inverse_scales", inverse.astype(_dtype(activation)))
    graph.nodes.append(gs.Node("Mul", name=f"{activation.name}_awq_Mul", inputs=[activation, constant],
                               outputs=[scaled]))
    for node in group:
        node.inputs[0] = scaled
    return "Mul inserted before the group"


def _dtype(variable: gs.Variable) -> np.dtype:
    return np.dtype(variable.dtype) if variable.dtype is not None else np.dtype(np.float32)


def _private_constant(tensor, size: int) -> bool:
    """A constant of `size` values (any leading 1-axes) that only one node reads, so changing it is local."""
    return (isinstance(tensor, gs.Constant) and len(tensor.outputs) == 1 and tensor.values.size == size
            and tensor.values.shape[-1] == size)


def _keeps_last_axis(reshape: gs.Node, size: int) -> bool:
    shape = reshape.inputs[1]
    return isinstance(shape, gs.Constant) and shape.values.size > 0 and int(shape.values.reshape(-1)[-1]) == size


def _fold_into_producer(producer: gs.Node, activation: gs.Variable, inverse: np.ndarray) -> str | None:
    size = len(inverse)
    if producer.op == "Reshape" and _keeps_last_axis(producer, size):
        # lm_head reads the final norm through a Reshape to [-1, K]: the channels are the same ones.
        source = producer.inputs[0]
        value_readers = [node for node in source.outputs if node.op != "Shape"]  # Shape reads only the shape
        if value_readers == [producer] and source.inputs:
            return _fold_into_producer(source.inputs[0], source, inverse)
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
        if source is None or len(operand.outputs) != 1:
            continue
        columns = slice(0, size)
        if source.op == "Split":  # gate and up packed into one MatMul (pack_projections): up's columns of it
            columns = _split_columns(source, operand, size)
            packed = source.inputs[0]
            source = packed.inputs[0] if columns is not None and len(packed.outputs) == 1 and packed.inputs else None
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
