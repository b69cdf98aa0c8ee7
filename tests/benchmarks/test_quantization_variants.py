"""benchmarks/quantization.py's variant table: every variant resolves to a valid recipe, and the settings the
benchmark writes into its JSON serialize (a variant with per-layer overrides once broke the write)."""
from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import quantization  # noqa: E402


@pytest.mark.parametrize("name", list(quantization.VARIANTS))
def test_each_variant_is_a_recipe_whose_settings_serialize(name):
    recipe = quantization.variant_recipe(name)
    assert recipe.name == f"bench-{name}" and not recipe.accuracy.enabled
    settings = json.loads(json.dumps(quantization.variant_settings(name)))
    quantize = next((p.options for p in recipe.passes if p.name == "quantize"), None)
    for key, value in settings["quantize"].items():  # what the JSON says is what the recipe builds
        built = getattr(quantize, key)
        assert (value == [dict(vars(o)) for o in built]) if key == "overrides" else value == built
