"""benchmarks/served_loglikelihood.py at a tiny size: lm-eval's loglikelihood requests over HTTP give what transformers
gives on the same (random) weights, and the script writes its table's numbers as JSON."""
from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import generate  # noqa: E402
import served_loglikelihood  # noqa: E402


def test_served_loglikelihoods_equal_transformers(tiny_artifact, tmp_path, monkeypatch):
    monkeypatch.setattr(generate, "RESULTS", tmp_path)  # the Hugging Face folder it writes for transformers
    out = tmp_path / "s.json"
    report = served_loglikelihood.main(["--artifact", str(tiny_artifact), "--items", "3", "--choices", "3",
                                        "--context-words", "5", "--concurrency", "2", "--out", str(out)])
    summary = report["summary"]
    assert summary["requests"] == 9 and summary["greedy_equal"] == 9
    assert summary["max_abs_diff"] < 1e-4 and summary["accuracy_served"] == summary["accuracy_reference"]
    assert json.loads(out.read_text())["summary"] == json.loads(json.dumps(summary))
    assert all(r["context_tokens"] > 0 and r["tokens"] > r["context_tokens"] for r in report["requests"])


def test_fewer_than_two_choices_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        served_loglikelihood.main(["--artifact", "/nonexistent", "--choices", "1"])
    assert "--choices must be >= 2" in capsys.readouterr().err
