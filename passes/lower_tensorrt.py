"""Lower each `aotlm.FlashAttention` node for TensorRT: rotary in ONNX, attention in the project's plugins.

`attention: plugin` (default). Per node; positions [B,S] int64 follow the op's rule (first prompt, S == total:
0..S-1; else seqlens_k + 1 - S + i) and are built by lower_onnx_attention.Shared, the same nodes as there:

    query -> RotaryEmbedding-23(cos, sin, positions, num_heads=H)  -> q_rot ---.
    key   -> RotaryEmbedding-23(cos, sin, positions, num_heads=KV) -> k_rot ---+
    value ---------------------------------------------------------------------+--> flash_attention --> output
    past_key, past_value, seqlens_k -------------------------------------------+     |--> present_key (past_key's buffer)
    total_sequence_length -> Reshape [1] ---------------------------------------'     '--> present_value (past_value's)

In the graph named "decode" (compiler/export.py names each graph by its phase) with decode_kv_splits P > 1:

    (the same 7 inputs) -> flash_decode -> partial_out, partial_lse -> flash_combine -> output
                                       '-> present_key, present_value (in place, as above)

Plugin contract (what the tensorrt.plugin registration implements). Every node: op_type = the plugin name,
domain = attribute plugin_namespace = PLUGIN_NAMESPACE ("aotlm"), attribute aot = 1, plugin version "1"
(the parser's default). T is the model's float type (float32/float16/bfloat16), B batch, S new tokens, H query
heads, KV kv heads, D head_dim, M the cache's static max context, P kv_splits. seqlens_k and
total_sequence_length are device tensors read by the kernel, not shape inputs: no output shape depends on them.

  flash_attention(q_rot, k_rot, value, past_key, past_value, seqlens_k, total_sequence_length)
                  -> (output, present_key, present_value)
    inputs   0 q_rot T [B,S,H*D]  1 k_rot T [B,S,KV*D]  2 value T [B,S,KV*D]  (q, k already rotated)
             3 past_key T [B,KV,M,D]  4 past_value T [B,KV,M,D]  5 seqlens_k int32 [B]
             6 total_sequence_length int32 [1]
    outputs  0 output T [B,S,H*D]; 1 present_key ALIASES input 3; 2 present_value ALIASES input 4 (in place)
    attrs    num_heads H (INT), kv_num_heads KV (INT), head_dim D (INT), scale (FLOAT)
    meaning  passes/flash_attention_op.py without its rotary (`plugin_reference`): per sequence b, new row i sits
             at position p_i (the rule above; first-prompt rows i > seqlens_k[b] are padding: not written, output
             unspecified); rows k_rot/value are written to the caches at p_i; query (i, head h) attends cache
             rows j <= p_i of kv head h // (H/KV) with softmax(scale * q.k).
  flash_decode(the same 7 inputs) -> (partial_out, partial_lse, present_key, present_value)
    outputs  0 partial_out float32 [B,S,H,P,D]; 1 partial_lse float32 [B,S,H,P];
             2 present_key ALIASES input 3; 3 present_value ALIASES input 4 (the same writes as flash_attention)
    attrs    num_heads, kv_num_heads, head_dim, scale, kv_splits P (INT, a power of two), split_size = ceil(M / P) (INT)
    meaning  split s covers cache rows J_s = [s*split_size, (s+1)*split_size) intersected with [0, p_i] (the new
             rows included): partial_lse = ln sum_{j in J_s} exp(scale q.k_j), partial_out = the softmax over J_s
             applied to v_j (normalized within the split); an empty split gives lse -inf and out 0.
  flash_combine(partial_out, partial_lse) -> output
    outputs  0 output T [B,S,H*D] = sum_s exp(lse_s - L) out_s with L = logsumexp_s lse_s (0 if every split is empty)
    attrs    num_heads (INT), head_dim (INT), kv_splits (INT), out_dtype (INT: the ONNX TensorProto type of T; both
             inputs are float32, so the plugin cannot infer T otherwise)
The kernels (runtime/kernels/flash_attention.py, registered by runtime/kernels/tensorrt_plugin.py) need head_dim
16, 32, 64 or 128 (PLUGIN_HEAD_DIMS: tiles within 48 KiB of shared memory) and kv_splits a power of two (the
combine loads all splits as one tile): refused here otherwise.
Engine build: import the plugin definitions before parsing, TensorRT >= 10.15 (RotaryEmbedding in the parser; AOT
QDP plugins since 10.9) and PreviewFeature.ALIASED_PLUGIN_IO_10_03 for the aliased outputs.

`attention: onnx_attention` delegates to lower_onnx_attention (Attention-23, explicit mask; TensorRT >= 10.14): the
cache rows are written by ScatterElements into new present outputs, not in place, so the TensorRT backend's recipe
check refuses it (its runtime binds each present output to its past buffer); the form stays for plain ONNX graphs.

`attention: trt_native` uses TensorRT 11's ONNX custom ops, per node:

    q_rot -> [B,H,S,D] -> Mul(scale) ---------------------------------------------------------------.
    k_rot -> [B,KV,S,D] -> TRT_KVCacheUpdate(past_key, ., write_indices) -> present_key -> Slice(:T) -> TRT_Attention
    value -> [B,KV,S,D] -> TRT_KVCacheUpdate(past_value, ...)    -> present_value -> Slice(:T) ----'  (kv_lengths)
    TRT_Attention [B,H,S,D] -> [B,S,H*D] output;   write_indices = positions[:, 0], kv_lengths = positions[:, -1] + 1

Confirmed in onnx/onnx-tensorrt docs/TRT_custom_ops.md (the newer of the two stored versions, which matches
TensorRT's IAttention): TRT_Attention inputs Q, K, V, attn_mask?, query_lengths? (int32), kv_lengths? (int32 [B]
per-sequence lengths in the padded form); attributes query_form / kv_form ("padded_bhnd"), causal_kind ("none",
"upper_left", "lower_right"; no attn_mask with a causal kind), TRT_decomposable; no scale, no reshape, so Q is
pre-scaled here. TRT_KVCacheUpdate inputs past_cache [B,H,N,D], update, write_indices? (int32 [B]),
update_lengths?; attributes update_form, mode ("linear"), axis (-2). Parser support: TensorRT 11.0 release notes
("custom operators TRT_Attention, TRT_MoE, and TRT_KVCacheUpdate"). Domain: that document names none;
NVIDIA's TensorRT-Edge-LLM exporter emits them as "trt::TRT_Attention" (OpSchema domain "trt"), and the parser
sources read (10.x) dispatch on op_type alone; so the nodes use domain "trt". Not confirmed: where lower_right is
anchored when kv_lengths < the padded key length, so kv_lengths is chosen to be right under either reading (the
first prompt passes T; decode is S = 1); a chunk of S > 1 after a cache needs batch 1, as for onnxruntime. Unlike
the op, TRT_KVCacheUpdate also writes a first prompt's padding rows (beyond the valid length, so never attended).
The older stored version of that document (onnx-tensorrt commit 2f3fa349) had TRT_Attention take is_causal/scale
and past_key/past_value at inputs 4-5 (query_lengths 6, kv_lengths 7): check the parser's order on the first build.
TRT_decomposable = 1 lets TensorRT fall back to unfused layers where it has no fused kernel (else the build fails).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes import flash_attention_op as op
from passes import lower_onnx_attention
from passes.errors import PassError
from passes.graph_export import export_onnx
from passes.lower_onnx_attention import OPSET, Shared

ATTENTION_TARGETS = ("plugin", "onnx_attention", "trt_native")
TRT_DOMAIN = "trt"  # TensorRT 11's custom ONNX ops (see the docstring for what was confirmed)
# What runtime/kernels/tensorrt_plugin.py registers (runtime/ cannot import passes/, so it spells them again).
# The plugin kernels' tiles (tl.dot: at least 16 wide) within the 48 KiB of shared memory an AOT launch gets
# (runtime/kernels/aot.py): a power of two from 16 to 128.
PLUGIN_HEAD_DIMS = (16, 32, 64, 128)
PLUGIN_HEAD_DIM_ADVICE = ("the flash_attention plugin kernels take head_dim 16, 32, 64 or 128 (a power of two whose "
                          "tiles fit 48 KiB of shared memory), this model has {head_dim}; use lower_tensorrt's "
                          "attention: trt_native (TensorRT >= 11)")
PLUGIN_NAMESPACE = "aotlm"
DEFAULT_DECODE_KV_SPLITS = 8
PLUGIN_OPS = ("flash_attention", "flash_decode", "flash_combine")


def _const(name: str, values) -> gs.Constant:
    return gs.Constant(name, np.asarray(values, dtype=np.int64))


def onnx_type(dtype) -> int:
    """ONNX element type of a graphsurgeon dtype (numpy dtypes; bfloat16 arrives as the ONNX type number)."""
    return dtype if isinstance(dtype, int) else int(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype or np.float32)))


@dataclass(frozen=True)
class Options:
    attention: Literal["plugin", "onnx_attention", "trt_native"] = "plugin"
    # flash-decoding splits of the cache in the plugin's decode graph (1 = one flash_attention); None: 8
    decode_kv_splits: int | None = None
    max_rewrites: int | None = None

    def __post_init__(self):
        if self.attention not in ATTENTION_TARGETS:
            raise ValueError(f"attention: {self.attention!r} is not one of {', '.join(ATTENTION_TARGETS)}")
        splits = self.decode_kv_splits
        if splits is not None and self.attention != "plugin":  # it was taken and did nothing
            raise ValueError(f"decode_kv_splits applies to attention: plugin (its flash-decoding kernels); attention "
                             f"{self.attention} reads the cache its own way: drop decode_kv_splits")
        if splits is not None and (splits < 1 or splits & (splits - 1)):
            raise ValueError(f"decode_kv_splits: {splits} must be a power of two >= 1 "
                             "(flash_combine loads all splits as one tile)")

    @property
    def kv_splits(self) -> int:
        return DEFAULT_DECODE_KV_SPLITS if self.decode_kv_splits is None else self.decode_kv_splits


class Lowering:
    """Nodes shared by a graph's layers (positions, total as [1]) and the per-node rewrites."""

    def __init__(self, graph: gs.Graph, options: Options, decode: bool):
        self.graph, self.options, self.decode = graph, options, decode
        self.shared = Shared(graph, prefix="tensorrt_positions")
        self.totals: dict[str, gs.Variable] = {}

    def layer(self, op_type, inputs, name, dtype=None, shape=None, **attrs) -> gs.Variable:
        out = self.shared.layer(op_type, inputs, name, **attrs)
        out.dtype, out.shape = dtype, shape
        return out

    def total_as_vector(self, total: gs.Tensor) -> gs.Variable:
        """The op's scalar total_sequence_length as the [1] int32 tensor the plugins take."""
        if total.name not in self.totals:
            name = f"tensorrt_total_{len(self.totals)}"
            self.totals[total.name] = self.layer("Reshape", [total, _const(f"{name}_shape", [1])], name, np.int32, [1])
        return self.totals[total.name]

    def rotate(self, node: gs.Node, name: str):
        query, key, _, _, _, seqlens, total, cos, sin = node.inputs
        positions, _, total64 = self.shared.positions_and_mask(query, seqlens, total)
        q = self.layer("RotaryEmbedding", [query, cos, sin, positions], f"{name}_q_rot", query.dtype, query.shape,
                       num_heads=node.attrs["num_heads"])
        k = self.layer("RotaryEmbedding", [key, cos, sin, positions], f"{name}_k_rot", key.dtype, key.shape,
                       num_heads=node.attrs["kv_num_heads"])
        return q, k, positions, total64

    def plugin_node(self, plugin: str, name: str, inputs: list, outputs: list, **attrs) -> None:
        self.graph.nodes.append(gs.Node(plugin, name=name, domain=PLUGIN_NAMESPACE, inputs=inputs, outputs=outputs,
                                        attrs={**attrs, "plugin_namespace": PLUGIN_NAMESPACE, "aot": 1}))

    def lower_plugin(self, node: gs.Node, index: int) -> dict:
        query, _, value, past_key, past_value, seqlens, total, cos, _ = node.inputs
        output, present_key, present_value = node.outputs
        heads, kv_heads, head_dim = node.attrs["num_heads"], node.attrs["kv_num_heads"], 2 * cos.shape[1]
        scale, name = op.node_scale(node, head_dim), f"{node.name or 'attention'}_{index}"
        op.check_rotary_layout(node, "lower_tensorrt")
        batch, length = (list(query.shape) if query.shape else [None, None])[:2]
        output.dtype, output.shape = query.dtype, [batch, length, heads * head_dim]
        q, k, _, _ = self.rotate(node, name)
        inputs = [q, k, value, past_key, past_value, seqlens, self.total_as_vector(total)]
        node.outputs.clear()
        splits = self.options.kv_splits if self.decode else 1
        if splits == 1:
            self.plugin_node("flash_attention", f"{name}_flash_attention", inputs, [output, present_key, present_value],
                             num_heads=heads, kv_num_heads=kv_heads, head_dim=head_dim, scale=scale)
            return {"node": node.name, "form": "flash_attention", "splits": 1}
        partial_out = gs.Variable(f"{name}_partial_out", np.float32, [batch, length, heads, splits, head_dim])
        partial_lse = gs.Variable(f"{name}_partial_lse", np.float32, [batch, length, heads, splits])
        self.plugin_node("flash_decode", f"{name}_flash_decode", inputs,
                         [partial_out, partial_lse, present_key, present_value], num_heads=heads,
                         kv_num_heads=kv_heads, head_dim=head_dim, scale=scale, kv_splits=splits,
                         split_size=math.ceil(past_key.shape[2] / splits))
        self.plugin_node("flash_combine", f"{name}_flash_combine", [partial_out, partial_lse], [output],
                         num_heads=heads, head_dim=head_dim, kv_splits=splits,
                         out_dtype=onnx_type(query.dtype))
        return {"node": node.name, "form": "flash_decode+flash_combine", "splits": splits}

    def heads(self, tensor: gs.Tensor, heads: int, head_dim: int, name: str) -> gs.Variable:
        """[B, S, heads*D] -> [B, heads, S, D]"""
        split = self.layer("Reshape", [tensor, _const(f"{name}_shape", [0, 0, heads, head_dim])], f"{name}_bshd")
        return self.layer("Transpose", [split], f"{name}_bhsd", tensor.dtype, None, perm=[0, 2, 1, 3])

    def lower_native(self, node: gs.Node, index: int) -> dict:
        query, _, value, past_key, past_value, _, _, cos, _ = node.inputs
        output, present_key, present_value = node.outputs
        heads, kv_heads, head_dim = node.attrs["num_heads"], node.attrs["kv_num_heads"], 2 * cos.shape[1]
        scale, name = op.node_scale(node, head_dim), f"{node.name or 'attention'}_{index}"
        op.check_rotary_layout(node, "lower_tensorrt")
        dtype = query.dtype if isinstance(query.dtype, int) else np.dtype(query.dtype or np.float32)  # int: bfloat16
        batch, length = (list(query.shape) if query.shape else [None, None])[:2]
        L = self.layer  # noqa: N806 - a short local name keeps the recipe of nodes readable
        q, k, positions, total64 = self.rotate(node, name)
        node.outputs.clear()
        start = L("Gather", [positions, _const(f"{name}_first", 0)], f"{name}_start", axis=1)
        write_at = L("Cast", [start], f"{name}_write_indices", np.int32, None, to=onnx.TensorProto.INT32)  # [B]
        last = L("Gather", [positions, _const(f"{name}_last", -1)], f"{name}_last_position", axis=1)
        kv_lengths = L("Cast", [L("Add", [last, _const(f"{name}_one", 1)], f"{name}_kv_len64")], f"{name}_kv_lengths",
                       np.int32, None, to=onnx.TensorProto.INT32)  # [B]: the first prompt's T, else seqlens_k + 1
        total = L("Unsqueeze", [total64, _const(f"{name}_ax0", [0])], f"{name}_total1")
        attended = []
        for tag, past, present, rows in (("k", past_key, present_key, k), ("v", past_value, present_value, value)):
            update = self.heads(rows, kv_heads, head_dim, f"{name}_{tag}")
            self.graph.nodes.append(gs.Node("TRT_KVCacheUpdate", name=f"{name}_{tag}_cache_update", domain=TRT_DOMAIN,
                                            inputs=[past, update, write_at], outputs=[present],
                                            attrs={"update_form": "padded_bhnd", "mode": "linear", "axis": -2}))
            window = [_const(f"{name}_{tag}_s0", [0]), total, _const(f"{name}_{tag}_ax", [2])]
            attended.append(L("Slice", [present, *window], f"{name}_{tag}_rows", dtype,
                              [batch, kv_heads, None, head_dim]))  # [B, KV, T, D]
        scale_constant = L("Cast", [gs.Constant(f"{name}_scale32", np.array(scale, np.float32))], f"{name}_scale", dtype,
                           [], to=onnx_type(dtype))  # numpy has no bfloat16: a float32 constant, cast
        scaled_q = L("Mul", [self.heads(q, heads, head_dim, f"{name}_q"), scale_constant], f"{name}_q_scaled", dtype,
                     [batch, heads, length, head_dim])  # TRT_Attention has no scale
        out = gs.Variable(f"{name}_attended", dtype, [batch, heads, length, head_dim])
        no_mask = no_query_lengths = gs.Variable.empty()
        self.graph.nodes.append(gs.Node("TRT_Attention", name=f"{name}_attention", domain=TRT_DOMAIN,
                                        inputs=[scaled_q, *attended, no_mask, no_query_lengths, kv_lengths],
                                        outputs=[out], attrs={"query_form": "padded_bhnd", "kv_form": "padded_bhnd",
                                                              "causal_kind": "lower_right", "TRT_decomposable": 1}))
        back = L("Transpose", [out], f"{name}_bshd_out", dtype, None, perm=[0, 2, 1, 3])
        self.graph.nodes.append(gs.Node("Reshape", name=f"{name}_merge_heads", outputs=[output],
                                        inputs=[back, _const(f"{name}_merge", [0, 0, heads * head_dim])]))
        return {"node": node.name, "form": "trt_native", "splits": 1}


def check(node: gs.Node, options: Options, decode: bool) -> None:
    """Refuse, before any edit, what the TensorRT paths cannot bind."""
    past_key = node.inputs[op.INPUTS.index("past_key")]
    if not past_key.name:
        raise PassError(f"{node.name}: FlashAttention has no KV cache (past_key is empty); the TensorRT lowering "
                        "always binds a cache buffer: export the graph with past_key_values inputs")
    head_dim = 2 * node.inputs[op.INPUTS.index("cos_cache")].shape[1]
    if options.attention == "plugin" and head_dim not in PLUGIN_HEAD_DIMS:
        raise PassError(f"{node.name}: {PLUGIN_HEAD_DIM_ADVICE.format(head_dim=head_dim)}")
    needs_static = options.attention == "trt_native" or (decode and options.kv_splits > 1)
    max_context = past_key.shape[2] if past_key.shape and len(past_key.shape) == 4 else None
    if needs_static and not isinstance(max_context, int):
        raise PassError(f"{node.name}: the cache's max context (dim 2 of {past_key.name}, {max_context!r}) must be "
                        "static for the TensorRT lowering (kv split size / TRT_KVCacheUpdate); export with a fixed "
                        "max_context")


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    nodes_in = [n for n in model.graph.node if n.domain == op.DOMAIN and n.op_type == op.OP_TYPE]
    chosen = nodes_in if options.max_rewrites is None else nodes_in[: options.max_rewrites]
    if options.attention == "onnx_attention":
        delegated = lower_onnx_attention.Options(max_rewrites=options.max_rewrites)
        lowered, report = lower_onnx_attention.run(model, delegated)
        return lowered, {**report, "attention": "onnx_attention",
                         "layers": [{"node": n.name, "form": "onnx_attention", "splits": 1} for n in chosen],
                         "plugins": {"namespace": None, "names": []},
                         "note": "TensorRT >= 10.14 parses Attention-23; the cache rows are written by ScatterElements "
                                 "into new present outputs (not in place), which the TensorRT backend refuses"}
    decode = model.graph.name == "decode"
    graph = gs.import_onnx(model)
    nodes = [n for n in graph.nodes if n.domain == op.DOMAIN and n.op == op.OP_TYPE][: len(chosen)]
    for node in nodes:
        check(node, options, decode)
    lowering = Lowering(graph, options, decode)
    rewrite = lowering.lower_native if options.attention == "trt_native" else lowering.lower_plugin
    layers = [rewrite(node, index) for index, node in enumerate(nodes)]
    graph.cleanup().toposort()
    remaining = sum(1 for n in graph.nodes if n.domain == op.DOMAIN and n.op == op.OP_TYPE)
    used = sorted({n.op for n in graph.nodes if n.domain == PLUGIN_NAMESPACE and n.op != op.OP_TYPE})
    domains = {o.domain: o.version for o in model.opset_import if o.domain not in ("", "ai.onnx", op.DOMAIN)}
    if remaining:
        domains[op.DOMAIN] = op.VERSION
    if used:
        domains.setdefault(PLUGIN_NAMESPACE, 1)
    if options.attention == "trt_native" and layers:
        domains[TRT_DOMAIN] = 1
    graph.opset = max(graph.opset, OPSET)
    graph.import_domains = [onnx.helper.make_opsetid("", graph.opset)] + [
        onnx.helper.make_opsetid(d, v) for d, v in domains.items()]
    lowered = export_onnx(graph)
    lowered.ir_version = max(lowered.ir_version, 10)  # IR 10 with opset 23, as torch.onnx writes it (onnx 1.23 lists 11)
    native = options.attention == "trt_native"
    return lowered, {
        "target": "tensorrt: TRT_KVCacheUpdate + TRT_Attention (TensorRT >= 11)" if native else
                  f"tensorrt: RotaryEmbedding-23 + {PLUGIN_NAMESPACE}:: plugins (TensorRT >= 10.15)",
        "attention": options.attention, "phase_graph": model.graph.name, "lowered": len(layers), "layers": layers,
        "left_unlowered": remaining,
        "plugins": {"namespace": None if native else PLUGIN_NAMESPACE, "names": used, "aot": not native,
                    "preview_feature": None if native else "ALIASED_PLUGIN_IO_10_03"}}


# ---- numpy meaning of the plugin nodes (float64), for tests and for checking the Triton kernels ------------------

def _identity_tables(positions: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    return np.ones((positions, head_dim // 2)), np.zeros((positions, head_dim // 2))


def plugin_reference(q_rot, k_rot, value, past_key, past_value, seqlens_k, total_sequence_length, num_heads,
                     kv_num_heads, scale=None):
    """flash_attention: the op on already-rotated q/k (identity rotary); (output, present_key, present_value)."""
    total = int(np.asarray(total_sequence_length).reshape(-1)[0])
    tables = _identity_tables(past_key.shape[2] + q_rot.shape[1], q_rot.shape[-1] // num_heads)
    return op.reference(q_rot, k_rot, value, past_key, past_value, seqlens_k, total, *tables, num_heads,
                        kv_num_heads, scale)


def flash_decode_reference(q_rot, k_rot, value, past_key, past_value, seqlens_k, total_sequence_length, num_heads,
                           kv_num_heads, scale, kv_splits, split_size):
    """flash_decode: (partial_out [B,S,H,P,D], partial_lse [B,S,H,P], present_key, present_value)."""
    _, present_key, present_value = plugin_reference(q_rot, k_rot, value, past_key, past_value, seqlens_k,
                                                     total_sequence_length, num_heads, kv_num_heads, scale)
    batch, length, _ = q_rot.shape
    head_dim, group = q_rot.shape[-1] // num_heads, num_heads // kv_num_heads
    total = int(np.asarray(total_sequence_length).reshape(-1)[0])
    partial_out = np.zeros((batch, length, num_heads, kv_splits, head_dim))
    partial_lse = np.full((batch, length, num_heads, kv_splits), -np.inf)
    for b in range(batch):
        valid_rows = int(seqlens_k[b]) + 1
        first_prompt = length == total
        for i in range(min(length, valid_rows) if first_prompt else length):
            position = i if first_prompt else valid_rows - length + i
            q = q_rot[b, i].reshape(num_heads, head_dim).astype(np.float64)
            for h in range(num_heads):
                keys, values = present_key[b, h // group, : position + 1], present_value[b, h // group, : position + 1]
                scores = scale * keys @ q[h]
                for s in range(kv_splits):
                    part = slice(s * split_size, min((s + 1) * split_size, position + 1))
                    if part.start >= part.stop:
                        continue
                    weights = np.exp(scores[part] - scores[part].max())
                    partial_out[b, i, h, s] = weights @ values[part] / weights.sum()
                    partial_lse[b, i, h, s] = scores[part].max() + np.log(weights.sum())
    return partial_out, partial_lse, present_key, present_value


def flash_combine_reference(partial_out, partial_lse):
    """flash_combine: output [B, S, H*D] from the per-split outputs and log-sum-exps."""
    batch, length, heads, _, head_dim = partial_out.shape
    peak = partial_lse.max(axis=-1, keepdims=True)
    weights = np.where(np.isfinite(partial_lse), np.exp(partial_lse - np.where(np.isfinite(peak), peak, 0)), 0.0)
    norm = weights.sum(axis=-1, keepdims=True)
    combined = (weights[..., None] * partial_out).sum(axis=-2) / np.where(norm > 0, norm, 1.0)
    return combined.reshape(batch, length, heads * head_dim)
