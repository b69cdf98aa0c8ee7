"""The engine's large memory on 2 MiB pages (Linux transparent huge pages): the decode step streams all of it.

A decode step reads every weight once (540 MB for SmolLM2-135M in fp32, 84 MB in INT4), and the KV cache up to
the context. On 4 KiB pages that is one address translation per 4 KiB, most of them TLB misses; on 2 MiB pages,
one per 2 MiB. onnxruntime allocates its weights (prepacked, or folded at load) through malloc, and where the
kernel's THP mode is "madvise" (a common default, and these VMs') malloc's memory gets 4 KiB pages. So after the
sessions are built, `collapse_large_mappings` marks the process's large private anonymous mappings
MADV_HUGEPAGE and asks for MADV_COLLAPSE (Linux 6.1+), which rebuilds what is resident now on huge pages rather
than whenever khugepaged reaches it (16 MB per 10 s by default). The contents do not change; only the mapping.
`advise` marks a buffer this runtime allocates itself (the scheduler's slot cache) before its pages are touched,
so its page faults take huge pages directly.

Only 2 MiB pages at least three quarters resident are collapsed (MADV_COLLAPSE makes the whole 2 MiB resident):
a cache not written yet, or another thread's sparse memory mapped during the load, is left as it is; the engine's
batch-1 cache is marked instead, so that its pages take 2 MiB pages as the requests fill it.

Measured on the 2-core VM, default model, 3 fresh processes per arm (benchmarks/huge_pages.py, README "Huge
pages"): decode steps 5-8% faster in fp32 and in INT4 (contexts 64 and 2000), prefill unchanged, resident memory
unchanged; load 0.5 s (INT4) to 2.4 s (fp32) longer: collapsing 1.1 GB took 0.4-2.6 s (the kernel may have to
compact memory to find free 2 MiB pages). Engine.load(huge_pages=False) skips it (`aotlm run`, one request, does).
Nothing here is fatal: an unsupported system or a refused call is reported, and the engine runs on 4 KiB pages.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import time
from pathlib import Path

import numpy as np

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux 6.1
HUGE_PAGE = 2 * 2**20
MIN_MAPPING = 8 * 2**20  # smaller mappings are mostly interpreter and library memory: little to gain
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's THP mode ("always", "madvise" or "never"), or None where there is no such setting."""
    try:
        text = THP_MODE_FILE.read_text(encoding="utf-8")
    except OSError:
        return None
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


@functools.cache  # find_library runs `ldconfig -p` in a subprocess: 60 of them made a scheduler's start 95 ms longer
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def _aligned(start: int, end: int) -> tuple[int, int]:
    """The whole 2 MiB pages inside [start, end)."""
    return (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE


GUARD_MAX = 2**20  # a thread stack's guard: an inaccessible mapping this small right below it


def private_anonymous_mappings(min_bytes: int = MIN_MAPPING) -> list[tuple[int, int]]:
    """[start, end) of this process's writable private anonymous mappings (and the heap) of at least min_bytes,
    thread stacks left out: glibc maps each (onnxruntime's pool threads' 8 MiB) right above an inaccessible guard
    page, and most of a stack is never touched, so there is nothing to gain and MADV_COLLAPSE refuses them."""
    found, previous = [], None
    # Each line ends with the mapped file's path as the kernel holds it, in any bytes (an artifact folder named
    # "modèles" maps its weights from there): only "" and "[heap]" are compared, so undecodable bytes may be replaced.
    try:
        maps = open("/proc/self/maps", encoding="utf-8", errors="replace")
    except OSError:  # not Linux (macOS, Windows), or no /proc: no mappings to name, and nothing to collapse
        return []
    with maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            path = fields[5] if len(fields) > 5 else ""
            guarded = previous is not None and previous[1] == start and previous[2] == "---p" and \
                previous[1] - previous[0] <= GUARD_MAX
            if fields[1].startswith("rw") and fields[1].endswith("p") and path in ("", "[heap]") \
                    and end - start >= min_bytes and not guarded:
                found.append((start, end))
            previous = (start, end, fields[1])
    return found


def _outside(ranges: list[tuple[int, int]], excluded: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `ranges` that no range of `excluded` covers (both [start, end), `excluded` sorted)."""
    parts = []
    for start, end in ranges:
        for low, high in excluded:
            if high <= start or low >= end:
                continue
            if low > start:
                parts.append((start, low))
            start = max(start, high)
            if start >= end:
                break
        if start < end:
            parts.append((start, end))
    return parts


def collapse_large_mappings(min_bytes: int = MIN_MAPPING, exclude: set | None = None) -> dict:
    """Put the resident pages of the process's large anonymous mappings on huge pages; returns what happened:
    thp_mode, mappings, bytes (2 MiB-aligned bytes asked for: those of mostly resident 2 MiB pages), sparse_left
    (bytes of the mappings' mostly unwritten 2 MiB pages, left alone: _dense_runs), collapsed (bytes MADV_COLLAPSE
    accepted), seconds, and skipped (why nothing was done) or errors (errno names of refused calls, counted).

    exclude: address ranges (start, end) to leave alone, e.g. the mappings that existed before the engine loaded:
    the caller's own memory (a test process's GBs, say) is not the engine's to rebuild, and would cost load time.
    Compared by address, not as whole mappings: the kernel often merges a new allocation into the mapping beside
    it, and the merged mapping then holds both, of which only the new part is collapsed."""
    report = {"thp_mode": thp_mode(), "mappings": 0, "bytes": 0, "collapsed": 0, "seconds": 0.0}
    madvise = _madvise()
    if madvise is None or report["thp_mode"] in (None, "never"):
        report["skipped"] = ("not Linux" if madvise is None else
                             "the kernel's transparent huge pages are off (never)" if report["thp_mode"] else
                             "the kernel has no transparent huge pages")
        return report
    errors: dict[str, int] = {}
    started = time.perf_counter()
    report["sparse_left"] = 0
    for start, end in _outside(private_anonymous_mappings(min_bytes), sorted(exclude or ())):
        low, high = _aligned(start, end)
        if high <= low:
            continue
        report["mappings"] += 1
        dense = _dense_runs(low, high)
        report["sparse_left"] += (high - low) - sum(run_high - run_low for run_low, run_high in dense)
        for run_low, run_high in dense:
            report["bytes"] += run_high - run_low
            for advice in (MADV_HUGEPAGE, MADV_COLLAPSE):
                # A mapping freed meanwhile (another thread) only makes the call fail: harmless, counted.
                if madvise(run_low, run_high - run_low, advice) == 0:
                    report["collapsed"] += (run_high - run_low) if advice == MADV_COLLAPSE else 0
                else:
                    name = _errno_name(ctypes.get_errno())
                    errors[name] = errors.get(name, 0) + 1
    report["seconds"] = time.perf_counter() - started
    if errors:
        # EINVAL: a kernel before 6.1 (no MADV_COLLAPSE: the mapping is still marked, khugepaged collapses it
        # later), or a range it will not collapse; EAGAIN/ENOMEM when no free 2 MiB pages could be found for part
        # of a mapping.
        report["errors"] = errors
    return report


PAGE = 4096
DENSE_PAGES = 3 * (HUGE_PAGE // PAGE) // 4  # resident 4 KiB pages that make a 2 MiB page worth collapsing
PAGEMAP_FILE = "/proc/self/pagemap"


def _dense_runs(low: int, high: int) -> list[tuple[int, int]]:
    """The runs of 2 MiB pages in [low, high) (aligned) with at least DENSE_PAGES of their 4 KiB pages resident.
    MADV_COLLAPSE makes a whole 2 MiB page resident however little of it was: a fresh cache nobody wrote yet (90 MiB
    for the default model's batch-1 cache), or a host thread's sparse arena mapped during the load (512 MiB made
    resident for 512 bytes written), is left alone. onnxruntime's weights, written whole, are dense. Where pagemap
    cannot be read, every page counts as dense (collapsed as before)."""
    first, count = low // PAGE, (high - low) // PAGE
    try:
        with open(PAGEMAP_FILE, "rb") as pagemap:
            pagemap.seek(first * 8)
            entries = np.frombuffer(pagemap.read(count * 8), dtype=np.uint64)
    except (OSError, ValueError):
        return [(low, high)]
    if entries.size != count:
        return [(low, high)]
    present = ((entries >> np.uint64(63)) & np.uint64(1)).reshape(-1, HUGE_PAGE // PAGE).sum(axis=1)
    dense = np.flatnonzero(present >= DENSE_PAGES)
    runs: list[tuple[int, int]] = []
    for index in dense:
        start = low + int(index) * HUGE_PAGE
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], start + HUGE_PAGE)
        else:
            runs.append((start, start + HUGE_PAGE))
    return runs


def advise(array) -> bool:
    """Mark a numpy array's buffer for huge pages before its pages are first touched; True if the kernel took it."""
    return advise_range(array.ctypes.data, array.nbytes)


def advise_range(address: int, nbytes: int) -> bool:
    """Mark [address, address + nbytes)'s whole 2 MiB pages for huge pages: each takes one when first touched."""
    madvise = _madvise()
    if madvise is None or thp_mode() in (None, "never"):
        return False
    low, high = _aligned(address, address + nbytes)
    return high > low and madvise(low, high - low, MADV_HUGEPAGE) == 0


def huge_bytes_in(start: int, end: int) -> int:
    """Bytes of [start, end)'s mappings that are on anonymous huge pages now (/proc/self/smaps), for tests and
    reports: whole mappings are counted where they overlap the range."""
    total, overlapping = 0, False
    with open("/proc/self/smaps", encoding="utf-8", errors="replace") as smaps:  # file paths: any bytes
        for line in smaps:
            head = line.split()[0] if line.strip() else ""
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                overlapping = low < end and start < high
            elif overlapping and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def _errno_name(number: int) -> str:
    import errno

    return errno.errorcode.get(number, str(number))
