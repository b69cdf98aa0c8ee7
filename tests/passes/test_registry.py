"""passes/registry.py: each recipe name maps to its own module's run, Options and option check."""
from __future__ import annotations

import importlib

import pytest

from passes.registry import PASSES

# The passes whose options can be refused before any graph exists, and the function that does it.
OPTION_CHECKS = {"dequantize_weights": "check_options", "pack_projections": "check_options",
                 "quantize": "check_options", "quantize_kv_cache": "check_settings",
                 "slice_packed_weights": "check_options"}


def test_the_table_lists_every_pass():
    assert sorted(PASSES) == ["cleanup", "dequantize_weights", "fuse_attention", "fuse_rms_norm", "fuse_rotary",
                              "fuse_silu", "lower_onnx_attention", "lower_onnxruntime", "lower_tensorrt",
                              "pack_projections", "quantize", "quantize_kv_cache", "skip_unused_rows",
                              "slice_packed_weights"]


@pytest.mark.parametrize("name", sorted(PASSES))
def test_each_name_runs_its_own_module_with_its_options_and_check(name):
    module = importlib.import_module(f"passes.{name}")
    entry = PASSES[name]
    assert entry.run is module.run and entry.options_type is module.Options
    assert entry.check is (getattr(module, OPTION_CHECKS[name]) if name in OPTION_CHECKS else None)
    assert entry.summary.strip()


def test_only_quantize_asks_for_the_decode_graph_first():
    """quantize calibrates on decode's graph (its lm_head reads every token's hidden state) and shares the result."""
    assert {name: entry.runs_first_on for name, entry in PASSES.items() if entry.runs_first_on} == {
        "quantize": ("decode",)}
