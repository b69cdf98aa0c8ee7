"""Argument checks the benchmark scripts share: bad input is a usage error before any measurement, not a
traceback after minutes of it."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# This checkout's packages, not whatever checkout the virtualenv's editable install names (a second checkout sharing
# the venv measured the other one's runtime, and http_serving's server ran this one's against it).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compiler.errors import UsageError, check_output_file, thread_count  # noqa: E402
from runtime.cpus import usable_cpus  # noqa: E402
from runtime.errors import ArtifactError  # noqa: E402
from runtime.manifest import read_manifest  # noqa: E402
from runtime.results import is_stream  # noqa: E402

# thread_count: --threads' type; usable_cpus: its default (the CPUs this process may use, not the machine's count)
__all__ = ["artifact_manifest", "count_list", "output_file", "require_at_least_one", "thread_count", "usable_cpus"]


def artifact_manifest(parser: argparse.ArgumentParser, artifact: Path) -> dict:
    """The artifact's manifest, or the script's usage error naming the folder and the fix (a missing folder was a
    FileNotFoundError traceback)."""
    try:
        return read_manifest(artifact)
    except ArtifactError as error:
        parser.error(str(error))


def output_file(parser: argparse.ArgumentParser, path) -> None:
    """--out must be writable as a file, checked before the work (a folder was an IsADirectoryError traceback after
    the whole measurement). Not a stream ("-", /dev/stdout): the scripts write their JSON and plots as files, named
    after it."""
    if path is not None and is_stream(path):
        parser.error(f"--out {path}: give a file path; this script writes its JSON (and plots beside it) as files")
    try:
        check_output_file(None if path is None else str(path), "--out")
    except UsageError as error:
        parser.error(str(error))


def require_at_least_one(parser: argparse.ArgumentParser, args, *flags: str) -> None:
    """Counts a measurement cannot be made without (--repeats 0 left nothing to take a median of, after minutes)."""
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")


def count_list(text: str) -> list[int]:
    """An argparse type: comma-separated counts (tokens, rows), each >= 1 and given once. A count given twice was
    measured twice per repeat under one key, and the paired ratios failed on the uneven lists after the whole sweep;
    0 rows read no weights yet were reported at 35x the machine's bandwidth."""
    try:
        values = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated counts, e.g. 64,512") from None
    if not values or any(value < 1 for value in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one count; each must be >= 1 and given once")
    return values
