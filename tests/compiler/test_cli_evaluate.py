"""compiler/cli_evaluate.py: the window and stride `aotlm eval` and `compare` choose and refuse (scoring itself is
tests/runtime/test_evaluate.py's)."""
from __future__ import annotations

import argparse
import json
import shutil

import pytest

from compiler import cli_evaluate
from compiler.cli_evaluate import _window_and_stride, _window_shown, _stride_shown
from runtime.evaluate import EvaluationError
from tests.compiler.test_cli_inputs import run_cli, wide_console  # noqa: F401 -- wide_console: autouse fixture
from tests.conftest import edited_copy


def window_and_stride(max_context: int, window: int | None = None, stride: int | None = None):
    artifact = argparse.Namespace(max_context=max_context, path="A")
    return _window_and_stride(argparse.Namespace(window=window, stride=stride), [artifact])


def test_the_default_window_is_512_or_the_whole_context_and_the_stride_half_of_it():
    assert window_and_stride(2048) == (512, 256)
    assert window_and_stride(100) == (100, 50)
    assert window_and_stride(128, window=128) == (128, 64)
    assert window_and_stride(128, window=40, stride=40) == (40, 40)


def test_a_window_past_the_context_or_too_short_names_only_the_flags_given():
    with pytest.raises(EvaluationError, match=r"^--window 129 exceeds the max context of A \(128\)$"):
        window_and_stride(128, window=129)
    with pytest.raises(EvaluationError) as refused:
        window_and_stride(128, window=1)
    assert str(refused.value).startswith("--window 1: ") and "--stride" not in str(refused.value)


def test_compare_fits_the_window_to_the_smaller_context_of_the_two(capsys, tiny_artifact, tmp_path):
    def shorter_context(manifest):  # the manifest's every record of it (compare refuses before the graphs load)
        manifest["kv_cache"]["max_context"] = manifest["kv_cache"]["shape"][2] = 64
        for engine in manifest["engines"].values():
            for entry in engine["inputs"]:
                if entry.get("kv_cache"):
                    entry["shape"][2] = 64

    smaller = edited_copy(tiny_artifact, tmp_path, shorter_context, name="smaller")
    for pair in ((tiny_artifact, smaller), (smaller, tiny_artifact)):
        status, output = run_cli(capsys, "compare", *pair, "--text", "builtin:pydoc-held-out", "--window", "100")
        assert status == 2 and f"--window 100 exceeds the max context of {smaller} (64)" in " ".join(output.split())


def test_the_window_shown_is_the_text_s_length_when_that_is_shorter():
    assert _window_shown(40, 40) == "40"
    assert _window_shown(40, 30) == "30 (all of them; --window 40)"
    assert _stride_shown(40, 20, 41) == "20"
    assert _stride_shown(40, 20, 40) == "- (one window)"  # no second window: the stride moved nothing


class Scored:
    """An evaluation result with distinct numbers for each field `eval` and `compare` print and write."""
    tokens_scored, windows, perplexity, mean_nll, reference_perplexity, reference_mean_nll = 49, 3, 12.5, 2.5, 10.0, 2.3
    top1_agreement, mean_kl = 0.875, 6.92e-07  # fixed six decimals printed it 0.000001, and below 5e-7 0.000000

    def to_dict(self):
        return {"tokens_scored": self.tokens_scored, "perplexity": self.perplexity}


def test_eval_and_compare_write_each_artifact_s_numbers_under_its_name(capsys, monkeypatch, tiny_artifact, tmp_path):
    monkeypatch.setattr(cli_evaluate, "_score", lambda *args: Scored())
    copy = shutil.copytree(tiny_artifact, tmp_path / "copy")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 8)
    argv = ("--text", text, "--max-tokens", "50", "--window", "32")
    status, output = run_cli(capsys, "compare", tiny_artifact, copy, *argv, "--json", tmp_path / "compare.json")
    written = json.loads((tmp_path / "compare.json").read_text())
    assert status == 0 and "87.50%" in output and "6.92e-07" in output, output
    assert (written["window"], written["stride"], written["tokens"], written["tokens_scored"]) == (32, 16, 50, 49)
    assert (written["reference"]["perplexity"], written["reference"]["mean_nll"]) == (10.0, 2.3)
    assert (written["candidate"]["perplexity"], written["candidate"]["mean_nll"]) == (12.5, 2.5)
    assert (written["top1_agreement"], written["mean_kl"]) == (0.875, 6.92e-07)
    status, output = run_cli(capsys, "eval", copy, *argv, "--json", tmp_path / "eval.json")
    alone = json.loads((tmp_path / "eval.json").read_text())
    assert status == 0 and alone["tokens"] == 50 and alone["tokens_sha256"] == written["tokens_sha256"], output
    status, output = run_cli(capsys, "eval", copy, *argv, "--json", "-")
    assert status == 0 and "wrote standard output" in output and "wrote -" not in output, output  # not a file "-"


# -- which artifact is the reference, and the text as written -------------------------
def test_compare_scores_the_candidate_against_the_reference_not_the_other_way(monkeypatch):
    """`compare A B`: B's perplexity is the result's, A's the reference's, and KL is KL(A || B). A self-compare
    (the only end-to-end compare test) cannot tell the two artifacts apart."""
    import numpy as np

    from runtime.evaluate import evaluate

    rng = np.random.default_rng(0)
    tables = {"A": rng.normal(size=(9, 9)), "B": 3 * rng.normal(size=(9, 9))}
    monkeypatch.setattr("runtime.Engine.load", lambda path, **options: path)
    monkeypatch.setattr("runtime.evaluate.decode_logits_for", lambda path: lambda ids: tables[path][ids])
    info = lambda path: argparse.Namespace(path=path, name=path)  # noqa: E731
    tokens = list(rng.integers(0, 9, size=40))
    result = cli_evaluate._score(argparse.Namespace(threads=None, no_spin=False), info("B"), info("A"), tokens, 16, 8)
    expected = evaluate(tokens, lambda ids: tables["B"][ids], window=16, stride=8,
                        reference_logits_for=lambda ids: tables["A"][ids])
    assert result == expected
    assert result.perplexity != pytest.approx(result.reference_perplexity)


def test_compare_prints_the_reference_s_perplexity_on_its_row(capsys, monkeypatch, tiny_artifact, tmp_path):
    monkeypatch.setattr(cli_evaluate, "_score", lambda *args: Scored())
    copy = shutil.copytree(tiny_artifact, tmp_path / "copy")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 8)
    status, output = run_cli(capsys, "compare", tiny_artifact, copy, "--text", text, "--max-tokens", "50")
    rows = {line.split("│")[1].strip(): line for line in output.splitlines() if line.count("│") > 3}
    assert status == 0 and "10.0000" in rows["A"] and "12.5000" in rows["B"], output


def test_eval_and_compare_json_name_kl_alike(capsys, monkeypatch, tiny_artifact, tmp_path):
    """compare's JSON named KL mean_kl_nats, where eval's JSON (Evaluation.to_dict) and the manifest's accuracy
    report name it mean_kl: a script reading both found no common key."""
    import dataclasses

    from runtime.evaluate import Evaluation

    monkeypatch.setattr(cli_evaluate, "_score", lambda *args: Scored())
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 8)
    status, output = run_cli(capsys, "compare", tiny_artifact, tiny_artifact, "--text", text, "--max-tokens", "50",
                             "--window", "32", "--json", tmp_path / "compare.json")
    compared = json.loads((tmp_path / "compare.json").read_text())
    assert status == 0 and compared["mean_kl"] == 6.92e-07 and "mean_kl_nats" not in compared, output
    assert {"mean_kl", "top1_agreement"} <= {field.name for field in dataclasses.fields(Evaluation)}  # eval's keys


@pytest.mark.parametrize("tokens", ["0", "1"])
def test_max_tokens_below_2_is_said_as_the_flag_not_the_text(capsys, tiny_artifact, tokens):
    """Without the flag's own check, --max-tokens 1 was blamed on the text ("1 token(s); scoring needs at least 2"),
    which holds thousands."""
    status, output = run_cli(capsys, "eval", tiny_artifact, "--text", "builtin:pydoc-held-out", "--max-tokens", tokens)
    assert status == 2 and f"--max-tokens must be >= 2 (one token of context, one scored), got {tokens}" in output


def test_a_text_that_is_a_fifo_or_a_device_is_refused_unread(capsys, tiny_artifact, tmp_path):
    """A FIFO hung `aotlm eval` for ever; /dev/zero read until memory ran out."""
    import os

    from compiler.cli import main

    fifo = tmp_path / "text.fifo"
    os.mkfifo(fifo)
    for text in (str(fifo), "/dev/zero"):
        assert main(["eval", str(tiny_artifact), "--text", text]) == 2
        assert "is not a regular file (a folder, a FIFO or a device)" in capsys.readouterr().err


def test_eval_reads_only_the_text_it_scores_and_refuses_one_that_is_not_text(capsys, tiny_artifact, tmp_path):
    """A 200 MB --text was read whole to score 64 tokens (and one bad byte far past them refused it); UTF-16 without
    a byte-order mark, read as UTF-8, was scored (perplexity 796 against 3.6 for the same text in UTF-8), as were
    1 MiB of zeros, which the build refuses as calibration text."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(("The lighthouse keeper lit the lamp at dusk. " * 3000).encode() + b"\xff")  # 132 kB
    status, output = run_cli(capsys, "eval", tiny_artifact, "--text", corpus, "--max-tokens", "64", "--window", "32")
    assert status == 0, output
    status, output = run_cli(capsys, "eval", tiny_artifact, "--text", corpus, "--max-tokens", "10000000")  # all of it
    assert status == 2 and f"--text {corpus}: the byte at offset 132000 (line 1, byte 132001 of the line) is 0xff: not UTF-8" in " ".join(output.split()), output
    utf16 = tmp_path / "utf16.txt"
    utf16.write_bytes(("The lighthouse keeper lit the lamp.\n" * 20).encode("utf-16-le"))
    zeros = tmp_path / "zeros.bin"
    zeros.write_bytes(b"\0" * (1 << 20))
    for path, problem in ((utf16, "it looks like UTF-16LE without a byte-order mark"), (zeros, "it looks binary")):
        status, output = run_cli(capsys, "compare", tiny_artifact, tiny_artifact, "--text", path)
        assert status == 2 and f"--text {path}: {problem}" in " ".join(output.split()), output
