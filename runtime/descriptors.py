"""A server's open-file limit. Every connection holds a descriptor, and a process out of them cannot accept the next
one: at systemd's default soft LimitNOFILE (1024), below `aotlm serve`'s 1024 connections, accept failed with EMFILE
and the server retried at once, for ever (a core at 95%, no log line, no new client answered). Here, as vLLM's
set_ulimit does, the soft limit is raised toward the hard one at start, and the connections are fitted to what
remains."""
from __future__ import annotations

import errno
import os

# accept's "out of resources" errors (asyncio's list): wait for a connection to close, do not spin
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# Descriptors kept free beside the connections: the files a request or /metrics opens for a moment (cgroup and /proc
# reads), logs, Python's and onnxruntime's own
SPARE_DESCRIPTORS = 32
RAISED_LIMIT = 65536  # at most (macOS refuses an unlimited soft limit; vLLM raises to 65535)


def raised_descriptor_limit() -> int | None:
    """Raise this process's soft RLIMIT_NOFILE toward its hard limit (RAISED_LIMIT at most) and return the soft limit
    then in force; None where there is no such limit (Windows) or none is set."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = RAISED_LIMIT if hard == resource.RLIM_INFINITY else min(hard, RAISED_LIMIT)
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a sandbox that forbids it: the limit stays as it was
            pass
    return None if soft == resource.RLIM_INFINITY else soft


def open_descriptors() -> int:
    """How many descriptors this process holds now (0 where /proc or /dev/fd cannot say)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


def connections_that_fit(max_connections: int) -> tuple[int, str | None]:
    """max_connections, or fewer where the open-file limit (raised first) leaves room for fewer; with the warning
    that says so."""
    limit = raised_descriptor_limit()
    if limit is None:
        return max_connections, None
    room = limit - open_descriptors() - SPARE_DESCRIPTORS
    if room >= max_connections:
        return max_connections, None
    fit = max(1, room)
    return fit, (f"this process may open {limit} files (ulimit -n; systemd's LimitNOFILE), so at most {fit} "
                 f"connections are served at once, not {max_connections}: raise the limit for more")
