"""Check, by running it, that an attention block's additive mask is the rule the fused node applies.

`aotlm.FlashAttention` masks causally (query at position p sees keys j <= p) over each sequence's valid length
(passes/flash_attention_op.py). A traced graph's mask subgraph may compute more: a sliding window, a bias
(ALiBi), bidirectional attention. Its structure varies with the exporter, so instead of matching it, the mask is
evaluated: the subgraph that computes it is cut out and run with onnxruntime on a probe sequence (positions
0..L-1, an attention_mask of ones, an empty past; batch 1, or the graph's fixed batch), and every query row must be
0 on keys j <= i and at most -1e4 (or -inf) after. A mask that the probe cannot run (it needs other inputs) is
reported as unchecked, and its layer stays unfused.

The first probe's length L is the graph's cache length when fixed (the project's export), else the rotary table
length the pass was given (`rotary_cache_length`), else 512, and at most 8192 (an L x L mask of 32768 tokens takes
4 GB): a window of L tokens or more is not seen.

Where the block reads its keys back from a cache of fixed length (a decode graph), a second probe puts queries after
cached tokens: Q = DECODE_QUERIES (3) new tokens after DECODE_CONTEXT - DECODE_QUERIES (5) cached ones, C = 8 keys
in all (fewer in a smaller cache). Query i must see keys j <= C-Q+i: a mask aligned top-left (j <= i, the usual
is_causal mistake) agrees with the first probe, where queries and keys are as many, and not here.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from passes.calibration import cpu_threads
from passes.probe_precision import as_float32

PROBE_TOKENS = 512  # when the graph's cache length is dynamic and no rotary table length is given
MAX_PROBE_TOKENS = 8192
DECODE_CONTEXT, DECODE_QUERIES = 8, 3  # the second probe: 3 new tokens after 5 cached
MASKED = -1e4  # at most this on a masked key (exporters use finfo.min or -inf)

TOKEN_INPUTS = ("input_ids", "position_ids", "attention_mask")
CACHE_WRITERS = ("ScatterElements", "ScatterND", "TensorScatter", "Concat")  # write new keys after the past ones
CACHE_WORDS = ("past", "cache", "key", "value")


def is_cache_input(value: gs.Tensor) -> bool:
    """A past key or value buffer: named as this project's and optimum's exports name them, or, whatever its name,
    a rank-4 float graph input that a cache writer reads (a scatter into the buffer, or a Concat of past and new
    keys). Only the name was read, and a cache named past.0.key was probed as 512 tokens (the mask then "had the
    wrong shape") or not at all ("no probe value")."""
    if value.name.startswith("past_key_values."):
        return True
    try:
        floating = value.dtype is not None and np.dtype(value.dtype).kind == "f"
    except TypeError:  # an element type numpy does not have (bfloat16): onnx's own
        floating = "float" in str(value.dtype).lower()
    rank_4 = value.shape is not None and len(value.shape) == 4
    return floating and rank_4 and any(node.op in CACHE_WRITERS for node in value.outputs)


def cache_length(graph: gs.Graph) -> int | None:
    # the conventional names first, then a cache's words in the name: another rank-4 float input concatenated in the
    # graph (prefix embeddings, say) is no cache
    candidates = [t for t in graph.inputs if is_cache_input(t)]
    ranked = sorted(candidates, key=lambda t: (not t.name.startswith("past_key_values."),
                                               not any(word in t.name.lower() for word in CACHE_WORDS)))
    past = ranked[0] if ranked else None
    fixed = past.shape[2] if past is not None and past.shape and len(past.shape) == 4 else None
    return int(fixed) if isinstance(fixed, int) and fixed > 0 else None


def probe_length(graph: gs.Graph, rotary_rows: int | None = None) -> int:
    return min(cache_length(graph) or rotary_rows or PROBE_TOKENS, MAX_PROBE_TOKENS)


def check_masks(graph: gs.Graph, masks: list[gs.Tensor], reading_cache: list[gs.Tensor] = (),
                length: int | None = None) -> dict[str, str | None]:
    """Per mask tensor name: None when it is the causal rule, a reason when not, or "unchecked: ...".
    reading_cache: the masks of blocks that read their keys from the cache, also probed with queries after
    cached tokens. length: the rotary table length, the probe's when the graph's cache length is not fixed."""
    unique = list({mask.name: mask for mask in masks}.values())
    if not unique:
        return {}
    length = probe_length(graph, length)
    verdicts = _evaluate(graph, unique, lambda value: probe_feed(value, length), lambda mask: _judge(mask, length))
    decode = [mask for mask in {mask.name: mask for mask in reading_cache}.values() if verdicts[mask.name] is None]
    context = min(DECODE_CONTEXT, cache_length(graph) or 0)  # a smaller cache: fewer cached tokens, still 1 or more
    if decode and context >= 2:
        queries = min(DECODE_QUERIES, context - 1)
        later = _evaluate(graph, decode, lambda value: probe_feed(value, context, queries),
                          lambda mask: _judge(mask, context, queries))
        verdicts.update(later)
    return verdicts


def _evaluate(graph: gs.Graph, masks: list[gs.Tensor], feed, judge) -> dict[str, str | None]:
    probe = graph.copy()  # shares the weights; the cleanup below keeps only what the masks need
    tensors = probe.tensors()
    probe.outputs = [tensors[mask.name] for mask in masks]
    for output in probe.outputs:
        output.dtype = output.dtype or np.float32
    as_float32(probe)  # onnxruntime's CPU kernels lack bfloat16 Where and Add: the same math in float32
    values = run_cut(probe, feed)
    if isinstance(values, str) and len(masks) > 1:  # one mask the probe cannot run: judge the others alone
        return {name: verdict for mask in masks for name, verdict in _evaluate(graph, [mask], feed, judge).items()}
    if isinstance(values, str):
        return {masks[0].name: f"unchecked: the mask could not be evaluated ({values})"}
    return {mask.name: judge(np.asarray(value, dtype=np.float64)) for mask, value in zip(masks, values)}


def run_cut(probe: gs.Graph, feed) -> list[np.ndarray] | str:
    """Run a graph cut out for a probe (its outputs set; `feed(input) -> array` for each input it keeps) with
    onnxruntime; the outputs' values, or why it could not run (the error's first line: an input the probe cannot
    make, or onnxruntime refusing the cut-out graph)."""
    runs = run_cut_many(probe, [feed])
    return runs if isinstance(runs, str) else runs[0]


def run_cut_many(probe: gs.Graph, feeds: list) -> list[list[np.ndarray]] | str:
    """run_cut for several feeds, one session: per feed, the outputs' values; or why it could not run."""
    import onnxruntime as ort  # the passes observe graphs with onnxruntime's kernels, as calibration does

    probe.cleanup(remove_unused_graph_inputs=True)
    try:
        model = gs.export_onnx(probe, do_type_check=False)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = cpu_threads()
        # values are judged within a tolerance, not fusions: the full optimizer's time grew faster than a deep graph
        # (a 128-layer probe's session 0.9-1.1 s, 0.33-0.42 s without it)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        names = [output.name for output in probe.outputs]
        return [session.run(names, {value.name: feed(value) for value in probe.inputs}) for feed in feeds]
    except Exception as error:  # noqa: BLE001 - any failure means "unchecked", said in the report
        line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        # onnxruntime's reason comes last, after a C++ signature ("Model::Model(onnx::ModelProto&&, ...) Unsupported
        # model IR version: 12, ..."): the first 160 characters had kept the signature and lost the reason
        return line if len(line) <= 160 else "..." + line[-157:]


def probe_feed(value: gs.Variable, length: int, queries: int | None = None, batch: int = 1) -> np.ndarray:
    """A graph input for a probe of `length` valid tokens whose last `queries` (all by default) are new, at
    positions 0..; `batch` sequences, or the input's own batch when fixed. The past buffer holds zeros (only its shape
    is read)."""
    dtype = np.dtype(value.dtype) if value.dtype is not None else np.dtype(np.int64)
    batch = value.shape[0] if value.shape and isinstance(value.shape[0], int) and value.shape[0] > 0 else batch
    queries = length if queries is None else queries
    if value.name == "input_ids":
        return np.zeros((batch, queries), dtype)
    if value.name == "position_ids":
        return np.repeat(np.arange(length - queries, length, dtype=dtype)[None], batch, axis=0)
    if value.name == "attention_mask":
        return np.ones((batch, length), dtype)
    if is_cache_input(value):  # an empty past, or the fixed buffer (only its shape is read)
        shape = [dim if isinstance(dim, int) else (batch if axis == 0 else 0) for axis, dim in enumerate(value.shape)]
        return np.zeros(shape, dtype)
    raise ValueError(f"no probe value for input {value.name!r}")


def _judge(mask: np.ndarray, length: int, queries: int | None = None) -> str | None:
    """The mask of `queries` new tokens (all `length` by default) at positions length-queries.. against the causal
    rule; a key axis wider than `length` (the whole cache buffer) holds keys no query may see."""
    queries = length if queries is None else queries
    if mask.ndim < 2 or mask.shape[-2] != queries or mask.shape[-1] < length:
        return (f"the additive mask has shape {list(mask.shape)} for a probe of {queries} queries over {length} "
                f"keys, not [..., {queries}, {length}]")
    keys = mask.shape[-1]
    rows = mask.reshape(-1, queries, keys)
    position = np.arange(length - queries, length)[:, None]
    visible = np.arange(keys)[None, :] <= position
    kept = rows[:, visible]
    if np.any(kept <= MASKED) and queries < length:
        return (f"the additive mask hides keys at or before the query for queries after cached tokens ({length - queries} "
                f"cached, {queries} new): aligned top-left, as is_causal does, or a sliding window")
    if np.any(kept <= MASKED):
        return "the additive mask hides keys at or before the query that a causal mask keeps (e.g. a sliding window)"
    if np.any(np.abs(kept) > 1e-3):
        return "the additive mask adds values on keys a causal mask keeps (a bias, e.g. ALiBi)"
    hidden = rows[:, ~visible]
    if hidden.size and np.any(hidden > MASKED):
        if queries < length:
            return (f"the additive mask is not causal for queries after cached tokens: with {length - queries} "
                    f"cached and {queries} new, some query sees a later key")
        return "the additive mask is not causal: some query sees a later key"
    return None

