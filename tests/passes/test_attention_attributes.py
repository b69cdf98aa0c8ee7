"""The FlashAttention node's attributes at their edges, the same in every lowering: a scale of 0 (a scale, not "the
default"), no scale attribute (D^-0.5), rotary attributes other than the op's meaning (refused where a lowering
would rotate wrongly), and the reference's no-cache form and empty sequences."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from passes import flash_attention_op as op
from passes import lower_onnx_attention, lower_onnxruntime, lower_tensorrt
from passes.errors import PassError
from tests.passes.test_lower_onnxruntime import decode_inputs, expected_output, flash_attention_model, run_attention
from tests.passes.test_lower_tensorrt import single_attention


def with_attributes(model: onnx.ModelProto, **attributes) -> onnx.ModelProto:
    """model with its FlashAttention node's attributes set (None: removed)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    node = next(n for n in model.graph.node if n.op_type == op.OP_TYPE)
    kept = [a for a in node.attribute if a.name not in attributes]
    del node.attribute[:]
    node.attribute.extend(kept + [onnx.helper.make_attribute(k, v) for k, v in attributes.items() if v is not None])
    return model


def test_a_scale_of_zero_is_a_scale_in_the_onnxruntime_lowering():
    """`scale or default` read 0 as "no scale": the node averaged nothing and attended as with D^-0.5."""
    lowered, report = lower_onnxruntime.run(flash_attention_model(0.0), lower_onnxruntime.Options())
    assert report["scale_folded_into"] == {"mul": 1}
    inputs = decode_inputs()
    np.testing.assert_allclose(run_attention(lowered, inputs), expected_output(inputs, 0.0), atol=1e-5)


def test_a_scale_onnx_attention_cannot_take_is_refused_by_the_pass_not_at_load():
    for scale in (0.0, -0.25):
        with pytest.raises(PassError, match=f"scale {scale}; ONNX's Attention takes a scale > 0"):
            lower_onnx_attention.run(flash_attention_model(scale), lower_onnx_attention.Options())


@pytest.mark.parametrize("attention", ["plugin", "trt_native"])
def test_the_tensorrt_lowering_takes_a_node_without_a_scale_as_the_default(attention):
    """KeyError 'scale' (as lower_onnx_attention had, fixed before): the op's meaning makes it optional."""
    model = with_attributes(single_attention("prefill", head_dim=64), scale=None)
    lowered, _ = lower_tensorrt.run(model, lower_tensorrt.Options(attention=attention))
    if attention == "plugin":
        plugin = next(n for n in lowered.graph.node if n.op_type == "flash_attention")
        scale = next(a.f for a in plugin.attribute if a.name == "scale")
    else:  # TRT_Attention has no scale: the query is multiplied by it first
        constant = next(i for i in lowered.graph.initializer if i.name.endswith("_scale32"))
        scale = float(onnx.numpy_helper.to_array(constant))
    assert scale == pytest.approx(64**-0.5)


@pytest.mark.parametrize("attribute, value", [("rotary_interleaved", 1), ("do_rotary", 0)])
def test_rotary_attributes_outside_the_ops_meaning_are_refused_where_they_would_be_ignored(attribute, value):
    """The opset-23 and TensorRT lowerings always rotate, in the half layout: a node saying otherwise gave other
    numbers than onnxruntime's lowering, which passes the attribute to GroupQueryAttention (max difference 0.99)."""
    model = with_attributes(flash_attention_model(), **{attribute: value})
    with pytest.raises(PassError, match=f"{attribute}={value}, and lower_onnx_attention implements"):
        lower_onnx_attention.run(model, lower_onnx_attention.Options())
    trt_model = with_attributes(single_attention("prefill", head_dim=64), **{attribute: value})
    for attention in ("plugin", "trt_native"):
        with pytest.raises(PassError, match=f"{attribute}={value}, and lower_tensorrt implements"):
            lower_tensorrt.run(trt_model, lower_tensorrt.Options(attention=attention))
    lowered, _ = lower_onnxruntime.run(model, lower_onnxruntime.Options())  # GroupQueryAttention honours it
    gqa = next(n for n in lowered.graph.node if n.op_type == "GroupQueryAttention")
    assert next(a.i for a in gqa.attribute if a.name == attribute) == value


def test_the_reference_runs_the_no_cache_form_and_refuses_an_empty_sequence():
    """past_key "" (no cache) is part of the op; the reference raised AttributeError on it. seqlens_k -1 wrote the
    cache's last row through a negative index."""
    rng = np.random.default_rng(5)
    query, key, value = rng.standard_normal((1, 3, 8)), rng.standard_normal((1, 3, 4)), rng.standard_normal((1, 3, 4))
    tables = np.ones((4, 2)), np.zeros((4, 2))
    output, present_key, _ = op.reference(query, key, value, None, None, np.array([2], np.int32), 3, *tables,
                                          num_heads=2, kv_num_heads=1)
    cache = np.zeros((1, 1, 3, 4))
    expected, _, _ = op.reference(query, key, value, cache, cache, np.array([2], np.int32), 3, *tables, num_heads=2,
                                  kv_num_heads=1)
    np.testing.assert_array_equal(output, expected)
    np.testing.assert_array_equal(present_key[0, 0], key[0])
    with pytest.raises(ValueError, match="must be >= 0"):
        op.reference(query[:, :1], key[:, :1], value[:, :1], np.zeros((1, 1, 4, 4)), np.zeros((1, 1, 4, 4)),
                     np.array([-1], np.int32), 1, *tables, num_heads=2, kv_num_heads=1)


def test_the_torch_reference_refuses_an_empty_sequence_too():
    """runtime/kernels/reference.py wrote the cache's last row through a negative index for seqlens_k -1."""
    torch = pytest.importorskip("torch")
    from runtime.kernels.reference import new_token_positions

    with pytest.raises(ValueError, match="must be >= 0"):
        new_token_positions(-1, 1, 1)
    positions, valid = new_token_positions(2, 3, 3)
    assert positions.tolist() == [0, 1, 2] and bool(valid.all()) and isinstance(positions, torch.Tensor)


def test_a_scale_of_zero_that_cannot_be_folded_is_refused():
    """q/k/v packed in a graph input: the scale stays in GroupQueryAttention, which reads 0 as "the default"."""
    with pytest.raises(PassError, match=r"scale 0.0 cannot be folded into its query"):
        lower_onnxruntime.run(flash_attention_model(0.0, packed="input"), lower_onnxruntime.Options())
