"""Fuse SiLU, x * Sigmoid(x), into onnxruntime's `com.microsoft.QuickGelu` (x * Sigmoid(alpha * x), alpha = 1).

    x ---> Sigmoid ---> Mul ---> (the gated MLP's Mul with the up projection)
    '------------------^

onnxruntime has no CPU kernel for the whole gate, SiLU(gate) * up, so the product with the up projection stays
a Mul. onnxruntime's own load-time optimizer makes the same QuickGelu; doing it here puts it in the artifact's
graph, where the report counts it and the runtime needs no optimizer to get it.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx
import onnx_graphsurgeon as gs

from passes.cleanup import export_like
from passes.graph_patterns import unique_name

MICROSOFT_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class Options:
    max_rewrites: int | None = None


@dataclass
class Match:
    sigmoid: gs.Node
    mul: gs.Node
    x: gs.Tensor


def match(sigmoid: gs.Node) -> Match | str:
    """A Match, or the reason this Sigmoid is not a SiLU."""
    x = sigmoid.inputs[0]
    consumers = sigmoid.outputs[0].outputs
    if len(consumers) != 1 or consumers[0].op != "Mul":
        return "the Sigmoid's output does not feed exactly one Mul"
    mul = consumers[0]
    if x not in mul.inputs:
        return "the Mul does not multiply the Sigmoid's own input"
    return Match(sigmoid, mul, x)


def rewrite(graph: gs.Graph, found: Match, taken_names: set[str]) -> None:
    output = found.mul.outputs[0]
    found.mul.outputs.clear()
    name = unique_name(f"{found.sigmoid.name or output.name}_silu", taken_names)  # unnamed Sigmoids: not all "_silu"
    graph.nodes.append(gs.Node("QuickGelu", name=name, domain=MICROSOFT_DOMAIN,
                               attrs={"alpha": 1.0}, inputs=[found.x], outputs=[output]))


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    graph = gs.import_onnx(model)
    graph.import_domains = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]  # keep input intact
    nodes_before = len(graph.nodes)
    fused, skipped = 0, []
    taken_names = {node.name for node in graph.nodes}
    for sigmoid in [n for n in graph.nodes if n.op == "Sigmoid"]:
        found = match(sigmoid)
        if isinstance(found, str):
            skipped.append({"node": sigmoid.name, "reason": found})
        elif options.max_rewrites is not None and fused >= options.max_rewrites:
            skipped.append({"node": sigmoid.name, "reason": f"max_rewrites={options.max_rewrites}"})
        else:
            rewrite(graph, found, taken_names)
            fused += 1
    if fused and not any(o.domain == MICROSOFT_DOMAIN for o in graph.import_domains):
        graph.import_domains.append(onnx.helper.make_opsetid(MICROSOFT_DOMAIN, 1))
    graph.cleanup().toposort()
    result = export_like(graph, model)  # keeps an initializer that is also a graph input (an overridable default)
    return result, {"fused": fused, "skipped": skipped, "nodes": {"before": nodes_before, "after": len(result.graph.node)}}
