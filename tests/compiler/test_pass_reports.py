"""compiler/pass_reports.py: which listed passes changed nothing, and why."""
from __future__ import annotations

from compiler.pass_reports import PassResult, idle_passes, partly_fused


def test_a_pass_that_changed_nothing_in_any_phase_is_named_with_its_first_reason():
    """The build's table shows node counts only, which cannot tell "nothing to do" from "done" (a lowering keeps the
    count): a fuse_attention that fused no layer, or a second lowering, passed in silence."""
    unfused = {"fused": 0, "layers": [{"layer": "layers.0", "fused": False, "reason": "no projection MatMul"}]}
    results = [PassResult("fuse_attention", phase, 0.1, unfused, 10, 10, index=1) for phase in ("prefill", "decode")]
    results += [PassResult("lower_onnxruntime", phase, 0.1, {"lowered": 0}, 10, 10, index=2)
                for phase in ("prefill", "decode")]
    # one phase's work is enough, and a phase its `phases` option leaves out does not count as idle
    results += [PassResult("skip_unused_rows", "prefill", 0.1, {"applied": True}, 10, 12, index=3),
                PassResult("skip_unused_rows", "decode", 0.0, {"applied": False, "reason": "no row selection"}, 9, 9,
                           index=3),
                PassResult("slice_packed_weights", "prefill", 0.1, {"applied": True}, 10, 12, index=4),
                PassResult("slice_packed_weights", "decode", 0.0,
                           {"applied": False, "reason": "runs on prefill only (its phases option)"}, 9, 9, index=4),
                PassResult("cleanup", "prefill", 0.1, {}, 10, 10, index=0)]
    assert idle_passes(results) == [
        "passes[1] (fuse_attention) changed nothing in prefill, decode: layers.0: no projection MatMul",
        "passes[2] (lower_onnxruntime) changed nothing in prefill, decode: no aotlm.FlashAttention node left to lower "
        "(none fused before it, or an earlier lowering took them)"]
    # the same pass listed twice: each listing on its own
    twice = [PassResult("fuse_rms_norm", "decode", 0.1, {"fused": 3}, 10, 7, index=5),
             PassResult("fuse_rms_norm", "decode", 0.1, {"fused": 0, "skipped": []}, 7, 7, index=6)]
    assert idle_passes(twice) == ["passes[6] (fuse_rms_norm) changed nothing in decode: no RMSNorm left to fuse (an "
                                  "earlier fuse_rms_norm took them, or the graph has none)"]  # with a reason, as said


def test_attention_fused_in_some_layers_only_is_named_with_the_first_left():
    """Without `required: true` a build that fused 1 of 2 layers said nothing on its console (the manifest knew)."""
    layers = [{"layer": "layers.0", "fused": True}, {"layer": "layers.1", "fused": False, "reason": "max_rewrites=1"}]
    partial = {"fused": 1, "unfused": 1, "layers": layers}
    results = [PassResult("fuse_attention", "decode", 0.1, partial, 10, 8, index=1),
               PassResult("fuse_attention", "prefill", 0.1, {"fused": 2, "unfused": 0, "layers": []}, 10, 6, index=1),
               PassResult("fuse_attention", "prefill", 0.1, {"fused": 0, "unfused": 2, "layers": []}, 10, 10, index=4)]
    assert partly_fused(results) == [
        "passes[1] (fuse_attention) left 1 of 2 attention blocks unfused in decode; first: layers.1: max_rewrites=1 "
        "(`required: true` makes this an error)"]  # none fused at all is idle_passes' line, not this one
