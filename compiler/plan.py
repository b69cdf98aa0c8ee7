"""`aotlm plan`: how much memory a model needs on a device, and the speed-of-light latencies it can reach.

Everything is counted from the model's config (no weights are read): parameters, weight bytes at each
precision, KV-cache bytes, the largest batch that fits, and lower bounds on time — prefill as compute-bound
(2 x projection params x prompt FLOPs at the device's peak), decode as bandwidth-bound (every weight byte, but
for an untied embedding table, and every cached KV byte read once per step). Real kernels reach some fraction of these peaks; the bounds say where
the floor is, not what a run will take. An artifact is planned as built: its weight and KV-cache dtypes are
the defaults, and its weight bytes are its manifest's; a recipe's quantized weights or cache are its defaults too.
On `cpu`, an artifact's decode steps are also timed.
"""
from __future__ import annotations

import json
import math
import os
import re
import socket
import statistics
import sys
import threading
import time
import timeit
from datetime import datetime, timezone
from pathlib import Path

from compiler.errors import BuildError
from compiler.frontend import hub_id_hint
from compiler.frontend.config import SUPPORTED_ARCHITECTURES, DecoderConfig
from passes.quantize_patterns import Product, matches, packed_parts, pattern_problem
from runtime.cpus import default_intra_op_threads, usable_cpus
from runtime.results import write_json
from runtime.versions import pip_install

# Dense peaks (NVIDIA's datasheets mark Tensor Core figures "with sparsity", twice these): bandwidth in bytes/s,
# fp16 = dense FP16 Tensor FLOP/s, int8 = dense INT8 Tensor OP/s. Memory: the total nvidia-smi reports, in bytes
# (MiB x 2**20). A datasheet's "80 GB" is nearer 80 GiB than 80e9 bytes: the H100's 81,559 MiB are 85.5e9 bytes.
MIB = 2**20
DEVICES = {
    # NVIDIA H100 datasheet, H100 SXM: 80 GB HBM3, 3.35 TB/s, FP16 Tensor 1,979* TFLOPS, INT8 Tensor 3,958* TOPS;
    # nvidia-smi: 81,559 MiB
    "H100": dict(name="NVIDIA H100 SXM 80GB", memory=81559 * MIB, bandwidth=3.35e12, fp16=989e12, int8=1979e12),
    # NVIDIA H200 datasheet, H200 SXM: 141 GB HBM3e, 4.8 TB/s, the H100 SXM's Tensor Core figures; nvidia-smi:
    # 143,771 MiB
    "H200": dict(name="NVIDIA H200 SXM 141GB", memory=143771 * MIB, bandwidth=4.8e12, fp16=989e12, int8=1979e12),
    # NVIDIA A100 datasheet, A100 80GB SXM: 2,039 GB/s, FP16 Tensor 312 (624*) TFLOPS, INT8 624 (1,248*) TOPS;
    # nvidia-smi: 81,920 MiB
    "A100": dict(name="NVIDIA A100 SXM 80GB", memory=81920 * MIB, bandwidth=2.039e12, fp16=312e12, int8=624e12),
    # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, FP16 Tensor 362.05 (733*) TFLOPS, FP8 733 (1,466*) TFLOPS;
    # INT8 runs at the FP8 rate on Ada (the L40 datasheet lists INT8 = FP8); nvidia-smi: 46,068 MiB (ECC on)
    "L40S": dict(name="NVIDIA L40S 48GB", memory=46068 * MIB, bandwidth=0.864e12, fp16=362e12, int8=733e12),
    # NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, FP16 Tensor 242* TFLOPS, INT8 485* TOPS (lists only sparse; / 2);
    # nvidia-smi: 23,034 MiB
    "L4": dict(name="NVIDIA L4 24GB", memory=23034 * MIB, bandwidth=0.3e12, fp16=121e12, int8=242.5e12),
    # NVIDIA Ada Lovelace whitepaper, RTX 4090: 24 GB GDDR6X, 1,008 GB/s; FP16 Tensor with FP32 accumulate 165.2
    # (330.4*) TFLOPS (330.3 with FP16 accumulate; frameworks accumulate in FP32), INT8 Tensor 660.6 (1,321.2*) TOPS;
    # nvidia-smi: 24,564 MiB
    "RTX4090": dict(name="NVIDIA GeForce RTX 4090", memory=24564 * MIB, bandwidth=1.008e12, fp16=165.2e12,
                    int8=660.6e12),
    "cpu": None,  # this machine, measured (measure_cpu) and cached under ~/.cache/aotlm/
}
ALIASES = {"h100sxm": "H100", "h100sxm5": "H100", "h200sxm": "H200", "a10080gb": "A100", "a100sxm": "A100",
           "4090": "RTX4090", "geforcertx4090": "RTX4090"}
WEIGHT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}
FLOAT_PRECISIONS = ("fp32", "fp16", "bf16")
KV_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
INT4_BLOCK, INT4_SCALE_BYTES = 32, 2  # one fp16 scale per 32 weights: +2/32 = 0.0625 bytes per parameter


def _cpu_cache_file() -> Path | None:
    """$XDG_CACHE_HOME/aotlm/cpu.json, ~/.cache's by default; None without a home folder (a container's user id with
    no passwd entry, as OpenShift runs them: Path.home() raised at import, and every `aotlm plan` failed)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # unset, or relative: ignored, as the XDG specification says
        try:
            base = Path.home() / ".cache"
        except RuntimeError:
            return None
    return Path(base) / "aotlm" / "cpu.json"


CACHE_FILE = _cpu_cache_file()  # None: the figures are measured on every call
MAX_OTHER_CORES = 0.25  # mean cores other processes may keep busy while this machine's figures are measured
AS_BUILT = "the artifact's weights file"  # where an artifact's planned weight bytes come from
RECIPE_QUANTIZE = "the recipe's quantize options"  # a recipe's: its blocks, scales and embedding choice
EXPORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # a recipe's export.dtype, as planned
NOT_COUNTED = "activations, workspace (GEMM/attention scratch), CUDA context / runtime, fragmentation"


def resolve_device(name: str) -> str:
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    known = {re.sub(r"[^a-z0-9]", "", k.lower()): k for k in DEVICES} | ALIASES
    if key not in known:
        raise BuildError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}")
    return known[key]


def read_bandwidth(threads: int, size_bytes: int = 512 * 2**20) -> float:
    """Bytes/s that `threads` threads read together, each taking the max of its own part of one array, best of 3.

    A decode step streams its weights (and the KV cache) on every core and writes little, so its floor is read
    bandwidth over all cores. What this measured before, one thread's copy (bytes read + written), gave 39.9 GB/s
    on a 2-core VM whose two cores read 44-48 GB/s this way (one core: 36), and the default model's decode steps
    there came out faster than that "bound" (measured / predicted 0.93x; 0.94x against this figure, so it is an
    estimate still: onnxruntime's one-row products stream a little faster than numpy). The max is the lightest
    of numpy's reductions here (a float32 sum ran at 22 GB/s on one core, bound by its adds), and numpy releases
    the GIL inside it, so the threads read at once; the array is far larger than any last-level cache."""
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    data = np.ones(size_bytes // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    # The barrier holds every part until all threads hold one: a pool thread that finished early would otherwise
    # take a second part, and the reads would partly run one after another.
    start_together = threading.Barrier(threads)

    def read(part) -> float:
        start_together.wait()
        return float(np.max(part))

    with ThreadPoolExecutor(threads) as pool:
        def read_all() -> None:
            list(pool.map(read, parts))

        read_all()  # threads started, pages touched
        seconds = min(timeit.repeat(read_all, number=1, repeat=3))
    return data.nbytes / seconds


def busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has spent busy (steal included: the hypervisor gave the time elsewhere);
    None where there is no /proc/stat."""
    try:
        with open("/proc/stat", encoding="utf-8") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def measure_cpu() -> dict:
    """This machine's read bandwidth over all its cores and fp32 matmul rate, best of 3, and the mean number of
    cores other processes kept busy meanwhile (None where that cannot be read)."""
    wall, busy, own = time.perf_counter(), busy_cpu_s(), own_cpu_s()
    measured = _measure_cpu()
    after = busy_cpu_s()
    others = None if busy is None or after is None else max(0.0, (after - busy) - (own_cpu_s() - own))
    return {**measured, "other_cores": None if others is None else others / (time.perf_counter() - wall)}


def _measure_cpu() -> dict:
    import numpy as np

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=1, repeat=3))

    cores = usable_cpus()
    bandwidth = read_bandwidth(cores)
    # The matmul peak is onnxruntime's (MLAS), the kernel artifacts run: numpy's BLAS can be far slower here
    # (e.g. with OPENBLAS_CORETYPE set), which made "lower bounds" above measured prefill times.
    import onnxruntime
    try:
        from onnx import TensorProto, helper, numpy_helper
    except ModuleNotFoundError:  # a runtime-only install (a deployment): measured once, where onnx is
        raise BuildError(f"measuring this machine's matmul peak builds a one-MatMul graph with onnx, which is not "
                         f"installed: {pip_install(repr('aotlm[compiler]'))} once (the figures are kept "
                         f"in {CACHE_FILE or '~/.cache/aotlm/cpu.json'}; "
                         f"a copy of that file from a machine of this kind does too)") from None

    n = 2048
    a, b = np.random.default_rng(0).standard_normal((2, n, n), dtype=np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "peak",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])],
                              [numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = default_intra_op_threads()  # the CPUs it may use, as the engine's sessions
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    session.run(None, {"a": a})
    matmul_s = best(lambda: session.run(None, {"a": a}))
    return {"bandwidth": bandwidth, "fp32_flops": 2 * n**3 / matmul_s,
            "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"), "method": (
                f"{cores} threads each reading part of a 512 MiB array (np.max; bytes read / s) and a 2048x2048 fp32 "
                f"onnxruntime MatMul, best of 3")}


def _read_cpu_cache() -> dict:
    """The cached figures by host key, each checked: the file is ours, but the README suggests copying it between
    machines, and `null`, a list or an entry without its numbers were tracebacks. What is not a figure is dropped
    (measured again)."""
    try:
        cache = json.loads(CACHE_FILE.read_text(encoding="utf-8")) if CACHE_FILE else {}
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(cache, dict):
        return {}

    def is_figure(entry) -> bool:
        return (isinstance(entry, dict) and isinstance(entry.get("measured"), str)
                and all(isinstance(entry.get(name), (int, float)) and not isinstance(entry.get(name), bool)
                        and 0 < entry[name] < float("inf") for name in ("bandwidth", "fp32_flops")))

    return {key: entry for key, entry in cache.items() if is_figure(entry)}


def cpu_device(remeasure: bool = False) -> dict:
    # -ort: matmul peak from onnxruntime, not numpy; -read: all-core read bandwidth, not one thread's copy; -quiet:
    # measured with other processes' load checked (a figure cached by an older version is measured again)
    # -use: the CPUs this process may use (a container's limit, taskset): a figure from 1 of 2 CPUs is not the 2's
    key = f"{socket.gethostname()}-{os.cpu_count()}cpu-{usable_cpus()}use-ort-read-quiet"
    cache = _read_cpu_cache()
    note = "`aotlm plan SOURCE --remeasure` redoes it"
    if remeasure or key not in cache:
        m = measure_cpu()
        # A figure measured while a build or a benchmark ran was kept for good: 15.4 GB/s on a host whose decode
        # steps read 29.6. One taken under load is used once and not cached, so the next call measures again.
        if (m.get("other_cores") or 0.0) <= MAX_OTHER_CORES:
            try:  # whole or not at all: a full disk cut the file short, and every host's figures with it
                if CACHE_FILE:
                    # read again just before writing: another plan (another host sharing this home, another
                    # taskset) may have added its figure during the seconds this one measured, and it was lost
                    write_json(CACHE_FILE, {**_read_cpu_cache(), key: m})
            except OSError:
                pass  # a read-only home only costs a re-measurement next time
        else:
            note = (f"other processes kept {m['other_cores']:.2f} cores busy meanwhile: an underestimate, not cached; "
                    f"measure again on a quiet machine")
    else:
        m = cache[key]
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # Windows has no sysconf
        raise BuildError("--device cpu: this system does not say how much memory it has (no os.sysconf); plan for "
                         "a named device instead (--device H100, say)") from None
    return {"name": f"cpu {key} (measured {m['measured']}; {note})", "memory": memory,
            "bandwidth": m["bandwidth"], "fp32": m["fp32_flops"], "measured": True}


def load_source(path: str) -> tuple[DecoderConfig, dict]:
    """The model config behind a recipe, config.json (or its folder), .gguf file or artifact folder."""
    p = Path(path)
    if not p.exists() and p.suffix in ("", ".yaml") and p.parent in (Path("."), Path("recipes")):
        # a recipe that comes with aotlm, by its name, as `aotlm build` finds it (a wheel has no recipes/); with the
        # runtime alone this import fails, and the CLI says which extra planning a recipe needs
        from compiler.recipe import bundled_recipes

        p = bundled_recipes().get(p.stem, p)
    if not p.exists():
        raise BuildError(f"{path}: no such file or folder.{hub_id_hint(path, 'hf')}")  # a .gguf path gets no hint
    if p.is_dir() and (p / "manifest.json").is_file() or p.name == "manifest.json":
        return _from_artifact(p if p.is_dir() else p.parent)
    if p.is_dir() and (p / "config.json").is_file():
        p = p / "config.json"
    if p.is_file() and p.suffix in (".yaml", ".yml"):
        from compiler.recipe import load_recipe

        from compiler.recipe_checks import check_config_fits, check_recipe

        recipe = load_recipe(p)
        check_recipe(recipe)  # what the build refuses, refused here too: not sized as if it would build
        spec = recipe.model
        if spec.source == "random":
            config = spec.config
        elif spec.source == "gguf":
            from compiler.frontend import default_gguf_path
            from compiler.frontend.gguf_loader import check_gguf_path

            config = _gguf_config(check_gguf_path(spec.path or default_gguf_path()))
        else:
            from compiler.frontend.hf_loader import check_hf_folder

            config = _hf_config(Path(check_hf_folder(spec.path)) / "config.json")
        check_config_fits(config, recipe)
        resolved = recipe.to_dict()
        head_warning = _stored_head_warning(config, Path(spec.path) / "config.json") if spec.source == "hf" else []
        export_dtype = EXPORT_DTYPES.get(recipe.export.dtype, "fp32")  # as its artifact would be planned
        return config, {"kind": f"recipe ({spec.source})", "path": str(p), "context": recipe.export.max_context,
                        "warnings": head_warning,
                        "backend": recipe.backend.name, "prefill": prefill_shape(resolved),
                        "max_batch": recipe.export.max_batch, "dtype": export_dtype,
                        "kv_dtype": export_dtype,  # the cache keeps the export's float type
                        **quantized_dtypes(resolved["passes"])}
    if p.is_file() and p.suffix == ".gguf":
        return _gguf_config(str(p)), {"kind": "gguf", "path": str(p)}
    if p.is_file() and p.suffix == ".json":
        config = _hf_config(p)
        return config, {"kind": "hf config.json", "path": str(p), "warnings": _stored_head_warning(config, p)}
    raise BuildError(f"{path}: not a recipe (.yaml), a Hugging Face config.json (or a folder with one), "
                     f"a .gguf file or an artifact folder (with manifest.json)")


def _gguf_config(path: str) -> DecoderConfig:
    from compiler.frontend.gguf_loader import _field, _open_reader, _read_config

    if not os.path.isfile(path):
        raise BuildError(f"GGUF file not found: {path}.{hub_id_hint(path, 'gguf')}")
    reader = _open_reader(path)  # metadata and tensor shapes only; nothing is dequantized
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise BuildError(f"{path}: GGUF architecture {arch!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})")
    return _read_config(reader, arch, None, path)  # vocab size from token_embd's shape


def _hf_config(path: Path) -> DecoderConfig:
    from compiler.frontend.hf_loader import _read_json, decoder_config_from_hf, refuse_quantized_checkpoint

    if not path.is_file():
        raise BuildError(f"{path}: config.json not found")
    hf = _read_json(str(path))
    config = decoder_config_from_hf(hf, {}, str(path))
    refuse_quantized_checkpoint(hf, str(path))  # the build refuses it: planning it as float weights would mislead
    return config


def _stored_head_warning(config: DecoderConfig, config_path: Path) -> list[str]:
    """The build unties a tied head whose checkpoint stores its own lm_head.weight unless that equals the table
    (as transformers does); the plan reads no tensor, so it counts the head tied and says what it would add."""
    from compiler.frontend.hf_loader import stored_tensor_names

    if not config.tie_word_embeddings:
        return []
    names = stored_tensor_names(str(config_path.parent))
    if not names or "lm_head.weight" not in names:
        return []
    return [f"config.json ties the lm_head to the embedding table, but the weights also store lm_head.weight: the "
            f"build keeps that head untied unless it equals the table, adding "
            f"{config.vocab_size * config.hidden_size / 1e6:.0f}M parameters this plan does not count"]


def _from_artifact(folder: Path) -> tuple[DecoderConfig, dict]:
    from runtime.errors import AotlmRuntimeError
    from runtime.manifest import read_manifest

    try:
        manifest = read_manifest(folder)
    except AotlmRuntimeError as error:
        raise BuildError(str(error)) from None
    try:
        return _artifact_config(folder, manifest)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as problem:  # read_manifest checks what the
        # runtime needs; the plan reads the recipe and the quantize options too, which an edit can break
        raise BuildError(f"{folder}/manifest.json: a field the plan reads is missing or malformed "
                         f"({type(problem).__name__}: {problem}); rebuild the artifact") from None


def _artifact_config(folder: Path, manifest: dict) -> tuple[DecoderConfig, dict]:
    kv = manifest.get("kv_cache", {})
    recipe = manifest.get("recipe", {})
    export_dtype = EXPORT_DTYPES.get(recipe.get("export", {}).get("dtype", "float32"), "fp32")
    quantized = quantized_dtypes(recipe.get("passes", []))
    info = {"kind": "artifact", "path": str(folder), "context": kv.get("max_context"), "prefill": prefill_shape(recipe),
            "float_bytes": 4 if export_dtype == "fp32" else 2,  # activations, and the scales stored in their type
            "backend": manifest.get("backend", {}).get("name", "onnxruntime"),
            # weight quantization decides the precision, not the export dtype
            "dtype": quantized.get("dtype", export_dtype), "float_prefill": quantized.get("float_prefill", False),
            **({"quantize": _as_quantized(quantized["quantize"], manifest)} if "quantize" in quantized else {}),
            "kv_dtype": {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int8": "int8"}.get(
                kv.get("dtype", "float32"), "fp32")}
    info["max_batch"] = recipe.get("export", {}).get("max_batch", 1)
    weights = manifest.get("backend", {}).get("weights", {}).get("bytes")
    if weights:  # what a decode step really reads: codes, scales and zero points, any layer kept in float
        info["weight_bytes"] = weights
    return DecoderConfig.from_dict(manifest["model"]["config"]), info


def _as_quantized(options: dict, manifest: dict) -> dict:
    """The quantize options with `embedding` as the build did it: the pass keeps a table float it has no kernel for
    (its report says why), whatever the recipe asked."""
    reports = [record.get("report", {}) for record in manifest.get("passes", []) if record.get("name") == "quantize"]
    done = [report["embedding"].get("quantized") for report in reports if isinstance(report.get("embedding"), dict)]
    return options | {"embedding": "quantized" if any(done) else "float"} if done else options


def quantized_dtypes(passes: list) -> dict:
    """{"dtype": "int4"/"int8", "quantize": its options} from a resolved recipe's quantize pass, {"kv_dtype": "int8"}
    from quantize_kv_cache."""
    found, packing = {}, None
    for entry in passes:  # each {pass name: options}, as Recipe.to_dict() and manifests write them
        for name, options in (entry.items() if isinstance(entry, dict) else ()):
            bits = options.get("bits") if isinstance(options, dict) else None
            if name == "pack_projections":  # before quantize: its patterns see the packed names
                packing = options if isinstance(options, dict) else {}
            if name == "quantize" and bits in (4, 8):
                found["dtype"], found["quantize"] = f"int{bits}", {**options, "packing": packing}
            elif name == "quantize_kv_cache" and bits == 8:
                found["kv_dtype"] = "int8"
            elif name == "dequantize_weights":  # on prefill only (its options refuse decode)
                found["float_prefill"] = True  # the prefill session holds float copies of the products
    return found


def quantized_weight_bytes(counts: dict, config: DecoderConfig, options: dict, scale_bytes: int) -> float:
    """Bytes of a recipe's quantized weights as the quantize pass stores them: codes, one scale per block of the
    product's own K (INT4: the recipe's block; INT8 on MatMulNBits: int8_kernel_block, else the channel's scale
    repeated over the largest power of two <= 256 dividing K, as passes/quantized_lowering_ort.for_matmulnbits
    stores it; either at most the power of two holding K), a zero point per block when asymmetric, the norms in
    float, and the embedding table in float unless `embedding: quantized` (a tied table then also serves the
    lm_head). Each product takes the settings of the first override whose pattern matches its names (the exported
    graph's node and weight names, as passes/quantize.py matches them), and float bytes where `exclude` or a `skip`
    override keeps it float (they had been read as the pass-wide settings)."""
    total, products = counts["norms"] * scale_bytes, 0
    head_settings = options
    blocks = packed_blocks(options.get("packing"))
    found = list(_products(config, blocks or set()))
    if blocks is not None:  # (None: pack_projections' max_rewrites makes its groups unknowable; the pass checks)
        problem = pattern_problem([product for product, _, _ in found], tuple(options.get("exclude") or ()),
                                  tuple(o.get("pattern", "") for o in options.get("overrides") or ()))
        if problem:  # the build refuses these patterns (passes/quantize.py): no size for it either
            raise BuildError(f"quantize: {problem}")
    for product, params, k in found:
        settings = _product_settings(options, product)
        head_settings = settings  # the last product is the lm_head
        products += params
        total += params * (scale_bytes if settings is None else _quantized_bytes_per_param(config, settings,
                                                                                           scale_bytes, k=k))
    total += (counts["attention"] + counts["mlp"] + counts["lm_head"] + (
        config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0) - products) * scale_bytes  # biases
    table = gathered_table_bytes(counts, config, options, scale_bytes)
    if table == 0 and head_settings is None:  # a tied table shares a quantized lm_head's codes; a float head none
        table = counts["embedding"] * _quantized_bytes_per_param(config, options, scale_bytes)
    return total + table


def packed_blocks(packing: dict | None) -> set[str] | None:
    """The blocks whose projections pack_projections (its options: `packing`, None where the recipe has none before
    quantize) joins into one MatMul: q/k/v (3 read one input) and gate/up (2), at its min_group; None where that
    cannot be told before the build (max_rewrites stops it part way)."""
    if packing is None:
        return set()
    if packing.get("max_rewrites") is not None:
        return None
    return {block for block, group in (("self_attn", 3), ("mlp", 2)) if group >= packing.get("min_group", 2)}


def _products(config: DecoderConfig, packed: set[str]):
    """(the product as the quantize pass's patterns see it, parameters, K) of every product a decode step runs:
    the exported graph's node names (the weights have torch's generated names, which no pattern matches, but the
    tied table's and a packed one's), as pack_projections leaves them in the `packed` blocks."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    sizes = {("self_attn", "q_proj"): (h * q, h), ("self_attn", "k_proj"): (h * kv, h),
             ("self_attn", "v_proj"): (h * kv, h), ("self_attn", "o_proj"): (q * h, q),
             ("mlp", "gate_proj"): (h * config.intermediate_size, h), ("mlp", "up_proj"): (h * config.intermediate_size, h),
             ("mlp", "down_proj"): (config.intermediate_size * h, config.intermediate_size)}
    groups = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}  # pack_projections'
    for layer in range(config.num_layers):
        for (block, name), (params, k) in sizes.items():
            if block in packed and name in groups[block]:  # one product for the group: its parameters, each part's K
                if name == groups[block][0]:
                    joined = f"/decoder/layers.{layer}/{block}/{'+'.join(groups[block])}"
                    yield Product((f"{joined}.packed_MatMul", f"{joined}.packed_weight"),
                                  packed_parts(f"{joined}.packed_MatMul")), sum(
                        sizes[block, part][0] for part in groups[block]), k
                continue
            yield Product((f"/decoder/layers.{layer}/{block}/{name}/MatMul",)), params, k
    head = (Product(("/decoder/lm_head/Gemm_tied", "model.embed_tokens.weight")) if config.tie_word_embeddings
            else Product(("/decoder/lm_head/MatMul",)))
    yield head, config.vocab_size * h, h


def _product_settings(options: dict, product: Product) -> dict | None:
    """The quantize options a product gets: the first matching override's over the pass-wide ones; None when it
    stays float (excluded, or a skip override)."""
    if any(matches(pattern, product) for pattern in options.get("exclude") or ()):
        return None
    for override in options.get("overrides") or ():
        if matches(override.get("pattern", ""), product):
            if override.get("skip"):
                return None
            given = {key: value for key, value in override.items() if key != "pattern" and value is not None}
            return {**options, **given}
    return options


def _quantized_bytes_per_param(config: DecoderConfig, options: dict, scale_bytes: int, k: int | None = None) -> float:
    """Stored bytes per weight of a product with K = k (default: the hidden size)."""
    from passes.quantized_weights import kernel_block  # numpy only: a runtime-only host plans too

    bits = options.get("bits", 4)
    block = kernel_block(k or config.hidden_size, options.get("int8_kernel_block") if bits == 8 else
                         options.get("block_size", INT4_BLOCK))
    return bits / 8 + scale_bytes / block + (0.5 / block if bits == 4 and not options.get("symmetric", True) else 0)


def gathered_table_bytes(counts: dict, config: DecoderConfig, options: dict, float_bytes: int) -> float:
    """Stored bytes of the embedding table beyond what the lm_head's product holds: the table a decode step gathers
    one row per sequence of and never reads whole. Float (the dtype of the activations) unless `embedding: quantized`
    on MatMulNBits, whose tied table is the lm_head's own codes (nothing more stored) and whose untied one is
    quantized alike; a float table beside a quantized tied lm_head is stored twice, once in each form."""
    if options.get("embedding", "float") == "quantized" and options.get("lowering", "matmulnbits") == "matmulnbits":
        return 0 if config.tie_word_embeddings else counts["embedding"] * _quantized_bytes_per_param(
            config, options, float_bytes)
    return counts["embedding"] * float_bytes


def count_params(c: DecoderConfig) -> dict:
    h, layers, q, kv = c.hidden_size, c.num_layers, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    counts = {"embedding": c.vocab_size * h,
              "attention": layers * (2 * h * q + 2 * h * kv + ((q + 2 * kv) if c.attention_bias else 0)),
              "mlp": layers * 3 * h * c.intermediate_size, "norms": (2 * layers + 1) * h,
              "lm_head": 0 if c.tie_word_embeddings else c.vocab_size * h}
    return counts | {"total": sum(counts.values())}


def prefill_flops(counts: dict, config: DecoderConfig, tokens: int, shape: dict | None = None) -> float:
    """FLOPs of a prefill of `tokens` tokens: every token through the attention and MLP projections, but for the last
    layer's o_proj and MLP when skip_unused_rows runs them on the last token only; causal attention, each query
    against the keys up to its own (scores and weighted sum: 2 x 2 x head_dim x its position, per head and layer);
    the output projection for the last position, or every one with export.prefill_logits: all. The embedding is a
    lookup. `shape`: prefill_shape's, the default recipe's (skip_unused_rows, last-position logits) when None."""
    shape = shape or {"skip_unused_rows": True, "prefill_logits": "last"}
    h = config.hidden_size
    last_layer_rows_only = h * config.num_heads * config.head_dim + 3 * h * config.intermediate_size
    skipped = 2 * last_layer_rows_only * (tokens - 1) if shape["skip_unused_rows"] else 0
    attention = 2 * config.num_layers * config.num_heads * config.head_dim * tokens * (tokens + 1)
    logits_rows = tokens if shape["prefill_logits"] == "all" else 1
    return 2 * (counts["attention"] + counts["mlp"]) * tokens - skipped + attention + 2 * config.vocab_size * h * logits_rows


def prefill_shape(recipe: dict) -> dict:
    """What a recipe's (or a manifest's recorded recipe's) prefill computes: whether skip_unused_rows cuts the last
    layer to the returned rows, and which positions' logits it returns."""
    names = {name for entry in recipe.get("passes", []) if isinstance(entry, dict) for name in entry}
    names |= {entry for entry in recipe.get("passes", []) if isinstance(entry, str)}
    logits = recipe.get("export", {}).get("prefill_logits", "last")
    # the pass moves the last layer to the returned rows; with every position returned it changes nothing
    return {"skip_unused_rows": "skip_unused_rows" in names and logits == "last", "prefill_logits": logits}


def weight_bytes(params: int) -> dict:
    sizes = {p: params * b for p, b in WEIGHT_BYTES.items()}
    return sizes | {"int4": params * (0.5 + INT4_SCALE_BYTES / INT4_BLOCK), "int4_no_scales": params * 0.5}


def decode_weight_bytes(weights: float, config: DecoderConfig, counts: dict, quantize: dict | None = None,
                        float_bytes: int = 4) -> float:
    """The weight bytes a decode step reads: all, but for the embedding table a step only gathers rows from (an
    untied table; a float one beside a quantized lm_head). Quantized weights (`quantize`: the recipe's options)
    subtract that table's stored bytes, which a float table makes a larger share than of the parameters;
    float weights, of one precision, its share of the parameters."""
    if quantize is not None:
        return weights - gathered_table_bytes(counts, config, quantize, float_bytes)
    return weights if config.tie_word_embeddings else weights * (1 - counts["embedding"] / counts["total"])


def artifact_step_weight_bytes(folder: str | Path) -> float | None:
    """The weight bytes one decode step of a built artifact reads: its stored weights less an embedding table the
    step only gathers rows from (what `plan` predicts from; `bench --phase decode` and benchmarks/phases.py divide
    it by the step's time). None when the manifest records no weights file (TensorRT engines hold theirs)."""
    config, info = _from_artifact(Path(folder))
    if "weight_bytes" not in info:
        return None
    counts = count_params(config)
    return decode_weight_bytes(info["weight_bytes"], config, counts, info.get("quantize"), info["float_bytes"])


def plan(source: str, *, device: str, precision: str | None = None, kv_dtype: str | None = None,
         context: int | None = None, concurrency: int = 1, prompt: int | None = None, headroom: float = 0.9,
         remeasure: bool = False, measure: bool = True) -> dict:
    """Memory and lower-bound latencies for serving `source` on `device`; raises BuildError on bad input."""
    key = resolve_device(device)
    gpu = key != "cpu"
    config, info = load_source(source)
    # An artifact's own dtypes are the defaults (it is planned as built), and a recipe's quantized ones; otherwise
    # fp16 on GPUs, fp32 on cpu.
    precision = precision or info.get("dtype") or ("fp16" if gpu else "fp32")
    kv_dtype = kv_dtype or info.get("kv_dtype") or ("fp16" if gpu else "fp32")
    if precision not in WEIGHT_BYTES or kv_dtype not in KV_BYTES:
        raise BuildError(f"precision must be one of {', '.join(WEIGHT_BYTES)}; kv dtype one of {', '.join(KV_BYTES)}")
    # The build refuses a cache longer than a sliding window (the decoder attends to the whole cache): the default
    # context is at most the window, and a longer one is refused as the build would.
    longest = min(config.max_position_embeddings, config.sliding_window or config.max_position_embeddings)
    context = (info.get("context") or longest) if context is None else context
    prompt = min(512, context) if prompt is None else prompt
    if min(context, concurrency, prompt) < 1:
        raise BuildError("--context, --concurrency and --prompt must be at least 1")
    if context > config.max_position_embeddings:  # an error: the decoder has plain RoPE, no context extension
        raise BuildError(f"context {context} exceeds the model's max_position_embeddings "
                         f"({config.max_position_embeddings}); use --context {config.max_position_embeddings} or less")
    if config.sliding_window is not None and context > config.sliding_window:
        raise BuildError(f"context {context} exceeds the model's sliding window ({config.sliding_window} tokens), "
                         f"which the decoder does not implement (the build refuses such a cache); use --context "
                         f"{config.sliding_window} or less")
    if prompt > context:
        raise BuildError(f"--prompt {prompt} is longer than the context ({context})")
    dev = cpu_device(remeasure) if not gpu else DEVICES[key]
    params = count_params(config)
    weights = weight_bytes(params["total"])
    as_built = info["kind"] == "artifact" and precision == info["dtype"] and "weight_bytes" in info
    from_recipe = not as_built and "quantize" in info and precision == info.get("dtype")
    float_bytes = 4 if info.get("backend") == "onnxruntime" else 2  # CPU graphs keep float32 scales; GPU ones fp16
    quantize = info.get("quantize") if as_built or from_recipe else None
    if as_built:
        w = info["weight_bytes"]
    elif from_recipe:
        w = quantized_weight_bytes(params, config, quantize, float_bytes)
    else:
        w = weights[precision]
    step_bytes = decode_weight_bytes(w, config, params, quantize, float_bytes)
    # dequantize_weights on prefill: its session folds the layers' products to float32 (the lm_head stays quantized)
    float_prefill = 4 * (params["attention"] + params["mlp"]) if info.get("float_prefill") and precision in (
        "int4", "int8") and info.get("backend") == "onnxruntime" else 0  # (its MatMulNBits only: onnxruntime's)
    # The prefill and decode engines are two sessions (two TensorRT engines): each holds its own copy of the weights
    # (onnxruntime prepacks each session's), the prefill's float32 copies of the layers' products where
    # dequantize_weights folds them. On onnxruntime a float tied table is held once more per session: the lm_head's
    # product is prepacked, and the embedding's Gather reads the table itself, mapped from weights.bin by both
    # sessions: one page-cache copy, which resident memory (RSS) counts once per session (PSS once). SmolLM2's fp32
    # artifact: 2 x (539 + 113) MB counted here, 1.46-1.52 GB resident measured (the rest: onnxruntime's arenas, code).
    prefill_copy = float_prefill or w
    on_onnxruntime = info.get("backend", "tensorrt" if gpu else "onnxruntime") == "onnxruntime"
    gather_table = params["embedding"] * WEIGHT_BYTES[precision] if (
        on_onnxruntime and config.tie_word_embeddings and quantize is None and precision in FLOAT_PRECISIONS) else 0
    resident = w + prefill_copy + 2 * gather_table
    products = params["attention"] + params["mlp"] + config.vocab_size * config.hidden_size
    kv_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * KV_BYTES[kv_dtype]
    # An artifact's engines (and a recipe's, once built) hold export.max_context rows per sequence whatever a request
    # uses: memory counts those; a decode step reads only the rows up to `context`.
    held_context = info.get("context") or context if info["kind"] == "artifact" or info["kind"].startswith(
        "recipe") else context
    kv_request, kv_total = kv_token * held_context, kv_token * held_context * concurrency
    kv_read = kv_token * min(context, held_context)
    usable = headroom * dev["memory"]
    # TensorRT's decode profile bounds a step's rows (export.max_batch): the scheduler takes no more slots than that
    most_rows = info["max_batch"] if info.get("backend") == "tensorrt" and info.get("max_batch") else math.inf
    # GPU compute peaks: fp16/bf16 and int4 (weight-only, matmuls in fp16) use FP16 Tensor; int8 uses INT8 Tensor
    # (W8A8); fp32 uses TF32 Tensor, half FP16's rate on all of these parts. cpu: measured fp32 matmul for all.
    peak = dev["fp32"] if not gpu else dev["int8"] if precision == "int8" else dev["fp16"] / (1 + (precision == "fp32"))
    memory_s, compute_s = (step_bytes + kv_read * concurrency) / dev["bandwidth"], 2 * products * concurrency / peak
    prefill_compute_s = prefill_flops(params, config, prompt, info.get("prefill")) / peak
    prefill_memory_s = step_bytes / dev["bandwidth"]
    result = {
        "model": {"source": info, "architecture": config.architecture, "layers": config.num_layers,
                  "hidden": config.hidden_size, "heads": config.num_heads, "kv_heads": config.num_kv_heads,
                  "head_dim": config.head_dim, "vocab": config.vocab_size,
                  "max_positions": config.max_position_embeddings},
        "device": {"key": key, "name": dev["name"], "memory_bytes": dev["memory"], "bandwidth_Bps": dev["bandwidth"],
                   "peak_flops": peak, "measured": bool(dev.get("measured"))},
        "inputs": {"precision": precision, "kv_dtype": kv_dtype, "context": context, "concurrency": concurrency,
                   "prompt": prompt, "headroom": headroom},
        "params": params, "weight_bytes": weights, "weights": w,
        "weights_from": AS_BUILT if as_built else RECIPE_QUANTIZE if from_recipe else f"params x {precision} bytes",
        "kv": {"bytes_per_token": kv_token, "held_context": held_context, "per_request": kv_request,
               "total": kv_total, "read_per_step_per_request": kv_read},
        "memory": {"total": resident + kv_total, "usable": usable, "fits": resident + kv_total <= usable,
                   "prefill_float_weights": float_prefill, "prefill_engine_weights": prefill_copy,
                   "gather_tables": 2 * gather_table,
                   "max_concurrency": max(0, min(int((usable - resident) // kv_request), most_rows)),
                   "not_counted": NOT_COUNTED},
        # prefill reads every weight a step reads at least once too: on a short prompt that, not the FLOPs, bounds it
        "bounds": {"prefill_s": max(prefill_compute_s, prefill_memory_s), "prefill_flops": prefill_compute_s * peak,
                   "prefill_bound": "compute" if prefill_compute_s >= prefill_memory_s else "bandwidth",
                   "decode_token_s": (step_bytes + kv_read) / dev["bandwidth"],
                   "decode_step_s": max(memory_s, compute_s),
                   "decode_tokens_per_s": concurrency / max(memory_s, compute_s),
                   "decode_bound": "bandwidth" if memory_s >= compute_s else "compute"},
        "assumptions": [
            ("device memory as nvidia-smi reports it (MiB)" if gpu else "memory: the machine's physical memory "
             "(MemTotal)") + f", every size shown in decimal GB (1e9 bytes); usable = {headroom:.0%} of it",
            f"the table's precision rows: int4 with one fp16 scale per {INT4_BLOCK} weights (+{INT4_SCALE_BYTES / INT4_BLOCK} "
            "B/param), all tensors quantized incl. embeddings, int8 per-channel scales ignored; an artifact's or a "
            "quantized recipe's own row counts what it stores",
            "prefill: 2 x (attention + MLP projection params) x prompt, less the last layer's o_proj and MLP for all but "
            "the last token (skip_unused_rows), + causal attention's 2 x layers x heads x head_dim x prompt x (prompt "
            "+ 1), + 2 x vocab x hidden per returned logits row, FLOPs at peak"
            + ("" if "prefill" in info else " (a model without a recipe: the default recipe's last-position logits "
                                            "and skip_unused_rows)"),
            "decode: all weights (an embedding table not shared with the lm_head: one row, at its stored size) + "
            "every sequence's KV cache up to the "
            "context read once per step, at peak bandwidth (or compute-bound at 2 x projection params x concurrency "
            "FLOPs, whichever is slower)",
            "KV memory: every sequence holds the artifact's (the recipe's) export.max_context rows, whatever the "
            "context of its requests",
            "GPU peaks are dense datasheet figures (not sparsity); fp32 runs at TF32 rate, int8 as W8A8, int4 as "
            "weight-only fp16 matmuls" if gpu else "cpu: measured fp32 onnxruntime MatMul rate for every precision"],
        "warnings": info.pop("warnings", [])}
    if info["kind"] == "artifact" and context > (info.get("context") or context):
        result["warnings"].append(f"context {context} exceeds this artifact's cache ({info['context']} tokens): it "
                                  f"serves at most {info['context']}; rebuild with a larger export.max_context")
    elif info["kind"].startswith("recipe") and context > (info.get("context") or context):  # sized past what it builds
        result["warnings"].append(f"context {context} exceeds the recipe's export.max_context ({info['context']}): "
                                  f"its artifact would serve at most {info['context']} tokens; raise "
                                  f"export.max_context to {context} to build what this plan sizes")
    if info.get("backend") == "tensorrt" and concurrency > info.get("max_batch", concurrency):
        # TensorRT's decode profile bounds the rows of a step: the scheduler refuses more slots than that
        result["warnings"].append(f"concurrency {concurrency} exceeds export.max_batch ({info['max_batch']}): "
                                  f"TensorRT's engines run at most {info['max_batch']} sequences per step; rebuild "
                                  f"with export.max_batch: {concurrency} to serve this many at once")
    if gpu and info.get("backend") == "onnxruntime":  # its engines are onnxruntime's CPU graphs
        what = "artifact" if info["kind"] == "artifact" else "recipe"
        result["warnings"].append(f"this {what} builds onnxruntime CPU graphs, which the runtime runs on cpu, not on "
                                  f"a GPU: this plan sizes the model for {dev['name']}, not what this {what} serves; "
                                  f"for a GPU, plan a TensorRT recipe (recipes/smollm2-135m-tensorrt.yaml)")
    if info["kind"] == "artifact" and not gpu and measure and info["backend"] != "onnxruntime":
        result["warnings"].append(f"not timed: this artifact's {info['backend']} engines run on a GPU, not on cpu")
    elif info["kind"].startswith("recipe") and not gpu and info["backend"] != "onnxruntime":
        result["warnings"].append(f"this recipe builds {info['backend']} engines, which run on a GPU, not on cpu: "
                                  f"plan it with --device H100 (or the GPU it will run on)")
    elif info["kind"] == "artifact" and not gpu and measure:
        result["measured"] = measure_artifact(info, config, dev, context)
        if context > (info.get("context") or context):
            result["warnings"].append(f"measured at the artifact's max context {info['context']}, not {context}")
    return result


def measure_artifact(info: dict, config: DecoderConfig, dev: dict, context: int) -> dict:
    """Time 16 decode steps (median inter-token latency) and predict them from the artifact's own dtypes."""
    from runtime import Engine

    engine = Engine.load(info["path"], generation_config="none")  # greedy: a step's time, not a sampler's
    n = max(1, min(context, engine.max_context) - 17)
    ids = [(7919 * i + 13) % config.vocab_size for i in range(n)]
    result = engine.generate(ids, max_new_tokens=17, ignore_eos=True)
    measured = statistics.median(result.timings.itl_s)
    kv_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * KV_BYTES[info["kv_dtype"]]
    counts = count_params(config)
    as_built = info.get("weight_bytes")
    weights = decode_weight_bytes(as_built or weight_bytes(counts["total"])[info["dtype"]], config, counts,
                                  info.get("quantize") if as_built else None)
    predicted = (weights + kv_token * (n + 9)) / dev["bandwidth"]
    return {"prompt_tokens": n, "steps": len(result.timings.itl_s), "measured_s": measured, "predicted_s": predicted,
            "ratio": measured / predicted, "dtypes": f"{info['dtype']} weights, {info['kv_dtype']} KV (the artifact's)"}


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def _t(s: float) -> str:
    return f"{s * 1e3:,.2f} ms" if s < 1 else f"{s:,.2f} s"


def render(p: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    from compiler.console import ReaderAwareConsole, message, print_table, warning

    out = ReaderAwareConsole(file=sys.stdout, emoji=False)  # the plan is the command's output; warnings go to stderr

    m, i, kv, mem, b = p["model"], p["inputs"], p["kv"], p["memory"], p["bounds"]
    message(f"[bold]{escape(Path(m['source']['path']).name)}[/bold] " + escape(
        f"({m['source']['kind']}): {m['architecture']}, {m['layers']} layers, hidden {m['hidden']}, heads "
        f"{m['heads']}/{m['kv_heads']} kv x {m['head_dim']}, vocab {m['vocab']}, max positions {m['max_positions']}"),
        out)
    d = p["device"]
    message(escape(f"device: {d['name']}: {_gb(d['memory_bytes'])}, {d['bandwidth_Bps'] / 1e9:,.1f} GB/s, "
                   f"{d['peak_flops'] / 1e12:,.2f} TFLOP/s at {i['precision']}"), out)
    table = Table(title=f"plan: {i['precision']} weights, {i['kv_dtype']} KV, context {i['context']}, "
                        f"concurrency {i['concurrency']}, prompt {i['prompt']}")
    for column, justify in (("quantity", "left"), ("value", "right"), ("how", "left")):
        table.add_column(column, justify=justify)
    pc = p["params"]
    head = f"head {pc['lm_head'] / 1e6:.0f}M" if pc["lm_head"] else "head tied"
    table.add_row("parameters", f"{pc['total'] / 1e9:.3f} B", f"embed {pc['embedding'] / 1e6:.0f}M, attn "
                  f"{pc['attention'] / 1e6:.0f}M, mlp {pc['mlp'] / 1e6:.0f}M, {head}")
    chosen = None if p["weights_from"] in (AS_BUILT, RECIPE_QUANTIZE) else i["precision"]
    for name, size in p["weight_bytes"].items():
        label = "int4 (no scales)" if name == "int4_no_scales" else name
        table.add_row(f"weights {label}", _gb(size), "params x " + (
            f"{0.5 + INT4_SCALE_BYTES / INT4_BLOCK} B" if name == "int4" else f"{WEIGHT_BYTES.get(name, 0.5)} B")
            + (" (chosen)" if chosen == name else ""), style="bold" if chosen == name else None)
    if p["weights_from"] in (AS_BUILT, RECIPE_QUANTIZE):
        label = "weights as built" if p["weights_from"] == AS_BUILT else f"weights {i['precision']} as the recipe stores them"
        table.add_row(label, _gb(p["weights"]), f"{p['weights_from']} (chosen)", style="bold")
    if mem["prefill_float_weights"]:
        table.add_row("prefill's float weights", _gb(mem["prefill_float_weights"]), "dequantize_weights: attention + "
                      "MLP params x 4 B, folded when the prefill session loads")
    else:
        table.add_row("prefill engine's copy", _gb(mem["prefill_engine_weights"]), "the prefill and decode engines "
                      "each hold the weights")
    if mem.get("gather_tables"):
        table.add_row("embedding tables for Gather", _gb(mem["gather_tables"]), "onnxruntime: each session also "
                      "holds the tied table itself (its lm_head copy is prepacked)")
    table.add_section()
    table.add_row("KV cache / token", f"{kv['bytes_per_token'] / 1024:,.2f} KiB", "2 x layers x kv_heads x head_dim"
                  f" x {KV_BYTES[i['kv_dtype']]} B")
    held = kv["held_context"]
    table.add_row("KV cache / request", _gb(kv["per_request"]), f"x context {held}" + (
        "" if held == i["context"] else f" (export.max_context: every sequence holds it; a step at context "
                                        f"{i['context']} reads {_gb(kv['read_per_step_per_request'])})"))
    table.add_row("KV cache total", _gb(kv["total"]), f"x concurrency {i['concurrency']}")
    fits = "[green]fits[/green]" if mem["fits"] else "[red]does not fit[/red]"
    table.add_row("weights + KV", _gb(mem["total"]), f"{fits} in {_gb(mem['usable'])} usable; excludes activations, "
                  "workspace")
    capped = p["model"]["source"].get("backend") == "tensorrt" and p["model"]["source"].get("max_batch")
    table.add_row("max concurrency", str(mem["max_concurrency"]), "(usable - weights - prefill's " + (
        "float weights" if mem["prefill_float_weights"] else "copy") + ") / KV per request" + (
        f", at most export.max_batch ({p['model']['source']['max_batch']})" if capped else ""))
    table.add_section()
    table.add_row("prefill >=", _t(b["prefill_s"]),
                  f"FLOPs of {i['prompt']} tokens (projections + causal attention) / peak FLOP/s" if
                  b["prefill_bound"] == "compute" else f"weights a step reads / bandwidth (bandwidth-bound: the "
                  f"FLOPs of {i['prompt']} tokens take less)")
    table.add_row("decode / token (1 seq) >=", _t(b["decode_token_s"]), "(weights + 1 request's KV) / bandwidth")
    table.add_row("decode / step (batch) >=", _t(b["decode_step_s"]),
                  f"{b['decode_bound']}-bound, {i['concurrency']} sequence" + "s" * (i["concurrency"] > 1))
    table.add_row("decode tokens/s <=", f"{b['decode_tokens_per_s']:,.1f}", "concurrency / step time")
    if "measured" in p:
        r = p["measured"]
        table.add_section()
        table.add_row("predicted decode / token", _t(r["predicted_s"]),
                      f"{r['dtypes']}, at {r['prompt_tokens']} + ~9 tokens")
        table.add_row("measured decode / token", _t(r["measured_s"]), f"median of {r['steps']} inter-token latencies")
        table.add_row("measured / predicted", f"{r['ratio']:.2f}x", "1.0 = at the bandwidth bound")
    print_table(table, out)
    for note in p["assumptions"]:
        message(f"[dim]- {escape(note)}[/dim]", out)
    for text in p["warnings"]:
        warning(text)
