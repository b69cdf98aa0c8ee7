"""skip_unused_rows: the prefill graph's last layer computes only the rows whose logits it returns.

With `export.prefill_logits: last` the prefill graph returns one row of logits per sequence (its last valid
token), but it selects that row only after the last layer, so the layer's o_proj, norm and MLP run on every
prompt token and all but B of those rows are thrown away. Everything between the last attention and the
selection works row by row, so the selection can move up to the attention's output. The attention itself
keeps every row: it writes every token's keys and values into the cache. llama.cpp does the same in its graphs
(`inp_out_ids`, applied in the last layer).

    before:
    attn ─► MatMul(o) ─► SkipNorm ─► MLP ─► Add ─► t ─► Flatten(axis 2) ─► Gather(rows) ─► final norm ─► lm_head
    residual ─────────────┘                 │           t ─► Shape ─► (computes rows from B and S)

    after:
    attn     ─► Flatten ─► Gather(rows) ─► Unsqueeze ─► MatMul(o) ─► SkipNorm ─► MLP ─► Add ─► t
    residual ─► Flatten ─► Gather(rows) ─► Unsqueeze ─────────────────┘                   │
    t ─► Squeeze(axis 0) ─► final norm ─► lm_head;   residual ─► Shape ─► (rows, from the same B and S)

The selection is what torch.onnx emits for `x[arange(B), last]`: Gather(axis 0) of Flatten(t, axis 2) [B·S, H]
by 1-D flat row indices. The moved nodes ("moved") are the producers of t, walking up, that work row by row and
whose outputs nothing else reads; where that walk stops (the attention's output, the residual stream, which the
attention's input norm also reads), each tensor is selected with the same rows ("frontier"). Selected
tensors are [1, R, X]: a batch of one with R = B rows, so 3-D kernels (MatMulNBits,
SkipSimplifiedLayerNormalization) take them as they are. The Shape nodes that compute the row indices from t
read a frontier tensor instead. Every frontier tensor must have t's batch and sequence dimensions, known and
equal (or be the first output of an attention op whose query has them): a tensor broadcast along the sequence,
such as [B, 1, X], has no per-token rows to select.

Row-wise here: MatMul (a 2-D weight) / MatMulNBits products by a weight that does not depend on the inputs; the
(Skip)(Simplified)LayerNormalization family over the last axis; Split over the last axis; elementwise ops whose
other inputs are constants of known rank <= 1 or rows themselves; reductions over the last axis (keepdims); unary
activations and casts.

Must run after `quantize` (its calibration must see every row of the last layer) and before `dequantize_weights`
(the pipeline refuses it after that); either side of `slice_packed_weights`.
Graphs without such a selection (decode, or prefill with prefill_logits: all) are returned unchanged, with the
reason in the report. Logits and cache are the same as before (onnxruntime tests); only rows nobody reads go.
Report: applied, reason, moved nodes (name, op), frontier tensors, rows before/after, and the weight products'
FLOPs per skipped row (2·K·N summed over the moved products).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes.cleanup import export_like

PRODUCTS = {"MatMul", "MatMulNBits"}  # the row input first, a weight second
NORMS = {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
         "SkipLayerNormalization"}
ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow"}
UNARY = {"QuickGelu", "Sigmoid", "Relu", "Tanh", "Gelu", "FastGelu", "Erf", "Cast", "Neg", "Identity", "Softplus",
         "Sqrt", "Reciprocal"}
REDUCTIONS = {"ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2"}  # kept as rows over the last axis
# Outputs [B, S, ...] of these ops have the batch and sequence of their query input, even where no shape is known.
SEQUENCE_KEEPING = {"GroupQueryAttention", "MultiHeadAttention", "Attention", "FlashAttention"}
SQUEEZE_AXES_AS_INPUT_OPSET = 13
MOVED_FLATTEN = "_moved_0_flatten"  # how the rewrite names the Flatten of its first frontier tensor (rewrite)


@dataclass(frozen=True)
class Options:
    pass


@dataclass
class Match:
    selection: gs.Node  # Gather(Flatten(t), rows)
    flatten: gs.Node
    rows: gs.Tensor
    moved: list[gs.Node]  # in graph order
    frontier: list[gs.Tensor]
    shape_readers: list[gs.Node]  # Shape nodes reading t (they compute the rows)


def is_invariant(tensor: gs.Tensor, memo: dict) -> bool:
    """True when the tensor does not depend on any graph input: a constant, or computed from constants only."""
    if isinstance(tensor, gs.Constant):
        return True
    if tensor.name in memo:
        return memo[tensor.name]
    memo[tensor.name] = False  # guards against cycles while we look
    producer = tensor.inputs[0] if tensor.inputs else None
    result = producer is not None and all(is_invariant(t, memo) for t in producer.inputs if t.name)
    memo[tensor.name] = result
    return result


def last_axis(node: gs.Node, default: int = -1) -> bool:
    """The node's axis is its first input's last: -1, or rank - 1 where the rank is known."""
    axis, rank = node.attrs.get("axis", default), len(node.inputs[0].shape or ())
    return axis == -1 or (rank > 0 and axis == rank - 1)


def row_inputs(node: gs.Node, invariant: dict) -> list[gs.Tensor] | str:
    """The inputs that carry rows, or why the node does not work row by row."""
    present = [t for t in node.inputs if t.name]
    varying = [t for t in present if not is_invariant(t, invariant)]
    if node.op in PRODUCTS:
        if varying != [node.inputs[0]]:
            return "a product whose weight depends on the inputs"
        if node.op == "MatMul" and len(node.inputs[1].shape or ()) != 2:  # [G, K, N] would pair rows with batches
            return "a MatMul whose weight is not known to be 2-D"
        return varying
    if node.op in NORMS:
        if not last_axis(node):
            return f"{node.op} over axis {node.attrs.get('axis')}, not known to be the last"
        allowed = node.inputs[:2] if node.op.startswith("Skip") else node.inputs[:1]
        return varying if all(t in allowed for t in varying) else f"{node.op} with a varying weight or bias"
    if node.op == "Split":
        if not last_axis(node, 0) or varying != [node.inputs[0]]:
            return "a Split not known to be over the last axis, or with varying sizes"
        return varying
    if node.op in ELEMENTWISE:
        constants = [t for t in present if t not in varying]
        if any(t.shape is None or len(t.shape) > 1 for t in constants):
            return f"{node.op} with a constant of rank > 1 or of unknown shape (it could vary along the sequence)"
        return varying
    if node.op in UNARY:
        return varying
    if node.op in REDUCTIONS:
        axes = node.attrs.get("axes")
        if axes is None and len(node.inputs) > 1 and isinstance(node.inputs[1], gs.Constant):
            axes = node.inputs[1].values.tolist()
        rank = len(node.inputs[0].shape or ())
        last = [-1] + ([rank - 1] if rank else [])
        if varying != [node.inputs[0]] or list(np.ravel(axes if axes is not None else [])) not in [[a] for a in last]:
            return f"{node.op} not over the last axis alone"
        if not node.attrs.get("keepdims", 1):
            return f"{node.op} without keepdims"
        return varying
    return f"{node.op} is not known to work row by row"


def find_selection(graph: gs.Graph) -> tuple[gs.Node, gs.Node] | str:
    found, shapeless = [], []
    for node in graph.nodes:
        if node.op != "Gather" or node.attrs.get("axis", 0) not in (0, -2) or not node.inputs[0].inputs:
            continue
        flatten = node.inputs[0].inputs[0]
        if flatten.op != "Flatten" or flatten.attrs.get("axis", 1) not in (2, -1):  # -1 of a 3-D input is 2
            continue
        source = flatten.inputs[0]
        if source.shape is None:  # unknown rank: shape inference could still make it a selection of positions
            shapeless.append((node, flatten))
        elif len(source.shape) == 3:
            found.append((node, flatten))
        # another known rank is no selection of positions (transformers' mask code gathers attention_mask's [B, S])
    if not found and shapeless:
        return (f"{shapeless[0][1].inputs[0].name}, whose rows {shapeless[0][0].name} selects, has no known shape; "
                f"run cleanup (shape inference) before this pass")
    if not found:
        return "no row selection (Gather of Flatten(t, axis 2)): " + _logits_rows(graph)
    if len(found) > 1:
        return f"{len(found)} row selections ({', '.join(n.name for n, _ in found)}); expected one"
    return found[0]


def _logits_rows(graph: gs.Graph) -> str:
    """What the graph returns, said beside "no row selection": one position's logits selected otherwise (dynamo's
    GatherND of the last valid token), or every position's."""
    logits = next((t for t in graph.outputs if t.name == "logits"), graph.outputs[0] if graph.outputs else None)
    shape = logits.shape if logits is not None else None
    if shape is not None and len(shape) == 3 and shape[1] == 1:
        return "the graph returns one position's logits, selected in a way this pass does not read"
    return "the graph returns every position's logits"


def match(graph: gs.Graph) -> Match | str:
    selection = find_selection(graph)
    if isinstance(selection, str):
        return selection
    gather, flatten = selection
    rows, t = gather.inputs[1], flatten.inputs[0]
    if rows.shape is None:
        return f"the selection's row indices {rows.name} have no known shape; run cleanup (shape inference) first"
    if len(rows.shape) != 1:
        return f"the selection's row indices {rows.name} are not 1-D"
    if any(d is None for d in t.shape[:2]):
        return f"{t.name}'s batch and sequence dimensions are unknown; run cleanup (shape inference) first"
    shape_readers = [n for n in t.outputs if n is not flatten]
    flat = flatten.outputs[0]
    if any(n.op != "Shape" for n in shape_readers) or len(flat.outputs) != 1:
        return f"{t.name} is read by more than the selection and Shape nodes"
    if flat.name in {output.name for output in graph.outputs}:  # it would return the selected rows only
        return f"{flat.name}, every row of {t.name}, is a graph output"
    if any(reader.attrs.get("start", 0) != 0 for reader in shape_readers) or not all(
            uses_batch_and_sequence_only(reader) for reader in shape_readers):
        return f"the row indices read more of {t.name}'s shape than its batch and sequence"
    if not t.inputs:
        return f"{t.name} is a graph input: nothing computes it"

    invariant: dict = {}
    graph_outputs = {t.name for t in graph.outputs}
    # Candidates: walk up from t through row-wise nodes.
    candidates, reasons, queue = {}, {}, [t.inputs[0]]
    while queue:
        node = queue.pop()
        if id(node) in candidates or id(node) in reasons:
            continue
        inputs = row_inputs(node, invariant)
        if isinstance(inputs, str):
            reasons[id(node)] = inputs
            continue
        candidates[id(node)] = node
        queue.extend(i.inputs[0] for i in inputs if i.inputs)
    if id(t.inputs[0]) not in candidates:
        return f"{label(t.inputs[0])}, which computes the selected rows: {reasons[id(t.inputs[0])]}"
    # Keep only nodes whose outputs nothing outside reads; dropping one may expose its producers, so repeat.
    allowed_outside = {id(flatten), *map(id, shape_readers)}
    changed = True
    while changed:
        changed = False
        for key, node in list(candidates.items()):
            for output in node.outputs:
                if not output.name:  # an optional output left out: onnx-graphsurgeon may share one empty tensor
                    continue
                outside = any(id(c) not in candidates and id(c) not in allowed_outside for c in output.outputs)
                if outside or output.name in graph_outputs:
                    del candidates[key]
                    changed = True
                    break
    if id(t.inputs[0]) not in candidates:
        return f"{t.name} is also read outside the rows' computation"
    moved = [n for n in graph.nodes if id(n) in candidates]
    produced = {id(o) for n in moved for o in n.outputs}
    frontier = []
    for node in moved:
        for tensor in row_inputs(node, invariant):
            if id(tensor) not in produced and all(tensor is not f for f in frontier):
                frontier.append(tensor)
    for tensor in frontier:
        if not same_rows(tensor, t):
            return (f"{tensor.name} (where the selection would move to) is not known to have {t.name}'s batch and "
                    f"sequence dimensions")
    return Match(gather, flatten, rows, moved, frontier, shape_readers)


def label(node: gs.Node) -> str:
    return f"{node.name} ({node.op})" if node.name else f"the {node.op} computing {node.outputs[0].name}"


def uses_batch_and_sequence_only(shape: gs.Node) -> bool:
    """Every reader of the Shape takes dimension 0 or 1 with a constant Gather index."""
    for reader in shape.outputs[0].outputs:
        index = reader.inputs[1] if reader.op == "Gather" and len(reader.inputs) > 1 else None
        if not isinstance(index, gs.Constant) or not np.all(np.isin(np.asarray(index.values), (0, 1))):
            return False
    return True


def same_rows(tensor: gs.Tensor, t: gs.Tensor) -> bool:
    """True when `tensor` is [B, S, X] with t's B and S: equal known dimensions (an unknown one matches nothing),
    or the first output of an attention op whose query has them."""
    if tensor.shape is not None:
        return len(tensor.shape) == 3 and all(a is not None and a == b for a, b in zip(tensor.shape[:2], t.shape[:2]))
    producer = tensor.inputs[0] if tensor.inputs else None
    return (producer is not None and producer.op in SEQUENCE_KEEPING and tensor is producer.outputs[0]
            and same_rows(producer.inputs[0], t))


def rewrite(graph: gs.Graph, found: Match) -> None:
    zero = gs.Constant(f"{found.selection.name}_axis0", np.array([0], np.int64))
    rows_of = {}
    for index, tensor in enumerate(found.frontier):
        flat = gs.Variable(f"{tensor.name}_flat_rows", dtype=tensor.dtype)
        picked = gs.Variable(f"{tensor.name}_used_rows_2d", dtype=tensor.dtype)
        selected = gs.Variable(f"{tensor.name}_used_rows", dtype=tensor.dtype)
        prefix = f"{found.selection.name}_moved_{index}"
        graph.nodes += [gs.Node("Flatten", f"{prefix}_flatten", {"axis": 2}, [tensor], [flat]),
                        gs.Node("Gather", f"{prefix}_gather", {"axis": 0}, [flat, found.rows], [picked]),
                        gs.Node("Unsqueeze", f"{prefix}_unsqueeze", inputs=[picked, zero], outputs=[selected])]
        rows_of[id(tensor)] = selected
    for node in found.moved:
        for position, tensor in enumerate(node.inputs):
            if id(tensor) in rows_of:
                node.inputs[position] = rows_of[id(tensor)]
        for output in node.outputs:
            if output.name:
                output.shape = None  # now [1, R, ...]: the exported [batch, sequence, ...] no longer holds
    t = found.flatten.inputs[0]
    for reader in found.shape_readers:  # the row indices come from B and S, which the frontier still has
        reader.inputs[0] = found.frontier[0]
    result = found.selection.outputs[0]
    found.selection.outputs.clear()
    graph.nodes.append(gs.Node("Squeeze", f"{found.selection.name}_rows", inputs=[t, zero], outputs=[result]))


def matmul_flops(node: gs.Node) -> int:
    """2·K·N per row for a product by a weight, 0 for other nodes."""
    if node.op == "MatMulNBits":
        return 2 * int(node.attrs["K"]) * int(node.attrs["N"])
    if node.op == "MatMul":
        weight = node.inputs[1]
        while not isinstance(weight, gs.Constant) and weight.inputs and weight.inputs[0].inputs:
            weight = weight.inputs[0].inputs[0]  # e.g. DequantizeLinear(codes); a Constant node ends the walk
        if isinstance(weight, gs.Constant) and len(weight.shape) == 2:
            return 2 * int(np.prod(weight.shape))
    return 0


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    graph = gs.import_onnx(model)
    # graphsurgeon appends to the model's own opset_import list on export: copy it (pure pass)
    graph.import_domains = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]
    nodes_before = len(graph.nodes)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    found = match(graph) if opset >= SQUEEZE_AXES_AS_INPUT_OPSET else (
        f"opset {opset}: the inserted Squeeze/Unsqueeze take their axes as an input from opset "
        f"{SQUEEZE_AXES_AS_INPUT_OPSET}")
    if isinstance(found, str):
        earlier = next((n.name for n in graph.nodes if n.op == "Flatten" and n.name.endswith(MOVED_FLATTEN)), None)
        if earlier:  # its own rewrite: the selection now reads rows a node outside it also reads
            found = f"the unused rows are skipped already ({earlier}: an earlier skip_unused_rows); list it once"
        return model, {"applied": False, "reason": found, "moved": [], "frontier": [],
                       "nodes": {"before": nodes_before, "after": nodes_before}}
    rewrite(graph, found)
    graph.cleanup().toposort()
    result = export_like(graph, model)  # keeps an initializer that is also a graph input (an overridable default)
    return result, {
        "applied": True, "reason": None,
        "moved": [{"node": n.name, "op": n.op} for n in found.moved],
        "frontier": [t.name for t in found.frontier],
        "rows": {"before": "batch x sequence", "after": "batch"},
        "flops_per_skipped_row": sum(matmul_flops(n) for n in found.moved),
        "nodes": {"before": nodes_before, "after": len(result.graph.node)},
    }
