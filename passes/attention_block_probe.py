"""Check, by running it, that each matched attention block computes what `aotlm.FlashAttention` computes.

`fuse_attention` matches a block by its structure: projections, rotary, cache reads, scaled scores, softmax,
weighted sum. Some differences do not show in that structure. The clearest is which kv head a query head reads:
FlashAttention's query head h reads kv head h // (H/KV) (passes/flash_attention_op.py), as Llama's `repeat_kv`
lays the copies out ([kv, rep]); a repeat laid out as [rep, kv] passes through the same Unsqueeze, Expand and
Reshape nodes and maps head h to kv head h % KV. A transpose or slice on the way to the products can change the
meaning the same way.

So the block is evaluated: the part of the graph between the q/k/v projections' outputs and the o projection's
input is cut out (the projections' outputs become inputs) and run with onnxruntime on random q, k and v for a
probe sequence (PROBE_TOKENS tokens at positions 0.., an attention_mask of ones, an empty past; PROBE_BATCH
sequences, or the graph's fixed batch, each with its own random q, k, v and cached rows). Each sequence's output must
equal `flash_attention_op.reference` under the matched heads, scale and rotary, and so must the cache
it writes (rows 0..PROBE_TOKENS-1 of each present buffer hold the rotated keys and the values, the rest stays as it
was): a prefill reads its new keys directly, so a write at other rows shows in the cache only. A block the probe
cannot run (it needs inputs the probe cannot make) is reported as unchecked, and stays unfused.

A block that reads its keys back from the cache (a decode graph) is probed a second time after cached tokens: a
decode step (DECODE_QUERIES new token after PROBE_TOKENS - 1 cached ones, random in the past buffers): with an empty
past the new tokens are the whole context, so a block that reads other rows of the cache than the valid ones (only
the new tokens' rows, rows shifted by one) agrees with the first probe and not with this one.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes import flash_attention_op as op
from passes.attention_mask_probe import cache_length, probe_feed, run_cut
from passes.probe_precision import as_float32, element_type

PROBE_TOKENS = 8  # or the cache length, when it is shorter
TOLERANCE = 1e-3  # of the reference's largest magnitude; a float32 block agrees to ~1e-6
REDUCED_PRECISION_TOLERANCE = 5e-2  # float16 / bfloat16 blocks (bfloat16 rounds the probe's inputs by ~4e-3)
DECODE_QUERIES = 1  # the second probe of a block reading its cache: one new token after the others cached
# Sequences per probe when the graph's batch is not fixed, each with its own values: a block that reads another
# sequence's cache rows (a Slice or Gather on the batch axis) computes the same as FlashAttention on identical ones.
PROBE_BATCH = 2


def check_blocks(graph: gs.Graph, matches: list, cached: bool = False, batch: int | None = None) -> list[str | None]:
    """Per match, in order: None when the block computes FlashAttention's output, a reason when not, or "unchecked: ...".
    cached: the second probe only (DECODE_QUERIES new tokens after cached ones), for blocks that read their cache.
    batch: the probe's sequences where the graph does not fix them (default PROBE_BATCH)."""
    if not matches:
        return []
    tokens = min(PROBE_TOKENS, cache_length(graph) or PROBE_TOKENS)  # a 4-row cache takes 4 probe tokens
    queries = min(DECODE_QUERIES, tokens - 1) if cached else tokens
    if queries < 1:
        return [None] * len(matches)  # a one-row cache holds no token before a new one
    fixed = fixed_batch(graph)
    batch = fixed or batch or PROBE_BATCH
    pasts = _random_pasts(matches, tokens - queries, batch, np.random.default_rng(1)) if cached else {}
    rng = np.random.default_rng(0)
    probe = graph.copy()  # shares the weights; the cleanup keeps only what the blocks need
    tensors = probe.tensors()
    projected, outputs = {}, []

    def cut(tensor: gs.Tensor, width: int) -> None:  # the tensor becomes computed from a float32 probe input
        if tensor.name in projected:
            return
        tensor = tensors[tensor.name]
        tensor.inputs.clear()
        two_d = tensor.shape is not None and len(tensor.shape) == 2
        shape = (batch * queries, width) if two_d else (batch, queries, width)
        fed = gs.Variable(f"{tensor.name}.probe", dtype=np.float32, shape=list(shape))
        # gs.Node, not probe.layer: layer() walks the whole graph per call (seconds over 180 cuts on SmolLM2)
        probe.nodes.append(gs.Node("Cast", inputs=[fed], outputs=[tensor], attrs={"to": element_type(tensor.dtype)}))
        rows = rng.standard_normal((batch, queries, width)).astype(np.float32)  # each sequence its own
        projected[tensor.name] = (fed, rows.reshape(shape), rows)

    for found in matches:
        for tensor in (found.query, found.key, found.value):
            cut(tensor, _width(found, tensor))
        # The projections' input too: the heads' Reshape often reads its shape (Shape(x)), and x would pull in
        # every layer before it; its values are not read once the projections' outputs are cut.
        for activation, width in found.activations:
            cut(activation, width)
        written = [writer.outputs[0] for writer in (found.key_writer, found.value_writer) if writer is not None]
        for output in (tensors[found.attention_output.name], *(tensors[present.name] for present in written)):
            outputs.append(gs.Variable(f"{output.name}.probe", np.float32))
            probe.nodes.append(gs.Node("Cast", inputs=[output], outputs=[outputs[-1]],
                                       attrs={"to": onnx.TensorProto.FLOAT}))
    probe.inputs = [*probe.inputs, *(fed for fed, _, _ in projected.values())]
    probe.outputs = outputs
    fed = {value.name: values for value, values, _ in projected.values()}
    as_float32(probe)  # onnxruntime's CPU kernels lack bfloat16 Mul and Where: the same math in float32

    def feed(value: gs.Variable) -> np.ndarray:
        if value.name in fed:
            return fed[value.name]
        array = probe_feed(value, tokens, queries, batch)
        if value.name in pasts:  # the cached rows, each sequence its own
            array[:, :, :pasts[value.name].shape[2]] = pasts[value.name]
        return array

    values = run_cut(probe, feed)
    if isinstance(values, str) and len(matches) > 1:  # one block the probe cannot run: judge the others alone
        return [check_blocks(graph, [found], cached, batch)[0] for found in matches]
    if isinstance(values, str) and fixed is None and batch > 1:
        # A block that runs one sequence only (the dynamo exporter's ONNX RotaryEmbedding with a batch-1 cos table:
        # onnxruntime wants the table's batch to be x's): probed with one, which cannot show a read of another's
        # rows. Block by block (above), so that one such block leaves the others their probe of PROBE_BATCH.
        return check_blocks(graph, matches, cached, batch=1)
    if isinstance(values, str):
        after = f" after {tokens - queries} cached tokens" if cached else ""
        return [f"unchecked: the block could not be evaluated{after} ({values})"]
    verdicts, values = [], iter(values)
    for found in matches:
        output = next(values)
        presents = [next(values) for writer in (found.key_writer, found.value_writer) if writer is not None]
        sequences = np.asarray(output).reshape(batch, -1)
        verdict = None
        for row in range(batch):  # each sequence must give the reference's output for its own q, k, v and past
            verdict = _judge(found, sequences[row], *(projected[t.name][2][row:row + 1] for t in
                                                      (found.query, found.key, found.value)),
                             reduced_precision=element_type(found.query.dtype) != onnx.TensorProto.FLOAT,
                             presents=[np.asarray(p)[row:row + 1] for p in presents], tokens=tokens,
                             past=tuple(pasts[t.name][row:row + 1] for t in (found.past_key, found.past_value)
                                        if t is not None) if cached else None)
            if verdict is not None:
                if row > 0:  # sequence 0 agreed: this one read another sequence's values (a Slice on the batch axis)
                    verdict += f"; in probe sequence {row} of {batch}, not 0: does it read another sequence's rows?"
                break
        verdicts.append(verdict)
    if not cached:  # the blocks that read their cache, once more after cached tokens
        reading = [index for index, (found, verdict) in enumerate(zip(matches, verdicts))
                   if verdict is None and found.reads_cache]
        for index, verdict in zip(reading, check_blocks(graph, [matches[i] for i in reading], cached=True,
                                                           batch=batch)):
            verdicts[index] = verdict
    return verdicts


def _random_pasts(matches: list, rows: int, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per past buffer the matches read: its first `rows` rows, random, [batch, KV, rows, D] (float32 values)."""
    pasts = {}
    for found in matches:
        for past in (found.past_key, found.past_value):
            if past is not None and past.name not in pasts:
                shape = (batch, found.kv_num_heads, rows, 2 * found.inv_freq.size)
                pasts[past.name] = rng.standard_normal(shape).astype(np.float32)
    return pasts


def fixed_batch(graph: gs.Graph) -> int | None:
    """The batch size input_ids fixes, else None."""
    ids = next((t for t in graph.inputs if t.name == "input_ids"), None)
    size = ids.shape[0] if ids is not None and ids.shape else None
    return size if isinstance(size, int) and size > 0 else None


def _width(found, tensor: gs.Tensor) -> int:
    heads = found.num_heads if tensor is found.query else found.kv_num_heads
    return heads * 2 * found.inv_freq.size


def _judge(found, output: np.ndarray, query: np.ndarray, key: np.ndarray, value: np.ndarray,
           reduced_precision: bool = False, presents: list[np.ndarray] = (), tokens: int = PROBE_TOKENS,
           past: tuple | None = None) -> str | None:
    """past: the cached rows of the key and value buffers (the second probe), None for the first probe's empty past."""
    heads, kv_heads, head_dim = found.num_heads, found.kv_num_heads, 2 * found.inv_freq.size
    tolerance = REDUCED_PRECISION_TOLERANCE if reduced_precision else TOLERANCE
    queries = query.size // (heads * head_dim)
    query, key, value = (x.reshape(1, queries, -1).astype(np.float64) for x in (query, key, value))
    expected, *written = _reference(found, query, key, value, tokens, past)
    cached = f" after {tokens - queries} cached tokens" if past is not None else ""
    for kind, present, reference in zip(("key", "value"), presents, written):
        reason = _judge_cache(kind, np.asarray(present, dtype=np.float64), reference, tolerance, tokens)
        if reason:
            return reason
    output = np.asarray(output, dtype=np.float64)
    if output.size != expected.size:
        return (f"the attention block's output has shape {list(output.shape)} on a {queries}-token probe{cached}, "
                f"not [1, {queries}, {heads * head_dim}]")
    output = output.reshape(expected.shape)
    error = np.abs(output - expected).max() / max(1.0, np.abs(expected).max())
    if error <= tolerance:
        return None
    group = heads // kv_heads
    if group > 1:  # the common other layout: query head h reads kv head h % KV
        order = np.arange(heads).reshape(group, kv_heads).T.reshape(-1)  # new head h' = (h % KV) * group + h // KV
        permuted = query.reshape(1, queries, heads, head_dim)[:, :, order].reshape(query.shape)
        modulo = _reference(found, permuted, key, value, tokens, past)[0].reshape(1, queries, heads, head_dim)
        modulo = modulo[:, :, np.argsort(order)].reshape(expected.shape)
        if np.abs(output - modulo).max() / max(1.0, np.abs(modulo).max()) <= tolerance:
            return (f"query head h reads kv head h % {kv_heads} (kv heads repeated as [rep, kv]); FlashAttention's "
                    f"reads h // {group}")
    return (f"the attention block computes something other than FlashAttention with the matched {heads} heads, "
            f"{kv_heads} kv heads, scale {found.scale:.4g} and rotary (largest difference {error:.2g} on a probe{cached})")


def _reference(found, query: np.ndarray, key: np.ndarray, value: np.ndarray, tokens: int = PROBE_TOKENS,
               past: tuple | None = None):
    kv_heads, head_dim = found.kv_num_heads, 2 * found.inv_freq.size
    cos, sin = op.rotary_tables(found.inv_freq, tokens, found.rotary_scaling)
    buffers = []
    for rows in (past or (None, None)):  # [1, KV, tokens, D]: the cached rows, then zeros
        buffer = np.zeros((1, kv_heads, tokens, head_dim))
        if rows is not None:
            buffer[:, :, :rows.shape[2]] = rows
        buffers.append(buffer)
    return op.reference(query, key, value, *buffers, np.array([tokens - 1]), tokens, cos, sin,
                        found.num_heads, kv_heads, found.scale)


def _judge_cache(kind: str, present: np.ndarray, reference: np.ndarray, tolerance: float,
                 tokens: int = PROBE_TOKENS) -> str | None:
    """The buffer the block wrote ([1, KV, M, D], written over zeros) against the op's rows 0..tokens-1."""
    if present.ndim != 4 or present.shape[:2] != reference.shape[:2] or present.shape[3] != reference.shape[3] \
            or present.shape[2] < tokens:
        return (f"the {kind} cache the block writes has shape {list(present.shape)}, not [1, {reference.shape[1]}, "
                f"max context, {reference.shape[3]}]")
    error = np.abs(present[:, :, :tokens] - reference).max() / max(1.0, np.abs(reference).max())
    if error > tolerance or np.any(present[:, :, tokens:]):
        return (f"the block writes the {kind} cache elsewhere than FlashAttention does (rows 0..{tokens - 1} "
                f"for a {tokens}-token first prompt; largest difference {error:.2g} on a probe)")
    return None
