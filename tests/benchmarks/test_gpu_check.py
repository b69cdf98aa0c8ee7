"""benchmarks/gpu_check.py's plumbing, in its --smoke mode (tiny shapes, CPU, Triton's interpreter): every row
is measured and our kernels agree with torch's attention. The real run needs a GPU."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

if importlib.util.find_spec("triton") is None:  # not importorskip: importing triton here would fix its mode early
    pytest.skip("the kernels need triton", allow_module_level=True)


def test_gpu_check_smoke(tmp_path):
    out = tmp_path / "gpu_check.json"
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    completed = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--json", str(out)], cwd=REPO,
                               env=environment, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(out.read_text())
    ours = [row for row in report["rows"] if row["impl"].startswith("aotlm")]
    assert {row["phase"] for row in ours} == {"prefill", "decode"} and all(row["ms"] > 0 for row in ours)
    differences = [row["max_abs_diff_vs_sdpa"] for row in report["rows"] if "max_abs_diff_vs_sdpa" in row]
    assert len(differences) == 2 and max(differences) < 2e-2  # bf16 outputs of O(1)


def test_a_part_that_fails_is_recorded_and_the_json_keeps_the_parts_before_it(tmp_path, monkeypatch):
    """The GPU run is one scarce try: a part that raises (or a run the time limit kills) must not lose the others,
    and the run's exit status says that something failed."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_check

    out = tmp_path / "gpu_check.json"
    monkeypatch.setattr(gpu_check.ARGS, "json", str(out))
    report = {"device": "test", "rows": []}
    assert gpu_check.part(report, "copy_gbs", lambda: 3000.0) == 3000.0
    assert json.loads(out.read_text())["copy_gbs"] == 3000.0  # written as soon as it was measured
    assert gpu_check.failures(report) == []

    def prefill(rows, checkpoint):  # one length measured and kept, then the next one fails
        rows.append({"phase": "prefill", "S": 2048, "impl": "aotlm", "ms": 1.0})
        checkpoint()
        assert json.loads(out.read_text())["rows"] == rows
        rows.append({"phase": "prefill", "S": 8192, "impl": "aotlm", "note": "failed: out of shared memory"})
        raise ZeroDivisionError("division by zero")

    gpu_check.part(report, "prefill", lambda: prefill(report["rows"], lambda: gpu_check.checkpoint(report)))
    gpu_check.part(report, "decode", lambda: report["rows"].append({"phase": "decode", "S": 64, "impl": "sdpa"}))
    written = json.loads(out.read_text())
    assert [row["S"] for row in written["rows"]] == [2048, 8192, 64] and written["copy_gbs"] == 3000.0
    assert written["failed"]["prefill"]["error"] == "ZeroDivisionError: division by zero"
    assert "division by zero" in written["failed"]["prefill"]["traceback"]
    assert gpu_check.failures(written) == ["prefill: ZeroDivisionError: division by zero",
                                           "aotlm at S=8192: failed: out of shared memory"]
    written["kernel_tests"] = {"returncode": 1, "summary": "1 failed, 45 passed"}
    assert "kernel tests: 1 failed, 45 passed" in gpu_check.failures(written)


def test_a_json_path_under_a_file_is_refused_before_the_run(tmp_path):
    (tmp_path / "file").write_text("")
    completed = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--json",
                                str(tmp_path / "file" / "gpu_check.json")], cwd=REPO, capture_output=True, text=True)
    assert completed.returncode == 2 and "is a file, not a folder" in completed.stderr


def _gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_check
    return gpu_check


def test_a_failing_part_is_in_the_json_before_the_next_part_runs(tmp_path, monkeypatch):
    gpu_check = _gpu_check(monkeypatch)
    out = tmp_path / "gpu_check.json"
    monkeypatch.setattr(gpu_check.ARGS, "json", str(out))
    gpu_check.part({"rows": []}, "prefill", lambda: 1 / 0)  # no later part writes it
    assert "ZeroDivisionError" in json.loads(out.read_text())["failed"]["prefill"]["error"]


def test_kernel_tests_that_time_out_keep_the_end_of_what_they_printed(monkeypatch):
    gpu_check = _gpu_check(monkeypatch)

    def timed_out(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"], output=b"x" * 5000 + b"\n....F..", stderr=None)

    monkeypatch.setattr(gpu_check.subprocess, "run", timed_out)
    result = gpu_check.kernel_tests()
    assert result["returncode"] == f"timed out after {gpu_check.KERNEL_TESTS_TIMEOUT_S} s"
    assert result["summary"] == "....F.." and result["output_tail"].endswith("\n....F..")
    json.dumps(result)  # strings, not bytes: the part's JSON must still be writable


COPY_FAILS = """
import json, sys
repo, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, repo)
sys.argv = ["gpu_check.py", "--smoke", "--json", out]
source = open(repo + "/benchmarks/gpu_check.py").read().replace('if __name__ == "__main__":\\n    main()', "")
namespace = {"__name__": "__main__", "__file__": repo + "/benchmarks/gpu_check.py"}
exec(compile(source, "gpu_check.py", "exec"), namespace)
def copy_fails():
    raise RuntimeError("CUDA error: out of memory")
namespace["copy_bandwidth_gbs"] = copy_fails
namespace["main"]()
"""


def test_a_failed_copy_costs_only_the_of_copy_column(tmp_path):
    out = tmp_path / "gpu_check.json"
    completed = subprocess.run([sys.executable, "-c", COPY_FAILS, str(REPO), str(out)], cwd=REPO, capture_output=True,
                               text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert completed.returncode == 1, completed.stderr[-3000:]  # the table printed, with empty "of copy" cells
    assert "1 failed:\n  copy_gbs: RuntimeError: CUDA error: out of memory" in completed.stdout
    report = json.loads(out.read_text())
    assert list(report["failed"]) == ["copy_gbs"]
    decode = [row for row in report["rows"] if row["phase"] == "decode"]
    assert decode and all(row["of_copy"] is None and row["ms"] > 0 for row in decode)


def test_a_json_that_cannot_be_written_is_a_failure_not_a_success(tmp_path, monkeypatch):
    """A disk that fills up: the run goes on and prints its table, but does not end as if its record were kept."""
    gpu_check = _gpu_check(monkeypatch)
    monkeypatch.setattr(gpu_check.ARGS, "json", str(tmp_path / "gpu_check.json"))
    monkeypatch.setattr(gpu_check, "write_json", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    monkeypatch.setattr(gpu_check, "WRITE_FAILURES", [])
    report = {"rows": []}
    assert gpu_check.part(report, "copy_gbs", lambda: 3000.0) == 3000.0  # measured, kept in memory
    assert gpu_check.failures(report) == [f"--json {tmp_path / 'gpu_check.json'} not written: [Errno 28] No space left"]
