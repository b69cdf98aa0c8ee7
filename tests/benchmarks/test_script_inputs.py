"""Bad input to benchmarks/*.py and `aotlm bench --baseline`: refused in one line before anything is loaded or measured
(each of these was a traceback, or a refusal after the measurement), and what a run reports of itself."""
from __future__ import annotations

import os
import sys

import pytest

from tests.compiler.test_cli_inputs import run_cli, wide_console  # noqa: F401 -- wide_console: autouse fixture
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import chunked_prefill  # noqa: E402
import generate  # noqa: E402
import huge_pages  # noqa: E402
import kv_cache_attention  # noqa: E402
import matmul_limits  # noqa: E402
import phases  # noqa: E402


def no_engine(monkeypatch):
    """Engine.load fails the test: the point is that nothing was loaded (let alone measured) before the error."""
    from runtime.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("loaded before the check")))


@pytest.mark.parametrize("baseline, module", [("onnxruntime-genai", "onnxruntime_genai"), ("transformers", "transformers")])
def test_bench_refuses_a_missing_baseline_before_serving_anything(capsys, tiny_artifact, tmp_path, monkeypatch,
                                                                  baseline, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError, as when not installed
    no_engine(monkeypatch)
    status, output = run_cli(capsys, "bench", tiny_artifact, "--requests", "2", "--prompt-tokens", "4",
                             "--output-tokens", "2", "--baseline", baseline, "--out", tmp_path / "b.json")
    assert status == 2 and f"--baseline {baseline}" in output and "not installed" in output, output


@pytest.mark.parametrize("flags, message", [
    (["--artifact", "/nonexistent"], "not an artifact folder"),
    (["--chunks", "none,abc"], "--chunks"),
    (["--chunks", "0"], "--chunks"),
    (["--decoders", "0"], "--decoders must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--long-prompt", "200"], "--long-prompt"),
    (["--decode-tokens", "200"], "--decode-tokens"),
])
def test_chunked_prefill_refuses_bad_sizes_before_loading(tiny_artifact, tmp_path, monkeypatch, capsys, flags, message):
    no_engine(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        chunked_prefill.main(["--artifact", str(tiny_artifact), "--chunks", "none,16", "--decoders", "2",
                              "--decode-tokens", "8", "--long-prompt", "16", "--repeats", "1",
                              "--out", str(tmp_path / "c.json"), *flags])
    error = capsys.readouterr().err.splitlines()[-1]  # the error line, not the usage (which names every flag)
    assert stopped.value.code == 2 and message in error, error


@pytest.mark.parametrize("flags, message", [(["--out", "{tmp}"], "is a folder"), (["--threads", "-1"], "--threads")])
def test_generate_refuses_a_folder_out_and_negative_threads_before_measuring(tiny_artifact, tmp_path, monkeypatch,
                                                                             capsys, flags, message):
    no_engine(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        generate.main(["--artifact", str(tiny_artifact), "--baselines", "", "--prompt-tokens", "4", "--new-tokens",
                       "2", "--repeats", "1", *(f.format(tmp=tmp_path) for f in flags)])
    error = capsys.readouterr().err.splitlines()[-1]
    assert stopped.value.code == 2 and message in error, error


def test_phases_refuses_genai_when_it_is_not_installed(tiny_artifact, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)
    monkeypatch.setattr(generate, "RESULTS", tmp_path)  # no genai build into the checkout
    monkeypatch.setattr(phases, "genai_model", lambda *a, **k: pytest.fail("built genai's model before the check"))
    no_engine(monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        phases.main(["--backends", f"{phases.FUSED},{phases.GENAI}", "--fused-artifact", str(tiny_artifact),
                     "--contexts", "8", "--prompt-lengths", "8", "--steps", "2", "--repeats", "1",
                     "--prefill-runs", "1", "--out", str(tmp_path / "p.json")])
    error = capsys.readouterr().err.splitlines()[-1]
    assert stopped.value.code == 2 and "onnxruntime-genai is not installed" in error, error


def test_generate_reports_how_many_tokens_it_really_compared(tiny_artifact, tmp_path):
    report = generate.main(["--artifact", str(tiny_artifact), "--baselines", "", "--prompt-tokens", "8",
                            "--new-tokens", "4", "--repeats", "1", "--threads", "1", "--out", str(tmp_path / "g.json")])
    assert report["agreement"]["tokens_compared"] == 4  # 4 tokens were made: "first 32 agree" was not measured
    assert [len(gaps) for gaps in report["results"]["aotlm"]["itl_ms"]] == [3]  # one run's 3 gaps, drawn in the plot
    assert (tmp_path / "g-itl.png").stat().st_size > 0


def test_huge_pages_names_a_missing_artifact(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        huge_pages.main(["--artifacts", str(tmp_path / "none"), "--repeats", "1", "--out", str(tmp_path / "h.json")])
    error = capsys.readouterr().err.splitlines()[-1]
    assert stopped.value.code == 2 and "not an artifact folder" in error, error


@pytest.mark.parametrize("main, flags, message", [
    (kv_cache_attention.main, ["--runs", "0", "--prompts", "16", "--contexts", "8"], "--runs must be >= 1"),
    (kv_cache_attention.main, ["--runs", "3", "--prompts", "16", "--contexts", "5000"], "--contexts"),
    (matmul_limits.main, ["--runs", "0", "--layers", "1", "--hidden", "64", "--intermediate", "128", "--kv-width",
                          "32", "--vocab", "256", "--rows", "1", "--bandwidth", "10"], "--runs must be >= 1"),
    # 0 rows read no weights yet were reported at 35x the bandwidth; "x" was a ValueError traceback
    (matmul_limits.main, ["--rows", "0", "--runs", "1"], "each must be >= 1 and given once"),
    (matmul_limits.main, ["--rows", "1,x", "--runs", "1"], "give comma-separated counts"),
])
def test_microbenchmarks_refuse_sizes_they_cannot_measure(main, flags, message, tmp_path, capsys):
    out = tmp_path / "m.json"
    with pytest.raises(SystemExit) as stopped:
        main([*flags, "--out", str(out)])
    error = capsys.readouterr().err.splitlines()[-1]
    assert stopped.value.code == 2 and message in error and not out.exists(), error


SCRIPTS = ("batching", "chunked_prefill", "decode_profile", "generate", "gguf_tokenizers", "http_serving", "huge_pages",
           "kv_cache_attention", "load_test", "matmul_limits", "pass_ab", "phases", "prefix_caching", "quantization",
           "served_loglikelihood", "thread_spinning")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_refuses_a_folder_out_and_too_many_threads_first(script, tmp_path, monkeypatch, capsys):
    """--out naming a folder was an IsADirectoryError after the whole measurement; --threads -1 a library's
    traceback at load. Both are the first checks after parsing, whatever else the arguments say."""
    import importlib

    module = importlib.import_module(script)
    no_engine(monkeypatch)
    cases = [(["--out", str(tmp_path)], "is a folder; give a file name"),
             (["--threads", "-1"], "--threads: -1 is negative"),
             (["--threads", "100000"], "--threads: 100000 is more than the")]
    for flags, message in cases[:1] if script == "gguf_tokenizers" else cases:  # it runs no model: no --threads
        with pytest.raises(SystemExit) as stopped:
            module.main(flags)
        error = capsys.readouterr().err.splitlines()[-1]
        assert stopped.value.code == 2 and message in error, (script, error)


@pytest.mark.parametrize("out", ["-", "/dev/stdout"])
def test_a_stream_as_a_scripts_out_is_refused_before_the_work(capsys, tiny_artifact, monkeypatch, out):
    """The scripts write their JSON, and plots named after it, as files: '-' made files named '-' and
    '--poisson.json' in the working folder (and /dev/stdout, as root, files in /dev)."""
    no_engine(monkeypatch)
    with pytest.raises(SystemExit) as exited:
        chunked_prefill.main(["--artifact", str(tiny_artifact), "--out", out])
    assert exited.value.code == 2 and f"--out {out}: give a file path" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["arguments", "decode_profile", "kv_cache_attention", "huge_pages"])
def test_the_scripts_import_their_own_checkout_first(tmp_path, script):
    """arguments.py imported compiler and runtime before any script put its checkout on the path (a second checkout
    sharing the virtualenv measured whichever checkout the editable install names), and three scripts imported
    compiler.console before arguments: one checkout's compiler with another's runtime."""
    import subprocess

    for package in ("runtime", "compiler"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("raise ImportError('another checkout')\n")
    run = (f"import runpy, sys; sys.argv = [{script!r}, '--help']; sys.path.insert(0, {str(REPO / 'benchmarks')!r})\n"
           f"try:\n    runpy.run_path({str(REPO / 'benchmarks' / (script + '.py'))!r}, run_name='__main__')\n"
           f"except SystemExit:\n    pass\n"
           f"import compiler, runtime; print(compiler.__file__, runtime.__file__)")
    done = subprocess.run([sys.executable, "-c", run], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == [str(REPO / "compiler" / "__init__.py"), str(REPO / "runtime" / "__init__.py")]
