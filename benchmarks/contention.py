"""How many cores other processes kept busy while a measurement ran: these 2-core hosts are shared, and a
measurement that ran beside another process's work says little about either side of a ratio. phases.py re-measures
such measurements (--max-other-cores); generate.py, quantization.py and batching.py record the figure per run and
count the contended ones, so that a reader can set them aside."""
from __future__ import annotations

import time

import numpy as np

from compiler.plan import busy_cpu_s, own_cpu_s

OTHER_CORES_LIMIT = 0.25  # a measurement beside more than this (mean cores) counts as contended


class OtherCores:
    """`with OtherCores() as others: ...`, then others.cores: the mean number of cores everything but this process
    kept busy meanwhile (steal included; 0 where /proc/stat cannot be read)."""

    cores = 0.0

    def __enter__(self) -> "OtherCores":
        self._wall, self._busy, self._own = time.perf_counter(), busy_cpu_s() or 0.0, own_cpu_s()
        return self

    def __exit__(self, *exc_info) -> None:
        wall = time.perf_counter() - self._wall
        others = ((busy_cpu_s() or 0.0) - self._busy) - (own_cpu_s() - self._own)
        self.cores = max(0.0, others) / wall if wall > 0 else 0.0


def contention_line(cores: list[float], what: str, limit: float = OTHER_CORES_LIMIT) -> str:
    """One line for the console: how many of the measurements ran contended, and the median."""
    contended = sum(value > limit for value in cores)
    median = f"{np.median(cores):.2f}" if cores else "-"
    return (f"contention: {contended} of {len(cores)} {what} ran beside other processes using more than {limit} "
            f"cores (median {median}); compare figures from uncontended ones")
