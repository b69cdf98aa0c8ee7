"""benchmarks/generate.py's measure_all: the repeats interleave the backends in an order that rotates, each
backend's median run is its own, and a backend that makes the wrong number of tokens is an error."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import generate  # noqa: E402


class Progress:
    def advance(self, task) -> None:
        pass


class Fake:
    def __init__(self, name: str, log: list, seconds: list[float], tokens: int = 3):
        self.name, self.log, self.seconds, self.tokens = name, log, iter(seconds), tokens

    def run(self, prompt_ids, new_tokens):
        self.log.append(self.name)
        end = next(self.seconds)
        return generate.Run(prefill_s=0.1, token_times_s=[end / 2, end * 3 / 4, end][: self.tokens],
                            token_ids=[1, 2, 3][: self.tokens])


def test_runs_interleave_with_a_rotating_order_and_medians_are_per_backend():
    log = []
    backends = {"a": Fake("a", log, [9.0, 1.0, 2.0, 3.0]), "b": Fake("b", log, [9.0, 6.0, 4.0, 5.0]),
                "c": Fake("c", log, [9.0, 7.0, 8.0, 9.0])}
    result = generate.measure_all(backends, [1], 3, 3, Progress(), {name: None for name in backends})
    assert log == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]  # warm-ups, then rotated rounds
    assert [result[name]["median"]["e2e_ms"] for name in "abc"] == [2000.0, 5000.0, 8000.0]
    assert all(len(result[name]["runs"]) == 3 for name in "abc")
    # ratios pair each repeat's runs (b's 6, 4, 5 s over a's 1, 2, 3 s), not one median over another (5 / 2 = 2.5)
    assert generate.paired_ratios(result, "a", keys=("e2e_ms",))["b"]["e2e_ms"] == pytest.approx(2.0)


def test_a_backend_that_stops_early_is_an_error():
    backends = {"ok": Fake("ok", [], [1.0, 1.0]), "short": Fake("short", [], [1.0, 1.0], tokens=2)}
    with pytest.raises(RuntimeError, match="short made 2 tokens, not 3"):
        generate.measure_all(backends, [1], 3, 1, Progress(), {name: None for name in backends})


def test_one_token_has_no_tpot_and_is_refused():
    """TPOT and ITL are gaps between output tokens: a one-token run used to report TPOT 0 and ITL 0 (and a
    division by zero in the table); now the run refuses to make up those numbers, and main() refuses the flag."""
    assert generate.Run(0.1, [0.2, 0.3], [1, 2]).metrics()["tpot_ms"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="no TPOT or ITL"):
        generate.Run(0.1, [0.2], [1]).metrics()


@pytest.mark.parametrize("flags, message", [(["--new-tokens", "1"], "--new-tokens must be >= 2"),
                                            (["--prompt-tokens", "0"], "--prompt-tokens must be >= 1"),
                                            (["--repeats", "0"], "--repeats must be >= 1, got 0")])
def test_main_refuses_runs_too_short_to_time(tiny_artifact, capsys, flags, message):
    with pytest.raises(SystemExit) as stopped:
        generate.main(["--artifact", str(tiny_artifact), "--baselines", "", *flags])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_artifact_is_a_usage_error(tmp_path, capsys):
    """It was a FileNotFoundError traceback from reading manifest.json."""
    with pytest.raises(SystemExit) as stopped:
        generate.main(["--artifact", str(tmp_path / "none"), "--baselines", ""])
    assert stopped.value.code == 2 and "not an artifact folder (no such directory)" in capsys.readouterr().err


def test_a_hugging_face_source_is_compared_from_its_own_folder(tmp_path, monkeypatch):
    """The harness rewrote every model's weights as a folder through hf_writer, which cannot spell a Llama 3.1
    rope scaling (it refuses it): an `hf` source's own folder is what transformers and genai load now."""
    from rich.console import Console

    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setattr(generate, "RESULTS", tmp_path / "results")
    manifest = {"name": "llama", "recipe": {"model": {"source": "hf", "path": str(folder)}}, "model": {"source": {}}}
    hf_folder, _ = generate.prepare_folders(manifest, Console(quiet=True), want_genai=False)
    assert hf_folder == folder and not (tmp_path / "results").exists()


def test_each_run_records_the_cores_other_processes_used_and_the_console_counts_them(monkeypatch):
    """generate.py, quantization.py and batching.py recorded only a load average at the end; a run beside another
    process's work now carries its other_cores (contention.py), and the line counts those above the limit."""
    import contention

    busy = iter([0.0, 0.0, 0.0, 0.9, 0.0, 0.1, 0.0, 0.0])  # machine-wide CPU seconds, before and after each run
    monkeypatch.setattr(contention, "busy_cpu_s", lambda: next(busy))
    monkeypatch.setattr(contention, "own_cpu_s", lambda: 0.0)
    clock = iter(range(100))
    monkeypatch.setattr(contention.time, "perf_counter", lambda: float(next(clock)))
    backends = {"a": Fake("a", [], [1.0, 1.0, 1.0]), "b": Fake("b", [], [1.0, 1.0, 1.0])}
    result = generate.measure_all(backends, [1], 3, 2, Progress(), {name: None for name in backends})
    cores = [run["other_cores"] for name in "ab" for run in result[name]["runs"]]
    # runs in the order a, b, then b, a (rotated), each timed 1 s by the clock
    assert cores == pytest.approx([0.0, 0.0, 0.9, 0.1])  # a's two runs, then b's
    assert contention.contention_line(cores, "timed runs").startswith("contention: 1 of 4 timed runs ran beside")


def fake_genai_builder(monkeypatch, version: str, fail: bool = False) -> list:
    """onnxruntime_genai at `version` whose builder (a subprocess) writes a model file into its -o folder."""
    import subprocess
    import types

    monkeypatch.setitem(sys.modules, "onnxruntime_genai", types.SimpleNamespace(__version__=version))
    commands = []

    def builder(command, **kwargs):
        commands.append(command)
        out = Path(command[command.index("-o") + 1])
        (out / "model.onnx").write_bytes(b"a model")
        (out / "genai_config.json").write_text("{}")
        return subprocess.CompletedProcess(command, 1 if fail else 0, "", "builder log")

    monkeypatch.setattr(generate.subprocess, "run", builder)
    return commands


def test_genai_models_are_cached_under_their_version_and_options(tmp_path, monkeypatch):
    """A folder found by a fixed name was timed after a genai upgrade, or with other builder options, while the
    results named the new version and the options in force."""
    hf_folder = tmp_path / "hf"
    commands = fake_genai_builder(monkeypatch, "0.18.0")
    plain = generate.genai_model(hf_folder, tmp_path, "fp32", Console(quiet=True))
    assert plain.name == "genai-0.18.0-fp32-cpu"
    assert generate.genai_model(hf_folder, tmp_path, "fp32", Console(quiet=True)) == plain  # not built again
    pruned = generate.genai_model(hf_folder, tmp_path, "fp32", Console(quiet=True), prune_lm_head="true")
    assert pruned.name == "genai-0.18.0-fp32-cpu-prune_lm_head-true" and len(commands) == 2
    assert commands[1][-2:] == ["--extra_options", "prune_lm_head=true"]
    record = generate.genai_build_record(pruned)
    assert record["extra_options"] == {"prune_lm_head": "true"} and record["onnxruntime_genai"] == "0.18.0"
    assert record["files_sha256"] == {"model.onnx": hashlib.sha256(b"a model").hexdigest()}
    assert str(pruned) in record["builder_command"]  # the folder it is used from, not the temporary one

    fake_genai_builder(monkeypatch, "0.19.0")
    assert generate.genai_model(hf_folder, tmp_path, "fp32", Console(quiet=True)).name == "genai-0.19.0-fp32-cpu"


def test_a_failed_genai_build_leaves_no_folder_to_be_taken_for_a_model(tmp_path, monkeypatch):
    fake_genai_builder(monkeypatch, "0.18.0", fail=True)
    with pytest.raises(SystemExit, match="builder failed:\n.*builder log"):
        generate.genai_model(tmp_path / "hf", tmp_path, "int4", Console(quiet=True))
    assert list(tmp_path.iterdir()) == []  # the cache folder holds no partial build


def test_glibc_huge_pages_cannot_restart_a_function_call_and_is_a_no_op_once_set(monkeypatch, capsys):
    """The tunable is read when the process starts: set from inside, it would change nothing and say nothing."""
    import argparse

    parser = argparse.ArgumentParser(prog="phases.py")
    monkeypatch.setattr(generate.os, "execve", lambda *a: pytest.fail("replaced the test's process"))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    version = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else None
    recent = version is not None and tuple(map(int, version.split()[-1].split(".")[:2])) >= (2, 35)
    with pytest.raises(SystemExit):
        generate.glibc_huge_pages(parser, ["--glibc-huge-pages"])
    error = capsys.readouterr().err
    assert ("starts the script again" if recent else "needs glibc 2.35 or later") in error, (version, error)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
    generate.glibc_huge_pages(parser, ["--glibc-huge-pages"])  # already in force: returns
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")  # the run would go without, recorded as with
    with pytest.raises(SystemExit):
        generate.glibc_huge_pages(parser, ["--glibc-huge-pages"])
    assert "turns them off" in capsys.readouterr().err
