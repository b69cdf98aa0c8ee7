"""README's table of every recipe key is the code's (compiler/recipe_reference.py), so a key added to a section or a
pass's Options is documented where users look: a review found a dozen keys accepted and unsaid."""
from __future__ import annotations

import dataclasses

from compiler.recipe_reference import END, START, table
from passes.registry import PASSES
from tests.conftest import REPO


def test_the_readme_holds_the_table_the_code_makes():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    held = readme.split(START, 1)[1].split(END, 1)[0].strip()
    assert held == table(), "README.md's recipe keys are stale: run python -m compiler.recipe_reference and paste it"


def test_the_table_lists_every_pass_option_and_a_parts_own_defaults():
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[3].strip() for line in table().splitlines()[2:]}
    for name, entry in PASSES.items():
        for field in dataclasses.fields(entry.options_type):
            assert f"{name}.{field.name}" in rows, (name, field.name)
    assert rows["quantize_kv_cache.calibration.samples"] == "16" and rows["quantize.calibration.samples"] == "64"
    assert rows["quantize.overrides[].pattern"] == "required"
