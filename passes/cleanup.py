"""cleanup: constant folding, dead-node removal, shared initializers, shape inference.

The tidy-up every recipe runs first (and may run again after rewrites):

    Constant ─► Add ─► Mul ─┐                 ->   folded (initializer) ─┐
    x ──────────────────────┴─► MatMul ─► y         x ───────────────────┴─► MatMul ─► y
    x ─► Relu ─► (read by nothing)            ->   (removed)
    bias_a = bias_b = [1, 2, 3]               ->   bias_a (bias_b's consumers now read bias_a)

Pure: the input ModelProto is never mutated. Graph inputs and outputs are kept exactly, names and
order, including inputs that nothing reads (KV-cache inputs look unused in some graphs).
Weights stay in memory (a model of ~540 MB is fine) and are never serialized: shape inference runs
on the graph without its large weights, and the result holds one copy of each weight it keeps.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.importers.onnx_importer import get_onnx_tensor_dtype, get_onnx_tensor_shape
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues

from passes.calibration import cpu_threads
from passes.graph_export import export_onnx
from passes.graph_patterns import constant_type

# The standard op domains: only their ops are folded (onnxruntime may not run aotlm or com.microsoft ops).
ONNX_DOMAINS = {"", "ai.onnx"}
# Sub-byte element types: ONNX packs them, so numpy's itemsize (1) would overstate their size.
SUB_BYTE_BITS = {name: bits for name, bits in
                 [("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2)]
                 if hasattr(onnx.TensorProto, name)}
# Initializers up to this size keep their values during shape inference (see inferred_value_info).
SHAPE_DATA_MAX_BYTES = 64 << 10
# Ops whose output is a fresh sample each run: folding would freeze one sample into the graph.
RANDOM_OPS = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"}
# graphsurgeon's shape folding runs these on int tensors cast to float and back (TensorRT's shape tensors), its
# constants cast to int: exact only for whole constants that nothing else reads (_guard_cast_elision).
CAST_ELISION_OPS = {"Add", "Sub", "Mul", "Div", "Max", "Min", "Equal", "Greater", "Less", "Concat"}


# deduplicate_initializers tells same-layout tensors apart by this many bytes from each end before hashing any
DIGEST_SAMPLE_BYTES = 4096


@dataclass(frozen=True)
class Options:
    fold_constants: bool = True
    deduplicate_initializers: bool = True
    infer_shapes: bool = True
    # Folding an Expand or Tile of a constant can create a tensor far larger than the subgraph computing it;
    # results above this size are left to be computed at inference time.
    fold_size_threshold_bytes: int = field(default=1 << 20, metadata={"min": 0})


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    """Returns a cleaned copy of `model` and a report of what changed, in numbers."""
    report: dict = {"dead_nodes_removed": 0, "nodes_folded": 0, "constants_folded": 0,
                    "initializers_deduplicated": 0}
    # An initializer that is also a graph input is a default the caller may override (older exporters write
    # them). Cleaned as a plain input, nothing reads its default: not folding, sharing nor shape inference.
    overridable = {value.name for value in model.graph.input} & {t.name for t in model.graph.initializer}
    source = _without_initializers(model, overridable) if overridable else model
    # Shapes let folding size its results (the threshold) and fold Shape ops of static tensors.
    shapes = inferred_value_info(source, report) if options.infer_shapes and options.fold_constants else []
    graph = _import(source, shapes)
    nodes_before = len(graph.nodes)
    graph.cleanup()  # keeps unused graph inputs (remove_unused_graph_inputs=False)
    report["dead_nodes_removed"] = nodes_before - len(graph.nodes)

    if options.fold_constants:
        graph = _fold_constants(graph, lambda: _import(source, shapes), options.fold_size_threshold_bytes, report)
    if options.deduplicate_initializers:
        first_seen = {tensor.name: index for index, tensor in enumerate(model.graph.initializer)}
        report["initializers_deduplicated"] = deduplicate_initializers(graph, first_seen)
    # One cleanup for all edits: drops rewired duplicates and initializers nothing reads.
    graph.cleanup().toposort()

    result = _export(graph, model)
    del graph
    if options.infer_shapes:
        inferred = inferred_value_info(result, report)
        del result.graph.value_info[:]  # `result` is our own copy: what ONNX infers replaces what gs exported
        result.graph.value_info.extend(inferred)
    result.graph.initializer.extend(t for t in model.graph.initializer if t.name in overridable)  # the defaults
    _restore_graph_inputs(result, model)
    _require_same_io(model, result)
    report.update(_compare(_summarize(model), _summarize(result)))
    report["inputs"] = [value.name for value in result.graph.input]
    report["outputs"] = [value.name for value in result.graph.output]
    return result, report


def _import(model: onnx.ModelProto, shapes: list[onnx.ValueInfoProto]) -> gs.Graph:
    graph = gs.import_onnx(model)
    _detach_attribute_tensors(graph)
    _float32_constant_attributes(graph)
    _shape_ranges_as_slices(graph)
    apply_shapes(graph, shapes)
    return graph.toposort()  # fold_constants requires topological order


def _without_initializers(model: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """`model` without the initializers `names` (they stay graph inputs): a copy, since the input is never mutated,
    that copies each kept weight once (a whole-model copy, then the kept ones again, took 3x the weights)."""
    copy = without_any_initializers(model)
    copy.graph.initializer.extend(tensor for tensor in model.graph.initializer if tensor.name not in names)
    return copy


def without_any_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of every field of `model` but its graph's initializers, which the caller adds as it needs."""
    copy = onnx.ModelProto()
    copy_fields(model, copy, skip="graph")
    copy_fields(model.graph, copy.graph, skip="initializer")
    return copy


def copy_fields(source, target, skip: str) -> None:
    """Copy every field of protobuf message `source` that is set into `target`, but `skip` (never read: a tensor's
    raw_data is not copied into Python)."""
    for descriptor in source.DESCRIPTOR.fields:
        if descriptor.name == skip:
            continue
        value = getattr(source, descriptor.name)
        if descriptor.is_repeated:
            getattr(target, descriptor.name).extend(value)
        elif descriptor.message_type is not None:
            if source.HasField(descriptor.name):
                getattr(target, descriptor.name).CopyFrom(value)
        elif source.HasField(descriptor.name) if descriptor.has_presence else value:
            setattr(target, descriptor.name, value)


def _float32_constant_attributes(graph: gs.Graph) -> None:
    """Constant(value_float[s]) as a float32 `value`: graphsurgeon reads the attribute as a float64 array, so the
    folded initializer was DOUBLE and onnxruntime refused the graph (Mul bound to float and double)."""
    for node in graph.nodes:
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):
                _float32_constant_attributes(value)
        for key in ("value_float", "value_floats"):
            if node.op == "Constant" and key in node.attrs:
                values = np.asarray(node.attrs.pop(key), dtype=np.float32)
                node.attrs["value"] = gs.Constant(f"{node.outputs[0].name}_value", values)


def _shape_ranges_as_slices(graph: gs.Graph) -> None:
    """Shape(x, start, end) as Slice(Shape(x)): graphsurgeon's shape folding reads Shape as the whole shape and
    ignores start and end (Shape(start=1) of a static [2, 3, 4, 5] folded to [2, 3, 4, 5]); it folds the Slice
    right."""
    for node in list(graph.nodes):
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):
                _shape_ranges_as_slices(value)
        if node.op != "Shape" or not ({"start", "end"} & set(node.attrs)):
            continue
        start, end = node.attrs.pop("start", 0), node.attrs.pop("end", None)
        whole = gs.Variable(f"{node.outputs[0].name}_whole_shape", np.int64)
        part = node.outputs[0]
        node.outputs = [whole]
        bounds = [gs.Constant(f"{part.name}_{what}", np.array([value], np.int64))
                  for what, value in (("starts", start), ("ends", np.iinfo(np.int64).max if end is None else end),
                                      ("axes", 0))]
        graph.nodes.append(gs.Node("Slice", name=f"{part.name}_range", inputs=[whole, *bounds], outputs=[part]))


def _guard_cast_elision(graph: gs.Graph) -> list[gs.Node]:
    """Before graphsurgeon's shape folding: an Identity after each op its cast elision would get wrong (a constant
    that is not whole, y = int(float(x) * 0.5) became x * 0; or one another node reads too, which it retypes in
    place), so that its pattern no longer matches. Returns them, for _unguard after the folding."""
    guards = []
    for node in list(graph.nodes):
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):  # fold_constants elides in subgraphs too
                guards += _guard_cast_elision(value)
        if node.op not in CAST_ELISION_OPS or not any(
                producer.op == "Cast" for tensor in node.inputs for producer in tensor.inputs):
            continue
        # Safe only when every operand not cast from int is a whole constant (an initializer or a Constant node's)
        # that nothing else reads: graphsurgeon recasts it in place.
        others = [tensor for tensor in node.inputs if not any(p.op == "Cast" for p in tensor.inputs)]
        if all(_sole_whole_constant(tensor) for tensor in others):
            continue
        for output in node.outputs:
            if output.outputs and all(consumer.op == "Cast" for consumer in output.outputs):
                guarded = gs.Variable(f"{output.name}_guarded", output.dtype, output.shape)
                for consumer in list(output.outputs):
                    consumer.inputs[consumer.inputs.index(output)] = guarded
                guards.append(gs.Node("Identity", name=f"{output.name}_guard", inputs=[output], outputs=[guarded]))
                graph.nodes.append(guards[-1])
    return guards


def _sole_whole_constant(tensor: gs.Tensor) -> bool:
    """A constant (an initializer, or a Constant node's output) of whole numbers that only one node reads."""
    if len(tensor.outputs) != 1:
        return False
    if isinstance(tensor, gs.Constant):
        stored = tensor
    elif len(tensor.inputs) == 1 and tensor.inputs[0].op == "Constant" and isinstance(
            tensor.inputs[0].attrs.get("value"), gs.Constant):
        stored = tensor.inputs[0].attrs["value"]
    else:
        return False
    if constant_type(stored).kind not in "iubf":  # bfloat16: graphsurgeon would cast its values to read them, and
        return False                              # warn of it for every weight (a guard is the safe answer)
    values = np.asarray(stored.values)
    return values.dtype.kind in "iub" or bool(np.all(np.isfinite(values) & (values == np.round(values))))


def _unguard(graph: gs.Graph, guards: list[gs.Node]) -> None:
    """Remove the Identity nodes _guard_cast_elision put in (those folding left): their readers read their input."""
    for guard in guards:
        if not guard.inputs or not guard.outputs:
            continue
        source, guarded = guard.inputs[0], guard.outputs[0]
        for consumer in list(guarded.outputs):
            consumer.inputs[consumer.inputs.index(guarded)] = source
        guard.inputs.clear()
        guard.outputs.clear()


def apply_shapes(graph: gs.Graph, shapes: list[onnx.ValueInfoProto]) -> None:
    """Give the graph's computed tensors the types and shapes of `shapes` (inferred_value_info's)."""
    tensors = graph.tensors()
    for value in shapes:
        tensor = tensors.get(value.name)
        if isinstance(tensor, gs.Variable) and value.type.HasField("tensor_type"):
            tensor.dtype, tensor.shape = get_onnx_tensor_dtype(value), get_onnx_tensor_shape(value)


def _detach_attribute_tensors(graph: gs.Graph) -> None:
    """Copies the (small) tensors in node attributes, such as a Constant node's value.

    Folding turns a Constant node into a tensor that points at that attribute's TensorProto, and exporting
    renames the proto: without a copy that would write into the caller's model.
    """
    for node in graph.nodes:
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):
                _detach_attribute_tensors(value)
            elif (isinstance(value, gs.Constant) and isinstance(value._values, LazyValues)
                  and not isinstance(value._values, SparseValues)):
                own = onnx.TensorProto()
                own.CopyFrom(value._values.tensor)
                value._values = LazyValues(own)


def _fold_constants(graph: gs.Graph, unfolded: Callable[[], gs.Graph], size_threshold: int, report: dict) -> gs.Graph:
    """Folds what depends only on constants; on an evaluation error folds nothing and says why in the report."""
    variables = {name for name, tensor in graph.tensors().items() if isinstance(tensor, gs.Variable)}
    nodes_before = len(graph.nodes)
    import onnxruntime  # graphsurgeon evaluates with it; its optimizer warnings are noise in a build log

    onnxruntime.set_default_logger_severity(3)
    guards = _guard_cast_elision(graph)
    graph.toposort()  # graphsurgeon folds in a few passes over the node list: a guard out of order stops a chain
    try:
        with _sessions_on_usable_cpus(onnxruntime):
            graph.fold_constants(size_threshold=size_threshold, error_ok=False,
                                 should_exclude_node=lambda node: (node.domain or "") not in ONNX_DOMAINS
                                 or node.op in RANDOM_OPS)
    except Exception as error:  # onnxruntime raises many types; any of them means "not folded"
        # fold_constants edits the graph before it evaluates, so start again from the unfolded model.
        report["fold_skipped"] = f"onnxruntime could not evaluate the constant subgraph: {error}"
        graph = unfolded()
        graph.cleanup()
        return graph
    _unguard(graph, guards)
    graph.cleanup()  # the folded subgraphs are now dead
    report["nodes_folded"] = nodes_before - len(graph.nodes)
    report["constants_folded"] = sum(1 for name, tensor in graph.tensors().items()
                                     if isinstance(tensor, gs.Constant) and name in variables)
    return graph


@contextlib.contextmanager
def _sessions_on_usable_cpus(onnxruntime):
    """graphsurgeon opens a session per folded subgraph with no options, so onnxruntime's default pool, which pins a
    worker to every physical core: in a container's cpuset each session printed "pthread_setaffinity_np failed".
    Where the process may not use every CPU, those sessions get the passes' thread count (cpu_threads) instead."""
    threads = cpu_threads()
    if not threads:
        yield
        return
    original = onnxruntime.InferenceSession

    def bounded(model, sess_options=None, *args, **kwargs):
        if sess_options is None:
            sess_options = onnxruntime.SessionOptions()
            sess_options.intra_op_num_threads = threads
        return original(model, sess_options, *args, **kwargs)

    onnxruntime.InferenceSession = bounded
    try:
        yield
    finally:
        onnxruntime.InferenceSession = original


def deduplicate_initializers(graph: gs.Graph, first_seen: dict[str, int]) -> int:
    """Rewires the consumers of each initializer to the first one with the same dtype, shape and bytes.

    `first_seen` orders the original initializers (the first name is kept); folded constants come after.
    Returns how many initializers were rewired; the next cleanup() removes them.
    """
    graph_io = {tensor.name for tensor in graph.inputs + graph.outputs}
    constants = [tensor for tensor in graph.tensors().values()
                 if isinstance(tensor, gs.Constant) and tensor.name not in graph_io]
    constants.sort(key=lambda tensor: first_seen.get(tensor.name, len(first_seen)))  # stable: graph order next

    # Group by layout first so only tensors that could be equal get hashed: O(bytes), no pairwise compares.
    by_layout: dict[tuple, list[gs.Constant]] = defaultdict(list)
    for tensor in constants:
        by_layout[(str(tensor.dtype), tuple(tensor.shape))].append(tensor)

    rewired = 0
    for group in by_layout.values():
        if len(group) < 2:
            continue
        # A tensor is hashed in full only when a sample of its bytes (their start and end) matches an earlier one's:
        # same-layout weights that differ (each layer's) are told apart by the sample, which costs a copy, not a
        # hash (blake2b of every weight was ~1 s of a SmolLM2-135M build). Equal contents have equal samples, so
        # the same tensors are kept and rewired as when every one was hashed.
        first_by_sample: dict[bytes, gs.Constant] = {}
        kept: dict[bytes, dict[bytes, gs.Constant]] = {}  # sample -> digest -> the tensor kept for those bytes
        for tensor in group:
            data = _content_bytes(tensor)
            if data is None:
                continue
            sample = data[:DIGEST_SAMPLE_BYTES] + data[-DIGEST_SAMPLE_BYTES:]
            first = first_by_sample.setdefault(sample, tensor)
            if first is tensor:
                continue
            by_digest = kept.setdefault(sample, {})
            if not by_digest:
                by_digest[_digest(_content_bytes(first))] = first
            keep = by_digest.setdefault(_digest(data), tensor)
            del data
            if keep is not tensor:
                _rewire_consumers(tensor, keep)
                rewired += 1
    return rewired


def _content_bytes(tensor: gs.Constant) -> bytes | None:
    """The tensor's bytes, or None when they are not at hand (external data, sparse, strings)."""
    values = tensor._values  # not .values: that would load a lazy weight into numpy and keep the copy
    if isinstance(values, SparseValues):
        return None
    if isinstance(values, LazyValues):
        proto = values.tensor
        if proto.data_location == onnx.TensorProto.EXTERNAL or proto.data_type == onnx.TensorProto.STRING:
            return None
        return proto.raw_data if proto.HasField("raw_data") else values.load().tobytes()
    if values.dtype == object:
        return None
    return np.ascontiguousarray(values).tobytes()


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def _rewire_consumers(duplicate: gs.Tensor, keep: gs.Tensor) -> None:
    for node in list(duplicate.outputs):
        for index, tensor in enumerate(node.inputs):
            if tensor is duplicate:
                node.inputs[index] = keep


def shape_skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` as shape inference needs it: large weights as typed graph inputs, small initializers kept (data
    propagation reads their values: Reshape targets, Slice bounds)."""
    skeleton = without_any_initializers(model)
    input_names = {value.name for value in model.graph.input}
    for tensor in model.graph.initializer:
        if tensor_nbytes(tensor) <= SHAPE_DATA_MAX_BYTES:
            skeleton.graph.initializer.append(tensor)
        elif tensor.name not in input_names:  # an initializer listed as an input is typed there already
            skeleton.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    return skeleton


def inferred_value_info(model: onnx.ModelProto, report: dict) -> list[onnx.ValueInfoProto]:
    """ONNX shape inference (with data propagation) run on the graph without its large weights.

    infer_shapes takes the model as bytes and returns a new one: on the whole model that is several copies
    of every weight. A large weight only needs its type and shape, so it goes in as a typed graph input;
    small initializers stay, since data propagation reads their values (Reshape targets, Slice bounds).
    A graph ONNX cannot type gets no shapes, and the reason goes in the report.
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(shape_skeleton(model), strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as error:
        report["shape_inference_skipped"] = str(error).splitlines()[0]
        return list(model.graph.value_info)
    return list(inferred.graph.value_info)


def export_like(graph: gs.Graph, model: onnx.ModelProto) -> onnx.ModelProto:
    """`graph` as a ModelProto with `model`'s metadata and graph inputs, for a pass that never changes the inputs
    (graphsurgeon drops the inputs that are also initializers, and the initializers nothing reads any more: an
    overridable default keeps its input and gets its value back from `model`)."""
    result = _export(graph, model)
    present = {value.name for value in result.graph.input} | {tensor.name for tensor in result.graph.initializer}
    inputs = {value.name for value in model.graph.input}
    result.graph.initializer.extend(tensor for tensor in model.graph.initializer
                                    if tensor.name in inputs and tensor.name not in present)
    del result.graph.input[:]
    result.graph.input.extend(model.graph.input)
    return result


def _export(graph: gs.Graph, original: onnx.ModelProto) -> onnx.ModelProto:
    # do_type_check=False: an output the original left untyped stays untyped rather than failing the export.
    result = export_onnx(graph, do_type_check=False)
    # gs carries opsets, IR version and producer; the rest of the model's own fields are copied here.
    result.doc_string = original.doc_string
    result.domain = original.domain
    result.model_version = original.model_version
    result.metadata_props.extend(original.metadata_props)
    return result


def _restore_graph_inputs(result: onnx.ModelProto, original: onnx.ModelProto) -> None:
    """gs drops graph inputs that are also initializers (an old way to give defaults): put every one back, in order."""
    exported = {value.name: value for value in result.graph.input}
    if list(exported) == [value.name for value in original.graph.input]:
        return
    restored = []
    for value in original.graph.input:
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(exported.get(value.name, value))
        restored.append(copy)
    del result.graph.input[:]
    result.graph.input.extend(restored)


def _require_same_io(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    for kind in ("input", "output"):
        names_before = [value.name for value in getattr(before.graph, kind)]
        names_after = [value.name for value in getattr(after.graph, kind)]
        if names_before != names_after:  # a bug in this pass, never a property of the model
            raise RuntimeError(f"cleanup changed the graph {kind}s: {names_before} -> {names_after}")


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    """Size of an initializer's data, from its dims and type (without copying the data)."""
    count = math.prod(tensor.dims)
    type_name = onnx.TensorProto.DataType.Name(tensor.data_type)
    if type_name in SUB_BYTE_BITS:
        return (count * SUB_BYTE_BITS[type_name] + 7) // 8
    if tensor.data_type == onnx.TensorProto.STRING:
        return sum(len(item) for item in tensor.string_data)
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _summarize(model: onnx.ModelProto) -> dict:
    graph = model.graph
    ops = Counter(f"{node.domain}.{node.op_type}" if node.domain not in ONNX_DOMAINS else node.op_type
                  for node in graph.node)
    return {"nodes": len(graph.node), "ops": ops, "initializers": len(graph.initializer),
            "initializer_bytes": sum(tensor_nbytes(tensor) for tensor in graph.initializer)}


def _compare(before: dict, after: dict) -> dict:
    changed_ops = {op: {"before": before["ops"][op], "after": after["ops"][op]}
                   for op in sorted(set(before["ops"]) | set(after["ops"]))
                   if before["ops"][op] != after["ops"][op]}
    counts = {key: {"before": before[key], "after": after[key]}
              for key in ("nodes", "initializers", "initializer_bytes")}
    return {**counts, "ops_changed": changed_ops}
