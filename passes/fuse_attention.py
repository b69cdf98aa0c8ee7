"""Fuse each traced attention block into one `aotlm.FlashAttention` node (meaning: passes/flash_attention_op.py).

Anchored on each Softmax; the pattern, as traced from the canonical decoder or from Hugging Face's Llama:

    x -> q_proj -> Reshape -> Transpose -> rotary ------------------------------.
    x -> k_proj -> Reshape -> Transpose -> rotary -> [ScatterElements(past_key)] -> [Slice] -> (Unsqueeze|Expand|
                                                     Reshape|Transpose)* -> MatMul(q, kT) -> Mul(scale) -> Add(mask)
    x -> v_proj -> Reshape -> Transpose -> [ScatterElements(past_value)] -> [Slice] -> (...)*       -> Softmax
                                                                 MatMul(probs, v) <-------------------'
                                                                 -> (Transpose|Reshape)* -> [Mul(s)] -> o_proj
    rotary(t) = t * cos + Concat(-t[..., D/2:], t[..., :D/2]) * sin,  cos = Cos(positions * inv_freq) [* scaling]

The fused node reads the three projections' outputs and the cache buffers, applies rotary itself from
cos/sin tables built from the graph's inv_freq, writes the caches in place and feeds o_proj (or the Mul of AWQ's
per-channel input scales before it, where quantize ran before fusion). The mask subgraph,
the scatter writes and the rotary math become dead and are removed. `match` returns a Match or a SkipReason,
so every attention that is not fused says which check failed, per layer, in the report. Two checks run what
the structure cannot show: each additive mask on a long probe (passes/attention_mask_probe.py: a window or a
bias stays unfused) and each matched block on random q/k/v against the op's reference
(passes/attention_block_probe.py: e.g. query heads that read other kv heads than h // (H/KV) stay unfused).
The graph walkers and the rotary parser, shared with fuse_rotary, are in passes/graph_patterns.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes import flash_attention_op as op
from passes.attention_block_probe import check_blocks
from passes.attention_mask_probe import check_masks
from passes.errors import PassError
from passes.graph_export import export_onnx
from passes.graph_patterns import (SkipReason, as_float, constant, layer_name, numbered, parse_inv_freq,
                                    parse_rotary_terms, producer, rotary_table_constants, scalar_factor,
                                    scaled_operand, walk_up, walk_up_scaled, weight_shape)
from passes.rotary_probe import check_tables

# Nodes that hold a whole attention: fuse_attention's own and the lowerings' (a graph fused already)
ALREADY_FUSED_OPS = (op.OP_TYPE, "GroupQueryAttention", "Attention")

THROUGH_CACHE_READ = {"Transpose", "Unsqueeze", "Reshape", "Expand", "Slice", "Identity", "Cast"}
THROUGH_HEAD_SPLIT = {"Transpose", "Reshape", "Identity"}


@dataclass(frozen=True)
class Options:
    required: bool = False  # fail the build when any attention stays unfused
    max_rewrites: int | None = None  # fuse only the first N (bisect a parity failure)
    # rotary table rows; default: the cache's max context, the only value a recipe takes (export.max_context); other
    # values are for graphs without a KV cache, through the pass's API
    rotary_cache_length: int | None = None


@dataclass
class Match:
    layer: str
    query: gs.Tensor
    key: gs.Tensor
    value: gs.Tensor
    past_key: gs.Tensor | None
    past_value: gs.Tensor | None
    key_writer: gs.Node | None  # the ScatterElements that wrote present_key (disconnected on rewrite)
    value_writer: gs.Node | None
    o_proj: gs.Node
    mask: gs.Tensor | None  # the additive mask, checked by running it (passes/attention_mask_probe.py)
    num_heads: int
    kv_num_heads: int
    scale: float
    inv_freq: np.ndarray
    rotary_scaling: float
    activations: tuple = ()  # per q, k, v projection: (its input x, K of x @ W), for the block probe
    reads_cache: bool = False  # the scores read the keys back from the written cache (a decode graph)
    tables: tuple = ()  # per rotated q and k: its (cos, sin) tensors, checked over the probe length
    # The node that reads the heads' merged output, and which of its inputs: o_proj, or AWQ's per-channel Mul before
    # it (input scales that fold into no producer when quantize runs before fusion), which then reads the fused output
    output_reader: tuple[gs.Node, int] | None = None

    @property
    def attention_output(self) -> gs.Tensor:
        node, index = self.output_reader or (self.o_proj, 0)
        return node.inputs[index]


def _scores(softmax: gs.Node) -> tuple[gs.Node, float, gs.Tensor | None] | SkipReason:
    """Softmax input back to MatMul(q, kT): through Add(mask) and Mul/Div by a scalar; returns (MatMul, scale, mask)."""
    tensor, scale, mask, added = softmax.inputs[0], 1.0, None, None
    for _ in range(4):
        node = producer(tensor)
        if node is None:
            break
        if node.op == "MatMul":
            return node, scale, mask
        if node.op in ("Mul", "Div"):
            values = [constant(t) for t in node.inputs]
            scalar = next((v for v in values if v is not None and v.size == 1), None)
            if scalar is None:
                return SkipReason(f"{node.op} before Softmax is not a scaling by a constant")
            scale = scale * as_float(scalar) if node.op == "Mul" else scale / as_float(scalar)
            tensor = node.inputs[0] if values[0] is None else node.inputs[1]
        elif node.op == "Add":  # the mask: continue along the operand that leads to the scores
            if added is not None:  # a second additive term (a window mask added after the causal one, a bias): the
                # mask probe runs one mask only, and the fused node would drop the other unseen
                return SkipReason(f"the scores get two additive masks or biases before Softmax ('{node.name}' and "
                                  f"'{added.name}'); FlashAttention applies one causal mask, and the probe checks one")
            added = node
            tensor = next((t for t in node.inputs if producer(t) is not None and producer(t).op in ("Mul", "Div", "MatMul")),
                          node.inputs[0])
            mask = next(t for t in node.inputs if t is not tensor)
        elif node.op in ("Cast", "Identity"):
            tensor = node.inputs[0]
        else:
            break
    return SkipReason("Softmax input does not come from MatMul(q, kT) through scale and mask")


def _value_matmul(softmax: gs.Node, graph_outputs: set[str]) -> gs.Node | SkipReason:
    tensor = softmax.outputs[0]
    while True:
        if tensor.name in graph_outputs:  # the fused node would not produce it: the unfused attention would stay
            return SkipReason(f"the attention probabilities '{tensor.name}' are a graph output")
        consumers = tensor.outputs
        guard = _nan_guard(tensor)
        if guard is not None:  # Where(IsNaN(p), 0, p): zero rows whose keys are all masked (torch's SDPA export)
            tensor = guard.outputs[0]
            continue
        if len(consumers) != 1:
            return SkipReason(f"Softmax output has {len(consumers)} consumers, expected the value MatMul only")
        if consumers[0].op in ("Cast", "Identity", "Dropout"):
            tensor = consumers[0].outputs[0]
            continue
        if consumers[0].op != "MatMul" or consumers[0].inputs[0] is not tensor:
            return SkipReason(f"Softmax output feeds {consumers[0].op} '{consumers[0].name}', not the value MatMul")
        return consumers[0]


def _nan_guard(probabilities: gs.Tensor) -> gs.Node | None:
    """The Where of Where(IsNaN(p), 0, p) when that is all that reads p."""
    readers = {node.op: node for node in probabilities.outputs}
    if len(probabilities.outputs) != 2 or set(readers) != {"IsNaN", "Where"}:
        return None
    where, isnan = readers["Where"], readers["IsNaN"]
    zero = constant(where.inputs[1])
    if where.inputs[0] is not isnan.outputs[0] or where.inputs[2] is not probabilities or zero is None or zero.size != 1 \
            or as_float(zero) != 0.0:
        return None
    return where


def _o_proj(value_matmul: gs.Node) -> tuple[gs.Node, gs.Node, int] | SkipReason:
    """(o_proj, the node reading the heads' merged output, which input) from the weighted sum's MatMul."""
    tensor = value_matmul.outputs[0]
    for _ in range(6):
        if not tensor.outputs:  # a graph output, or nothing
            break
        if len(tensor.outputs) != 1:
            readers = ", ".join(f"{node.op} '{node.name}'" for node in tensor.outputs[:3])
            hint = ("; TorchScript's export of SDPA attention reads the output's shape this way: export with "
                    "attn_implementation='eager' or with the dynamo exporter (torch.onnx.export(..., dynamo=True))"
                    if any(node.op == "Shape" for node in tensor.outputs) else "")
            return SkipReason(f"the attention output '{tensor.name}' has {len(tensor.outputs)} readers ({readers}) on "
                              f"the way to the output projection, which FlashAttention's output alone would feed{hint}")
        node = tensor.outputs[0]
        if weight_shape(node) is not None:
            return node, node, node.inputs.index(tensor)
        scaled = _channel_scales_before(node, tensor)
        if scaled is not None:
            return scaled, node, node.inputs.index(tensor)
        if node.op not in THROUGH_HEAD_SPLIT:
            break
        tensor = node.outputs[0]
    return SkipReason("attention output does not reach an output projection (MatMul by a weight)")


def _channel_scales_before(node: gs.Node, tensor: gs.Tensor) -> gs.Node | None:
    """The o_proj MatMul when `node` multiplies `tensor` (the heads merged, [.., K]) by constant per-channel scales and
    feeds only it: AWQ's input scales where quantize ran before fusion and they folded into no producer."""
    if node.op != "Mul" or len(node.inputs) != 2 or len(node.outputs[0].outputs) != 1:
        return None
    scales = constant(node.inputs[1 - node.inputs.index(tensor)])
    o_proj = node.outputs[0].outputs[0]
    shape = weight_shape(o_proj)
    if scales is None or shape is None or scales.size != shape[0] or scales.shape[-1] != shape[0]:
        return None
    return o_proj


def _projection(tensor: gs.Tensor) -> tuple[gs.Tensor, int, tuple[gs.Tensor, int]] | SkipReason:
    """From a [B, heads, S, D] tensor up to the projection output [B, S, heads*D]; returns it, its width and the
    projection's input with its width (the activation x and K of x @ W)."""
    tensor, node = walk_up(tensor, THROUGH_HEAD_SPLIT)
    if node is not None and node.op == "Add" and any(constant(t) is not None for t in node.inputs):
        matmul = next((producer(t) for t in node.inputs if producer(t) is not None), None)  # q/k/v bias (Qwen2)
    else:
        matmul = node
    shape = weight_shape(matmul)
    if shape is None:
        return SkipReason(f"no projection MatMul with a constant weight above '{tensor.name}'")
    return tensor, shape[1], (matmul.inputs[0], shape[0])


def _cache_write(tensor: gs.Tensor) -> tuple[gs.Tensor, gs.Node | None, gs.Tensor | None, float, bool] | SkipReason:
    """Up from the attention's K or V operand to the new keys/values; returns (new, cache writer, past buffer,
    the product of the constant scalings passed on the way, whether the operand reads the written cache).

    Decode reads the cache after ScatterElements wrote it; prefill reads the new keys directly while a
    ScatterElements beside the attention writes them: look for the writer among the consumers on the way up.
    """
    chain, factor = [tensor], 1.0
    node = producer(tensor)
    while node is not None and (node.op in THROUGH_CACHE_READ | {"ScatterElements"} or scalar_factor(node) is not None):
        if node.op in ("Mul", "Div"):
            factor *= scalar_factor(node)
            tensor = scaled_operand(node)
        else:
            tensor = node.inputs[2] if node.op == "ScatterElements" else node.inputs[0]
        chain.append(tensor)
        node = producer(tensor)
    if node is not None and node.op == "ScatterND":
        return SkipReason(f"the cache is written by ScatterND '{node.name}' (torch.export's index_copy_, a StaticCache); "
                          f"FlashAttention's pattern writes it with ScatterElements along the sequence axis, as "
                          f"aotlm's export and TorchScript's trace of a StaticCache spell it")
    if node is not None and node.op == "Concat" and any(not t.inputs and not isinstance(t, gs.Constant)
                                                        for t in node.inputs):
        return SkipReason(f"the cache grows by Concat(past, new) at '{node.name}' (a dynamic cache); FlashAttention "
                          f"writes a preallocated cache in place (ScatterElements into a fixed-size past buffer, as "
                          f"aotlm's export traces it)")
    writers = [n for t in chain for n in t.outputs if n.op == "ScatterElements" and n.inputs[2] is t]
    if not writers:
        return chain[-1], None, None, factor, False
    writer = writers[0]
    if producer(writer.inputs[0]) is not None:
        return SkipReason(f"cache write '{writer.name}' does not update a graph input buffer")
    reduction = writer.attrs.get("reduction", "none")
    if reduction != "none":  # the probes' buffers hold zeros at the new rows, where "add" writes what "none" does
        return SkipReason(f"cache write '{writer.name}' has reduction='{reduction}': it combines the new keys or values "
                          f"with what the buffer held; FlashAttention overwrites the rows (reduction='none')")
    return chain[-1], writer, writer.inputs[0], factor, any(t is writer.outputs[0] for t in chain)


def match(softmax: gs.Node, graph_outputs: set[str] = frozenset()) -> Match | SkipReason:
    scores = _scores(softmax)
    if isinstance(scores, SkipReason):
        return scores
    qk, scale, mask = scores
    pv = _value_matmul(softmax, graph_outputs)
    if isinstance(pv, SkipReason):
        return pv
    found_o_proj = _o_proj(pv)
    if isinstance(found_o_proj, SkipReason):
        return found_o_proj
    o_proj, reader, reader_input = found_o_proj
    q_rotated, q_factor = walk_up_scaled(qk.inputs[0], THROUGH_CACHE_READ)
    key = _cache_write(qk.inputs[1])
    value = _cache_write(pv.inputs[1])
    for found in (key, value):
        if isinstance(found, SkipReason):
            return found
    (k_new, key_writer, past_key, k_factor, reads_cache), (v_new, value_writer, past_value, v_factor, _) = key, value
    if v_factor != 1.0:
        return SkipReason(f"the values are scaled by {v_factor:g} before the weighted sum")
    scale *= q_factor * k_factor  # scores = (a q) . (b k) = a b (q . k)
    if (past_key is None) != (past_value is None):
        return SkipReason("only one of the key and value caches is written")
    parts = [parse_rotary_terms(q_rotated), parse_rotary_terms(k_new)]
    for part in parts:
        if isinstance(part, SkipReason):
            return part
    (q_heads, cos, q_sin), (k_heads, k_cos, k_sin) = parts
    tables = [(cos, q_sin), (k_cos, k_sin)]
    rotary = parse_inv_freq(cos)
    if isinstance(rotary, SkipReason):
        return rotary
    inv_freq, scaling = rotary
    projections = [_projection(q_heads), _projection(k_heads), _projection(v_new)]
    for projection in projections:
        if isinstance(projection, SkipReason):
            return projection
    (query, q_width, _), (key_tensor, k_width, _), (value_tensor, v_width, _) = projections
    head_dim = 2 * inv_freq.size
    if q_width % head_dim or k_width % head_dim or k_width != v_width:
        return SkipReason(f"projection widths q={q_width} k={k_width} v={v_width} do not fit head_dim {head_dim}")
    return Match(layer_name(o_proj), query, key_tensor, value_tensor, past_key, past_value, key_writer, value_writer,
                 o_proj, mask, q_width // head_dim, k_width // head_dim, scale, inv_freq, scaling,
                 tuple(projection[2] for projection in projections), reads_cache, tuple(tables), (reader, reader_input))


class SharedInputs:
    """Per-graph tensors every fused node reads: sequence lengths from attention_mask, rotary tables."""

    def __init__(self, graph: gs.Graph, table_rows: int | None):
        self.graph, self.table_rows = graph, table_rows
        self.tables: dict[tuple, tuple[gs.Constant, gs.Constant]] = {}
        self._lengths: tuple[gs.Variable, gs.Variable] | None = None

    def lengths(self) -> tuple[gs.Variable, gs.Variable]:
        if self._lengths is None:
            mask = next((t for t in self.graph.inputs if t.name == "attention_mask"), None)
            if mask is None:
                raise PassError("the graph has no attention_mask input to derive per-sequence lengths from")
            one = gs.Constant("fa_one", np.array(1, dtype=np.int64))
            valid = self.graph.layer(op="ReduceSum", inputs=[mask, gs.Constant("fa_axis1", np.array([1], np.int64))],
                                     outputs=["fa_valid_tokens"], attrs={"keepdims": 0})[0]
            last = self.graph.layer(op="Sub", inputs=[valid, one], outputs=["fa_last_index"])[0]
            seqlens = self.graph.layer(op="Cast", inputs=[last], outputs=["fa_seqlens_k"], attrs={"to": onnx.TensorProto.INT32})[0]
            width = self.graph.layer(op="Shape", inputs=[mask], outputs=["fa_mask_shape"])[0]
            total = self.graph.layer(op="Gather", inputs=[width, one], outputs=["fa_total_length64"], attrs={"axis": 0})[0]
            total = self.graph.layer(op="Cast", inputs=[total], outputs=["fa_total_sequence_length"],
                                     attrs={"to": onnx.TensorProto.INT32})[0]
            seqlens.dtype, total.dtype = np.int32, np.int32
            self._lengths = (seqlens, total)
        return self._lengths

    def rotary(self, match: Match) -> tuple[gs.Constant, gs.Constant]:
        rows = self.table_rows or (match.past_key.shape[2] if match.past_key is not None else None)
        if not isinstance(rows, int):
            raise PassError("no rotary table length: the graph has no KV cache; give rotary_cache_length in the "
                            "pass's options")
        dtype = match.query.dtype
        key = (match.inv_freq.tobytes(), match.rotary_scaling, rows, str(dtype))
        if key not in self.tables:  # float16 / bfloat16 graphs: the op's inputs share a type
            self.tables[key] = rotary_table_constants(self.graph, f"fa_{len(self.tables)}_", match.inv_freq, rows,
                                                      match.rotary_scaling, dtype)
        return self.tables[key]


def rewrite(graph: gs.Graph, match: Match, shared: SharedInputs) -> None:
    seqlens, total = shared.lengths()
    cos, sin = shared.rotary(match)
    presents = []
    for writer in (match.key_writer, match.value_writer):
        presents.append(writer.outputs[0] if writer is not None else gs.Variable.empty())
        if writer is not None:
            writer.outputs.clear()  # the fused node writes the cache now
    output = gs.Variable(f"{match.layer}.attention_output", dtype=match.query.dtype)
    past_key = match.past_key if match.past_key is not None else gs.Variable.empty()
    past_value = match.past_value if match.past_value is not None else gs.Variable.empty()
    graph.nodes.append(gs.Node(
        op=op.OP_TYPE, domain=op.DOMAIN, name=f"{match.layer}.FlashAttention",
        attrs={"num_heads": match.num_heads, "kv_num_heads": match.kv_num_heads, "scale": float(match.scale),
               "do_rotary": 1, "rotary_interleaved": 0},
        inputs=[match.query, match.key, match.value, past_key, past_value, seqlens, total, cos, sin],
        outputs=[output, *presents],
    ))
    reader, index = match.output_reader
    reader.inputs[index] = output


def _shared_writers(matches: list[Match]) -> list[str | None]:
    """Per match: a reason when one of its cache writers is another match's too, else None."""
    owners: dict[int, list[str]] = {}
    for found in matches:
        for writer in (found.key_writer, found.value_writer):
            if writer is not None:
                owners.setdefault(id(writer), []).append(found.layer)
    verdicts = []
    for found in matches:
        shared = next((writer for writer in (found.key_writer, found.value_writer)
                       if writer is not None and len(owners[id(writer)]) > 1), None)
        verdicts.append(None if shared is None else
                        f"the cache write '{shared.name}' is matched by {', '.join(owners[id(shared)])}: a block reads "
                        f"keys or values from another layer's cache, which FlashAttention cannot share")
    return verdicts


def _keep_checked(matches: list[Match], layers: list[dict], verdicts: list[str | None]) -> list[Match]:
    """The matches whose probe verdict is None; the others' layers become unfused, the verdict their reason (an
    "unchecked: ..." one too: a block the probe could not run may compute anything, e.g. a sliding window in a
    graph of fixed batch 2). `layers` lists the fused ones in the matches' order."""
    kept = []
    for found, layer, verdict in zip(matches, [layer for layer in layers if layer["fused"]], verdicts, strict=True):
        if verdict is None:
            kept.append(found)
        else:
            layer.clear()
            layer.update({"layer": found.layer, "fused": False, "reason": verdict})
    return kept


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    graph = gs.import_onnx(model)
    # graphsurgeon keeps the model's own opset_import list and appends to it on export: copy it (pure pass).
    graph.import_domains = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]
    nodes_before = len(graph.nodes)
    layers, matches = [], []
    for index, softmax in enumerate([n for n in graph.nodes if n.op == "Softmax"]):
        found = match(softmax, {t.name for t in graph.outputs})
        if isinstance(found, SkipReason):
            layers.append({"layer": numbered(layer_name(softmax), index), "node": softmax.name, "fused": False,
                           "reason": str(found)})
            continue
        found.layer = numbered(found.layer, index)  # it names the fused node and its output: must be unique
        if options.max_rewrites is not None and len(matches) >= options.max_rewrites:
            layers.append({"layer": found.layer, "fused": False, "reason": f"max_rewrites={options.max_rewrites}"})
        else:
            matches.append(found)
            layers.append({"layer": found.layer, "fused": True, "num_heads": found.num_heads,
                           "kv_num_heads": found.kv_num_heads, "cache": found.past_key is not None})
    for index, node in enumerate([n for n in graph.nodes if n.op == "Attention" and n.domain in ("", None, "ai.onnx")],
                                 start=len(layers)):
        layers.append({"layer": numbered(layer_name(node), index), "node": node.name, "fused": False,
                       "reason": f"'{node.name}' is an ONNX Attention op (torch's SDPA exported at opset 23): "
                                 f"fuse_attention matches attention spelled out as MatMul, Softmax, MatMul; export "
                                 f"with attn_implementation='eager' or a lower opset"})
    # Each fused node takes over its cache writers: a writer two blocks matched (one block reads the keys or values
    # another layer's cache holds) would be claimed twice, and the block would read another layer's rows.
    matches = _keep_checked(matches, layers, _shared_writers(matches))
    # The fused node masks causally: a mask that computes more (a window, a bias) keeps its layer unfused; then
    # each remaining block must compute the node's output on a probe (which kv head each query head reads, ...).
    mask_verdicts = check_masks(graph, [found.mask for found in matches if found.mask is not None],
                                reading_cache=[found.mask for found in matches if found.mask is not None
                                               and found.reads_cache],
                                length=options.rotary_cache_length)
    matches = _keep_checked(matches, layers, [mask_verdicts.get(found.mask.name) if found.mask is not None
                                              else None for found in matches])
    # The block probe runs a few positions; the rotary tables the fused node builds serve every position up to the
    # probe length: the graph's cos and sin must equal them there (a longrope switch at 32 tokens showed past it only)
    table_verdicts = check_tables(graph, [(cos, sin, found.inv_freq, found.rotary_scaling) for found in matches
                                          for cos, sin in found.tables], length=options.rotary_cache_length)
    matches = _keep_checked(matches, layers, [next((v for v in table_verdicts[2 * i:2 * i + 2] if v), None)
                                              for i in range(len(matches))])
    matches = _keep_checked(matches, layers, check_blocks(graph, matches))
    unfused = [layer for layer in layers if not layer["fused"]]
    if options.required and (unfused or not layers):
        fused_before = [n for n in graph.nodes if n.op in ALREADY_FUSED_OPS]
        if not layers and fused_before:  # a graph fused already (fuse_attention listed twice): nothing is unfused
            raise PassError(f"the attention is fused already ({len(fused_before)} {fused_before[0].op} nodes, e.g. "
                            f"{fused_before[0].name}); list fuse_attention once in the recipe")
        first = unfused[0] if unfused else {"layer": "graph", "reason": "no Softmax (attention) found"}
        raise PassError(f"fusion required but {len(unfused) or 1} attention block(s) not fused; "
                        f"first: {first['layer']}: {first['reason']}")
    shared = SharedInputs(graph, options.rotary_cache_length)
    for found in matches:
        rewrite(graph, found, shared)
    graph.cleanup().toposort()
    if matches and not any(o.domain == op.DOMAIN for o in graph.import_domains):
        graph.import_domains.append(onnx.helper.make_opsetid(op.DOMAIN, op.VERSION))
    fused = export_onnx(graph)
    # seqlens_k comes from each attention_mask row's sum, as the runtime right-pads; a graph that also handled left
    # padding (transformers' masks do) gives wrong rows for a left-padded batch once fused: say so.
    padding = "right: each attention_mask row is ones, then zeros (a left-padded row gives wrong outputs)"
    return fused, {"fused": len(matches), "unfused": len(unfused), "layers": layers,
                   **({"padding": padding} if matches else {}),
                   "nodes": {"before": nodes_before, "after": len(fused.graph.node)}}
