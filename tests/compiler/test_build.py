"""Builds are atomic, and the command line turns bad input into one clear line (exit status 2)."""
from __future__ import annotations

import dataclasses
import re
import shutil

import onnx
import pytest

from compiler import build as build_module
from compiler.backends import onnxruntime as onnxruntime_backend
from compiler.cli import main
from compiler.errors import BuildError
from tests.conftest import TINY_RECIPE


def test_missing_model_file_fails_without_artifact(tiny_recipe, tmp_path):
    recipe = dataclasses.replace(tiny_recipe, model=dataclasses.replace(tiny_recipe.model, source="gguf", config=None,
                                                                        path=str(tmp_path / "missing.gguf")))
    with pytest.raises(BuildError, match="missing.gguf"):
        build_module.build(recipe, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_failure_while_writing_leaves_nothing_and_keeps_the_old_artifact(tiny_recipe, tiny_artifact, monkeypatch):
    output_root = tiny_artifact.parent
    before = sorted(p.name for p in output_root.iterdir())
    manifest_before = (tiny_artifact / "manifest.json").read_text()

    def broken_writer(graphs, folder, *args):
        (folder / "prefill.onnx").write_text("half written")
        raise BuildError("disk full (simulated)")

    monkeypatch.setattr(build_module.onnxruntime_backend, "write_engines", broken_writer)
    monkeypatch.setattr(build_module, "trace_graphs", lambda *a, **k: {})  # skip the slow trace
    monkeypatch.setattr(build_module, "run_pipeline", lambda graphs, passes, **settings: (graphs, []))
    with pytest.raises(BuildError, match="simulated"):
        build_module.build(tiny_recipe, output_root)
    assert sorted(p.name for p in output_root.iterdir()) == before  # no .partial folder left behind
    assert (tiny_artifact / "manifest.json").read_text() == manifest_before


def test_the_manifest_lists_every_file_below_the_folder_but_itself_with_size_and_sha256(tmp_path):
    """The runtime refuses any file the list leaves out: files in subfolders count, and only the folder's own
    manifest.json is the manifest (a subfolder's is a file like any other)."""
    import hashlib
    import json

    from compiler.artifact import write_manifest

    (tmp_path / "weights.bin").write_bytes(b"\1" * 100)
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "decode.engine").write_bytes(b"\2" * 10)
    (tmp_path / "engines" / "manifest.json").write_text("{}")
    manifest = write_manifest(tmp_path, {"name": "x"})
    names = ["engines/decode.engine", "engines/manifest.json", "weights.bin"]
    assert manifest["files"] == {name: {"bytes": (tmp_path / name).stat().st_size,
                                        "sha256": hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}
                                 for name in names}
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    # JSON strictly: a broken build's perplexity past 1e308 was written as Infinity, which strict parsers refuse
    write_manifest(tmp_path, {"name": "x", "accuracy": {"held_out": {"perplexity": float("inf"), "mean_nll": 800.0}}})
    strict = json.loads((tmp_path / "manifest.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert strict["accuracy"]["held_out"] == {"perplexity": None, "mean_nll": 800.0}


def test_tool_versions_name_a_tool_that_is_not_installed_as_null():
    """The manifest says which tools were absent (tensorrt on a CPU build), not only which were there."""
    import platform
    from importlib import metadata

    from compiler.artifact import tool_versions

    assert tool_versions(("aotlm", "no-such-distribution")) == {
        "python": platform.python_version(), "aotlm": metadata.version("aotlm"), "no-such-distribution": None}


def run_cli(capsys, *argv) -> tuple[int, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out + captured.err


@pytest.mark.parametrize("recipe_text, expected", [
    (None, "recipe not found"),
    ("name: x\nmodel: [", "invalid YAML at line"),
    ("name: x\nmodel: {source: random}\npasses: [cleanpu]\n", "did you mean 'cleanup'"),
    ("name: x\nmodel: {source: gguf}\nexport: {max_contxt: 5}\n", "did you mean 'max_context'"),
])
def test_bad_recipes_get_one_line_errors(capsys, tmp_path, recipe_text, expected):
    path = tmp_path / "recipe.yaml"
    if recipe_text is not None:
        path.write_text(recipe_text)
    status, output = run_cli(capsys, "build", str(path), "--output", str(tmp_path / "out"))
    assert status == 2
    assert expected in output and "Traceback" not in output
    assert not (tmp_path / "out").exists()


def test_an_error_naming_a_long_path_prints_it_unbroken(capsys, tmp_path, monkeypatch):
    """An error goes to stderr, which a log or a pipe gives 80 columns: rich cut a long path there with a newline,
    so the path a user copies or greps for was not in the output."""
    from compiler.console import console

    monkeypatch.setattr(console, "_width", 80)  # as a pipe gives it, whatever COLUMNS this test runs under
    path = tmp_path / ("a_folder_whose_name_is_long_" * 4) / "recipe.yaml"
    status, output = run_cli(capsys, "build", str(path))
    assert status == 2 and str(path) in output and output.count("\n") == 1


def test_the_built_line_prints_a_long_artifact_path_unbroken(capsys, tmp_path, tiny_artifact, monkeypatch):
    """The build's last line names the artifact; piped, rich's 80 columns cut a long path there with a newline, as
    they had cut errors' paths."""
    import shutil

    import json

    from compiler.console import console

    monkeypatch.setattr(console, "_width", 80)  # as a pipe gives it, whatever COLUMNS this test runs under
    artifact = shutil.copytree(tiny_artifact, tmp_path / ("a_folder_whose_name_is_long_" * 4) / "tiny-random")
    def built(recipe, output, progress=None, dump_dir=None, written=None, swap=None):
        written.update(json.loads((artifact / "manifest.json").read_text()))
        return artifact

    monkeypatch.setattr(build_module, "build", built)
    status, output = run_cli(capsys, "build", str(TINY_RECIPE), "--output", str(artifact.parent))
    assert status == 0 and any(line.startswith(f"built {artifact} in ") for line in output.splitlines()), output


@pytest.mark.parametrize("passes, expected", [
    ("cleanup, fuse_attention", "passes[1]: fuse_attention leaves aotlm.FlashAttention nodes, which onnxruntime "
                                "cannot run; add lower_onnxruntime after it"),
    ("cleanup, lower_onnxruntime, fuse_attention", "passes[2]: fuse_attention leaves aotlm.FlashAttention nodes"),
    ("cleanup, fuse_attention, lower_tensorrt", "passes[2]: lower_tensorrt emits TensorRT plugin nodes"),
    ("cleanup, fuse_attention, quantize_kv_cache, lower_onnxruntime",
     "passes[2]: quantize_kv_cache rewrites onnxruntime's GroupQueryAttention; list it after"),
    ("cleanup, fuse_attention, lower_onnxruntime, quantize_kv_cache, quantize",
     "passes[4] (quantize) comes after passes[3] (quantize_kv_cache): AWQ folds input scales into the value "
     "projection"),
])
def test_pass_orders_onnxruntime_cannot_run_are_refused_before_the_export(capsys, tmp_path, passes, expected):
    path = tmp_path / "recipe.yaml"
    path.write_text(TINY_RECIPE.read_text().split("passes:")[0] + f"passes: [{passes}]\n")
    status, output = run_cli(capsys, "build", str(path), "--output", str(tmp_path / "out"))
    assert status == 2 and expected in " ".join(output.split()) and "Traceback" not in output
    assert "loading the model" not in output and not (tmp_path / "out").exists()


def test_a_graph_onnxruntime_cannot_run_is_not_written(tmp_path):
    node = onnx.helper.make_node("FlashAttention", ["q", "k", "v"], ["y"], name="layer0", domain="aotlm")
    graph = onnx.helper.make_graph([node], "g", [], [])
    with pytest.raises(BuildError, match="decode graph: node layer0 is aotlm.FlashAttention, which onnxruntime cannot "
                                         "run; lower it with lower_onnxruntime"):
        onnxruntime_backend.write_engines({"decode": onnx.helper.make_model(graph)}, tmp_path, None, {})
    assert not any(tmp_path.iterdir())


def test_unsupported_architecture_is_named(capsys, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: x\nmodel: {{source: hf, path: {folder}}}\n")
    status, output = run_cli(capsys, "build", str(recipe), "--output", str(tmp_path / "out"))
    assert status == 2 and "gpt2" in output and "llama" in output and "Traceback" not in output


def test_run_and_inspect(capsys, tiny_artifact):
    status, output = run_cli(capsys, "run", str(tiny_artifact), "--prompt", "hi", "--max-new-tokens", "5")
    assert status == 0 and "TTFT ms" in output and "TPOT ms" in output
    status, output = run_cli(capsys, "inspect", str(tiny_artifact), "--verify")
    assert status == 0 and "sha256 verified" in output and "decode.onnx" in output
    assert "weights: float32 (not quantized)" in output
    assert "prefill after cached tokens: yes" in " ".join(output.split())


def test_inspect_json_prints_the_whole_manifest_and_the_table_marks_what_it_shortens(capsys, tiny_artifact):
    """Summaries were cut at 100 characters mid-word, with no mark and no way to see the rest."""
    import json

    from compiler.cli import _shortened, main

    assert main(["inspect", str(tiny_artifact), "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest == json.loads((tiny_artifact / "manifest.json").read_text())
    long = "fused=30, padding=right: each attention_mask row is ones, then zeros " * 5
    assert _shortened("fused=30") == "fused=30"
    cut = _shortened(long, 60)
    kept = cut[:-2]
    assert cut.endswith(" …") and long.startswith(kept) and len(kept) <= 60 and long[len(kept)] in " ,"  # whole words


def test_run_stops_before_a_stop_string(capsys, tiny_artifact):
    from runtime import Engine

    full = Engine.load(tiny_artifact).generate("hi", max_new_tokens=12).text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip()
    status, output = run_cli(capsys, "run", str(tiny_artifact), "--prompt", "hi", "--max-new-tokens", "12",
                             "--stop", stop)
    assert status == 0 and output.startswith("hi" + full.split(stop, 1)[0] + "\n") and "(stop)" in output


def test_run_refuses_a_prompt_longer_than_max_context(capsys, tiny_artifact):
    status, output = run_cli(capsys, "run", str(tiny_artifact), "--prompt", "word " * 300)
    assert status == 2 and "max context is 128" in output and "Traceback" not in output


def test_run_refuses_a_tampered_artifact(capsys, tiny_artifact, tmp_path):
    import shutil

    copy = shutil.copytree(tiny_artifact, tmp_path / "copy")
    (copy / "decode.onnx").write_bytes(b"")
    status, output = run_cli(capsys, "run", str(copy), "--prompt", "hi")
    assert status == 2 and "decode.onnx" in output and "Traceback" not in output


def test_every_attention_lowering_generates_the_same_tokens(tiny_recipe, tiny_artifact, tmp_path):
    """The default tiny recipe (GroupQueryAttention), the portable ONNX Attention lowering and no fusion at all."""
    from compiler.recipe import PassSpec
    from passes import cleanup, fuse_attention, fuse_rms_norm, lower_onnx_attention
    from runtime import Engine

    variants = {
        "unfused": (PassSpec("cleanup", cleanup.Options()),),
        "onnx-attention": (PassSpec("cleanup", cleanup.Options()),
                           PassSpec("fuse_attention", fuse_attention.Options(required=True)),
                           PassSpec("lower_onnx_attention", lower_onnx_attention.Options()),
                           PassSpec("fuse_rms_norm", fuse_rms_norm.Options())),
    }
    engines = {"default": Engine.load(tiny_artifact)}
    for name, passes in variants.items():
        recipe = dataclasses.replace(tiny_recipe, name=f"tiny-{name}", passes=passes)
        engines[name] = Engine.load(build_module.build(recipe, tmp_path))
    for prompt in ([1, 17, 300, 42, 9], [1, 5]):
        tokens = {name: engine.generate(prompt, max_new_tokens=20, ignore_eos=True).token_ids
                  for name, engine in engines.items()}
        assert tokens["default"] == tokens["unfused"] == tokens["onnx-attention"], tokens
    # Only GroupQueryAttention reading the cache inputs attends to a past in the prefill graph: the others' prefix
    # caching runs the rest through the decode graph, and each makes the same tokens as a whole prefill
    assert {name: engine.manifest["engines"]["prefill"]["takes_past"] for name, engine in engines.items()} == {
        "default": True, "unfused": False, "onnx-attention": False}
    prompt, follow_up = [1] + list(range(40, 70)), list(range(200, 210))
    for name, engine in engines.items():
        cached = Engine.load(engine.artifact_dir, prefix_caching=True)
        first = cached.generate(prompt, max_new_tokens=4, ignore_eos=True).token_ids
        result = cached.generate(prompt + first + follow_up, max_new_tokens=6, ignore_eos=True)
        assert result.timings.cached_prompt_tokens == len(prompt) + 3, name
        assert result.token_ids == engine.generate(prompt + first + follow_up, max_new_tokens=6,
                                                   ignore_eos=True).token_ids, name


def test_an_artifact_whose_prefill_returns_every_position_generates_the_same_tokens(tiny_recipe, tiny_artifact,
                                                                                    tmp_path):
    """export.prefill_logits: all gives [batch, sequence, vocab]; the runtime samples each row's last prompt token
    (it sampled from the flattened rows and fed an out-of-range token id to the decode graph)."""
    from runtime import Engine

    recipe = dataclasses.replace(tiny_recipe, name="tiny-all-logits",
                                 export=dataclasses.replace(tiny_recipe.export, prefill_logits="all"))
    every, last = Engine.load(build_module.build(recipe, tmp_path)), Engine.load(tiny_artifact)
    assert every.manifest["engines"]["prefill"]["outputs"][0]["shape"] == ["batch", "sequence", 512]
    assert every.manifest["engines"]["prefill"]["takes_past"] is True  # a rest after a past: its last row's logits
    prompt = [1] + list(range(40, 70))
    cached = Engine.load(every.artifact_dir, prefix_caching=True)
    longer = prompt + cached.generate(prompt, max_new_tokens=2, ignore_eos=True).token_ids + [5, 6, 7, 8]
    rest = cached.generate(longer, max_new_tokens=5, ignore_eos=True)
    assert rest.timings.cached_prompt_tokens == len(prompt) + 1
    assert rest.token_ids == last.generate(longer, max_new_tokens=5, ignore_eos=True).token_ids
    prompts = [[1, 17, 300, 42, 9], [1, 5, 6], [1, 7, 8, 9, 10, 11, 12]]  # one right-padded prefill batch of 3
    alone = every.generate(prompts[0], max_new_tokens=6, ignore_eos=True)
    assert alone.token_ids == last.generate(prompts[0], max_new_tokens=6, ignore_eos=True).token_ids
    batched = every.generate(prompts, max_new_tokens=6, ignore_eos=True)
    assert [r.token_ids for r in batched] == [r.token_ids for r in last.generate(prompts, max_new_tokens=6,
                                                                                  ignore_eos=True)]
    every.close()
    last.close()


def test_a_large_models_build_runs_the_passes_one_phase_at_a_time_and_writes_the_same_files(tiny_recipe, tiny_artifact,
                                                                                             tmp_path, monkeypatch):
    """Above SPILL_ABOVE_WEIGHT_BYTES the passes before quantization hold one phase's graph at a time, the other on
    disk (a 1.25 GB model's passes peaked at 3.4 GB instead of 5.1): the artifact's files are the very bytes of a build
    that holds both."""
    import json

    import compiler.build as build_module
    from compiler.build import build

    monkeypatch.setattr(build_module, "SPILL_ABOVE_WEIGHT_BYTES", 0)
    said = []
    spilled = json.loads((build(tiny_recipe, tmp_path, progress=said.append) / "manifest.json").read_text())
    held = json.loads((tiny_artifact / "manifest.json").read_text())
    assert any("run one phase at a time" in line for line in said)
    assert spilled["files"] == held["files"]
    assert [(p["name"], p["phase"], p["report"]) for p in spilled["passes"]] == \
        [(p["name"], p["phase"], p["report"]) for p in held["passes"]]


def test_a_build_under_an_ascii_locale_writes_the_tokenizer_as_utf8(tmp_path):
    """tokenizer.json was written in the locale's encoding: under LC_ALL=C (no UTF-8 mode) a byte-level vocabulary's
    Ġ and Ā failed the build at its end with a UnicodeEncodeError traceback."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    completed = subprocess.run([sys.executable, "-m", "compiler.cli", "build", str(TINY_RECIPE), "--output",
                                str(tmp_path)], cwd=TINY_RECIPE.parents[1], env=env, capture_output=True, timeout=600)
    assert completed.returncode == 0, completed.stderr.decode(errors="replace")[-2000:]
    vocabulary = json.loads((tmp_path / "tiny-random" / "tokenizer.json").read_bytes().decode("utf-8"))["model"]["vocab"]
    assert "Ġ" in "".join(vocabulary)


def test_build_dumps_each_passs_graphs_where_asked(capsys, tmp_path):
    """The pipeline could dump every pass's graph, but nothing outside the tests turned it on."""
    import onnx

    status, output = run_cli(capsys, "build", str(TINY_RECIPE), "--output", str(tmp_path / "out"),
                             "--dump-passes", str(tmp_path / "dumps"))
    assert status == 0, output
    dumped = sorted(path.name for path in (tmp_path / "dumps").iterdir())
    assert dumped[:2] == ["00-cleanup-decode.onnx", "00-cleanup-prefill.onnx"]
    assert "06-skip_unused_rows-prefill.onnx" in dumped and len(dumped) == 14  # 7 passes x 2 phases
    last = onnx.load(str(tmp_path / "dumps" / "06-skip_unused_rows-decode.onnx"))
    assert {node.op_type for node in last.graph.node} >= {"GroupQueryAttention"}
    (tmp_path / "a-file").write_text("")  # refused before the export, not a traceback after it
    status, output = run_cli(capsys, "build", str(TINY_RECIPE), "--output", str(tmp_path / "out2"),
                             "--dump-passes", str(tmp_path / "a-file"))
    assert status == 2 and "--dump-passes folder" in output and "is a file, not a folder" in output, output
    assert "tracing" not in output


def test_dumped_passes_are_numbered_as_the_build_counts_them_across_quantization(tmp_path):
    """The build runs the passes in two parts (before and from the first quantizing pass): the dumps' numbers
    restarted at 00 there and interleaved with the first part's."""
    from compiler.build import build
    from compiler.recipe import load_recipe, parse_recipe

    data = load_recipe(TINY_RECIPE).to_dict()
    passes = [p for p in data["passes"] if (p if isinstance(p, str) else next(iter(p))) != "skip_unused_rows"]
    data.update(passes=passes + [{"quantize": {"bits": 8, "method": "rtn"}}], accuracy={"enabled": False})
    build(parse_recipe(data, origin="test"), tmp_path / "out", dump_dir=tmp_path / "dumps")
    numbers = sorted({path.name.split("-")[0] + "-" + path.name.split("-")[1]
                      for path in (tmp_path / "dumps").iterdir()})
    assert numbers[-1] == f"{len(passes):02d}-quantize", numbers


def test_dumps_inside_the_artifact_folder_are_refused_before_the_export(capsys, tmp_path, tiny_artifact):
    """The build replaces the artifact folder: dumps inside it were deleted without a word, or (on a fresh output)
    the whole build ran and then refused to write the artifact."""
    for inside in ("tiny-random", "tiny-random/dumps"):
        status, output = run_cli(capsys, "build", str(TINY_RECIPE), "--output", str(tmp_path / "out"),
                                 "--dump-passes", str(tmp_path / "out" / inside))
        assert status == 2 and "inside the artifact folder" in output and "tracing" not in output, output
    other = shutil.copytree(tiny_artifact, tmp_path / "other")
    for inside in (other, other / "dumps"):  # another artifact: its 14 graphs made that one unloadable
        status, output = run_cli(capsys, "build", str(TINY_RECIPE), "--output", str(tmp_path / "out"),
                                 "--dump-passes", str(inside))
        assert status == 2 and f"the artifact folder {other}, which holds only what its manifest lists" in output, output
    assert sorted(path.name for path in other.iterdir()) == sorted(path.name for path in tiny_artifact.iterdir())


def test_build_prints_its_own_reports_though_another_build_replaced_the_artifact(capsys, tmp_path, monkeypatch):
    """The CLI read the manifest at the path after the swap's lock was released: a build of the same name that swapped
    in meanwhile (two CI jobs) had its pass table printed under this build's "built"."""
    import json

    import compiler.build

    build = compiler.build.build

    def then_replaced(recipe, output, **options):
        path = build(recipe, output, **options)
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["passes"] = manifest["passes"][:1]  # the other build's: one pass
        (path / "manifest.json").write_text(json.dumps(manifest))
        return path

    monkeypatch.setattr(compiler.build, "build", then_replaced)
    status, output = run_cli(capsys, "build", str(TINY_RECIPE), "--output", str(tmp_path))
    table_rows = re.findall(r"^(\w+)\s+(?:prefill|decode)\s+[\d.]+\s", output, re.M)  # the pass table's, not progress
    assert status == 0 and {"fuse_attention", "skip_unused_rows"} <= set(table_rows), output


def test_a_malformed_source_date_epoch_is_refused_before_the_work(tmp_path, monkeypatch):
    """It was refused when the manifest was written: after the whole build (minutes for a real model)."""
    import compiler.build

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    monkeypatch.setattr(compiler.build, "trace_graphs", lambda *a, **k: pytest.fail("traced before the check"))
    from compiler.recipe import load_recipe

    with pytest.raises(BuildError, match=r"SOURCE_DATE_EPOCH='yesterday'"):
        compiler.build.build(load_recipe(TINY_RECIPE), tmp_path)
