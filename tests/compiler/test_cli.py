"""compiler/cli.py: what `aotlm run`, `inspect`, `bench` and the entry point tell a user, in numbers and lines (bad
input is tests/compiler/test_cli_inputs.py's)."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal

import pytest

from compiler import cli
from compiler.cli import _check_bench_flags, _shortened, main, parser
from tests.compiler.test_cli_inputs import run_cli, wide_console  # noqa: F401 -- wide_console: autouse fixture
from tests.conftest import REPO, edited_copy


def test_a_summary_of_exactly_the_limit_is_whole_and_a_cut_one_ends_on_a_word_not_a_comma():
    assert _shortened("fused=2 layers=30", 17) == "fused=2 layers=30"
    assert _shortened("fused=2 layers=30", 16) == "fused=2 …"
    assert _shortened("a=1, b=2, c=3", 9) == "a=1 …"  # the cut "a=1, b=2," ends on its comma


def test_inspect_checks_every_file_s_size_and_with_verify_its_sha256(capsys, tiny_artifact, tmp_path):
    copy = shutil.copytree(tiny_artifact, tmp_path / "copy")
    data = bytearray((copy / "tokenizer.json").read_bytes())
    data[-2] ^= 1  # same size, other bytes
    (copy / "tokenizer.json").write_bytes(bytes(data))
    assert run_cli(capsys, "inspect", copy)[0] == 0  # sizes only, by default
    status, output = run_cli(capsys, "inspect", copy, "--verify")
    assert status == 2 and f"{copy / 'tokenizer.json'}: sha256 differs from the manifest" in output, output
    (copy / "tokenizer.json").write_bytes(bytes(data[:-1]))
    status, output = run_cli(capsys, "inspect", copy)
    assert status == 2 and f"{len(data) - 1} bytes, but the manifest records {len(data)}" in output, output


def test_run_s_max_context_note_asks_for_as_many_tokens_as_fit(capsys, tiny_artifact):
    """The note's "ask for at most N": N tokens run to the end of the context and stop for --max-new-tokens."""
    status, output = run_cli(capsys, "run", tiny_artifact, "--prompt", "hello", "--max-new-tokens", "500",
                             "--ignore-eos")
    prompt_tokens = int(re.search(r"(\d+) prompt tokens", output).group(1))
    most = int(re.search(r"ask for at most (\d+)", output).group(1))
    assert status == 0 and most == 128 + 1 - prompt_tokens, output
    assert f"a {prompt_tokens}-token prompt leaves room for {most} new tokens" in " ".join(output.split()), output
    status, output = run_cli(capsys, "run", tiny_artifact, "--prompt", "hello", "--max-new-tokens", most,
                             "--ignore-eos")
    assert status == 0 and f"{most} output tokens (length)" in output and "note:" not in output, output


def test_inspect_shows_the_engines_inputs_the_prefill_path_and_each_file_in_mib(capsys, tiny_artifact, tmp_path):
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    status, output = run_cli(capsys, "inspect", tiny_artifact)
    assert status == 0 and "prefill after cached tokens: yes" in output, output
    for phase, engine in manifest["engines"].items():
        inputs = engine["inputs"]
        third = f"{inputs[2]['name']}[{', '.join(map(str, inputs[2]['shape']))}]"  # [batch, total], not ['batch', ...]
        assert f"{third} (+{len(inputs) - 3} kv)" in output, (phase, output)
    name, record = max(manifest["files"].items(), key=lambda item: item[1]["bytes"])
    assert record["bytes"] > 2**20 // 10  # MiB and MB differ in the second decimal
    assert re.search(rf"{re.escape(name)}\s*│\s*{record['bytes'] / 2**20:.2f}\s*│", output), output

    def without_takes_past(manifest):  # an artifact whose prefill graph takes no cache
        del manifest["engines"]["prefill"]["takes_past"]
    status, output = run_cli(capsys, "inspect", edited_copy(tiny_artifact, tmp_path, without_takes_past))
    assert status == 0 and "prefill after cached tokens: no (they run through the decode graph)" in output, output


def test_the_manifest_names_the_commit_that_built_it_and_inspect_says_it(capsys, tiny_artifact):
    """An artifact built before a loader fix carried the same "aotlm 0.1.0" as one built after it (SmolLM2's stop
    set gained <|endoftext|>): the commit tells them apart."""
    import subprocess

    source = json.loads((tiny_artifact / "manifest.json").read_text())["tools"]["aotlm_source"]
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        assert source is None  # no git, or not a checkout: nothing to record
        return
    assert source["commit"] == head and isinstance(source["modified"], bool)
    status, output = run_cli(capsys, "inspect", tiny_artifact)
    version = json.loads((tiny_artifact / "manifest.json").read_text())["tools"]["aotlm"]
    assert status == 0 and f"built by aotlm {version} at commit {head[:12]}" in output, output


def test_inspect_names_the_aotlm_release_of_a_wheels_build(capsys, tiny_artifact, tmp_path):
    """A wheel's build records its version and no commit: inspect said nothing of what built it."""
    import shutil

    copy = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tools"].update(aotlm="0.1.0", aotlm_source=None)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    status, output = run_cli(capsys, "inspect", copy)
    sources = manifest["tools"]["aotlm_sources_sha256"]
    assert status == 0 and f"built by aotlm 0.1.0 (sources sha256 {sources[:12]})\n" in output, output
    assert "at commit" not in output


def test_the_sources_digest_changes_with_any_source_file_and_nothing_else(tmp_path):
    """A wheel's build (pip install .) recorded version 0.1.0 and no commit: every build since looked the same."""
    import shutil

    from compiler.artifact import SOURCE_FOLDERS, sources_sha256

    for folder in SOURCE_FOLDERS:
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    first = sources_sha256(tmp_path)
    (tmp_path / "runtime" / "notes.txt").write_text("not code")
    assert sources_sha256(tmp_path) == first == sources_sha256(REPO)
    (tmp_path / "passes" / "extra.py").write_text("")  # a module added
    assert sources_sha256(tmp_path) != first


def test_source_date_epoch_sets_created_and_a_malformed_one_is_refused(monkeypatch, tmp_path):
    from compiler.artifact import creation_time
    from compiler.errors import BuildError

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert creation_time().isoformat() == "2023-11-14T22:13:20+00:00"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(BuildError, match=r"SOURCE_DATE_EPOCH='yesterday': give the seconds since 1970"):
        creation_time()
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "999999999999")  # year 33658: was a ValueError traceback
    with pytest.raises(BuildError, match=r"SOURCE_DATE_EPOCH='999999999999': a time past what a date can hold"):
        creation_time()


def test_version_prints_the_release(capsys):
    from importlib.metadata import version

    from compiler.cli import main

    with pytest.raises(SystemExit) as exited:  # argparse's --help and --version exit
        main(["--version"])
    output = capsys.readouterr().out
    assert exited.value.code == 0 and output.startswith(f"aotlm {version('aotlm')}"), output


def test_a_change_to_the_runtime_marks_the_source_modified(tmp_path):
    """The build runs runtime/ code (the calibration split, the TensorRT kernels): a change there changed the
    weights while the manifest said modified: false."""
    import subprocess

    from compiler.artifact import source_revision

    clone = tmp_path / "clone"
    try:
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git, or this is not a checkout: nothing to record")
    clean = source_revision(clone)["modified"]
    evaluate = clone / "runtime" / "evaluate.py"
    evaluate.write_text(evaluate.read_text().replace("CALIBRATION_FRACTION = 0.9", "CALIBRATION_FRACTION = 0.5"))
    assert (clean, source_revision(clone)["modified"]) == (False, True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", "--", "runtime"], check=True)
    (clone / "passes" / "extra_constants.py").write_text("")  # imported by a change, never added: the commit
    assert source_revision(clone)["modified"] is True  # alone could not rebuild the artifact


def test_an_aotlm_installed_inside_another_projects_checkout_records_no_commit(monkeypatch, tmp_path):
    """git -C <site-packages> answers for whatever repository holds the folder: another project's, whose ignored
    .venv has aotlm in it, gave that project's HEAD."""
    import subprocess

    from compiler.artifact import source_revision

    def other_project(command, **kwargs):
        if "--show-toplevel" in command:
            return subprocess.CompletedProcess(command, 0, stdout=f"{tmp_path}\n")
        raise AssertionError("read another project's commit")

    monkeypatch.setattr(subprocess, "run", other_project)
    assert source_revision() is None


def test_inspect_summarizes_the_decode_graph_s_quantize_report(capsys, tiny_artifact, tmp_path):
    layers = [{"method": "rtn", "bits": 4, "block_size": 32}] * 3 + [
        {"method": "rtn", "bits": 8, "block_size": 64, "symmetric": False}]
    totals = {"matmuls": 4, "weight_bytes_before": 4 * 2**20, "weight_bytes_after": 2**20,
              "mean_relative_output_error": 0.0123}
    skipped = [{"node": "a", "reason": "kept float by override '*layers.0/*'"}, {"node": "b", "reason": "excluded by "
               "pattern '*lm_head*'"}, {"node": "c", "reason": "B is not a constant weight"}]  # an attention product
    decode = {"layers": layers, "embedding": {"quantized": True, "bits": 8, "block_size": 64}, "totals": totals,
              "skipped": skipped}

    def quantized(report):
        def edit(manifest):  # the prefill graph's report after the decode graph's, and quantizing nothing
            manifest["accuracy"] = {"held_out": {
                "text": "builtin:pydoc (last 10%)", "tokens_scored": 300, "window": 64, "stride": 32,
                "reference_perplexity": 500.0, "perplexity": 510.0, "perplexity_increase": 0.02,
                "top1_agreement": 0.95, "mean_kl": 0.01}}
            manifest["passes"] += [{"name": "quantize", "phase": "decode", "seconds": 1.25, "report": report},
                                   {"name": "quantize", "phase": "prefill", "seconds": 1.0,
                                    "report": {"layers": [], "totals": {"matmuls": 0}}}]
        return edit

    status, output = run_cli(capsys, "inspect", edited_copy(tiny_artifact, tmp_path, quantized(decode)))
    # INT8 is per channel (its report's block 64 is MatMulNBits' repetition of the channel's scale, not a grid)
    assert status == 0 and ("weights: 3 x rtn int4 block 32; 1 x rtn int8 per channel asymmetric; 2 kept float; "
                            "embedding int8 per row; 4.0 -> 1.0 MiB\n") in output, output
    row = next(line for line in output.splitlines() if "quantize" in line and "decode" in line)
    assert "1.25" in row and "matmuls=4, weight_bytes_before=4194304, weight_bytes_after=1048576" in row, row
    assert "mean_relative_output_error" not in output  # errors are the report's, in full: inspect --json
    assert "perplexity: float 500.000 -> quantized 510.000 (+2.00%); top-1 agreement 95.00%" in output, output
    shutil.rmtree(tmp_path / "copy")
    status, output = run_cli(capsys, "inspect", edited_copy(tiny_artifact, tmp_path, quantized({"layers": []})))
    assert status == 0 and "weights: none quantized\n" in output, output


@pytest.mark.parametrize("argv, flag", [
    (["run", "a", "--prompt", "x"], "--max-new-tokens"),
    (["chat", "a"], "--max-new-tokens"),
    (["serve", "a"], "--port"), (["serve", "a"], "--max-queue"), (["serve", "a"], "--shutdown-timeout"),
    (["eval", "a", "--text", "t"], "--max-tokens"), (["compare", "a", "b", "--text", "t"], "--max-tokens"),
    (["bench", "a"], "--requests"), (["bench", "a"], "--seed"), (["bench", "a"], "--warmup"),
    (["bench", "a"], "--prompt-tokens"), (["bench", "a"], "--output-tokens"), (["bench", "a"], "--batch"),
    (["bench", "a", "--phase", "prefill"], "--runs"), (["bench", "a", "--phase", "decode"], "--steps"),
    (["bench", "a", "--phase", "decode"], "--batch"),
])
def test_a_flag_left_out_takes_the_default_its_help_states(argv, flag):
    root = parser()
    args = root.parse_args(argv)
    if argv[0] == "bench":
        _check_bench_flags(args)  # bench fills its defaults once it knows the kind of run
    command = next(action for action in root._actions if action.dest == "command").choices[argv[0]]
    action = next(action for action in command._actions if flag in action.option_strings)
    stated = re.search(r"default:? (\d+(?:\.\d+)?)\b", action.help).group(1)
    assert float(getattr(args, action.dest)) == float(stated), action.help


def test_main_puts_back_the_sigterm_handler_it_found(capsys, tmp_path):
    """main raises SIGTERM as an interrupt while it runs; a program calling it keeps its own handler after."""
    def handler(signum, frame):
        pass
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        assert run_cli(capsys, "inspect", tmp_path)[0] == 2
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("code, filename, said", [
    (errno.EROFS, "/mnt/ro/out.json", "Read-only file system (/mnt/ro/out.json): write elsewhere"),
    (errno.EACCES, "/srv/out", "Permission denied (/srv/out): check its permissions, or write elsewhere"),
    (errno.ENOSPC, None, "No space left on device: free space there, or write elsewhere"),
])
def test_a_refused_write_is_one_line_naming_the_file_and_what_to_do(capsys, monkeypatch, code, filename, said):
    def refused(args):
        raise OSError(code, os.strerror(code), filename)
    monkeypatch.setattr(cli, "_inspect", refused)
    status, output = run_cli(capsys, "inspect", "artifact")
    assert status == 2 and output == f"error: {said}\n", output


def test_other_os_errors_are_not_taken_for_a_refused_write(monkeypatch):
    def missing(args):
        raise OSError(errno.ENOENT, "No such file or directory", "x")
    monkeypatch.setattr(cli, "_inspect", missing)
    with pytest.raises(FileNotFoundError):
        main(["inspect", "artifact"])


@pytest.mark.parametrize("argv, slots", [((), 8), (("--arrival", "concurrency", "--concurrency", "3"), 3),
                                         (("--batching", "continuous", "--batching", "continuous"), 8)])
def test_bench_serves_with_8_slots_or_one_per_client_on_every_core(capsys, tiny_artifact, tmp_path, argv, slots):
    out = tmp_path / "b.json"
    status, output = run_cli(capsys, "bench", tiny_artifact, "--requests", "3", "--prompt-tokens", "8",
                             "--output-tokens", "2", "--warmup", "0", *argv, "--out", out)
    settings = json.loads(out.read_text())["settings"]
    assert status == 0 and settings["slots"] == slots and settings["threads"] == os.cpu_count(), output
    assert settings["backends"] == ["aotlm"] and settings["batching"] == ["continuous"]  # a mode given twice: once


def test_bench_refuses_an_artifact_a_build_replaced_while_it_ran(capsys, tiny_artifact, tmp_path, monkeypatch):
    """It sized the workload from the manifest it read first, loaded whatever was there later, and wrote the hash
    of the manifest on disk at the end: a run of one artifact recorded as another's."""
    from runtime import Engine

    load = Engine.load

    def rebuilt(*args, **kwargs):
        engine = load(*args, **kwargs)
        engine.manifest = {**engine.manifest, "created": "2099-01-01T00:00:00+00:00"}  # another build's
        return engine

    monkeypatch.setattr(Engine, "load", rebuilt)
    status, output = run_cli(capsys, "bench", tiny_artifact, "--requests", "2", "--prompt-tokens", "8",
                             "--output-tokens", "2", "--warmup", "0", "--out", tmp_path / "b.json")
    assert status == 2 and "was replaced (a build finished there) while bench ran; run bench again" in output, output
    assert not (tmp_path / "b.json").exists()


def test_bench_s_default_output_names_the_artifact_and_the_phase(capsys, tiny_artifact, tmp_path, monkeypatch):
    import compiler.plan

    monkeypatch.chdir(tmp_path)  # the machine is not measured (2 s, and ~/.cache written): bench --phase asks it
    monkeypatch.setattr(compiler.plan, "cpu_device", lambda: {"fp32": 1e11, "bandwidth": 1e10, "name": "fake"})
    status, output = run_cli(capsys, "bench", tiny_artifact, "--phase", "decode", "--contexts", "16", "--steps", "2")
    written = tmp_path / "benchmarks" / "results" / "bench-tiny-random-decode.json"
    assert status == 0 and json.loads(written.read_text())["settings"]["phase"] == "decode", output


@pytest.mark.parametrize("command", [["run", "--prompt", "x"], ["chat"]])
@pytest.mark.parametrize("flags, said", [
    (["--temperature", "-1"], "error: --temperature: -1.0 must be a finite number >= 0"),
    (["--temperature", "1", "--top-p", "0"], "error: --top-p: 0.0 must be a number in (0, 1]"),  # the flag, not top_p
    (["--presence-penalty", "3"], "error: --presence-penalty: 3.0 must be a number in [-2, 2]"),
    (["--max-new-tokens", "2", "--min-new-tokens", "3"], "error: --min-new-tokens: 3 must be an integer from 0"),
    (["--stop", ""], "error: --stop: an empty string would stop before any text"),
])
def test_run_and_chat_refuse_bad_sampling_values_before_loading_the_weights(capsys, monkeypatch, chat_artifact,
                                                                             command, flags, said):
    def load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the sampling options were checked")
    monkeypatch.setattr("runtime.Engine.load", load)
    status, output = run_cli(capsys, command[0], chat_artifact[0], *command[1:], *flags)
    assert status == 2 and said in output and "Traceback" not in output, output


def test_inspect_s_summary_is_its_output_on_stdout_and_an_error_stays_on_stderr(capsys, tiny_artifact, tmp_path):
    """`aotlm inspect A > summary.txt` (or `| less`, `| grep`) got nothing: the summary went to stderr."""
    assert main(["inspect", str(tiny_artifact), "--verify"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "max context" in out and "files (sha256 verified)" in out, (out, err)
    assert main(["inspect", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "not an artifact" in err


@pytest.mark.parametrize("damage, raised", [
    (lambda m: m["engines"]["decode"]["inputs"][0].pop("shape"), "KeyError: 'shape'"),
    (lambda m: m["passes"][0]["report"].__setitem__("totals", []), "TypeError"),
    (lambda m: m.__setitem__("recipe", None), "AttributeError"),
    (lambda m: m.__setitem__("accuracy", {"held_out": {"text": "x"}}), "KeyError"),
])
def test_a_damaged_manifest_is_one_error_line_from_inspect_and_plan(capsys, tiny_artifact, tmp_path, damage, raised):
    """read_manifest checks what the runtime needs; the summary and the plan read more (pass reports, accuracy, the
    recipe), and an edit there was a traceback, after half a summary."""
    copy = shutil.copytree(tiny_artifact, tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    damage(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert main(["inspect", str(copy)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "a field the summary reads is missing or malformed" in err and raised in err, err
    assert main(["inspect", str(copy), "--json"]) == 0  # the manifest as it is, to see what went wrong
    if "recipe" in manifest and manifest["recipe"] is None:
        assert main(["plan", str(copy), "--device", "H100"]) == 2
        assert "a field the plan reads is missing or malformed" in capsys.readouterr().err


def test_a_stop_string_that_is_not_utf8_is_refused_as_a_prompt_is(capsys, tiny_artifact):
    """`--stop $'\\xff'` (argv read with surrogateescape) was taken and never matched: decoded text holds no lone
    surrogate, and the same bytes in --prompt or --chat are refused."""
    status, output = run_cli(capsys, "run", tiny_artifact, "--prompt", "hi", "--stop", "ok\udcff")
    assert status == 2 and "error: --stop: 'ok\\udcff' is not valid Unicode at character 2" in output, output


# A static-batching run's summary (session 50's, benchmarks/results/, which a clone does not have), rounded
SATURATED_SUMMARY = json.loads(
    '{"requests": 128, "failed": 0, "duration_s": 94.106, "prompt_tokens": 16384, "output_tokens": 17356,'
    ' "cached_prompt_tokens": 0, "requests_per_s": 1.36, "output_tokens_per_s": 184.43, '
    '"total_tokens_per_s": 358.532, "queued_share": 0.937, "ttft_ms": {"count": 128, "mean": 30440.843, '
    '"median": 31615.238, "p90": 55037.719, "p95": 56007.506, "p99": 63781.302, "max": 64322.809}, '
    '"tpot_ms": {"count": 128, "mean": 37.381, "median": 38.812, "p90": 41.707, "p95": 41.979, "p99": '
    '41.999, "max": 42.075}, "itl_ms": {"count": 17228, "mean": 36.73, "median": 39.07, "p90": 42.33, '
    '"p95": 43.371, "p99": 45.954, "max": 52.928}, "e2e_ms": {"count": 128, "mean": 35384.442, "median": '
    '36706.814, "p90": 59973.619, "p95": 64183.715, "p99": 68117.544, "max": 68818.975}, "queue_ms": '
    '{"count": 128, "mean": 28351.511, "median": 29399.124, "p90": 52878.104, "p95": 53848.062, "p99": '
    '63060.19, "max": 63601.774}, "prefill_ms": {"count": 128, "mean": 2088.942, "median": 2222.886, '
    '"p90": 2275.175, "p95": 2275.175, "p99": 2275.175, "max": 2275.175}}')


@pytest.mark.parametrize("width", [40, 80])
def test_a_result_table_cuts_no_number_or_name_however_narrow_the_console(width):
    """rich's default overflow cut cells with "…": bench's comparison read "│ aot… │ 0.… │ 6.… │" at 80 columns, an
    E2E of 24289.5 ms "24289.…", compare's artifact name lost its "-kv8"."""
    import io

    from rich.table import Table

    from compiler.console import ReaderAwareConsole, print_table
    from runtime.metrics import format_table

    buffer = io.StringIO()
    out = ReaderAwareConsole(file=buffer, width=width)
    print_table(format_table(SATURATED_SUMMARY), out)  # E2E and TTFT of 10 s and more, as bench prints them
    names = Table(title="artifacts")
    for column in ("", "artifact", "TTFT p50 / aotlm-continuous", "perplexity"):
        names.add_column(column)
    names.add_row("B", "smollm2-135m-int4-b64-kv8", "24289.5", "24289.51234")
    print_table(names, out)
    text = buffer.getvalue()
    # each on one line: `grep NAME` on a log found nothing where rich folded the name mid-word, which it did even
    # where the table fit the console (it takes room from the widest columns, words or not)
    assert "…" not in text and "24289.51234" in text and "smollm2-135m-int4-b64-kv8" in text
    # and no column cut off at the console's edge: every row of the table ends in its right border
    rows = [line.rstrip() for line in text.splitlines() if line.startswith(("┏", "┃", "│", "┡", "└"))]
    assert "aotlm-continuous" in text and rows and all(row.endswith(("┓", "┃", "│", "┩", "┘")) for row in rows)


def test_a_table_is_drawn_no_wider_than_its_words_need():
    """Widened until rich's own column widths held every word, a table was drawn ~40 columns past an 80-column
    console (inspect's engines table at 120) and a 40-column one at 59, where 38 hold every word."""
    import io

    from rich.table import Table

    from compiler.console import ReaderAwareConsole, print_table

    for width, most in ((40, 40), (20, 38)):  # fits the console; else the least that keeps each word whole
        buffer = io.StringIO()
        table = Table()
        table.add_column("artifact")
        table.add_column("note")
        table.add_row("tiny-random-int8-rtn-packed", "a b c d e f g h i j k l m")
        print_table(table, ReaderAwareConsole(file=buffer, width=width))
        lines = buffer.getvalue().splitlines()
        assert max(map(len, lines)) == most and any("tiny-random-int8-rtn-packed" in line for line in lines), lines


def test_a_table_s_title_no_wrap_and_max_width_are_kept_and_its_columns_given_back():
    """A path in a title folded mid-word at 40 columns; a no_wrap column's cell was cropped without a mark; a fixed
    width overrode max_width; the widths fixed for one console stayed on the caller's table."""
    import io

    from rich.table import Table

    from compiler.console import ReaderAwareConsole, print_table

    def drawn(table, width):
        buffer = io.StringIO()
        print_table(table, ReaderAwareConsole(file=buffer, width=width))
        return buffer.getvalue()

    path = "held-out/some-rather-long-folder-name-for-texts.txt"
    table = Table(title=f"{path}: 40 tokens")
    table.add_column("artifact", no_wrap=True)
    table.add_column("note", max_width=12)
    table.add_row("tiny random int8", "a b c d e f g h i j k l m n o p")
    text = drawn(table, 40)
    assert path in text and "tiny random int8" in text, text
    assert [column.width for column in table.columns] == [None, None]  # as the caller made them
    assert max(map(len, drawn(table, 200).splitlines())) < 60  # max_width held: not as wide as the room


@pytest.mark.parametrize("environment, interactive", [({"FORCE_COLOR": "1"}, "False"),
                                                      ({"FORCE_COLOR": "1", "TTY_INTERACTIVE": "1"}, "True")])
def test_forced_colour_into_a_log_animates_nothing(tmp_path, environment, interactive):
    """FORCE_COLOR (CI setups set it for coloured logs) made rich animate spinners and bars into the log file, frame
    by frame; TTY_INTERACTIVE still decides where it is set."""
    import subprocess
    import sys

    log = tmp_path / "log"
    with open(log, "w") as stderr:
        shown = subprocess.run([sys.executable, "-c", "from compiler.console import console; "
                                "print(console.is_interactive, console.is_terminal)"], cwd=REPO, stderr=stderr,
                               capture_output=False, stdout=subprocess.PIPE, text=True, check=True,
                               env={**os.environ, **environment}).stdout.split()
    assert shown == [interactive, "True"]  # colours kept (a terminal to rich), animation only where asked


def test_inspect_on_a_narrow_console_keeps_its_order(capsys, tiny_artifact, monkeypatch):
    """A table wider than the console was printed through a console of its own, past inspect's capture: its tables
    came before its header, and an error after them left them printed (inspect prints all or nothing)."""
    monkeypatch.setenv("COLUMNS", "40")
    status, output = run_cli(capsys, "inspect", tiny_artifact)
    title = lambda name: re.search(rf"^\s*{name}\s*$", output, re.M).start()  # noqa: E731 -- a table's title line
    assert status == 0 and output.index("tiny-random  format") < title("engines") < title("passes"), output


def test_bench_writes_no_plots_beside_a_stream(capsys, tiny_artifact, tmp_path, monkeypatch):
    """--out - left --cdf.png and --timeline.png in the working folder (and --phase's --steps.png)."""
    import compiler.plan

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compiler.plan, "cpu_device", lambda: {"fp32": 1e11, "bandwidth": 1e10, "name": "fake"})
    status, output = run_cli(capsys, "bench", tiny_artifact, "--requests", "2", "--prompt-tokens", "8",
                             "--output-tokens", "2", "--warmup", "0", "--out", "-")
    assert status == 0 and '"backends"' in output
    status, output = run_cli(capsys, "bench", tiny_artifact, "--phase", "decode", "--contexts", "16", "--steps", "2",
                             "--out", "-")
    assert status == 0 and '"rows"' in output and list(tmp_path.iterdir()) == []
