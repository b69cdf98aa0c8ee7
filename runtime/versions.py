"""Release numbers of the libraries an artifact was built with and is run with, compared by their numbers."""
from __future__ import annotations

import itertools
import shlex
import sys


def release(version: str) -> tuple[int, ...]:
    """major.minor.patch as numbers: "1.33.0rc1" / "1.33.0.dev2026" / "1.32.0+cpu" -> (1, 33, 0) ((1, 32, 0)); a part
    with no leading digits reads 0. Compared as tuples, "1.9.0" comes before "1.32.0" (as strings it would not)."""
    numbers = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        numbers.append(int(digits or 0))
    return tuple(numbers)


def pip_install(arguments: str) -> str:
    """The command that installs into this interpreter's environment: a bare `pip` is often another Python's (a
    .venv's aotlm run without activating it, as README runs it, beside pyenv's or the system's pip)."""
    return f"{shlex.quote(sys.executable)} -m pip install {arguments}"
