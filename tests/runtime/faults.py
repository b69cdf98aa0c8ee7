"""Graph runs that fail on cue, for the tests of what a failure leaves behind."""
from __future__ import annotations

from typing import Callable


def failing_run(run: Callable, phase: str, at: int, message: str = "out of memory") -> Callable:
    """`run` (a backend's or a slot cache's run(phase, ...)) that raises RuntimeError(message) instead of its
    `at`-th run of `phase`, and runs everything else."""
    counts: dict[str, int] = {}

    def run_or_fail(run_phase: str, *args):
        counts[run_phase] = counts.get(run_phase, 0) + 1
        if run_phase == phase and counts[phase] == at:
            raise RuntimeError(message)
        return run(run_phase, *args)

    return run_or_fail
