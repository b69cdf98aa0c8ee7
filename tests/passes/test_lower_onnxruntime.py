"""lower_onnxruntime: FlashAttention -> com.microsoft.GroupQueryAttention, the softmax scale folded into the query,
and the decode graph's GEMM path; parity through onnxruntime (the fused graphs come from tests/passes/test_fuse_attention.py),
and one hand-built node against flash_attention_op.reference (scales, packed q/k/v, float16)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from compiler.export import export_graphs
from compiler.frontend.model import build_decoder
from compiler.frontend.random_init import random_model
from passes import cleanup, fuse_attention, lower_onnxruntime
from passes import flash_attention_op as op
from passes.errors import PassError
from tests.passes.test_fuse_attention import (CONFIG, MAX_CONTEXT, decoder_graphs, fuse_and_lower, op_counts,  # noqa: F401,E501
                                              generate_logits)


def test_the_folded_scale_is_shared_by_both_phases_and_flash_keeps_the_default_path(decoder_graphs):
    lowered = {phase: fuse_and_lower(model)[2] for phase, model in decoder_graphs.items()}
    def folded_q_weights(model):  # per layer, the weight of the MatMul that feeds the attention's query
        initializers = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
        producers = {out: n for n in model.graph.node for out in n.output}
        return [initializers[producers[n.input[0]].input[1]] for n in model.graph.node if n.op_type == "GroupQueryAttention"]

    # The artifact stores a weight once when both graphs hold the same bytes: the fold must not split them.
    prefill, decode = folded_q_weights(lowered["prefill"]), folded_q_weights(lowered["decode"])
    assert len(prefill) == len(decode) == CONFIG.num_layers
    for a, b in zip(prefill, decode):
        np.testing.assert_array_equal(a, b)
    unscaled = {t.name: onnx.numpy_helper.to_array(t) for t in decoder_graphs["decode"].graph.initializer}
    # the q projection times 1/sqrt(head_dim) = 1/4 here, a power of two: exact
    assert any(np.array_equal(decode[0], w * np.float32(CONFIG.head_dim ** -0.5)) for w in unscaled.values()
               if w.shape == decode[0].shape)
    assert not any(np.array_equal(decode[0], w) for w in unscaled.values())
    flash = {phase: lower_onnxruntime.run(fuse_attention.run(model, fuse_attention.Options())[0],
                                          lower_onnxruntime.Options(decode_kernel="flash"))
             for phase, model in decoder_graphs.items()}
    assert flash["decode"][1]["attention_kernel"] == "flash"
    assert not any(a.name == "qk_output" for n in flash["decode"][0].graph.node for a in n.attribute)
    for gemm_logits, flash_logits in zip(generate_logits(lowered), generate_logits({p: m for p, (m, _) in flash.items()})):
        np.testing.assert_allclose(gemm_logits, flash_logits, atol=1e-5)
    with pytest.raises(PassError, match="decode_kernel: 'fast' is not one of gemm, flash"):
        lower_onnxruntime.run(decoder_graphs["decode"], lower_onnxruntime.Options(decode_kernel="fast"))


def test_a_query_that_is_not_a_plain_projection_is_scaled_by_a_mul(decoder_graphs):
    """A q projection weight read twice (here: by an extra MatMul that feeds nothing) is left alone: a Mul scales q."""
    fused = fuse_attention.run(decoder_graphs["decode"], fuse_attention.Options())[0]
    attention = next(n for n in fused.graph.node if n.op_type == "FlashAttention")
    projection = next(n for n in fused.graph.node if attention.input[0] in n.output)
    fused.graph.node.append(onnx.helper.make_node("MatMul", [projection.input[0], projection.input[1]], ["extra"]))
    before = {t.name: onnx.numpy_helper.to_array(t) for t in fused.graph.initializer}[projection.input[1]]
    lowered, report = lower_onnxruntime.run(fused, lower_onnxruntime.Options())
    assert report["scale_folded_into"] == {"mul": 1, "weight": CONFIG.num_layers - 1}
    after = {t.name: onnx.numpy_helper.to_array(t) for t in lowered.graph.initializer}[projection.input[1]]
    np.testing.assert_array_equal(after, before)
    lowered_attention = next(n for n in lowered.graph.node if n.name == attention.name)
    mul = next(n for n in lowered.graph.node if n.op_type == "Mul" and n.output[0] == lowered_attention.input[0])
    assert mul.input[0] == projection.output[0]
    factor = {t.name: onnx.numpy_helper.to_array(t) for t in lowered.graph.initializer}[mul.input[1]]
    assert factor == np.float32(CONFIG.head_dim ** -0.5)


def test_a_query_that_is_a_graph_output_keeps_its_value(decoder_graphs):
    """The q projection's output is also a graph output: folding the softmax scale into its weight would change
    what the graph returns, so a Mul scales q instead."""
    fused = fuse_attention.run(decoder_graphs["decode"], fuse_attention.Options())[0]
    attention = next(n for n in fused.graph.node if n.op_type == "FlashAttention")
    fused.graph.output.append(onnx.helper.make_tensor_value_info(attention.input[0], onnx.TensorProto.FLOAT, None))
    _, report = lower_onnxruntime.run(fused, lower_onnxruntime.Options())
    assert report["scale_folded_into"] == {"mul": 1, "weight": CONFIG.num_layers - 1}


def test_a_query_another_node_reads_keeps_its_value(decoder_graphs):
    """Read by a second node (not a graph output itself): folding the scale into the shared weight changed that
    node's input too."""
    fused = fuse_attention.run(decoder_graphs["decode"], fuse_attention.Options())[0]
    attention = next(n for n in fused.graph.node if n.op_type == "FlashAttention")
    fused.graph.node.append(onnx.helper.make_node("Relu", [attention.input[0]], ["query_read"]))
    fused.graph.output.append(onnx.helper.make_tensor_value_info("query_read", onnx.TensorProto.FLOAT, None))
    _, report = lower_onnxruntime.run(fused, lower_onnxruntime.Options())
    assert report["scale_folded_into"] == {"mul": 1, "weight": CONFIG.num_layers - 1}


def test_a_query_weight_that_is_also_a_graph_input_stays_overridable(decoder_graphs):
    """An initializer listed as a graph input (an overridable default): the scale was folded into it as into a
    constant, and the export dropped the input."""
    fused = fuse_attention.run(decoder_graphs["decode"], fuse_attention.Options())[0]
    attention = next(n for n in fused.graph.node if n.op_type == "FlashAttention")
    projection = next(n for n in fused.graph.node if attention.input[0] in n.output)
    weight = next(t for t in fused.graph.initializer if t.name == projection.input[1])
    fused.graph.input.append(onnx.helper.make_tensor_value_info(weight.name, weight.data_type, list(weight.dims)))
    lowered, report = lower_onnxruntime.run(fused, lower_onnxruntime.Options())
    assert report["scale_folded_into"] == {"mul": 1, "weight": CONFIG.num_layers - 1}
    assert [i.name for i in lowered.graph.input] == [i.name for i in fused.graph.input]
    after = {t.name: onnx.numpy_helper.to_array(t) for t in lowered.graph.initializer}[weight.name]
    np.testing.assert_array_equal(after, onnx.numpy_helper.to_array(weight))


def test_a_float16_graph_folds_the_scale_with_the_head_dim_of_its_cast_tables():
    """In a float16 graph the rotary tables reach the node through a Cast; head_dim comes from their shape (before:
    from initializers only, so it read 0 here: the head_dim check could not fire, and the fold fell back to a Mul)."""
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    prefill = cleanup.run(export_graphs(decoder, MAX_CONTEXT, dtype="float16")["prefill"], cleanup.Options())[0]
    fused = fuse_attention.run(prefill, fuse_attention.Options(required=True))[0]
    lowered, report = lower_onnxruntime.run(fused, lower_onnxruntime.Options())
    assert report["scale_folded_into"] == {"weight": CONFIG.num_layers}
    before = {t.name: onnx.numpy_helper.to_array(t) for t in fused.graph.initializer}
    after = {t.name: onnx.numpy_helper.to_array(t) for t in lowered.graph.initializer}
    attention = next(n for n in lowered.graph.node if n.op_type == "GroupQueryAttention")
    projection = next(n for n in lowered.graph.node if attention.input[0] in n.output)
    np.testing.assert_array_equal(after[projection.input[1]],
                                  before[projection.input[1]] * np.float16(CONFIG.head_dim ** -0.5))
    assert next(a.f for a in attention.attribute if a.name == "scale") == 1.0


def test_rotary_separate_rotates_q_and_k_before_the_op_with_the_same_logits(decoder_graphs):
    """rotary "separate": com.microsoft.RotaryEmbedding on q and k at the op's positions (0..S-1 in the prompt,
    after the cache in decode, per row), do_rotary 0; logits and written cache equal the inside-rotary graphs'."""
    inside = {phase: fuse_and_lower(model)[2] for phase, model in decoder_graphs.items()}
    separate = {}
    for phase, model in decoder_graphs.items():
        fused = fuse_attention.run(model, fuse_attention.Options())[0]
        separate[phase], report = lower_onnxruntime.run(fused, lower_onnxruntime.Options(rotary="separate"))
        assert report["rotary"] == "separate"
        added = op_counts(separate[phase]) - op_counts(inside[phase])
        # two rotations a layer; the positions once a graph (Shape, Squeeze, Cast x2, Equal, Add x2, Sub, Where,
        # Range, Unsqueeze)
        assert added["RotaryEmbedding"] == 2 * CONFIG.num_layers and added["Range"] == added["Where"] == 1, added
        for node in (n for n in separate[phase].graph.node if n.op_type == "GroupQueryAttention"):
            assert onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "do_rotary")) == 0
            assert len(node.input) == 7  # no cos/sin tables
    for a, b in zip(generate_logits(inside), generate_logits(separate)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(PassError, match="rotary: 'outside' is not one of inside, separate"):
        lower_onnxruntime.run(decoder_graphs["decode"], lower_onnxruntime.Options(rotary="outside"))
    packed = fuse_attention.run(decoder_graphs["decode"], fuse_attention.Options())[0]
    for node in (n for n in packed.graph.node if n.op_type == "FlashAttention"):
        node.input[1] = node.input[2] = ""  # q, k and v in one input (a hand-made graph: no pass packs this op)
    with pytest.raises(PassError, match="come packed in one input; rotary 'separate' rotates q and k apart"):
        lower_onnxruntime.run(packed, lower_onnxruntime.Options(rotary="separate"))


# ---- one hand-built FlashAttention node against the op's numpy reference --------------------------------------------

HEADS, KV_HEADS, HEAD_DIM, ROWS, HIDDEN = 4, 2, 16, 16, 32  # ROWS: the cache's max context
WIDTHS = {"query": HEADS * HEAD_DIM, "key": KV_HEADS * HEAD_DIM, "value": KV_HEADS * HEAD_DIM}


def flash_attention_model(scale: float | None = None, dtype=np.float32, head_dim: int = HEAD_DIM,
                          packed: str | None = None) -> onnx.ModelProto:
    """A decode graph of one aotlm.FlashAttention node on graph inputs, its rotary tables initializers. packed: None
    (query, key, value inputs), "input" (q/k/v in one input "qkv") or "weight" (x [B, 1, HIDDEN] times the packed
    q/k/v weight "qkv_weight", an initializer)."""
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    value_info = lambda name, shape: onnx.helper.make_tensor_value_info(name, elem, shape)  # noqa: E731
    cos, sin = rotary_tables(head_dim)
    initializers = [onnx.numpy_helper.from_array(cos.astype(dtype), "cos_cache"),
                    onnx.numpy_helper.from_array(sin.astype(dtype), "sin_cache")]
    caches = [value_info(name, [2, KV_HEADS, ROWS, head_dim]) for name in ("past_key", "past_value")]
    lengths = [onnx.helper.make_tensor_value_info("seqlens_k", onnx.TensorProto.INT32, [2]),
               onnx.helper.make_tensor_value_info("total_sequence_length", onnx.TensorProto.INT32, [])]
    nodes, width = [], sum(WIDTHS.values()) * head_dim // HEAD_DIM
    if packed is None:
        qkv = [value_info(name, [2, 1, w * head_dim // HEAD_DIM]) for name, w in WIDTHS.items()]
        attention_inputs = list(WIDTHS)
    elif packed == "input":
        qkv, attention_inputs = [value_info("qkv", [2, 1, width])], ["qkv", "", ""]
    else:
        qkv, attention_inputs = [value_info("x", [2, 1, HIDDEN])], ["qkv", "", ""]
        initializers.append(onnx.numpy_helper.from_array(packed_weight().astype(dtype), "qkv_weight"))
        nodes.append(onnx.helper.make_node("MatMul", ["x", "qkv_weight"], ["qkv"], name="qkv_proj"))
    attributes = {"num_heads": HEADS, "kv_num_heads": KV_HEADS, "do_rotary": 1, "rotary_interleaved": 0}
    nodes.append(onnx.helper.make_node(op.OP_TYPE, attention_inputs + list(op.INPUTS[3:]), list(op.OUTPUTS),
                                       name="attention", domain=op.DOMAIN,
                                       **attributes, **({} if scale is None else {"scale": scale})))
    outputs = [value_info("output", [2, 1, HEADS * head_dim]),
               *(value_info(name, [2, KV_HEADS, ROWS, head_dim]) for name in op.OUTPUTS[1:])]
    graph = onnx.helper.make_graph(nodes, "decode", qkv + caches + lengths, outputs, initializers)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21),
                                                        onnx.helper.make_opsetid(op.DOMAIN, op.VERSION)])


def rotary_tables(head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    return op.rotary_tables(1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim), ROWS)


def packed_weight() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((HIDDEN, sum(WIDTHS.values()))).astype(np.float32) / HIDDEN ** 0.5


def decode_inputs(head_dim: int = HEAD_DIM) -> dict[str, np.ndarray]:
    """One new token for each of two sequences that hold 6 and 3 cached tokens."""
    rng = np.random.default_rng(0)
    seqlens = np.array([6, 3], np.int32)
    inputs = {name: rng.standard_normal((2, 1, width * head_dim // HEAD_DIM)).astype(np.float32)
              for name, width in WIDTHS.items()}
    for name in ("past_key", "past_value"):
        inputs[name] = np.zeros((2, KV_HEADS, ROWS, head_dim), np.float32)
        for row, cached in enumerate(seqlens):
            inputs[name][row, :, :cached] = rng.standard_normal((KV_HEADS, cached, head_dim))
    return {**inputs, "seqlens_k": seqlens, "total_sequence_length": np.array(7, np.int32)}


def expected_output(inputs: dict, scale: float | None, head_dim: int = HEAD_DIM) -> np.ndarray:
    return op.reference(*(inputs[name] for name in op.INPUTS[:7]), *rotary_tables(head_dim), HEADS, KV_HEADS,
                        scale)[0]


def run_attention(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(["output"], {name: value for name, value in feeds.items() if name in names})[0]


@pytest.mark.parametrize("scale, dtype", [(0.3, np.float32), (None, np.float32), (0.3, np.float16)],
                         ids=["scale-0.3", "no-scale-attribute", "float16"])
def test_the_node_scale_or_its_default_reaches_the_output(scale, dtype):
    """fuse_attention always writes scale 1/sqrt(head_dim); the op's meaning also allows another one, or none (that
    default). Here q is a graph input, so a Mul in the graph's type scales it."""
    lowered, report = lower_onnxruntime.run(flash_attention_model(scale, dtype), lower_onnxruntime.Options())
    assert report["scale_folded_into"] == {"mul": 1}
    inputs = decode_inputs()
    output = run_attention(lowered, {name: value.astype(dtype) if value.dtype == np.float32 else value
                                     for name, value in inputs.items()})
    np.testing.assert_allclose(output, expected_output(inputs, scale), atol=1e-5 if dtype == np.float32 else 1e-2)


def test_a_packed_query_takes_the_scale_in_its_query_columns_or_keeps_it_in_the_op():
    """q, k and v in one tensor (a hand-made graph: no pass packs this op): from a weight, only its query columns
    take the scale; from a graph input, the op keeps it, and so the decode graph keeps onnxruntime's flash path (its
    GEMM path is taken for a scale of 1)."""
    inputs = decode_inputs()
    x = np.random.default_rng(2).standard_normal((2, 1, HIDDEN)).astype(np.float32)
    from_weight = dict(zip(WIDTHS, np.split(x @ packed_weight(), np.cumsum(list(WIDTHS.values()))[:-1], axis=-1)))
    lowered, report = lower_onnxruntime.run(flash_attention_model(0.3, packed="weight"), lower_onnxruntime.Options())
    assert report["scale_folded_into"] == {"weight": 1}
    weight = next(onnx.numpy_helper.to_array(t) for t in lowered.graph.initializer if t.name == "qkv_weight")
    np.testing.assert_array_equal(weight[:, WIDTHS["query"]:], packed_weight()[:, WIDTHS["query"]:])
    np.testing.assert_allclose(run_attention(lowered, {**inputs, "x": x}),
                               expected_output({**inputs, **from_weight}, 0.3), atol=1e-5)

    lowered, report = lower_onnxruntime.run(flash_attention_model(0.3, packed="input"), lower_onnxruntime.Options())
    assert report["scale_folded_into"] == {"none": 1} and report["attention_kernel"] == "flash"
    attention = next(n for n in lowered.graph.node if n.op_type == "GroupQueryAttention")
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}
    assert attributes["scale"] == pytest.approx(0.3) and "qk_output" not in attributes and len(attention.output) == 3
    packed = np.concatenate([inputs[name] for name in WIDTHS], axis=-1)
    np.testing.assert_allclose(run_attention(lowered, {**inputs, "qkv": packed}), expected_output(inputs, 0.3),
                               atol=1e-5)


def test_a_head_dim_onnxruntime_cannot_run_is_refused():
    with pytest.raises(PassError, match="needs a head_dim that is a multiple of 16, and this model's is 8: lower the "
                                        "fused attention with lower_onnx_attention instead"):
        lower_onnxruntime.run(flash_attention_model(head_dim=8), lower_onnxruntime.Options())


def test_a_biased_query_projection_takes_the_scale_in_its_weight_and_bias():
    """Qwen2's q_proj adds a bias: the scale went into a Mul, which kept the query out of the packed q/k/v and, having
    no shape, left skip_unused_rows nothing to prove (it changed nothing on every Qwen2 model)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from passes import pack_projections
    from tests.passes.test_fuse_attention import trace_hf

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="eager", use_cache=False)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # transformers starts biases at 0: they would read as no bias
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_()
    ids, mask = torch.randint(0, 300, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits.numpy()
    fused, _ = fuse_attention.run(trace_hf(model, ids, mask), fuse_attention.Options(rotary_cache_length=128))
    lowered, report = lower_onnxruntime.run(fused, lower_onnxruntime.Options())
    assert report["scale_folded_into"] == {"weight": 2}, report
    packed, _ = pack_projections.run(lowered, pack_projections.Options())
    attention = [node for node in packed.graph.node if node.op_type == "GroupQueryAttention"]
    assert all(node.input[1] == node.input[2] == "" for node in attention)  # q, k and v packed into one input
    session = ort.InferenceSession(packed.SerializeToString(), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    np.testing.assert_allclose(logits, expected, atol=1e-4)


def test_skip_unused_rows_moves_the_rows_past_separate_rotary(decoder_graphs):
    """rotary: separate wrote its rotated query without a shape: skip_unused_rows could not prove it row-wise and
    changed nothing (recipes/smollm2-135m-rotary-separate.yaml lists it)."""
    from passes import fuse_rms_norm, fuse_silu, pack_projections, skip_unused_rows

    model = fuse_attention.run(decoder_graphs["prefill"], fuse_attention.Options())[0]
    model = lower_onnxruntime.run(model, lower_onnxruntime.Options(rotary="separate"))[0]
    for module in (fuse_rms_norm, fuse_silu, pack_projections):
        model = module.run(model, module.Options())[0]
    _, report = skip_unused_rows.run(model, skip_unused_rows.Options())
    assert report["applied"], report
