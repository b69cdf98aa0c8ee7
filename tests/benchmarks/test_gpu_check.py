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
