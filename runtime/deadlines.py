"""Deadlines for the HTTP server's connections, all kept by one thread.

A threading.Timer per request (the header deadline) doubled the server's threads: 200 idle connections held 403
threads and 3.3 GB of stacks' address space, and at 1000 the server could start no thread to answer /health. Here
every deadline waits in one heap. Cancelling one drops its action at once (a handler it holds must not outlive the
connection behind an idle one's minute), and its heap entry, a time and a number, when it comes up.

A deadline found more than LATE_S past its time was not missed by its connection but by this process, which did not
run (SIGSTOP, `docker pause`, a frozen cgroup: the monotonic clock goes on meanwhile): it is put off once by LATE_S,
so that the connections' threads, woken at the same moment, read what arrived meanwhile first (4 in 10 requests
whose bytes had all come during a 70 s stop were cut with a 408 that said they had not; uvicorn served them).
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Callable

LATE_S = 1.0


class Deadlines:
    def __init__(self, name: str = "aotlm-deadlines"):
        self._name = name
        self._changed = threading.Condition()
        self._heap: list[tuple[float, int]] = []  # (when, token)
        self._actions: dict[int, Callable[[], None]] = {}  # the tokens neither cancelled nor due yet
        self._tokens = itertools.count()
        self._put_off: set[int] = set()  # tokens already put off once (LATE_S)
        self._thread: threading.Thread | None = None

    def add(self, seconds: float, action: Callable[[], None]) -> int:
        """Call action() on this object's thread in `seconds`, unless cancel(token) comes first. The action must
        be quick (it delays the deadlines after it) and must check for itself whether it still applies: a cancel
        that races with its deadline may come too late."""
        with self._changed:
            token = next(self._tokens)
            heapq.heappush(self._heap, (time.monotonic() + seconds, token))
            self._actions[token] = action
            if self._thread is None or not self._thread.is_alive():  # started once (again after a fork)
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif self._heap[0][1] == token:  # sooner than the one the thread waits for; else its wait ends in time
                self._changed.notify()
        return token

    def cancel(self, token: int) -> None:
        with self._changed:
            self._actions.pop(token, None)
            self._put_off.discard(token)
            if len(self._heap) > 2 * len(self._actions) + 64:  # mostly cancelled ones: 1000 connections a second
                # behind one idle connection kept 60,000 entries
                self._heap = [entry for entry in self._heap if entry[1] in self._actions]
                heapq.heapify(self._heap)

    def pending(self) -> int:
        """Deadlines added and neither cancelled nor due."""
        with self._changed:
            return len(self._actions)

    def _run(self) -> None:
        while True:
            with self._changed:
                while True:
                    while self._heap and self._heap[0][1] not in self._actions:
                        heapq.heappop(self._heap)  # cancelled
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        when, token = heapq.heappop(self._heap)
                        if now - when > LATE_S and token not in self._put_off:  # this process did not run
                            self._put_off.add(token)
                            heapq.heappush(self._heap, (now + LATE_S, token))
                            continue
                        self._put_off.discard(token)
                        action = self._actions.pop(token)
                        break
                    # a wait past threading.TIMEOUT_MAX overflows: deadlines are seconds to minutes away
                    self._changed.wait(None if not self._heap else min(self._heap[0][0] - now, 3600.0))
            try:
                action()
            except Exception:  # noqa: BLE001 - one connection's cut failing must not stop every other deadline
                pass
