"""Store the KV cache in int8: onnxruntime's GroupQueryAttention quantizes what it writes and dequantizes what it reads.

Decode reads every cached key and value of every layer each step; in float32 that is 46 KB per context token for
SmolLM2-135M, as many bytes as its INT4 weights at ~1,900 tokens. An int8 cache reads a quarter of them, and four
times as many tokens (or concurrent sequences) fit in the same memory.

The rewrite, on a graph already lowered by lower_onnxruntime:
- every `past_key_values.*` input and `present.*` output becomes int8 (the runtime allocates the buffers by the
  manifest's `kv_cache.dtype`, still one buffer per layer and kind, still bound once as input and output);
- decode: each GroupQueryAttention node gets `k_quant_type` / `v_quant_type` ("PER_CHANNEL" or "PER_TENSOR"),
  `kv_cache_bit_width` 8 and its `k_scale` / `v_scale` inputs (13th and 14th). The op stores
  code = clip(round(x / scale), -128, 127) per (kv head, channel), keys after rotary, and reads code * scale.
- prefill (no past, `prefill_attention: float`): onnxruntime's quantized-cache path is 4-5x slower than its flash
  kernel over a whole prompt (29.5 against 7.3 ms per layer at 512 tokens, 416 against 78 at 2000, 2 threads:
  benchmarks/kv_cache_attention.py), so the node keeps a float cache of the prompt's length and
  Mul(1/scale)/Round/Clip/Cast/Pad write the same codes into the bound int8 buffer (by the reciprocal, as
  onnxruntime's decode kernel quantizes: see write_codes_after). The prompt's own attention is then exact; decode
  steps (and prefill chunks after a past, which run the decode graph) read the rounded cache.
- The scales come from calibration text: the pass runs its input graph (float cache) on the samples, reads the
  keys and values each layer wrote into `present.*`, and sets scale = headroom * max |x| / 127 per kv head and
  channel (or per layer); the headroom (1.5) keeps values a little beyond the calibration peak from clipping.
  Prefill writes what decode reads, so both phases must use the same scales: the first phase computes them, the
  calibration set's memo hands them to the other.

The report gives each layer's scale range and the cache's relative round-off error on the calibration data,
E(x - x̂)² / E x², for keys and values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto

from passes.calibration import CalibrationSet, CalibrationSpec, sample_outputs
from passes.errors import PassError
from passes.graph_export import export_onnx

GQA = ("com.microsoft", "GroupQueryAttention")
PAST_INPUTS = (3, 4)  # GroupQueryAttention's past_key, past_value
PRESENT_OUTPUTS = (1, 2)
SCALE_INPUT = 12  # k_scale; v_scale follows
QUANT_TYPES = {"per_channel": "PER_CHANNEL", "per_tensor": "PER_TENSOR"}
CODE_MAX = 127


@dataclass(frozen=True)
class Options:
    bits: int = 8  # 8 only: onnxruntime's GroupQueryAttention reads an int8 cache
    granularity: Literal["per_channel", "per_tensor"] = "per_channel"
    # scale = headroom * calibration peak / 127: a value beyond what calibration saw (another prompt's outlier
    # channel) is clipped to ±127 codes, so leave room above the peak, at the price of a coarser step.
    headroom: float = 1.5
    # The prefill graph (no past): "float" attends over the prompt in float with onnxruntime's flash kernel and then
    # writes the int8 codes; "int8" keeps onnxruntime's quantized-cache path there too, 4-5x slower per layer.
    prefill_attention: Literal["float", "int8"] = "float"
    calibration: CalibrationSpec | None = CalibrationSpec(samples=16, length=256)


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    check_options(options)
    graph = gs.import_onnx(model)
    graph.import_domains = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]
    nodes = [n for n in graph.nodes if (n.domain, n.op) == GQA]
    if not nodes:
        raise PassError("no com.microsoft.GroupQueryAttention node: quantize_kv_cache stores onnxruntime's cache, so "
                        "put it after lower_onnxruntime in the recipe (backend onnxruntime)")
    already = [t.name for t in graph.inputs if t.dtype is not None and np.dtype(t.dtype) == np.int8]
    if already:  # after this pass, prefill's attention no longer reads them: say so before looking for them
        raise PassError(f"{already[0]}: the KV cache is already INT8, not float; list quantize_kv_cache once in the "
                        f"recipe")
    for node in nodes:
        check_cache_io(graph, node)
    read = {past.name for node in nodes for past in pasts_of(node)}
    other = [t.name for t in graph.inputs if t.name not in read and t.dtype is not None and t.shape is not None
             and len(t.shape) == 4 and np.dtype(t.dtype).kind == "f"]
    if other:  # a cache half int8, half float matches no one dtype in the manifest, and no runtime buffer
        raise PassError(f"{', '.join(other[:4])}{' ...' if len(other) > 4 else ''}: KV-cache inputs that no "
                        f"GroupQueryAttention reads (a layer lowered otherwise, or left unfused); quantize_kv_cache "
                        f"stores onnxruntime's cache for every layer or none: lower every layer with lower_onnxruntime, "
                        f"or leave quantize_kv_cache out")
    key = ("kv_cache_scales", options.bits, options.granularity, options.headroom)
    memo = options.calibration.memo
    if key not in memo:
        memo[key] = calibrate(model, [past.name for n in nodes for past in pasts_of(n)],
                              [n.outputs[i].name for n in nodes for i in PRESENT_OUTPUTS], options,
                              {pasts_of(n)[0].name: pairs for n in nodes if (pairs := rotary_pairs(n)) is not None})
    scales, errors = memo[key]

    float_prefill = graph.name == "prefill" and options.prefill_attention == "float"
    layers = []
    for node in nodes:
        pasts, presents = pasts_of(node), [node.outputs[i] for i in PRESENT_OUTPUTS]
        missing = [past.name for past in pasts if past.name not in scales]
        if missing:
            raise PassError(f"{node.name}: no calibrated scales for {missing}: the phases' graphs name their caches "
                            f"differently")
        for cache in [*pasts, *presents]:
            cache.dtype = np.int8  # graph inputs and outputs: the buffers the runtime binds
        node_scales = [scales[past.name] for past in pasts]
        if float_prefill:
            write_codes_after(graph, node, node_scales)
        else:
            read_codes(node, node_scales, options)
        layers.append({"layer": node.name, "key_scale": _range(node_scales[0]), "value_scale": _range(node_scales[1]),
                       "key_error": errors[pasts[0].name], "value_error": errors[pasts[1].name]})
    graph.cleanup(remove_unused_graph_inputs=False).toposort()  # prefill's past inputs stay: the I/O contract
    result = export_onnx(graph)
    return result, {
        "quantized_layers": len(nodes), "dtype": "int8", "granularity": options.granularity, "headroom": options.headroom,
        "prefill_attention": options.prefill_attention if graph.name == "prefill" else None,
        "bytes_per_element": {"before": 4, "after": 1},
        "relative_error": {"key_mean": float(np.mean([layer["key_error"] for layer in layers])),
                           "value_mean": float(np.mean([layer["value_error"] for layer in layers]))},
        "calibration": options.calibration.describe(), "layers": layers, "phase_graph": graph.name,
        "nodes": {"before": len(model.graph.node), "after": len(result.graph.node)},
    }


def pasts_of(node: gs.Node) -> list[gs.Variable]:
    return [node.inputs[i] for i in PAST_INPUTS]


def check_cache_io(graph: gs.Graph, node: gs.Node) -> None:
    graph_inputs, graph_outputs = {t.name for t in graph.inputs}, {t.name for t in graph.outputs}
    for past in pasts_of(node):
        if past.name not in graph_inputs:
            raise PassError(f"{node.name}: its past input {past.name!r} is not a graph input (the KV-cache buffer the "
                            f"runtime binds); quantize_kv_cache needs the artifact's cache I/O")
        if np.dtype(past.dtype) != np.float32:  # an int8 one was refused in run(): a second run
            raise PassError(f"{past.name}: the KV cache is {np.dtype(past.dtype).name.upper()}, not float32; "
                            f"quantize_kv_cache calibrates and rounds a float32 cache (export.dtype float32)")
    if len(node.inputs) > SCALE_INPUT:
        raise PassError(f"{node.name}: already has k_scale/v_scale inputs")
    for index in PRESENT_OUTPUTS:
        if node.outputs[index].name not in graph_outputs:
            raise PassError(f"{node.name}: its present output {node.outputs[index].name!r} is not a graph output")


def read_codes(node: gs.Node, scales: list[np.ndarray], options: Options) -> None:
    """The node keeps its cache int8: it quantizes the keys and values it writes and dequantizes what it reads."""
    constants = [gs.Constant(f"{past.name}.kv_scale", scale) for past, scale in zip(pasts_of(node), scales)]
    node.inputs.extend([gs.Variable.empty() for _ in range(SCALE_INPUT - len(node.inputs))] + constants)
    node.attrs.update(k_quant_type=QUANT_TYPES[options.granularity], v_quant_type=QUANT_TYPES[options.granularity],
                      kv_cache_bit_width=options.bits)


def write_codes_after(graph: gs.Graph, node: gs.Node, scales: list[np.ndarray]) -> None:
    """Prefill (no past): the node attends in float over the prompt's own keys and values (onnxruntime's flash
    kernel; its quantized-cache path is 4-5x slower there) and returns them; the nodes after it round them to
    the codes the decode graph reads and pad them to the cache's length, straight into the bound present buffer:

        GroupQueryAttention ─► present_float ─► Mul(1/scale) ─► Round ─► Clip(-128, 127) ─► Cast(int8) ─► Pad ─► present

    Mul by the float32 reciprocal, not Div by the scale: onnxruntime's decode kernel quantizes x * (1/scale), and
    at a half-code boundary the two round to codes one apart (415 of 3200 boundary keys in a review's probe).
    """
    _, kv_heads, max_context, head_dim = cache_shape(pasts_of(node)[0])
    for index in PAST_INPUTS:
        node.inputs[index] = gs.Variable.empty()  # stays a graph input (the artifact's contract), unused here
    prefix = f"{node.name}/int8_cache"
    low = gs.Constant(f"{prefix}/low", np.array(-CODE_MAX - 1, np.float32))
    high = gs.Constant(f"{prefix}/high", np.array(CODE_MAX, np.float32))
    length = gs.Constant(f"{prefix}/length", np.array([max_context], np.int64))
    pads_before = gs.Constant(f"{prefix}/pads_before", np.zeros(6, np.int64))  # Pad's [begin..., end...] of 4 axes
    pads_after = gs.Constant(f"{prefix}/pads_after", np.zeros(1, np.int64))
    for index, scale, kind in zip(PRESENT_OUTPUTS, scales, ("key", "value")):
        present, step = node.outputs[index], f"{prefix}/{kind}"
        exact = gs.Variable(f"{step}_float", dtype=np.float32)  # [batch, kv_heads, prompt, head_dim], keys after rotary
        node.outputs[index] = exact
        broadcast = (1, kv_heads, 1, head_dim) if scale.size > 1 else (1,)
        inverse = gs.Constant(f"{step}_inverse_scale", reciprocal(scale).reshape(broadcast))
        scaled = graph.layer(op="Mul", name=f"{step}_Mul", inputs=[exact, inverse], outputs=[f"{step}_scaled"])
        rounded = graph.layer(op="Round", name=f"{step}_Round", inputs=scaled, outputs=[f"{step}_rounded"])
        clipped = graph.layer(op="Clip", name=f"{step}_Clip", inputs=[*rounded, low, high], outputs=[f"{step}_clipped"])
        codes = graph.layer(op="Cast", name=f"{step}_Cast", inputs=clipped, outputs=[f"{step}_codes"],
                            attrs={"to": TensorProto.INT8})
        prompt = graph.layer(op="Shape", name=f"{step}_Shape", inputs=[exact], outputs=[f"{step}_prompt"],
                             attrs={"start": 2, "end": 3})
        tail = graph.layer(op="Sub", name=f"{step}_Sub", inputs=[length, *prompt], outputs=[f"{step}_tail"])
        pads = graph.layer(op="Concat", name=f"{step}_Concat", inputs=[pads_before, *tail, pads_after],
                           outputs=[f"{step}_pads"], attrs={"axis": 0})
        graph.layer(op="Pad", name=f"{step}_Pad", inputs=[*codes, *pads], outputs=[present])  # zeros after the prompt


def reciprocal(scale: np.ndarray) -> np.ndarray:
    """1/scale in float32, as onnxruntime's GroupQueryAttention computes it before it multiplies."""
    return (np.float32(1) / scale.astype(np.float32)).astype(np.float32)


def cache_shape(past: gs.Variable) -> tuple:
    shape = tuple(past.shape or ())
    if len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in shape[1:]):
        raise PassError(f"{past.name}: the cache must be [batch, kv_heads, max_context, head_dim] with fixed sizes after "
                        f"batch, not {list(shape)}")
    return shape


def check_options(options: Options) -> None:
    check_settings(options)
    if not isinstance(options.calibration, CalibrationSet):
        raise PassError("calibration: the build resolves the calibration text into tokens before the pass runs; "
                        "give quantize_kv_cache a calibration section (text, samples, length, seed)")


def check_settings(options: Options) -> None:
    """What the recipe alone decides (the build checks it before the export)."""
    if options.calibration is None:
        raise PassError("calibration: quantize_kv_cache sets its scales from calibration text; give it a calibration "
                        "section (text, samples, length, seed)")
    if options.bits != 8:
        raise PassError(f"bits: {options.bits} is not supported; quantize_kv_cache stores 8-bit codes (onnxruntime's "
                        f"4-bit cache packs two codes per byte, which this runtime's buffers do not)")
    if options.granularity not in QUANT_TYPES:
        raise PassError(f"granularity: {options.granularity!r} is not one of {', '.join(QUANT_TYPES)}")
    if options.prefill_attention not in ("float", "int8"):
        raise PassError(f"prefill_attention: {options.prefill_attention!r} is not one of float, int8")
    if not options.headroom >= 1.0:
        raise PassError(f"headroom: {options.headroom} must be >= 1 (the scales cover headroom x the calibration peak)")
    if options.headroom > CODE_MAX:
        raise PassError(f"headroom: {options.headroom} puts the calibration peak below code 1 of {CODE_MAX}, so "
                        f"nearly every key and value would be stored as 0; use a headroom near 1.5")


def rotary_pairs(node: gs.Node) -> str | None:
    """How the node's keys were rotated, pairing their channels: "interleaved" (2j, 2j + 1), "halves" (c,
    c + head_dim / 2: Llama's), or None for keys no rotary turns. By the node itself (do_rotary) or by the
    com.microsoft.RotaryEmbedding before it (lower_onnxruntime's rotary "separate")."""
    rotated_by = node.inputs[1].inputs[0] if node.inputs[1].inputs else None
    if int(node.attrs.get("do_rotary", 0)):
        interleaved = int(node.attrs.get("rotary_interleaved", 0))
    elif rotated_by is not None and (rotated_by.domain, rotated_by.op) == ("com.microsoft", "RotaryEmbedding"):
        interleaved = int(rotated_by.attrs.get("interleaved", 0))
    else:
        return None
    return "interleaved" if interleaved else "halves"


def pair_norms(keys: np.ndarray, pairs: str) -> np.ndarray:
    """Each key channel's pair's largest norm over the rows: keys [kv_heads, rows, head_dim] -> [kv_heads * head_dim].
    A rotation keeps a pair's norm, so no position turns either channel past it."""
    first, second = (keys[..., 0::2], keys[..., 1::2]) if pairs == "interleaved" else np.split(keys, 2, axis=-1)
    norms = np.hypot(first, second).max(axis=1)  # [kv_heads, head_dim / 2]
    per_channel = np.repeat(norms, 2, axis=-1) if pairs == "interleaved" else np.concatenate([norms, norms], -1)
    return per_channel.reshape(-1)


def calibrate(model: onnx.ModelProto, pasts: list[str], presents: list[str], options: Options,
              key_pairs: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Per past input name: the scales ([kv_heads * head_dim] or [1], float32) and the relative round-off error.

    Two runs over the samples, so that memory holds one sample's cache rows, not all of them: the first finds
    each channel's peak, the second measures the round-off of the scales that came out of it.

    key_pairs: the rotated keys' past names, and how their channels pair (rotary_pairs). Calibration's rows are
    early positions, where a slow rotary pair (0.07 rad over 256 tokens, SmolLM2's) has barely turned: a pair
    lying near one axis gave its other channel a scale that keys at positions past 1024 overran 7-fold, clipped
    (+5.6% perplexity there). A rotated key channel's scale covers at least its pair's norm, which no position
    exceeds.
    """
    key_pairs = key_pairs or {}
    calibration = options.calibration
    length = calibration.token_ids.shape[1]
    total = len(calibration.token_ids)

    def written(run: str):  # per sample: {past name: its rows [kv_heads, length, head_dim]}
        for index, outputs in enumerate(sample_outputs(model, presents, calibration)):
            if index + 1 == total or (index + 1) % max(1, total // 8) == 0:  # about 8 lines a run, as quantize's
                calibration.say(f"kv cache calibration ({run}): sample {index + 1}/{total}")
            yield {past: np.asarray(present[0, :, :length], np.float32) for past, present in zip(pasts, outputs)}

    peaks: dict[str, np.ndarray] = {}
    pair_peaks: dict[str, np.ndarray] = {}
    for rows in written("peaks"):
        for past, values in rows.items():
            peak = np.abs(values).max(axis=1).reshape(-1)  # per kv head and channel
            peaks[past] = peak if past not in peaks else np.maximum(peaks[past], peak)
            if past in key_pairs:
                norm = pair_norms(values, key_pairs[past])
                pair_peaks[past] = norm if past not in pair_peaks else np.maximum(pair_peaks[past], norm)
    scales = {}
    for past, peak in peaks.items():
        covered = options.headroom * peak  # headroom above what calibration saw, and at least a turned pair's norm
        covered = np.maximum(covered, pair_peaks[past]) if past in pair_peaks else covered
        covered = covered if options.granularity == "per_channel" else covered.max(keepdims=True)
        # Floored after the division: tiny / 127 is subnormal, whose reciprocal (decode's GroupQueryAttention
        # multiplies by it) is inf, and 0 x inf wrote code 127 where prefill wrote 0 for a channel always 0.
        scales[past] = np.maximum(covered / CODE_MAX, np.finfo(np.float32).tiny).astype(np.float32)
        if not np.isfinite(scales[past]).all():  # decode would read 0 x inf = NaN for every cached value
            raise PassError(f"{past}: the float graph wrote keys or values that are not finite on the calibration "
                            f"text (peak {float(peak.max())}), so no int8 scale covers them; check the model's weights")
    squared_error = dict.fromkeys(pasts, 0.0)
    squared = dict.fromkeys(pasts, 0.0)
    for rows in written("round-off"):
        for past, values in rows.items():
            scale = np.broadcast_to(scales[past], (values.shape[0] * values.shape[2],)).reshape(values.shape[0], 1, -1)
            restored = np.clip(np.round(values * reciprocal(scale)), -CODE_MAX - 1, CODE_MAX) * scale
            squared_error[past] += float(np.sum((values - restored) ** 2, dtype=np.float64))
            squared[past] += float(np.sum(values ** 2, dtype=np.float64))
    errors = {past: squared_error[past] / max(squared[past], 1e-30) for past in pasts}
    return scales, errors


def _range(scale: np.ndarray) -> list[float]:
    return [float(scale.min()), float(scale.max())]
