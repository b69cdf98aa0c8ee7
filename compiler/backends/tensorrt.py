"""TensorRT backend build: one serialized engine per phase from the final graphs, with a timing cache.

TensorRT >= 11 is strongly typed: an engine computes in the graph's own types, so a float16 / bfloat16 engine
starts from a graph exported in that type (`export.dtype`), and no precision flag is set (they are gone in 11).
Attention arrives lowered by `passes/lower_tensorrt.py` to the project's Triton plugins (registered by
`runtime/kernels/tensorrt_plugin.py`, compiled ahead of time into the engine) or to TensorRT's own attention.
Quantized weights arrive as DequantizeLinear -> MatMul (`quantize` with `lowering: dequantize_linear`).

One optimization profile per engine, from the recipe (`optimization_profiles`):
    prefill  batch 1..max_batch (opt 1), sequence 1..max_context (opt prefill_opt_tokens), mask width the same
    decode   batch 1..max_batch (opt max_batch), sequence 1..decode_max_tokens (opt 1), mask width 1..max_context
             (opt max_context: the runtime binds a full-width mask so a decode step has one shape, for CUDA graphs)
    caches   [batch, kv_heads, max_context, head_dim]: only the batch varies.
The timing cache lives beside the artifacts (`<output root>/<timing_cache>`), keyed inside by TensorRT; a second
build of any recipe on the same GPU reuses its kernel timings.

Written against TensorRT's Python API (10.x and 11.x; ../shared/reference/tensorrt-api.md) and not yet run:
this project's machines have no TensorRT. What needs no TensorRT (recipe checks, profiles, manifest fields) is
tested on CPU in tests/compiler/test_tensorrt_backend.py.
"""
from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path

import onnx

from compiler.artifact import scratch_folder
from compiler.backends.onnxruntime import io_spec
from compiler.errors import BuildError
from passes.lower_tensorrt import PLUGIN_NAMESPACE, PLUGIN_OPS
from passes.quantize import methods_used
from runtime.results import process_umask

INT4_BLOCK_SIZES = (64, 128)  # TensorRT's INT4 weight-only blocks ("supported block sizes are {64, 128}")


def check_recipe(recipe) -> None:
    """What TensorRT cannot build, refused before the slow export (each message names the key and the fix)."""
    names = [spec.name for spec in recipe.passes]
    if "lower_onnxruntime" in names:
        raise BuildError("passes: lower_onnxruntime emits onnxruntime's GroupQueryAttention, which TensorRT cannot "
                         "parse; use lower_tensorrt for backend tensorrt")
    if "fuse_attention" in names and "lower_tensorrt" not in names and "lower_onnx_attention" not in names:
        raise BuildError("passes: fuse_attention leaves aotlm.FlashAttention nodes; add lower_tensorrt after it")
    for index, spec in enumerate(recipe.passes):
        # Attention-23 lowering writes the cache with ScatterElements into new present outputs; the TensorRT runtime
        # binds each present output to its past buffer, which TensorRT documents only for aliased plugin outputs
        # and TRT_KVCacheUpdate, so this form is refused rather than run on an unverified aliasing.
        if spec.name == "lower_onnx_attention" or (spec.name == "lower_tensorrt" and
                                                   spec.options.attention == "onnx_attention"):
            key = "lower_onnx_attention" if spec.name == "lower_onnx_attention" else "lower_tensorrt.attention"
            raise BuildError(f"passes[{index}].{key}: Attention-23 writes the KV cache with ScatterElements into new "
                             f"outputs, not in place as the TensorRT runtime binds it; use lower_tensorrt with "
                             f"attention: plugin (default) or trt_native for backend tensorrt")
    for index, spec in enumerate(recipe.passes):
        if spec.name == "quantize_kv_cache":
            raise BuildError(f"passes[{index}]: quantize_kv_cache stores onnxruntime's int8 GroupQueryAttention cache, "
                             f"which TensorRT cannot run: remove it for backend tensorrt")
        if spec.name in ("fuse_rms_norm", "fuse_silu"):
            raise BuildError(f"passes[{index}]: {spec.name} emits onnxruntime-only ops; TensorRT fuses these "
                             f"patterns itself: remove it for backend tensorrt")
        if spec.name != "quantize":
            continue
        options = spec.options
        calibrating = sorted(methods_used(options) - {"rtn"})
        if recipe.export.dtype == "bfloat16" and (calibrating or options.calibration is not None):
            # calibration and the accuracy report run the float graph on onnxruntime's CPU kernels, which have none
            # for bfloat16 arithmetic (it failed after the export, at the first Mul)
            what = f"method {', '.join(calibrating)}" if calibrating else "a calibration set (the accuracy report)"
            raise BuildError(f"passes[{index}].quantize: {what} with export.dtype bfloat16: calibration runs the "
                             f"graph on onnxruntime's CPU kernels, which have no bfloat16 arithmetic; use "
                             f"export.dtype float16, or method rtn without calibration")
        if options.lowering != "dequantize_linear":
            raise BuildError(f"passes[{index}].quantize.lowering: {options.lowering!r} is onnxruntime's MatMulNBits; "
                             f"use dequantize_linear for backend tensorrt")
        if options.full_range:
            raise BuildError(f"passes[{index}].quantize.full_range: true gives negative scales; TensorRT's "
                             f"DequantizeLinear takes strictly positive ones: remove full_range for backend tensorrt")
        for where, bits, block, symmetric in _quantize_choices(options):
            if bits == 4 and not symmetric:  # INT8 is always symmetric (per channel)
                raise BuildError(f"passes[{index}].quantize{where}.symmetric: false; TensorRT's DequantizeLinear "
                                 f"takes no zero point: use symmetric: true")
            if bits == 4 and block not in INT4_BLOCK_SIZES:
                raise BuildError(f"passes[{index}].quantize{where}.block_size: {block}; TensorRT's INT4 weights take "
                                 f"blocks of {' or '.join(map(str, INT4_BLOCK_SIZES))}")
        if options.embedding == "quantized":
            raise BuildError(f"passes[{index}].quantize.embedding: quantized needs onnxruntime's GatherBlockQuantized;"
                             f" use embedding: float for backend tensorrt")
    if recipe.export.dtype == "float32":
        raise BuildError("export.dtype: float32 for backend tensorrt builds a float32/TF32 engine (strong typing); "
                         "use float16 or bfloat16")
    if "lower_tensorrt" not in names:  # the exported graph writes its cache as Attention-23 does (above)
        raise BuildError("passes: backend tensorrt needs fuse_attention, then lower_tensorrt: without them the decode "
                         "graph writes the KV cache with ScatterElements into new outputs, not in place as the "
                         "TensorRT runtime binds it (see recipes/smollm2-135m-tensorrt.yaml)")
    spec = recipe.backend.tensorrt
    if spec.decode_max_tokens > recipe.export.max_context:  # a decode call's tokens all go into the cache
        raise BuildError(f"backend.tensorrt.decode_max_tokens: {spec.decode_max_tokens} is more than "
                         f"export.max_context ({recipe.export.max_context}); give at most {recipe.export.max_context}")
    cache = Path(spec.timing_cache)
    if not spec.timing_cache or cache.is_absolute() or ".." in cache.parts or cache.name in ("", "."):
        raise BuildError(f"backend.tensorrt.timing_cache: {spec.timing_cache!r} must be a file name relative to the "
                         f"output folder, without '..' (e.g. tensorrt-timing.cache): the build writes it there")


def check_graphs(graphs: dict[str, onnx.ModelProto]) -> None:
    """What the passes produced that TensorRT cannot read or bind, refused before the engine build: an INT4 weight
    whose blocks are not 64 or 128 long (quantize shrinks the block of a layer whose K is shorter than the
    recipe's), and a KV cache whose sequences do not each start 256-byte aligned (check_cache_rows)."""
    int4 = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4}
    for phase, model in graphs.items():
        check_cache_rows(phase, model)
        left = next((node for node in model.graph.node if node.domain == PLUGIN_NAMESPACE
                     and node.op_type not in PLUGIN_OPS), None)
        if left is not None:  # no TensorRT plugin of that name: the parser would fail with its own message
            raise BuildError(f"{phase} graph, {left.name}: {left.domain}.{left.op_type} is left, which TensorRT cannot "
                             f"parse; lower_tensorrt lowers every fused node unless a max_rewrites stops it or it runs "
                             f"before fuse_attention")
        types = {t.name: t.data_type for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type != "DequantizeLinear" or types.get(node.input[0]) not in int4:
                continue
            block = next((a.i for a in node.attribute if a.name == "block_size"), None)
            if block not in INT4_BLOCK_SIZES:
                raise BuildError(f"{phase} graph, {node.name}: INT4 weights in blocks of {block or 'a whole axis'}; "
                                 f"TensorRT reads INT4 only in blocks of {' or '.join(map(str, INT4_BLOCK_SIZES))} "
                                 f"(this layer's input is shorter than the recipe's block): give it bits: 8 or skip: "
                                 f"true with a quantize override")


# The oldest TensorRT whose ONNX parser reads what the lowering emits: RotaryEmbedding-23 (plugin attention) since
# 10.15, TRT_Attention / TRT_KVCacheUpdate (trt_native) since 11.0.
OP_RELEASES = {("", "RotaryEmbedding"): (10, 15), ("trt", "TRT_Attention"): (11, 0),
               ("trt", "TRT_KVCacheUpdate"): (11, 0)}


def check_release(version: str, graphs: dict[str, onnx.ModelProto]) -> None:
    """Refuse, before any engine build, a TensorRT older than the ops in the graphs need (its parser would fail on
    them with a message about an unknown op, or the builder on a missing preview feature)."""
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    domain = lambda node: "" if node.domain == "ai.onnx" else node.domain  # noqa: E731  (the default's alias)
    needed = [(OP_RELEASES[domain(node), node.op_type], node.op_type) for model in graphs.values()
              for node in model.graph.node if (domain(node), node.op_type) in OP_RELEASES]
    if needed:
        floor, op = max(needed)
        if release < floor:
            raise BuildError(f"TensorRT {version} cannot read the graphs' {op} nodes: they need TensorRT "
                             f"{floor[0]}.{floor[1]} or newer; install a newer tensorrt (the gpu extra)")


ADDRESS_ALIGNMENT = 256  # bytes: setTensorAddress "must have at least 256-byte alignment"


def check_cache_rows(phase: str, model: onnx.ModelProto) -> None:
    """The scheduler binds rows lo:hi of one cache buffer per layer [slots, kv_heads, max_context, head_dim] as a
    batch: its address is lo whole rows in, so a row's bytes must be a multiple of TensorRT's address alignment."""
    for value in model.graph.input:
        if not value.name.startswith("past_key_values."):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).itemsize
        if len(dims) != 4 or None in dims[1:]:
            continue  # a symbolic max context is refused by lower_tensorrt, with its reason
        check_cache_alignment(*dims[1:], itemsize, f"in the {phase} graph ")
        return  # every layer's cache has the same shape


def check_cache_alignment(kv_heads: int, max_context: int, head_dim: int, itemsize: int, where: str = "") -> None:
    """check_cache_rows' arithmetic, also run on the model's config before the export (recipe_checks)."""
    row = kv_heads * head_dim * itemsize  # bytes per cached position of one sequence
    if (row * max_context) % ADDRESS_ALIGNMENT:
        step = ADDRESS_ALIGNMENT // math.gcd(ADDRESS_ALIGNMENT, row)
        fitting = -(-max_context // step) * step
        raise BuildError(f"export.max_context: {max_context}: {where}a sequence's cache rows take {kv_heads} x "
                         f"{max_context} x {head_dim} x {itemsize} bytes, not a multiple of {ADDRESS_ALIGNMENT}, so "
                         f"the scheduler's slots would start at addresses TensorRT refuses; use a multiple of {step} "
                         f"({fitting})")


def _quantize_choices(options):
    yield "", options.bits, options.block_size, options.symmetric
    for number, override in enumerate(options.overrides):
        if override.skip:
            continue
        yield (f".overrides[{number}]", override.bits or options.bits, override.block_size or options.block_size,
               options.symmetric if override.symmetric is None else override.symmetric)


def optimization_profiles(engines_io: dict[str, dict], max_batch: int, max_context: int, spec) -> dict[str, dict]:
    """Per phase, per input: [min, opt, max] shapes. engines_io is the manifest's io spec per phase."""
    prompt = (1, min(spec.prefill_opt_tokens, max_context), max_context)
    ranges = {  # the prefill mask's width ("total") is the prompt's: the runtime runs no chunk after a past on it
        "prefill": {"batch": (1, 1, max_batch), "sequence": prompt, "total": prompt},
        "decode": {"batch": (1, max_batch, max_batch), "sequence": (1, 1, spec.decode_max_tokens),
                   "total": (1, max_context, max_context)},
    }
    profiles = {}
    for phase, io in engines_io.items():
        profile = {}
        for tensor in io["inputs"]:
            shape = []
            for dim in tensor["shape"]:
                if isinstance(dim, int) and dim > 0:
                    shape.append((dim, dim, dim))
                elif dim in ranges.get(phase, {}):
                    shape.append(ranges[phase][dim])
                else:
                    raise BuildError(f"{phase} graph input {tensor['name']}: dimension {dim!r} has no range for a "
                                     f"TensorRT optimization profile")
            profile[tensor["name"]] = [list(bounds) for bounds in zip(*shape)]  # [[min...], [opt...], [max...]]
        profiles[phase] = profile
    return profiles


def plugin_ops(model: onnx.ModelProto) -> list[str]:
    return sorted({node.op_type for node in model.graph.node if node.domain == PLUGIN_NAMESPACE and node.op_type in PLUGIN_OPS})


def _tensorrt():
    try:
        import tensorrt as trt
        import torch
    except ImportError as error:
        raise BuildError(f"backend tensorrt needs the tensorrt package and torch with CUDA ({error}); install "
                         f"aotlm[gpu] on a machine with an NVIDIA GPU") from None
    if not torch.cuda.is_available():
        raise BuildError("backend tensorrt needs an NVIDIA GPU: torch.cuda.is_available() is False on this machine")
    return trt, torch


def _network_flags(trt) -> int:
    flags = 0
    creation = trt.NetworkDefinitionCreationFlag
    if hasattr(creation, "STRONGLY_TYPED"):  # opt-in on 10.x, ignored (always on) on 11.x
        flags |= 1 << int(creation.STRONGLY_TYPED)
    if hasattr(creation, "PREFER_AOT_PYTHON_PLUGINS"):  # our plugins define only aot_impl; say so anyway
        flags |= 1 << int(creation.PREFER_AOT_PYTHON_PLUGINS)
    return flags


def attach_timing_cache(config, cached: bytes, say) -> None:
    """Start from the kept timing cache, or from an empty one when TensorRT refuses it (set_timing_cache returns
    False: a cache from another TensorRT version or GPU, ignore_mismatch being off); the build then rewrites it."""
    kept = config.create_timing_cache(cached)  # None where TensorRT cannot read the bytes at all
    if kept is not None and config.set_timing_cache(kept, ignore_mismatch=False):
        return
    if cached:
        why = "cannot be read" if kept is None else "is from another TensorRT version or GPU"
        say(f"TensorRT: the kept timing cache {why}; starting an empty one")
    empty = config.create_timing_cache(b"") if cached else None
    if not cached or empty is None or not config.set_timing_cache(empty, ignore_mismatch=False):
        raise BuildError("TensorRT refused an empty timing cache; its log above says why")


def _build_one(trt, logger, onnx_path: Path, profile: dict, spec, timing_cache_bytes: bytes, say):
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT could not parse {onnx_path.name}:\n{errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, spec.workspace_gib << 30)
    config.builder_optimization_level = spec.optimization_level
    aliased_io = getattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03", None)  # 10.3-11.1; a later one may drop it
    if aliased_io is not None:
        config.set_preview_feature(aliased_io, True)  # in-place KV cache in plugins
    optimization = builder.create_optimization_profile()
    for name, (low, opt, high) in profile.items():
        optimization.set_shape(name, low, opt, high)
    if config.add_optimization_profile(optimization) < 0:  # -1: TensorRT found the profile invalid (logged above)
        raise BuildError(f"TensorRT refused the optimization profile of {onnx_path.name}: {profile}")
    attach_timing_cache(config, timing_cache_bytes, say)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(f"TensorRT could not build an engine from {onnx_path.name}; its log above says why")
    return bytes(plan), bytes(config.get_timing_cache().serialize())


def backend_section(version: str, gpu: str, capability: tuple[int, int], plugins: list[str], spec,
                    timing_cache_path: Path) -> dict:
    """The manifest's backend section: what the runtime checks (version, compute capability) and what it uses."""
    return {"name": "tensorrt", "version": version, "gpu": gpu, "compute_capability": f"{capability[0]}.{capability[1]}",
            "plugins": [f"{PLUGIN_NAMESPACE}::{op}" for op in plugins], "timing_cache": str(timing_cache_path),
            "cuda_graphs": spec.cuda_graphs, "decode_max_tokens": spec.decode_max_tokens}


def require_tensorrt() -> None:
    """Fail fast (before the export) on a machine that cannot build engines."""
    _tensorrt()


def write_engines(graphs: dict[str, onnx.ModelProto], folder: Path, recipe, aliases: dict[str, str],
                  output_root: Path, progress=None) -> dict:
    """Build <phase>.engine into folder; returns the manifest's engines and backend sections. The graphs are
    consumed: saving them for the parser moves their weights out to files that are gone afterwards."""
    say = progress or (lambda line: None)
    check_graphs(graphs)
    trt, torch = _tensorrt()
    check_release(trt.__version__, graphs)
    spec = recipe.backend.tensorrt
    plugins = sorted({op for model in graphs.values() for op in plugin_ops(model)})
    if plugins:
        import runtime.kernels.tensorrt_plugin  # noqa: F401  registers the plugins before any parse
    engines_io = {phase: io_spec(model, aliases) for phase, model in graphs.items()}
    profiles = optimization_profiles(engines_io, recipe.export.max_batch, recipe.export.max_context, spec)
    timing_cache_path = Path(output_root) / spec.timing_cache
    if timing_cache_path.is_dir():  # before the engine builds (minutes), not when the cache is written after them
        raise BuildError(f"backend.tensorrt.timing_cache: {timing_cache_path} is a folder; name a file")
    timing_cache = timing_cache_path.read_bytes() if timing_cache_path.is_file() else b""
    logger = trt.Logger(trt.Logger.WARNING)
    engines = {}
    with scratch_folder("tensorrt") as scratch:
        for phase, model in graphs.items():
            onnx_path = Path(scratch) / f"{phase}.onnx"  # external data beside it: parse_from_file resolves it
            onnx.save_model(model, onnx_path, save_as_external_data=True, location=f"{phase}.weights")
            say(f"TensorRT: building the {phase} engine (profile {profiles[phase]})")
            plan, timing_cache = _build_one(trt, logger, onnx_path, profiles[phase], spec, timing_cache, say)
            (folder / f"{phase}.engine").write_bytes(plan)
            engines[phase] = {"file": f"{phase}.engine", "backend": "tensorrt", **engines_io[phase],
                              "profile": profiles[phase]}
    timing_cache_path.parent.mkdir(parents=True, exist_ok=True)
    # Shared by every build under the output root: written whole or not at all (a build killed mid-write would
    # leave a truncated cache that the next build's create_timing_cache reads).
    # A file of its own (mkstemp): named by the PID, two containers' builds (the same PID in each) finishing together
    # wrote one file, one replace failed after every engine was built, and the other published the first's bytes.
    descriptor, partial = tempfile.mkstemp(prefix=f".{timing_cache_path.name}.", suffix=".partial",
                                           dir=timing_cache_path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(timing_cache)
        os.chmod(partial, 0o666 & ~process_umask())  # mkstemp makes it private: as open() would make it
        os.replace(partial, timing_cache_path)
    except BaseException:  # a full disk: no partial file left in the output folder
        Path(partial).unlink(missing_ok=True)
        raise
    backend = backend_section(trt.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability(),
                              plugins, spec, timing_cache_path)
    warning = plugin_leak_warning(trt.__version__, plugins)
    if warning:
        say(f"warning: {warning}")
        backend["warnings"] = [warning]
    return {"engines": engines, "backend": backend}


def plugin_leak_warning(version: str, plugins: list[str]) -> str | None:
    """TensorRT 11.1 and 11.2.1 leak CUDA modules of ahead-of-time Python plugins on every new input shape
    (NVIDIA/TensorRT#4849, open): prefill sees a new prompt length on almost every request. The issue names the
    releases it was measured on and is not fixed, so every release from 11.1 on is warned about (11.2.0 between
    the two measured ones included) until a release says it fixed it."""
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if plugins and release >= (11, 1):
        measured = release == (11, 1) or tuple(re.findall(r"\d+", version)[:3]) == ("11", "2", "1")
        leaks, known = ("leaks", "") if measured else ("may leak", "; measured on 11.1 and 11.2.1, fixed in none yet")
        return (f"TensorRT {version} {leaks} GPU memory with ahead-of-time Python plugins on each new input shape "
                f"(NVIDIA/TensorRT#4849, open{known}): a long-running server's memory grows with every new prompt "
                f"length; use TensorRT 10.x or lower_tensorrt attention: trt_native")
    return None
