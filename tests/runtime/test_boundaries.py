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


def test_a_request_imports_nothing_new(tiny_artifact):
    """Whatever a first request needs, alone or through the scheduler, is imported with the runtime, not inside
    its timing: numpy 2 loads numpy.random on first use, which added ~20 ms to the first request's TTFT before
    runtime/sampling.py imported it."""
    script = (
        "import sys\n"
        "from runtime import Engine\n"
        f"engine = Engine.load({str(tiny_artifact)!r})\n"
        "engine.start_scheduler(slots=2)\n"
        "before = set(sys.modules)\n"
        "engine.generate('hi', max_new_tokens=3, temperature=0.8, top_p=0.9, seed=1)\n"
        "engine.generate('hi', max_new_tokens=3)\n"
        "engine.generate(['hi', 'a longer prompt'], max_new_tokens=3, temperature=0.8, seed=2)\n"
        "new = sorted(set(sys.modules) - before)\n"
        "print(new)\n"
        "sys.exit(1 if new else 0)\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
