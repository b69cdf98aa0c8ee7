"""The pass manager: runs a recipe's passes, in order, over each phase's graph ("prefill", "decode").

Passes only rewrite. This module does the cross-cutting work around each one, as LLVM's pass manager
and its instrumentation do: it looks the pass up in the registry, times it, checks the result
(onnx.checker, strict shape inference, graph inputs and outputs kept), optionally dumps the intermediate graph
(`aotlm build --dump-passes DIR`), and collects
the reports as JSON-ready dicts for the manifest. A pass whose options have a `phases` field runs on those
phases' graphs only (the others keep theirs, and their report says why): passes do not know which graph they get.
A pass registered with `runs_first_on` gets those phases' graphs first (quantize: decode, whose lm_head reads
every token, so the calibration results both phases share come from all of them); reports keep the graphs' order.
The passes run pass by pass over all phases, or, for a large model (spill_dir), phase by phase with the graphs not in
work kept on disk.
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx

from compiler.errors import BuildError
from compiler.pass_reports import PHASES_OPTION, PassResult
from passes.cleanup import SHAPE_DATA_MAX_BYTES, shape_skeleton, tensor_nbytes, without_any_initializers
from passes.errors import PassError
from passes.quantize import methods_used
from passes.registry import PASSES, PassEntry
from passes.session_config import record_session_config, session_config

# Initializers above this go to the side file when a graph is spilled (run_pipeline's spill_dir).
SPILL_ABOVE_BYTES = 1024
# Above this a dumped graph keeps its weights in a side file: one .onnx must stay under protobuf's 2 GiB,
# and small files open faster in viewers such as Netron.
DUMP_EXTERNAL_DATA_BYTES = 100 << 20
# onnxruntime contrib ops registered in the default domain (onnxruntime refuses them under com.microsoft).
RUNTIME_DEFINED_DEFAULT_DOMAIN_OPS = {"SimplifiedLayerNormalization"}
# Passes that refuse a graph they have already rewritten.
RUN_ONCE = ("quantize", "quantize_kv_cache")
ONNXRUNTIME_LOWERINGS = ("lower_onnxruntime", "lower_onnx_attention")  # their graphs run in onnxruntime
# (pass, a pass it must not come after, unless such a lowering lies between (True) or in any case (False), the fix)
ORDER_RULES = (
    ("quantize", "fuse_attention", True,
     "its calibration and the accuracy report run the graph in onnxruntime, which cannot run aotlm.FlashAttention; "
     "list quantize before fuse_attention, or after lower_onnxruntime or lower_onnx_attention"),
    ("fuse_attention", "lower_tensorrt", False,
     "lower_tensorrt turns the aotlm.FlashAttention nodes fuse_attention makes into TensorRT's; before it, it finds "
     "none, and TensorRT's parser cannot read the fused nodes left; list lower_tensorrt after fuse_attention"),
    ("fuse_attention", "fuse_rotary", False,
     "fuse_attention reads the rotary math that fuse_rotary replaces; list fuse_rotary after fuse_attention (it then "
     "rotates what fuse_attention left unfused)"),
    ("fuse_attention", "pack_projections", False,
     "fuse_attention reads each projection's own MatMul; list pack_projections after the attention lowering"),
    ("quantize", "dequantize_weights", False,
     "dequantize_weights rewrites the MatMulNBits that quantize emits; list it after quantize"),
    ("skip_unused_rows", "dequantize_weights", False,
     "skip_unused_rows moves products by constant weights, and dequantize_weights computes theirs; list "
     "dequantize_weights after skip_unused_rows"),
    ("slice_packed_weights", "dequantize_weights", False,
     "after dequantize_weights it would cut the packed float weights folded at load, whose freed blocks stay in the "
     "heap (the INT4 engine held 1195 MB, not 733); list slice_packed_weights before dequantize_weights, which then "
     "unpacks each part's 4- or 8-bit codes"),
    ("quantize", "quantize_kv_cache", False,
     "AWQ folds input scales into the value projection, so the cache would hold values divided by scales the int8 "
     "cache's were not calibrated on; list quantize_kv_cache after quantize"),
    ("quantize", "slice_packed_weights", False,
     "slice_packed_weights makes prefill's packed products read column slices of their weight, which quantize does "
     "not take as constant weights: prefill would keep them float, and an AWQ scale folded into decode's value "
     "columns would not be in prefill's, so the two graphs would write different values to the cache; list "
     "slice_packed_weights after quantize (it then cuts the quantized codes)"),
    ("cleanup", "dequantize_weights", False,
     "cleanup would fold at build time the unpacking dequantize_weights leaves to the session load, storing each "
     "weight again as int8 beside its 4-bit codes (an int4 artifact's weights.bin grew 2.7-fold); list cleanup "
     "before it"),
    ("cleanup", "slice_packed_weights", False,
     "cleanup would fold prefill's slices of the packed weights into copies stored beside them; list cleanup "
     "before it"),
    ("quantize", "skip_unused_rows", False,
     "its calibration must see every row of the last layer, which skip_unused_rows drops from the prefill graph; "
     "list skip_unused_rows after quantize"),
)


def run_pipeline(
    graphs: Mapping[str, onnx.ModelProto],
    passes: Sequence,
    *,
    check: bool = True,
    dump_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
    consume: bool = False,
    spill_dir: str | os.PathLike | None = None,
    numbered: tuple[int, int] | None = None,
) -> tuple[dict[str, onnx.ModelProto], list[PassResult]]:
    """Runs each pass (anything with `.name` and `.options`) over every phase; returns the graphs and one result
    per (pass, phase), pass by pass, each pass's in the graphs' order. Raises BuildError when a pass is unknown or its
    result fails a check.
    consume=True replaces each graph in `graphs` itself (a dict) as its passes run, so the caller's dict does not
    keep a copy of every weight alive through the build; the returned dict is then `graphs`. When a pass fails, that
    dict is left with each graph as far as it got (the build that passes it stops there).
    spill_dir (with consume=True): run the passes one phase at a time, the other phases' graphs in files there, so
    that one phase's graph is in memory, not all (they hold the same weights, each its own copy): a phase's graph is
    read back once, runs every pass, and is written there again while the next phase runs. A graph may come in
    spilled already (the path spill_graph returned); the returned graphs are all in memory. A phase a pass wants first
    (runs_first_on) runs all its passes first. Only for passes that share nothing between phases: they see the same
    graphs either way, but a pass that keeps state from one phase for the next (quantize_kv_cache's calibration)
    would see the phases in another order.
    numbered=(passes before these, passes in all): what the progress lines' "[i/n]" count, for a caller that runs
    a recipe's passes in more than one call (the build: before and from the first quantizing pass)."""
    if spill_dir is not None and not consume:
        raise TypeError("run_pipeline(spill_dir=...) replaces the graphs as it goes: pass consume=True")
    say = progress or (lambda line: None)
    # Look every pass up before running any, so a typo in the last pass does not cost a long build.
    entries = [(spec, lookup_pass(spec.name)) for spec in passes]
    if not consume:
        graphs = dict(graphs)
    elif not isinstance(graphs, dict):
        raise TypeError("run_pipeline(consume=True) replaces the graphs in place: pass a dict")
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)

    options = [_options_for(spec, entry) for spec, entry in entries]
    numbered = numbered or (0, len(entries))
    ran: dict[tuple[int, str], PassResult] = {}
    # The collections after each pass (_run_pass) and the automatic ones need only look at what the passes make: the
    # objects from before (torch's and the exporter's, ~200k) go to the collector's permanent generation while the
    # passes run (1.0-1.5 s of a default build's collections), and back after, to be collected as before.
    freeze = gc.get_freeze_count() == 0  # a caller's own freeze is left to it
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        _run_passes(graphs, entries, options, check, dump_dir, say, numbered, spill_dir, ran)
    finally:
        if freeze:
            gc.unfreeze()
    for phase in graphs:
        graphs[phase] = _unspilled(graphs[phase])
    # reported pass by pass, each in the graphs' order, whichever phase ran first
    return graphs, [ran[index, phase] for index in range(len(entries)) for phase in graphs]


def _run_passes(graphs: dict, entries: list, options: list, check: bool, dump_dir: str | None, say,
                numbered: tuple[int, int], spill_dir, ran: dict) -> None:
    """run_pipeline's loop: each (pass, phase)'s new graph into `graphs`, its result into `ran`."""
    if spill_dir is None or len(graphs) < 2:
        for index, (spec, entry) in enumerate(entries):
            for phase in _first_on(graphs, entry.runs_first_on):
                graphs[phase], ran[index, phase] = _run_pass(index, entries, options, phase, _unspilled(graphs[phase]),
                                                             check, dump_dir, say, numbered)
    else:
        # Phase by phase: each graph is read back once, runs every pass, and goes back to disk while the next runs.
        # A phase a pass wants first (runs_first_on) runs all its passes first.
        wanted = {phase for _, entry in entries for phase in entry.runs_first_on}
        if len(wanted) > 1:
            raise BuildError(f"passes want different phases first ({', '.join(sorted(wanted))}); they cannot run one "
                             f"phase at a time")
        order = _first_on(graphs, tuple(wanted))
        for phase in order:
            model = _unspilled(graphs[phase])
            for index in range(len(entries)):
                model, ran[index, phase] = _run_pass(index, entries, options, phase, model, check, dump_dir, say,
                                                     numbered)
                graphs[phase] = model  # consume: as far as it got, should a later pass fail
            if phase != order[-1]:
                graphs[phase] = spill_graph(model, Path(spill_dir) / phase)
            del model
            gc.collect()


def _first_on(graphs: Mapping, first: tuple[str, ...]) -> list[str]:
    return sorted(graphs, key=lambda name: name not in first)  # stable: the rest keep their order


def _run_pass(index: int, entries: list, options: list, phase: str, model: onnx.ModelProto, check: bool,
              dump_dir: str | None, say, numbered: tuple[int, int]) -> tuple[onnx.ModelProto, PassResult]:
    """Pass `index` on one phase's graph: the new graph (or `model`, where the pass does not run on this phase) and
    its result."""
    spec, entry = entries[index]
    phases = getattr(options[index], "phases", None)
    if phases is not None and phase not in phases:
        return model, PassResult(spec.name, phase, 0.0, {"applied": False, "reason": (
            f"runs on {', '.join(phases)} only {PHASES_OPTION}")}, len(model.graph.node), len(model.graph.node),
            numbered[0] + index)
    say(f"[{numbered[0] + index + 1}/{numbered[1]}] {spec.name} ({phase})")
    started = time.perf_counter()
    try:
        new_model, report = entry.run(model, options[index])
    except PassError as error:  # said as the recipe's other errors are: its position, the pass, then the problem
        said = str(error).removeprefix(f"{spec.name}: ")  # a pass that names itself: once
        raise BuildError(f"passes[{numbered[0] + index}] ({spec.name}, {phase} graph): {said}") from None
    seconds = time.perf_counter() - started
    if session_config(model) and not session_config(new_model):
        # Most passes rebuild the model through onnx-graphsurgeon, which drops metadata: the session
        # settings an earlier pass recorded (passes/session_config.py) go on with the graph.
        record_session_config(new_model, model, {})
    report = to_json(report, f"pass '{spec.name}' ({phase}) report")
    if check:
        check_pass_result(spec.name, phase, model, new_model, report)
    if dump_dir:
        dump_model(new_model, os.path.join(dump_dir, f"{numbered[0] + index:02d}-{spec.name}-{phase}.onnx"))
    result = PassResult(spec.name, phase, seconds, report, nodes_before=len(model.graph.node),
                        nodes_after=len(new_model.graph.node), index=numbered[0] + index)
    del model
    # graphsurgeon's graphs are reference cycles (nodes and tensors point at each other) that hold the
    # previous model's weights: left to the cycle collector, which large buffers do not prompt, a
    # 1.8 GB model's build grew by a copy of its weights per pass (18 GB at the end, not 7).
    gc.collect()
    say(f"{spec.name} ({phase}): {seconds:.2f} s, nodes {result.nodes_before} -> {result.nodes_after}")
    return new_model, result


def spill_graph(model: onnx.ModelProto, folder: Path) -> Path:
    """Write `model` (taking its data: onnx moves it out as it writes) to folder/graph.onnx with its weights in a
    side file; returns the path to read it back from."""
    folder.mkdir(parents=True, exist_ok=True)
    path, data = folder / "graph.onnx", folder / "graph.data"
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
                    size_threshold=SPILL_ABOVE_BYTES, convert_attribute=False)
    return path


def _unspilled(graph: onnx.ModelProto | Path) -> onnx.ModelProto:
    """A spilled graph read back whole; its files go (they would hold a copy of the weights on disk to the end)."""
    if not isinstance(graph, Path):
        return graph
    model = onnx.load(str(graph), load_external_data=True)
    for tensor in model.graph.initializer:  # as it was before the spill (onnx sets the default explicitly)
        if tensor.HasField("data_location") and tensor.data_location == onnx.TensorProto.DEFAULT:
            tensor.ClearField("data_location")
    graph.unlink()
    (graph.parent / "graph.data").unlink(missing_ok=True)
    return model


def check_passes(passes: Sequence) -> None:
    """Each pass's options, checked before the slow export (a pass checks what needs no graph in `entry.check`),
    and passes that must not run twice. Raises BuildError naming the pass's index."""
    names = [spec.name for spec in passes]
    for index, spec in enumerate(passes):
        entry = lookup_pass(spec.name)
        if spec.name in RUN_ONCE and spec.name in names[:index]:
            per_layer = ", with overrides for per-layer settings" if spec.name == "quantize" else ""
            raise BuildError(f"passes[{index}]: {spec.name} is listed twice (the second would find nothing left to do); "
                             f"use one{per_layer}")
        options = _options_for(spec, entry)
        _check_order(names, index, options)
        if entry.check is not None:
            try:
                entry.check(options)
            except PassError as error:
                raise BuildError(f"passes[{index}] ({spec.name}): {error}") from None
        if getattr(options, "max_rewrites", None) is not None and options.max_rewrites < 0:
            raise BuildError(f"passes[{index}].{spec.name}.max_rewrites: {options.max_rewrites} must be >= 0 "
                             f"(or null: every match)")


def _check_order(names: Sequence[str], index: int, options) -> None:
    for later, earlier, unless_lowered, fix in ORDER_RULES:
        if names[index] != later or earlier not in names[:index]:
            continue
        at = names.index(earlier)
        between = names[at:index]
        if unless_lowered and any(name in ONNXRUNTIME_LOWERINGS for name in between):
            continue
        if (later, earlier) == ("quantize", "fuse_attention") and "lower_tensorrt" in between:
            methods = methods_used(options)
            calibrated = options.calibration is not None
            if methods <= {"rtn"} and not calibrated:  # no graph runs; the accuracy report is onnxruntime's only
                continue
            why = (f"method {', '.join(sorted(methods - {'rtn'}))}, whose calibration" if methods - {"rtn"} else
                   "calibration set, whose per-layer error report")
            raise BuildError(f"passes[{index}] (quantize) comes after passes[{names.index('lower_tensorrt')}] "
                             f"(lower_tensorrt) with {why} runs the graph in onnxruntime, which cannot run TensorRT's "
                             f"plugins; list quantize before fuse_attention (it calibrates on the float graph "
                             f"there), or use method rtn without calibration after lower_tensorrt")
        raise BuildError(f"passes[{index}] ({later}) comes after passes[{at}] ({earlier}): {fix}")


def lookup_pass(name: str) -> PassEntry:
    if name not in PASSES:
        raise BuildError(f"unknown pass '{name}'; known passes: {', '.join(sorted(PASSES))}")
    return PASSES[name]


def _options_for(spec, entry: PassEntry):
    options = getattr(spec, "options", None)
    if options is None:
        return entry.options_type()
    if not isinstance(options, entry.options_type):
        raise BuildError(f"pass '{spec.name}' takes {entry.options_type.__qualname__} options, "
                         f"got {type(options).__qualname__}")
    return options


def check_pass_result(name: str, phase: str, before: onnx.ModelProto, after: onnx.ModelProto, report: dict) -> None:
    """Raises BuildError, naming the pass and phase, when `after` is not a valid model or lost its I/O names."""
    if not isinstance(after, onnx.ModelProto):
        raise BuildError(f"pass '{name}' ({phase}) returned a {type(after).__name__}, not an onnx.ModelProto")
    skeleton = _as_checked(checkable_copy(after, name, phase))
    try:
        # Nodes of domains the checker does not know (aotlm, com.microsoft) pass as long as the model
        # imports their domain; shape inference runs below, on the weights' types and shapes only.
        onnx.checker.check_model(skeleton, full_check=False)
    except onnx.checker.ValidationError as error:
        raise BuildError(f"pass '{name}' produced an invalid {phase} graph: {_one_line(error)}") from None
    shape_error = _shape_error(after)
    if shape_error and not _shape_error(before):  # a graph whose shapes did not check before is not this pass's
        raise BuildError(f"pass '{name}' produced a {phase} graph whose shapes do not check: {shape_error}")
    if report.get("changes_io"):
        return
    for kind in ("input", "output"):
        names_before = [value.name for value in getattr(before.graph, kind)]
        names_after = [value.name for value in getattr(after.graph, kind)]
        if names_before != names_after:
            raise BuildError(
                f"pass '{name}' changed the {phase} graph's {kind}s from {names_before} to {names_after}; "
                f"a pass that means to must say changes_io: True in its report")


def _as_checked(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime defines a few ops in the default ONNX domain that onnx has no schema for: checked as if they
    were in a custom domain (whose nodes the checker accepts and shape inference passes over)."""
    for node in model.graph.node:
        if not node.domain and node.op_type in RUNTIME_DEFINED_DEFAULT_DOMAIN_OPS:
            node.domain = "com.microsoft"
    return model


def _shape_error(model: onnx.ModelProto) -> str | None:
    """Why strict shape inference refuses `model` (a MatMul of sizes that cannot meet, a Reshape of the wrong
    count), or None: caught at the pass that made it rather than as onnxruntime's error at the session load."""
    try:
        onnx.shape_inference.infer_shapes(_as_checked(shape_skeleton(model)), strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as error:
        return _one_line(error)
    return None


def _one_line(error: Exception) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


TYPED_DATA_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")
ONE_VALUE_PER_ELEMENT_FIELDS = ("float_data", "int64_data", "double_data", "uint64_data")  # complex: two
COMPLEX_TYPES = (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128)


def checkable_copy(model: onnx.ModelProto, name: str = "?", phase: str = "?") -> onnx.ModelProto:
    """What onnx.checker needs of `model`, without the data of its large weights. The checker serializes what it
    checks: a model of 2 GiB or more cannot be (protobuf's limit), and copying every weight per pass is slow. Every
    field is copied but the large initializers, which go in as empty stubs of the same name and type (so duplicate
    names, undefined types and where initializers may stand are checked as before); what the checker would have
    checked of their data (one data field, of the length the dims say) is checked here."""
    skeleton = without_any_initializers(model)
    for tensor in model.graph.initializer:
        try:
            size = tensor_nbytes(tensor)
        except (KeyError, ValueError):  # a type tensor_nbytes does not know (UNDEFINED): the checker names it
            size = None
        if size is None or size <= SHAPE_DATA_MAX_BYTES or tensor.data_location == onnx.TensorProto.EXTERNAL:
            skeleton.graph.initializer.append(tensor)
            continue
        skeleton.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=[0])
        typed = [field for field in TYPED_DATA_FIELDS if len(getattr(tensor, field))]
        if len(typed) + tensor.HasField("raw_data") != 1:
            fields = (["raw_data"] if tensor.HasField("raw_data") else []) + typed
            raise BuildError(f"pass '{name}' produced an invalid {phase} graph: initializer {tensor.name!r} has "
                             f"{len(fields)} data fields ({', '.join(fields) or 'none'}); it needs exactly one")
        if typed and typed[0] in ONE_VALUE_PER_ELEMENT_FIELDS:
            values = len(getattr(tensor, typed[0]))
            needed = (2 if tensor.data_type in COMPLEX_TYPES else 1) * math.prod(tensor.dims)
            if values < needed:
                raise BuildError(f"pass '{name}' produced an invalid {phase} graph: initializer {tensor.name!r} holds "
                                 f"{values} {typed[0]} values, and its dims {list(tensor.dims)} need {needed}")
        # len() copies the bytes once: upb has no cheaper way (ByteSize() serializes the tensor into a growing buffer,
        # which took twice the time and twice the bytes)
        if tensor.HasField("raw_data") and (length := len(tensor.raw_data)) != size:
            raise BuildError(f"pass '{name}' produced an invalid {phase} graph: initializer {tensor.name!r} holds "
                             f"{length} bytes of raw_data, and its dims {list(tensor.dims)} and type "
                             f"need {size}")
    return skeleton


def to_json(value, where: str):
    """Returns `value` with numpy scalars and arrays as Python ones, so the report can go into the manifest."""
    if isinstance(value, Mapping):
        return {str(key): to_json(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(item, f"{where}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise BuildError(f"{where} holds a {type(value).__name__}, which is not JSON-serializable")


def dump_model(model: onnx.ModelProto, path: str) -> None:
    """model at path (its weights in path.data when large), or nothing there: a full disk left a cut-short .onnx
    that onnx cannot read, and an error that named no file."""
    try:
        _save_dump(model, path)
    except OSError as problem:
        for written in (path, path + ".data"):
            with contextlib.suppress(OSError):
                os.remove(written)
        problem.filename = problem.filename or path
        raise


def _save_dump(model: onnx.ModelProto, path: str) -> None:
    if model.ByteSize() < DUMP_EXTERNAL_DATA_BYTES:
        onnx.save_model(model, path)
        return
    data_file = os.path.basename(path) + ".data"
    data_path = os.path.join(os.path.dirname(path), data_file)
    if os.path.exists(data_path):
        os.remove(data_path)  # onnx appends to an existing data file
    # Saving with external data rewrites the tensors it moves out, so it gets a copy, not the graph in flight.
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(copy, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_file, size_threshold=1024)
