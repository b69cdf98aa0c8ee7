"""compiler/recipe_checks.py: what the build (and `aotlm plan`) refuses once the model's config is known."""
from __future__ import annotations

import dataclasses

import pytest

from compiler.errors import BuildError
from compiler.recipe import load_recipe
from compiler.recipe_checks import check_config_fits
from tests.conftest import TINY_RECIPE

RECIPE = load_recipe(TINY_RECIPE)  # cleanup, fuse_attention, lower_onnxruntime, ...; max_context 128
CONFIG = RECIPE.model.config


def with_passes(*names: str):
    return dataclasses.replace(RECIPE, passes=tuple(spec for spec in RECIPE.passes if spec.name in names))


def test_a_head_dim_groupqueryattention_cannot_take_is_refused_only_where_a_fused_node_is_lowered():
    narrow = dataclasses.replace(CONFIG, head_dim=8)
    with pytest.raises(BuildError, match="needs a head_dim that is a multiple of 16, and this model's is 8"):
        check_config_fits(narrow, RECIPE)
    check_config_fits(dataclasses.replace(CONFIG, head_dim=32), RECIPE)
    # lower_onnxruntime with no fuse_attention before it lowers nothing: nothing to refuse
    check_config_fits(narrow, with_passes("cleanup", "lower_onnxruntime"))
    check_config_fits(narrow, with_passes("cleanup", "fuse_attention"))  # left unlowered: the pass order's business


def test_the_context_must_fit_the_models_window_and_positions():
    with pytest.raises(BuildError, match="sliding window of 64 tokens .* set export.max_context to 64 or less"):
        check_config_fits(dataclasses.replace(CONFIG, sliding_window=64), RECIPE)
    check_config_fits(dataclasses.replace(CONFIG, sliding_window=128), RECIPE)
    with pytest.raises(BuildError, match=r"export.max_context: 128 exceeds the model's max_position_embeddings \(100\)"):
        check_config_fits(dataclasses.replace(CONFIG, max_position_embeddings=100), RECIPE)
    check_config_fits(dataclasses.replace(CONFIG, max_position_embeddings=128), RECIPE)  # the whole context: fits


def test_a_calibration_window_of_the_whole_context_is_accepted():
    from compiler.recipe import parse_recipe
    from compiler.recipe_checks import check_recipe

    data = RECIPE.to_dict()
    data["passes"] = [*data["passes"][:-1], {"quantize": {"method": "awq", "calibration": {"samples": 1,
                                                                                         "length": 128}}}]
    check_recipe(parse_recipe(data))  # calibration.length == export.max_context
    data["passes"][-1]["quantize"]["calibration"]["length"] = 129
    with pytest.raises(BuildError, match="calibration.length 129 exceeds export.max_context"):
        check_recipe(parse_recipe(data))
