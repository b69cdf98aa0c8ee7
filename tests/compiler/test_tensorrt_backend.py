"""The TensorRT builder's parts that need no TensorRT: recipe checks, optimization profiles, manifest fields.

Building engines needs tensorrt and a GPU: tests/runtime/test_tensorrt_backend.py does that where they exist.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from compiler.backends import tensorrt as tensorrt_backend
from compiler.backends.onnxruntime import io_spec
from compiler.errors import BuildError
from compiler.recipe import load_recipe, parse_recipe
from tests.conftest import REPO
from tests.passes.test_fuse_attention import decoder_graphs  # noqa: F401  (a fixture)

TENSORRT_RECIPE = REPO / "recipes" / "smollm2-135m-tensorrt.yaml"


def recipe_with(passes=None, **export) -> object:
    recipe = load_recipe(TENSORRT_RECIPE)
    data = recipe.to_dict()
    if passes is not None:
        data["passes"] = passes
    data["export"].update(export)
    return parse_recipe(data)


def test_the_tensorrt_recipe_passes_the_checks():
    tensorrt_backend.check_recipe(load_recipe(TENSORRT_RECIPE))


@pytest.mark.parametrize("passes, export, message", [
    (["cleanup", {"fuse_attention": {}}, "lower_onnxruntime"], {}, "lower_onnxruntime emits onnxruntime's"),
    (["cleanup", {"fuse_attention": {}}], {}, "add lower_tensorrt after it"),
    (["cleanup", {"fuse_attention": {}}, "lower_tensorrt", "fuse_rms_norm"], {}, "passes[3]: fuse_rms_norm"),
    (["cleanup", {"quantize": {"bits": 4, "lowering": "dequantize_linear"}}], {}, "quantize.block_size: 32"),
    (["cleanup", {"quantize": {"bits": 4, "block_size": 64}}], {}, "quantize.lowering: 'matmulnbits'"),
    (["cleanup", {"quantize": {"bits": 4, "block_size": 64, "symmetric": False, "lowering": "dequantize_linear"}}],
     {}, "quantize.symmetric: false"),
    (["cleanup", {"quantize": {"bits": 4, "block_size": 64, "lowering": "dequantize_linear",
                               "overrides": [{"pattern": "*down_proj*", "block_size": 32}]}}],
     {}, "quantize.overrides[0].block_size: 32"),
    (["cleanup"], {"dtype": "float32"}, "export.dtype: float32 for backend tensorrt"),
    (["cleanup", {"quantize": {"bits": 4, "block_size": 64, "lowering": "dequantize_linear", "full_range": True}}],
     {}, "quantize.full_range: true gives negative scales"),
    (["cleanup", {"fuse_attention": {}}, {"lower_tensorrt": {"attention": "onnx_attention"}}], {},
     "passes[2].lower_tensorrt.attention: Attention-23 writes the KV cache with ScatterElements"),
    (["cleanup", {"fuse_attention": {}}, "lower_onnx_attention"], {}, "passes[2].lower_onnx_attention: Attention-23"),
    (["cleanup"], {}, "backend tensorrt needs fuse_attention, then lower_tensorrt"),  # was accepted: ScatterElements
    (["cleanup", "fuse_rotary"], {}, "backend tensorrt needs fuse_attention, then lower_tensorrt"),
    (["cleanup", {"fuse_attention": {}}, "lower_tensorrt",  # was refused only inside the pass, after the export
      {"quantize_kv_cache": {"calibration": {"text": "pydoc", "samples": 2, "length": 16, "seed": 0}}}], {},
     "passes[3]: quantize_kv_cache stores onnxruntime's int8 GroupQueryAttention cache"),
    (["cleanup", {"fuse_attention": {}}, "lower_tensorrt", "fuse_silu"], {},
     "passes[3]: fuse_silu emits onnxruntime-only"),
    (["cleanup", {"quantize": {"bits": 4, "block_size": 64, "lowering": "dequantize_linear",
                               "embedding": "quantized"}}],
     {}, "passes[1].quantize.embedding: quantized needs onnxruntime's GatherBlockQuantized"),
    (["cleanup", {"quantize": {"bits": 8, "lowering": "dequantize_linear",  # INT4 layers of an INT8 recipe: block 32
                               "overrides": [{"pattern": "*down_proj*", "bits": 4}]}}],
     {}, "passes[1].quantize.overrides[0].block_size: 32"),
    (["cleanup", {"quantize": {"bits": 4, "block_size": 64, "lowering": "dequantize_linear",
                               "overrides": [{"pattern": "*down_proj*", "symmetric": False}]}}],
     {}, "passes[1].quantize.overrides[0].symmetric: false"),
    # calibration runs the bfloat16 graph on onnxruntime's CPU kernels: it failed after the export, at the first Mul
    (["cleanup", {"quantize": {"bits": 8, "lowering": "dequantize_linear", "method": "gptq",
                               "calibration": {"text": "pydoc", "samples": 2, "length": 16, "seed": 0}}}],
     {"dtype": "bfloat16"}, "passes[1].quantize: method gptq with export.dtype bfloat16: calibration runs"),
])
def test_what_tensorrt_cannot_build_is_refused_with_the_key(passes, export, message):
    with pytest.raises(BuildError) as error:
        tensorrt_backend.check_recipe(recipe_with(passes, **export))
    assert message in str(error.value)


@pytest.mark.parametrize("settings, message", [
    ({"decode_max_tokens": 4096}, "backend.tensorrt.decode_max_tokens: 4096 is more than export.max_context (2048)"),
    ({"timing_cache": ""}, "backend.tensorrt.timing_cache: '' must be a file name relative to the output folder"),
    ({"timing_cache": "."}, "timing_cache: '.' must be a file name"),  # the output folder itself: written after
    ({"timing_cache": "/tmp/x.cache"}, "timing_cache: '/tmp/x.cache' must be a file name"),  # the engine builds
    ({"timing_cache": "../x.cache"}, "timing_cache: '../x.cache' must be a file name"),
])
def test_tensorrt_settings_that_would_fail_after_the_engine_builds_are_refused_first(settings, message):
    data = load_recipe(TENSORRT_RECIPE).to_dict()
    data["export"]["max_context"] = 2048
    data["backend"]["tensorrt"].update(settings)
    with pytest.raises(BuildError, match=re.escape(message)):
        tensorrt_backend.check_recipe(parse_recipe(data))
    data["backend"]["tensorrt"].update(decode_max_tokens=2048, timing_cache="caches/tensorrt-timing.cache")
    tensorrt_backend.check_recipe(parse_recipe(data))  # the largest decode call and a subfolder are fine


@pytest.mark.parametrize("version, plugins, warned", [
    ("11.1.0.3", ["flash_attention"], True), ("11.2.1", ["flash_attention"], True), ("11.2.0", ["flash_attention"], True),
    ("11.4.1", ["flash_attention"], True),  # #4849 is open: no release is known to be fixed
    ("11.0.0", ["flash_attention"], False), ("10.15.1", ["flash_attention"], False), ("11.1.0", [], False),
])
def test_tensorrt_releases_that_leak_plugin_modules_are_named_at_build(version, plugins, warned):
    warning = tensorrt_backend.plugin_leak_warning(version, plugins)
    assert (warning is not None) == warned
    assert warning is None or "NVIDIA/TensorRT#4849" in warning and version in warning


def test_int8_per_channel_and_int4_block_128_are_accepted():
    lowered = ["cleanup", {"fuse_attention": {}}, "lower_tensorrt"]
    tensorrt_backend.check_recipe(recipe_with([*lowered, {"quantize": {"bits": 8, "lowering": "dequantize_linear"}}]))
    tensorrt_backend.check_recipe(recipe_with([*lowered, {"quantize": {
        "bits": 4, "block_size": 128, "lowering": "dequantize_linear"}}]))
    # layers an override keeps float are not quantized at all: its block size is never used
    tensorrt_backend.check_recipe(recipe_with([*lowered, {"quantize": {
        "bits": 4, "block_size": 64, "lowering": "dequantize_linear",
        "overrides": [{"pattern": "*lm_head*", "skip": True, "block_size": 32}]}}]))


@pytest.fixture(scope="module")
def tiny_io():
    """The io spec of the tiny model's exported graphs, as the manifest records it."""
    from compiler.export import export_graphs, kv_cache_spec
    from compiler.frontend import load_model
    from compiler.frontend.model import build_decoder

    recipe = load_recipe(REPO / "recipes" / "tiny-random.yaml")
    loaded = load_model(recipe.model.source, recipe.model.path, recipe.model.config, recipe.model.seed)
    graphs = export_graphs(build_decoder(loaded.config, loaded.state_dict), 64, dtype="float16")
    aliases = kv_cache_spec(loaded.config, 64, "float16")["output_aliases_input"]
    return {phase: io_spec(model, aliases) for phase, model in graphs.items()}, loaded.config


def test_profiles_cover_prompts_decode_steps_and_batches(tiny_io):
    io, config = tiny_io
    spec = replace(load_recipe(TENSORRT_RECIPE).backend.tensorrt, prefill_opt_tokens=512, decode_max_tokens=4)
    profiles = tensorrt_backend.optimization_profiles(io, max_batch=8, max_context=64, spec=spec)
    prefill, decode = profiles["prefill"], profiles["decode"]
    assert prefill["input_ids"] == [[1, 1], [1, 64], [8, 64]]  # opt length capped at max_context
    assert prefill["attention_mask"] == prefill["input_ids"]  # prefill: mask width = prompt length
    assert decode["input_ids"] == [[1, 1], [8, 1], [8, 4]]
    assert decode["attention_mask"] == [[1, 1], [8, 64], [8, 64]]  # a full-width mask is the optimum (CUDA graphs)
    cache = [config.num_kv_heads, 64, config.head_dim]
    assert decode["past_key_values.0.key"] == [[1, *cache], [8, *cache], [8, *cache]]
    assert set(prefill) == set(decode) == {t["name"] for t in io["decode"]["inputs"]}


def test_a_dimension_without_a_range_is_refused(tiny_io):
    io, _ = tiny_io
    odd = {"prefill": {"inputs": [{"name": "input_ids", "shape": ["batch", "beams"]}]}}
    with pytest.raises(BuildError, match="input_ids: dimension 'beams' has no range"):
        tensorrt_backend.optimization_profiles(odd, 1, 64, load_recipe(TENSORRT_RECIPE).backend.tensorrt)
    unnamed = {"decode": {"inputs": [{"name": "attention_mask", "shape": ["batch", 0]}]}}  # a dynamic dim, no name
    with pytest.raises(BuildError, match="attention_mask: dimension 0 has no range"):
        tensorrt_backend.optimization_profiles(unnamed, 1, 64, load_recipe(TENSORRT_RECIPE).backend.tensorrt)


def test_manifest_backend_section_records_what_the_runtime_checks():
    spec = load_recipe(TENSORRT_RECIPE).backend.tensorrt
    section = tensorrt_backend.backend_section("10.13.0.35", "NVIDIA H200", (9, 0), ["flash_attention", "flash_decode"],
                                               spec, Path("artifacts/tensorrt-timing.cache"))
    assert section["name"] == "tensorrt" and section["compute_capability"] == "9.0"
    assert section["plugins"] == ["aotlm::flash_attention", "aotlm::flash_decode"]
    assert section["timing_cache"] == str(Path("artifacts/tensorrt-timing.cache"))
    assert (section["cuda_graphs"], section["decode_max_tokens"]) == (True, 1)
    eager = tensorrt_backend.backend_section("10.13.0.35", "NVIDIA H200", (9, 0), [],
                                             replace(spec, cuda_graphs=False, decode_max_tokens=8), Path("t.cache"))
    assert (eager["cuda_graphs"], eager["decode_max_tokens"], eager["plugins"]) == (False, 8, [])
    from runtime.tensorrt_backend import check_compatible

    check_compatible(section, "10.13.0.35", (9, 0), "NVIDIA H200")  # the machine that built it runs it


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here")
def test_a_build_without_tensorrt_fails_at_once_saying_what_to_install(tmp_path):
    from compiler.build import build

    with pytest.raises(BuildError, match=r"needs the tensorrt package .* install aotlm\[gpu\]"):
        build(load_recipe(TENSORRT_RECIPE), tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype, scale_type", [("float16", "FLOAT16"), ("bfloat16", "BFLOAT16")])
def test_quantized_weights_reach_tensorrt_as_dequantize_linear_in_the_graph_type(dtype, scale_type):
    """Strong typing: DequantizeLinear's output type is its scale's, so the scales must be the graph's type."""
    import onnx

    from compiler.export import export_graphs
    from compiler.frontend import load_model
    from compiler.frontend.model import build_decoder
    from compiler.pipeline import run_pipeline

    recipe = recipe_with(["cleanup", {"fuse_attention": {"required": True}}, "lower_tensorrt", {"quantize": {
        "bits": 4, "block_size": 64, "method": "rtn", "lowering": "dequantize_linear"}}], dtype=dtype)
    tensorrt_backend.check_recipe(recipe)
    tiny = load_recipe(REPO / "recipes" / "tiny-random.yaml").model
    loaded = load_model(tiny.source, tiny.path, tiny.config, tiny.seed)
    graphs = export_graphs(build_decoder(loaded.config, loaded.state_dict), 64, dtype=dtype)
    graphs, results = run_pipeline({"decode": graphs["decode"]}, recipe.passes)
    assert results[-1].report["totals"]["skipped"] == 0
    model = graphs["decode"]
    initializers = {t.name: t for t in model.graph.initializer}
    dequantized = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert len(dequantized) == len(matmuls) == 7 * loaded.config.num_layers + 1  # q k v o gate up down; lm_head
    assert {onnx.TensorProto.DataType.Name(initializers[n.input[1]].data_type) for n in dequantized} == {scale_type}
    assert {onnx.TensorProto.DataType.Name(initializers[n.input[0]].data_type) for n in dequantized} == {"INT4"}
    # blocked even where one block spans K (hidden 64): TensorRT reads INT4 only with per-block scales of 64 / 128
    assert {next(a.i for a in n.attribute if a.name == "block_size") for n in dequantized} == {64}
    tensorrt_backend.check_graphs(graphs)


@pytest.mark.parametrize("codes_type, block, refused", [
    ("int4", 32, "blocks of 32"), ("uint4", 32, "blocks of 32"), ("int4", None, "blocks of a whole axis"),
    ("int4", 64, None), ("int8", None, None),  # INT8 per channel: any block
])
def test_int4_blocks_tensorrt_cannot_read_are_refused_before_the_engine_build(codes_type, block, refused):
    import ml_dtypes
    import onnx

    dtype = {"int4": ml_dtypes.int4, "uint4": ml_dtypes.uint4, "int8": np.int8}[codes_type]
    codes = onnx.numpy_helper.from_array(np.zeros((32, 8), dtype), "w_q4")
    scale = onnx.numpy_helper.from_array(np.ones((1, 8), np.float16), "w_scale")
    blocked = {} if block is None else {"block_size": block}
    node = onnx.helper.make_node("DequantizeLinear", ["w_q4", "w_scale"], ["w"], name="layers.0/down_proj_dq", axis=0,
                                 **blocked)
    graph = onnx.helper.make_graph([node], "decode", [], [onnx.helper.make_tensor_value_info(
        "w", onnx.TensorProto.FLOAT16, [32, 8])], initializer=[codes, scale])
    if refused is None:
        return tensorrt_backend.check_graphs({"decode": onnx.helper.make_model(graph)})
    with pytest.raises(BuildError, match=rf"decode graph, layers.0/down_proj_dq: INT4 weights in {refused}; "
                                         r"TensorRT reads INT4 only in blocks of 64 or 128"):
        tensorrt_backend.check_graphs({"decode": onnx.helper.make_model(graph)})


def test_a_float16_graph_for_onnxruntime_is_refused_before_the_export(tmp_path):
    from compiler.build import build

    data = load_recipe(REPO / "recipes" / "tiny-random.yaml").to_dict()
    data["export"]["dtype"] = "float16"
    with pytest.raises(BuildError, match="export.dtype: 'float16' with backend onnxruntime: .* use float32"):
        build(parse_recipe(data), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_timing_cache_tensorrt_refuses_is_replaced_by_an_empty_one():
    """set_timing_cache returns False for a cache of another TensorRT version or GPU (ignore_mismatch off): its
    return was ignored, and the build went on with no cache attached."""
    class Config:  # IBuilderConfig's two timing-cache calls, refusing any cache made from other bytes than b""
        def __init__(self):
            self.attached = []

        def create_timing_cache(self, data):
            return bytes(data)

        def set_timing_cache(self, cache, ignore_mismatch):
            assert ignore_mismatch is False
            self.attached.append(cache)
            return cache == b""

    said = []
    config = Config()
    tensorrt_backend.attach_timing_cache(config, b"from another GPU", said.append)
    assert config.attached == [b"from another GPU", b""] and "another TensorRT version or GPU" in said[0]
    fresh = Config()
    tensorrt_backend.attach_timing_cache(fresh, b"", said.append)  # a first build: no word
    assert fresh.attached == [b""] and len(said) == 1

    class Unreadable(Config):  # create_timing_cache gives None for bytes it cannot read at all
        def create_timing_cache(self, data):
            return None if data else b""

    unreadable = Unreadable()
    tensorrt_backend.attach_timing_cache(unreadable, b"truncated", said.append)
    assert unreadable.attached == [b""] and "cannot be read; starting an empty one" in said[-1]

    class Refusing(Config):  # not even an empty cache: the build must not go on without one
        def set_timing_cache(self, cache, ignore_mismatch):
            self.attached.append(cache)
            return False

    for cached in (b"", b"from another GPU"):
        refusing = Refusing()
        with pytest.raises(BuildError, match="TensorRT refused an empty timing cache"):
            tensorrt_backend.attach_timing_cache(refusing, cached, said.append)
        assert refusing.attached == ([cached, b""] if cached else [b""])


@pytest.mark.parametrize("kv_heads, max_context, head_dim, refused", [
    (3, 2001, 64, "use a multiple of 2 (2002)"),  # SmolLM2's: a slot 3 x 2001 x 64 x 2 bytes in, not 256-aligned
    (3, 2002, 64, None), (8, 2001, 128, None),  # any max_context fits a head of 128 halves
    (3, 2001, 40, "use a multiple of 16 (2016)"), (3, 2048, 40, None),
])
def test_cache_rows_that_would_put_a_slot_off_tensorrts_alignment_are_refused(kv_heads, max_context, head_dim,
                                                                              refused):
    past = onnx.helper.make_tensor_value_info("past_key_values.0.key", onnx.TensorProto.FLOAT16,
                                              ["batch", kv_heads, max_context, head_dim])
    model = onnx.helper.make_model(onnx.helper.make_graph([], "decode", [past], []))
    if refused is None:
        return tensorrt_backend.check_graphs({"decode": model})
    with pytest.raises(BuildError, match=rf"export.max_context: {max_context}: .* {re.escape(refused)}"):
        tensorrt_backend.check_graphs({"decode": model})


@pytest.mark.parametrize("attention, oldest", [("plugin", "10.15"), ("trt_native", "11.0")])
def test_a_tensorrt_too_old_for_the_lowered_ops_is_refused_before_the_build(decoder_graphs, attention, oldest):
    from passes import fuse_attention, lower_tensorrt

    graphs = {}
    for phase, source in decoder_graphs.items():
        model = onnx.ModelProto()
        model.CopyFrom(source)  # the fixture's graphs are shared with other tests
        model.graph.name = phase
        fused = fuse_attention.run(model, fuse_attention.Options())[0]
        assert tensorrt_backend.plugin_ops(fused) == []  # aotlm.FlashAttention is in the namespace, not a plugin
        graphs[phase] = lower_tensorrt.run(fused, lower_tensorrt.Options(attention=attention))[0]
    plugins = {"plugin": (["flash_attention"], ["flash_combine", "flash_decode"]), "trt_native": ([], [])}[attention]
    assert (tensorrt_backend.plugin_ops(graphs["prefill"]), tensorrt_backend.plugin_ops(graphs["decode"])) == plugins
    older = {"10.15": "10.14.1.48", "11.0": "10.16.0"}[oldest]
    with pytest.raises(BuildError, match=rf"TensorRT {older} cannot read .* need TensorRT {oldest} or newer"):
        tensorrt_backend.check_release(older, graphs)
    tensorrt_backend.check_release(f"{oldest}.0.1", graphs)
    tensorrt_backend.check_release("12.0.0", graphs)


def test_rotary_embedding_in_the_default_domains_alias_needs_the_same_tensorrt():
    """ai.onnx is the default domain's other name: a RotaryEmbedding-23 node written with it is the same op."""
    for domain in ("", "ai.onnx"):
        node = onnx.helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "positions"], ["y"], domain=domain)
        graphs = {"prefill": onnx.helper.make_model(onnx.helper.make_graph([node], "prefill", [], []))}
        with pytest.raises(BuildError, match=r"TensorRT 10.14.1.48 cannot read the graphs' RotaryEmbedding nodes: "
                                             r"they need TensorRT 10.15 or newer"):
            tensorrt_backend.check_release("10.14.1.48", graphs)
        tensorrt_backend.check_release("10.15.0.1", graphs)


def test_the_gpu_extra_installs_what_the_tensorrt_path_needs():
    """The extra allowed tensorrt 10.9, which the lowering's RotaryEmbedding-23 refuses (10.15), and brought no
    torch, which the TensorRT runtime imports for its CUDA buffers."""
    import re
    import tomllib
    from pathlib import Path

    from compiler.backends.tensorrt import OP_RELEASES

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    gpu = project["project"]["optional-dependencies"]["gpu"]
    floor = next(re.fullmatch(r"tensorrt>=(\d+)\.(\d+)", spec) for spec in gpu if spec.startswith("tensorrt"))
    assert (int(floor[1]), int(floor[2])) >= OP_RELEASES[("", "RotaryEmbedding")]
    assert any(spec.startswith("torch") for spec in gpu) and any(spec.startswith("triton") for spec in gpu)


def test_lower_tensorrt_before_fuse_attention_is_refused_by_the_recipe_checks():
    """It found no fused node and left FlashAttention for TensorRT's parser, after the export."""
    from compiler.recipe_checks import check_recipe

    with pytest.raises(BuildError, match="list lower_tensorrt after fuse_attention"):
        check_recipe(recipe_with(["cleanup", "lower_tensorrt", {"fuse_attention": {}}]))


@pytest.mark.parametrize("head_dim, max_context, refused", [
    (24, 256, "take head_dim 16, 32, 64 or 128"), (256, 256, "take head_dim 16, 32, 64 or 128"),
    (64, 2001, "use a multiple of 2 (2002)"), (64, 2002, None),
])
def test_what_the_plugin_path_refuses_after_the_export_is_refused_before_it(head_dim, max_context, refused):
    """`aotlm plan` accepted, and the build found out after the export (minutes on a real model): a head the plugin
    kernels cannot tile, and cache rows off TensorRT's address alignment."""
    from compiler.recipe_checks import check_config_fits

    config = replace(load_recipe(REPO / "recipes" / "tiny-random.yaml").model.config, num_kv_heads=3, num_heads=3,
                     head_dim=head_dim, hidden_size=3 * head_dim, max_position_embeddings=4096)
    recipe = recipe_with(max_context=max_context)
    if refused is None:
        return check_config_fits(config, recipe)
    with pytest.raises(BuildError, match=re.escape(refused)):
        check_config_fits(config, recipe)


def test_a_fused_node_left_in_a_tensorrt_graph_is_refused_before_the_engine_build():
    node = onnx.helper.make_node("FlashAttention", ["q"], ["o"], domain="aotlm", name="layers.0.FlashAttention")
    model = onnx.helper.make_model(onnx.helper.make_graph([node], "prefill", [], []))
    with pytest.raises(BuildError, match="layers.0.FlashAttention: aotlm.FlashAttention is left, which TensorRT"):
        tensorrt_backend.check_graphs({"prefill": model})


def test_two_builds_finishing_together_each_write_a_whole_timing_cache(tmp_path, monkeypatch):
    """The cache went through `.NAME.partial-PID`: two containers' builds (each PID 1) finishing together wrote one
    file, one replace failed after every engine was built, and the other published the first's bytes. Both builds
    here are one process (one PID), and each waits to replace until the other has written. TensorRT is stubbed."""
    import os
    import threading
    import types

    recipe = load_recipe(REPO / "recipes" / "smollm2-135m-tensorrt.yaml")
    trt = types.SimpleNamespace(__version__="10.9.0",
                                Logger=type("Logger", (), {"WARNING": 0, "__init__": lambda self, level: None}))
    cuda = types.SimpleNamespace(get_device_name=lambda: "stub", get_device_capability=lambda: (9, 0))
    monkeypatch.setattr(tensorrt_backend, "_tensorrt", lambda: (trt, types.SimpleNamespace(cuda=cuda)))
    for name, stub in (("check_graphs", lambda graphs: None), ("check_release", lambda version, graphs: None),
                       ("plugin_ops", lambda model: []), ("io_spec", lambda model, aliases: {}),
                       ("optimization_profiles", lambda *args: {"decode": {}})):
        monkeypatch.setattr(tensorrt_backend, name, stub)
    letters = threading.local()
    monkeypatch.setattr(tensorrt_backend, "_build_one", lambda *args: (b"engine", letters.value * 4096))
    both_written, replace = threading.Barrier(2, timeout=10), os.replace

    def replace_once_both_wrote(source, target):
        if str(target).endswith("tensorrt-timing.cache"):
            both_written.wait()
        replace(source, target)

    monkeypatch.setattr(os, "replace", replace_once_both_wrote)
    graph = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    failures = []

    def build(letter: bytes) -> None:
        letters.value = letter
        staging = tmp_path / f"staging-{letter.decode()}"
        staging.mkdir()
        try:
            tensorrt_backend.write_engines({"decode": graph}, staging, recipe, {}, tmp_path, lambda line: None)
        except Exception as error:  # noqa: BLE001 -- what the test reports
            failures.append(error)

    threads = [threading.Thread(target=build, args=(letter,)) for letter in (b"A", b"B")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cache = (tmp_path / recipe.backend.tensorrt.timing_cache).read_bytes()
    assert not failures and cache in (b"A" * 4096, b"B" * 4096)
    from runtime.results import process_umask  # shared as open() would make it, not mkstemp's private 0600

    assert (tmp_path / recipe.backend.tensorrt.timing_cache).stat().st_mode & 0o777 == 0o666 & ~process_umask()
    assert sorted(path.name for path in tmp_path.iterdir() if path.is_file()) == ["tensorrt-timing.cache"]
