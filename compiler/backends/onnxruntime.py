"""ONNX Runtime backend build: the final graphs with their weights stored once, and session settings.

Both graphs reference one `weights.bin` (external data, page-aligned offsets) in which each distinct
tensor content is stored once, so the weights both graphs use take disk space once. Small tensors stay
inside the graphs. Session config entries a pass recorded in a graph (passes/session_config.py) go into that
engine's manifest entry, `session_config`, which the runtime sets on the engine's session.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import onnx
from onnx import numpy_helper

from compiler.errors import BuildError
from passes.session_config import session_config

WEIGHTS_FILE = "weights.bin"
INLINE_LIMIT_BYTES = 1024  # tensors smaller than this stay in the .onnx file
ALIGNMENT = 4096  # page-aligned offsets let onnxruntime map weights instead of copying them


def _tensor_bytes(tensor: onnx.TensorProto) -> bytes:
    return tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()


def _externalize(graphs: dict[str, onnx.ModelProto], weights_path: Path) -> int:
    """Move large initializers of all graphs into one file, each distinct content stored once.

    Keyed by content, not name: the exporter's constants (val_N) reuse names across graphs for other values.
    """
    written: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length)
    offset = 0
    with open(weights_path, "wb") as weights:
        for model in graphs.values():
            for tensor in model.graph.initializer:
                data = _tensor_bytes(tensor)
                if len(data) < INLINE_LIMIT_BYTES:
                    continue
                digest = hashlib.sha256(data).hexdigest()
                if digest not in written:
                    padding = -offset % ALIGNMENT
                    weights.write(b"\0" * padding)
                    offset += padding
                    weights.write(data)
                    written[digest] = (offset, len(data))
                    offset += len(data)
                start, length = written[digest]
                tensor.ClearField("raw_data")
                for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    tensor.ClearField(field)
                del tensor.external_data[:]
                for key, value in (("location", WEIGHTS_FILE), ("offset", str(start)), ("length", str(length))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, value
                tensor.data_location = onnx.TensorProto.EXTERNAL
    return offset


def _dims(value_info: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


RUNNABLE_DOMAINS = ("", "ai.onnx", "com.microsoft")  # the ops onnxruntime's CPU provider has kernels for
LOWERINGS = ("lower_onnxruntime", "lower_onnx_attention")  # FlashAttention -> ops onnxruntime runs


def check_recipe(recipe) -> None:
    """Pass orders that would build a graph onnxruntime cannot load, refused before the slow export; so is an
    onnxruntime too old to load what the build writes."""
    import onnxruntime

    from runtime.onnxruntime_backend import check_installed
    from runtime.errors import ArtifactError

    names = [spec.name for spec in recipe.passes]
    try:  # the accuracy report and calibration run what the build writes: a cache too new for it failed in them
        check_installed(onnxruntime.__version__, ["int8_kv_cache"] if "quantize_kv_cache" in names else [])
    except ArtifactError as error:
        raise BuildError(str(error)) from None
    if "lower_tensorrt" in names:
        raise BuildError(f"passes[{names.index('lower_tensorrt')}]: lower_tensorrt emits TensorRT plugin nodes, which "
                         f"onnxruntime cannot run; use lower_onnxruntime for backend onnxruntime")
    if "fuse_attention" in names:
        last_fusion = len(names) - 1 - names[::-1].index("fuse_attention")
        if not any(name in LOWERINGS for name in names[last_fusion + 1:]):
            raise BuildError(f"passes[{last_fusion}]: fuse_attention leaves aotlm.FlashAttention nodes, which "
                             f"onnxruntime cannot run; add lower_onnxruntime after it")
    for index, spec in enumerate(recipe.passes):
        if spec.name in LOWERINGS and getattr(spec.options, "max_rewrites", None) is not None:
            raise BuildError(f"passes[{index}].{spec.name}.max_rewrites: a FlashAttention node it leaves unlowered is "
                             f"one onnxruntime cannot run, so the build would fail at its end; to bisect a parity "
                             f"failure, limit fuse_attention.max_rewrites instead (unfused layers run as they were)")
    if "quantize_kv_cache" in names:
        index = names.index("quantize_kv_cache")
        if "lower_onnxruntime" not in names[:index]:
            raise BuildError(f"passes[{index}]: quantize_kv_cache rewrites onnxruntime's GroupQueryAttention; list it "
                             f"after fuse_attention and lower_onnxruntime")


def check_runnable(graphs: dict[str, onnx.ModelProto]) -> None:
    """Every node in an op set onnxruntime implements: the last check before writing, whatever the passes did."""
    for phase, model in graphs.items():
        for node in model.graph.node:
            if node.domain not in RUNNABLE_DOMAINS:
                hint = ("; lower it with lower_onnxruntime (with no max_rewrites)" if node.op_type == "FlashAttention"
                        else "")
                raise BuildError(f"{phase} graph: node {node.name or node.op_type} is {node.domain}.{node.op_type}, "
                                 f"which onnxruntime cannot run{hint}")


def io_spec(model: onnx.ModelProto, aliases: dict[str, str]) -> dict:
    dtype = lambda v: onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name  # noqa: E731
    return {
        "inputs": [{"name": v.name, "dtype": dtype(v), "shape": _dims(v), "kv_cache": v.name in aliases.values()}
                   for v in model.graph.input],
        "outputs": [{"name": v.name, "dtype": dtype(v), "shape": _dims(v), "aliases": aliases.get(v.name)}
                    for v in model.graph.output],
    }


def takes_past(model: onnx.ModelProto, aliases: dict[str, str]) -> bool:
    """Whether this prefill graph runs a chunk after cached tokens (the rest of a prompt whose start is cached, a
    later chunk of a long one), as the decode graph does but with the last position's logits only: when every
    layer's attention is onnxruntime's GroupQueryAttention reading the graph's own cache inputs, it attends to the
    past the mask covers, and the export's last-token index leaves the past out (compiler/frontend/model.py). An
    int8 cache's prefill (quantize_kv_cache) keeps a float cache of the prompt alone, and an unfused graph attends
    to the run's own tokens: neither does."""
    past_inputs = set(aliases.values())
    attention = [node for node in model.graph.node
                 if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft"]
    read = {name for node in attention for name in node.input[3:5]}
    return bool(attention) and 2 * len(attention) == len(past_inputs) and read == past_inputs


def _stamp(model: onnx.ModelProto, phase: str) -> None:
    """Say who made the graph, for a program or a viewer that opens it alone: the exporter's producer ("pytorch")
    claimed graphs holding com.microsoft ops and quantized weights that PyTorch never wrote."""
    from importlib import metadata

    try:
        version = metadata.version("aotlm")
    except metadata.PackageNotFoundError:
        version = "unknown"
    model.producer_name, model.producer_version = "aotlm", version
    model.doc_string = (f"aotlm's {phase} engine for onnxruntime: run it as the artifact's manifest.json describes "
                        f"(its engines.{phase} I/O, session_config and kv_cache sections)")
    kept = [prop for prop in model.metadata_props if prop.key != "aotlm.phase"]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key="aotlm.phase", value=phase)


def write_engines(graphs: dict[str, onnx.ModelProto], folder: Path, backend_spec, aliases: dict[str, str]) -> dict:
    """Write <phase>.onnx + weights.bin into folder; returns the manifest's engines and backend sections."""
    import onnxruntime

    check_runnable(graphs)
    weight_bytes = _externalize(graphs, folder / WEIGHTS_FILE)
    engines = {}
    for phase, model in graphs.items():
        _stamp(model, phase)
        onnx.save_model(model, folder / f"{phase}.onnx")
        engines[phase] = {"file": f"{phase}.onnx", "backend": "onnxruntime", **io_spec(model, aliases)}
        config = session_config(model)  # entries a pass needs this engine's session to have
        if config:
            engines[phase]["session_config"] = config
    if "prefill" in engines:
        engines["prefill"]["takes_past"] = takes_past(graphs["prefill"], aliases)
    backend = {
        "name": "onnxruntime",
        "version": onnxruntime.__version__,
        "session": {
            "intra_op_threads": backend_spec.intra_op_threads,
            "graph_optimization_level": backend_spec.graph_optimization_level,
        },
        "weights": {"file": WEIGHTS_FILE, "bytes": weight_bytes, "shared_by": sorted(graphs)},
    }
    return {"engines": engines, "backend": backend}
