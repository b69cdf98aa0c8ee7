"""Weight-only quantization of MatMuls with a constant float weight, lowered to `com.microsoft.MatMulNBits`.

    A ---> MatMul ---> Y              A ---> MatMulNBits(K, N, bits, block_size, accuracy_level) ---> Y
    W [K, N] --^               =>     B_packed [N, blocks, blob], scales [N, blocks] (, zero_points) --^

The weight goes through the one internal representation (`passes.quantized_weights.QuantizedWeight`), so the
report's error is measured against the same numpy dequantization that the tests compare onnxruntime with.
INT4 uses blocks of `block_size` along K; INT8 is per output channel (one block of size K). A K the block
size does not divide is skipped with a reason, never padded. Activation x activation MatMuls (attention
scores) have no constant weight and are skipped with a reason too.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes.errors import PassError
from passes.quantized_weights import QuantizedWeight, dequantize, pack_matmulnbits, quantize_rtn

MICROSOFT_DOMAIN = "com.microsoft"
FLOAT_TYPES = (np.float32, np.float16)


@dataclass(frozen=True)
class Options:
    bits: int = 4
    block_size: int = 32        # INT4 only; INT8 is per channel
    symmetric: bool = True      # INT4 only; INT8 is always symmetric
    method: str = "rtn"
    exclude: tuple[str, ...] = ()  # fnmatch patterns on the MatMul's node name or its weight's name
    accuracy_level: int = 0     # MatMulNBits' minimum compute precision (0 = unset, 4 = int8 activations)
    max_rewrites: int | None = None


@dataclass
class Match:
    matmul: gs.Node
    weight: gs.Constant


def check_options(options: Options) -> None:
    if options.bits not in (4, 8):
        raise PassError(f"quantize: bits={options.bits} is not supported; choose 4 (blocked) or 8 (per channel)")
    if options.method != "rtn":
        raise PassError(f"quantize: method {options.method!r} not implemented yet (rtn only)")
    size = options.block_size
    if options.bits == 4 and (size < 16 or size & (size - 1)):
        raise PassError(f"quantize: block_size={size}: MatMulNBits needs a power of two >= 16 (e.g. 32, 64, 128)")


def block_size_for(options: Options, k: int) -> int:
    return k if options.bits == 8 else options.block_size


def match(matmul: gs.Node, options: Options) -> Match | str:
    """A Match, or the reason this MatMul is not quantized."""
    weight = matmul.inputs[1]
    if not isinstance(weight, gs.Constant):
        return "B is not a constant weight"
    values = weight.values
    if values.ndim != 2 or values.dtype.type not in FLOAT_TYPES:
        return f"B is {values.ndim}-D {values.dtype}, not a 2-D float weight"
    activation = matmul.inputs[0]
    if activation.shape is not None and len(activation.shape) < 2:
        return "A is 1-D; MatMulNBits needs A of rank >= 2"
    k = values.shape[0]
    block_size = block_size_for(options, k)
    if k % block_size:
        return f"K={k} not divisible by block_size={block_size}; choose a block size that divides it"
    if block_size < 16 or block_size & (block_size - 1):
        return f"per-channel block K={k} is not a power of two >= 16, which MatMulNBits needs"
    return Match(matmul, weight)


def lowered_constants(name: str, qw: QuantizedWeight, dtype: np.dtype) -> list[gs.Constant]:
    """MatMulNBits' B, scales (in A's float type) and, when asymmetric, zero_points."""
    blob, scales, zero_points = pack_matmulnbits(qw)
    constants = [gs.Constant(f"{name}_q{qw.bits}", blob), gs.Constant(f"{name}_scales", scales.astype(dtype))]
    if zero_points is not None:
        constants.append(gs.Constant(f"{name}_zero_points", zero_points))
    return constants


def rewrite(graph: gs.Graph, found: Match, qw: QuantizedWeight, constants: list[gs.Constant], options: Options) -> None:
    inputs = [found.matmul.inputs[0], *constants]
    output = found.matmul.outputs[0]
    found.matmul.outputs.clear()
    attrs = {"K": qw.k, "N": qw.n, "bits": qw.bits, "block_size": qw.block_size}
    if options.accuracy_level:
        attrs["accuracy_level"] = options.accuracy_level
    graph.nodes.append(gs.Node("MatMulNBits", name=f"{found.matmul.name}_q{qw.bits}", domain=MICROSOFT_DOMAIN,
                               attrs=attrs, inputs=inputs, outputs=[output]))


def matches(pattern: str, matmul: gs.Node) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for name in (matmul.name, matmul.inputs[1].name))


def excluded_by(matmul: gs.Node, options: Options) -> str | None:
    return next((pattern for pattern in options.exclude if matches(pattern, matmul)), None)


def check_exclude_patterns(matmuls: list[gs.Node], options: Options) -> None:
    """A pattern that matches nothing is a typo or a stale recipe; silently quantizing everything would hide it."""
    unmatched = [p for p in options.exclude if not any(matches(p, m) for m in matmuls)]
    if unmatched:
        example = f"; MatMul names look like {matmuls[0].name!r}" if matmuls else "; the graph has no MatMul"
        raise PassError(f"quantize: exclude pattern(s) {unmatched} match no MatMul node or weight name{example}")


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    check_options(options)
    graph = gs.import_onnx(model)
    graph.import_domains = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]  # keep input intact
    matmuls = [n for n in graph.nodes if n.op == "MatMul"]
    check_exclude_patterns(matmuls, options)
    layers, skipped = [], []
    quantized: dict[str, tuple[QuantizedWeight, list[gs.Constant]]] = {}  # a weight shared by MatMuls, once
    for matmul in matmuls:
        pattern = excluded_by(matmul, options)
        found = f"excluded by pattern {pattern!r}" if pattern else match(matmul, options)
        if isinstance(found, str):
            skipped.append({"node": matmul.name, "reason": found})
            continue
        if options.max_rewrites is not None and len(layers) >= options.max_rewrites:
            skipped.append({"node": matmul.name, "reason": f"max_rewrites={options.max_rewrites}"})
            continue
        weight = found.weight.values
        if found.weight.name not in quantized:
            qw = quantize_rtn(weight, options.bits, block_size_for(options, weight.shape[0]), options.symmetric)
            quantized[found.weight.name] = qw, lowered_constants(found.weight.name, qw, weight.dtype)
        qw, constants = quantized[found.weight.name]
        rewrite(graph, found, qw, constants, options)
        bytes_after = sum(int(c.values.nbytes) for c in constants)
        layers.append({"node": matmul.name, "bits": qw.bits, "block_size": qw.block_size,
                       "max_abs_weight_error": float(np.abs(weight.astype(np.float32) - dequantize(qw)).max()),
                       "bytes_before": int(weight.nbytes), "bytes_after": bytes_after})
    if layers and not any(o.domain == MICROSOFT_DOMAIN for o in graph.import_domains):
        graph.import_domains.append(onnx.helper.make_opsetid(MICROSOFT_DOMAIN, 1))
    graph.cleanup().toposort()
    result = gs.export_onnx(graph)
    totals = {"weight_bytes_before": sum(layer["bytes_before"] for layer in layers),
              "weight_bytes_after": sum(layer["bytes_after"] for layer in layers),
              "quantized": len(layers), "skipped": len(skipped)}
    return result, {"layers": layers, "skipped": skipped, "totals": totals}
