"""What may import what (ARCHITECTURE.md's boundaries, and the README's note on where the compiler reuses the
runtime), read from the source: an import added against them fails here, not in a deployment."""
from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO

PACKAGES = ("compiler", "passes", "runtime")
# The runtime modules the compiler reuses rather than keep a second copy of: the manifest's reader (the contract
# is checked by the code that loads it), the tokenizer and evaluation (the build's accuracy report and calibration
# score what the deployed runtime computes), the engine and server for the run/chat/serve/bench commands, the count
# of CPUs a process may use (its --threads' bound, plan's measurement), and the TensorRT plugin's kernel definitions.
COMPILER_USES_OF_RUNTIME = {
    "runtime", "runtime.chat", "runtime.cpus", "runtime.descriptors", "runtime.engine", "runtime.errors",
    "runtime.evaluate", "runtime.kernels.tensorrt_plugin", "runtime.manifest", "runtime.metrics", "runtime.onnxruntime_backend", "runtime.results", "runtime.sampling",
    "runtime.server", "runtime.text_files", "runtime.tokenizer", "runtime.versions",
}


def imports(package: str) -> dict[str, set[str]]:
    """Every absolute import in the package's files: module -> the files that import it."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def reaching(package: str, roots: tuple[str, ...]) -> dict[str, set[str]]:
    return {name: files for name, files in imports(package).items() if name.split(".")[0] in roots}


def test_passes_know_graphs_only():
    assert reaching("passes", ("compiler", "runtime", "torch", "yaml")) == {}


def test_the_runtime_imports_neither_the_compiler_nor_the_passes():
    assert reaching("runtime", ("compiler", "passes")) == {}


def test_the_compiler_reuses_only_the_runtime_modules_it_says():
    used = reaching("compiler", ("runtime",))
    assert set(used) <= COMPILER_USES_OF_RUNTIME, {name: used[name] for name in set(used) - COMPILER_USES_OF_RUNTIME}


@pytest.mark.parametrize("package", PACKAGES)
def test_the_check_finds_imports(package):
    """The walk sees each package's own imports (a walk that found nothing would pass every check above)."""
    assert any(name.split(".")[0] == package for name in imports(package))
