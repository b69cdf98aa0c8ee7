"""Bad command-line input fails fast with one `error:` line (status 2), before any slow work, and leaves nothing
half-written: user text is printed as it is, recipe values are range-checked, damaged artifacts are named,
output paths are checked before the work they would receive."""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from compiler import cli, cli_evaluate
import compiler.artifact as artifact_module
from compiler.artifact import remove_abandoned, staged_folder
from compiler.cli import main
from compiler.errors import BuildError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny-random.yaml"


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setattr(cli.console, "width", 10_000)  # no wrapping inside the messages compared below


def run_cli(capsys, *argv) -> tuple[int, str]:
    status = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def tiny_recipe(tmp_path: Path, old: str = "", new: str = "", name: str = "tiny.yaml") -> Path:
    text = TINY.read_text()
    assert old in text
    path = tmp_path / name
    path.write_text(text.replace(old, new, 1))
    return path


def test_user_text_in_an_error_is_printed_as_given(capsys, tmp_path):
    for given in ("[/x]", "models[bold]"):
        status, output = run_cli(capsys, "inspect", tmp_path / given)
        assert status == 2 and given in output and "Traceback" not in output


@pytest.mark.parametrize("old, new, message", [
    ("num_kv_heads: 2", "num_kv_heads: 0", "num_kv_heads: 0 must be >= 1"),
    ("num_heads: 4", "num_heads: 0", "num_heads: 0 must be >= 1"),
    ("hidden_size: 64", "hidden_size: -64", "hidden_size: -64 must be >= 1"),
    ("head_dim: 16", "head_dim: 15", "head_dim: 15 must be even"),
    ("num_layers: 2", "num_layers: 0", "num_layers: 0 must be >= 1"),
])
def test_a_model_config_out_of_range_is_refused_by_name(capsys, tmp_path, old, new, message):
    recipe = tiny_recipe(tmp_path, old, new)
    for command in (("build", recipe, "--output", tmp_path / "out"), ("plan", recipe, "--device", "H100")):
        status, output = run_cli(capsys, *command)
        assert status == 2 and message in output and "Traceback" not in output, output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_head_dim_groupqueryattention_cannot_take_is_refused_before_the_export(capsys, tmp_path, monkeypatch):
    """head_dim 8 (hidden 32, 4 heads: a common tiny test model) was refused only after both graphs were traced, with
    advice (leave lower_onnxruntime out) that the next build refused in turn: fuse_attention's node needs lowering.
    The advice it gives now builds, and matches the unlowered graph."""
    small = tiny_recipe(tmp_path, "head_dim: 16", "head_dim: 8")
    monkeypatch.setattr("compiler.build.trace_graphs", lambda *a, **k: (_ for _ in ()).throw(AssertionError("traced")))
    status, output = run_cli(capsys, "build", small, "--output", tmp_path / "out")
    assert status == 2 and "Traceback" not in output, output
    assert ("needs a head_dim that is a multiple of 16, and this model's is 8: lower the fused attention with "
            "lower_onnx_attention instead") in output
    monkeypatch.undo()
    monkeypatch.setattr(cli.console, "width", 10_000)
    text = small.read_text()
    lowered = tmp_path / "lowered.yaml"
    lowered.write_text(text.replace("  - lower_onnxruntime ", "  - lower_onnx_attention ", 1))
    unfused = tmp_path / "unfused.yaml"
    unfused.write_text(text[:text.index("passes:")] + "passes:\n  - cleanup\n")
    from runtime import Engine

    tokens = []
    for recipe, out in ((lowered, tmp_path / "lowered"), (unfused, tmp_path / "unfused")):
        status, output = run_cli(capsys, "build", recipe, "--output", out)
        assert status == 0, output
        engine = Engine.load(out / "tiny-random")
        tokens.append(engine.generate([5, 6, 7], max_new_tokens=8, ignore_eos=True).token_ids)
    assert len(tokens[0]) == 8 and tokens[0] == tokens[1]


def test_a_listed_pass_that_changed_nothing_is_warned_of_and_a_working_build_has_no_warning(capsys, tmp_path):
    status, output = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 0 and "warning" not in output and "replaced" not in output
    twice = tiny_recipe(tmp_path, "  - fuse_rms_norm ", "  - lower_onnxruntime\n  - fuse_rms_norm ")
    status, output = run_cli(capsys, "build", twice, "--output", tmp_path / "out")
    assert status == 0, output
    assert ("warning: passes[3] (lower_onnxruntime) changed nothing in prefill, decode: no aotlm.FlashAttention node "
            "left to lower") in output
    assert "s (it replaced the artifact that was there)" in output  # swapped in whole; the user is told
    status, output = run_cli(capsys, "inspect", tmp_path / "out" / "tiny-random")
    assert status == 0 and "warning: passes[3] (lower_onnxruntime) changed nothing" in output


def test_attention_left_unfused_in_some_layers_is_warned_of_at_build_and_inspect(capsys, tmp_path):
    partial = tiny_recipe(tmp_path, "      required: true ", "      max_rewrites: 1 ")
    status, output = run_cli(capsys, "build", partial, "--output", tmp_path / "out")
    assert status == 0, output
    expected = ("warning: passes[1] (fuse_attention) left 1 of 2 attention blocks unfused in prefill; first: layers.1: "
                "max_rewrites=1")
    assert expected in output and expected.replace("prefill", "decode") in output
    status, output = run_cli(capsys, "inspect", tmp_path / "out" / "tiny-random")
    assert status == 0 and expected in output


@pytest.mark.parametrize("option, message", [
    ("block_size: 48", "passes[6] (quantize): quantize: block_size=48"),
    ("int8_kernel_block: 48", "passes[6] (quantize): quantize: int8_kernel_block=48"),
    # INT8 is one symmetric scale per output channel: these were dropped without a word
    ("bits: 8\n      block_size: 7", "quantize: block_size=7 with bits=8: INT8 has one scale per output channel"),
    ("bits: 8\n      symmetric: false", "quantize: symmetric=false with bits=8: INT8 is symmetric per output channel"),
    ("overrides: [{pattern: '*lm_head*', bits: 8, block_size: 64}]",
     "quantize: overrides[0] ('*lm_head*'): block_size=64 with bits=8"),
])
def test_bad_pass_options_are_refused_before_the_export(capsys, tmp_path, monkeypatch, option, message):
    recipe = tiny_recipe(tmp_path, "  - pack_projections", f"  - pack_projections\n  - quantize:\n      {option}")
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    status, output = run_cli(capsys, "build", recipe, "--output", tmp_path / "out")
    assert status == 2 and message in output, output


def test_build_warns_of_settings_its_backend_ignores_before_the_export(capsys, tmp_path, monkeypatch):
    recipe = tiny_recipe(tmp_path, "export:", "export:\n  max_batch: 4")
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "out").write_text("x")  # the build stops at its first check; the warning came before it
    status, output = run_cli(capsys, "build", recipe, "--output", tmp_path / "out")
    assert status == 2 and "warning: export.max_batch: 4 bounds TensorRT's optimization profiles" in output, output


def test_a_pass_that_runs_once_listed_twice_is_refused_before_the_export(capsys, tmp_path, monkeypatch):
    recipe = tiny_recipe(tmp_path, "  - pack_projections", "  - pack_projections\n  - quantize\n  - quantize")
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    status, output = run_cli(capsys, "build", recipe, "--output", tmp_path / "out")
    assert status == 2 and "passes[7]: quantize is listed twice" in output, output


def test_a_chat_template_that_does_not_parse_is_refused_before_the_export(capsys, tmp_path, monkeypatch):
    """It built, and every chat request to the artifact then failed with "rebuild the artifact", which did not help."""
    from compiler import build

    load = build.load_model
    monkeypatch.setattr(build, "load_model", lambda *args, **kwargs: dataclasses.replace(
        load(*args, **kwargs), chat_template="{% if %}broken"))
    monkeypatch.setattr(build, "trace_graphs", lambda *a, **k: pytest.fail("exported"))
    status, output = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and "the model's chat template does not parse (" in output, output
    assert "or remove it to build without one" in output


def test_an_output_path_inside_a_file_is_refused_before_the_export(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    for output in (blocker, blocker / "sub"):
        status, text = run_cli(capsys, "build", TINY, "--output", output)
        assert status == 2 and f"{blocker} is a file, not a folder" in text, text
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tiny-random").write_text("x")
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and "tiny-random is a file; the artifact is a folder" in text


def test_dangling_links_as_output_or_artifact_are_refused_before_the_export(capsys, tmp_path, monkeypatch):
    """`--output` a link to an unmounted disk failed in mkdir, and <output>/<name> a dangling link failed in the final
    rename, each with a traceback after the whole build."""
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "unmounted").symlink_to(tmp_path / "mnt" / "disk")
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "unmounted")
    assert status == 2 and "unmounted is a link to" in text and "which leads to no folder" in text, text
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")  # both exist: "does not exist" would mislead
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "loop_a" / "x")
    assert status == 2 and "or the links form a loop" in text, text
    # a name longer than the file system takes: the check itself had raised OSError, a traceback
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / ("x" * 300))
    assert status == 2 and "File name too long; choose another path" in text and "Traceback" not in text, text
    if Path("/proc/self").is_dir():  # writable by its permissions, yet it takes no folder: mkdir failed at the end
        status, text = run_cli(capsys, "build", TINY, "--output", "/proc/aotlm-output")
        assert status == 2 and "/proc" in text and "choose another path" in text, text  # (not writable, as a user)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tiny-random").symlink_to(tmp_path / "gone")
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and "tiny-random is a link to" in text and "remove the link" in text, text


def test_a_folder_that_is_not_an_artifact_is_never_replaced(capsys, tmp_path, monkeypatch):
    """The build swaps <output>/<name> for the new artifact: a folder of the user's own files there (the model it
    builds from, say) is refused before the export, and left as it was."""
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    own = tmp_path / "out" / "tiny-random"
    own.mkdir(parents=True)
    (own / "config.json").write_text("{}")
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and "exists and is not an aotlm artifact" in text, text
    assert [p.name for p in own.iterdir()] == ["config.json"]


def test_an_artifact_folder_as_output_is_refused(capsys, tiny_artifact, tmp_path, monkeypatch):
    """--output names the folder that receives <name>/; an artifact given there would get a stray folder inside it,
    which its manifest does not list (the runtime then refuses it)."""
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    copy = tmp_path / "copy"
    shutil.copytree(tiny_artifact, copy)
    for output in (copy, copy / "sub"):
        status, text = run_cli(capsys, "build", TINY, "--output", output)
        assert status == 2 and f"the artifact folder {copy}" in text and "receives <name>/" in text, text
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in tiny_artifact.iterdir())


@pytest.fixture
def damaged(tiny_artifact, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_artifact, copy)
    return copy


@pytest.mark.parametrize("section", ["kv_cache", "engines", "files", "tokenizer"])
def test_a_manifest_missing_a_section_is_named(capsys, damaged, section):
    manifest = json.loads((damaged / "manifest.json").read_text())
    del manifest[section]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    for command in (("run", damaged, "--prompt", "hi"), ("inspect", damaged),
                    ("eval", damaged, "--text", "builtin:pydoc-held-out", "--max-tokens", "100")):
        status, output = run_cli(capsys, *command)
        assert status == 2 and f"the manifest lacks {section}" in output and "Traceback" not in output, output


def test_compare_names_a_missing_tokenizer(capsys, tiny_artifact, damaged):
    (damaged / "tokenizer.json").unlink()
    status, output = run_cli(capsys, "compare", tiny_artifact, damaged, "--text", "builtin:pydoc-held-out")
    assert status == 2 and "tokenizer.json: file listed in the manifest is missing" in output, output


def test_output_files_are_checked_before_the_work(capsys, tiny_artifact, tmp_path, monkeypatch):
    monkeypatch.setattr(cli_evaluate, "_score", lambda *a: pytest.fail("scored before checking --json"))
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    for argv in (("eval", tiny_artifact, "--text", "builtin:pydoc-held-out", "--json", tmp_path),
                 ("eval", tiny_artifact, "--text", "builtin:pydoc-held-out", "--json", blocker / "x.json"),
                 ("compare", tiny_artifact, tiny_artifact, "--text", "builtin:pydoc-held-out", "--json", tmp_path),
                 ("bench", tiny_artifact, "--phase", "decode", "--contexts", "16", "--out", blocker / "x.json")):
        status, output = run_cli(capsys, *argv)
        assert status == 2 and ("is a folder" in output or "is a file, not a folder" in output), output


def test_a_build_says_it_replaced_an_artifact_another_build_made_while_it_ran(capsys, tiny_artifact, tmp_path,
                                                                                monkeypatch):
    """Whether it replaced one was decided before the build: of three concurrent builds of one name, the two that
    replaced another's artifact said nothing of it."""
    import shutil

    from compiler.build import onnxruntime_backend

    write_engines = onnxruntime_backend.write_engines

    def another_build_finished_meanwhile(graphs, folder, *args, **kwargs):
        shutil.copytree(tiny_artifact, tmp_path / "out" / "tiny-random")
        return write_engines(graphs, folder, *args, **kwargs)

    monkeypatch.setattr("compiler.build.onnxruntime_backend.write_engines", another_build_finished_meanwhile)
    status, output = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 0 and "s (it replaced the artifact that was there)" in output, output


def test_an_empty_folder_the_swap_takes_is_not_an_artifact_it_replaced(capsys, tmp_path):
    (tmp_path / "out" / "tiny-random").mkdir(parents=True)
    status, output = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 0 and "replaced" not in output, output


def test_a_recipe_is_read_as_every_text_file_is(capsys, tmp_path):
    """UTF-16 was "'utf-8' codec can't decode byte 0xff in position 0"; a FIFO was "recipe not found"."""
    import codecs

    utf16 = tmp_path / "r16.yaml"
    utf16.write_bytes(codecs.BOM_UTF16_LE + TINY.read_text().encode("utf-16-le"))
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(TINY.read_bytes() + b"# caf\xe9\n")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    lines = TINY.read_bytes().count(b"\n")
    for recipe, message in ((utf16, "it is UTF-16 (it begins with UTF-16's byte-order mark), not UTF-8"),
                            (latin1, f"(line {lines + 1}, byte 6 of the line) is 0xe9: not UTF-8"),
                            (fifo, "not a regular file (a FIFO or a device); give the YAML file")):
        status, output = run_cli(capsys, "build", recipe, "--output", tmp_path / "out")
        assert status == 2 and message in " ".join(output.split()) and "invalid YAML" not in output, output


def test_a_temporary_folder_python_read_as_surrogates_is_refused_before_the_export(monkeypatch, tmp_path):
    """A C locale reads a UTF-8 TMPDIR's non-ASCII bytes as lone surrogates: the export failed with torch's argument
    dump."""
    import tempfile

    from compiler.artifact import temporary_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path) + "/tmp_\udcc3\udca9")
    with pytest.raises(BuildError, match=r"has a path that is not UTF-8 as Python reads it .* rename it"):
        temporary_folder()


def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(capsys, tiny_artifact, tmp_path, monkeypatch):
    """A full disk while writing the engines, or the --json of an evaluation, ended in an OSError traceback after
    all the work, the evaluation leaving an empty file behind."""
    def full(graphs, folder, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "weights.bin"))

    monkeypatch.setattr("compiler.build.onnxruntime_backend.write_engines", full)
    status, output = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and "No space left on device" in output and "free space there, or write elsewhere" in output
    assert "Traceback" not in output and list((tmp_path / "out").iterdir()) == []  # the staging folder is gone

    from runtime import results

    previous = tmp_path / "eval.json"
    previous.write_text('{"an": "earlier result"}')

    fdopen = os.fdopen

    class FullFile:
        def __init__(self, descriptor, *args, **kwargs):
            self.file = fdopen(descriptor, *args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, text):
            self.file.write(text[:10])  # some of it, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results.os, "fdopen", FullFile)
    status, output = run_cli(capsys, "eval", tiny_artifact, "--text", "builtin:pydoc-held-out", "--max-tokens", "64",
                             "--json", previous)
    assert status == 2 and f"No space left on device ({previous}): free space there" in output, output
    assert "Traceback" not in output and previous.read_text() == '{"an": "earlier result"}' and sorted(p.name for p in tmp_path.iterdir()) == [
        "eval.json", "out"]  # the earlier file whole, no temporary one beside it


def test_an_output_file_inside_an_artifact_is_refused(capsys, tiny_artifact, monkeypatch):
    """The runtime refuses an artifact holding a file its manifest does not list: eval --json there made the
    artifact unloadable (and --json .../manifest.json replaced its manifest), with status 0."""
    monkeypatch.setattr(cli_evaluate, "_score", lambda *a: pytest.fail("scored before checking --json"))
    for target in (tiny_artifact / "eval.json", tiny_artifact / "manifest.json", tiny_artifact / "runs" / "x.json"):
        for argv in (("eval", tiny_artifact, "--text", "builtin:pydoc-held-out", "--json", target),
                     ("bench", tiny_artifact, "--phase", "decode", "--contexts", "16", "--out", target)):
            status, output = run_cli(capsys, *argv)
            assert status == 2 and "inside the artifact folder" in output, output
    assert not (tiny_artifact / "eval.json").exists() and not (tiny_artifact / "runs").exists()


def test_an_eval_text_is_scored_as_written(capsys, tiny_artifact, tmp_path):
    """CRLF line ends are the file's text (read_text turned them into LF); a UTF-8 byte-order mark is not text."""
    plain, crlf, bom = tmp_path / "plain.txt", tmp_path / "crlf.txt", tmp_path / "bom.txt"
    text = "The quick brown fox\njumps over the lazy dog.\n" * 4
    plain.write_bytes(text.encode())
    crlf.write_bytes(text.replace("\n", "\r\n").encode())
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode())
    scored = {}
    for path in (plain, crlf, bom):
        out = tmp_path / f"{path.stem}.json"
        assert run_cli(capsys, "eval", tiny_artifact, "--text", path, "--json", out)[0] == 0
        scored[path.stem] = json.loads(out.read_text())
    assert {**scored["bom"], "text": None} == {**scored["plain"], "text": None}  # the same tokens and numbers
    assert scored["crlf"]["tokens"] > scored["plain"]["tokens"]


def test_paths_that_look_like_markup_are_printed_as_they_are(capsys, tiny_artifact, tmp_path, monkeypatch):
    """Rich reads "[/x]" as a closing tag: printed as markup, a finished build, eval or compare ended in a
    MarkupError (and eval's --json was never written)."""
    folder = tmp_path / "w[/x]"  # a folder "w[" holding "x]"
    artifact = folder / "tiny[bold]"
    shutil.copytree(tiny_artifact, artifact)
    text = folder / "notes[/x].txt"
    text.parent.mkdir()
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 4)
    status, output = run_cli(capsys, "inspect", artifact)
    assert status == 0 and "Traceback" not in output, output
    out = folder / "eval.json"
    status, output = run_cli(capsys, "eval", artifact, "--text", text, "--json", out)
    squashed = lambda printed: "".join(printed.split())  # noqa: E731  (a table wraps its title to its width)
    assert status == 0 and str(text) in squashed(output) and json.loads(out.read_text())["text"] == str(text), output
    status, output = run_cli(capsys, "compare", artifact, tiny_artifact, "--text", text)
    assert status == 0 and str(text) in squashed(output), output

    def build(recipe, output, progress, dump_dir=None, written=None, swap=None):  # the CLI's printing only: a real
        progress(f"writing engines into {artifact} [/x]")  # build of this recipe is tested elsewhere
        written.update(json.loads((artifact / "manifest.json").read_text()))
        return artifact
    monkeypatch.setattr("compiler.build.build", build)
    status, output = run_cli(capsys, "build", TINY, "--output", folder)
    assert status == 0 and f"built {artifact}" in output, output
    assert any(line.endswith(f"s writing engines into {artifact} [/x]") for line in output.splitlines()), output


@pytest.mark.parametrize("argv, message", [
    (("--phase", "decode", "--contexts", "16", "--steps", "0"), "--steps must be >= 1, got 0"),
    (("--phase", "prefill", "--prompt-lengths", "16", "--runs", "0"), "--runs must be >= 1, got 0"),
])
def test_bench_phase_refuses_zero_steps_or_runs(capsys, tiny_artifact, tmp_path, argv, message):
    status, output = run_cli(capsys, "bench", tiny_artifact, *argv, "--out", tmp_path / "b.json")
    assert status == 2 and message in output, output


@pytest.mark.parametrize("flag", ["--context", "--prompt"])
def test_plan_refuses_a_zero_context_or_prompt(capsys, flag):
    status, output = run_cli(capsys, "plan", TINY, "--device", "H100", flag, "0")
    assert status == 2 and "must be at least 1" in output, output


def test_a_terminated_build_removes_its_temporary_folder(capsys, tmp_path, monkeypatch):
    final = tmp_path / "out" / "tiny-random"

    def build_until_killed(args):
        with staged_folder(final) as folder:
            (folder / "weights.bin").write_bytes(b"x" * 1000)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            pytest.fail("SIGTERM did not stop the build")

    monkeypatch.setattr(cli, "_build", build_until_killed)
    status, output = run_cli(capsys, "build", TINY)
    assert status == 143 and "terminated" in output
    assert list((tmp_path / "out").iterdir()) == []


def test_ctrl_c_during_the_interpreters_exit_ends_it_without_a_traceback():
    """A build that printed "built" and then got Ctrl-C while Python exited (torch's finalizers run then): "Exception
    ignored in atexit callback ... KeyboardInterrupt" and exit status 0 (a review: 1 of 14 late Ctrl-Cs)."""
    script = (
        "import atexit, os, signal, sys, time\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.5)))  # after main's: runs later\n"
        "from compiler.cli import main\n"
        "sys.exit(main(['inspect', 'no-such-artifact']))\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == -signal.SIGINT, (completed.returncode, completed.stderr[-2000:])
    assert "Traceback" not in completed.stderr and "KeyboardInterrupt" not in completed.stderr, completed.stderr


@pytest.mark.parametrize("stop, status, said", [(KeyboardInterrupt, 130, "interrupted"), (cli._Terminated, 143, "terminated")])
def test_a_signal_while_a_module_initialises_is_an_interrupt_not_a_traceback(capsys, monkeypatch, stop, status, said):
    """onnxruntime's import turns a Ctrl-C or SIGTERM during its initialisation into an ImportError."""
    def importing(args):
        try:
            raise stop()
        except KeyboardInterrupt:
            raise ImportError("initialization failed")

    monkeypatch.setattr(cli, "_run", importing)
    code, output = run_cli(capsys, "run", "artifact", "--prompt", "x")
    assert code == status and said in output and "Traceback" not in output


def locked(folder: Path) -> int:
    """What a running build holds on its temporary folder (closing the descriptor releases it)."""
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return descriptor


def aged(folder: Path) -> None:
    """Made a minute ago: a staging folder made a moment ago is spared (it may not be locked yet)."""
    os.utime(folder, (time.time() - 60, time.time() - 60))


def test_a_staging_folder_made_a_moment_ago_is_spared_as_not_locked_yet(tmp_path):
    """Between a build's mkdtemp and its lock, another build starting took its folder for a killed build's, removed
    it and said so."""
    fresh = tmp_path / ".tiny-random.partial-999999999-new"
    fresh.mkdir()
    assert remove_abandoned(tmp_path / "tiny-random") == [] and fresh.exists()
    aged(fresh)
    assert remove_abandoned(tmp_path / "tiny-random") == [fresh]


def test_a_build_removes_what_a_killed_build_left_and_spares_a_running_one(tmp_path):
    """Whether a build runs is its lock, not its process id: a build in another container (another pid space) was
    deleted as it wrote, and a killed build's folder whose pid a container gives every build stayed forever."""
    final = tmp_path / "tiny-random"
    abandoned = tmp_path / f".tiny-random.partial-{os.getpid()}-abc"  # a live pid, but nobody holds it
    running = tmp_path / ".tiny-random.partial-999999999-def"  # no such pid here, but locked by a build elsewhere
    for folder in (abandoned, running):
        folder.mkdir()
        aged(folder)
    lock = locked(running)
    try:
        with staged_folder(final) as folder:
            (folder / "manifest.json").write_text("{}")
            assert remove_abandoned(final) == []  # this build holds its own folder while it writes
    finally:
        os.close(lock)
    assert not abandoned.exists() and running.exists() and (final / "manifest.json").exists()
    assert remove_abandoned(final) == [running] and not running.exists()  # released: that build was killed


def test_without_locks_the_process_id_in_the_name_decides(tmp_path, monkeypatch):
    """A filesystem without flock (ENOLCK): builds still run, and the pid tells running from killed, as before."""
    def no_locks(descriptor, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    final = tmp_path / "tiny-random"
    killed = tmp_path / ".tiny-random.partial-999999999-abc"
    running = tmp_path / f".tiny-random.partial-{os.getpid()}-def"
    for folder in (killed, running):
        folder.mkdir()
        aged(folder)
    with staged_folder(final) as folder:
        (folder / "manifest.json").write_text("{}")
    assert not killed.exists() and running.exists() and (final / "manifest.json").exists()


def test_a_folder_another_build_removes_meanwhile_is_not_locked(tmp_path, monkeypatch):
    """Two builds of one name: a folder the other removed between the glob and the open raised FileNotFoundError
    (in remove_abandoned, or while the finished build swapped itself in, throwing it away); one removed between
    the open and the lock was taken as locked."""
    from compiler import artifact

    assert artifact._try_lock(tmp_path / ".tiny-random.partial-1-gone") is None
    folder = tmp_path / ".tiny-random.partial-1-late"
    folder.mkdir()
    flock = fcntl.flock

    def removed_first(descriptor, operation):
        folder.rmdir()  # the other build's rmtree, just before this lock
        return flock(descriptor, operation)

    monkeypatch.setattr(fcntl, "flock", removed_first)
    assert artifact._try_lock(folder) is None


def test_a_running_build_whose_name_looks_like_an_abandoned_folder_is_spared(tmp_path):
    """The glob `.a.old-*` also matches the staging folder of a build of recipe `a.old-999999999-b`; read
    loosely, its "pid" 999999999 was dead and the running build's folder was removed."""
    lookalike = tmp_path / f".a.old-999999999-b.partial-{os.getpid()}-xyz"
    lookalike.mkdir()
    assert remove_abandoned(tmp_path / "a") == [] and lookalike.exists()


def test_a_stop_between_the_swaps_renames_puts_the_old_artifact_back(tmp_path):
    """Stopped after the old artifact moved aside and before the new one moved in: the next build restores it
    (it deleted it, with the rest of the abandoned folder)."""
    final = tmp_path / "tiny-random"
    old = tmp_path / ".tiny-random.old-999999999-abc" / "tiny-random"  # no such process
    old.mkdir(parents=True)
    (old / "manifest.json").write_text("{}")
    remove_abandoned(final)
    assert (final / "manifest.json").read_text() == "{}" and not old.parent.exists()


def test_an_abandoned_old_copy_does_not_replace_a_newer_artifact(tmp_path):
    """The old copy a stopped swap left aside goes back only where nothing is in place: a later build may have put a
    newer artifact there (a rename onto it would fail, or replace it with the older one)."""
    final = tmp_path / "tiny-random"
    final.mkdir()
    (final / "manifest.json").write_text("newer")
    old = tmp_path / ".tiny-random.old-999999999-abc"  # no such process
    (old / "tiny-random").mkdir(parents=True)
    (old / "tiny-random" / "manifest.json").write_text("older")
    assert remove_abandoned(final) == [old]
    assert (final / "manifest.json").read_text() == "newer" and not old.exists()


def test_without_locks_another_users_build_is_taken_as_running(tmp_path, monkeypatch):
    """os.kill(pid, 0) on another user's process raises PermissionError: the process exists, its folder stays."""
    def no_locks(descriptor, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    kill = os.kill

    def another_users(pid, signal_number):
        if pid == 999999999:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return kill(pid, signal_number)

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(os, "kill", another_users)
    theirs = tmp_path / ".tiny-random.partial-999999999-abc"
    theirs.mkdir()
    assert remove_abandoned(tmp_path / "tiny-random") == [] and theirs.exists()


def test_an_artifact_this_build_cannot_replace_is_refused_first(capsys, tmp_path, monkeypatch):
    (tmp_path / "out" / "tiny-random").mkdir(parents=True)
    access = os.access  # the artifact as a user without write permission on it sees it
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "tiny-random" and access(path, mode))
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    status, output = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and "an artifact this build would replace, and it is not readable and writable by you" in output, output


def test_a_key_given_twice_in_a_recipe_is_refused(capsys, tmp_path):
    recipe = tiny_recipe(tmp_path, "  max_context: 128", "  max_context: 128\n  max_context: 64")
    status, output = run_cli(capsys, "build", recipe, "--output", tmp_path / "out")
    assert status == 2 and "key 'max_context' is given twice in one mapping" in output and "line" in output, output


@pytest.mark.parametrize("old, new, message", [
    ("  - pack_projections", "  - pack_projections\n  - quantize:\n      accuracy_level: 7", "accuracy_level=7"),
    ("  - pack_projections", "  - pack_projections\n  - quantize:\n      max_rewrites: -3", "max_rewrites=-3 must be >= 0"),
    ("max_position_embeddings: 256", "max_position_embeddings: 256\n    architecture: gpt2",
     "architecture: 'gpt2' is not one of llama, mistral, qwen2"),
    # below: each was found only after the export (a traceback, or an error without the key), or never
    ("  - pack_projections", "  - pack_projections:\n      min_group: 1", "min_group: 1 must be >= 2"),
    ("  - lower_onnxruntime ", "  - lower_onnxruntime: {rotary: sideways} ", "'sideways' is not one of"),
    ("  - cleanup", "  - cleanup\n  - fuse_silu: {max_rewrites: -1}", "passes[1].fuse_silu.max_rewrites: -1 must be >= 0"),
    ("      required: true ", "      rotary_cache_length: 16\n      required: true ",
     "rotary_cache_length 16 is below export.max_context (128)"),
    ("      required: true ", "      rotary_cache_length: 100000000\n      required: true ",
     "rotary_cache_length 100000000 exceeds export.max_context (128)"),  # was minutes of table-building, then stored
    ("  - lower_onnxruntime ", "  - quantize: {bits: 4, method: rtn}\n  - lower_onnxruntime ",
     "passes[2] (quantize) comes after passes[1] (fuse_attention): its calibration and the accuracy report"),
    ("  - cleanup", "  - cleanup\n  - fuse_rotary", "passes[2] (fuse_attention) comes after passes[1] (fuse_rotary)"),
    ("  - cleanup", "  - cleanup\n  - pack_projections",
     "passes[2] (fuse_attention) comes after passes[1] (pack_projections)"),
])
def test_more_recipe_values_are_refused_before_the_export(capsys, tmp_path, monkeypatch, old, new, message):
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    status, output = run_cli(capsys, "build", tiny_recipe(tmp_path, old, new), "--output", tmp_path / "out")
    assert status == 2 and message in output, output


@pytest.mark.parametrize("argv, message", [
    (("--threads", "-1"), "-1 is negative"),
    (("--threads", "100000"), "100000 is more than the"),  # it started ~8,500 threads and took 16 GB
    (("--slo-ttft-ms", "-1"), "-1 must be a finite number > 0"),
    (("--slo-ttft-ms", "inf"), "inf must be a finite number > 0"),
])
def test_bench_refuses_negative_threads_or_limits_as_usage_errors(capsys, tiny_artifact, argv, message):
    with pytest.raises(SystemExit) as exit_info:  # argparse's one-line usage error
        main(["bench", str(tiny_artifact), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (("--batch", "4"), "--batch: for --phase prefill or decode (timing one graph), not a served workload"),
    (("--steps", "0"), "--steps: for --phase prefill or decode"),
    (("--phase", "prefill", "--requests", "5", "--slots", "2"),
     "--requests, --slots: they shape a served workload and do not apply to --phase prefill"),
    (("--phase", "decode", "--prompt-tokens", "500"), "--prompt-tokens: it shapes a served workload"),
    (("--phase", "prefill", "--seed", "7"), "--seed: it shapes a served workload"),
    (("--phase", "decode", "--runs", "3"), "--runs: for --phase prefill only, not --phase decode"),
    (("--phase", "prefill", "--contexts", "16"), "--contexts: for --phase decode only, not --phase prefill"),
])
def test_bench_refuses_flags_the_kind_of_run_would_ignore(capsys, tiny_artifact, tmp_path, argv, message):
    """These exited 0 as if used."""
    status, output = run_cli(capsys, "bench", tiny_artifact, *argv, "--out", tmp_path / "b.json")
    assert status == 2 and message in output and not (tmp_path / "b.json").exists(), output


@pytest.mark.parametrize("argv, message", [
    (("--seed", "1"), "--seed: it shapes sampling, but --temperature 0 (the default) decodes greedily"),
    (("--top-k", "50", "--top-p", "0.9"), "--top-k, --top-p: they shape sampling"),
    (("--system", "be brief"), "--system goes with --chat"),
    (("--max-new-tokens", "0"), "--max-new-tokens must be >= 1, got 0"),  # was max_new_tokens, the API's name
])
def test_run_refuses_sampling_flags_greedy_decoding_would_ignore(capsys, tiny_artifact, argv, message):
    """`--top-k 50 --seed 1` and `--seed 2` exited 0 with the same greedy text."""
    status, output = run_cli(capsys, "run", tiny_artifact, "--prompt", "hi", *argv)
    assert status == 2 and message in output, output
    status, output = run_cli(capsys, "run", tiny_artifact, "--prompt", "hi", "--max-new-tokens", "2",
                             "--temperature", "0.7", "--seed", "1", "--top-k", "50")
    assert status == 0, output


def test_messages_name_the_flag_or_what_the_path_is(capsys, tiny_artifact, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    utf16 = tmp_path / "utf16.txt"
    utf16.write_bytes(("The lighthouse keeper lit the lamp.\n" * 20).encode("utf-16-le"))
    gguf_folder = tmp_path / "model.gguf"
    gguf_folder.mkdir()
    recipe = tmp_path / "gguf.yaml"
    recipe.write_text(f"name: g\nmodel:\n  source: gguf\n  path: {gguf_folder}\n")
    for argv, message in [
        (("build", tmp_path), "a folder, not a recipe file; give the YAML file"),
        (("build", recipe, "--output", tmp_path / "out"), "a folder, not a GGUF file; model.path names the .gguf"),
        (("bench", tiny_artifact, "--warmup", "-1", "--out", tmp_path / "b.json"), "--warmup must be >= 0, got -1"),
        (("bench", tiny_artifact, "--prompt-file", empty, "--prompt-tokens", "8", "--out", tmp_path / "b.json"),
         "the prompt text is empty (--prompt-file)"),
        # read until memory ran out: a device is refused unread, as eval's --text
        (("bench", tiny_artifact, "--prompt-file", "/dev/zero", "--out", tmp_path / "b.json"),
         "--prompt-file /dev/zero is not a regular file (a folder, a FIFO or a device)"),
        (("bench", tiny_artifact, "--prompt-file", utf16, "--prompt-tokens", "8", "--out", tmp_path / "b.json"),
         "the prompt text (--prompt-file) looks like UTF-16LE without a byte-order mark"),
        (("eval", tiny_artifact, "--text", "builtin:pydoc-held-out", "--window", "16", "--stride", "0"),
         "--window 16 --stride 0: stride must be between 1 and the window (16)"),
    ]:
        status, output = run_cli(capsys, *argv)
        assert status == 2 and message in output and "Traceback" not in output, (argv, output)


def test_bench_refuses_an_infinite_rate(capsys, tiny_artifact, tmp_path):
    status, output = run_cli(capsys, "bench", tiny_artifact, "--requests", "2", "--arrival", "poisson", "--rate", "inf",
                             "--out", tmp_path / "b.json")
    assert status == 2 and "--rate must be a finite number > 0" in output, output


def test_bench_refuses_a_rate_without_poisson_arrivals(capsys, tiny_artifact, tmp_path):
    status, output = run_cli(capsys, "bench", tiny_artifact, "--requests", "2", "--rate", "3",
                             "--out", tmp_path / "b.json")
    assert status == 2 and "--rate applies to --arrival poisson, not" in output, output


def test_calibration_longer_than_the_cache_is_refused_before_the_export(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    recipe = tiny_recipe(tmp_path, "  - pack_projections", "  - pack_projections\n  - quantize:\n      calibration: {}")
    status, output = run_cli(capsys, "build", recipe, "--output", tmp_path / "out")
    assert status == 2 and "passes[6] (quantize): calibration.length 256 exceeds export.max_context (128)" in output


def test_a_sliding_window_shorter_than_the_context_is_refused(capsys, tmp_path):
    from compiler.frontend.random_init import random_model
    from tests.compiler.test_frontend import TINY, write_hf_folder

    config = dataclasses.replace(TINY, architecture="mistral")
    original = random_model(config, 0)
    write_hf_folder(tmp_path / "m", config, original.state_dict, model_type="mistral", sliding_window=64)
    (tmp_path / "m" / "tokenizer.json").write_text(original.tokenizer_json)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: swa\nmodel: {{source: hf, path: {tmp_path / 'm'}}}\nexport: {{max_context: 128}}\n"
                      f"passes: [cleanup]\n")
    status, output = run_cli(capsys, "build", recipe, "--output", tmp_path / "out")
    assert status == 2 and "sliding window of 64 tokens" in output and "export.max_context to 64" in output, output


def test_a_relative_calibration_text_is_found_beside_the_recipe(tmp_path, monkeypatch):
    from compiler.recipe import load_recipe

    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "notes.txt").write_text("some text\n")
    recipe = tiny_recipe(tmp_path / "recipes", "  - pack_projections",
                         "  - pack_projections\n  - quantize:\n      calibration: {text: notes.txt, length: 32}")
    monkeypatch.chdir(tmp_path)  # not the recipe's folder
    spec = next(p for p in load_recipe(recipe).passes if p.name == "quantize")
    assert spec.options.calibration.text == str(tmp_path / "recipes" / "notes.txt")
    assert load_recipe(TINY).passes[0].name == "cleanup"  # recipes without calibration are unchanged


def test_a_held_out_text_too_short_for_the_accuracy_report_is_refused_before_the_export(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("compiler.build.trace_graphs", lambda *a, **k: pytest.fail("exported"))
    (tmp_path / "one.txt").write_text("abcdefghij")  # 9 byte tokens calibrate, the last 10% holds 1
    recipe = tiny_recipe(tmp_path, "  - pack_projections", "  - pack_projections\n  - quantize:\n      calibration: "
                         f"{{text: {tmp_path / 'one.txt'}, samples: 1, length: 8}}")
    status, output = run_cli(capsys, "build", recipe, "--output", tmp_path / "out")
    assert status == 2 and "accuracy report: its held-out text" in output and "accuracy.enabled: false" in output, output
    (tmp_path / "off.yaml").write_text(recipe.read_text() + "accuracy: {enabled: false}\n")
    monkeypatch.setattr("compiler.build.trace_graphs", lambda *a, **k: (_ for _ in ()).throw(SystemExit("reached")))
    with pytest.raises(SystemExit, match="reached"):  # without the report, the build goes on to the export
        main(["build", str(tmp_path / "off.yaml"), "--output", str(tmp_path / "out")])


@pytest.mark.parametrize("command", ["run", "bench"])
def test_a_negative_seed_is_a_usage_error(capsys, tiny_artifact, command):
    """numpy's generators take seeds >= 0 (before: a ValueError traceback, even for greedy decoding)."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, str(tiny_artifact), *(["--prompt", "hi"] if command == "run" else []), "--seed", "-1"])
    assert exit_info.value.code == 2 and "-1 is negative; give 0 or more" in capsys.readouterr().err


def test_bench_phase_errors_name_the_flag_and_default_sizes_fit_a_small_artifact(capsys, tiny_artifact, tmp_path):
    """The tiny artifact's max context is 128: the default decode contexts (64, 512, ...) keep 64, the prefill
    lengths none, so the largest that fits is timed (before: an error naming no flag, for the defaults)."""
    status, output = run_cli(capsys, "bench", tiny_artifact, "--phase", "decode", "--contexts", "16,500",
                             "--out", tmp_path / "a.json")
    assert status == 2 and "--contexts '16,500': each must be >= 1 and below" in output, output
    status, output = run_cli(capsys, "bench", tiny_artifact, "--phase", "decode", "--steps", "2",
                             "--out", tmp_path / "decode.json")
    assert status == 0, output
    assert [row["context"] for row in json.loads((tmp_path / "decode.json").read_text())["rows"]] == [64]
    status, output = run_cli(capsys, "bench", tiny_artifact, "--phase", "prefill", "--runs", "1",
                             "--out", tmp_path / "prefill.json")
    assert status == 0, output
    assert [row["prompt_tokens"] for row in json.loads((tmp_path / "prefill.json").read_text())["rows"]] == [127]


def test_inspect_on_a_recipe_file_says_what_to_do_with_it(capsys):
    status, output = run_cli(capsys, "inspect", TINY)
    assert status == 2 and "a file, not an artifact folder; it looks like a recipe: build it with `aotlm build" in output


def test_run_into_a_closed_pipe_stops_quietly(tiny_artifact):
    """`aotlm run ... | head -c 5`: the reader leaves early (before: a BrokenPipeError traceback, status 1)."""
    import subprocess
    import sys

    command = (f"{sys.executable} -m compiler.cli run {tiny_artifact} --prompt hello --max-new-tokens 60 "
               f"--threads 1 | head -c 5")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert result.stdout == "hello" and "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 141, result.stderr


def test_run_with_one_output_token_shows_no_tpot(capsys, tiny_artifact):
    status, output = run_cli(capsys, "run", tiny_artifact, "--prompt", "hello", "--max-new-tokens", "1")
    row = next(line for line in output.splitlines() if line.count("│") >= 5 and "ms" not in line and "TTFT" not in line)
    cells = [cell.strip() for cell in row.split("│")[1:-1]]
    assert status == 0 and cells[2] == "-" and cells[3] == "-", output


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_build_and_at_the_prompt(capsys, tmp_path, tiny_artifact):
    """A 300-token model given a 512-token tokenizer: before, the build passed and the first prompt using a high id
    ended in an onnxruntime Gather traceback."""
    from compiler.frontend.random_init import random_model
    from runtime import Engine, RequestError
    from tests.compiler.test_frontend import TINY, write_hf_folder

    small = dataclasses.replace(TINY, vocab_size=300)
    write_hf_folder(tmp_path / "m", small, random_model(small, 0).state_dict)
    (tmp_path / "m" / "tokenizer.json").write_text((tiny_artifact / "tokenizer.json").read_text())  # 512 tokens
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: big-tokenizer\nmodel: {{source: hf, path: {tmp_path / 'm'}}}\nexport: {{max_context: 64}}\n"
                      f"passes: [cleanup]\n")
    status, output = run_cli(capsys, "build", recipe, "--output", tmp_path / "out")
    assert status == 2 and "the tokenizer's ids reach 511, but the model's vocab_size is 300" in output, output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    # an artifact built before this check: its manifest's vocabulary is smaller than its tokenizer's ids
    damaged = shutil.copytree(tiny_artifact, tmp_path / "old")
    manifest = json.loads((damaged / "manifest.json").read_text())
    manifest["model"]["config"]["vocab_size"] = 3
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RequestError, match=r"the tokenizer gave id \d+, outside this model's vocabulary \(0..2\)"):
        Engine.load(damaged).generate("hello there", max_new_tokens=2)


def test_every_file_and_folder_is_flushed_to_disk_before_the_rename_publishes_them(tmp_path, monkeypatch):
    """Without fsync, a power loss after the rename could leave the artifact in place with empty files: the rename
    may reach the disk before their data. Every file and folder is synced first, and the parent after the rename."""
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        fsync(descriptor)

    def recording_replace(source, target):
        events.append(("replace", str(source), str(target)))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    final = tmp_path / "artifact"
    with staged_folder(final) as folder:
        (folder / "weights.bin").write_bytes(b"\0" * 64)
        (folder / "sub").mkdir()
        (folder / "sub" / "manifest.json").write_text("{}")
        staging = str(folder)
    renamed = next(index for index, event in enumerate(events) if event[0] == "replace")
    synced_before = {event[1] for event in events[:renamed]}
    assert synced_before == {staging, f"{staging}/weights.bin", f"{staging}/sub", f"{staging}/sub/manifest.json"}
    assert events[renamed] == ("replace", staging, str(final))
    assert events[renamed + 1:] == [("fsync", str(tmp_path))]


def test_a_filesystem_that_refuses_to_sync_folders_still_builds_and_a_late_sync_error_only_warns(tmp_path, monkeypatch):
    """Some mounts refuse fsync on a folder (EINVAL): every build had failed at its very end. An error flushing the
    parent after the rename had reported a failed build whose new artifact was already in place."""
    fsync = os.fsync
    final = tmp_path / "artifact"

    def refuse_folders(descriptor):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{descriptor}")):
            raise OSError(errno.EINVAL, "Invalid argument")
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", refuse_folders)
    with staged_folder(final) as folder:
        (folder / "manifest.json").write_text('{"format": "aotlm-artifact", "n": "first"}')
    assert "first" in (final / "manifest.json").read_text()

    def fail_on_the_parent(descriptor):
        if os.readlink(f"/proc/self/fd/{descriptor}") == str(tmp_path):
            raise OSError(errno.EIO, "Input/output error")
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fail_on_the_parent)
    with pytest.warns(RuntimeWarning, match=r"could not flush the folder to disk after the rename .*in place"):
        with staged_folder(final) as folder:
            (folder / "manifest.json").write_text('{"format": "aotlm-artifact", "n": "second"}')
    assert "second" in (final / "manifest.json").read_text()


def test_replacing_an_artifact_leaves_only_the_new_one_shared_and_a_failed_swap_puts_the_old_back(tmp_path,
                                                                                                 monkeypatch):
    """The old artifact, moved aside for the swap, is removed after it (not left as a hidden full copy), the new
    one is readable by others (mkdtemp makes it private), and when the second rename fails the old one is put back."""
    final = tmp_path / "artifact"
    with staged_folder(final) as folder:
        (folder / "manifest.json").write_text('{"format": "aotlm-artifact", "n": "first"}')
    with staged_folder(final) as folder:
        (folder / "manifest.json").write_text('{"format": "aotlm-artifact", "n": "second"}')
    assert [p.name for p in tmp_path.iterdir()] == ["artifact"]
    assert "second" in (final / "manifest.json").read_text() and final.stat().st_mode & 0o777 == 0o755
    replace = os.replace
    monkeypatch.setattr(artifact_module, "exchange_folders", lambda first, second: False)  # the two renames' path

    def refuse_the_new_one(source, target):
        if Path(target) == final and ".partial" in str(source):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        replace(source, target)

    monkeypatch.setattr(os, "replace", refuse_the_new_one)
    with pytest.raises(OSError, match="cross-device"):
        with staged_folder(final) as folder:
            (folder / "manifest.json").write_text("third")
    assert "second" in (final / "manifest.json").read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["artifact"]


def test_replacing_an_artifact_is_one_atomic_exchange_where_linux_has_it(tmp_path, monkeypatch):
    """Two renames left the path without an artifact between them: a load in that gap was refused. renameat2's
    RENAME_EXCHANGE swaps the two folders in one step; the old artifact, at the staging name after it, is removed."""
    import ctypes

    first, second = (os.fsencode(tempfile.mkdtemp(dir=tmp_path)) for _ in range(2))
    libc = ctypes.CDLL(None, use_errno=True)  # asked directly, so that a broken exchange_folders cannot skip this
    if not hasattr(libc, "renameat2"):
        pytest.skip("this libc has no renameat2 (staged_folder renames twice here)")
    if libc.renameat2(-100, first, -100, second, 2) != 0:
        assert ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP), os.strerror(ctypes.get_errno())
        pytest.skip("this kernel or filesystem has no RENAME_EXCHANGE (staged_folder renames twice here)")
    for path in list(tmp_path.iterdir()):
        shutil.rmtree(path)
    final = tmp_path / "artifact"
    with staged_folder(final) as folder:
        (folder / "manifest.json").write_text('{"format": "aotlm-artifact", "n": "first"}')
    seen, exchange = [], artifact_module.exchange_folders

    def watched(first, second):
        done = exchange(first, second)
        seen.append(((second / "manifest.json").read_text(), (first / "manifest.json").read_text()))
        return done

    monkeypatch.setattr(artifact_module, "exchange_folders", watched)
    monkeypatch.setattr(os, "replace", lambda *args: pytest.fail(f"renamed {args} instead of exchanging"))
    with staged_folder(final) as folder:
        (folder / "manifest.json").write_text('{"format": "aotlm-artifact", "n": "second"}')
    assert seen == [('{"format": "aotlm-artifact", "n": "second"}', '{"format": "aotlm-artifact", "n": "first"}')]
    assert [p.name for p in tmp_path.iterdir()] == ["artifact"] and final.stat().st_mode & 0o777 == 0o755


def test_an_exchange_the_filesystem_cannot_do_falls_back_and_a_real_failure_is_raised(tmp_path, monkeypatch):
    """exchange_folders: False where the kernel or filesystem has no RENAME_EXCHANGE (then two renames), an OSError
    naming the path for anything else; and a link at the artifact's path is never exchanged (the link itself would
    move, and stay behind as a .partial that rmtree cannot remove)."""
    import ctypes

    class Libc:
        def __init__(self, number):
            self.number = number
            self.renameat2 = self

        def __call__(self, *args):
            ctypes.set_errno(self.number)
            return -1

    for number, unsupported in ((errno.EINVAL, True), (errno.ENOSYS, True), (errno.EXDEV, False),
                                (errno.ENOENT, False)):
        monkeypatch.setattr(ctypes, "CDLL", lambda *args, number=number, **kwargs: Libc(number))
        if unsupported:
            assert artifact_module.exchange_folders(tmp_path / "a", tmp_path / "b") is False
        else:
            with pytest.raises(OSError) as raised:
                artifact_module.exchange_folders(tmp_path / "a", tmp_path / "b")
            assert raised.value.errno == number and raised.value.filename == str(tmp_path / "b")
    monkeypatch.undo()
    elsewhere = tmp_path / "elsewhere" / "art"
    elsewhere.mkdir(parents=True)
    (elsewhere / "manifest.json").write_text('{"format": "aotlm-artifact", "n": "old"}')
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "art").symlink_to(elsewhere)
    monkeypatch.setattr(artifact_module, "exchange_folders", lambda first, second: pytest.fail("exchanged a link"))
    with staged_folder(tmp_path / "out" / "art") as folder:
        (folder / "manifest.json").write_text('{"format": "aotlm-artifact", "n": "new"}')
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["art"]


def test_a_held_out_text_that_repeats_the_calibration_part_is_warned_about_before_the_export(capsys, tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setattr("compiler.build.trace_graphs", lambda *a, **k: (_ for _ in ()).throw(SystemExit("reached")))
    paragraphs = [" ".join(f"word{i}x{j}" for j in range(40)) for i in range(60)]
    (tmp_path / "notes.txt").write_text("\n\n".join(paragraphs + [paragraphs[3]]))  # the last one copies the 4th
    recipe = tiny_recipe(tmp_path, "  - pack_projections", "  - pack_projections\n  - quantize:\n      calibration: "
                         f"{{text: {tmp_path / 'notes.txt'}, samples: 2, length: 32}}")
    with pytest.raises(SystemExit, match="reached"):
        main(["build", str(recipe), "--output", str(tmp_path / "out")])
    captured = capsys.readouterr()
    output = " ".join((captured.out + captured.err).split())
    assert "warning: accuracy report: from its token" in output and "repeats the calibration part" in output, output
    assert "set accuracy.max_tokens to" in output


def test_a_folder_made_at_the_path_during_the_build_is_left_alone(tmp_path, monkeypatch):
    """The check that --output/<name> is an artifact ran at the start only: a folder made there meanwhile (a user's
    notes) was moved aside by the swap and deleted with the old artifact."""
    import compiler.artifact as artifact

    final = tmp_path / "artifact"
    sync = artifact.sync_to_disk

    def someone_writes_there(folder):
        sync(folder)
        final.mkdir()
        (final / "notes.txt").write_text("mine")

    monkeypatch.setattr(artifact, "sync_to_disk", someone_writes_there)
    with pytest.raises(BuildError, match="appeared during the build and is not an aotlm artifact: it is left alone"):
        with staged_folder(final) as folder:
            (folder / "manifest.json").write_text('{"format": "aotlm-artifact"}')
    assert (final / "notes.txt").read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["artifact"]


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_swap_waits_until_the_new_artifact_is_in_place(tmp_path, monkeypatch, number):
    """Between the swap's two renames the path holds no artifact: a Ctrl-C or SIGTERM there had left it so (the
    old one hidden in .NAME.old-*) until the next build. The signal now acts once the swap is done."""
    import compiler.artifact as artifact

    final = tmp_path / "artifact"
    with staged_folder(final) as folder:
        (folder / "manifest.json").write_text('{"format": "aotlm-artifact", "n": "old"}')
    replace = os.replace

    def signalled_after_the_first_rename(source, target):
        replace(source, target)
        if ".old-" in str(target):
            # to this thread, its handler run before raise_signal returns: os.kill may reach another thread, and
            # the handler then ran once the main thread looked, at times after the swap (a flaky failure under load)
            signal.raise_signal(number)

    monkeypatch.setattr(artifact.os, "replace", signalled_after_the_first_rename)
    monkeypatch.setattr(artifact, "exchange_folders", lambda first, second: False)  # the two renames' path
    previous = signal.signal(signal.SIGTERM, cli._terminated)
    try:
        with pytest.raises(KeyboardInterrupt):  # cli._Terminated is one too
            with staged_folder(final) as folder:
                (folder / "manifest.json").write_text('{"format": "aotlm-artifact", "n": "new"}')
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert '"new"' in (final / "manifest.json").read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["artifact"]


def test_an_empty_output_and_a_mount_point_are_refused(capsys, tmp_path, monkeypatch):
    status, output = run_cli(capsys, "build", TINY, "--output", "")
    assert status == 2 and "--output is empty (an unset variable?)" in output, output
    (tmp_path / "tiny-random").mkdir()
    monkeypatch.setattr("os.path.ismount", lambda path: Path(path) == tmp_path / "tiny-random")
    status, output = run_cli(capsys, "build", TINY, "--output", tmp_path)
    assert status == 2 and "is a mount point" in output and "--output a folder on that volume (e.g. " in output


def test_sighup_stops_as_sigterm_does(capsys, monkeypatch):
    """An ssh session that drops sends SIGHUP, whose default ended a build with its temporary folders left."""
    def hung_up(args):
        raise cli._Terminated(signal.SIGHUP)

    monkeypatch.setattr(cli, "_run", hung_up)
    code, output = run_cli(capsys, "run", "artifact", "--prompt", "x")
    assert code == 129 and "hung up" in output


def test_the_artifact_folder_follows_the_umask_as_its_files_do(tmp_path):
    """It was 0o755 whatever the umask: under 002 a group-shared tree got a folder its group could not rebuild into,
    under 077 a world-listable folder of private files."""
    final = tmp_path / "artifact"
    mask = os.umask(0o027)
    try:
        with staged_folder(final) as folder:
            (folder / "manifest.json").write_text('{"format": "aotlm-artifact"}')
    finally:
        os.umask(mask)
    assert final.stat().st_mode & 0o777 == 0o750


def test_a_killed_builds_scratch_folders_are_removed_by_the_next_and_a_running_ones_kept(tmp_path, monkeypatch):
    """Traces went to TemporaryDirectory folders: SIGKILL or the OOM killer left them (a model's weights once or
    twice over) for good. They are locked while a build runs, and a later build removes those no build holds."""
    import tempfile

    from compiler.artifact import remove_abandoned_scratch, scratch_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    abandoned = tmp_path / "aotlm-trace-killed"  # what a killed build leaves: nothing holds its lock
    abandoned.mkdir()
    (abandoned / "model.onnx").write_bytes(b"x" * 100)
    os.utime(abandoned, (time.time() - 60, time.time() - 60))
    (tmp_path / "aotlm-unrelated").mkdir()  # not a build's
    # Made a moment ago and not locked yet: a running build's between its mkdtemp and its lock, taken for a killed one
    (tmp_path / "aotlm-spill-just-made").mkdir()
    glob = Path.glob  # and one a running build removed between the listing and the look at it (FileNotFoundError)
    monkeypatch.setattr(Path, "glob", lambda self, pattern: [*glob(self, pattern), self / pattern.replace("*", "gone")])
    with scratch_folder("spill") as running:
        os.utime(running, (time.time() - 60, time.time() - 60))  # old, but locked
        assert remove_abandoned_scratch() == [abandoned]
        assert running.is_dir() and (tmp_path / "aotlm-unrelated").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aotlm-spill-just-made", "aotlm-unrelated"]


def test_calibration_writes_a_large_graph_to_a_locked_scratch_folder_the_next_build_removes(tiny_artifact, tmp_path,
                                                                                            monkeypatch):
    """For a graph of 1 GiB or more calibration saved the float graph and its weights to a TemporaryDirectory, at the
    build's memory peak: the OOM killer left a copy of the model there that no later build removed."""
    import tempfile

    import numpy as np

    import passes.calibration as calibration_module
    from compiler.artifact import _try_lock
    from compiler.calibration import resolve
    from tests.passes.test_quantize_calibrated import gather_matmul

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(calibration_module, "IN_MEMORY_LIMIT", 0)  # every graph goes through a file, as a large one
    seen = []
    session = calibration_module._session

    def recording(model, options, folder, ort):
        seen.append((Path(folder), _try_lock(Path(folder))))  # None: a running build holds it
        return session(model, options, folder, ort)

    monkeypatch.setattr(calibration_module, "_session", recording)
    spec = calibration_module.CalibrationSpec(text="pydoc", samples=2, length=8, seed=0)
    calibration = resolve(spec, (tiny_artifact / "tokenizer.json").read_text())
    rng = np.random.default_rng(0)
    table = rng.standard_normal((int(calibration.token_ids.max()) + 1, 4)).astype(np.float32)
    calibration_module.collect_statistics(gather_matmul(table, np.ones((4, 2), np.float32)), ["x"], calibration)
    [(folder, lock)] = seen
    assert folder.parent == tmp_path and folder.name.startswith("aotlm-calibration-") and lock is None
    assert not folder.exists()


def test_a_sighup_that_nohup_ignores_stays_ignored(capsys, monkeypatch):
    """main() put its own handler over nohup's SIG_IGN: a build started with nohup ended when the terminal closed."""
    def hung_up_on(args):
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.05)  # a handler, had one been set, would run here

    monkeypatch.setattr(cli, "_run", hung_up_on)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        code, output = run_cli(capsys, "run", "artifact", "--prompt", "x")
        assert code == 0 and "hung up" not in output and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_emoji_codes_in_a_users_text_are_printed_as_written(capsys):
    """rich replaced ":x:" and ":smile:" in a path with emoji: `aotlm build /etc/passwd`'s error read "root❌0:0"."""
    from compiler.cli import main

    assert main(["build", ":x: :smile:"]) == 2
    assert "recipe not found: :x: :smile:" in capsys.readouterr().err


def test_a_build_puts_a_stopped_swaps_artifact_back_before_its_export(tmp_path, monkeypatch, tiny_recipe):
    """It was put back only once the next build wrote its own artifact: one that failed first (a recipe that does not
    fit, an export error) left the path empty, the whole old artifact hidden in .NAME.old-*."""
    import compiler.build

    old = tmp_path / ".tiny-random.old-999999999-abc" / "tiny-random"  # no such process
    old.mkdir(parents=True)
    (old / "manifest.json").write_text("{}")
    said = []

    def export_fails(*args, **kwargs):
        raise RuntimeError("the export failed")

    monkeypatch.setattr(compiler.build, "trace_graphs", export_fails)
    with pytest.raises(RuntimeError, match="the export failed"):
        compiler.build.build(tiny_recipe, tmp_path, progress=said.append)
    assert (tmp_path / "tiny-random" / "manifest.json").read_text() == "{}" and not old.parent.exists()
    assert any(line.startswith(f"removed {old.parent}, left by a build of tiny-random that was killed")
               for line in said), said
