"""Shared fixtures: the tiny random-init recipe built once per test session, and its torch reference."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest


def _has_cuda_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Triton fixes at import time whether @triton.jit functions (its own standard library included) run in its
# interpreter, and any test may import triton first: decide once, here, before any test module is imported.
# Without a CUDA GPU the kernel tests run on CPU tensors through the interpreter; with one, natively.
if "TRITON_INTERPRET" not in os.environ and not _has_cuda_gpu():
    os.environ["TRITON_INTERPRET"] = "1"

# rich reads COLUMNS (and LINES) even when writing to a pipe, once, when a console is made: a narrow COLUMNS in the
# caller's environment wrapped the tables and messages the tests read (TTFT ms split over two lines at 45 columns).
# FORCE_COLOR and its kin put colour codes inside the messages the tests read (53 tests failed under FORCE_COLOR=1),
# and a developer's AOTLM_API_KEY made the servers the tests start refuse their requests (401).
for _variable in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_INTERACTIVE", "TTY_COMPATIBLE", "CLICOLOR_FORCE",
                  "AOTLM_API_KEY"):
    os.environ.pop(_variable, None)
# Nothing written to the developer's home: onnxruntime's telemetry (aotlm's packages turn it off, but a test file may
# import onnxruntime first), matplotlib's font cache, Triton's compiled kernels (23 MB from one test).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
_SCRATCH = tempfile.mkdtemp(prefix="aotlm-tests-home-")
os.environ.setdefault("MPLCONFIGDIR", os.path.join(_SCRATCH, "matplotlib"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_SCRATCH, "triton"))
atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = REPO / "recipes" / "tiny-random.yaml"

# The longest test files, started first. `--dist loadfile` gives each worker whole files; xdist queued them by their
# number of tests, which put the default model's (7 tests, ~130 s) 75th of 98, and the run ended with one worker
# idle for ~40 s while it finished.
SLOW_FILES_FIRST = ("tests/test_default_model.py", "tests/runtime/kernels/test_flash_attention.py",
                    "tests/test_default_model_tensorrt.py")


def reorder_asked(config) -> bool:
    """--loadscope-reorder given on the command line, in PYTEST_ADDOPTS or in the ini file's addopts."""
    import shlex

    given = [*config.invocation_params.args, *shlex.split(os.environ.get("PYTEST_ADDOPTS", "")),
             *config.getini("addopts")]
    return "--loadscope-reorder" in given


def pytest_configure(config):
    # xdist (3.8 on): dispatch files in the collection order set below, unless asked otherwise
    if hasattr(config.option, "loadscopereorder") and not reorder_asked(config):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return SLOW_FILES_FIRST.index(path) if path in SLOW_FILES_FIRST else len(SLOW_FILES_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


def edited_copy(artifact: Path, tmp_path: Path, edit, name: str = "copy") -> Path:
    """A copy of an artifact whose manifest `edit(manifest)` changed in place (the manifest is not among its files)."""
    import json
    import shutil

    copy = shutil.copytree(artifact, tmp_path / name)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.fixture(scope="session")
def tiny_recipe():
    from compiler.recipe import load_recipe

    return load_recipe(TINY_RECIPE)


@pytest.fixture(scope="session")
def tiny_artifact(tiny_recipe, tmp_path_factory) -> Path:
    """Build recipes/tiny-random.yaml once per test process (2-5 s on 2 cores)."""
    from compiler.build import build

    return build(tiny_recipe, tmp_path_factory.mktemp("artifacts"))


@pytest.fixture(scope="session")
def tiny_reference(tiny_recipe):
    """The torch canonical decoder holding the same weights as the tiny artifact."""
    from compiler.frontend import load_model
    from compiler.frontend.model import build_decoder

    spec = tiny_recipe.model
    loaded = load_model(spec.source, spec.path, spec.config, spec.seed)
    return build_decoder(loaded.config, loaded.state_dict), loaded


@pytest.fixture(scope="session")
def chat_artifact(tiny_recipe, tmp_path_factory):
    """(artifact, Hugging Face folder) of the tiny model with a chat template (tests/runtime/chat_artifact.py)."""
    from tests.runtime.chat_artifact import build_chat_artifact

    return build_chat_artifact(tiny_recipe, tmp_path_factory.mktemp("chat"))


@pytest.fixture
def tiny_engine(tiny_artifact):
    from runtime import Engine

    return Engine.load(tiny_artifact)


@pytest.fixture
def opened_sessions_stop_spinning(monkeypatch) -> list[bool]:
    """Per onnxruntime session the runtime opens from now on, in order: whether it stops spinning after a run."""
    import runtime.onnxruntime_backend as backend

    stops: list[bool] = []
    real = backend.session_options

    def recording(*args, **keywords):
        options = real(*args, **keywords)
        try:
            stops.append(options.get_session_config_entry(backend.STOP_SPINNING_AFTER_RUN) == "1")
        except RuntimeError:  # never set: onnxruntime's default, spinning on after a run
            stops.append(False)
        return options

    monkeypatch.setattr(backend, "session_options", recording)
    return stops
