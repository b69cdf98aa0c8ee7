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
    """The GPU run is one scarce try: a part that raises (or a run the time limit kills) must not lose the others."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_check

    out = tmp_path / "gpu_check.json"
    monkeypatch.setattr(gpu_check.ARGS, "json", str(out))
    report = {"device": "test", "rows": []}
    assert gpu_check.part(report, "copy_gbs", lambda: 3000.0) == 3000.0
    assert json.loads(out.read_text())["copy_gbs"] == 3000.0  # written as soon as it was measured
    gpu_check.part(report, "prefill", lambda: [{"phase": "prefill"}, 1 / 0], rows=True)
    gpu_check.part(report, "decode", lambda: [{"phase": "decode"}], rows=True)
    written = json.loads(out.read_text())
    assert written["rows"] == [{"phase": "decode"}] and written["copy_gbs"] == 3000.0
    assert written["failed"]["prefill"]["error"] == "ZeroDivisionError: division by zero"
    assert "1 / 0" in written["failed"]["prefill"]["traceback"]
