"""Ahead-of-time compilation of the FlashAttention kernels to PTX, as the TensorRT plugins embed them.

No TensorRT here, and no GPU needed: Triton compiles for an explicit target (`GPUTarget("cuda", 90, 32)` is an
H100/H200), so the CPU test suite checks exactly what `tensorrt_plugin.aot_impl` hands TensorRT. The argument
order is the AOT plugin's: tensor inputs, int32 scalars, tensor outputs, then constexprs (floats such as the
softmax scale can only be constexprs: TensorRT passes extra kernel arguments as int32 only).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget

from runtime.kernels import flash_attention as kernels

ELEMENT_TYPES = ("fp16", "bf16")
INDEX_POINTERS = {"SEQLENS_K": "*i32", "TOTAL": "*i32", "PARTIAL_OUT": "*fp32", "PARTIAL_LSE": "*fp32"}
SCALARS = {"seq_len": "i32", "max_context": "i32"}


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    ptx: str
    num_warps: int
    shared_bytes: int
    rows_per_program: int  # query rows a program covers (grid = cdiv(rows, this))


def current_target() -> GPUTarget:
    return triton.runtime.driver.active.get_current_target()


def compile_kernel(kernel, element: str, constants: dict, num_warps: int, num_stages: int,
                   target: GPUTarget | None) -> triton.compiler.CompiledKernel:
    if element not in ELEMENT_TYPES:
        raise ValueError(f"FlashAttention kernels take fp16 or bf16 tensors, not {element!r}")
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = INDEX_POINTERS.get(name) or SCALARS.get(name) or f"*{element}"
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants)
    target = target or current_target()
    options = triton.compiler.make_backend(target).parse_options({"num_warps": num_warps, "num_stages": num_stages})
    compiled = triton.compile(source, target=target, options=options.__dict__)
    if getattr(compiled.metadata, "global_scratch_size", 0) or getattr(compiled.metadata, "profile_scratch_size", 0):
        raise RuntimeError(f"{kernel.__name__}: needs Triton scratch memory, which an AOT TensorRT plugin cannot pass")
    return compiled


def _result(compiled, rows_per_program: int) -> CompiledKernel:
    return CompiledKernel(compiled.metadata.name, compiled.asm["ptx"], compiled.metadata.num_warps,
                          compiled.metadata.shared, rows_per_program)


def flash_attention(element: str, num_heads: int, kv_heads: int, head_dim: int, scale: float,
                    target: GPUTarget | None = None) -> CompiledKernel:
    """attention_kernel; grid (cdiv(S, rows_per_program), B * num_heads)."""
    blocks = kernels.prefill_blocks(head_dim)
    compiled = compile_kernel(kernels.attention_kernel, element, {
        "NUM_HEADS": num_heads, "KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "SCALE": scale,
        "BLOCK_M": blocks.block_m, "BLOCK_N": blocks.block_n, "DOT_IN_FP32": False},
        blocks.num_warps, blocks.num_stages, target)
    return _result(compiled, blocks.block_m)


def flash_decode(element: str, num_heads: int, kv_heads: int, head_dim: int, scale: float, kv_splits: int,
                 split_size: int, target: GPUTarget | None = None) -> CompiledKernel:
    """decode_split_kernel; grid (kv_splits, B * kv_heads, cdiv(S * group, rows_per_program)): a program's rows
    are (new token, head of the group) pairs."""
    blocks = kernels.decode_blocks(head_dim, num_heads // kv_heads)
    compiled = compile_kernel(kernels.decode_split_kernel, element, {
        "NUM_HEADS": num_heads, "KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "SCALE": scale,
        "SPLIT_SIZE": split_size, "NUM_SPLITS": kv_splits, "BLOCK_N": blocks.block_n, "BLOCK_R": blocks.block_r,
        "DOT_IN_FP32": False}, blocks.num_warps, 2, target)
    return _result(compiled, blocks.block_r)


def flash_combine(element: str, num_heads: int, head_dim: int, kv_splits: int,
                  target: GPUTarget | None = None) -> CompiledKernel:
    """combine_kernel; grid (S, B * num_heads)."""
    compiled = compile_kernel(kernels.combine_kernel, element,
                              {"NUM_HEADS": num_heads, "HEAD_DIM": head_dim, "NUM_SPLITS": kv_splits}, 4, 1, target)
    return _result(compiled, 1)
