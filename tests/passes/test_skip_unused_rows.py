"""skip_unused_rows: the prefill graph's last layer runs its post-attention part on the selected rows only, and the
logits and the written cache stay the same (onnxruntime, right-padded batch of two, then decode steps)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from compiler.errors import BuildError
from compiler.export import export_graphs
from compiler.frontend.model import build_decoder
from compiler.frontend.random_init import random_model
from compiler.pipeline import check_passes
from compiler.recipe import PassSpec
from passes import (cleanup, fuse_attention, fuse_rms_norm, fuse_silu, lower_onnxruntime, pack_projections, quantize,
                    quantize_kv_cache, skip_unused_rows)
from tests.passes.test_fuse_attention import CONFIG, MAX_CONTEXT, decoder_graphs, generate_logits, op_counts  # noqa: F401

DEFAULT_RECIPE_PASSES = (fuse_attention, lower_onnxruntime, fuse_rms_norm, fuse_silu, pack_projections)
POST_ATTENTION = ["MatMul", "SkipSimplifiedLayerNormalization", "MatMul", "Split", "QuickGelu", "Mul", "MatMul", "Add"]


def run_passes(model: onnx.ModelProto, passes) -> onnx.ModelProto:
    for module in passes:
        model = module.run(model, module.Options())[0]
    return model


def skip(graphs: dict) -> tuple[dict, dict]:
    results = {phase: skip_unused_rows.run(model, skip_unused_rows.Options()) for phase, model in graphs.items()}
    return {p: r[0] for p, r in results.items()}, {p: r[1] for p, r in results.items()}


def assert_same_generation(before: dict, after: dict) -> None:
    for reference, result in zip(generate_logits(before), generate_logits(after)):
        np.testing.assert_allclose(result, reference, rtol=0, atol=1e-6)


def output_shape(model: onnx.ModelProto, tensor: str, length: int = 6) -> tuple:
    """Runs the prefill graph on a batch of two prompts of `length` tokens with `tensor` added as an output."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.helper.make_empty_tensor_value_info(tensor))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {"input_ids": np.ones((2, length), np.int64), "position_ids": np.tile(np.arange(length), (2, 1)),
            "attention_mask": np.ones((2, length), np.int64)}
    for value in session.get_inputs()[3:]:
        feed[value.name] = np.zeros((2, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), np.float32)
    return session.run([tensor], feed)[0].shape


def test_default_passes_then_skip_moves_the_last_layer_after_attention(decoder_graphs):  # noqa: F811
    graphs = {phase: run_passes(model, DEFAULT_RECIPE_PASSES) for phase, model in decoder_graphs.items()}
    skipped, reports = skip(graphs)
    report = reports["prefill"]
    assert report["applied"], report
    assert [m["op"] for m in report["moved"]] == POST_ATTENTION
    assert all("layers.1" in m["node"] for m in report["moved"])  # the last layer only
    assert report["frontier"][0] == "layers.1.attention_output"
    assert "layers.0" in report["frontier"][1]  # the residual stream coming out of layer 0
    # o_proj 64x64, gate/up 64x256, down 128x64: 2·K·N each
    assert report["flops_per_skipped_row"] == 2 * (64 * 64 + 64 * 256 + 128 * 64)
    before, after = op_counts(graphs["prefill"]), op_counts(skipped["prefill"])
    assert after["MatMul"] == before["MatMul"] and after["Gather"] == before["Gather"] + 1  # two selections, one gone
    assert after["Squeeze"] == before["Squeeze"] + 1 and after["Flatten"] == before["Flatten"] + 1
    # The moved products really see one row per sequence: [1, batch, N], where they saw [batch, sequence, N].
    down = next(m["node"] for m in report["moved"] if "down_proj" in m["node"])
    down_output = next(n.output[0] for n in skipped["prefill"].graph.node if n.name == down)
    assert output_shape(graphs["prefill"], down_output) == (2, 6, CONFIG.hidden_size)
    assert output_shape(skipped["prefill"], down_output) == (1, 2, CONFIG.hidden_size)
    assert not reports["decode"]["applied"] and "every position's logits" in reports["decode"]["reason"]
    assert skipped["decode"] is graphs["decode"]
    assert_same_generation(graphs, skipped)


def test_unfused_graph_moves_its_norm_math_too(decoder_graphs):  # noqa: F811
    skipped, reports = skip(decoder_graphs)
    moved = [m["op"] for m in reports["prefill"]["moved"]]
    assert moved[:6] == ["MatMul", "Add", "Pow", "ReduceMean", "Add", "Sqrt"], moved  # o_proj, residual, RMSNorm
    assert moved.count("MatMul") == 4  # o_proj, gate, up, down
    assert_same_generation(decoder_graphs, skipped)


def test_int4_matmulnbits_graph_skips_and_generates_the_same(decoder_graphs):  # noqa: F811
    options = quantize.Options(bits=4, block_size=16)
    graphs = {phase: quantize.run(run_passes(model, DEFAULT_RECIPE_PASSES), options)[0]
              for phase, model in decoder_graphs.items()}
    skipped, reports = skip(graphs)
    moved = [m["op"] for m in reports["prefill"]["moved"]]
    assert moved.count("MatMulNBits") == 3, moved
    assert reports["prefill"]["flops_per_skipped_row"] == 2 * (64 * 64 + 64 * 256 + 128 * 64)
    assert_same_generation(graphs, skipped)


def test_prefill_with_every_positions_logits_is_left_alone():
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    prefill = cleanup.run(export_graphs(decoder, MAX_CONTEXT, prefill_logits="all")["prefill"], cleanup.Options())[0]
    result, report = skip_unused_rows.run(prefill, skip_unused_rows.Options())
    assert result is prefill and not report["applied"] and "every position's logits" in report["reason"]


def test_rows_mixed_along_the_sequence_stop_the_move_with_a_reason(decoder_graphs):  # noqa: F811
    """The last residual Add gets a term averaged over the sequence ([B, 1, H]): the selection cannot move above it
    (that tensor has no per-token rows), and the pass says so rather than selecting the wrong rows."""
    model = onnx.ModelProto()
    model.CopyFrom(run_passes(decoder_graphs["prefill"], DEFAULT_RECIPE_PASSES))
    flatten = next(n for n in model.graph.node if n.op_type == "Flatten")
    last = flatten.input[0]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "sequence_axis"))
    model.graph.node.extend([
        onnx.helper.make_node("ReduceMean", [last, "sequence_axis"], ["sequence_mean"], keepdims=1),
        onnx.helper.make_node("Add", [last, "sequence_mean"], ["mixed"])])
    for node in model.graph.node:
        if node.output[0] != "sequence_mean" and node.op_type in ("Flatten", "Shape") and node.input[0] == last:
            node.input[0] = "mixed"
    model = cleanup.run(model, cleanup.Options())[0]  # puts the new nodes in order and infers their shapes
    result, report = skip_unused_rows.run(model, skip_unused_rows.Options())
    assert not report["applied"] and "sequence_mean" in report["reason"], report
    assert result is model


def test_a_recipe_that_quantizes_after_skipping_is_refused():
    with pytest.raises(BuildError, match=r"passes\[1\] \(quantize\) comes after passes\[0\] \(skip_unused_rows\)"):
        check_passes([PassSpec("skip_unused_rows", skip_unused_rows.Options()),
                      PassSpec("quantize", quantize.Options())])


def test_a_graph_without_shapes_is_left_with_the_fix(decoder_graphs):  # noqa: F811
    model = onnx.ModelProto()
    model.CopyFrom(run_passes(decoder_graphs["prefill"], DEFAULT_RECIPE_PASSES))
    del model.graph.value_info[:]  # as before cleanup's shape inference
    result, report = skip_unused_rows.run(model, skip_unused_rows.Options())
    assert not report["applied"] and "run cleanup (shape inference)" in report["reason"], report
    assert result is model


def test_int8_kv_cache_graph_skips_and_generates_the_same():
    """After quantize_kv_cache the prefill graph writes int8 codes after its attention; the rows move above the
    attention's output as before, and logits and the int8 cache stay the same."""
    from tests.passes.test_quantize_kv_cache import calibration_set, run_steps

    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    options = quantize_kv_cache.Options(calibration=calibration_set())
    graphs = {phase: quantize_kv_cache.run(run_passes(cleanup.run(model, cleanup.Options())[0], DEFAULT_RECIPE_PASSES),
                                           options)[0]
              for phase, model in export_graphs(decoder, MAX_CONTEXT).items()}
    skipped, reports = skip(graphs)
    assert [m["op"] for m in reports["prefill"]["moved"]] == POST_ATTENTION
    logits_before, caches_before = run_steps(graphs, np.int8)
    logits_after, caches_after = run_steps(skipped, np.int8)
    for before, after in zip(logits_before + caches_before, logits_after + caches_after):
        np.testing.assert_array_equal(after, before)
