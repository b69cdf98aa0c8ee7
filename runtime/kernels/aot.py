"""Ahead-of-time compilation of the FlashAttention kernels to PTX, as the TensorRT plugins embed them.

No TensorRT here, and no GPU needed: Triton compiles for an explicit target (`GPUTarget("cuda", 90, 32)` is an
H100/H200), so the CPU test suite checks exactly what `tensorrt_plugin.aot_impl` hands TensorRT. The argument
order is the AOT plugin's: tensor inputs, int32 scalars, tensor outputs, then constexprs (floats such as the
softmax scale can only be constexprs: TensorRT passes extra kernel arguments as int32 only).

Two things Triton's own launcher hides and TensorRT's AOT launch does not do (TensorRT loads the PTX through the
CUDA driver and launches it with exactly: inputs, extra int32 scalars, outputs):
  * Recent Triton (3.4 on, per triton-lang/triton#8903; 3.9 here) appends two pointer parameters to every kernel
    entry, global_scratch and profile_scratch, and its own launcher passes them (null when unused:
    triton/backends/nvidia/driver.c, "+ 2 for global & profile scratch"; #8903: "two additional parameters
    appended in the end. Set them to null"). TensorRT's launch passes nothing for them, and NVIDIA's AOT sample
    (samples/python/quickly_deployable_plugins/qdp_defs.py) hands over asm["ptx"] unchanged (its requirements
    pinned triton 3.2.0 in an older copy, 3.5.0 at TensorRT 11.1). `_trim_hidden_parameters` checks that the kernel
    needs no scratch and never reads them, then drops them from the `.entry`, so the PTX declares exactly the
    parameters TensorRT passes (the trimmed PTX assembles with ptxas for sm_90a).
  * Triton writes `.version` from its bundled ptxas (CUDA 13.4 in triton 3.9: PTX ISA 9.4), which only as new a
    driver can JIT. Compiling on the engine's GPU machine (libcuda present), `_driver_ptx_version` caps it at what
    the installed driver accepts.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from types import SimpleNamespace

import triton
from triton.backends.compiler import GPUTarget

from runtime.kernels import flash_attention as kernels

ELEMENT_TYPES = ("fp16", "bf16")
INDEX_POINTERS = {"SEQLENS_K": "*i32", "TOTAL": "*i32", "PARTIAL_OUT": "*fp32", "PARTIAL_LSE": "*fp32"}
SCALARS = {"seq_len": "i32", "max_context": "i32"}
SHARED_MEMORY_WITHOUT_OPT_IN = 48 * 1024


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    ptx: str
    num_warps: int
    shared_bytes: int
    rows_per_program: int  # query rows a program covers (grid = cdiv(rows, this))
    hidden_parameters: int  # Triton's trailing scratch pointers dropped from the PTX entry (see the docstring)


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
    # Every tensor TensorRT hands a plugin starts 256-byte aligned (setTensorAddress: "at least 256-byte alignment";
    # its own activations too), and a slot view of the KV cache starts a whole number of rows in, a multiple of 16
    # bytes (head_dim >= 16). Triton's JIT launcher tells the compiler so itself for aligned pointers; compiled
    # ahead of time, without the hint, every load is a scalar 16-bit one (320 in the prefill kernel's PTX, against
    # 24 128-bit ones with it).
    aligned = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names)
               if signature[name].startswith("*")}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned)
    target = target or current_target()
    options = {"num_warps": num_warps, "num_stages": num_stages}  # triton.compile parses them for the target
    ptx_version = _driver_ptx_version()
    if ptx_version is not None and ptx_version < _ptxas_ptx_version(target):
        options["ptx_version"] = ptx_version
    compiled = triton.compile(source, target=target, options=options)
    if getattr(compiled.metadata, "global_scratch_size", 0) or getattr(compiled.metadata, "profile_scratch_size", 0):
        raise RuntimeError(f"{kernel.__name__}: needs Triton scratch memory, which an AOT TensorRT plugin cannot pass")
    return compiled


def _ptxas_ptx_version(target: GPUTarget) -> int:
    """The PTX ISA version Triton writes by default: the newest its bundled ptxas knows (e.g. 94 for 9.4).

    Asked through Triton's own default (options without a ptx_version): get_ptxas, which it calls, changed shape
    from release to release (3.3: get_ptxas(arch) -> (path, version); 3.4-3.5: get_ptxas() -> a tool with
    .version; 3.6 on: get_ptxas(arch) -> a tool), and calling it directly failed on all but the newest."""
    from triton.backends.nvidia.compiler import get_ptx_version_from_options

    return get_ptx_version_from_options(SimpleNamespace(ptx_version=None), target.arch)


def _driver_ptx_version() -> int | None:
    """The newest PTX ISA the installed CUDA driver can JIT (TensorRT loads AOT plugin PTX through it); None
    without a driver (CPU machines: the PTX is only inspected there)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    from triton.backends.nvidia.compiler import ptx_get_version

    return ptx_get_version(f"{version.value // 1000}.{version.value % 1000 // 10}")


def _trim_hidden_parameters(ptx: str, name: str, declared: int) -> tuple[str, int]:
    """Drop the parameters Triton appends after the kernel's own `declared` ones (global / profile scratch),
    after checking that there are at most two and that the kernel body never loads them."""
    start = ptx.index(f".entry {name}(")
    end = ptx.index(")", start)
    parameters = re.findall(rf"\.param[^,\n]*?\b({re.escape(name)}_param_\d+)", ptx[start:end])
    hidden = parameters[declared:]
    if len(parameters) < declared or len(hidden) > 2:
        raise RuntimeError(f"{name}: the PTX entry has {len(parameters)} parameters, the kernel declares {declared} "
                           f"(+ at most Triton's 2 scratch pointers); this Triton's calling convention is unknown here")
    body = ptx[end:]
    used = [parameter for parameter in hidden if f"[{parameter}]" in body]
    if used:
        raise RuntimeError(f"{name}: the kernel reads Triton's hidden parameters {used}, which an AOT TensorRT "
                           f"plugin launch does not pass")
    if not hidden:
        return ptx, 0
    lines = [line for line in ptx[start:end].split("\n")
             if not any(re.search(rf"\b{parameter}\b", line) for parameter in hidden)]
    last = max(index for index, line in enumerate(lines) if "_param_" in line or ".entry" in line)
    lines[last] = lines[last].rstrip().rstrip(",")  # the last kept parameter now closes the list
    return ptx[:start] + "\n".join(lines) + ptx[end:], len(hidden)


def _result(compiled, kernel, constants: dict, rows_per_program: int) -> CompiledKernel:
    name = compiled.metadata.name
    declared = sum(1 for argument in kernel.arg_names if argument not in constants)  # what TensorRT passes
    ptx, hidden = _trim_hidden_parameters(compiled.asm["ptx"], name, declared)
    return CompiledKernel(name, ptx, compiled.metadata.num_warps, compiled.metadata.shared, rows_per_program, hidden)


def flash_attention(element: str, num_heads: int, kv_heads: int, head_dim: int, scale: float,
                    target: GPUTarget | None = None) -> CompiledKernel:
    """attention_kernel; grid (cdiv(S, rows_per_program), B * num_heads)."""
    blocks = kernels.prefill_blocks(head_dim)
    while True:
        constants = {"NUM_HEADS": num_heads, "KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "SCALE": scale,
                     "BLOCK_M": blocks.block_m, "BLOCK_N": blocks.block_n, "DOT_IN_FP32": False}
        compiled = compile_kernel(kernels.attention_kernel, element, constants, blocks.num_warps, blocks.num_stages,
                                  target)
        # Above 48 KiB a kernel must be opted in to more dynamic shared memory (cuFuncSetAttribute), and nothing
        # says TensorRT's AOT launch does that: narrower key tiles instead (128x64 at D128 needs 64 KiB).
        if compiled.metadata.shared <= SHARED_MEMORY_WITHOUT_OPT_IN:
            return _result(compiled, kernels.attention_kernel, constants, blocks.block_m)
        if blocks.block_n <= 16:
            raise _too_much_shared_memory("flash_attention", compiled.metadata.shared, num_heads, kv_heads, head_dim)
        blocks = kernels.PrefillBlocks(blocks.block_m, blocks.block_n // 2, blocks.num_warps, blocks.num_stages)


def flash_decode(element: str, num_heads: int, kv_heads: int, head_dim: int, scale: float, kv_splits: int,
                 split_size: int, target: GPUTarget | None = None) -> CompiledKernel:
    """decode_split_kernel; grid (kv_splits, B * kv_heads, cdiv(S * group, rows_per_program)): a program's rows
    are (new token, head of the group) pairs."""
    blocks = kernels.decode_blocks(head_dim, num_heads // kv_heads)
    while True:  # within 48 KiB as flash_attention: narrower key tiles (a large head or head group needs them)
        constants = {"NUM_HEADS": num_heads, "KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "SCALE": scale,
                     "SPLIT_SIZE": split_size, "NUM_SPLITS": kv_splits, "BLOCK_N": blocks.block_n,
                     "BLOCK_R": blocks.block_r, "DOT_IN_FP32": False}
        compiled = compile_kernel(kernels.decode_split_kernel, element, constants, blocks.num_warps, 2, target)
        if compiled.metadata.shared <= SHARED_MEMORY_WITHOUT_OPT_IN:
            return _result(compiled, kernels.decode_split_kernel, constants, blocks.block_r)
        if blocks.block_n <= 16:
            raise _too_much_shared_memory("flash_decode", compiled.metadata.shared, num_heads, kv_heads, head_dim)
        blocks = kernels.DecodeBlocks(blocks.block_n // 2, blocks.block_r, blocks.num_warps)


def _too_much_shared_memory(kernel: str, shared: int, num_heads: int, kv_heads: int, head_dim: int) -> ValueError:
    return ValueError(f"the {kernel} plugin kernel needs {shared} bytes of shared memory for {num_heads} heads over "
                      f"{kv_heads} kv heads of head_dim {head_dim}, above the 48 KiB a TensorRT AOT launch gets "
                      f"without opting in; use lower_tensorrt's attention: trt_native (TensorRT >= 11)")


def flash_combine(element: str, num_heads: int, head_dim: int, kv_splits: int,
                  target: GPUTarget | None = None) -> CompiledKernel:
    """combine_kernel; grid (S, B * num_heads)."""
    constants = {"NUM_HEADS": num_heads, "HEAD_DIM": head_dim, "NUM_SPLITS": kv_splits}
    compiled = compile_kernel(kernels.combine_kernel, element, constants, 4, 1, target)
    return _result(compiled, kernels.combine_kernel, constants, 1)
