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
    from compiler.pipeline import check_passes

    recipe = quantization.variant_recipe(name)
    assert recipe.name == f"bench-{name}" and not recipe.accuracy.enabled
    check_passes(recipe.passes)  # what the build checks before its export: a refused variant failed minutes into a run
    settings = json.loads(json.dumps(quantization.variant_settings(name)))
    quantize = next((p.options for p in recipe.passes if p.name == "quantize"), None)
    for key, value in settings["quantize"].items():  # what the JSON says is what the recipe builds
        built = getattr(quantize, key)
        assert (value == [dict(vars(o)) for o in built]) if key == "overrides" else value == built


def test_paired_ratio_divides_each_repeat_by_the_same_repeat_of_the_reference():
    runs = [{"tpot_ms": 2.0}, {"tpot_ms": 4.0}, {"tpot_ms": 9.0}]
    reference = [{"tpot_ms": 1.0}, {"tpot_ms": 4.0}, {"tpot_ms": 3.0}]  # medians 4 / 3 would say 1.33x
    assert quantization.paired_ratio(runs, reference, "tpot_ms") == 2.0  # ratios 2, 1, 3
    with pytest.raises(ValueError):  # a repeat missing on one side: no pairing
        quantization.paired_ratio(runs[:2], reference, "tpot_ms")


@pytest.mark.parametrize("block", [64, 128])
def test_the_int8_cache_variants_are_what_their_names_say(block):
    recipe = quantization.variant_recipe(f"int4-awq_gptq_act-b{block}-head32-kv8")
    names = [p.name for p in recipe.passes]
    assert names.index("quantize") < names.index("quantize_kv_cache")
    (quantize,) = (p.options for p in recipe.passes if p.name == "quantize")
    assert (quantize.bits, quantize.block_size, quantize.method, quantize.gptq_act_order) == (4, block, "awq_gptq", True)
    assert [(o.pattern, o.block_size) for o in quantize.overrides] == [("model.embed_tokens.weight", 32)]
    # the same as its float-cache twin but for the cache pass
    twin = quantization.variant_recipe(f"int4-awq_gptq_act-b{block}-head32")
    assert [p for p in recipe.passes if p.name != "quantize_kv_cache"] == list(twin.passes)


def test_out_is_a_path_and_a_bare_name_goes_under_results(tmp_path):
    assert quantization.out_path("q.json") == REPO / "benchmarks" / "results" / "q.json"
    assert quantization.out_path(str(tmp_path / "q.json")) == tmp_path / "q.json"
    assert quantization.out_path("benchmarks/results/q.json").as_posix() == "benchmarks/results/q.json"  # not nested


@pytest.mark.parametrize("flags, message", [
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--eval-tokens", "0"], "--eval-tokens must be >= 2"),
    (["--window", "1"], "--window/--stride: window must be >= 2 tokens"),
    (["--stride", "600"], "--window/--stride: stride must be between 1 and the window (512)"),
])
def test_bad_sizes_are_refused_before_any_variant_is_built(flags, message, capsys, monkeypatch):
    """They failed after every build and all the timing (an IndexError, a ZeroDivisionError)."""
    monkeypatch.setattr(quantization, "built", lambda *a: pytest.fail("built before the arguments were checked"))
    with pytest.raises(SystemExit) as stopped:
        quantization.main(["--variants", "fp32", "--no-genai", *flags])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("builds", ["onnxruntime-genai-int4-b128", "onnxruntime-genai-int4,onnxruntime-genai-int8"])
def test_genai_builds_are_checked_before_any_build(builds, monkeypatch, capsys):
    """The ratios' reference is genai's default int4 build: a list without it, or a build genai is not asked for,
    is refused before minutes of builds."""
    monkeypatch.setattr(quantization, "built", lambda *a: pytest.fail("built before checking --genai-builds"))
    with pytest.raises(SystemExit) as stopped:
        quantization.main(["--variants", "fp32", "--genai-builds", builds])
    error = capsys.readouterr().err
    assert stopped.value.code == 2 and "--genai-builds: from onnxruntime-genai-int4, onnxruntime-genai-int4-b128" in error
