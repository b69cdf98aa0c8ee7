"""How much a piece of code raises a process's peak resident memory, measured in a fresh Python: the tests of the
build's memory (graph export, pack_projections, quantize) compare it with the weights it handles."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREAMBLE = '''
import numpy as np
from onnx import TensorProto, helper, numpy_helper


def peak_kb():  # this process's own high-water mark (ru_maxrss also counts the parent it was forked from)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))


def matmul_model(count, rows, columns, random=False):
    """x [1, rows] times `count` weights w0, w1 ... [rows, columns] (sibling MatMuls /p0/MatMul ...), each written
    straight into the model, so that building it never holds a second copy."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"/p{i}/MatMul") for i in range(count)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, columns]) for i in range(count)]),
        opset_imports=[helper.make_opsetid("", 21)])
    rng = np.random.default_rng(0)
    for i in range(count):
        values = rng.standard_normal((rows, columns), np.float32) if random else np.full((rows, columns), i, np.float32)
        model.graph.initializer.add().CopyFrom(numpy_helper.from_array(values, f"w{i}"))
    return model
'''


def peak_growth_mb(setup: str, measured: str, *args: str) -> float:
    """Runs `setup`, then `measured` (source text; the preamble's peak_kb and matmul_model are defined, and
    sys.argv[1:] is `args`) at the repository root; returns how many MB the peak rose during `measured`."""
    script = (PREAMBLE + textwrap.dedent(setup) + "\n_before = peak_kb()\n" + textwrap.dedent(measured)
              + "\nprint((peak_kb() - _before) / 1024)\n")
    output = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True,
                            cwd=REPO)
    return float(output.stdout.split()[-1])
