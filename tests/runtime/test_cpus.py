"""The CPUs a process may use (runtime/cpus.py): an affinity mask or a container's CPU quota, which os.cpu_count()
does not see, sets the default thread count and bounds --threads."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import cpus
from runtime.errors import RequestError


def cgroup(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text)
    (tmp_path / "cgroup").write_text(membership)
    return tmp_path / "cgroup", tmp_path / "fs"


def test_a_v2_quota_is_read_from_the_process_cgroup_and_its_ancestors(tmp_path):
    """docker --cpus=1.5 writes "150000 100000" to cpu.max; a parent's lower limit binds the child too."""
    files = {"kubepods/pod1/cpu.max": "150000 100000\n", "kubepods/cpu.max": "max 100000\n"}
    assert cpus.cgroup_cpu_quota(*cgroup(tmp_path, "0::/kubepods/pod1\n", files)) == 1.5
    files["kubepods/cpu.max"] = "100000 100000\n"
    assert cpus.cgroup_cpu_quota(*cgroup(tmp_path, "0::/kubepods/pod1\n", files)) == 1.0
    assert cpus.cgroup_cpu_quota(*cgroup(tmp_path / "none", "0::/\n", {"cpu.max": "max 100000\n"})) is None


def test_a_v1_quota_is_read_and_minus_one_is_no_limit(tmp_path):
    membership = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n"
    files = {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"}
    assert cpus.cgroup_cpu_quota(*cgroup(tmp_path, membership, files)) == 2.0
    files["cpu,cpuacct/docker/abc/cpu.cfs_quota_us"] = "-1\n"
    assert cpus.cgroup_cpu_quota(*cgroup(tmp_path, membership, files)) is None


@pytest.fixture
def one_of_four_cpus(monkeypatch):
    """A process held to CPU 0 (taskset -c 0, a container's cpuset) on a 4-CPU machine."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: None)


def test_held_to_fewer_cpus_the_default_is_their_count_and_more_threads_are_refused(one_of_four_cpus):
    from compiler.errors import thread_count
    from runtime.onnxruntime_backend import session_options

    assert cpus.usable_cpus() == 1 and cpus.default_intra_op_threads() == 1
    assert session_options({}, None).intra_op_num_threads == 1  # explicit: onnxruntime pins nothing then
    with pytest.raises(argparse.ArgumentTypeError, match=r"2 is more than the 1 CPU this process may use \(of the "
                                                         r"machine's 4: an affinity mask or a container's CPU limit\)"):
        thread_count("2")
    with pytest.raises(RequestError, match="intra_op_threads: 2 is more than the 1 CPU this process may use"):
        from runtime import Engine

        Engine.load("/nonexistent", intra_op_threads=2)
    with pytest.warns(RuntimeWarning, match="more than the 1 CPU this process may use"):
        assert session_options({"intra_op_threads": 3}, None).intra_op_num_threads == 1


def test_a_quota_lowers_the_count_and_an_unrestricted_machine_keeps_onnxruntimes_default(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: None)
    assert cpus.usable_cpus() == 4 and cpus.default_intra_op_threads() == 0 and cpus.restriction() == ""
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 1.5)  # --cpus=1.5: two threads may run at once
    assert cpus.usable_cpus() == 2 and cpus.default_intra_op_threads() == 2


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs to hold a process to fewer")
def test_an_engine_held_to_one_cpu_starts_no_thread_on_another(tiny_artifact):
    """Under `taskset -c 0` onnxruntime's default pool pinned a worker to CPU 1 (and inside a cpuset failed to,
    printing an error on every session load)."""
    script = (f"import os; os.sched_setaffinity(0, {{0}})\n"
              f"from runtime import Engine\n"
              f"engine = Engine.load({str(tiny_artifact)!r})\n"
              f"engine.generate([1, 2, 3], max_new_tokens=2)\n"
              f"tasks = os.listdir('/proc/self/task')\n"
              f"print(sorted({{tuple(sorted(os.sched_getaffinity(int(t)))) for t in tasks}}), len(tasks))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == "[(0,)]", result.stdout  # every thread may run on CPU 0 only
    assert "setaffinity" not in result.stderr


def test_a_recipes_thread_count_above_the_cpus_is_warned_once_at_the_callers_line(tiny_artifact, tmp_path):
    """The warning pointed into aotlm (onnxruntime_backend.py, its source line printed under it by the CLI) and came
    twice, once per phase's session."""
    import json
    import shutil
    import warnings

    from runtime import Engine

    copy = shutil.copytree(tiny_artifact, tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["backend"].setdefault("session", {})["intra_op_threads"] = 4096
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Engine.load(copy).close()
    said = [w for w in caught if "intra_op_threads: 4096" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [(w.filename, str(w.message)) for w in caught]
    assert cpus.cpus(1) == "1 CPU" and cpus.cpus(2) == "2 CPUs"


def test_a_containers_own_mount_is_read_where_its_path_names_the_hosts(tmp_path):
    """Inside a container /proc/self/cgroup may name the host's hierarchy while the mount is the container's own:
    the quota at the mount's root is the one that applies."""
    membership, root = cgroup(tmp_path, "0::/kubepods/pod1\n", {"cpu.max": "50000 100000\n"})
    assert cpus.cgroup_cpu_quota(membership, root) == 0.5


def test_the_passes_sessions_follow_the_affinity(one_of_four_cpus):
    from passes.calibration import cpu_threads

    assert cpu_threads() == 1


def test_nonsense_quotas_are_no_limit_and_paths_stay_under_the_mount(tmp_path):
    for index, text in enumerate(("9" * 4000 + " 100000\n", "-5 100000\n", "50000 -1\n", "50000 0\n")):
        assert cpus.cgroup_cpu_quota(*cgroup(tmp_path / str(index), "0::/\n", {"cpu.max": text})) is None, text[:9]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "cpu.max").write_text("25000 100000\n")
    (tmp_path / "root" / "fs").mkdir(parents=True)
    membership, root = cgroup(tmp_path / "root", "0::/../../outside\n", {})
    assert cpus.cgroup_cpu_quota(membership, root) is None  # a file outside the mount is never read


def test_a_v2_memory_limit_leaves_the_limit_less_the_working_set(tmp_path):
    """/proc/meminfo shows the machine's memory: in a pod limited to 2 GiB, --slots beyond it passed the check and
    the OOM killer ended the server while the cache was zeroed. Page cache the kernel reclaims first is not charged."""
    files = {"kubepods/pod1/memory.max": f"{2 << 30}\n", "kubepods/pod1/memory.current": f"{1 << 30}\n",
             "kubepods/pod1/memory.stat": f"anon 100\ninactive_file {256 << 20}\nactive_file {64 << 20}\n"
                                          f"file_mapped {32 << 20}\n",
             "kubepods/memory.max": "max\n", "kubepods/memory.current": "5\n"}
    # both file lists reclaimable (a copied artifact fills the active one), mapped file pages not
    assert cpus.cgroup_memory_left(*cgroup(tmp_path, "0::/kubepods/pod1\n", files)) == (2 << 30) - (736 << 20)
    files["kubepods/memory.max"] = f"{1280 << 20}\n"  # a parent's lower limit binds the child too
    files["kubepods/memory.current"] = f"{1 << 30}\n"
    assert cpus.cgroup_memory_left(*cgroup(tmp_path / "parent", "0::/kubepods/pod1\n", files)) == 256 << 20
    assert cpus.cgroup_memory_left(*cgroup(tmp_path / "none", "0::/\n", {"memory.max": "max\n"})) is None


def test_a_v1_memory_limit_is_read_and_its_no_limit_value_is_none(tmp_path):
    membership = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n"
    files = {"memory/docker/abc/memory.limit_in_bytes": f"{4 << 30}\n",
             "memory/docker/abc/memory.usage_in_bytes": f"{3 << 30}\n",
             "memory/docker/abc/memory.stat": f"cache 1\ntotal_inactive_file {1 << 30}\ntotal_active_file 0\n"}
    assert cpus.cgroup_memory_left(*cgroup(tmp_path, membership, files)) == 2 << 30
    files["memory/docker/abc/memory.limit_in_bytes"] = "9223372036854771712\n"  # v1's "no limit"
    assert cpus.cgroup_memory_left(*cgroup(tmp_path / "unlimited", membership, files)) is None


def test_the_slot_memory_check_heeds_a_containers_memory_limit(monkeypatch):
    from runtime import onnxruntime_backend

    monkeypatch.setattr(onnxruntime_backend, "_meminfo_available", lambda: 64 << 30)  # the machine's
    monkeypatch.setattr(onnxruntime_backend, "cgroup_memory_left", lambda: 1 << 30)  # the container's
    with pytest.raises(RequestError, match=r"slots: 16 sequences need 1.4 GiB of KV cache \(90.0 MiB each\), and this "
                                           r"process can allocate 640.0 MiB now beside 384.0 MiB for onnxruntime's own "
                                           r"work; use at most 7"):
        onnxruntime_backend.check_slot_memory(16, 90 << 20)


def test_the_slot_check_keeps_room_for_onnxruntimes_own_work_and_says_when_none_fits(monkeypatch):
    """In a 1.5 GiB cgroup the check allowed four of SmolLM2's 90 MiB slots with 18 MiB to spare, and four 1800-token
    prompts then took ~300 MiB more: the OOM killer ended the process. A limit that holds no slot said "use at most 0"
    of the engine's internal "batch"."""
    from runtime import onnxruntime_backend

    monkeypatch.setattr(onnxruntime_backend, "available_memory_bytes", lambda: 4 * (90 << 20) + (18 << 20))
    with pytest.raises(RequestError, match=r"use at most 0|not one sequence's cache"):
        onnxruntime_backend.check_slot_memory(4, 90 << 20)
    monkeypatch.setattr(onnxruntime_backend, "available_memory_bytes", lambda: (384 + 60) << 20)
    with pytest.raises(RequestError, match=r"^the batch-1 cache Engine.load allocates: 1 sequences need 90.0 MiB .*"
                                           r"can allocate 60.0 MiB now beside 384.0 MiB for onnxruntime's own work, "
                                           r"not one sequence's cache: raise its memory limit"):
        onnxruntime_backend.check_slot_memory(1, 90 << 20, what="batch")
