"""Lower `aotlm.FlashAttention` to onnxruntime's `com.microsoft.GroupQueryAttention`.

The two share their contract (passes/flash_attention_op.py): same inputs in the same order, per-sequence
`seqlens_k` and `total_sequence_length`, rotary applied inside from cos/sin tables, and past/present cache
buffers that onnxruntime updates in place when the runtime binds one buffer to both (its
past_present_share_buffer mode). So the rewrite is the op's name, domain and attributes.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx

from passes import flash_attention_op as op
from passes.errors import PassError

MICROSOFT_DOMAIN = "com.microsoft"
KEPT_ATTRIBUTES = ("num_heads", "kv_num_heads", "scale", "do_rotary", "rotary_interleaved")


@dataclass(frozen=True)
class Options:
    max_rewrites: int | None = None


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    count = 0
    table_widths = {t.name: t.dims[-1] for t in lowered.graph.initializer if len(t.dims) == 2}
    for node in lowered.graph.node:
        if node.domain != op.DOMAIN or node.op_type != op.OP_TYPE:
            continue
        if options.max_rewrites is not None and count >= options.max_rewrites:
            break
        head_dim = 2 * table_widths.get(node.input[op.INPUTS.index("cos_cache")], 0)
        if head_dim % 16:
            raise PassError(f"{node.name}: onnxruntime's GroupQueryAttention needs head_dim % 16 == 0, "
                            f"this model has head_dim {head_dim}; leave lower_onnxruntime out of the recipe")
        node.op_type, node.domain = "GroupQueryAttention", MICROSOFT_DOMAIN
        kept = [a for a in node.attribute if a.name in KEPT_ATTRIBUTES]
        del node.attribute[:]
        node.attribute.extend(kept)
        count += 1
    remaining = sum(1 for n in lowered.graph.node if n.domain == op.DOMAIN)
    imports = [o for o in lowered.opset_import if o.domain != op.DOMAIN or remaining]
    if count and not any(o.domain == MICROSOFT_DOMAIN for o in imports):
        imports.append(onnx.helper.make_opsetid(MICROSOFT_DOMAIN, 1))
    del lowered.opset_import[:]
    lowered.opset_import.extend(imports)
    return lowered, {"lowered": count, "target": f"{MICROSOFT_DOMAIN}.GroupQueryAttention", "left_unlowered": remaining}
