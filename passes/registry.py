"""The one table that maps recipe pass names to passes.

A pass is a module with a frozen dataclass `Options` and `run(model, options) -> (model, report)`:
`model` is an in-memory onnx.ModelProto (weights included), `report` a JSON-serializable dict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from passes import (cleanup, dequantize_weights, fuse_attention, fuse_rms_norm, fuse_rotary, fuse_silu, lower_onnx_attention,
                    lower_onnxruntime, lower_tensorrt, pack_projections, quantize, quantize_kv_cache, skip_unused_rows,
                    slice_packed_weights)


@dataclass(frozen=True)
class PassEntry:
    run: Callable
    options_type: type
    summary: str
    check: Callable | None = None  # check(options) raises PassError for options that need no graph to refuse
    # Phases whose graph the pipeline gives this pass first. A pass that shares its calibration results between
    # phases computes them on the first graph it gets: quantize must see decode's, whose lm_head reads every
    # token's hidden state; prefill's (prefill_logits: last) reads one row per sample (64, for a 576-wide layer).
    runs_first_on: tuple[str, ...] = ()


PASSES: dict[str, PassEntry] = {
    "cleanup": PassEntry(cleanup.run, cleanup.Options, "constant folding, dead nodes, shape inference, shared initializers"),
    "dequantize_weights": PassEntry(dequantize_weights.run, dequantize_weights.Options,
                                    "MatMulNBits -> float MatMul over a weight ONNX ops unpack from the same codes "
                                    "(folded when the session loads; for prefill)", dequantize_weights.check_options),
    "fuse_attention": PassEntry(fuse_attention.run, fuse_attention.Options,
                                "each attention block -> one aotlm.FlashAttention node (rotary and KV-cache writes inside)"),
    "fuse_rotary": PassEntry(fuse_rotary.run, fuse_rotary.Options,
                             "each rotary-embedding subgraph (unfused attention) -> ONNX RotaryEmbedding-23"),
    "fuse_silu": PassEntry(fuse_silu.run, fuse_silu.Options, "x * Sigmoid(x) -> com.microsoft.QuickGelu (alpha 1)"),
    "lower_onnx_attention": PassEntry(lower_onnx_attention.run, lower_onnx_attention.Options,
                                      "aotlm.FlashAttention -> standard ONNX Attention-23 + RotaryEmbedding (portable)"),
    "lower_onnxruntime": PassEntry(lower_onnxruntime.run, lower_onnxruntime.Options,
                                   "aotlm.FlashAttention -> com.microsoft.GroupQueryAttention (shared KV buffers)"),
    "lower_tensorrt": PassEntry(lower_tensorrt.run, lower_tensorrt.Options,
                                "aotlm.FlashAttention -> RotaryEmbedding + TensorRT plugins (flash_attention; flash_decode + "
                                "flash_combine in decode), or Attention-23, or TRT_Attention + TRT_KVCacheUpdate"),
    "pack_projections": PassEntry(pack_projections.run, pack_projections.Options,
                                  "sibling MatMuls on one activation (q/k/v, gate/up) -> one MatMul + Split",
                                  pack_projections.check_options),
    "fuse_rms_norm": PassEntry(fuse_rms_norm.run, fuse_rms_norm.Options,
                               "RMSNorm (+ residual Add) -> onnxruntime's (Skip)SimplifiedLayerNormalization"),
    "quantize": PassEntry(quantize.run, quantize.Options,
                          "MatMul weights -> INT4 blocked / INT8 per channel (rtn, awq, gptq) as MatMulNBits or DequantizeLinear",
                          quantize.check_options, runs_first_on=("decode",)),
    "quantize_kv_cache": PassEntry(quantize_kv_cache.run, quantize_kv_cache.Options,
                                   "GroupQueryAttention's KV cache -> int8 with calibrated per-channel scales",
                                   quantize_kv_cache.check_settings),
    "slice_packed_weights": PassEntry(slice_packed_weights.run, slice_packed_weights.Options,
                                      "packed MatMul or MatMulNBits + Split -> a product per part over its columns of "
                                      "the weight or codes (sliced when the session loads; for prefill)", slice_packed_weights.check_options),
    "skip_unused_rows": PassEntry(skip_unused_rows.run, skip_unused_rows.Options,
                                  "prefill's last layer after attention runs only on the rows whose logits it returns"),
}
