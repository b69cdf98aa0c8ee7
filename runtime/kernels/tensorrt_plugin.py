"""The Triton FlashAttention kernels as TensorRT plugins (`tensorrt.plugin`, ahead-of-time: PTX in the engine).

Import this module before parsing a graph that `passes/lower_tensorrt.py` lowered: the parser looks the plugin
nodes up by op type and `plugin_namespace`. Engines embed the kernels' PTX (`aot_impl`, compiled by
`runtime/kernels/aot.py`), so running them needs neither these definitions nor Triton.

Plugins (namespace "aotlm"; the node contract is written in passes/lower_tensorrt.py):
    flash_attention(query, key, value, key_cache, value_cache, seqlens_k, total) -> (output, key_cache', value_cache')
    flash_decode(the same inputs) -> (partial_out, partial_lse, key_cache', value_cache')   the cache split in parts
    flash_combine(partial_out, partial_lse) -> output
key_cache' / value_cache' are aliased to the cache inputs (preview feature ALIASED_PLUGIN_IO_10_03): the kernels
write this step's rows in place, and the runtime binds one buffer to both names.

Written from TensorRT's Python plugin documentation (aot_impl: 10.9+) and not yet run: this project's CPU machines
have no TensorRT. What it hands TensorRT (PTX, kernel name, warps, shared memory) is tested through aot.py.

No `from __future__ import annotations` here: tensorrt.plugin reads these signatures with inspect.signature (no
eval_str) and tests the annotations with issubclass (`_validate.py`), so they must be real classes, not strings.
Every aot_impl lists all of its plugin's attributes, in `register` order: `_TemplateAOTPlugin.get_launch_params`
passes all attributes positionally (`zip(*self.attrs.items())`), in the order the parser loads them, which is
the creator's field order, i.e. `register`'s (onnx-tensorrt `loadFields`). ONNX INT attributes arrive as INT32
fields and FLOAT as FLOAT32; the creator converts them with the annotation (`int(...)`, `float(...)`).
"""
from typing import Tuple, Union

import tensorrt as trt
import tensorrt.plugin as trtp

from runtime.kernels import aot

NAMESPACE = "aotlm"  # passes/lower_tensorrt.PLUGIN_NAMESPACE: the nodes' domain and plugin_namespace
_ELEMENTS = {trt.float16: "fp16", trt.bfloat16: "bf16"}
_ONNX_TYPES = {10: trt.float16, 16: trt.bfloat16}  # flash_combine's out_dtype attribute: ONNX element types
_FLOATS = "FP16|BF16"  # dependent ('|'): every attention tensor takes the same one of the two


def _element(desc: trtp.TensorDesc) -> str:
    if desc.dtype not in _ELEMENTS:
        raise ValueError(f"aotlm FlashAttention plugins: tensor type {desc.dtype}; export the graph in float16 or bfloat16")
    return _ELEMENTS[desc.dtype]


# aot_impl's return annotation is required (`_validate_aot_impl`: "No return annotation found").
# Names and PTX go back as bytes, as NVIDIA's sample (qdp_defs.py) returns them.
AotKernel = Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]


def _launch(compiled: aot.CompiledKernel, grid: tuple) -> trtp.KernelLaunchParams:
    """Launch parameters take ints or symbolic shape expressions (KernelLaunchParams wraps each in SymInt32)."""
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y = grid[0], grid[1]
    if len(grid) > 2:
        params.grid_z = grid[2]
    params.block_x = compiled.num_warps * 32
    params.shared_mem = compiled.shared_bytes
    return params


def _lengths(query: trtp.TensorDesc, key_cache: trtp.TensorDesc) -> trtp.SymIntExprs:
    """The kernels' int32 arguments: new tokens per sequence, and the cache's max context."""
    return trtp.SymIntExprs.from_tuple([trtp.SymInt32(query.shape_expr[1]), trtp.SymInt32(key_cache.shape_expr[2])])


# -- flash_attention: prefill (and any step) in one kernel ------------------------------------------------------
@trtp.register(f"{NAMESPACE}::flash_attention")
def flash_attention_desc(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                         key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc, seqlens_k: trtp.TensorDesc,
                         total: trtp.TensorDesc, num_heads: int, kv_num_heads: int,
                         head_dim: int, scale: float) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
    return query.like(), key_cache.aliased(), value_cache.aliased()


# An AutoTuneCombination names one type per input, then one per output (7 + 3 here, 7 + 4 for flash_decode).
@trtp.autotune(f"{NAMESPACE}::flash_attention")
def flash_attention_types(query, key, value, key_cache, value_cache, seqlens_k, total, outputs):
    return [trtp.AutoTuneCombination(", ".join([_FLOATS] * 5 + ["INT32", "INT32"] + [_FLOATS] * 3), "LINEAR")]


@trtp.aot_impl(f"{NAMESPACE}::flash_attention")
def flash_attention_aot(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                        key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc, seqlens_k: trtp.TensorDesc,
                        total: trtp.TensorDesc, num_heads: int, kv_num_heads: int, head_dim: int,
                        scale: float, outputs: Tuple[trtp.TensorDesc], tactic: int) -> AotKernel:
    compiled = aot.flash_attention(_element(query), num_heads, kv_num_heads, head_dim, scale)
    grid = (trtp.cdiv(query.shape_expr[1], compiled.rows_per_program), query.shape_expr[0] * num_heads)
    return compiled.name.encode(), compiled.ptx.encode(), _launch(compiled, grid), _lengths(query, key_cache)


# -- flash_decode + flash_combine: the cache split in kv_splits parts, then merged ---------------------------
@trtp.register(f"{NAMESPACE}::flash_decode")
def flash_decode_desc(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                      key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc, seqlens_k: trtp.TensorDesc,
                      total: trtp.TensorDesc, num_heads: int, kv_num_heads: int, head_dim: int, scale: float,
                      kv_splits: int, split_size: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc,
                                                                trtp.TensorDesc]:
    batch, sequence = query.shape_expr[0], query.shape_expr[1]
    partial_out = trtp.from_shape_expr((batch, sequence, num_heads, kv_splits, head_dim), dtype=trt.float32)
    partial_lse = trtp.from_shape_expr((batch, sequence, num_heads, kv_splits), dtype=trt.float32)
    return partial_out, partial_lse, key_cache.aliased(), value_cache.aliased()


@trtp.autotune(f"{NAMESPACE}::flash_decode")
def flash_decode_types(query, key, value, key_cache, value_cache, seqlens_k, total, outputs):
    types = ", ".join([_FLOATS] * 5 + ["INT32", "INT32", "FP32", "FP32"] + [_FLOATS] * 2)
    return [trtp.AutoTuneCombination(types, "LINEAR")]


@trtp.aot_impl(f"{NAMESPACE}::flash_decode")
def flash_decode_aot(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                     key_cache: trtp.TensorDesc, value_cache: trtp.TensorDesc, seqlens_k: trtp.TensorDesc,
                     total: trtp.TensorDesc, num_heads: int, kv_num_heads: int, head_dim: int, scale: float,
                     kv_splits: int, split_size: int, outputs: Tuple[trtp.TensorDesc], tactic: int) -> AotKernel:
    compiled = aot.flash_decode(_element(query), num_heads, kv_num_heads, head_dim, scale, kv_splits, split_size)
    rows = query.shape_expr[1] * (num_heads // kv_num_heads)
    grid = (kv_splits, query.shape_expr[0] * kv_num_heads, trtp.cdiv(rows, compiled.rows_per_program))
    return compiled.name.encode(), compiled.ptx.encode(), _launch(compiled, grid), _lengths(query, key_cache)


# No autotune: TensorRT then takes the network's input types (float32 partials) and register's output type
# (out_dtype), LINEAR ("An autotune function is optional", tensorrt.plugin.autotune).
@trtp.register(f"{NAMESPACE}::flash_combine")
def flash_combine_desc(partial_out: trtp.TensorDesc, partial_lse: trtp.TensorDesc, num_heads: int, head_dim: int,
                       kv_splits: int, out_dtype: int) -> trtp.TensorDesc:
    if out_dtype not in _ONNX_TYPES:
        raise ValueError(f"aotlm flash_combine: out_dtype {out_dtype} is not ONNX float16 (10) or bfloat16 (16)")
    batch, sequence = partial_out.shape_expr[0], partial_out.shape_expr[1]
    return trtp.from_shape_expr((batch, sequence, num_heads * head_dim), dtype=_ONNX_TYPES[out_dtype])


@trtp.aot_impl(f"{NAMESPACE}::flash_combine")
def flash_combine_aot(partial_out: trtp.TensorDesc, partial_lse: trtp.TensorDesc, num_heads: int, head_dim: int,
                      kv_splits: int, out_dtype: int, outputs: Tuple[trtp.TensorDesc], tactic: int) -> AotKernel:
    compiled = aot.flash_combine(_element(outputs[0]), num_heads, head_dim, kv_splits)
    grid = (partial_out.shape_expr[1], partial_out.shape_expr[0] * num_heads)
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(partial_out.shape_expr[1])])
    return compiled.name.encode(), compiled.ptx.encode(), _launch(compiled, grid), extra
