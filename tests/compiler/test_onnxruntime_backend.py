"""The onnxruntime backend's build (compiler/backends/onnxruntime.py): pass orders refused before the export, one
shared page-aligned weights file, and the manifest's engines and backend sections.

End-to-end builds of the tiny model are in tests/compiler/test_build.py; these use graphs made by hand."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.backends import onnxruntime as onnxruntime_backend
from compiler.errors import BuildError
from compiler.recipe import BackendSpec, load_recipe, parse_recipe
from tests.conftest import TINY_RECIPE


def recipe_with(passes):
    data = load_recipe(TINY_RECIPE).to_dict()
    data["passes"] = passes
    return parse_recipe(data)


@pytest.mark.parametrize("passes, refused", [
    (["cleanup", "fuse_attention", "lower_onnxruntime"], None),
    (["cleanup", "fuse_attention", "lower_onnx_attention"], None),  # the portable lowering runs on onnxruntime too
    (["cleanup", "fuse_attention", "lower_onnxruntime", "fuse_attention"], "passes[3]: fuse_attention leaves"),
    (["cleanup", "fuse_attention", "lower_onnxruntime", "quantize_kv_cache"], None),
    # a lowering limited to some layers leaves FlashAttention nodes: the build failed at its end, naming the pass the
    # recipe had (and one it did not have, for lower_onnx_attention)
    (["cleanup", "fuse_attention", {"lower_onnxruntime": {"max_rewrites": 1}}],
     "passes[2].lower_onnxruntime.max_rewrites: a FlashAttention node it leaves unlowered"),
    (["cleanup", "fuse_attention", {"lower_onnx_attention": {"max_rewrites": 1}}],
     "passes[2].lower_onnx_attention.max_rewrites"),
    (["cleanup", {"fuse_attention": {"max_rewrites": 1}}, "lower_onnxruntime"], None),  # the way to bisect
])
def test_the_last_fusion_needs_a_lowering_after_it(passes, refused):
    recipe = recipe_with(passes)
    if refused is None:
        onnxruntime_backend.check_recipe(recipe)  # accepted: no error
        return
    with pytest.raises(BuildError, match=refused.replace("[", r"\[").replace("]", r"\]")):
        onnxruntime_backend.check_recipe(recipe)


def _array(values: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(values).astype(np.float32)


def _graph(name: str, initializers: dict[str, np.ndarray]) -> onnx.ModelProto:
    """x + each initializer in turn; a KV-cache pair (past in, present out) beside it, through an op written in the
    default domain's other name (ai.onnx). An initializer named *_listed holds its values in float_data, not raw."""
    nodes, last = [], "x"
    for number, weight in enumerate(initializers):
        nodes.append(helper.make_node("Add", [last, weight], [f"sum{number}"]))
        last = f"sum{number}"
    nodes.append(helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], domain="ai.onnx"))
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1]),
         helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, ["batch", 2, 8, 4])],
        [helper.make_tensor_value_info(last, TensorProto.FLOAT, ["batch", None]),
         helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, ["batch", 2, 8, 4])],
        [helper.make_tensor(weight, TensorProto.FLOAT, [1, array.size], array.tolist()) if weight.endswith("_listed")
         else numpy_helper.from_array(array.reshape(1, -1), weight) for weight, array in initializers.items()])
    return helper.make_model(graph)


def test_weights_are_written_once_each_on_a_page_boundary_and_small_ones_stay_inline(tmp_path):
    """Keyed by content: a tensor both graphs hold (under other names) is stored once; the exporter's val_N names,
    reused across graphs for other values, are not taken for the same tensor. Exactly INLINE_LIMIT_BYTES goes out."""
    shared, at_limit, small = _array(2000, 0), _array(256, 1), _array(255, 2)  # 8000, 1024 and 1020 bytes
    assert at_limit.nbytes == onnxruntime_backend.INLINE_LIMIT_BYTES
    contents = {
        "decode": {"w": shared, "val_1": at_limit, "tiny": small},
        "prefill": {"w_prefill": shared, "val_1": _array(300, 3),  # same name as decode's val_1, other content
                    "b_listed": _array(512, 4)},
    }
    graphs = {phase: _graph(phase, arrays) for phase, arrays in contents.items()}
    spec = BackendSpec(intra_op_threads=2, graph_optimization_level="basic")
    written = onnxruntime_backend.write_engines(graphs, tmp_path, spec, {"present.0.key": "past_key_values.0.key"})

    weights = tmp_path / onnxruntime_backend.WEIGHTS_FILE
    # decode's w at 0 (8000 bytes), its val_1 at 8192 (1024), prefill's val_1 at 12288 (1200), b_listed at 16384
    # (2048); w_prefill is w's copy
    assert weights.stat().st_size == 16384 + 2048
    assert written["backend"] == {
        "name": "onnxruntime", "version": written["backend"]["version"],
        "session": {"intra_op_threads": 2, "graph_optimization_level": "basic"},
        "weights": {"file": "weights.bin", "bytes": 16384 + 2048, "shared_by": ["decode", "prefill"]},
    }
    placed = {}
    for phase in contents:
        stored = onnx.load(tmp_path / f"{phase}.onnx", load_external_data=False)
        for tensor in stored.graph.initializer:
            location = {entry.key: entry.value for entry in tensor.external_data}
            placed[phase, tensor.name] = (int(location["offset"]), int(location["length"])) if location else None
        loaded = {t.name: numpy_helper.to_array(t).ravel()
                  for t in onnx.load(tmp_path / f"{phase}.onnx").graph.initializer}
        assert set(loaded) == set(contents[phase])
        for name, array in contents[phase].items():
            np.testing.assert_array_equal(loaded[name], array)
    assert placed == {("decode", "w"): (0, 8000), ("decode", "val_1"): (8192, 1024), ("decode", "tiny"): None,
                      ("prefill", "w_prefill"): (0, 8000), ("prefill", "val_1"): (12288, 1200),
                      ("prefill", "b_listed"): (16384, 2048)}
    assert not any(stored.float_data for stored in onnx.load(tmp_path / "prefill.onnx", load_external_data=False)
                   .graph.initializer)  # its values are in weights.bin alone


def test_the_engines_record_their_io_and_which_outputs_alias_the_cache(tmp_path):
    graphs = {"decode": _graph("decode", {"w": _array(300, 0)})}
    engines = onnxruntime_backend.write_engines(graphs, tmp_path, BackendSpec(),
                                                {"present.0.key": "past_key_values.0.key"})["engines"]
    assert engines == {"decode": {  # no session_config: no pass recorded one in this graph
        "file": "decode.onnx", "backend": "onnxruntime",
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 1], "kv_cache": False},
                   {"name": "past_key_values.0.key", "dtype": "float32", "shape": ["batch", 2, 8, 4],
                    "kv_cache": True}],
        "outputs": [{"name": "sum0", "dtype": "float32", "shape": ["batch", 0], "aliases": None},
                    {"name": "present.0.key", "dtype": "float32", "shape": ["batch", 2, 8, 4],
                     "aliases": "past_key_values.0.key"}],
    }}
    written = onnx.load(tmp_path / "decode.onnx", load_external_data=False)  # opened alone, it names its maker
    assert (written.producer_name, {prop.key: prop.value for prop in written.metadata_props}) == (
        "aotlm", {"aotlm.phase": "decode"})
    assert "manifest.json" in written.doc_string


def _attention_graph(layers: int, reads, domain: str = "com.microsoft") -> onnx.ModelProto:
    """`layers` GroupQueryAttention nodes; layer i reads reads(i) as its past key and value (inputs 3 and 4)."""
    nodes = [helper.make_node("GroupQueryAttention", ["q", "k", "v", *reads(i)], [f"out{i}"], domain=domain)
             for i in range(layers)]
    return helper.make_model(helper.make_graph(nodes, "prefill", [], []))


def test_a_prefill_takes_a_past_only_when_every_layers_attention_reads_the_cache_inputs():
    aliases = {f"present.{i}.{kind}": f"past_key_values.{i}.{kind}" for i in range(2) for kind in ("key", "value")}
    own = lambda i: [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]  # noqa: E731
    assert onnxruntime_backend.takes_past(_attention_graph(2, own), aliases)
    assert not onnxruntime_backend.takes_past(_attention_graph(2, own, domain="aotlm"), aliases)  # not onnxruntime's
    assert not onnxruntime_backend.takes_past(_attention_graph(1, own), aliases)  # a layer without attention to a past
    assert not onnxruntime_backend.takes_past(_attention_graph(3, lambda i: own(i % 2)), aliases)  # not one per layer
    assert not onnxruntime_backend.takes_past(  # keys from the cache, values from a float copy (int8 cache's prefill)
        _attention_graph(2, lambda i: [f"past_key_values.{i}.key", f"float_past.{i}.value"]), aliases)
    assert not onnxruntime_backend.takes_past(_attention_graph(0, own), {})  # unfused: attends to its own tokens


def test_a_build_with_too_old_an_onnxruntime_is_refused_before_the_export(monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "__version__", "1.20.0")
    with pytest.raises(BuildError, match="onnxruntime 1.20.0 is installed; aotlm's graphs need 1.23"):
        onnxruntime_backend.check_recipe(SimpleNamespace(passes=[]))
    monkeypatch.setattr(onnxruntime, "__version__", "1.25.0")  # the int8 cache's inputs came in 1.27
    with pytest.raises(BuildError, match="an int8 KV cache .* needs 1.27 or later"):
        onnxruntime_backend.check_recipe(SimpleNamespace(passes=[SimpleNamespace(name="quantize_kv_cache")]))
    onnxruntime_backend.check_recipe(SimpleNamespace(passes=[SimpleNamespace(name="cleanup", options=None)]))
