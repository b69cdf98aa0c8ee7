"""tests/conftest.py's dispatch order: the longest files first, kept by xdist (see SLOW_FILES_FIRST)."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, SLOW_FILES_FIRST


def test_xdist_keeps_the_collection_order(pytestconfig):
    if hasattr(pytestconfig.option, "loadscopereorder"):  # xdist installed
        assert pytestconfig.option.loadscopereorder is False


def test_the_slowest_files_are_collected_first():
    files = ["tests/runtime/test_manifest.py", *reversed(SLOW_FILES_FIRST[:2])]
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                            cwd=REPO, capture_output=True, text=True, timeout=120).stdout
    order = list(dict.fromkeys(line.split("::")[0] for line in listed.splitlines() if "::" in line))
    assert order == [*SLOW_FILES_FIRST[:2], "tests/runtime/test_manifest.py"], order
