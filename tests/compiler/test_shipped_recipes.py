"""Every recipe under recipes/ passes the checks a build makes before its slow work, and builds into a folder named
after its file (two recipes with one name would overwrite each other's artifact)."""
from __future__ import annotations

from pathlib import Path

import pytest

from compiler.backends import onnxruntime as onnxruntime_backend
from compiler.backends import tensorrt as tensorrt_backend
from compiler.pipeline import check_passes
from compiler.recipe import load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_the_shipped_recipes_are_found():
    assert len(RECIPES) >= 10 and {"smollm2-135m", "smollm2-135m-int8", "smollm2-135m-int8-rtn"} <= {
        path.stem for path in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_a_shipped_recipe_passes_the_checks_before_the_export(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    check_passes(recipe.passes)
    backend = {"onnxruntime": onnxruntime_backend, "tensorrt": tensorrt_backend}[recipe.backend.name]
    backend.check_recipe(recipe)
