"""The runtime stands alone: a deployed onnxruntime artifact needs neither torch nor the compiler."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def run_python(script: str) -> subprocess.CompletedProcess:
    """The script in a fresh interpreter (a module imported by an earlier test stays imported in this one)."""
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_runtime_imports_no_torch_and_no_compiler(tiny_artifact):
    script = (
        "import sys\n"
        "from runtime import Engine\n"
        f"Engine.load({str(tiny_artifact)!r}).generate('hi', max_new_tokens=3)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'compiler', 'passes', 'onnx'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    completed = run_python(script)
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
    completed = run_python(script)
    assert completed.returncode == 0, completed.stdout + completed.stderr


BLOCKED = ("onnx", "onnx_graphsurgeon", "onnxscript", "torch", "yaml", "gguf", "safetensors")  # the compiler extra's


def _cli_without_the_compiler_extra(*argv: str, home: str) -> subprocess.CompletedProcess:
    """`aotlm ARGV` in a process where the compiler extra's modules cannot be imported (a runtime-only install)."""
    script = (
        "import sys\n"
        f"for name in {BLOCKED!r}:\n"
        "    sys.modules[name] = None  # import raises ModuleNotFoundError, as where it is not installed\n"
        "from compiler.cli import main\n"
        f"sys.exit(main({list(argv)!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": home, "COLUMNS": "200"})


def test_the_runtime_commands_run_without_the_compiler_extra(tiny_artifact, tmp_path):
    """A deployment installs aotlm[cpu] only: inspect, eval and bench --phase imported onnx through compiler modules
    (pass reports, calibration's text name, plan's block sizes) and ended in a ModuleNotFoundError traceback."""
    text = tmp_path / "text.txt"
    text.write_text("The lighthouse keeper climbed the stairs each evening and lit the lamp. " * 20)
    for argv in (["inspect", str(tiny_artifact)],
                 ["run", str(tiny_artifact), "--prompt", "hi", "--max-new-tokens", "3"],
                 ["eval", str(tiny_artifact), "--text", str(text), "--max-tokens", "100", "--window", "64"],
                 ["plan", str(tiny_artifact), "--device", "H100"]):
        completed = _cli_without_the_compiler_extra(*argv, home=str(tmp_path))
        assert completed.returncode == 0 and "Traceback" not in completed.stderr, (argv, completed.stderr[-2000:])
    # what needs the extra says so in one line: a build, and the cpu peak measured on a machine without a cache
    completed = _cli_without_the_compiler_extra("build", str(REPO / "recipes" / "tiny-random.yaml"), "--output",
                                                str(tmp_path / "built"), home=str(tmp_path))
    assert completed.returncode == 2 and "pip install 'aotlm[compiler]'" in completed.stderr, completed.stderr[-2000:]
    completed = _cli_without_the_compiler_extra("bench", str(tiny_artifact), "--phase", "decode", "--contexts", "8",
                                                "--steps", "2", "--out", str(tmp_path / "d.json"), home=str(tmp_path))
    assert completed.returncode == 2 and "pip install 'aotlm[compiler]' once" in completed.stderr, completed.stderr


def test_the_package_imports_its_names_on_first_use():
    """`import runtime.errors` (the compiler's, a GPU image's `runtime.kernels`) imported the engine with the package:
    onnxruntime and tokenizers, ~0.3 s, and a kernels-only install needed tokenizers. The package's names now come
    from their modules when first used."""
    script = (
        "import sys\n"
        "import runtime.errors, runtime.manifest, runtime.versions\n"
        "from runtime import RequestError\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('onnxruntime', 'tokenizers', 'numpy', 'rich')\n"
        "               or m in ('runtime.engine', 'runtime.scheduler'))\n"
        "print(heavy)\n"
        "import runtime\n"
        "from runtime import Engine, Scheduler\n"
        "assert Engine is runtime.engine.Engine and runtime.Scheduler is Scheduler and 'Engine' in dir(runtime)\n"
        "assert sorted(runtime.__all__) == sorted(runtime._MODULE_OF)\n"
        "exec('from runtime import *', namespace := {})\n"
        "assert all(namespace[name] is getattr(runtime, name) for name in runtime.__all__)\n"
        "try:\n"
        "    runtime.Engin\n"
        "except AttributeError as error:\n"
        "    print(error)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    completed = run_python(script)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "module 'runtime' has no attribute 'Engin'" in completed.stdout
