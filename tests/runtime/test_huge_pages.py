"""runtime/huge_pages.py: large memory ends up on 2 MiB pages where the kernel allows it, contents untouched, and
the engine's tokens do not depend on it. Skipped where the kernel has no transparent huge pages (the report then
says why, and that is tested too)."""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from runtime import Engine
from runtime import huge_pages

THP = huge_pages.thp_mode() in ("always", "madvise")
needs_thp = pytest.mark.skipif(not THP, reason=f"the kernel's transparent huge pages are {huge_pages.thp_mode()}")


def huge_bytes(array: np.ndarray) -> int:
    return huge_pages.huge_bytes_in(array.ctypes.data, array.ctypes.data + array.nbytes)


def kernel_has_collapse() -> bool:
    """MADV_COLLAPSE exists from Linux 6.1."""
    major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 1)


def require_collapse(report: dict) -> None:
    """Skip where MADV_COLLAPSE cannot work: a kernel before 6.1, or one that found no free 2 MiB pages (EAGAIN /
    ENOMEM: memory too fragmented). Anywhere else, nothing collapsed is a failure (a wrong advice value, no call)."""
    if huge_pages.thp_mode() != "madvise" or report["collapsed"]:
        return
    if not kernel_has_collapse():
        pytest.skip(f"Linux {os.uname().release} has no MADV_COLLAPSE (6.1+): {report.get('errors')}")
    errors = report.get("errors", {})
    if errors and set(errors) <= {"EAGAIN", "ENOMEM"}:
        pytest.skip(f"the kernel found no free huge pages to collapse into: {errors}")
    pytest.fail(f"MADV_COLLAPSE collapsed nothing on Linux {os.uname().release}: {report}")


def fresh_touched(megabytes: int) -> np.ndarray:
    """A new private anonymous mapping, never advised, filled: on 4 KiB pages (THP mode madvise), whatever earlier
    tests did to the process's other mappings."""
    buffer = mmap.mmap(-1, megabytes * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(buffer, dtype=np.float64)
    array[:] = np.arange(array.size)
    return array


@needs_thp
def test_collapse_moves_a_touched_array_onto_huge_pages_and_keeps_its_values():
    values = fresh_touched(48)
    before = values.copy()
    report = huge_pages.collapse_large_mappings()
    assert report["mappings"] >= 1 and report["bytes"] >= 32 * 2**20, report
    require_collapse(report)
    assert huge_bytes(values) >= 32 * 2**20
    np.testing.assert_array_equal(values, before)


@needs_thp
def test_mappings_that_existed_before_are_left_alone():
    """Engine.load collapses what appeared while it loaded, not the caller's own memory."""
    values = fresh_touched(48)
    if huge_pages.thp_mode() == "madvise":
        assert huge_bytes(values) == 0
    huge_pages.collapse_large_mappings(exclude=set(huge_pages.private_anonymous_mappings(0)))
    if huge_pages.thp_mode() == "madvise":
        assert huge_bytes(values) == 0
    report = huge_pages.collapse_large_mappings()  # the control: not excluded, it is collapsed
    require_collapse(report)
    assert huge_bytes(values) >= 32 * 2**20


def test_excluded_ranges_are_cut_out_of_the_mappings_by_address():
    """A caller's mapping that the engine's allocation merged into: compared as whole (start, end) pairs, the merged
    mapping no longer matched and the caller's part was collapsed too."""
    mib = 2**20
    assert huge_pages._outside([(0, 300 * mib)], [(0, 200 * mib)]) == [(200 * mib, 300 * mib)]  # merged after it
    assert huge_pages._outside([(0, 300 * mib)], [(100 * mib, 200 * mib)]) == [(0, 100 * mib), (200 * mib, 300 * mib)]
    assert huge_pages._outside([(0, 300 * mib)], [(400 * mib, 500 * mib)]) == [(0, 300 * mib)]
    assert huge_pages._outside([(0, 300 * mib)], [(0, 100 * mib), (100 * mib, 300 * mib)]) == []


@needs_thp
def test_a_new_allocation_merged_into_an_existing_mapping_is_collapsed_alone():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, huge, map_fixed = 32 * 2**20, 2 * 2**20, 0x10
    flags, protection = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.PROT_READ | mmap.PROT_WRITE
    reserved = libc.mmap(None, 2 * size + huge, 0, flags, -1, 0)  # PROT_NONE: address space for both, unusable
    old = (reserved + huge - 1) // huge * huge
    try:
        assert libc.mmap(old, size, protection, flags | map_fixed, -1, 0) == old
        ctypes.memset(old, 1, size)  # the caller's memory, before the load
        existing = huge_pages.private_anonymous_mappings(0)
        assert libc.mmap(old + size, size, protection, flags | map_fixed, -1, 0) == old + size  # the engine's
        ctypes.memset(old + size, 2, size)
        merged = [(start, end) for start, end in huge_pages.private_anonymous_mappings(0) if start <= old < end]
        if not merged or merged[0][1] < old + 2 * size:
            pytest.skip("the kernel kept the two mappings apart: nothing merged to test")
        report = huge_pages.collapse_large_mappings(exclude=set(existing))
        assert size <= report["bytes"] < 2 * size, report  # the new part (and what else appeared), not old's too
    finally:
        libc.munmap(reserved, 2 * size + huge)


def test_thread_stacks_are_not_among_the_mappings():
    """onnxruntime's pool threads' 8 MiB stacks were advised and collapsed: mostly untouched, they cost time, and
    MADV_COLLAPSE refused them (EINVAL, reported as an old kernel)."""
    import threading

    started, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: (started.set(), release.wait()))
    thread.start()
    started.wait()
    try:
        lines = [line.split() for line in open("/proc/self/maps")]
        spans = [tuple(int(x, 16) for x in fields[0].split("-")) for fields in lines]
        stacks = {spans[i] for i in range(1, len(lines)) if lines[i - 1][1] == "---p" and spans[i - 1][1] == spans[i][0]
                  and spans[i - 1][1] - spans[i - 1][0] <= huge_pages.GUARD_MAX and lines[i][1] == "rw-p"
                  and len(lines[i]) == 5 and spans[i][1] - spans[i][0] >= 8 * 2**20 - 2**20}
        assert stacks, "no thread stack found above a guard page: the check below would say nothing"
        assert not stacks & set(huge_pages.private_anonymous_mappings(0))
    finally:
        release.set()
        thread.join()


@needs_thp
def test_an_advised_array_faults_in_on_huge_pages():
    array = np.empty(32 * 2**20, dtype=np.uint8)
    assert huge_pages.advise(array)
    array.fill(1)
    assert huge_bytes(array) >= 16 * 2**20


def test_a_kernel_without_huge_pages_is_reported_not_fatal(monkeypatch, tmp_path):
    off = tmp_path / "enabled"
    off.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_MODE_FILE", off)
    report = huge_pages.collapse_large_mappings()
    assert report["skipped"] == "the kernel's transparent huge pages are off (never)" and report["collapsed"] == 0
    assert not huge_pages.advise(np.empty(8 * 2**20, dtype=np.uint8))
    monkeypatch.setattr(huge_pages, "THP_MODE_FILE", tmp_path / "absent")
    assert huge_pages.collapse_large_mappings()["skipped"] == "the kernel has no transparent huge pages"


def test_tokens_do_not_depend_on_huge_pages(tiny_artifact):
    prompt = [1, 17, 42, 99, 7]
    plain = Engine.load(tiny_artifact, huge_pages=False)
    assert plain.huge_pages is None and not plain.backend.huge_pages
    huge = Engine.load(tiny_artifact)
    assert huge.huge_pages is not None and huge.backend.huge_pages
    for engine in (plain, huge):
        engine.start_scheduler(slots=2)  # the slot cache: advised before its first touch in the second engine
    try:
        expected = plain.generate(prompt, max_new_tokens=8).token_ids
        assert huge.generate(prompt, max_new_tokens=8).token_ids == expected
        assert [r.token_ids for r in huge.generate([prompt, prompt], max_new_tokens=8)] == [expected, expected]
    finally:
        plain.close()
        huge.close()


def test_the_report_counts_whole_huge_pages_outside_the_exclusions_and_names_refusals(monkeypatch, tmp_path):
    """Addresses made up (no call reaches the kernel): which ranges are advised, in what order, and what is counted."""
    import ctypes
    import errno

    mib = 2**20
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_MODE_FILE", mode)
    asked = []
    monkeypatch.setattr(huge_pages, "private_anonymous_mappings",
                        lambda min_bytes: asked.append(min_bytes) or [(3 * mib, 13 * mib),  # whole pages 4..12 MiB
                                                                      (20 * mib, 21 * mib + 5),  # no whole page
                                                                      (40 * mib, 60 * mib)])
    calls = []

    def madvise(start, length, advice):
        calls.append((start // mib, length // mib, advice))
        if advice == huge_pages.MADV_COLLAPSE and start in (46 * mib, 56 * mib):  # no free huge pages there
            ctypes.set_errno(errno.EAGAIN)
            return -1
        return 0

    monkeypatch.setattr(huge_pages, "_madvise", lambda: madvise)
    monkeypatch.setattr(huge_pages, "_dense_runs", lambda low, high: [(low, high)])  # made-up pages: all resident
    report = huge_pages.collapse_large_mappings(min_bytes=4 * mib, exclude=[(50 * mib, 55 * mib), (44 * mib, 46 * mib)])
    assert asked == [4 * mib]
    hugepage, collapse = huge_pages.MADV_HUGEPAGE, huge_pages.MADV_COLLAPSE
    assert (hugepage, collapse) == (14, 25)  # linux/mman.h
    assert calls == [(start, length, advice) for start, length in ((4, 8), (40, 4), (46, 4), (56, 4))
                     for advice in (hugepage, collapse)]
    assert {key: value for key, value in report.items() if key != "seconds"} == {
        "thp_mode": "madvise", "mappings": 4, "bytes": 20 * mib, "collapsed": 12 * mib, "errors": {"EAGAIN": 2},
        "sparse_left": 0}


def resident_pages(array: np.ndarray) -> int:
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(array.ctypes.data // 4096 * 8)
        entries = np.frombuffer(pagemap.read(array.nbytes // 4096 * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


def sparse_dense_mapping() -> tuple[np.ndarray, int]:
    """A 2 MiB-aligned 48 MiB view of a fresh mapping: its first 16 MiB written whole, the next 16 MiB one byte per
    2 MiB (a host's sparse arena), the last 16 MiB not at all (a cache not written yet). Returns it and its start."""
    buffer = mmap.mmap(-1, 50 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(buffer, dtype=np.uint8)
    offset = -whole.ctypes.data % (2 * 2**20)
    view = whole[offset:offset + 48 * 2**20]
    view[:16 * 2**20] = 1
    view[16 * 2**20:32 * 2**20:2 * 2**20] = 1
    return view, view.ctypes.data


def test_only_mostly_resident_huge_pages_are_worth_collapsing():
    """MADV_COLLAPSE makes a whole 2 MiB page resident: Engine.load made a host thread's 512 MiB arena (a byte per
    2 MiB written) and the untouched 90 MiB batch-1 cache resident."""
    view, start = sparse_dense_mapping()
    mib = 2**20
    if not os.path.exists("/proc/self/pagemap"):
        pytest.skip("no /proc/self/pagemap")
    assert huge_pages._dense_runs(start, start + 48 * mib) == [(start, start + 16 * mib)]


@needs_thp
def test_collapsing_leaves_sparse_and_unwritten_memory_unresident():
    view, start = sparse_dense_mapping()
    sparse, dense = view[16 * 2**20:], view[:16 * 2**20]
    before = resident_pages(sparse)
    report = huge_pages.collapse_large_mappings(exclude=set(huge_pages.private_anonymous_mappings(0)) - {
        mapping for mapping in huge_pages.private_anonymous_mappings(0) if mapping[0] <= start < mapping[1]})
    require_collapse(report)
    assert resident_pages(sparse) == before == 8  # one 4 KiB page per 2 MiB written: still only those
    assert report["sparse_left"] >= 32 * 2**20
    assert huge_bytes(dense) == 16 * 2**20


def test_an_array_smaller_than_a_huge_page_is_not_advised(monkeypatch, tmp_path):
    mode = tmp_path / "enabled"
    mode.write_text("[always] madvise never\n")
    monkeypatch.setattr(huge_pages, "THP_MODE_FILE", mode)
    assert huge_pages.thp_mode() == "always"
    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    assert not huge_pages.advise(np.empty(2**20, dtype=np.uint8))  # inside one 2 MiB page at most: nothing whole
    assert calls == []
    assert huge_pages.advise(np.empty(8 * 2**20, dtype=np.uint8)) and len(calls) == 1


def _fake_proc_file(monkeypatch, name: str, text: str) -> None:
    """/proc/self/<name> read by runtime/huge_pages.py gives `text` (other files open as usual)."""
    import builtins
    import io

    real = builtins.open
    monkeypatch.setattr(huge_pages, "open", lambda path, *args, **keywords: io.StringIO(text)
                        if path == f"/proc/self/{name}" else real(path, *args, **keywords), raising=False)


def test_only_large_writable_private_anonymous_mappings_not_thread_stacks_are_listed(monkeypatch):
    _fake_proc_file(monkeypatch, "maps", """\
00400000-00c00000 r-xp 00000000 08:01 1234 /usr/bin/python3
01000000-02000000 rw-p 00000000 00:00 0 [heap]
10000000-10800000 rw-p 00000000 00:00 0
20000000-21000000 rw-s 00000000 00:00 0
30000000-31000000 r--p 00000000 00:00 0
40000000-40001000 ---p 00000000 00:00 0
40001000-40801000 rw-p 00000000 00:00 0
50000000-50001000 ---p 00000000 00:00 0
50002000-51002000 rw-p 00000000 00:00 0
60000000-607ff000 rw-p 00000000 00:00 0
7ffc0000-7ffd0000 rw-p 00000000 00:00 0 [stack]
""")
    # the heap; exactly 8 MiB; 16 MiB after a gap (not right above the ---p page). Not: a file, a shared or read-only
    # mapping, the 8 MiB right above a guard page (a thread's stack), 8 MiB less a page, the main stack
    assert huge_pages.private_anonymous_mappings(8 * 2**20) == [
        (0x01000000, 0x02000000), (0x10000000, 0x10800000), (0x50002000, 0x51002000)]


def test_a_mapping_above_a_large_reservation_is_no_thread_stack(monkeypatch):
    """A thread stack sits above a guard of a page or so; 16 MiB above a 56 MiB ---p reservation (a glibc arena
    heap's reserved tail) is a heap, and is listed (no test held the guard's size limit: a mutation audit)."""
    _fake_proc_file(monkeypatch, "maps", """\
10000000-10800000 rw-p 00000000 00:00 0
10800000-14000000 ---p 00000000 00:00 0
14000000-15000000 rw-p 00000000 00:00 0
""")
    assert huge_pages.private_anonymous_mappings(8 * 2**20) == [(0x10000000, 0x10800000), (0x14000000, 0x15000000)]


def test_huge_bytes_are_counted_for_the_mappings_a_range_overlaps(monkeypatch):
    _fake_proc_file(monkeypatch, "smaps", """\
00400000-00600000 rw-p 00000000 00:00 0
Size:               2048 kB
AnonHugePages:      2048 kB
00600000-00e00000 rw-p 00000000 00:00 0
Size:               8192 kB
AnonHugePages:      4096 kB
VmFlags: rd wr mr mw me ac
""")
    assert huge_pages.huge_bytes_in(0x400000, 0x600000) == 2 * 2**20  # ends where the next mapping starts
    assert huge_pages.huge_bytes_in(0x600000, 0x600001) == 4 * 2**20
    assert huge_pages.huge_bytes_in(0x500000, 0x700000) == 6 * 2**20


def test_an_artifact_in_a_folder_with_a_non_ascii_name_loads(tiny_artifact, tmp_path):
    """/proc/self/maps names each mapped file by its path: read as ASCII, the artifact's own weights.bin under a
    folder named "modèles ✓" made Engine.load (huge_pages=True, as `aotlm serve` and `bench` load) fail with a
    UnicodeDecodeError traceback."""
    import shutil

    copy = shutil.copytree(tiny_artifact, tmp_path / "modèles ✓")
    engine = Engine.load(copy, huge_pages=True)
    assert len(engine.generate("hi", max_new_tokens=2, ignore_eos=True).token_ids) == 2


def test_mappings_of_files_named_in_any_bytes_are_read(tmp_path):
    """A path need not be UTF-8 (the kernel keeps bytes): the scan and the smaps count still read every line."""
    path = os.path.join(os.fsencode(tmp_path), b"caf\xe9.bin")
    with open(path, "wb") as handle:
        handle.write(b"\0" * mmap.PAGESIZE)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ):
        huge_pages.private_anonymous_mappings()  # the real files, with that line among them: no UnicodeDecodeError
        huge_pages.huge_bytes_in(0, 2**64)


def test_the_lines_after_a_path_in_other_bytes_are_read_too(monkeypatch):
    """The scan must go on past a mapped file whose path is not UTF-8, to the mappings listed after it (the real-file
    test above shows only that nothing raises)."""
    import io

    maps = (b"7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
            b"7f0000400000-7f0000401000 r--s 00000000 08:01 12 /tmp/caf\xe9.bin\n"
            b"7f0000600000-7f0000a00000 rw-p 00000000 00:00 0 \n")
    smaps = (b"7f0000400000-7f0000401000 r--s 00000000 08:01 12 /tmp/caf\xe9.bin\nAnonHugePages:         0 kB\n"
             b"7f0000600000-7f0000a00000 rw-p 00000000 00:00 0 \nAnonHugePages:      4096 kB\n")
    files = {"/proc/self/maps": maps, "/proc/self/smaps": smaps}
    monkeypatch.setattr(huge_pages, "open", lambda path, encoding, errors: io.TextIOWrapper(
        io.BytesIO(files[path]), encoding=encoding, errors=errors), raising=False)
    assert huge_pages.private_anonymous_mappings(0) == [(0x7f0000000000, 0x7f0000400000),
                                                        (0x7f0000600000, 0x7f0000a00000)]
    assert huge_pages.huge_bytes_in(0x7f0000600000, 0x7f0000a00000) == 4096 * 1024


def test_the_batch_one_cache_is_one_block_advised_whole(tiny_artifact, monkeypatch):
    """Each of the default model's 60 buffers is 1.5 MiB: advised one by one, none held a whole 2 MiB page and the
    advice did nothing; and, each from the heap, release_single_stream_cache "freed" 90 MiB that stayed resident
    (one block of 90 MiB is a mapping of its own, given back when freed: 1543 -> 1453 MiB measured)."""
    from runtime import Engine, onnxruntime_backend

    advised = []
    monkeypatch.setattr(onnxruntime_backend, "advise", lambda array: advised.append(array))
    engine = Engine.load(tiny_artifact, huge_pages=False)
    engine.generate("hi", max_new_tokens=2)
    cache = engine.backend.cache
    assert cache.block.nbytes == cache.nbytes and [buffer.data_ptr() for buffer in cache.buffers] == [
        cache.block.ctypes.data + i * cache.block[0].nbytes for i in range(len(cache.buffers))]  # views, in order
    engine.backend.use_huge_pages()
    assert len(advised) == 1 and advised[0] is cache.block
    assert engine.generate("hi", max_new_tokens=4).token_ids == Engine.load(tiny_artifact).generate(
        "hi", max_new_tokens=4).token_ids
