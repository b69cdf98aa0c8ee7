"""Tests for compiler/recipe.py: shipped recipes, defaults, round-trip, and the one-line errors."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from compiler.errors import RecipeError
from compiler.frontend.config import DecoderConfig
from compiler.recipe import BackendSpec, ExportSpec, PassSpec, Recipe, ignored_settings, load_recipe, parse_recipe
from passes import (cleanup, fuse_attention, fuse_rms_norm, fuse_silu, lower_onnxruntime, pack_projections,
                    skip_unused_rows, slice_packed_weights)

REPO = Path(__file__).resolve().parents[2]

TINY_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16)


def gguf(**sections) -> dict:
    return {"name": "x", "model": {"source": "gguf"}, **sections}


def random_model(**config) -> dict:
    return {"name": "x", "model": {"source": "random", "config": {**TINY_CONFIG, **config}}}


def error_of(data, origin="<dict>") -> str:
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, origin=origin)
    message = str(info.value)
    assert message.startswith(f"{origin}: ") and "\n" not in message
    return message


# --- shipped recipes --------------------------------------------------------------------------------

def test_smollm2_recipe():
    r = load_recipe(REPO / "recipes/smollm2-135m.yaml")
    assert r.name == "smollm2-135m"
    assert (r.model.source, r.model.path, r.model.config) == ("gguf", None, None)
    assert r.export == ExportSpec(max_context=2048, dtype="float32", opset=21, prefill_logits="last", max_batch=1)
    assert r.passes == (PassSpec("cleanup", cleanup.Options()),
                        PassSpec("fuse_attention", fuse_attention.Options(required=True)),
                        PassSpec("lower_onnxruntime", lower_onnxruntime.Options()),
                        PassSpec("fuse_rms_norm", fuse_rms_norm.Options()),
                        PassSpec("fuse_silu", fuse_silu.Options()),
                        PassSpec("pack_projections", pack_projections.Options()),
                        PassSpec("skip_unused_rows", skip_unused_rows.Options()),
                        PassSpec("slice_packed_weights", slice_packed_weights.Options(phases=("prefill",))))
    assert r.backend == BackendSpec(name="onnxruntime", intra_op_threads=0, graph_optimization_level="all")


def test_tiny_random_recipe():
    r = load_recipe(REPO / "recipes/tiny-random.yaml")
    assert r.name == "tiny-random"
    assert r.model.source == "random" and r.model.path is None and r.model.seed == 0
    assert r.model.config == DecoderConfig(**TINY_CONFIG, rope_theta=10000.0, rms_norm_eps=1e-5,
                                           tie_word_embeddings=False, max_position_embeddings=256,
                                           bos_token_id=1, eos_token_ids=(2,))
    assert r.export.max_context == 128
    assert [p.name for p in r.passes] == ["cleanup", "fuse_attention", "lower_onnxruntime", "fuse_rms_norm",
                                            "fuse_silu", "pack_projections", "skip_unused_rows"]


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-random"])
def test_shipped_recipes_round_trip(name):
    r = load_recipe(REPO / f"recipes/{name}.yaml")
    d = json.loads(json.dumps(r.to_dict()))  # what the manifest stores
    assert parse_recipe(d) == r


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_set_nothing_their_backend_ignores(path):
    assert ignored_settings(load_recipe(path)) == []


@pytest.mark.parametrize("sections, expected", [
    ({"backend": {"tensorrt": {"workspace_gib": 16, "cuda_graphs": False}}},
     ["backend.tensorrt (workspace_gib, cuda_graphs): applies to backend tensorrt only; this recipe builds for "
      "onnxruntime"]),
    ({"export": {"max_batch": 8}},
     ["export.max_batch: 8 bounds TensorRT's optimization profiles; onnxruntime's engines take any number of "
      "sequences per step, so it has no effect"]),
    ({"backend": {"name": "tensorrt", "intra_op_threads": 2, "tensorrt": {"workspace_gib": 16}},
      "export": {"max_batch": 8}},
     ["backend.intra_op_threads: 2 is an onnxruntime session setting; backend tensorrt never reads it"]),
    ({"backend": {"tensorrt": {"workspace_gib": 8}}, "export": {"max_batch": 1}}, []),  # the defaults, spelled out
])
def test_settings_the_backend_never_reads_are_named(sections, expected):
    recipe = parse_recipe(gguf(**sections))
    assert ignored_settings(recipe) == expected
    assert ignored_settings(parse_recipe(json.loads(json.dumps(recipe.to_dict())))) == expected  # a manifest's copy


# --- defaults and values ----------------------------------------------------------------------------

def test_defaults_filled():
    r = parse_recipe(gguf())
    assert r == Recipe(name="x", model=r.model)
    assert r.export == ExportSpec(2048, "float32", 21, "last", 1)
    assert r.backend == BackendSpec("onnxruntime", 0, "all")
    assert (r.accuracy.enabled, r.accuracy.max_tokens, r.accuracy.window, r.accuracy.stride) == (True, 4096, 512, None)
    # no stride: window / 2, as `aotlm eval`'s default
    assert parse_recipe(gguf(accuracy={"window": 64, "stride": 64})).accuracy.stride == 64  # a stride of a window
    assert r.passes == (PassSpec("cleanup", cleanup.Options()),)
    d = r.to_dict()
    assert d["model"] == {"source": "gguf", "path": None, "config": None, "seed": 0}
    assert d["passes"] == [{"cleanup": dataclasses.asdict(cleanup.Options())}]


def test_empty_sections_mean_defaults(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("name: x\nmodel:\n  source: gguf\nexport:\nbackend:\npasses:\n")
    r = load_recipe(f)
    assert r.export == ExportSpec() and r.backend == BackendSpec() and len(r.passes) == 1


def test_explicit_empty_pass_list():
    assert parse_recipe(gguf(passes=[])).passes == ()


def test_pass_mapping_builds_options():
    r = parse_recipe(gguf(passes=["cleanup", {"cleanup": {"fold_constants": False}}, {"cleanup": None}]))
    assert [p.options for p in r.passes] == [cleanup.Options(), cleanup.Options(fold_constants=False),
                                             cleanup.Options()]
    assert isinstance(r.passes[1].options, cleanup.Options)


def test_round_trip_with_options_and_path(tmp_path):
    r = parse_recipe({"name": "m", "model": {"source": "hf", "path": str(tmp_path)},
                      "export": {"max_context": 64, "prefill_logits": "all", "max_batch": 4},
                      "passes": [{"cleanup": {"infer_shapes": False}}],
                      "backend": {"name": "tensorrt", "intra_op_threads": 2, "graph_optimization_level": "basic"}})
    assert parse_recipe(json.loads(json.dumps(r.to_dict()))) == r


def test_config_numbers_and_lists():
    r = parse_recipe(random_model(rope_theta=500000, rms_norm_eps="1e-6", eos_token_ids=[2, 3]))
    c = r.model.config
    assert c.rope_theta == 500000.0 and isinstance(c.rope_theta, float)
    assert c.rms_norm_eps == 1e-6  # PyYAML reads `1e-6` as a string; float fields accept it
    assert c.eos_token_ids == (2, 3)


def test_a_model_path_under_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # `~` is the user's home, not a folder named `~` in the working one
    recipe = parse_recipe({"name": "x", "model": {"source": "gguf", "path": "~/models/m.gguf"}})
    assert recipe.model.path == str(tmp_path / "models" / "m.gguf")


@pytest.mark.parametrize("name", ["quantize", "quantize_kv_cache"])
def test_the_builtin_calibration_text_is_not_resolved_as_a_file(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "r.yaml"
    f.write_text(f"name: x\nmodel: {{source: gguf}}\npasses:\n  - {name}: {{calibration: {{text: pydoc}}}}\n")
    assert load_recipe(f).passes[0].options.calibration.text == "pydoc"  # not {tmp_path}/pydoc, which does not exist


def test_eval_s_spelling_of_the_builtin_text_in_a_recipe_is_pointed_to_the_recipe_s(tmp_path, monkeypatch):
    """calibration.text: builtin:pydoc was read as a file path ("/x/builtin:pydoc: no such file")."""
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "r.yaml"
    f.write_text("name: x\nmodel: {source: gguf}\npasses:\n  - quantize: {calibration: {text: 'builtin:pydoc'}}\n")
    with pytest.raises(RecipeError, match=r"passes\[0\].quantize.calibration.text.*'builtin:pydoc': a recipe names the "
                                          r"built-in text 'pydoc'"):
        load_recipe(f)


def test_relative_model_path(tmp_path, monkeypatch):
    recipe_dir, cwd = tmp_path / "recipes", tmp_path / "cwd"
    recipe_dir.mkdir(), cwd.mkdir()
    (recipe_dir / "m.gguf").write_bytes(b"")
    f = recipe_dir / "r.yaml"
    f.write_text("name: x\nmodel:\n  source: gguf\n  path: m.gguf\n")
    monkeypatch.chdir(cwd)
    assert load_recipe(f).model.path == str(recipe_dir / "m.gguf")  # not in cwd: the recipe's folder
    (cwd / "m.gguf").write_bytes(b"")
    # in both folders, two files: which one the build read had depended on where it ran
    with pytest.raises(RecipeError, match=rf"model.path: 'm.gguf' names {cwd / 'm.gguf'} \(from the current folder\) "
                                          rf"and {recipe_dir / 'm.gguf'} \(from the recipe's folder\), two different "
                                          rf"files; write the one you mean as an absolute path"):
        load_recipe(f)
    (recipe_dir / "m.gguf").unlink()
    assert load_recipe(f).model.path == str(cwd / "m.gguf")  # only in the current folder
    monkeypatch.chdir(recipe_dir)
    assert load_recipe(f).model.path == str(recipe_dir / "m.gguf")  # both the same file: no question
    monkeypatch.chdir(cwd)
    (cwd / "m.gguf").unlink()
    assert load_recipe(f).model.path == str(cwd / "m.gguf")  # nowhere: cwd, left to the loader to report


def test_a_calibration_text_in_both_folders_is_refused_by_its_key(tmp_path, monkeypatch):
    recipe_dir, cwd = tmp_path / "recipes", tmp_path / "cwd"
    recipe_dir.mkdir(), cwd.mkdir()
    (recipe_dir / "notes.txt").write_text("a"), (cwd / "notes.txt").write_text("b")
    f = recipe_dir / "r.yaml"
    f.write_text("name: x\nmodel: {source: gguf}\npasses:\n  - cleanup\n"
                 "  - quantize: {calibration: {text: notes.txt}}\n")
    monkeypatch.chdir(cwd)
    with pytest.raises(RecipeError, match=r"passes\[1\].quantize.calibration.text: 'notes.txt' names .* two different"):
        load_recipe(f)


def test_environment_variables_in_a_path_are_expanded(tmp_path, monkeypatch):
    """`~` was expanded and `$HOME` kept as written: the build looked for a folder named `$HOME`."""
    monkeypatch.setenv("MODELS", str(tmp_path / "models"))
    for path in ("$MODELS/m.gguf", "${MODELS}/m.gguf"):
        recipe = parse_recipe({"name": "x", "model": {"source": "gguf", "path": path},
                               "passes": [{"quantize": {"calibration": {"text": path.replace("m.gguf", "c.txt")}}}]})
        assert recipe.model.path == str(tmp_path / "models" / "m.gguf")
        assert recipe.passes[0].options.calibration.text == str(tmp_path / "models" / "c.txt")
    monkeypatch.delenv("MODELS")
    assert "model.path: '$MODELS/m.gguf': the environment variable MODELS is not set" in error_of(
        {"name": "x", "model": {"source": "gguf", "path": "$MODELS/m.gguf"}})


def test_a_broken_link_beside_the_recipe_is_the_path_it_names(tmp_path, monkeypatch):
    """exists() follows links: the recipe's dangling link was passed over for a current-folder path that does not
    exist either, and the loader named a file the recipe never mentioned."""
    recipe_dir, cwd = tmp_path / "recipes", tmp_path / "cwd"
    recipe_dir.mkdir(), cwd.mkdir()
    (recipe_dir / "m.gguf").symlink_to(tmp_path / "gone.gguf")
    f = recipe_dir / "r.yaml"
    f.write_text("name: x\nmodel:\n  source: gguf\n  path: m.gguf\n")
    monkeypatch.chdir(cwd)
    assert load_recipe(f).model.path == str(recipe_dir / "m.gguf")


# --- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("data, expected", [
    (gguf(export={"max_contxt": 4}),
     "export.max_contxt: unknown key; did you mean 'max_context'? "
     "(known: dtype, max_batch, max_context, opset, prefill_logits)"),
    (gguf(pases=[]), "pases: unknown key; did you mean 'passes'?"),
    (gguf(export={"max_ctx": 4}), "export.max_ctx: unknown key; did you mean 'max_context'?"),  # a loose typo too
    (gguf(passes=["cleanpu"]), "passes[0]: unknown pass 'cleanpu'; did you mean 'cleanup'? Known passes: cleanup"),
    (gguf(passes=["zzz"]), "passes[0]: unknown pass 'zzz'. Known passes: cleanup"),
    (gguf(passes=["cleanup", {"cleanup": {"fold_constant": True}}]),
     "passes[1].cleanup.fold_constant: unknown key; did you mean 'fold_constants'?"),
    (gguf(passes=[{"cleanup": {"fold_constants": "yes"}}]),
     "passes[0].cleanup.fold_constants: expected true or false, got 'yes'"),
    (gguf(passes=[{"cleanup": [1]}]), "passes[0].cleanup: expected a mapping, got a list"),
    (gguf(passes=[{"cleanup": {"fold_size_threshold_bytes": -5}}]),
     "passes[0].cleanup.fold_size_threshold_bytes: -5 must be >= 0"),  # had silently folded nothing
    (gguf(passes=[{"cleanup": {}, "x": {}}]), "passes[0]: expected a pass name or a one-key mapping"),
    (gguf(passes="cleanup"), "passes: expected a list, got 'cleanup'"),
    (gguf(export={"max_context": True}), "export.max_context: expected an integer, got true"),
    (gguf(export={"max_context": 2048.0}), "export.max_context: expected an integer, got 2048.0"),
    (gguf(export={"max_context": 1}), "export.max_context: 1 must be >= 2"),
    (gguf(export={"opset": 17}), "export.opset: 17 must be >= 21"),
    (gguf(export={"opset": 25}), "export.opset: 25 must be <= 23 (aotlm exports opsets 21 to 23)"),  # was a 253-line trace
    (gguf(accuracy={"window": 64, "stride": 100}), "accuracy.stride: 100 must be <= accuracy.window (64)"),  # was clamped
    ({"name": "x", "model": {"source": "gguf", "path": ""}}, "model.path: must not be empty"),
    (gguf(backend={"name": "tensorrt", "tensorrt": {"optimization_level": True}}),
     "backend.tensorrt.optimization_level: true is not one of"),  # YAML's true is not the level 1
    (gguf(export={"max_batch": 0}), "export.max_batch: 0 must be >= 1"),
    (gguf(export={"prefill_logits": "first"}), "export.prefill_logits: 'first' is not one of last, all"),
    (gguf(export={"dtype": "float8"}),
     "export.dtype: 'float8' is not one of float32, float16, bfloat16"),
    (gguf(export=[1]), "export: expected a mapping, got a list"),
    (gguf(backend={"name": "tensorrtx"}), "backend.name: 'tensorrtx' is not one of onnxruntime, tensorrt"),
    (gguf(backend={"intra_op_threads": -1}), "backend.intra_op_threads: -1 must be >= 0"),
    (gguf(backend={"graph_optimization_level": 99}), "backend.graph_optimization_level: 99 is not one of"),
    ({"name": "x", "model": {}}, "model.source: missing required key"),
    ({"name": "x"}, "model: missing required key"),
    ({"model": {"source": "gguf"}}, "name: missing required key"),
    ({"name": "Bad Name", "model": {"source": "gguf"}}, "name: 'Bad Name' must match ^[a-z0-9][a-z0-9._-]*$"),
    # the whole name must match, not a prefix: a slash would put the artifact outside artifacts/
    ({"name": "a/../../etc", "model": {"source": "gguf"}}, "name: 'a/../../etc' must match ^[a-z0-9][a-z0-9._-]*$"),
    ({"name": "x", "model": {"source": "onnx"}}, "model.source: 'onnx' is not one of gguf, hf, random"),
    ({"name": "x", "model": {"source": "gguf", "config": TINY_CONFIG}},
     "model.config: only allowed with source random (source is 'gguf')"),
    ({"name": "x", "model": {"source": "gguf", "seed": 3}}, "model.seed: only used with source random"),
    ({"name": "x", "model": {"source": "hf"}}, "model.path: required when source is hf"),
    ({"name": "x", "model": {"source": "random"}}, "model.config: required when source is random"),
    ({"name": "x", "model": {"source": "random", "config": TINY_CONFIG, "path": "m.gguf"}},
     "model.path: must be null when source is random"),
    (random_model(num_layer=2), "model.config.num_layer: unknown key; did you mean 'num_layers'?"),
    ({"name": "x", "model": {"source": "random", "config": {k: v for k, v in TINY_CONFIG.items() if k != "head_dim"}}},
     "model.config.head_dim: missing required key"),
    (random_model(eos_token_ids=[2, "3"]), "model.config.eos_token_ids[1]: expected an integer, got '3'"),
    (random_model(tie_word_embeddings=1), "model.config.tie_word_embeddings: expected true or false, got 1"),
    (random_model(rope_theta="big"), "model.config.rope_theta: expected a number, got 'big'"),
    (random_model(rope_theta=True), "model.config.rope_theta: expected a number, got true"),  # not 1.0
    (random_model(num_kv_heads=3), "model.config: num_heads (4) must be a multiple of num_kv_heads (3)"),
    # Infinite numbers built artifacts whose logits were all NaN (an inf epsilon zeroes every norm).
    (random_model(rms_norm_eps=float("inf")), "model.config.rms_norm_eps: expected a finite number, got inf"),
    (random_model(rope_theta=float("nan")), "model.config.rope_theta: expected a finite number, got nan"),
    (random_model(rope_theta=10**400), "model.config.rope_theta: expected a number, got 1000"),
    (gguf(passes=[{"quantize_kv_cache": {"headroom": float("inf")}}]),
     "passes[0].quantize_kv_cache.headroom: expected a finite number, got inf"),
    (random_model(sliding_window=0), "model.config: sliding_window: 0 must be >= 1"),  # was "max_context to 0 or less"
    ({"name": "x", "model": {"source": "random", "config": TINY_CONFIG, "seed": 2**64}},
     "model.seed: 18446744073709551616 must be <= 18446744073709551615"),  # was a torch overflow traceback
    ({"name": "a" * 201, "model": {"source": "gguf"}}, "name: 201 characters; at most 200"),  # mkdtemp failed late
    ([1, 2], "a recipe must be a mapping of sections"),
    # options written at the name's indent: YAML reads one mapping with both keys ("got a mapping" said no more)
    (gguf(passes=[{"fuse_attention": None, "required": True}]),
     "passes[0]: a mapping with keys fuse_attention, required: a pass's options go indented under its name "
     "(`- fuse_attention:` then, on the next line, `    required: ...`)"),
    (gguf(passes=[{"skip_unused_rows": {"phases": ["prefill"]}}]),
     "passes[0].skip_unused_rows.phases: unknown key (it takes no options)"),  # was "(known: )"
])
def test_errors(data, expected):
    assert expected in error_of(data)


def test_the_longest_name_and_seed_are_accepted():
    assert parse_recipe({"name": "a" * 200, "model": {"source": "gguf"}}).name == "a" * 200
    recipe = parse_recipe({"name": "x", "model": {"source": "random", "config": TINY_CONFIG, "seed": 2**64 - 1}})
    assert recipe.model.seed == 2**64 - 1


def test_an_unclosed_quote_is_named_where_it_opens(tmp_path):
    """PyYAML meets the end of the file: the message named only that place, far from the quote."""
    f = tmp_path / "x.yaml"
    f.write_text('name: x\nmodel:\n  source: "gguf\n  path: a\nexport:\n  max_context: 64\n')
    with pytest.raises(RecipeError) as info:
        load_recipe(f)
    assert str(info.value) == (f"{f}: invalid YAML at line 7, column 1: found unexpected end of stream (while "
                               f"scanning a quoted scalar at line 3, column 11)")


def test_yaml_merge_keys_are_read_as_yaml_defines_them(tmp_path):
    f = tmp_path / "x.yaml"  # the duplicate-key check had refused `<<` as a tag it could not construct
    f.write_text("name: x\nexport: &common {max_context: 256, opset: 21}\n"
                 "model: {source: gguf}\naccuracy: {<<: {max_tokens: 512, window: 128}, stride: 64}\n")
    recipe = load_recipe(f)
    assert (recipe.accuracy.max_tokens, recipe.accuracy.window, recipe.accuracy.stride) == (512, 128, 64)
    f.write_text("name: x\nmodel: {source: gguf}\naccuracy: {<<: {window: 128}, window: 64, window: 32}\n")
    with pytest.raises(RecipeError, match="key 'window' is given twice"):
        load_recipe(f)


def test_a_key_beside_a_merge_overrides_the_merged_one(tmp_path):
    """What `<<` is for: it was refused as "given twice" (the merged keys were checked as the mapping's own)."""
    f = tmp_path / "x.yaml"
    f.write_text("name: x\nmodel: {source: gguf}\naccuracy: {<<: &base {window: 128, max_tokens: 512}, window: 64, "
                 "stride: 32}\n")
    recipe = load_recipe(f)
    assert (recipe.accuracy.window, recipe.accuracy.max_tokens) == (64, 512)


def test_a_section_given_in_part_keeps_its_fields_own_defaults():
    """quantize_kv_cache calibrates on 16 samples by default; giving only its seed took CalibrationSpec's 64."""
    default = parse_recipe(gguf(passes=["cleanup", "quantize_kv_cache"])).passes[1].options.calibration
    seeded = parse_recipe(gguf(passes=["cleanup", {"quantize_kv_cache": {"calibration": {"seed": 1}}}]))
    assert seeded.passes[1].options.calibration == dataclasses.replace(default, seed=1)
    assert default.samples == 16


@pytest.mark.parametrize("sections, expected", [
    ({"accuracy": {"max_tokens": 100}}, "accuracy: the accuracy report compares a quantized build with its float "
                                        "graph, and this recipe has no quantize or quantize_kv_cache pass"),
    ({"accuracy": {"window": 64, "stride": 32}, "passes": ["cleanup", "quantize_kv_cache"],
      "backend": {"name": "tensorrt"}}, "accuracy: the accuracy report runs the graphs in onnxruntime, and this "
                                        "recipe builds for tensorrt"),
])
def test_an_accuracy_section_no_report_reads_is_named(sections, expected):
    assert [line for line in ignored_settings(parse_recipe(gguf(**sections))) if line.startswith("accuracy")] == [
        expected + ("; drop the section" if "no quantize" in expected else "; score the artifact with `aotlm eval` "
                    "instead")]


def test_a_date_is_said_as_yaml_wrote_it():
    import datetime

    assert error_of({"name": datetime.date(2024, 1, 1), "model": {"source": "gguf"}}) == (
        "<dict>: name: expected a string, got the date 2024-01-01 (quote it for a string)")  # was datetime.date(...)


def test_an_empty_calibration_text_and_special_ids_past_the_vocabulary_are_refused_as_such():
    message = error_of(gguf(passes=["cleanup", {"quantize": {"method": "awq", "calibration": {"text": ""}}}]))
    assert "passes[1].quantize.calibration.text: must not be empty" in message  # it said ": : a folder"
    assert "model.config.bos_token_id: 9999 is outside the vocabulary (0..511)" in error_of(
        random_model(bos_token_id=9999))


@pytest.mark.parametrize("text, expected", [
    ("", "the file is empty (or holds only comments)"),
    ("# only a comment\n", "the file is empty (or holds only comments)"),
    ("name: x\nmodel: {source: gguf}\npasses:\n  - quantize: {exclude: [*lm_head]}\n",
     'quote glob patterns, e.g. pattern: "*lm_head*"'),
])
def test_an_empty_file_and_an_unquoted_glob_say_what_they_are(tmp_path, text, expected):
    f = tmp_path / "x.yaml"
    f.write_text(text)
    with pytest.raises(RecipeError, match=re.escape(expected)):
        load_recipe(f)


def test_error_starts_with_file_path(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("name: x\nmodel:\n  source: gguf\nexport:\n  max_contxt: 4\n")
    with pytest.raises(RecipeError, match="did you mean 'max_context'") as info:
        load_recipe(f)
    assert str(info.value).startswith(f"{f}: export.max_contxt: unknown key")


def test_yaml_true_for_int_in_file(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("name: x\nmodel: {source: gguf}\nbackend: {intra_op_threads: true}\n")
    with pytest.raises(RecipeError, match=r"backend\.intra_op_threads: expected an integer, got true"):
        load_recipe(f)


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe not found: .*nope.yaml"):
        load_recipe(tmp_path / "nope.yaml")


def test_malformed_yaml_one_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("name: x\nmodel:\n  source: [gguf\nexport: {}\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(f)
    message = str(info.value)
    assert message.startswith(f"{f}: invalid YAML at line ") and "column" in message and "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no yaml traceback chained


def test_malformed_yaml_names_the_line_and_column_an_editor_shows(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("name: x\nmodel: {source: gguf}\nexport: {max_context: 64]\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(f)
    assert str(info.value) == f"{f}: invalid YAML at line 3, column 25: expected ',' or '}}', but got ']'"  # the `]`


@pytest.mark.parametrize("text, got", [("- a\n- b\n", "a list"), ("just text\n", "'just text'")])
def test_top_level_not_a_mapping(tmp_path, text, got):
    f = tmp_path / "x.yaml"
    f.write_text(text)
    with pytest.raises(RecipeError, match=f"^{f}: a recipe must be a mapping of sections .*got {got}$"):
        load_recipe(f)


@pytest.mark.parametrize("text, message", [
    ("export:\n  ? [max_context]\n  : 128\n", "a list as a key: keys are names"),  # was TypeError: unhashable
    ("export:\n  max_context: " + "9" * 5001 + "\n", "invalid YAML: Exceeds the limit"),  # was ValueError
    ("name: " + "[" * 3000 + "\n", "invalid YAML"),  # was RecursionError
])
def test_yaml_that_pyyaml_chokes_on_is_one_line(tmp_path, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(RecipeError) as error:
        load_recipe(f)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_recipe_that_comes_with_aotlm_is_found_by_its_name_from_any_folder(tmp_path, monkeypatch):
    """A wheel carries no recipes/ folder beside the user's work: `aotlm build smollm2-135m` (or the README's
    recipes/smollm2-135m.yaml, run elsewhere) finds the recipe installed with aotlm; a file of that path wins."""
    from compiler.recipe import bundled_recipes, find_recipe

    monkeypatch.chdir(tmp_path)
    assert {"smollm2-135m", "tiny-random", "smollm2-135m-int4"} <= set(bundled_recipes())
    for given in ("tiny-random", "recipes/tiny-random.yaml", "tiny-random.yaml"):
        assert find_recipe(given) == bundled_recipes()["tiny-random"]
    assert load_recipe("tiny-random").name == "tiny-random"
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "tiny-random.yaml").write_text("name: mine\n")
    assert find_recipe("recipes/tiny-random.yaml") == Path("recipes/tiny-random.yaml")  # the user's own
    with pytest.raises(RecipeError, match=r"recipe not found: smollm2-136m; give a recipe file, or the name of one "
                                          r"that comes with aotlm: .*smollm2-135m, .*tiny-random"):
        find_recipe("smollm2-136m")
    with pytest.raises(RecipeError, match="recipe not found: elsewhere/tiny-random.yaml"):  # a path is a path
        find_recipe("elsewhere/tiny-random.yaml")


@pytest.mark.parametrize("layout", ["user/lib/python3.11/site-packages", "target"])
def test_bundled_recipes_are_found_where_each_install_scheme_puts_them(tmp_path, monkeypatch, layout):
    """pip install --user puts data files under ~/.local/share, --target under the target: only the interpreter's
    prefix was searched, and `aotlm build smollm2-135m` found none."""
    import compiler.recipe as recipe_module

    base = tmp_path / layout.split("/")[0]
    package = tmp_path / layout / "compiler"
    package.mkdir(parents=True)
    (base / "share" / "aotlm" / "recipes").mkdir(parents=True)
    (base / "share" / "aotlm" / "recipes" / "smollm2-135m.yaml").write_text("name: x\n")
    monkeypatch.setattr(recipe_module, "__file__", str(package / "recipe.py"))
    monkeypatch.setattr(recipe_module.sysconfig, "get_path", lambda name: str(tmp_path / "elsewhere"))
    assert recipe_module.bundled_recipes() == {"smollm2-135m": base / "share" / "aotlm" / "recipes" /
                                               "smollm2-135m.yaml"}


def test_a_checkouts_own_recipes_are_the_ones_found_by_name(tmp_path, monkeypatch):
    """Folders above a checkout were searched first: /tmp/share/aotlm/recipes, which anyone may make, named a clone
    in /tmp's recipes."""
    import compiler.recipe as recipe_module

    checkout = tmp_path / "clone"
    (checkout / "compiler").mkdir(parents=True)
    (checkout / "recipes").mkdir()
    (checkout / "pyproject.toml").write_text("")
    (checkout / "recipes" / "tiny-random.yaml").write_text("name: mine\n")
    planted = tmp_path / "share" / "aotlm" / "recipes"
    planted.mkdir(parents=True)
    (planted / "tiny-random.yaml").write_text("name: planted\n")
    (planted / "other.yaml").write_text("name: other\n")
    monkeypatch.setattr(recipe_module, "__file__", str(checkout / "compiler" / "recipe.py"))
    assert recipe_module.bundled_recipes() == {"tiny-random": checkout / "recipes" / "tiny-random.yaml"}


def test_an_empty_recipe_path_says_so():
    """`aotlm build ''` (an unset variable) said ": a folder, not a recipe file"."""
    with pytest.raises(RecipeError, match=r"^the recipe path is empty \(an unset variable\?\)"):
        load_recipe("")
