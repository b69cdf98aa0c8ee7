"""graphsurgeon's export_onnx, holding each weight once more rather than twice.

gs.export_onnx copies every initializer twice: into a GraphProto (onnx.helper.make_graph), then that GraphProto into
the ModelProto (make_model); protobuf has no move. With the model the pass read still alive (its weights are what the
graph's LazyValues point at), a pass's export held three copies of the phase's weights at its peak: a 1.25 GB model's
build rose 2.1-2.4 GB above its steady state in fuse_rms_norm, fuse_silu and pack_projections. Here the large
constants go through graphsurgeon as empty stubs of the same name, type and shape, and their data is copied once,
into the finished model. The result is the model gs.export_onnx would return, field for field (tested).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, dtype_to_onnx
from onnx_graphsurgeon.ir.tensor import LazyValues

STUB_ABOVE_BYTES = 1 << 16  # smaller constants are exported as graphsurgeon does it: their copies are cheap


def export_onnx(graph: gs.Graph, **kwargs) -> onnx.ModelProto:
    """gs.export_onnx(graph, **kwargs), with large constants' data copied once. `graph` is left as it was."""
    stubbed: dict[str, tuple[gs.Constant, object]] = {}
    # A constant that a subgraph (If, Loop) reads too is exported there as well, outside model.graph.initializer,
    # where no stub would be filled in: a graph with subgraphs goes through gs as it is (aotlm's graphs have none).
    has_subgraphs = any(isinstance(value, gs.Graph) for node in graph.nodes for value in node.attrs.values())
    for tensor in () if has_subgraphs else graph.tensors().values():
        stub = _stub(tensor)
        if stub is not None:
            stubbed[tensor.name] = (tensor, tensor._values)
            tensor._values = LazyValues(stub)
    try:
        model = gs.export_onnx(graph, **kwargs)
    finally:
        for tensor, values in stubbed.values():
            tensor._values = values
    for initializer in model.graph.initializer:
        if initializer.name in stubbed:
            # what gs would have put there: the tensor it read (renamed), or one made from the array
            initializer.CopyFrom(OnnxExporter.export_tensor_proto(stubbed[initializer.name][0]))
    return model


def _stub(tensor) -> onnx.TensorProto | None:
    """An empty TensorProto of the constant's name, type and shape, or None where it is exported as gs does. (The
    type shows where the constant is also a graph output: its value_info is made from it.)"""
    if not isinstance(tensor, gs.Constant):
        return None
    values = tensor._values
    if isinstance(values, LazyValues) and isinstance(values.tensor, onnx.TensorProto):
        data_type = values.tensor.data_type
    elif isinstance(values, np.ndarray) and values.dtype != object:
        data_type = dtype_to_onnx(tensor.export_dtype)
    else:
        return None
    if values.nbytes <= STUB_ABOVE_BYTES:
        return None
    return onnx.TensorProto(name=tensor.name, data_type=data_type, dims=values.shape)
