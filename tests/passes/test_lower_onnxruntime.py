"""lower_onnxruntime: FlashAttention -> com.microsoft.GroupQueryAttention, the softmax scale folded into the query,
and the decode graph's GEMM path; parity through onnxruntime (the fused graphs come from tests/passes/test_fuse_attention.py)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from compiler.export import export_graphs
from compiler.frontend.model import build_decoder
from compiler.frontend.random_init import random_model
from passes import cleanup, fuse_attention, lower_onnxruntime
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
