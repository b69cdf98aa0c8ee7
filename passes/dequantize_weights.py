"""dequantize_weights: MatMulNBits -> DequantizeLinear -> MatMul over the same codes, folded to float at load.

    A ─► MatMulNBits(K, N, bits, block_size) ─► Y     =>    A ─► MatMul ─► Y
         B [N, blocks, bytes], scales (, zero_points)             │
                                                           DequantizeLinear(axis 0, block_size)
                                                             codes [K, N] = Transpose(unpack(B))     (uint8)
                                                             scales, zero points [blocks, N]

Why: prefill is bound by arithmetic, and onnxruntime's MatMulNBits runs a long prompt slower than a float MatMul
(it rounds the activations to int8 per block and runs integer dot products tuned for a few rows: on SmolLM2-135M
a 512-token prefill took 1532 ms with INT8 MatMulNBits and 1179 ms with INT4, against 891 ms in fp32). Every
input of the new ops is computed from constants only, so onnxruntime's constant folding builds each float weight
once, when the session loads. The file keeps only the integer codes: the new ops read the very initializers the
decode graph's MatMulNBits read (or slice_packed_weights' Slices of them), so the artifact stores them once and does
not grow. The price is paid at load: the session holds
these products in float32 (4 bytes a parameter, in onnxruntime's packed form), as an fp32 session does, and takes
seconds to build them. Decode, bound by the bytes each step reads, keeps the integer kernels: recipes run this pass with
`phases: [prefill]` (the pipeline runs a pass whose options have `phases` on those graphs only).

onnxruntime folds a DequantizeLinear only with its QDQ fusions off (otherwise it fuses DequantizeLinear -> MatMul
back into a MatMulNBits of its own, or, past a padded block's Slice, dequantizes at every run): the pass records
the session setting in the graph's metadata (passes/session_config.py), the onnxruntime backend copies it into
the manifest's engine entry, and the runtime applies it to that engine's session. The folding also needs graph
optimizations (graph_optimization_level basic or above; the default is all).

Kept as they are, with the reason in the report:
- products whose activation is known to be 2-D, [rows, K], in a graph whose `logits` output is 2-D (one row per
  sequence): the prefill graph's lm_head after the last-token selection, which is bound by its weight's bytes,
  where 4 or 8 bits win (with prefill_logits: all the lm_head reads every token and is rewritten);
- nodes with a g_idx input (groups out of order; aotlm does not emit them) or an input computed from a graph input.
  Inputs computed from constants only are rewritten: slice_packed_weights' Slices of a packed gate/up's codes.

Numerics: the product runs in float over scale x (code - zero point), the quantized model's own definition
(passes/quantized_weights.py); MatMulNBits with accuracy_level 4 also rounds the activations to int8, which the
rewritten products no longer do. So prefill's logits move (by up to 0.7 on SmolLM2-135M with INT4 RTN weights), by
what that rounding moved them; measured against fp32 they end no further from it (README).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes.errors import PassError
from passes.graph_export import export_onnx
from passes.graph_patterns import computed_from_constants, is_present
from passes.opset import default_opset
from passes.session_config import record_session_config

MICROSOFT_DOMAIN = "com.microsoft"
BLOCKED_DEQUANTIZE_OPSET = 21  # DequantizeLinear's block_size (BitwiseAnd, for 4-bit codes, is from opset 18)
PHASES = ("prefill", "decode")
SESSION_CONFIG = {"session.disable_quant_qdq": "1"}  # fold DequantizeLinear on constants instead of fusing it


@dataclass(frozen=True)
class Options:
    # the graphs it rewrites (the pipeline reads it): [prefill] only, the decode graph keeps its integer kernels
    phases: tuple[Literal["prefill", "decode"], ...] = ("prefill",)


def check_options(options: Options) -> None:
    if not options.phases or len(set(options.phases)) != len(options.phases):
        raise PassError(f"phases: {list(options.phases)} must name each of {', '.join(PHASES)} at most once, and one "
                        f"at least (the pass is meant for prefill: phases: [prefill])")
    if "decode" in options.phases:
        raise PassError("phases: decode reads every weight at every step, and in float32 that is the fp32 model's "
                        "step with a slower load: run dequantize_weights on prefill only (phases: [prefill]), or "
                        "build without quantize")


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    graph = gs.import_onnx(model)
    graph.import_domains = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]
    nodes_before = len(graph.nodes)
    opset = default_opset(model)
    rewritten, kept, float_bytes = [], [], 0
    # prefill with prefill_logits: last returns [batch, vocab]; with "all" its 2-D lm_head input is every token's row
    selected_rows = any(out.name == "logits" and out.shape is not None and len(out.shape) == 2 for out in graph.outputs)
    for node in [n for n in graph.nodes if n.domain == MICROSOFT_DOMAIN and n.op == "MatMulNBits"]:
        reason = _keep_reason(node, opset, selected_rows)
        if reason:
            kept.append({"node": node.name, "reason": reason})
            continue
        float_bytes += rewrite(graph, node)
        rewritten.append(node.name)
    report = {"applied": bool(rewritten), "rewritten": rewritten, "kept": kept,
              "reason": None if rewritten else ("no MatMulNBits to rewrite" if not kept else
                                                 f"every MatMulNBits left is kept ({len(kept)}: see kept)"),
              "float_weight_bytes_at_load": float_bytes}  # what the session builds (before its packed copies)
    if not rewritten:
        report["nodes"] = {"before": nodes_before, "after": nodes_before}
        return model, report
    graph.cleanup().toposort()
    result = export_onnx(graph)
    report["session_config"] = record_session_config(result, model, SESSION_CONFIG)
    report["nodes"] = {"before": nodes_before, "after": len(result.graph.node)}
    return result, report


def _keep_reason(node: gs.Node, opset: int, selected_rows: bool) -> str | None:
    inputs = node.inputs
    if len(inputs) > 4 and is_present(inputs[4]):
        return "has a g_idx input (groups out of order), which aotlm's quantize does not emit"
    for tensor, name in zip(inputs[1:4], ("B", "scales", "zero_points")):
        if is_present(tensor) and not computed_from_constants(tensor):  # constants, or slice_packed_weights' Slices
            return f"its {name} input is computed from a graph input: nothing to fold"
    activation = inputs[0]
    if selected_rows and activation.shape is not None and len(activation.shape) == 2:
        return (f"2-D activation {list(activation.shape)} in a graph whose logits are one row per sequence: the "
                f"selected rows, bound by the weight's bytes, where the integer kernel reads fewer")
    bits, block_size, k, n = (int(node.attrs[a]) for a in ("bits", "block_size", "K", "N"))
    if bits not in (4, 8):
        return f"bits {bits}: only 4 and 8 are unpacked"
    if opset < BLOCKED_DEQUANTIZE_OPSET:
        return f"opset {opset}: DequantizeLinear takes blocks from opset {BLOCKED_DEQUANTIZE_OPSET}"
    expected = [n, -(-k // block_size), block_size * bits // 8]
    if inputs[1].shape is None or list(inputs[1].shape) != expected:
        return f"B is {inputs[1].shape}, not {expected} as K, N, bits and block_size say"
    return None


def rewrite(graph: gs.Graph, node: gs.Node) -> int:
    """Replaces MatMulNBits `node` by MatMul over its dequantized [K, N] weight; returns the weight's float bytes."""
    bits, block_size, k, n = (int(node.attrs[a]) for a in ("bits", "block_size", "K", "N"))
    activation, blob, scales = node.inputs[:3]
    zero_points = node.inputs[3] if len(node.inputs) > 3 and is_present(node.inputs[3]) else None
    bias = node.inputs[5] if len(node.inputs) > 5 and is_present(node.inputs[5]) else None
    blocks = -(-k // block_size)
    prefix = node.name or node.outputs[0].name
    # [N, blocks, block] uint8 codes -> [blocks * block, N], transposed while each element is one byte, not four
    codes = _unpacked(graph, prefix, blob, bits, [n, blocks * block_size])
    codes = _op(graph, "Transpose", f"{prefix}_codes_kn", [codes], perm=[1, 0])
    scale_rows = _op(graph, "Reshape", f"{prefix}_scales_rows", [scales, _ints(f"{prefix}_scales_shape", [n, blocks])])
    block_scales = _op(graph, "Transpose", f"{prefix}_scales_kn", [scale_rows], perm=[1, 0])  # [blocks, N]
    if zero_points is None:  # the format's midpoint, as MatMulNBits assumes without a zero_points input
        midpoint = gs.Constant(f"{prefix}_midpoint_code", np.array(1 << (bits - 1), np.uint8))
        zero = _op(graph, "Expand", f"{prefix}_midpoint", [midpoint, _ints(f"{prefix}_midpoint_shape", [blocks, n])])
    else:  # [N, ceil(blocks * bits / 8)] packed like B -> [blocks, N]
        per_row = _op(graph, "Reshape", f"{prefix}_zp_rows", [zero_points, _ints(f"{prefix}_zp_rows_shape", [n, -1])])
        unpacked = _unpacked(graph, f"{prefix}_zp", per_row, bits, [n, -1])
        trimmed = _op(graph, "Slice", f"{prefix}_zp_trim", [unpacked, _ints(f"{prefix}_zp_starts", [0]),
                                                            _ints(f"{prefix}_zp_ends", [blocks]),
                                                            _ints(f"{prefix}_zp_axes", [1])])  # an odd count pads
        zero = _op(graph, "Transpose", f"{prefix}_zp_kn", [trimmed], perm=[1, 0])
    weight = _op(graph, "DequantizeLinear", f"{prefix}_dequantize", [codes, block_scales, zero], axis=0,
                 block_size=block_size)
    if blocks * block_size != k:  # a padded last block
        weight = _op(graph, "Slice", f"{prefix}_unpad", [weight, _ints(f"{prefix}_unpad_starts", [0]),
                                                         _ints(f"{prefix}_unpad_ends", [k]),
                                                         _ints(f"{prefix}_unpad_axes", [0])])
    output = node.outputs[0]
    node.inputs.clear()
    node.outputs.clear()
    if bias is None:
        graph.nodes.append(gs.Node("MatMul", name=f"{prefix}_float", inputs=[activation, weight], outputs=[output]))
    else:
        product = _op(graph, "MatMul", f"{prefix}_float", [activation, weight])
        graph.nodes.append(gs.Node("Add", name=f"{prefix}_bias", inputs=[product, bias], outputs=[output]))
    return k * n * 4  # onnxruntime's CPU provider holds them in float32 (float16 graphs get Casts around the MatMul)


def _unpacked(graph: gs.Graph, prefix: str, packed: gs.Tensor, bits: int, shape: list[int]) -> gs.Tensor:
    """uint8 codes with the low-first packing undone (INT4: element 2i in the low nibble of byte i), as `shape`.
    INT4: each byte, as [..., 1], shifted right by [0, 4] (broadcast) and masked with 15 gives its [low, high]."""
    if bits == 8:
        return _op(graph, "Reshape", f"{prefix}_unpacked", [packed, _ints(f"{prefix}_unpacked_shape", shape)])
    as_pairs = _op(graph, "Unsqueeze", f"{prefix}_bytes", [packed, _ints(f"{prefix}_bytes_axis", [-1])])
    shifted = _op(graph, "BitShift", f"{prefix}_shifted",
                  [as_pairs, gs.Constant(f"{prefix}_shifts", np.array([0, 4], np.uint8))], direction="RIGHT")
    nibbles = _op(graph, "BitwiseAnd", f"{prefix}_nibbles",
                  [shifted, gs.Constant(f"{prefix}_mask", np.array(15, np.uint8))])
    return _op(graph, "Reshape", f"{prefix}_unpacked", [nibbles, _ints(f"{prefix}_unpacked_shape", shape)])


def _op(graph: gs.Graph, op: str, name: str, inputs: list, **attrs) -> gs.Variable:
    output = gs.Variable(f"{name}_out")
    graph.nodes.append(gs.Node(op, name=name, attrs=attrs, inputs=inputs, outputs=[output]))
    return output


def _ints(name: str, values: list[int]) -> gs.Constant:
    return gs.Constant(name, np.array(values, np.int64))
