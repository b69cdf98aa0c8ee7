"""The benchmarks decode greedily: every engine they generate with is loaded with generation_config="none", so a model
that ships sampling defaults (generation_config.json, a GGUF's general.sampling) neither makes their runs sample nor
makes two runs of one request differ (four benchmarks once sampled at such a model's temperature)."""
from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO

# Loads that never sample, each with the reason
NOT_GENERATING = {
    "huge_pages.py": "times the backend's graph runs, never Engine.generate",
    "quantization.py": "loads an engine for its tokenizer only",
}


def engine_loads(path):
    """(line, keywords) of each Engine.load(...) call in the file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "Engine"):
            keywords = {k.arg: k.value for k in node.keywords if k.arg}
            for spread in (k.value for k in node.keywords if k.arg is None):  # Engine.load(path, **settings)
                if isinstance(spread, ast.Name):
                    keywords.update(assigned_dict(path, spread.id))
            yield node.lineno, keywords


def assigned_dict(path, name):
    """The keys and values of a dict literal assigned to `name` in the file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            return {ast.literal_eval(k): v for k, v in zip(node.value.keys, node.value.values) if k is not None}
    return {}


SCRIPTS = sorted((REPO / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_generating_benchmark_loads_without_the_models_sampling_defaults(script):
    loads = list(engine_loads(script))
    if script.name in NOT_GENERATING:
        assert loads, f"{script.name} no longer loads an engine: drop it from NOT_GENERATING"
        return
    for line, keywords in loads:
        setting = keywords.get("generation_config")
        assert isinstance(setting, ast.Constant) and setting.value == "none", (
            f"{script.name}:{line}: Engine.load without generation_config=\"none\" samples at the model's defaults")


def serve_commands(path):
    """(line, items) of each list literal in the file that runs `aotlm serve` (a server in a subprocess)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.List) and any(isinstance(e, ast.Constant) and e.value == "serve" for e in node.elts):
            yield node.lineno, [e.value if isinstance(e, ast.Constant) else None for e in node.elts]


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_benchmark_server_runs_without_the_models_sampling_defaults(script):
    """A request's temperature 0 does not turn off a model's repetition_penalty: http_serving's server applied it
    while its in-process side did not."""
    for line, items in serve_commands(script):
        flag = items.index("--generation-config") if "--generation-config" in items else None
        assert flag is not None and items[flag + 1] == "none", (
            f"{script.name}:{line}: aotlm serve without --generation-config none applies the model's defaults")


def test_the_scan_sees_the_loads_it_checks():
    """Guard against a scan that finds nothing (and so passes everything): the scripts named here do load engines."""
    found = {s.name for s in SCRIPTS if list(engine_loads(s))}
    assert {"batching.py", "chunked_prefill.py", "http_serving.py", "prefix_caching.py", "thread_spinning.py",
            "gpu_check.py", "phases.py", "generate.py", "load_test.py", "served_loglikelihood.py"} <= found
    assert [line for script in SCRIPTS if script.name == "http_serving.py" for line, _ in serve_commands(script)]
