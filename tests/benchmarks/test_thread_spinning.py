"""benchmarks/thread_spinning.py on the tiny artifact: every arm runs the same work (every request's tokens made,
the same prompt), the JSON holds the table's medians, and the plot is written."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from rich.console import Console

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import thread_spinning  # noqa: E402


def test_every_arm_on_the_tiny_artifact(tiny_artifact, tmp_path, opened_sessions_stop_spinning, monkeypatch):
    import runtime.onnxruntime_backend as backend

    out = tmp_path / "spin.json"
    busy = []  # the --busy-cores processes: started with the measuring, and ended with it

    class Busy:
        def __init__(self):
            self.ended = False
            busy.append(self)

        def kill(self):
            self.ended = True

        def wait(self):
            assert self.ended

    monkeypatch.setattr(thread_spinning, "busy_core", Busy)
    allowed = []
    real = backend.session_options
    monkeypatch.setattr(backend, "session_options", lambda *a, **k: allowed.append(k["spin_during_run"]) or real(*a, **k))
    report = thread_spinning.main(["--artifacts", str(tiny_artifact), "--repeats", "2", "--prompt", "24",
                                   "--new-tokens", "12", "--early", "4", "--requests", "6", "--request-prompt", "8",
                                   "--request-outputs", "4:20", "--slots", "3", "--busy-cores", "1",
                                   "--pause", "0", "--threads", "1", "--out", str(out)], console=Console(quiet=True))
    assert len(busy) == 1 and busy[0].ended and report["settings"]["busy_cores"] == 1
    # per arm its prefill and decode sessions: both stop; the prefill stops, the decode spins on; never spinning
    # (during a run either); both spin on
    assert allowed == [True, True, True, True, False, False, True, True]
    assert opened_sessions_stop_spinning == [True, True, True, False, True, True, False, False]
    assert list(thread_spinning.ARMS.values()) == [{"spin_after_run": False}, {"spin_after_run": ["decode"]},
                                                   {"spin_during_run": False}, {"spin_after_run": True}]
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["settings"]["arms"] == thread_spinning.ARMS  # which setting each label stood for
    assert out.with_suffix(".png").stat().st_size > 0
    (result,) = report["results"]
    assert set(result["runs"]) == set(thread_spinning.ARMS)
    for runs in result["runs"].values():
        assert len(runs) == 2
        for run in runs:
            assert len(run["single"]["gaps_ms"]) == 11  # 12 tokens: 11 gaps
            assert run["continuous"] > 0 and run["static"] > 0
    for label, median in result["median"].items():
        runs = result["runs"][label]
        assert median["tpot_ms"] == pytest.approx(np.median([run["single"]["tpot_ms"] for run in runs]))
        assert median["static_tokens_per_s"] == pytest.approx(np.median([run["static"] for run in runs]))


def test_the_workload_is_fixed_and_within_its_lengths():
    ids = list(range(1000, 1400))
    first = thread_spinning.scheduler_workload(ids, 20, 128, (16, 256))
    assert first == thread_spinning.scheduler_workload(ids, 20, 128, (16, 256)) and len(first) == 20
    assert all(len(prompt) == 128 and 16 <= n <= 256 for prompt, n in first)
    assert len({tuple(prompt) for prompt, _ in first}) == 20  # different prompts
    with pytest.raises(ValueError, match="100 text tokens for 20 prompts of 128"):
        thread_spinning.scheduler_workload(ids[:100], 20, 128, (16, 256))


def test_too_few_new_tokens_for_the_early_window_is_refused(tiny_artifact, tmp_path):
    with pytest.raises(SystemExit, match="--new-tokens \\(4\\) must exceed --early \\(10\\)"):
        thread_spinning.main(["--artifacts", str(tiny_artifact), "--new-tokens", "4", "--out", str(tmp_path / "s.json")],
                             console=Console(quiet=True))


def test_a_bad_output_range_is_refused(tiny_artifact, tmp_path):
    with pytest.raises(SystemExit, match="--request-outputs: '9:3' needs 1 <= LOW <= HIGH"):
        thread_spinning.main(["--artifacts", str(tiny_artifact), "--request-outputs", "9:3",
                              "--out", str(tmp_path / "s.json")], console=Console(quiet=True))


@pytest.mark.parametrize("arguments, message", [
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--early", "0"], "--early must be at least 1, got 0"),
    (["--prompt", "120", "--new-tokens", "20"], "--prompt \\+ --new-tokens - 1 = 139 cache positions, above its max "
                                                "context 128"),
    (["--prompt", "8", "--new-tokens", "12", "--request-prompt", "100", "--request-outputs", "10:40"],
     "the longest --request-outputs - 1 = 139"),
])
def test_bad_settings_are_refused_before_any_work(tiny_artifact, tmp_path, arguments, message):
    with pytest.raises(SystemExit, match=message):
        thread_spinning.main(["--artifacts", str(tiny_artifact), *arguments, "--out", str(tmp_path / "s.json")],
                             console=Console(quiet=True))
