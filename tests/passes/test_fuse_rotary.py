"""fuse_rotary: RotaryEmbedding counts, the skip report, and onnxruntime parity with the unfused graphs.

Graphs: the canonical decoder's prefill/decode export (position_ids is a graph input), and Hugging Face's
traced Llama (positions computed inside the graph, batch 1, no cache) for the fallback paths.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from passes import fuse_rotary
from tests.passes.test_fuse_attention import (CONFIG, decoder_graphs, generate_logits, hf_traced,  # noqa: F401 (fixtures)
                                              op_counts)

ROTARIES = 2 * CONFIG.num_layers  # q and k in every layer


def test_every_rotary_becomes_one_rotary_embedding(decoder_graphs):  # noqa: F811
    fused = {}
    for phase, model in decoder_graphs.items():
        fused[phase], report = fuse_rotary.run(model, fuse_rotary.Options())
        assert report["rewrites"] == ROTARIES and report["skipped"] == [], (phase, report)
        counts = op_counts(fused[phase])
        assert counts["RotaryEmbedding"] == ROTARIES
        # The Cos/Sin tables were read only by the rotaries, so they go with them; no Neg anywhere else.
        assert counts["Neg"] == counts["Cos"] == counts["Sin"] == 0, (phase, counts)
        assert report["nodes"]["after"] < report["nodes"]["before"]
        assert fused[phase].ir_version >= 10 and {o.domain: o.version for o in fused[phase].opset_import}[""] >= 23
        onnx.checker.check_model(fused[phase])
    for reference, result in zip(generate_logits(decoder_graphs), generate_logits(fused)):
        np.testing.assert_allclose(result, reference, atol=1e-5)


def test_max_rewrites_fuses_only_the_first(decoder_graphs):  # noqa: F811
    fused, report = fuse_rotary.run(decoder_graphs["decode"], fuse_rotary.Options(max_rewrites=1))
    assert report["rewrites"] == 1 and op_counts(fused)["RotaryEmbedding"] == 1
    assert [s["reason"] for s in report["skipped"]] == ["max_rewrites=1"] * (ROTARIES - 1)
    assert op_counts(fused)["Cos"] == 1  # still read by the three unfused rotaries


def swap_rotate_half(model: onnx.ModelProto) -> onnx.ModelProto:
    """Concat(Neg(t2), t1) -> Concat(t1, Neg(t2)) in layer 1's first rotary: no longer a rotation."""
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    concat = next(n for n in broken.graph.node if n.op_type == "Concat" and "layers.1" in n.name
                  and any(p.op_type == "Neg" and p.output[0] == n.input[0] for p in broken.graph.node))
    concat.input[0], concat.input[1] = concat.input[1], concat.input[0]
    return broken


def test_a_swapped_rotate_half_is_skipped_with_a_reason(decoder_graphs):  # noqa: F811
    broken = {phase: swap_rotate_half(model) for phase, model in decoder_graphs.items()}
    fused = {}
    for phase, model in broken.items():
        before = model.SerializeToString()
        fused[phase], report = fuse_rotary.run(model, fuse_rotary.Options())
        assert model.SerializeToString() == before  # pure
        assert report["rewrites"] == ROTARIES - 1 and len(report["skipped"]) == 1, report
        assert report["skipped"][0]["layer"] == "layers.1" and "rotate-half" in report["skipped"][0]["reason"]
        assert op_counts(fused[phase])["Neg"] == 1
    for reference, result in zip(generate_logits(broken), generate_logits(fused)):
        np.testing.assert_allclose(result, reference, atol=1e-5)


def test_hugging_face_positions_are_found_under_cos(hf_traced):  # noqa: F811
    model, ids, mask, expected = hf_traced
    _, report = fuse_rotary.run(model, fuse_rotary.Options())
    assert report["rewrites"] == 0 and "rotary_cache_length" in report["skipped"][0]["reason"]  # no KV cache input
    fused, report = fuse_rotary.run(model, fuse_rotary.Options(rotary_cache_length=128))
    assert report["rewrites"] == ROTARIES and op_counts(fused)["RotaryEmbedding"] == ROTARIES
    session = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"input_ids": ids, "attention_mask": mask})[0], expected, atol=1e-5)
