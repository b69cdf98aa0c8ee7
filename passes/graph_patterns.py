"""Pattern pieces shared by passes: walking up a graph through shape-only ops and constant scalings, reading
constants, naming layers, and parsing a rotary embedding back to its input, its cos table and the inv_freq under it
(fuse_attention, fuse_rotary); and whether an optional input is present or a tensor is computed from constants only
(slice_packed_weights, dequantize_weights).

Every parser returns what it found or a SkipReason saying which check failed, for the passes' reports.
"""
from __future__ import annotations

import re

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues


class SkipReason(str):
    """Why an attention block was not fused: the first check that failed."""


def producer(tensor: gs.Tensor) -> gs.Node | None:
    return tensor.inputs[0] if tensor.inputs else None


def uncached_values(constant: gs.Constant) -> np.ndarray:
    """A constant's values, read without keeping them in it: `Constant.values` keeps an array read from the model
    (one more copy of that weight, until the graph is collected after the pass), which a pass that only reads a
    weight to build another does not need."""
    return constant._values.load() if isinstance(constant._values, LazyValues) else constant.values


def constant_type(constant: gs.Constant) -> np.dtype:
    """A constant's numpy type, without reading its values (graphsurgeon's dtype names bfloat16 by its ONNX number)."""
    values = constant._values
    if isinstance(values, LazyValues):
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(values.tensor.data_type))
    return np.asarray(values).dtype


def constant(tensor: gs.Tensor) -> np.ndarray | None:
    if isinstance(tensor, gs.Constant):
        return np.asarray(tensor.values)
    node = producer(tensor)
    if node is not None and node.op == "Constant":
        return np.asarray(node.attrs["value"].values)
    return None


def weight_shape(node: gs.Node | None) -> tuple[int, int] | None:
    """(K, N) of a product x @ W by a constant weight: a MatMul by a constant, or by DequantizeLinear of constant
    codes ([K, N], quantize's dequantize_linear lowering), or onnxruntime's MatMulNBits (its K and N); else None.
    Shapes only: a weight's values are not read (INT4 codes would be unpacked)."""
    if node is None:
        return None
    if node.op == "MatMulNBits":
        k, n = node.attrs.get("K"), node.attrs.get("N")
        return (int(k), int(n)) if isinstance(k, int) and isinstance(n, int) else None
    if node.op != "MatMul" or len(node.inputs) != 2:
        return None
    weight = node.inputs[1]
    quantized = producer(weight)
    if quantized is not None and quantized.op == "DequantizeLinear":
        weight = quantized.inputs[0]
    shape = _constant_shape(weight)
    return (int(shape[0]), int(shape[1])) if shape is not None and len(shape) == 2 else None


def _constant_shape(tensor: gs.Tensor) -> tuple | None:
    if isinstance(tensor, gs.Constant):
        return tuple(tensor.shape)
    node = producer(tensor)
    if node is not None and node.op == "Constant":
        return tuple(node.attrs["value"].shape)
    return None


def is_present(tensor: gs.Tensor) -> bool:
    """False for an omitted optional input (an unnamed Variable)."""
    return not (isinstance(tensor, gs.Variable) and tensor.name == "")


def computed_from_constants(tensor: gs.Tensor) -> bool:
    """True when `tensor` is a constant, or every input of the subgraph that computes it is one: onnxruntime's
    constant folding then computes it once, when the session loads."""
    if isinstance(tensor, gs.Constant):
        return True
    if not tensor.inputs:  # a graph input
        return False
    node = tensor.inputs[0]
    if node.op == "Constant":
        return True
    if not node.inputs or any(isinstance(value, gs.Graph) for value in node.attrs.values()):
        return False  # a source such as RandomNormal (not folded), or a subgraph that may read outer values
    return all(computed_from_constants(t) for t in node.inputs if t.name)


def walk_up(tensor: gs.Tensor, through: set[str]) -> tuple[gs.Tensor, gs.Node | None]:
    """Follow first inputs up through shape-only ops; returns the tensor reached and its producer."""
    node = producer(tensor)
    while node is not None and node.op in through:
        tensor, node = node.inputs[0], producer(node.inputs[0])
    return tensor, node


def as_float(value: np.ndarray) -> float:
    """A one-element constant of any shape ([], [1], [1, 1]) as a float (numpy 2 refuses float() on shape [1])."""
    return float(np.asarray(value).reshape(-1)[0])


def scalar_factor(node: gs.Node) -> float | None:
    """The factor a Mul by a constant scalar (or a Div by one) applies; None for any other node."""
    values = [constant(t) for t in node.inputs] if node.op in ("Mul", "Div") else []
    if node.op == "Mul":
        scalar = next((v for v in values if v is not None and v.size == 1), None)
        return None if scalar is None or all(v is not None for v in values) else as_float(scalar)
    if node.op == "Div" and values[0] is None and values[1] is not None and values[1].size == 1:
        return 1.0 / as_float(values[1])
    return None


def scaled_operand(node: gs.Node) -> gs.Tensor:
    return next(t for t in node.inputs if constant(t) is None)


def walk_up_scaled(tensor: gs.Tensor, through: set[str]) -> tuple[gs.Tensor, float]:
    """walk_up, also through scalings by constants (an exporter may scale q and k by sqrt(scale) each before
    their product); returns the tensor reached and the product of the factors passed."""
    factor, node = 1.0, producer(tensor)
    while node is not None:
        if node.op in through:
            tensor = node.inputs[0]
        elif scalar_factor(node) is not None:
            factor *= scalar_factor(node)
            tensor = scaled_operand(node)
        else:
            break
        node = producer(tensor)
    return tensor, factor


def numbered(name: str, index: int) -> str:
    """A layer's name for the report and the fused node: "layers.N" from the graph's names, else "attention.<index>"
    (exporters that name nodes by op, node_Softmax_157, or not at all)."""
    return name if re.fullmatch(r"layers\.\d+", name) else f"attention.{index}"


def layer_name(node: gs.Node) -> str:
    found = re.search(r"layers[./_](\d+)", node.name or "")
    return f"layers.{found.group(1)}" if found else (node.name or "attention")


def parse_rotary(tensor: gs.Tensor) -> tuple[gs.Tensor, gs.Tensor] | SkipReason:
    """Parse rotary(t) = t*cos + Concat(-t2, t1)*sin, or ONNX RotaryEmbedding(t, cos, sin) (rotate-half, all
    of t rotated, positions already in cos); returns (t, cos)."""
    terms = parse_rotary_terms(tensor)
    return terms if isinstance(terms, SkipReason) else terms[:2]


def parse_rotary_terms(tensor: gs.Tensor) -> tuple[gs.Tensor, gs.Tensor, gs.Tensor] | SkipReason:
    """parse_rotary's (t, cos), and the sin operand: RotaryEmbedding's third input, else the rotate-half term's
    other factor."""
    add = producer(tensor)
    if add is not None and add.op == "RotaryEmbedding":
        width = add.inputs[0].shape[-1] if add.inputs[0].shape and len(add.inputs[0].shape) == 4 else None
        partial = add.attrs.get("rotary_embedding_dim", 0) not in (0, width)
        indexed = len(add.inputs) > 3 and not add.inputs[3].is_empty()
        if add.attrs.get("interleaved", 0) or partial or indexed:
            return SkipReason(f"RotaryEmbedding '{add.name}' is interleaved, partial or indexed by position_ids; "
                              f"FlashAttention rotates all of each head, rotate-half, at the token's position")
        return add.inputs[0], add.inputs[1], add.inputs[2]
    if add is None or add.op != "Add" or not all(producer(t) is not None and producer(t).op == "Mul" for t in add.inputs):
        return SkipReason(f"no rotary embedding (Add of two Muls) at '{tensor.name}'")
    for rotate_mul, cos_mul in (add.inputs[0].inputs[0], add.inputs[1].inputs[0]), (add.inputs[1].inputs[0], add.inputs[0].inputs[0]):
        concat = next((producer(t) for t in rotate_mul.inputs if producer(t) is not None and producer(t).op == "Concat"), None)
        if concat is None or producer(concat.inputs[0]) is None or producer(concat.inputs[0]).op != "Neg":
            continue
        negated_slice = producer(producer(concat.inputs[0]).inputs[0])
        if negated_slice is None or negated_slice.op != "Slice":
            continue
        source = negated_slice.inputs[0]
        if source not in cos_mul.inputs:
            return SkipReason("rotary: the cos term does not multiply the tensor being rotated")
        cos = cos_mul.inputs[1] if cos_mul.inputs[0] is source else cos_mul.inputs[0]
        sin = rotate_mul.inputs[1] if rotate_mul.inputs[0] is concat.outputs[0] else rotate_mul.inputs[0]
        return source, cos, sin
    return SkipReason("rotary: no rotate-half term Concat(Neg(Slice(t)), Slice(t))")


def parse_inv_freq(cos: gs.Tensor) -> tuple[np.ndarray, float] | SkipReason:
    """Find Cos above the cos table, the scalar scaling on the way, and the inv_freq constant under it."""
    scaling, tensor = 1.0, cos
    node = producer(tensor)
    while node is not None and node.op != "Cos":
        if node.op == "Mul":
            scalar = next((constant(t) for t in node.inputs if constant(t) is not None and constant(t).size == 1), None)
            if scalar is not None:
                scaling *= as_float(scalar)
            tensor = next(t for t in node.inputs if constant(t) is None)
        elif node.op in ("Unsqueeze", "Cast", "Identity", "Transpose", "Gather", "Slice", "Expand", "Reshape"):
            tensor = node.inputs[0]
        else:
            return SkipReason(f"rotary: cos table comes from {node.op}, not Cos")
        node = producer(tensor)
    if node is None:
        return SkipReason("rotary: cos table is not computed from positions in the graph")
    frontier, seen = [(node.inputs[0], None)], set()
    while frontier:  # breadth-first: the nearest float constant that is not a scalar is inv_freq
        tensor, chooser = frontier.pop(0)
        value = constant(tensor)
        if value is not None and value.size > 1 and value.dtype.kind == "f":
            if chooser is not None:  # e.g. longrope: Where(max(position) + 1 > original, long, short)
                return SkipReason(f"rotary: the frequencies under Cos are chosen at run time by {chooser.op} "
                                  f"'{chooser.name}' (e.g. by sequence length); FlashAttention's tables hold one set")
            return value.reshape(-1).astype(np.float32), scaling
        upstream = producer(tensor)
        if upstream is not None and id(upstream) not in seen:
            seen.add(id(upstream))
            selects = upstream.op in ("Where", "If", "Loop", "Scan")
            frontier.extend((t, upstream if selects else chooser) for t in upstream.inputs)
    return SkipReason("rotary: no inv_freq constant under Cos")


def unique_name(name: str, taken: set[str]) -> str:
    """name, or name_1, name_2...: the first not in taken (which it joins). ONNX refuses two nodes of one name."""
    candidate, index = name, 1
    while candidate in taken:
        candidate, index = f"{name}_{index}", index + 1
    taken.add(candidate)
    return candidate


def rotary_table_constants(graph: gs.Graph, prefix: str, inv_freq: np.ndarray, rows: int, scaling: float,
                           dtype) -> tuple[gs.Tensor, gs.Tensor]:
    """cos/sin caches [rows, D/2] (flash_attention_op.rotary_tables) as graph inputs of the rotated tensor's type:
    float32 constants, each behind a Cast for a float16 / bfloat16 graph (an op's data and caches share one type;
    numpy has no bfloat16 to store them in). onnxruntime folds the Casts when it loads the graph."""
    from passes.flash_attention_op import rotary_tables

    cos, sin = rotary_tables(inv_freq, rows, scaling)
    tables = (gs.Constant(f"{prefix}cos_cache", cos), gs.Constant(f"{prefix}sin_cache", sin))
    if dtype is None or dtype == np.float32:
        return tables
    elem_type = dtype if isinstance(dtype, int) else onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    casts = tuple(graph.layer(op="Cast", inputs=[table], outputs=[f"{table.name}_cast"], attrs={"to": elem_type})[0]
                  for table in tables)
    for cast, table in zip(casts, tables):
        cast.dtype, cast.shape = dtype, list(table.shape)
    return casts
