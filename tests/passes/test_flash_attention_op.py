"""The FlashAttention op's written meaning (numpy reference) equals what its onnxruntime lowering computes."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from passes import flash_attention_op as op

B, H, KV, D, MAX = 2, 4, 2, 16, 16  # onnxruntime needs head_size % 16 == 0


def group_query_attention_graph() -> onnx.ModelProto:
    node = helper.make_node("GroupQueryAttention", list(op.INPUTS), list(op.OUTPUTS), domain="com.microsoft",
                            num_heads=H, kv_num_heads=KV, do_rotary=1, rotary_interleaved=0)
    floats = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    inputs = [floats("query", ["b", "s", H * D]), floats("key", ["b", "s", KV * D]), floats("value", ["b", "s", KV * D]),
              floats("past_key", ["b", KV, MAX, D]), floats("past_value", ["b", KV, MAX, D]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["b"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
              floats("cos_cache", [MAX, D // 2]), floats("sin_cache", [MAX, D // 2])]
    outputs = [floats("output", None), floats("present_key", None), floats("present_value", None)]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("case", ["first prompt with right padding", "decode one token", "later chunk of three"])
def test_reference_matches_onnxruntime(case):
    rng = np.random.default_rng(0)
    if case == "first prompt with right padding":
        length, seqlens, total = 5, np.array([4, 2], np.int32), 5
        past_rows = [0, 0]
    elif case == "decode one token":
        length, seqlens, total = 1, np.array([6, 3], np.int32), 7
        past_rows = [6, 3]
    else:
        length, seqlens, total = 3, np.array([8, 5], np.int32), 9
        past_rows = [6, 3]
    past_key = np.zeros((B, KV, MAX, D), np.float32)
    past_value = np.zeros((B, KV, MAX, D), np.float32)
    for b, rows in enumerate(past_rows):  # only rows already cached hold data
        past_key[b, :, :rows] = rng.standard_normal((KV, rows, D))
        past_value[b, :, :rows] = rng.standard_normal((KV, rows, D))
    inv_freq = 1.0 / 10000 ** (np.arange(0, D, 2) / D)
    cos, sin = op.rotary_tables(inv_freq, MAX)
    feed = {"query": rng.standard_normal((B, length, H * D)).astype(np.float32),
            "key": rng.standard_normal((B, length, KV * D)).astype(np.float32),
            "value": rng.standard_normal((B, length, KV * D)).astype(np.float32),
            "past_key": past_key, "past_value": past_value, "seqlens_k": seqlens,
            "total_sequence_length": np.array(total, np.int32), "cos_cache": cos, "sin_cache": sin}
    batch = B
    if case == "later chunk of three":  # onnxruntime's kernel takes chunks after a cached prefix one sequence at a time
        batch = 1
        feed = {k: v[:1] if k not in ("total_sequence_length", "cos_cache", "sin_cache") else v for k, v in feed.items()}
        feed["total_sequence_length"] = np.array(int(seqlens[0]) + 1, np.int32)
    session = ort.InferenceSession(group_query_attention_graph().SerializeToString(), providers=["CPUExecutionProvider"])
    output, present_key, present_value = session.run(None, feed)
    expected = op.reference(**{k: v for k, v in feed.items()}, num_heads=H, kv_num_heads=KV)
    for b in range(batch):
        valid = slice(0, seqlens[b] + 1)
        rows = range(length) if length != total else range(int(seqlens[b]) + 1)  # padded rows are unspecified
        np.testing.assert_allclose(output[b, list(rows)], expected[0][b, list(rows)], atol=1e-5)
        np.testing.assert_allclose(present_key[b, :, valid], expected[1][b, :, valid], atol=1e-5)
        np.testing.assert_allclose(present_value[b, :, valid], expected[2][b, :, valid], atol=1e-5)


def first_prompt(query, max_context=4):
    """For reference() on one sequence's first prompt, every row valid, H = 2 query heads over KV = 1: an empty cache,
    rotary tables that rotate nothing (cos 1, sin 0) and seqlens_k."""
    batch, length, width = query.shape
    head_dim = width // 2
    cache = np.zeros((batch, 1, max_context, head_dim))
    tables = np.ones((max_context, head_dim // 2)), np.zeros((max_context, head_dim // 2))
    return cache, tables, np.array([length - 1], np.int32)


def test_rotary_tables_scale_both_cos_and_sin():
    inv_freq = np.array([1.0, 0.25])
    cos, sin = op.rotary_tables(inv_freq, 3, scaling=2.0)
    angles = np.arange(3)[:, None] * inv_freq[None, :]
    np.testing.assert_allclose(cos, 2 * np.cos(angles), rtol=1e-6)
    np.testing.assert_allclose(sin, 2 * np.sin(angles), rtol=1e-6)
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == (3, 2)


def test_the_scale_argument_is_used_zero_averages_the_visible_values():
    rng = np.random.default_rng(3)
    query, key, value = rng.standard_normal((1, 3, 8)), rng.standard_normal((1, 3, 4)), rng.standard_normal((1, 3, 4))
    cache, tables, seqlens = first_prompt(query)
    output, _, _ = op.reference(query, key, value, cache, cache, seqlens, 3, *tables, num_heads=2, kv_num_heads=1,
                                scale=0.0)
    for i in range(3):  # every visible key weighs the same: the mean of value rows 0..i, for both heads
        mean = value[0, : i + 1].mean(axis=0)
        np.testing.assert_allclose(output[0, i], np.concatenate([mean, mean]), atol=1e-12)


def test_right_padding_of_a_first_prompt_is_not_written_to_the_cache():
    rng = np.random.default_rng(4)
    query, key, value = rng.standard_normal((1, 4, 8)), rng.standard_normal((1, 4, 4)), rng.standard_normal((1, 4, 4))
    past_key, past_value = rng.standard_normal((1, 1, 6, 4)), rng.standard_normal((1, 1, 6, 4))
    tables = np.ones((6, 2)), np.zeros((6, 2))
    _, present_key, present_value = op.reference(query, key, value, past_key, past_value, np.array([1], np.int32), 4,
                                                 *tables, num_heads=2, kv_num_heads=1)
    np.testing.assert_allclose(present_key[0, 0, :2], key[0, :2])  # the two valid rows, written
    np.testing.assert_allclose(present_value[0, 0, :2], value[0, :2])
    np.testing.assert_array_equal(present_key[0, 0, 2:], past_key[0, 0, 2:])  # padding rows 2, 3: the cache as it was
    np.testing.assert_array_equal(present_value[0, 0, 2:], past_value[0, 0, 2:])


def test_large_scores_give_a_finite_softmax():
    """Scores of +-1e4 overflow exp() unless the row's maximum is taken out first."""
    key = np.array([[[100.0, 0.0], [-100.0, 0.0]]])  # [1, 2, KV*D = 2]
    value = np.array([[[1.0, 2.0], [3.0, 4.0]]])
    query = np.concatenate([key[:, [0, 0]], key[:, [0, 0]]], axis=-1)  # both rows, both heads, along key 0
    cache, tables, seqlens = first_prompt(query)
    output, _, _ = op.reference(query, key, value, cache, cache, seqlens, 2, *tables, num_heads=2, kv_num_heads=1,
                                scale=1.0)
    np.testing.assert_allclose(output[0], [[1.0, 2.0, 1.0, 2.0]] * 2)
