"""benchmarks/pass_ab.py on the tiny recipe: both builds made, both prefill graphs timed, and skip_unused_rows
changes no logit through the whole artifact path."""
from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO, TINY_RECIPE

sys.path.insert(0, str(REPO / "benchmarks"))
import pass_ab  # noqa: E402


def test_tiny_recipe_with_and_without_skip_unused_rows(monkeypatch, tmp_path, tiny_artifact):
    reference = ["--reference", str(tiny_artifact), "--reference-prompts", "3", "--reference-tokens", "16"]
    monkeypatch.setattr(pass_ab, "OUT", tmp_path / "builds")
    out = tmp_path / "ab.json"
    result = pass_ab.main(["--recipe", str(TINY_RECIPE), "--prompt-lengths", "5,12", "--runs", "3",
                           "--threads", "1", "--load-runs", "1", "--out", str(out)] + reference)
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(result["results"]))
    for length in ("5", "12"):
        r = result["results"][length]
        assert r["logits_max_difference"] == 0.0
        assert len(r["run_ms"]["with"]) == len(r["run_ms"]["without"]) == 3
        assert r["ratio_of_medians"] > 0 and r["median_ms"]["with"] > 0
    names = {kind: [next(iter(p)) for p in json.loads((tmp_path / "builds" / f"tiny-random-{kind}-skip_unused_rows" /
                                                       "manifest.json").read_text())["recipe"]["passes"]]
             for kind in ("with", "without")}
    assert names["with"] == names["without"] + ["skip_unused_rows"]
    # Against the tiny artifact (the same recipe and weights) both variants' distributions are the reference's
    for kind in ("with", "without"):
        assert result["reference"][kind]["mean_kl"] == pytest.approx(0, abs=1e-9)
        assert result["reference"][kind]["top1_agreement"] == 1.0
    for kind in ("with", "without"):  # Engine.load measured in a fresh process
        cost = result["loading"][kind]
        assert cost["seconds"] > 0 and 0 < cost["resident_mb"] <= cost["peak_resident_mb"] and cost["files_mb"] > 0


def test_a_pass_the_recipe_does_not_list_is_refused_before_any_build(tmp_path, monkeypatch):
    monkeypatch.setattr(pass_ab, "OUT", tmp_path)
    with pytest.raises(SystemExit, match="lists no pass 'quantize' to leave out"):
        pass_ab.main(["--recipe", str(TINY_RECIPE), "--without", "quantize"])
    assert not any(tmp_path.iterdir())
