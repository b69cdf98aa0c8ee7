"""tests/conftest.py's dispatch order: the longest files first, kept by xdist (see SLOW_FILES_FIRST)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, SLOW_FILES_FIRST, reorder_asked


def test_xdist_keeps_the_collection_order(pytestconfig):
    if not hasattr(pytestconfig.option, "loadscopereorder"):
        pytest.skip("pytest-xdist is not installed")
    if reorder_asked(pytestconfig):
        pytest.skip("--loadscope-reorder was asked for: xdist orders the files by their number of tests")
    assert pytestconfig.option.loadscopereorder is False


def test_the_slowest_files_are_collected_first():
    files = ["tests/runtime/test_manifest.py", *reversed(SLOW_FILES_FIRST[:2])]
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                            cwd=REPO, capture_output=True, text=True, timeout=120).stdout
    order = list(dict.fromkeys(line.split("::")[0] for line in listed.splitlines() if "::" in line))
    assert order == [*SLOW_FILES_FIRST[:2], "tests/runtime/test_manifest.py"], order
