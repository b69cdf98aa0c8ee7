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
- prefill (no past, `prefill_attention: float`): onnxruntime's quantized-cache path is 4-6x slower than its flash
  kernel over a whole prompt (30 against 7 ms per layer at 512 tokens, 366 against 62-74 at 2000, 2 threads), so
  the node keeps a float cache of the prompt's length and Div/Round/Clip/Cast/Pad write the same codes into the
  bound int8 buffer. The prompt's own attention is then exact; decode steps (and prefill chunks after a past,
  which run the decode graph) read the rounded cache.
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
from onnx import TensorProto, numpy_helper

from passes.calibration import CalibrationSet, CalibrationSpec, sample_outputs
from passes.errors import PassError

GQA = ("com.microsoft", "GroupQueryAttention")
PAST_INPUTS = (3, 4)  # GroupQueryAttention's past_key, past_value
PRESENT_OUTPUTS = (1, 2)
SCALE_INPUT = 12  # k_scale; v_scale follows
QUANT_TYPES = {"per_channel": "PER_CHANNEL", "per_tensor": "PER_TENSOR"}
CODE_MAX = 127


@dataclass(frozen=True)
class Options:
    bits: int = 8
    granularity: Literal["per_channel", "per_tensor"] = "per_channel"
    # scale = headroom * calibration peak / 127: a value beyond what calibration saw (another prompt's outlier
    # channel) is clipped to ±127 codes, so leave room above the peak, at the price of a coarser step.
    headroom: float = 1.5
    # The prefill graph (no past): "float" attends over the prompt in float with onnxruntime's flash kernel and then
    # writes the int8 codes; "int8" keeps onnxruntime's quantized-cache path there too, 4-6x slower per layer.
    prefill_attention: Literal["float", "int8"] = "float"
    calibration: CalibrationSpec | None = CalibrationSpec(samples=16, length=256)


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    check_options(options)
    graph = model.graph
    nodes = [n for n in graph.node if (n.domain, n.op_type) == GQA]
    if not nodes:
        raise PassError("no com.microsoft.GroupQueryAttention node: quantize_kv_cache stores onnxruntime's cache, so "
                        "put it after lower_onnxruntime in the recipe (backend onnxruntime)")
    caches = [(node.input[PAST_INPUTS[0]], node.input[PAST_INPUTS[1]]) for node in nodes]
    graph_inputs = {i.name: i for i in graph.input}
    for node, names in zip(nodes, caches):
        for name in names:
            if name not in graph_inputs:
                raise PassError(f"{node.name}: its past input {name!r} is not a graph input (the KV-cache buffer the "
                                f"runtime binds); quantize_kv_cache needs the artifact's cache I/O")
            if graph_inputs[name].type.tensor_type.elem_type != TensorProto.FLOAT:
                raise PassError(f"{name}: the KV cache is already {TensorProto.DataType.Name(graph_inputs[name].type.tensor_type.elem_type)}, "
                                f"not float; list quantize_kv_cache once in the recipe")
    key = ("kv_cache_scales", options.bits, options.granularity)
    memo = options.calibration.memo
    if key not in memo:
        memo[key] = calibrate(model, nodes, options)
    scales, errors = memo[key]

    quantized = onnx.ModelProto()
    quantized.CopyFrom(model)
    graph = quantized.graph
    float_prefill = graph.name == "prefill" and options.prefill_attention == "float"
    cache_names = set()
    layers = []
    rewritten = []
    for node in graph.node:
        rewritten.append(node)
        if (node.domain, node.op_type) != GQA:
            continue
        past_key, past_value = node.input[PAST_INPUTS[0]], node.input[PAST_INPUTS[1]]
        if past_key not in scales or past_value not in scales:
            raise PassError(f"{node.name}: no calibrated scales for {past_key!r}: the phases' graphs name their "
                            f"caches differently")
        if len(node.input) > SCALE_INPUT:
            raise PassError(f"{node.name}: already has k_scale/v_scale inputs")
        cache_names.update([past_key, past_value, *(node.output[i] for i in PRESENT_OUTPUTS)])
        if float_prefill:
            rewritten += write_codes_after(graph, node, [scales[past_key], scales[past_value]], options)
        else:
            read_codes(graph, node, [scales[past_key], scales[past_value]], options)
        layers.append({"layer": node.name, "key_scale": _range(scales[past_key]), "value_scale": _range(scales[past_value]),
                       "key_error": errors[past_key], "value_error": errors[past_value]})
    del graph.node[:]
    graph.node.extend(rewritten)
    for value in [*graph.input, *graph.output]:
        if value.name in cache_names:
            value.type.tensor_type.elem_type = TensorProto.INT8
    kept_info = [v for v in graph.value_info if v.name not in cache_names]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    return quantized, {
        "quantized_layers": len(nodes), "dtype": "int8", "granularity": options.granularity, "headroom": options.headroom,
        "bytes_per_element": {"before": 4, "after": 1},
        "relative_error": {"key_mean": float(np.mean([layer["key_error"] for layer in layers])),
                           "value_mean": float(np.mean([layer["value_error"] for layer in layers]))},
        "calibration": options.calibration.describe(), "layers": layers, "phase_graph": graph.name,
    }


def read_codes(graph: onnx.GraphProto, node: onnx.NodeProto, scales: list[np.ndarray], options: Options) -> None:
    """The node keeps its cache int8: it quantizes the keys and values it writes and dequantizes what it reads."""
    names = []
    for past, scale in zip((node.input[PAST_INPUTS[0]], node.input[PAST_INPUTS[1]]), scales):
        names.append(f"{past}.kv_scale")
        graph.initializer.append(numpy_helper.from_array(scale, names[-1]))
    inputs = list(node.input) + [""] * (SCALE_INPUT - len(node.input))
    del node.input[:]
    node.input.extend(inputs + names)
    node.attribute.extend([onnx.helper.make_attribute("k_quant_type", QUANT_TYPES[options.granularity]),
                           onnx.helper.make_attribute("v_quant_type", QUANT_TYPES[options.granularity]),
                           onnx.helper.make_attribute("kv_cache_bit_width", options.bits)])


def write_codes_after(graph: onnx.GraphProto, node: onnx.NodeProto, scales: list[np.ndarray],
                      options: Options) -> list[onnx.NodeProto]:
    """Prefill (no past): the node attends in float over the prompt's own keys and values (onnxruntime's flash
    kernel; its quantized-cache path is 4-6x slower there) and returns them; the nodes after it round them to
    the codes the decode graph reads and pad them to the cache's length, straight into the bound present buffer.

    Returns the nodes that follow it. The past inputs stay graph inputs (the artifact's contract), unused.
    """
    _, kv_heads, max_context, head_dim = _cache_shape(graph, node.input[PAST_INPUTS[0]])
    node.input[PAST_INPUTS[0]] = node.input[PAST_INPUTS[1]] = ""
    prefix = f"{node.name}/int8_cache"
    constants = {f"{prefix}/low": np.array(-CODE_MAX - 1, np.float32), f"{prefix}/high": np.array(CODE_MAX, np.float32),
                 f"{prefix}/length": np.array([max_context], np.int64), f"{prefix}/pads_before": np.zeros(6, np.int64),
                 f"{prefix}/pads_after": np.zeros(1, np.int64)}
    graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in constants.items())
    make = onnx.helper.make_node
    added = []
    for output_index, scale, kind in zip(PRESENT_OUTPUTS, scales, ("key", "value")):
        present, exact, step = node.output[output_index], f"{prefix}/{kind}_float", f"{prefix}/{kind}"
        node.output[output_index] = exact  # [batch, kv_heads, prompt, head_dim], keys after rotary
        broadcast = (1, kv_heads, 1, head_dim) if scale.size > 1 else (1,)
        graph.initializer.append(numpy_helper.from_array(scale.reshape(broadcast), f"{step}_scale"))
        added += [
            make("Div", [exact, f"{step}_scale"], [f"{step}_scaled"], name=f"{step}_Div"),
            make("Round", [f"{step}_scaled"], [f"{step}_rounded"], name=f"{step}_Round"),
            make("Clip", [f"{step}_rounded", f"{prefix}/low", f"{prefix}/high"], [f"{step}_clipped"], name=f"{step}_Clip"),
            make("Cast", [f"{step}_clipped"], [f"{step}_codes"], to=TensorProto.INT8, name=f"{step}_Cast"),
            make("Shape", [exact], [f"{step}_prompt"], start=2, end=3, name=f"{step}_Shape"),
            make("Sub", [f"{prefix}/length", f"{step}_prompt"], [f"{step}_tail"], name=f"{step}_Sub"),
            make("Concat", [f"{prefix}/pads_before", f"{step}_tail", f"{prefix}/pads_after"], [f"{step}_pads"],
                 axis=0, name=f"{step}_Concat"),
            make("Pad", [f"{step}_codes", f"{step}_pads"], [present], name=f"{step}_Pad"),  # zeros after the prompt
        ]
    return added


def _cache_shape(graph: onnx.GraphProto, past: str) -> tuple[int | str, int, int, int]:
    dims = next(v for v in graph.input if v.name == past).type.tensor_type.shape.dim
    shape = tuple(d.dim_value or d.dim_param for d in dims)
    if len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in shape[1:]):
        raise PassError(f"{past}: the cache must be [batch, kv_heads, max_context, head_dim] with fixed sizes after "
                        f"batch, not {list(shape)}")
    return shape


def check_options(options: Options) -> None:
    if options.bits != 8:
        raise PassError(f"bits: {options.bits} is not supported; quantize_kv_cache stores 8-bit codes (onnxruntime's "
                        f"4-bit cache packs two codes per byte, which this runtime's buffers do not)")
    if options.granularity not in QUANT_TYPES:
        raise PassError(f"granularity: {options.granularity!r} is not one of {', '.join(QUANT_TYPES)}")
    if options.prefill_attention not in ("float", "int8"):
        raise PassError(f"prefill_attention: {options.prefill_attention!r} is not one of float, int8")
    if not options.headroom >= 1.0:
        raise PassError(f"headroom: {options.headroom} must be >= 1 (the scales cover headroom x the calibration peak)")
    if not isinstance(options.calibration, CalibrationSet):
        raise PassError("calibration: the build resolves the calibration text into tokens before the pass runs; "
                        "give quantize_kv_cache a calibration section (text, samples, length, seed)")


def calibrate(model: onnx.ModelProto, nodes: list, options: Options) -> tuple[dict, dict]:
    """Per past input name: the scales ([kv_heads * head_dim] or [1], float32) and the relative round-off error.

    Two runs over the samples, so that memory holds one sample's cache rows, not all of them: the first finds
    each channel's peak, the second measures the round-off of the scales that came out of it.
    """
    calibration = options.calibration
    presents = [node.output[i] for node in nodes for i in PRESENT_OUTPUTS]
    pasts = [node.input[i] for node in nodes for i in PAST_INPUTS]
    length = calibration.token_ids.shape[1]
    total = len(calibration.token_ids)

    def written(run: str):  # per sample: {past name: its rows [kv_heads, length, head_dim]}
        for index, outputs in enumerate(sample_outputs(model, presents, calibration)):
            calibration.say(f"kv cache calibration ({run}): sample {index + 1}/{total}")
            yield {past: np.asarray(present[0, :, :length], np.float32) for past, present in zip(pasts, outputs)}

    peaks: dict[str, np.ndarray] = {}
    for rows in written("peaks"):
        for past, values in rows.items():
            peak = np.abs(values).max(axis=1).reshape(-1)  # per kv head and channel
            peaks[past] = peak if past not in peaks else np.maximum(peaks[past], peak)
    scales = {}
    for past, peak in peaks.items():
        peak = peak if options.granularity == "per_channel" else peak.max(keepdims=True)
        scales[past] = (np.maximum(options.headroom * peak, np.finfo(np.float32).tiny) / CODE_MAX).astype(np.float32)
    squared_error = dict.fromkeys(pasts, 0.0)
    squared = dict.fromkeys(pasts, 0.0)
    for rows in written("round-off"):
        for past, values in rows.items():
            scale = np.broadcast_to(scales[past], (values.shape[0] * values.shape[2],)).reshape(values.shape[0], 1, -1)
            restored = np.clip(np.round(values / scale), -CODE_MAX - 1, CODE_MAX) * scale
            squared_error[past] += float(np.sum((values - restored) ** 2, dtype=np.float64))
            squared[past] += float(np.sum(values ** 2, dtype=np.float64))
    errors = {past: squared_error[past] / max(squared[past], 1e-30) for past in pasts}
    return scales, errors


def _range(scale: np.ndarray) -> list[float]:
    return [float(scale.min()), float(scale.max())]
