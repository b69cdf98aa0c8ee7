"""Check, by running it, that an attention block's additive mask is the rule the fused node applies.

`aotlm.FlashAttention` masks causally (query at position p sees keys j <= p) over each sequence's valid length
(passes/flash_attention_op.py). A traced graph's mask subgraph may compute more: a sliding window, a bias
(ALiBi), bidirectional attention. Its structure varies with the exporter, so instead of matching it, the mask is
evaluated: the subgraph that computes it is cut out and run with onnxruntime on a probe sequence (batch 1,
positions 0..L-1, an attention_mask of ones, an empty past), and every query row must be 0 on keys j <= i and
at most -1e4 (or -inf) after. A mask that the probe cannot run (it needs other inputs) is reported as unchecked.

The probe length L is the graph's cache length when fixed (the project's export), else 512: a window longer than
L is not seen.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from passes.probe_precision import as_float32

PROBE_TOKENS = 512  # when the graph's cache length is dynamic
MASKED = -1e4  # at most this on a masked key (exporters use finfo.min or -inf)

TOKEN_INPUTS = ("input_ids", "position_ids", "attention_mask")


def probe_length(graph: gs.Graph) -> int:
    past = next((t for t in graph.inputs if t.name.startswith("past_key_values.")), None)
    fixed = past.shape[2] if past is not None and past.shape and len(past.shape) == 4 else None
    return int(fixed) if isinstance(fixed, int) and fixed > 0 else PROBE_TOKENS


def check_masks(graph: gs.Graph, masks: list[gs.Tensor]) -> dict[str, str | None]:
    """Per mask tensor name: None when it is the causal rule, a reason when not, or "unchecked: ..."."""
    unique = list({mask.name: mask for mask in masks}.values())
    if not unique:
        return {}
    length = probe_length(graph)
    probe = graph.copy()  # shares the weights; the cleanup below keeps only what the masks need
    tensors = probe.tensors()
    probe.outputs = [tensors[mask.name] for mask in unique]
    for output in probe.outputs:
        output.dtype = output.dtype or np.float32
    as_float32(probe)  # onnxruntime's CPU kernels lack bfloat16 Where and Add: the same math in float32
    values = run_cut(probe, lambda value: probe_feed(value, length))
    if isinstance(values, str):
        reason = f"unchecked: the mask could not be evaluated ({values})"
        return {mask.name: reason for mask in unique}
    return {mask.name: _judge(np.asarray(value, dtype=np.float64), length) for mask, value in zip(unique, values)}


def run_cut(probe: gs.Graph, feed) -> list[np.ndarray] | str:
    """Run a graph cut out for a probe (its outputs set; `feed(input) -> array` for each input it keeps) with
    onnxruntime; the outputs' values, or why it could not run (the error's first line: an input the probe cannot
    make, or onnxruntime refusing the cut-out graph)."""
    import onnxruntime as ort  # the passes observe graphs with onnxruntime's kernels, as calibration does

    probe.cleanup(remove_unused_graph_inputs=True)
    try:
        feeds = {value.name: feed(value) for value in probe.inputs}
        model = gs.export_onnx(probe, do_type_check=False)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return session.run([output.name for output in probe.outputs], feeds)
    except Exception as error:  # noqa: BLE001 - any failure means "unchecked", said in the report
        return (str(error).strip().splitlines() or [type(error).__name__])[0][:160]


def probe_feed(value: gs.Variable, length: int) -> np.ndarray:
    """A graph input for a batch-1 probe of `length` tokens at positions 0.., all valid, with an empty past."""
    dtype = np.dtype(value.dtype) if value.dtype is not None else np.dtype(np.int64)
    if value.name == "input_ids":
        return np.zeros((1, length), dtype)
    if value.name == "position_ids":
        return np.arange(length, dtype=dtype)[None]
    if value.name == "attention_mask":
        return np.ones((1, length), dtype)
    if value.name.startswith("past_key_values."):  # an empty past, or the fixed buffer (only its shape is read)
        shape = [dim if isinstance(dim, int) else (1 if axis == 0 else 0) for axis, dim in enumerate(value.shape)]
        return np.zeros(shape, dtype)
    raise ValueError(f"no probe value for input {value.name!r}")


def _judge(mask: np.ndarray, length: int) -> str | None:
    if mask.size % (length * length) or mask.shape[-1] != length:
        return f"the additive mask has shape {list(mask.shape)} for a {length}-token probe, not [..., {length}, {length}]"
    rows = mask.reshape(-1, length, length)
    visible = np.tril(np.ones((length, length), dtype=bool))
    kept = rows[:, visible]
    if np.any(kept <= MASKED):
        return "the additive mask hides keys at or before the query that a causal mask keeps (e.g. a sliding window)"
    if np.any(np.abs(kept) > 1e-3):
        return "the additive mask adds values on keys a causal mask keeps (a bias, e.g. ALiBi)"
    hidden = rows[:, ~visible]
    if hidden.size and np.any(hidden > MASKED):
        return "the additive mask is not causal: some query sees a later key"
    return None

