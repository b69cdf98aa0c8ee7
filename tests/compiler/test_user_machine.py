"""What a user's machine has: no usable temporary folder, a TMPDIR Python passes over, an artifact reached through a
link, a team's setgid folder, a sticky (/tmp-like) folder, `--output=~/...`, a file-size limit, a home folder
onnxruntime should not write to, a terminal that is not UTF-8."""
from __future__ import annotations

import errno
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from compiler import cli
from compiler.artifact import staged_folder, temporary_folder
from compiler.cli import main
from compiler.errors import BuildError
from tests.compiler.test_cli_inputs import TINY, run_cli, wide_console  # noqa: F401 -- wide_console: autouse


def test_no_writable_temporary_folder_is_one_line_before_the_model_loads(capsys, tmp_path, monkeypatch):
    """A read-only root with TMPDIR unset: Python's FileNotFoundError came out as a traceback after the model loaded."""
    def none_usable():
        raise FileNotFoundError(errno.ENOENT, "No usable temporary directory found in ['/tmp', '/var/tmp']")

    monkeypatch.setattr(tempfile, "gettempdir", none_usable)
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and "no writable temporary folder" in text and "set TMPDIR" in text, text
    assert "Traceback" not in text


def test_a_tmpdir_python_passes_over_is_warned_of(tmp_path, monkeypatch):
    """TMPDIR naming a folder that is not there: Python silently took /tmp (or, with /tmp read-only, the current
    folder, which then got the model's traces)."""
    monkeypatch.setattr(tempfile, "tempdir", None)  # recomputed from TMPDIR (restored after the test)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "scratch-typo"))
    folder, warning = temporary_folder()
    assert folder != tmp_path / "scratch-typo" and warning is not None
    assert f"TMPDIR={tmp_path / 'scratch-typo'} is not a writable folder" in warning and str(folder) in warning
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert temporary_folder() == (tmp_path, None)


def test_a_linked_artifact_in_a_team_folder_named_with_a_tilde_is_rebuilt_where_the_link_leads(capsys, tmp_path,
                                                                                             tiny_artifact,
                                                                                             monkeypatch):
    """Three things a user's setup has, in one build:
    - `--output=~/out` (bash leaves ~ alone after `=`) made a folder named ~ in the working folder;
    - <output>/<name> a link to a bigger disk was replaced by a plain folder, the old artifact left behind there;
    - in a setgid (team) folder the artifact lost the bit, so its files lost the team's group."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    disk = tmp_path / "disk"
    disk.mkdir()
    disk.chmod(0o2775)  # setgid: what is made inside takes the folder's group
    shutil.copytree(tiny_artifact, disk / "tiny-random")
    old_created = json.loads((disk / "tiny-random" / "manifest.json").read_text())["created"]
    (tmp_path / "home" / "out").mkdir(parents=True)
    (tmp_path / "home" / "out" / "tiny-random").symlink_to(disk / "tiny-random")
    status, text = run_cli(capsys, "build", TINY, "--output=~/out")
    assert status == 0, text
    assert not (tmp_path / "~").exists()
    link = tmp_path / "home" / "out" / "tiny-random"
    assert link.is_symlink() and link.resolve() == disk / "tiny-random"
    manifest = json.loads((disk / "tiny-random" / "manifest.json").read_text())
    assert manifest["created"] != old_created
    assert (disk / "tiny-random").stat().st_mode & stat.S_ISGID
    assert sorted(path.name for path in disk.iterdir()) == ["tiny-random"]  # no staging or old copy left


def test_a_linked_artifact_whose_swap_was_killed_is_named_and_put_back_by_the_next_build(capsys, tmp_path,
                                                                                         tiny_artifact, monkeypatch):
    """A build killed between its swap's renames, where <output>/<name> is a link: the old artifact sat whole in
    .TARGET.old-*/TARGET, the link dangled, a load said only "no such directory", and the next build refused the
    dangling link before putting the artifact back, leaving a full copy of the weights hidden for good."""
    from runtime import ArtifactError, Engine

    disk = tmp_path / "disk"
    retired = disk / ".tiny-random.old-99-abcd"
    retired.mkdir(parents=True)
    shutil.copytree(tiny_artifact, retired / "tiny-random")
    (disk / ".tiny-random.partial-99-efgh").mkdir()  # the new one, never renamed in, a minute ago
    os.utime(disk / ".tiny-random.partial-99-efgh", (os.path.getmtime(disk) - 60,) * 2)
    (tmp_path / "out").mkdir()
    link = tmp_path / "out" / "tiny-random"
    link.symlink_to(disk / "tiny-random")
    with pytest.raises(ArtifactError, match=rf"tiny-random is a link to {disk}/tiny-random; .*stopped while it "
                                            rf"replaced it, .*whole at .*\.tiny-random\.old-99-abcd/tiny-random"):
        Engine.load(link)

    def loaded_up_to_here(*args, **kwargs):
        raise BuildError("stopped after the checks")

    monkeypatch.setattr("compiler.build.load_model", loaded_up_to_here)
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and "stopped after the checks" in text and "remove the link" not in text, text
    assert "left by a build of" in text and (disk / "tiny-random" / "manifest.json").is_file()
    assert sorted(path.name for path in disk.iterdir()) == ["tiny-random"]
    Engine.load(link).close()


def test_an_artifact_another_user_owns_in_a_sticky_folder_is_refused_before_the_export(capsys, tmp_path,
                                                                                      monkeypatch):
    """In a 1777 folder only an artifact's owner (or the folder's) may rename it away: the swap failed after the whole
    build, and left its old-copy folder behind."""
    out = tmp_path / "out"
    (out / "tiny-random").mkdir(parents=True)
    (out / "tiny-random" / "manifest.json").write_text('{"format": "aotlm-artifact"}')
    out.chmod(0o1777)
    monkeypatch.setattr(os, "geteuid", lambda: 54321)  # another user than the owner of both
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    status, text = run_cli(capsys, "build", TINY, "--output", out)
    assert status == 2 and "only a file's owner may move it (the sticky bit" in text, text


def test_a_swap_refused_at_its_first_rename_leaves_no_folder_behind(tmp_path, monkeypatch):
    final = tmp_path / "artifact"
    final.mkdir()
    old = '{"format": "aotlm-artifact"}'
    (final / "manifest.json").write_text(old)
    replace = os.replace

    def refused(source, destination):
        if Path(source) == final:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(final))
        return replace(source, destination)

    monkeypatch.setattr(os, "replace", refused)
    monkeypatch.setattr("compiler.artifact.exchange_folders", lambda first, second: False)  # the two renames' path
    with pytest.raises(PermissionError):
        with staged_folder(final) as folder:
            (folder / "manifest.json").write_text("new")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["artifact"]
    assert (final / "manifest.json").read_text() == old


def test_a_file_size_limit_is_one_line_naming_it(capsys, tmp_path, monkeypatch):
    """ulimit -f, or FAT32's 4 GiB largest file, when weights.bin is written: EFBIG was a traceback."""
    def too_large(*args, **kwargs):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr("compiler.build.build", too_large)
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and "File too large" in text and "ulimit -f" in text and "Traceback" not in text, text
    assert f"({tmp_path / 'out'}, where the artifact is written" in text, text  # which disks the build writes


def test_onnxruntime_writes_nothing_under_the_home_folder(tmp_path):
    """onnxruntime 1.32 records every import in ~/.cache/Microsoft/.../onnxruntime.db (and warns on each command where
    HOME is read-only): aotlm's packages turn that off unless the user set ORT_DISABLE_TELEMETRY."""
    home = tmp_path / "home"
    home.mkdir()
    environment = {key: value for key, value in os.environ.items() if key != "ORT_DISABLE_TELEMETRY"}
    for package in ("runtime", "passes", "compiler"):
        subprocess.run([sys.executable, "-c", f"import {package}, onnxruntime"], env={**environment, "HOME": str(home)},
                       cwd=Path(__file__).resolve().parents[2], check=True, timeout=120)
    assert list(home.rglob("*")) == []


def test_a_terminal_that_is_not_utf8_gets_replacement_characters_not_a_traceback(tiny_artifact):
    """PYTHONIOENCODING=latin-1 (or a Latin-1 locale): the tiny model's text held a character Latin-1 lacks, and `run`
    died mid-generation with UnicodeEncodeError."""
    result = subprocess.run([sys.executable, "-m", "compiler.cli", "run", str(tiny_artifact), "--prompt", "hi \u2026",
                             "--max-new-tokens", "40", "--threads", "1"], capture_output=True,
                            env={**os.environ, "PYTHONIOENCODING": "latin-1"}, cwd=Path(__file__).resolve().parents[2],
                            timeout=120)
    assert result.returncode == 0 and b"Traceback" not in result.stderr, result.stderr.decode("latin-1")[-2000:]
    assert b"hi ?" in result.stdout  # the prompt's ellipsis, which Latin-1 has no byte for


def test_a_terminal_that_hung_up_is_a_hang_up_not_a_traceback(capsys, monkeypatch, tiny_artifact):
    """ssh dropped: the terminal's reads and writes fail with EIO (chat's readline at the prompt, run's newline after
    an interrupt): a 30-line traceback and status 1, where a hang-up is 129."""
    import argparse

    def hung_up(args):
        raise OSError(errno.EIO, "Input/output error")

    parsed = argparse.Namespace(handler=hung_up, command="chat")
    monkeypatch.setattr(cli, "parser", lambda: type("P", (), {"parse_args": lambda self, argv: parsed})())
    monkeypatch.setattr(cli, "_on_a_terminal", lambda: True)
    assert main(["chat", str(tiny_artifact)]) == 129
    assert "Traceback" not in capsys.readouterr().err
    monkeypatch.setattr(cli, "_on_a_terminal", lambda: False)  # a disk's EIO is not a hang-up
    with pytest.raises(OSError):
        main(["chat", str(tiny_artifact)])


def test_a_deleted_working_folder_is_one_line_for_every_command(capsys, tmp_path, monkeypatch):
    """bench's output check, plan's hints and torch (a oneMKL fatal error) failed their own ways in a folder another
    shell removed; run named it."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    for argv in (["plan", "x.yaml", "--device", "H100"], ["bench", "art", "--out", "b.json"], ["build", str(TINY)]):
        status, text = run_cli(capsys, *argv)
        assert status == 2 and "the working folder was deleted" in text and "Traceback" not in text, text


def test_notices_survive_a_gone_stderr_and_a_gone_stdout_ends_as_a_closed_pipe(capsys, monkeypatch, tiny_artifact):
    """A notice written to a terminal that hung up (EIO) raised; `aotlm inspect | head` exits 141 as any writer into a
    closed pipe (rich's own answer was status 1, and /dev/null over stdout whichever stream broke)."""
    from compiler.console import ReaderAwareConsole, message

    class Broken:
        def __init__(self, error):
            self.error = error

        def write(self, text):
            raise self.error

        def flush(self):
            raise self.error

    hung_up = OSError(errno.EIO, "Input/output error")
    message("a notice", ReaderAwareConsole(file=Broken(hung_up), stderr=True, emoji=False))
    with pytest.raises(OSError):  # stdout's line is the command's output: main says why it stopped (status 129)
        message("a report line", ReaderAwareConsole(file=Broken(hung_up), emoji=False))
    stdout = ReaderAwareConsole(file=Broken(BrokenPipeError(errno.EPIPE, "Broken pipe")), emoji=False)
    with pytest.raises(BrokenPipeError):
        stdout.print("a table row")
    monkeypatch.setattr(cli, "ReaderAwareConsole", lambda **kwargs: ReaderAwareConsole(
        file=Broken(BrokenPipeError(errno.EPIPE, "Broken pipe")), emoji=False))
    monkeypatch.setattr(os, "dup2", lambda *args: None)  # (the real one would point this process's stdout at null)
    assert main(["inspect", str(tiny_artifact)]) == 141


def test_the_stop_signals_are_held_while_their_handlers_are_restored(monkeypatch, tiny_artifact, capsys):
    """A second Ctrl-C between two restores was a traceback from main's finally."""
    import signal

    calls = []
    mask = signal.pthread_sigmask
    monkeypatch.setattr(signal, "pthread_sigmask", lambda how, numbers: calls.append((how, set(numbers))) or
                        mask(how, numbers))
    assert main(["inspect", str(tiny_artifact)]) == 0
    held = [numbers for how, numbers in calls if how == signal.SIG_BLOCK]
    assert held and {signal.SIGINT, signal.SIGTERM} <= held[-1]


def test_a_run_artifact_path_may_start_with_a_tilde(capsys, monkeypatch, tiny_artifact, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(tiny_artifact, home / "art")
    monkeypatch.setenv("HOME", str(home))
    status, text = run_cli(capsys, "run", "~/art", "--prompt", "hi", "--max-new-tokens", "2")
    assert status == 0, text


def test_links_into_an_artifact_or_onto_a_mount_point_are_refused_before_the_export(capsys, tmp_path, monkeypatch,
                                                                                    tiny_artifact):
    """<output>/<name> a link into another artifact wrote the new one inside it (breaking it); a link onto a mount
    point passed the mount-point check (which looked at the link), and the swap failed after the whole export."""
    monkeypatch.setattr("compiler.build.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    other = shutil.copytree(tiny_artifact, tmp_path / "art")
    (other / "sub").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tiny-random").symlink_to(other / "sub")
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and f"inside the artifact folder {other}" in text, text
    disk = tmp_path / "disk"
    disk.mkdir()
    (tmp_path / "out" / "tiny-random").unlink()
    (tmp_path / "out" / "tiny-random").symlink_to(disk)
    ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == disk or ismount(path))
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and "is a mount point" in text, text


def test_a_tmpdir_link_loop_is_warned_of_and_a_keep_alive_past_the_bound_is_a_usage_error(tmp_path, monkeypatch,
                                                                                          capsys):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "loop"))
    folder, warning = temporary_folder()  # (Path.resolve raised RuntimeError: a traceback)
    assert warning is not None and "is not a writable folder" in warning
    with pytest.raises(SystemExit):
        main(["serve", "/nonexistent", "--keep-alive-timeout", "1000000"])
    assert "must be below 1,000,000 seconds" in capsys.readouterr().err


def test_the_warnings_hook_passes_on_names_that_are_no_path():
    shown = []
    hook = cli._one_line_warnings(lambda *args: shown.append(args[2]))
    hook("x", UserWarning, "<frozen importlib._bootstrap>", 1)
    assert shown == ["<frozen importlib._bootstrap>"]


@pytest.mark.parametrize("unbuffered", ["1", ""])
@pytest.mark.parametrize("command", [["inspect", "{artifact}", "--json"], ["--help"], ["run", "--help"]])
def test_standard_output_on_a_full_disk_is_one_line_naming_it(tiny_artifact, unbuffered, command):
    """`aotlm inspect --json > file` on a full disk: one line naming standard output, status 2. argparse dropped the
    failure of --help's text: nothing written, status 0."""
    with open("/dev/full", "w") as full:  # every write there fails with ENOSPC
        result = subprocess.run([sys.executable, "-m", "compiler.cli",
                                 *(word.format(artifact=tiny_artifact) for word in command)],
                                stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
                                env={**os.environ, "PYTHONUNBUFFERED": unbuffered},
                                cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == ("error: No space left on device (standard output): free space there, or write "
                             "elsewhere\n")


def test_a_short_write_to_standard_output_writes_on_until_all_is_written(monkeypatch):
    """Under PYTHONUNBUFFERED Python's stdout dropped what a short write left (a nearly full disk took 4096 of
    23978 bytes and the command exited 0); its replacement writes on."""
    from compiler.console import _WholeWrites

    reader, writer = os.pipe()
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda descriptor, data: real_write(descriptor, bytes(data[:7])))
    stream = io.TextIOWrapper(_WholeWrites(writer), encoding="utf-8", write_through=True)
    text = json.dumps({"layers": list(range(300))})
    stream.write(text)
    monkeypatch.undo()
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        assert pipe.read().decode() == text


def aotlm(*argv, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compiler.cli", *map(str, argv)], stderr=subprocess.PIPE, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2], **popen)


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_report_on_stdout_that_cannot_be_written_fails_the_command(tiny_artifact, unbuffered):
    """plan, eval and compare print their report through a console that dropped every write error: `aotlm plan A >
    result.txt` on a full disk exited 0 with an empty file, and into a closed pipe 0, not 141. With stdout buffered
    (PYTHONUNBUFFERED unset), a report smaller than the buffer failed only at Python's exit flush: status 120 and a
    traceback."""
    environment = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    scored = ("--text", "builtin:pydoc-held-out", "--max-tokens", "64")
    for argv in (("plan", tiny_artifact, "--device", "H100"), ("plan", tiny_artifact, "--device", "H100", "--json"),
                 ("inspect", tiny_artifact), ("--version",), ("eval", tiny_artifact, *scored),
                 ("compare", tiny_artifact, tiny_artifact, *scored)):  # eval's and compare's tables: print_table
        with open("/dev/full", "w") as full:
            result = aotlm(*argv, stdout=full, env=environment)
        assert result.returncode == 2, (argv, result.stderr)
        assert result.stderr.endswith("error: No space left on device (standard output): free space there, or write "
                                      "elsewhere\n"), (argv, result.stderr)  # after eval's progress line
        assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
    reader, writer = os.pipe()
    os.close(reader)
    try:
        result = aotlm("plan", tiny_artifact, "--device", "H100", stdout=writer, env=environment)
        version = aotlm("--version", stdout=writer, env=environment)
    finally:
        os.close(writer)
    assert result.returncode == 141 and version.returncode == 141 and "Traceback" not in version.stderr


def test_closed_standard_streams_are_a_line_or_the_end_of_input_not_a_traceback(tiny_artifact, chat_artifact):
    closed_stdout = aotlm("run", tiny_artifact, "--prompt", "hi", preexec_fn=lambda: os.close(1))
    assert closed_stdout.returncode == 2 and closed_stdout.stderr == (
        "error: standard output is closed (>&-); redirect it to a file or /dev/null\n")
    closed_stderr = subprocess.run([sys.executable, "-m", "compiler.cli", "run", str(tiny_artifact), "--prompt", "hi",
                                    "--max-new-tokens", "3"], capture_output=True, text=True, timeout=120,
                                   cwd=Path(__file__).resolve().parents[2], preexec_fn=lambda: os.close(2))
    assert closed_stderr.returncode == 0 and closed_stderr.stdout.startswith("hi")
    # a usage error with stderr closed: 2, as every usage error (argparse's own writer skips a missing stream)
    usage = subprocess.run([sys.executable, "-m", "compiler.cli", "--bogus"], capture_output=True, text=True,
                           timeout=120, cwd=Path(__file__).resolve().parents[2], preexec_fn=lambda: os.close(2))
    assert usage.returncode == 2 and "Traceback" not in usage.stdout, usage.stdout
    closed_stdin = aotlm("chat", chat_artifact[0], stdout=subprocess.PIPE, preexec_fn=lambda: os.close(0))
    assert closed_stdin.returncode == 0 and "Traceback" not in closed_stdin.stderr, closed_stdin.stderr


def test_a_disk_without_room_is_refused_before_the_export_with_sizes(capsys, tmp_path, monkeypatch):
    """A full output disk was found only when the artifact was written, after the export and every pass (minutes for
    a large model), in a line naming two folders and no sizes."""
    import shutil as shutil_module
    from compiler import artifact

    traced = []
    monkeypatch.setattr("compiler.build.trace_graphs", lambda *a, **k: traced.append(1))
    real_usage = shutil_module.disk_usage
    free = {"out": 100_000, "tmp": 10**12}

    def usage(folder):
        taken = "out" if Path(folder).resolve() == (tmp_path / "out").resolve() else "tmp"
        return real_usage(folder)._replace(free=free[taken])
    monkeypatch.setattr(artifact.shutil, "disk_usage", usage)
    (tmp_path / "out").mkdir()
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and traced == [] and list((tmp_path / "out").iterdir()) == [], text
    assert f"error: the artifact's weights need about 545.2 KiB in {tmp_path / 'out'}, and 97.7 KiB are free" in text
    free.update(out=10**12, tmp=100_000)
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and traced == [] and "the traced graphs (two copies of the weights) need about 1.1 MiB" in text


@pytest.mark.parametrize("number, strerror, fix", [(errno.ENOSPC, "No space left on device", "free space there"),
                                                   (errno.EFBIG, "File too large", "a file-size limit (ulimit -f)")])
def test_a_full_temporary_folder_during_the_export_is_named(capsys, tmp_path, monkeypatch, number, strerror, fix):
    """The exporter's ENOSPC became "export of the prefill graph failed: [Errno 28] ...", naming no folder; so did
    `ulimit -f`'s EFBIG (a review: "export of the prefill graph failed: [Errno 27] File too large")."""
    import torch

    def full(*args, **kwargs):
        raise OSError(number, strerror)
    monkeypatch.setattr(torch.onnx, "export", full)
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 2 and "Traceback" not in text, text
    assert (f"{strerror} ({tempfile.gettempdir()}, the temporary folder where the prefill graph is traced "
            f"(TMPDIR)): {fix}") in text, text


def test_a_pass_dump_the_disk_refused_leaves_no_cut_short_graph(tmp_path, monkeypatch):
    import onnx

    from compiler.pipeline import dump_model

    def full(model, path, **kwargs):
        Path(path).write_bytes(b"\x08\x07partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(onnx, "save_model", full)
    with pytest.raises(OSError) as raised:
        dump_model(onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [])), str(tmp_path / "00-x.onnx"))
    assert raised.value.filename == str(tmp_path / "00-x.onnx") and list(tmp_path.iterdir()) == []


def test_a_build_without_the_memory_its_peak_needs_is_warned_before_the_export(capsys, tmp_path, monkeypatch):
    """A build past the memory left was ended by the OOM killer minutes in, with no word before."""
    import runtime.onnxruntime_backend as backend

    monkeypatch.setattr(backend, "available_memory_bytes", lambda: 100_000)
    monkeypatch.setattr("compiler.build.trace_graphs", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 130 and "warning: this build's peak holds about 3 to 5 times the model's float32 weights" in text
    assert "97.7 KiB more is available now" in text and "it may be killed partway (the OOM killer)" in text
    monkeypatch.setattr(backend, "available_memory_bytes", lambda: 10**12)
    status, text = run_cli(capsys, "build", TINY, "--output", tmp_path / "out")
    assert status == 130 and "peak holds" not in text


def test_a_killed_builds_leftovers_are_removed_before_the_disk_is_checked(capsys, tmp_path, monkeypatch):
    """The check counted a killed build's traces (twice the weights in TMPDIR) as taken, and refused the build that
    would have removed them."""
    order = []
    monkeypatch.setattr("compiler.build.remove_abandoned_scratch", lambda: order.append("removed") or [])
    monkeypatch.setattr("compiler.build.check_disk_room", lambda *args: order.append("checked"))
    monkeypatch.setattr("compiler.build.trace_graphs", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert run_cli(capsys, "build", TINY, "--output", tmp_path / "out")[0] == 130
    assert order[0] == "removed" and "checked" in order
