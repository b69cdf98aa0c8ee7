"""Probes of float16 / bfloat16 graphs run in float32.

The fusion passes check what they matched by running the cut-out subgraph with onnxruntime's CPU kernels
(attention_block_probe, attention_mask_probe, rotary_probe). Those kernels have no bfloat16 Mul, Add or Where, so
a bfloat16 graph (export.dtype for TensorRT) could not be probed at all, and a match the probe cannot run would be
unchecked. The probe graph (a copy) is turned into the same math in float32 instead: what is checked is which
operations the graph performs on which values (layout, heads, scale, mask, rotation), not its rounding.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

REDUCED = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def element_type(dtype) -> int:
    """A gs tensor's dtype (numpy, ml_dtypes or an onnx enum; None = unknown, taken as float32) as an onnx enum."""
    if dtype is None:
        return onnx.TensorProto.FLOAT
    return dtype if isinstance(dtype, int) else onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _has_reduced(probe: gs.Graph) -> bool:
    """Whether any value, Cast or constant attribute of the graph is float16/bfloat16."""
    return (any(element_type(tensor.dtype) in REDUCED for tensor in probe.tensors().values())
            or any(node.op == "Cast" and node.attrs.get("to") in REDUCED for node in probe.nodes)
            or any(isinstance(value, gs.Constant) and element_type(value.dtype) in REDUCED
                   for node in probe.nodes for value in node.attrs.values()))


def as_float32(probe: gs.Graph) -> None:
    """Rewrite a probe graph (a gs copy: its tensors are its own) so that every float16/bfloat16 value is float32.

    Cleans the graph up first, so that only the weights the probe reads are converted; a float32 graph is left as it
    is (run_cut cleans it: graphsurgeon's cleanup looks each input up in a list of every tensor, so each one costs
    inputs x tensors, and a deep graph's probes spent seconds in it)."""
    if not _has_reduced(probe):
        return
    probe.cleanup(remove_unused_graph_inputs=True)
    for tensor in probe.tensors().values():
        if element_type(tensor.dtype) not in REDUCED:
            continue
        if isinstance(tensor, gs.Constant):  # a new Constant: onnx >= 1.20 takes no export_dtype to change
            widened = gs.Constant(tensor.name, np.asarray(tensor.values, dtype=np.float32))
            for consumer in list(tensor.outputs):
                for index, read in enumerate(consumer.inputs):
                    if read is tensor:
                        consumer.inputs[index] = widened
        else:
            tensor.dtype = np.float32
    for node in probe.nodes:
        attrs = dict(node.attrs)
        if node.op == "Cast" and attrs.get("to") in REDUCED:
            attrs["to"] = onnx.TensorProto.FLOAT
        for key, value in attrs.items():  # Constant's and ConstantOfShape's `value`
            if isinstance(value, gs.Constant) and element_type(value.dtype) in REDUCED:
                attrs[key] = gs.Constant(value.name, np.asarray(value.values, dtype=np.float32))
        node.attrs = attrs
