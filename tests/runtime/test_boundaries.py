"""The runtime stands alone: a deployed onnxruntime artifact needs neither torch nor the compiler."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_runtime_imports_no_torch_and_no_compiler(tiny_artifact):
    script = (
        "import sys\n"
        "from runtime import Engine\n"
        f"Engine.load({str(tiny_artifact)!r}).generate('hi', max_new_tokens=3)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'compiler', 'passes', 'onnx'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
