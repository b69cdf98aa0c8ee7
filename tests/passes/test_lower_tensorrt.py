"""lower_tensorrt: node counts, the plugin contract (attributes, shapes, aliases), refusals, and the lowered graph's
meaning checked without TensorRT: onnxruntime computes everything up to the plugin (rotary, positions, the [1]
total), the numpy plugin references finish it, and the result must equal flash_attention_op.reference.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from compiler.export import io_names
from passes import flash_attention_op as op
from passes import fuse_attention, lower_tensorrt
from passes.errors import PassError
from passes.registry import PASSES
from tests.passes.test_fuse_attention import (CONFIG, MAX_CONTEXT, decoder_graphs,  # noqa: F401 (a fixture)
                                              generate_logits, op_counts)

LAYERS, HEADS, KV_HEADS, HEAD_DIM = CONFIG.num_layers, CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
PLUGINS = ("flash_attention", "flash_decode", "flash_combine")
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def fused_graphs(decoder_graphs):
    fused = {}
    for phase, model in decoder_graphs.items():
        fused[phase] = fuse_attention.run(model, fuse_attention.Options())[0]
        fused[phase].graph.name = phase  # what compiler/export.py sets; the pass reads it
    return fused


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def evaluate(model: onnx.ModelProto, names: list[str], feeds: dict) -> dict:
    """Run onnxruntime on the part of `model` that computes `names` (custom ops must not be upstream)."""
    graph = gs.import_onnx(onnx.shape_inference.infer_shapes(model))
    tensors = graph.tensors()
    constants = {n: tensors[n].values for n in names if isinstance(tensors[n], gs.Constant)}
    wanted = [n for n in names if n not in constants and n not in feeds]
    graph.outputs = [tensors[n] for n in wanted]
    graph.cleanup()
    session = ort.InferenceSession(gs.export_onnx(graph).SerializeToString(), providers=["CPUExecutionProvider"])
    used = {i.name for i in session.get_inputs()}
    results = dict(zip(wanted, session.run(wanted, {k: v for k, v in feeds.items() if k in used}))) if wanted else {}
    return {**feeds, **constants, **results}


def inputs_of(model: onnx.ModelProto, node: onnx.NodeProto, feeds: dict) -> list[np.ndarray]:
    values = evaluate(model, [n for n in node.input if n], feeds)
    return [values[n] if n else None for n in node.input]


def single_attention(phase: str, max_context: int | str = 10, cache: bool = True, head_dim: int = 16,
                     dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """One FlashAttention node on graph inputs (H=4, KV=2) in a graph named after its phase."""
    heads, kv_heads = 4, 2
    tensor = helper.make_tensor_value_info
    inputs = [tensor("query", dtype, ["batch", "sequence", heads * head_dim]),
              tensor("key", dtype, ["batch", "sequence", kv_heads * head_dim]),
              tensor("value", dtype, ["batch", "sequence", kv_heads * head_dim])]
    cache_shape = ["batch", kv_heads, max_context, head_dim]
    outputs = [tensor("output", dtype, ["batch", "sequence", heads * head_dim])]
    if cache:
        inputs += [tensor(n, dtype, cache_shape) for n in ("past_key", "past_value")]
        outputs += [tensor(n, dtype, cache_shape) for n in ("present_key", "present_value")]
    inputs += [tensor("seqlens_k", TensorProto.INT32, ["batch"]),
               tensor("total_sequence_length", TensorProto.INT32, [])]
    inv_freq = 1.0 / (10000 ** (np.arange(0, head_dim, 2) / head_dim))
    cos, sin = (t.astype(helper.tensor_dtype_to_np_dtype(dtype)) for t in op.rotary_tables(inv_freq, 32))
    caches = ["past_key", "past_value"] if cache else ["", ""]
    node = helper.make_node("FlashAttention", ["query", "key", "value", *caches,
                                               "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"],
                            [o.name for o in outputs], name="layers.0.attn", domain=op.DOMAIN, num_heads=heads,
                            kv_num_heads=kv_heads, scale=head_dim**-0.5, do_rotary=1, rotary_interleaved=0)
    graph = helper.make_graph([node], phase, inputs, outputs, initializer=[
        onnx.numpy_helper.from_array(cos, "cos_cache"), onnx.numpy_helper.from_array(sin, "sin_cache")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(op.DOMAIN, 1)],
                             ir_version=10)


def test_prefill_gets_one_flash_attention_plugin_per_layer(fused_graphs):
    lowered, report = lower_tensorrt.run(fused_graphs["prefill"], lower_tensorrt.Options())
    onnx.checker.check_model(lowered, full_check=True)
    counts = op_counts(lowered)
    assert counts["FlashAttention"] == 0 and counts["flash_attention"] == LAYERS
    assert counts["RotaryEmbedding"] == 2 * LAYERS
    assert counts["flash_decode"] == counts["flash_combine"] == 0
    assert report["layers"] == [{"node": f"layers.{i}.FlashAttention", "form": "flash_attention", "splits": 1}
                                for i in range(LAYERS)]
    assert report["left_unlowered"] == 0
    assert report["plugins"] == {"namespace": "aotlm", "names": ["flash_attention"], "aot": True,
                                 "preview_feature": "ALIASED_PLUGIN_IO_10_03"}
    assert report["target"] == "tensorrt: RotaryEmbedding-23 + aotlm:: plugins (TensorRT >= 10.15)"
    assert report["phase_graph"] == "prefill" and report["attention"] == "plugin"
    plugins = [n for n in lowered.graph.node if n.op_type == "flash_attention"]
    assert len({node.input[6] for node in plugins}) == 1  # one [1] total for every layer
    for index, node in enumerate(n for n in lowered.graph.node if n.op_type == "flash_attention"):
        assert node.domain == "aotlm"
        assert attrs(node) == {"num_heads": HEADS, "kv_num_heads": KV_HEADS, "head_dim": HEAD_DIM,
                               "scale": pytest.approx(HEAD_DIM**-0.5), "plugin_namespace": b"aotlm", "aot": 1}
        assert list(node.output[1:]) == [f"present.{index}.key", f"present.{index}.value"]  # aliased in place
        assert list(node.input[3:5]) == [f"past_key_values.{index}.key", f"past_key_values.{index}.value"]
    assert [o.name for o in lowered.graph.output] == [o.name for o in fused_graphs["prefill"].graph.output]
    assert ("aotlm", 1) in [(o.domain, o.version) for o in lowered.opset_import]


def test_decode_gets_split_kv_decode_and_combine(fused_graphs):
    lowered, report = lower_tensorrt.run(fused_graphs["decode"], lower_tensorrt.Options(decode_kv_splits=8))
    onnx.checker.check_model(lowered, full_check=True)
    counts = op_counts(lowered)
    assert counts["FlashAttention"] == counts["flash_attention"] == 0
    assert counts["flash_decode"] == counts["flash_combine"] == LAYERS and counts["RotaryEmbedding"] == 2 * LAYERS
    assert {layer["form"] for layer in report["layers"]} == {"flash_decode+flash_combine"}
    assert report["plugins"]["names"] == ["flash_combine", "flash_decode"]
    decodes = [n for n in lowered.graph.node if n.op_type == "flash_decode"]
    combines = [n for n in lowered.graph.node if n.op_type == "flash_combine"]
    for index, (decode, combine) in enumerate(zip(decodes, combines)):
        assert attrs(decode) == {"num_heads": HEADS, "kv_num_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                 "scale": pytest.approx(HEAD_DIM**-0.5), "kv_splits": 8, "split_size": MAX_CONTEXT // 8,
                                 "plugin_namespace": b"aotlm", "aot": 1}
        assert attrs(combine) == {"num_heads": HEADS, "head_dim": HEAD_DIM, "kv_splits": 8,
                                  "out_dtype": TensorProto.FLOAT, "plugin_namespace": b"aotlm", "aot": 1}
        assert list(combine.input) == list(decode.output[:2])
        assert list(decode.output[2:]) == [f"present.{index}.key", f"present.{index}.value"]
    one_split, _ = lower_tensorrt.run(fused_graphs["decode"], lower_tensorrt.Options(decode_kv_splits=1))
    assert op_counts(one_split)["flash_attention"] == LAYERS and op_counts(one_split)["flash_decode"] == 0


def test_plugin_tensors_have_the_contract_shapes_after_shape_inference(fused_graphs):
    lowered = {phase: lower_tensorrt.run(model, lower_tensorrt.Options(decode_kv_splits=4))[0]
               for phase, model in fused_graphs.items()}
    for phase, model in lowered.items():
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        graph = inferred.graph
        infos = {v.name: v.type.tensor_type for v in [*graph.value_info, *graph.input, *graph.output]}
        described = lambda name: (infos[name].elem_type,  # noqa: E731
                                  [d.dim_value or d.dim_param for d in infos[name].shape.dim])
        plugin = next(n for n in graph.node if n.op_type in ("flash_attention", "flash_decode"))
        cache = (TensorProto.FLOAT, ["batch", KV_HEADS, MAX_CONTEXT, HEAD_DIM])
        output = (TensorProto.FLOAT, ["batch", "sequence", HEADS * HEAD_DIM])
        kv = (TensorProto.FLOAT, ["batch", "sequence", KV_HEADS * HEAD_DIM])
        assert [described(name) for name in plugin.input] == [
            output, kv, kv, cache, cache, (TensorProto.INT32, ["batch"]), (TensorProto.INT32, [1])]
        if phase == "prefill":
            assert [described(name) for name in plugin.output] == [output, cache, cache]
        else:
            partial_out = (TensorProto.FLOAT, ["batch", "sequence", HEADS, 4, HEAD_DIM])
            partial_lse = (TensorProto.FLOAT, ["batch", "sequence", HEADS, 4])
            assert [described(name) for name in plugin.output] == [partial_out, partial_lse, cache, cache]
            combine = next(n for n in graph.node if n.op_type == "flash_combine")
            assert described(combine.output[0]) == output


def decoder_feeds(phase: str) -> dict:
    """Two right-padded prompts (6 and 3 tokens), or their next decode step; random caches."""
    rng = np.random.default_rng(1)
    names, _ = io_names(CONFIG)
    feeds = {n: rng.standard_normal((2, KV_HEADS, MAX_CONTEXT, HEAD_DIM)).astype(np.float32) for n in names[3:]}
    if phase == "prefill":
        return {**feeds, "input_ids": np.array([[1, 5, 9, 14, 200, 7], [1, 77, 3, 0, 0, 0]]),
                "position_ids": np.tile(np.arange(6), (2, 1)), "attention_mask": np.array([[1] * 6, [1] * 3 + [0] * 3])}
    return {**feeds, "input_ids": np.array([[10], [20]]), "position_ids": np.array([[6], [3]]),
            "attention_mask": np.array([[1] * 7, [1] * 4 + [0] * 3])}


def plugin_meaning(node: onnx.NodeProto, inputs: list[np.ndarray]):
    """What the plugin node(s) compute: (output, present_key, present_value) from flash_attention or decode+combine."""
    a = attrs(node)
    args = (*inputs, a["num_heads"], a["kv_num_heads"], a["scale"])
    if node.op_type == "flash_attention":
        return lower_tensorrt.plugin_reference(*args)
    partial_out, partial_lse, present_key, present_value = lower_tensorrt.flash_decode_reference(
        *args, a["kv_splits"], a["split_size"])
    return lower_tensorrt.flash_combine_reference(partial_out, partial_lse), present_key, present_value


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_layer_zero_plugins_compute_what_the_fused_node_means(fused_graphs, phase):
    fused, feeds = fused_graphs[phase], decoder_feeds(phase)
    lowered, _ = lower_tensorrt.run(fused, lower_tensorrt.Options(decode_kv_splits=4))
    attention = next(n for n in fused.graph.node if n.op_type == "FlashAttention")
    expected = op.reference(*inputs_of(fused, attention, feeds), HEADS, KV_HEADS, HEAD_DIM**-0.5)
    plugin = next(n for n in lowered.graph.node if n.op_type in PLUGINS)
    got = plugin_meaning(plugin, inputs_of(lowered, plugin, feeds))
    for name, value, reference in zip(("output", "present_key", "present_value"), got, expected):
        print(f"{phase} {name}: max |difference| {np.abs(value - reference).max():.2e}")
        np.testing.assert_allclose(value, reference, atol=TOLERANCE)


CASES = {  # phase, batch, new tokens, valid tokens per sequence after the step, total
    "first prompt, right padded": ("prefill", 2, 5, [5, 3], 5),
    "first prompt in the decode graph": ("decode", 2, 2, [2, 1], 2),
    "decode step, two lengths": ("decode", 2, 1, [7, 4], 7),
    "chunk after a cached prefix": ("decode", 1, 3, [7], 7),
}


@pytest.mark.parametrize("case", CASES)
def test_rotary_plus_plugin_reference_equals_the_op_on_random_inputs(case):
    phase, batch, length, valid, total = CASES[case]
    model = single_attention(phase, max_context=10)  # 4 splits of 3 rows: the last one is short
    rng = np.random.default_rng(len(case))
    feeds = {"query": rng.standard_normal((batch, length, 64)), "key": rng.standard_normal((batch, length, 32)),
             "value": rng.standard_normal((batch, length, 32)), "past_key": rng.standard_normal((batch, 2, 10, 16)),
             "past_value": rng.standard_normal((batch, 2, 10, 16))}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    feeds |= {"seqlens_k": np.array(valid, np.int32) - 1, "total_sequence_length": np.array(total, np.int32)}
    tables = [onnx.numpy_helper.to_array(t) for t in model.graph.initializer]
    expected = op.reference(*[feeds[n] for n in op.INPUTS[:7]], *tables, 4, 2, 16**-0.5)
    lowered, report = lower_tensorrt.run(model, lower_tensorrt.Options(decode_kv_splits=4))
    assert report["layers"][0]["splits"] == (4 if phase == "decode" else 1)
    plugin = next(n for n in lowered.graph.node if n.op_type in PLUGINS)
    if plugin.op_type == "flash_decode":
        assert attrs(plugin)["split_size"] == 3
    got = plugin_meaning(plugin, inputs_of(lowered, plugin, feeds))  # RotaryEmbedding-23 run by onnxruntime
    for value, reference in zip(got, expected):
        np.testing.assert_allclose(value, reference, atol=TOLERANCE)


def test_a_float16_graph_keeps_its_type_through_the_plugins():
    lowered, _ = lower_tensorrt.run(single_attention("decode", dtype=TensorProto.FLOAT16), lower_tensorrt.Options())
    onnx.checker.check_model(lowered, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(lowered, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.value_info, *inferred.graph.output]}
    decode, combine = (next(n for n in inferred.graph.node if n.op_type == op_type)
                       for op_type in ("flash_decode", "flash_combine"))
    assert [types[name] for name in decode.input[:2]] == [TensorProto.FLOAT16] * 2  # the rotated q, k
    assert [types[name] for name in decode.output] == [TensorProto.FLOAT] * 2 + [TensorProto.FLOAT16] * 2
    assert attrs(combine)["out_dtype"] == TensorProto.FLOAT16 and types[combine.output[0]] == TensorProto.FLOAT16


def test_max_rewrites_lowers_only_the_first(fused_graphs):
    lowered, report = lower_tensorrt.run(fused_graphs["decode"], lower_tensorrt.Options(max_rewrites=1))
    onnx.checker.check_model(lowered, full_check=True)
    counts = op_counts(lowered)
    assert counts["flash_decode"] == 1 and counts["FlashAttention"] == 1 and report["left_unlowered"] == 1
    assert [layer["node"] for layer in report["layers"]] == ["layers.0.FlashAttention"]


def test_a_node_without_cache_is_refused():
    with pytest.raises(PassError, match=r"layers\.0\.attn: FlashAttention has no KV cache .* export the graph with "
                                        r"past_key_values inputs"):
        lower_tensorrt.run(single_attention("prefill", cache=False), lower_tensorrt.Options())


def test_a_symbolic_max_context_is_refused_where_the_split_needs_it():
    with pytest.raises(PassError, match=r"layers\.0\.attn: the cache's max context .*'max_context'.* must be static"):
        lower_tensorrt.run(single_attention("decode", max_context="max_context"), lower_tensorrt.Options())
    lowered, _ = lower_tensorrt.run(single_attention("prefill", max_context="max_context"), lower_tensorrt.Options())
    assert op_counts(lowered)["flash_attention"] == 1  # prefill's single kernel needs no static M
    one_split = lower_tensorrt.Options(decode_kv_splits=1)  # decode without splits: the same single kernel
    lowered, _ = lower_tensorrt.run(single_attention("decode", max_context="max_context"), one_split)
    assert op_counts(lowered)["flash_attention"] == 1
    with pytest.raises(PassError, match=r"layers\.0\.attn: the cache's max context .* must be static"):
        lower_tensorrt.run(single_attention("prefill", max_context="max_context"),
                           lower_tensorrt.Options(attention="trt_native"))  # TRT_KVCacheUpdate's cache is static


def test_a_head_dim_the_kernels_cannot_tile_is_refused():
    for head_dim in (8, 24, 256):  # 256: tiles past the 48 KiB of shared memory an AOT launch gets
        with pytest.raises(PassError, match=rf"layers\.0\.attn: .* take head_dim 16, 32, 64 or 128 .* this model has "
                                            rf"{head_dim}; use lower_tensorrt's attention: trt_native"):
            lower_tensorrt.run(single_attention("prefill", head_dim=head_dim), lower_tensorrt.Options())
    native = lower_tensorrt.Options(attention="trt_native")
    lowered, _ = lower_tensorrt.run(single_attention("prefill", head_dim=8), native)
    assert op_counts(lowered)["TRT_Attention"] == 1


def test_options_are_checked():
    for splits in (0, 3):
        with pytest.raises(ValueError, match="decode_kv_splits: .* power of two"):
            lower_tensorrt.Options(decode_kv_splits=splits)
    with pytest.raises(ValueError, match="attention: 'flash' is not one of plugin, onnx_attention, trt_native"):
        lower_tensorrt.Options(attention="flash")
    for attention in ("trt_native", "onnx_attention"):  # taken, and the graphs came out the same whatever it was
        with pytest.raises(ValueError, match=f"decode_kv_splits applies to attention: plugin .* attention {attention}"):
            lower_tensorrt.Options(attention=attention, decode_kv_splits=8)
    assert lower_tensorrt.Options().kv_splits == 8 and lower_tensorrt.Options(decode_kv_splits=2).kv_splits == 2
    assert PASSES["lower_tensorrt"].options_type is lower_tensorrt.Options


def test_onnx_attention_option_delegates_to_attention_23(decoder_graphs, fused_graphs):
    lowered = {}
    for phase, model in fused_graphs.items():
        lowered[phase], report = lower_tensorrt.run(model, lower_tensorrt.Options(attention="onnx_attention"))
        counts = op_counts(lowered[phase])
        assert counts["Attention"] == LAYERS and counts["ScatterElements"] == 2 * LAYERS
        assert report["attention"] == "onnx_attention" and "not in place" in report["note"]
    for reference, got in zip(generate_logits(decoder_graphs), generate_logits(lowered)):
        np.testing.assert_allclose(got, reference, atol=TOLERANCE)


def emulate_trt_native(lowered: onnx.ModelProto, feeds: dict, layer: int = 0):
    """numpy TRT_KVCacheUpdate + TRT_Attention (lower_right anchored at each kv_length) on onnxruntime's inputs."""
    nodes = [n for n in lowered.graph.node if n.domain == "trt" and n.name.startswith(f"layers.{layer}.")]
    updates = sorted((n for n in nodes if n.op_type == "TRT_KVCacheUpdate"), key=lambda n: n.name)  # k, then v
    attention = next(n for n in nodes if n.op_type == "TRT_Attention")
    total = feeds["attention_mask"].shape[1]
    caches = []
    for update in updates:
        past, rows, write_at = inputs_of(lowered, update, feeds)
        cache = past.copy()
        for b, start in enumerate(write_at):
            cache[b, :, start: start + rows.shape[2]] = rows[b][:, : cache.shape[2] - start]
        caches.append(cache)
    values = evaluate(lowered, [attention.input[0], attention.input[5]], feeds)
    q, kv_lengths = values[attention.input[0]], values[attention.input[5]]
    out = np.zeros_like(q)
    length, group = q.shape[2], HEADS // KV_HEADS
    for b, h, i in np.ndindex(q.shape[0], HEADS, length):
        visible = min(kv_lengths[b] - length + i + 1, kv_lengths[b], total)
        scores = caches[0][b, h // group, :visible] @ q[b, h, i]
        weights = np.exp(scores - scores.max())
        out[b, h, i] = weights / weights.sum() @ caches[1][b, h // group, :visible]
    return out.transpose(0, 2, 1, 3).reshape(q.shape[0], length, -1), *caches


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_trt_native_writes_and_attends_like_the_op(fused_graphs, phase):
    fused, feeds = fused_graphs[phase], decoder_feeds(phase)
    lowered, report = lower_tensorrt.run(fused, lower_tensorrt.Options(attention="trt_native"))
    onnx.checker.check_model(lowered, full_check=True)
    counts = op_counts(lowered)
    assert counts["TRT_KVCacheUpdate"] == 2 * LAYERS and counts["TRT_Attention"] == LAYERS
    assert counts["FlashAttention"] == 0
    assert report["plugins"] == {"namespace": None, "names": [], "aot": False, "preview_feature": None}
    assert report["target"] == "tensorrt: TRT_KVCacheUpdate + TRT_Attention (TensorRT >= 11)"
    assert report["phase_graph"] == phase and report["left_unlowered"] == 0
    assert report["layers"] == [{"node": f"layers.{i}.FlashAttention", "form": "trt_native", "splits": 1}
                                for i in range(LAYERS)]
    domains = {o.domain: o.version for o in lowered.opset_import}
    assert domains.get("trt") == 1 and "aotlm" not in domains  # nothing of the project's domain is left
    update = next(n for n in lowered.graph.node if n.op_type == "TRT_KVCacheUpdate")
    assert attrs(update) == {"update_form": b"padded_bhnd", "mode": b"linear", "axis": -2}
    attention = next(n for n in lowered.graph.node if n.op_type == "TRT_Attention")
    assert attrs(attention) == {"query_form": b"padded_bhnd", "kv_form": b"padded_bhnd", "causal_kind": b"lower_right",
                                "TRT_decomposable": 1}
    writers = {n.output[0] for n in lowered.graph.node if n.op_type == "TRT_KVCacheUpdate"}
    assert writers == {f"present.{i}.{kind}" for i in range(LAYERS) for kind in ("key", "value")}  # in place
    fa = next(n for n in fused.graph.node if n.op_type == "FlashAttention")
    expected = op.reference(*inputs_of(fused, fa, feeds), HEADS, KV_HEADS, HEAD_DIM**-0.5)
    got = emulate_trt_native(lowered, feeds)
    valid = feeds["attention_mask"].sum(axis=1)  # the op leaves padding rows unwritten and their output unspecified
    for b, rows in enumerate(valid):
        if phase == "prefill":
            np.testing.assert_allclose(got[0][b, :rows], expected[0][b, :rows], atol=TOLERANCE)
        else:
            np.testing.assert_allclose(got[0][b], expected[0][b], atol=TOLERANCE)
        for cache, reference in zip(got[1:], expected[1:]):
            np.testing.assert_allclose(cache[b, :, :rows], reference[b, :, :rows], atol=TOLERANCE)


def test_a_decode_graph_is_split_eight_ways_by_default_and_only_the_decode_graph_is_split():
    lowered, report = lower_tensorrt.run(single_attention("decode"), lower_tensorrt.Options())
    decode = next(n for n in lowered.graph.node if n.op_type == "flash_decode")
    assert attrs(decode)["kv_splits"] == 8 and attrs(decode)["split_size"] == 2  # ceil(10 / 8)
    assert report["layers"] == [{"node": "layers.0.attn", "form": "flash_decode+flash_combine", "splits": 8}]
    lowered, report = lower_tensorrt.run(single_attention("main"), lower_tensorrt.Options())  # not a phase's name
    assert op_counts(lowered)["flash_attention"] == 1 and report["layers"][0]["splits"] == 1


@pytest.mark.parametrize("attention", ["plugin", "trt_native"])
def test_max_rewrites_zero_lowers_nothing_and_keeps_the_graph_valid(attention):
    lowered, report = lower_tensorrt.run(single_attention("decode"),
                                         lower_tensorrt.Options(attention=attention, max_rewrites=0))
    onnx.checker.check_model(lowered, full_check=True)
    assert op_counts(lowered) == {"FlashAttention": 1}
    assert report["lowered"] == 0 and report["left_unlowered"] == 1 and report["layers"] == []
    assert {o.domain: o.version for o in lowered.opset_import} == {"": 23, "aotlm": 1}


def test_max_rewrites_is_passed_on_to_the_onnx_attention_lowering(fused_graphs):
    options = lower_tensorrt.Options(attention="onnx_attention", max_rewrites=1)
    lowered, report = lower_tensorrt.run(fused_graphs["decode"], options)
    counts = op_counts(lowered)
    assert counts["Attention"] == 1 and counts["FlashAttention"] == LAYERS - 1
    assert report["layers"] == [{"node": "layers.0.FlashAttention", "form": "onnx_attention", "splits": 1}]


def test_a_newer_opset_is_kept_and_an_older_ir_version_raised_to_10():
    newer = single_attention("prefill")
    newer.opset_import[0].version = 24
    lowered, _ = lower_tensorrt.run(newer, lower_tensorrt.Options())
    assert {o.domain: o.version for o in lowered.opset_import}[""] == 24
    older = single_attention("prefill")
    older.ir_version = 8
    assert lower_tensorrt.run(older, lower_tensorrt.Options())[0].ir_version == 10


def test_a_bfloat16_graph_keeps_its_type_in_the_combine_and_the_native_scale():
    model = single_attention("decode", dtype=TensorProto.BFLOAT16)
    lowered, _ = lower_tensorrt.run(model, lower_tensorrt.Options())
    combine = next(n for n in lowered.graph.node if n.op_type == "flash_combine")
    assert attrs(combine)["out_dtype"] == TensorProto.BFLOAT16
    native, _ = lower_tensorrt.run(model, lower_tensorrt.Options(attention="trt_native"))
    onnx.checker.check_model(native, full_check=True)
    scale = next(n for n in native.graph.node if list(n.input) == ["layers.0.attn_0_scale32"])  # float32 -> T
    assert attrs(scale)["to"] == TensorProto.BFLOAT16


def test_a_flash_attention_op_of_another_domain_is_left_alone():
    model = single_attention("prefill")
    aotlm = model.graph.node[0]
    foreign = helper.make_node("FlashAttention", list(aotlm.input), ["foreign_output"], name="foreign",
                               domain="com.example")
    model.graph.node.insert(0, foreign)
    model.graph.output.append(helper.make_tensor_value_info("foreign_output", TensorProto.FLOAT, None))
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    lowered, report = lower_tensorrt.run(model, lower_tensorrt.Options())
    assert [layer["node"] for layer in report["layers"]] == ["layers.0.attn"]
    kept = [(n.domain, n.name) for n in lowered.graph.node if n.op_type == "FlashAttention"]
    assert kept == [("com.example", "foreign")]
