"""How many CPUs this process may use, which os.cpu_count() (the machine's) does not say: its affinity (taskset, a
container's cpuset) and its cgroup's CPU quota (`docker --cpus`, a Kubernetes CPU limit); and, the same way, how much
memory its cgroup leaves it (`docker --memory`, a Kubernetes memory limit), which /proc/meminfo does not say.

onnxruntime's default thread pool (intra_op_num_threads 0) takes one thread per physical core of the machine and pins
them, affinity or not: under `taskset -c 0` it pinned a worker to CPU 1, inside a cpuset every session load printed
"pthread_setaffinity_np failed", and under a 1-CPU quota two spinning threads took ~2x as long per token as one (a
review, session 53). Where the process may use fewer CPUs than the machine has, aotlm gives onnxruntime that count
explicitly (an explicit count pins nothing); on an unrestricted machine it keeps onnxruntime's default.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus() -> int:
    """The CPUs this process may run on at once: its affinity, lowered to its cgroup's quota (rounded up)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(count, math.ceil(quota))) if quota is not None else max(1, count)


def default_intra_op_threads() -> int:
    """What "0 / the default" means for an onnxruntime session here: onnxruntime's own default (0) where every CPU
    of the machine is usable, else the usable count, given explicitly."""
    usable = usable_cpus()
    return 0 if usable >= (os.cpu_count() or 1) else usable


def cpus(count: int) -> str:
    """"1 CPU", "2 CPUs": the count a message names (a 1-CPU container is the usual case)."""
    return f"{count} CPU{'' if count == 1 else 's'}"


def restriction() -> str:
    """How this process is held to fewer CPUs than the machine has, for messages: "" when it is not."""
    usable, machine = usable_cpus(), os.cpu_count() or 1
    return "" if usable >= machine else f" (of the machine's {machine}: an affinity mask or a container's CPU limit)"


def cgroup_cpu_quota(membership: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> float | None:
    """The smallest CPU quota (quota / period, in CPUs) of this process's cgroup and its ancestors, v2 (cpu.max) or
    v1 (cpu.cfs_quota_us); None where there is none or it cannot be read. membership: the process's cgroups
    (/proc/self/cgroup); root: where the hierarchies are mounted."""
    quotas = [_v2_quota(folder / "cpu.max") if version == 2 else _v1_quota(folder)
              for version, folder in _cgroup_folders("cpu", ("cpu", "cpu,cpuacct"), membership, root)]
    found = [quota for quota in quotas if quota is not None]
    return min(found) if found else None


def _cgroup_folders(controller: str, v1_mounts: tuple[str, ...], membership: Path, root: Path) -> list[tuple[int, Path]]:
    """(2, folder) for the v2 hierarchy and (1, folder) for the v1 hierarchies of `controller` (mounted as one of
    v1_mounts under root): this process's cgroup folder and each ancestor's, from its membership file
    (/proc/self/cgroup); none where that cannot be read."""
    try:
        lines = membership.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one unified hierarchy
            found += [(2, folder) for folder in _folders(root, path)]
        elif controller in controllers.split(","):
            found += [(1, folder) for mount in v1_mounts for folder in _folders(root / mount, path)]
    return found


def _folders(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder under mount and each ancestor's, up to the mount (inside a container the process's path
    may name the host's hierarchy while the mount is its own: the mount itself is tried too)."""
    folder = Path(os.path.normpath(mount / path.strip("/")))  # "/../x" (outside a cgroup namespace) stays under mount
    folders = [folder, *folder.parents] if path.strip("/") else [folder]
    return [f for f in folders if f == mount or mount in f.parents]


def _v2_quota(path: Path) -> float | None:
    try:
        quota, period = path.read_text(encoding="utf-8").split()[:2]
        return None if quota == "max" else _ratio(int(quota), int(period))
    except (OSError, ValueError, ArithmeticError):  # missing, malformed, or a number no float holds
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        return _ratio(int((folder / "cpu.cfs_quota_us").read_text(encoding="utf-8")), int((folder / "cpu.cfs_period_us").read_text(encoding="utf-8")))
    except (OSError, ValueError, ArithmeticError):
        return None


def _ratio(quota: int, period: int) -> float | None:
    """CPUs a quota per period gives; None for no limit (v1's -1) or nonsense (<= 0)."""
    return quota / period if quota > 0 and period > 0 else None


def cgroup_memory_left(membership: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> int | None:
    """Bytes this process's cgroup and its ancestors let it allocate before the OOM killer acts: the smallest limit
    less what is charged now, the page cache the kernel reclaims first (file pages not mapped) not counted as
    charged; v2 (memory.max) or v1 (memory.limit_in_bytes). None where no limit is set or read."""
    left = [_memory_left(folder, "memory.max", "memory.current", V2_FILE_PAGES) if version == 2 else
            _memory_left(folder, "memory.limit_in_bytes", "memory.usage_in_bytes", V1_FILE_PAGES)
            for version, folder in _cgroup_folders("memory", ("memory",), membership, root)]
    found = [bytes_ for bytes_ in left if bytes_ is not None]
    return min(found) if found else None


V1_NO_LIMIT = 1 << 62  # v1 writes its "no limit" as a page-rounded 2^63 - 1
# memory.stat's page-cache keys: (inactive, active, mapped) file pages. Both file LRU lists are reclaimed before the
# OOM killer acts (counting the inactive list alone refused 8 slots that ran, after a copy of the artifact had
# filled the active one); pages mapped into a process stay charged.
V1_FILE_PAGES = ("total_inactive_file", "total_active_file", "total_mapped_file")
V2_FILE_PAGES = ("inactive_file", "active_file", "file_mapped")


def _memory_left(folder: Path, limit_file: str, usage_file: str, file_keys: tuple[str, str, str]) -> int | None:
    try:
        limit_text = (folder / limit_file).read_text(encoding="utf-8").strip()
        if limit_text == "max" or int(limit_text) >= V1_NO_LIMIT:
            return None
        limit, usage = int(limit_text), int((folder / usage_file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    stat = {}
    try:
        for line in (folder / "memory.stat").read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(" ")
            if key in file_keys:
                stat[key] = int(value)
    except (OSError, ValueError):
        pass
    inactive, active, mapped = (stat.get(key, 0) for key in file_keys)
    reclaimable = max(0, inactive + active - mapped)
    return max(0, limit - max(0, usage - reclaimable))
