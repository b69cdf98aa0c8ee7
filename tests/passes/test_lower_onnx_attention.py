"""lower_onnx_attention: one hand-built FlashAttention node lowered to opset-23 Attention against the op's numpy
reference, and what max_rewrites leaves; the whole decoder's parity is in tests/passes/test_fuse_attention.py."""
from __future__ import annotations

import numpy as np
import pytest

from passes import flash_attention_op as op
from passes import fuse_attention, lower_onnx_attention
from tests.passes.test_fuse_attention import decoder_graphs, op_counts  # noqa: F401
from tests.passes.test_lower_onnxruntime import decode_inputs, expected_output, flash_attention_model, run_attention


@pytest.mark.parametrize("scale", [0.3, None], ids=["scale-0.3", "no-scale-attribute"])
def test_the_node_scale_or_its_default_reaches_the_output(scale):
    """fuse_attention always writes scale 1/sqrt(head_dim); the op's meaning also allows another one, or none (that
    default; the pass failed with a KeyError on it)."""
    lowered, report = lower_onnx_attention.run(flash_attention_model(scale), lower_onnx_attention.Options())
    assert report["lowered"] == 1
    inputs = decode_inputs()
    np.testing.assert_allclose(run_attention(lowered, inputs), expected_output(inputs, scale), atol=1e-5)


def test_max_rewrites_lowers_the_first_and_only_a_node_left_keeps_the_project_domain(decoder_graphs):  # noqa: F811
    fused = fuse_attention.run(decoder_graphs["decode"], fuse_attention.Options())[0]
    partial, report = lower_onnx_attention.run(fused, lower_onnx_attention.Options(max_rewrites=1))
    assert report["lowered"] == report["left_unlowered"] == 1
    assert op_counts(partial)["Attention"] == op_counts(partial)[op.OP_TYPE] == 1
    assert [o.domain for o in partial.opset_import].count(op.DOMAIN) == 1
    lowered, _ = lower_onnx_attention.run(fused, lower_onnx_attention.Options())
    # nothing reads the domain any more: an importer that does not know it need not resolve it
    assert op.DOMAIN not in {o.domain for o in lowered.opset_import}
