"""Accuracy evaluation (runtime/evaluate.py) and `aotlm eval` / `aotlm compare`, on the tiny artifact.

Perplexity from the decode graph is checked against the torch canonical decoder (full recompute, float32)
within 1e-4 relative; KL and top-1 agreement against the artifact itself and against altered logits.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from compiler import cli
from runtime.evaluate import (EvaluationError, builtin_text, decode_logits_for, encode_text, evaluate, log_softmax,
                              split_held_out, split_pydoc_text, window_spans)

TEXT = ("The lighthouse keeper climbed the stairs each evening, counting the steps as his father had, and "
        "lit the lamp before the sea turned dark. ")


# -- the window plan -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens, window, stride", [
    (2, 2, 1), (2, 2, 2), (3, 2, 2), (10, 4, 1), (10, 4, 2), (10, 4, 3), (10, 4, 4), (11, 4, 3),
    (100, 16, 5), (100, 16, 16), (5, 64, 32), (64, 64, 32), (65, 64, 32), (64, 64, 64), (300, 128, 100),
])
def test_window_spans_score_every_token_but_the_first_exactly_once(num_tokens, window, stride):
    spans = window_spans(num_tokens, window, stride)
    scored = [token for _, end, first in spans for token in range(first, end)]
    assert sorted(scored) == scored == list(range(1, num_tokens))  # once each, in order
    step = min(stride, window - 1)  # a window of W tokens scores at most W - 1
    for index, (start, end, first) in enumerate(spans):
        assert 0 <= start < first <= end <= num_tokens and end - start <= window
        if index:
            assert start - spans[index - 1][0] == step
        # the most left context available: the whole prefix, or at least window - step tokens
        assert first - start >= min(first, window - step)
    assert spans[0][0] == 0 and spans[-1][1] == num_tokens


@pytest.mark.parametrize("num_tokens", [0, 1])
def test_window_spans_of_too_short_texts_are_empty(num_tokens):
    assert window_spans(num_tokens, 8, 4) == []


@pytest.mark.parametrize("window, stride, message", [
    (1, 1, "window must be >= 2"), (0, 1, "window must be >= 2"),
    (8, 0, "stride must be between 1 and the window (8)"), (8, 9, "stride must be between 1 and the window (8)"),
])
def test_window_spans_refuse_bad_windows(window, stride, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        window_spans(10, window, stride)


# -- statistics against the torch reference ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokens(tiny_artifact):
    from runtime.tokenizer import TextTokenizer

    ids = encode_text(TextTokenizer(tiny_artifact / "tokenizer.json", 1), TEXT * 3)
    assert ids[0] != 1  # no BOS
    return np.array(ids, dtype=np.int64)


def torch_logits_for(decoder):
    """All-position logits from scratch (no cache), the torch canonical decoder's."""
    config = decoder.config

    def logits_for(token_ids: np.ndarray) -> np.ndarray:
        length = len(token_ids)
        empty = [torch.zeros(1, config.num_kv_heads, length, config.head_dim) for _ in range(config.num_layers)]
        with torch.no_grad():
            logits, _, _ = decoder(torch.tensor(token_ids[None]), torch.arange(length)[None],
                                   torch.ones(1, length, dtype=torch.long), empty, empty,
                                   attend_to_cache=False, logits="all")
        return logits[0].numpy()

    return logits_for


def test_decode_logits_match_torch_for_a_whole_chunk(tiny_engine, tiny_reference, tokens):
    decoder, _ = tiny_reference
    chunk = tokens[:50]
    np.testing.assert_allclose(decode_logits_for(tiny_engine.backend)(chunk), torch_logits_for(decoder)(chunk),
                               atol=1e-4)


def test_an_engine_with_fewer_tokens_per_decode_call_gets_the_chunk_in_pieces(tiny_artifact, tiny_reference, tokens):
    """TensorRT's decode engine takes at most decode_max_tokens per call (its profile); evaluation then feeds a
    chunk in pieces, each attending to the cached ones before it. Here onnxruntime's backend is given that limit
    (before, a window wider than the limit went to the engine whole and failed its profile)."""
    from runtime.onnxruntime_backend import OnnxRuntimeBackend
    from runtime.manifest import read_manifest

    decoder, _ = tiny_reference
    backend = OnnxRuntimeBackend(tiny_artifact, read_manifest(tiny_artifact))
    calls = []
    run = backend.run
    backend.run = lambda phase, ids, *rest: calls.append(ids.shape[1]) or run(phase, ids, *rest)
    for limit, expected_calls in ((7, [7] * 7 + [1]), (1, [1] * 50)):
        calls.clear()
        backend.max_decode_tokens = limit
        np.testing.assert_allclose(decode_logits_for(backend)(tokens[:50]), torch_logits_for(decoder)(tokens[:50]),
                                   atol=1e-4)
        assert calls == expected_calls


def test_a_long_chunk_is_scored_in_pieces_with_the_same_result(tiny_artifact, tokens, monkeypatch):
    """A window runs through the decode graph EVAL_PIECE_TOKENS positions at a time and is reduced that many rows at
    a time: one run over a 2048-token window had grown onnxruntime's arena by ~5.8 GiB on SmolLM2-135M. Same
    logits, same perplexity and KL as in one piece."""
    from runtime import evaluate as evaluation
    from runtime.manifest import read_manifest
    from runtime.onnxruntime_backend import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(tiny_artifact, read_manifest(tiny_artifact))
    calls = []
    run = backend.run
    backend.run = lambda phase, ids, *rest: calls.append(ids.shape[1]) or run(phase, ids, *rest)
    whole = decode_logits_for(backend)(tokens[:100])
    assert calls == [100]
    altered = lambda ids: decode_logits_for(backend)(ids) * 0.9  # noqa: E731 -- a reference that differs
    one_piece = evaluate(tokens[:100], decode_logits_for(backend), window=100, stride=50, reference_logits_for=altered)
    monkeypatch.setattr(evaluation, "EVAL_PIECE_TOKENS", 16)
    calls.clear()
    np.testing.assert_allclose(decode_logits_for(backend)(tokens[:100]), whole, atol=1e-5)
    assert calls == [16] * 6 + [4]
    pieces = evaluate(tokens[:100], decode_logits_for(backend), window=100, stride=50, reference_logits_for=altered)
    assert pieces.tokens_scored == one_piece.tokens_scored == 99
    assert pieces.mean_nll == pytest.approx(one_piece.mean_nll, rel=1e-6)
    assert pieces.mean_kl == pytest.approx(one_piece.mean_kl, rel=1e-4) and pieces.mean_kl > 0
    assert pieces.top1_agreement == one_piece.top1_agreement


def test_single_window_perplexity_equals_torch_mean_nll(tiny_engine, tiny_reference, tokens):
    decoder, _ = tiny_reference
    chunk = tokens[:60]
    result = evaluate(chunk, decode_logits_for(tiny_engine.backend), window=64, stride=32)
    log_probs = torch.log_softmax(torch.from_numpy(torch_logits_for(decoder)(chunk)).double(), dim=-1)
    nll = -log_probs[torch.arange(59), torch.from_numpy(chunk[1:])].mean().item()
    assert result.windows == 1 and result.tokens_scored == 59
    assert result.mean_nll == pytest.approx(nll, rel=1e-4)
    assert result.perplexity == pytest.approx(np.exp(nll), rel=1e-4)
    assert result.top1_agreement is None and result.mean_kl is None


def test_sliding_windows_score_n_minus_one_tokens_as_torch_does(tiny_engine, tiny_reference, tokens):
    decoder, _ = tiny_reference
    assert len(tokens) > 300
    progress = []
    result = evaluate(tokens, decode_logits_for(tiny_engine.backend), window=48, stride=20,
                      reference_logits_for=torch_logits_for(decoder), on_window=lambda *done: progress.append(done))
    assert result.tokens_scored == len(tokens) - 1
    assert progress == [(i, result.windows) for i in range(1, result.windows + 1)]
    assert result.perplexity == pytest.approx(result.reference_perplexity, rel=1e-4)
    assert 0 <= result.mean_kl < 1e-6


def test_artifact_against_itself_agrees_fully(tiny_engine, tokens):
    logits_for = decode_logits_for(tiny_engine.backend)
    result = evaluate(tokens[:200], logits_for, window=64, stride=16, reference_logits_for=logits_for)
    assert abs(result.mean_kl) < 1e-9 and result.top1_agreement == 1.0
    assert result.reference_perplexity == result.perplexity
    assert set(result.to_dict()) >= {"tokens_scored", "perplexity", "top1_agreement", "mean_kl"}


def test_kl_against_different_logits_is_positive(tiny_engine, tokens):
    logits_for = decode_logits_for(tiny_engine.backend)
    sharper = lambda ids: 3.0 * logits_for(ids)  # noqa: E731  (same argmax, different distribution)
    shuffled = lambda ids: np.roll(logits_for(ids), 1, axis=-1)  # noqa: E731
    as_sharper = evaluate(tokens[:100], sharper, window=32, stride=16, reference_logits_for=logits_for)
    assert as_sharper.mean_kl > 1e-3 and as_sharper.top1_agreement == 1.0
    as_shuffled = evaluate(tokens[:100], shuffled, window=32, stride=16, reference_logits_for=logits_for)
    assert as_shuffled.mean_kl > 1e-3 and as_shuffled.top1_agreement < 0.5  # a random model: near-uniform logits


def test_kl_matches_its_definition_on_small_logits():
    rng = np.random.default_rng(0)
    model, reference = rng.normal(size=(10, 7)), rng.normal(size=(10, 7))
    tokens = rng.integers(0, 7, size=10)
    result = evaluate(tokens, lambda ids: model[: len(ids)], window=10, stride=5,
                      reference_logits_for=lambda ids: reference[: len(ids)])
    model, reference = model[:9], reference[:9]  # row i predicts token i + 1: the last row predicts nothing here
    p_ref = np.exp(reference) / np.exp(reference).sum(-1, keepdims=True)
    p_model = np.exp(model) / np.exp(model).sum(-1, keepdims=True)
    assert result.mean_kl == pytest.approx(np.mean((p_ref * np.log(p_ref / p_model)).sum(-1)), rel=1e-12)
    assert result.mean_nll == pytest.approx(-np.mean(np.log(p_model[np.arange(9), tokens[1:]])), rel=1e-12)
    # the reference's own perplexity, from the reference's probabilities (the report puts the two side by side)
    assert result.reference_perplexity == pytest.approx(np.exp(-np.mean(np.log(p_ref[np.arange(9), tokens[1:]]))),
                                                        rel=1e-12)
    assert result.reference_perplexity != pytest.approx(result.perplexity)


def test_log_softmax_is_stable_for_large_logits():
    values = log_softmax(np.array([[1e4, 0.0, -1e4], [3e38, 3e38, 0.0]], dtype=np.float32))
    assert np.isfinite(values).all() and values.dtype == np.float64
    np.testing.assert_allclose(values[1, :2], [np.log(0.5)] * 2)


def test_each_piece_of_a_chunk_runs_at_its_own_positions():
    """Pieces past the first continue the sequence: positions start..end - 1 and a mask over every token so far. The
    tiny artifact cannot show a wrong position (onnxruntime's GroupQueryAttention derives them from the mask), so a
    recording backend checks what a TensorRT engine, whose rotary reads position_ids, would be given."""
    from types import SimpleNamespace

    calls = []

    def run(phase, input_ids, positions, mask):
        calls.append((phase, input_ids.tolist(), positions.tolist(), mask.shape))
        return np.zeros((1, input_ids.shape[1], 5), np.float32)

    backend = SimpleNamespace(kv_spec={"max_context": 16}, max_decode_tokens=4, run=run,
                              allocate_cache=lambda batch: None, manifest={"model": {"config": {"vocab_size": 20}}})
    assert decode_logits_for(backend)(np.arange(10, 20)).shape == (10, 5)
    assert calls == [("decode", [[10, 11, 12, 13]], [[0, 1, 2, 3]], (1, 4)),
                     ("decode", [[14, 15, 16, 17]], [[4, 5, 6, 7]], (1, 8)),
                     ("decode", [[18, 19]], [[8, 9]], (1, 10))]


def test_decode_logits_refuse_chunks_longer_than_max_context(tiny_engine):
    with pytest.raises(EvaluationError, match="max context \\(128\\)"):
        decode_logits_for(tiny_engine.backend)(np.ones(129, dtype=np.int64))


def test_pydoc_text_splits_into_calibration_and_held_out():
    from pydoc_data.topics import topics

    calibration, held_out = split_pydoc_text()
    text = "\n\n".join(topics[name] for name in sorted(topics))
    assert calibration + held_out == text and held_out.startswith("\n\n")
    assert 0.9 * len(text) <= len(calibration) and "\n\n" not in text[int(0.9 * len(text)): len(calibration)]
    assert builtin_text("pydoc-held-out") == held_out and builtin_text("pydoc-calibration") == calibration
    with pytest.raises(EvaluationError, match="unknown built-in text 'nope'; known: pydoc-held-out"):
        builtin_text("nope")


def test_held_out_part_starts_at_a_paragraph_boundary_at_or_after_90_percent():
    text = "a" * 36 + "\n\nb\n\n"  # 41 characters: 90% is character 36, where a paragraph boundary starts
    assert split_held_out(text) == ("a" * 36, "\n\nb\n\n")
    before = "a" * 5 + "\n\n" + "b" * 39  # 46 characters: its boundary, at 5, is before 90% of 50
    assert split_held_out(before + "\n\ncc") == (before, "\n\ncc")
    assert split_held_out("x" * 20) == ("x" * 18, "x" * 2)  # none: at 90% exactly


# -- the command line ----------------------------------------------------------------------------------------
@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT * 2, encoding="utf-8")
    return path


def test_cli_eval_prints_and_writes_perplexity(tiny_artifact, tiny_engine, text_file, tokens, tmp_path, capsys):
    out = tmp_path / "results" / "eval.json"
    assert cli.main(["eval", str(tiny_artifact), "--text", str(text_file), "--max-tokens", "150",
                     "--window", "40", "--json", str(out)]) == 0
    shown = capsys.readouterr().out  # the result table is the command's output: stdout (it was stderr)
    assert "perplexity" in shown and "tiny-random" in shown
    written = json.loads(out.read_text())
    assert written["tokens"] == 150 and written["tokens_scored"] == 149
    assert (written["window"], written["stride"]) == (40, 20)  # stride defaults to window / 2
    assert written["bytes"] == sum(r["bytes"] for r in json.loads((tiny_artifact / "manifest.json").read_text())
                                   ["files"].values())
    direct = evaluate(tokens[:150], decode_logits_for(tiny_engine.backend), window=40, stride=20)
    assert written["perplexity"] == pytest.approx(direct.perplexity, rel=1e-6)


def test_cli_eval_shows_the_window_it_used_on_a_short_text(tiny_artifact, text_file, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # the result table's console: stdout's
    assert cli.main(["eval", str(tiny_artifact), "--text", str(text_file), "--max-tokens", "30", "--window", "40"]) == 0
    assert "30 (all of them; --window 40)" in capsys.readouterr().out


def test_cli_eval_builtin_text_and_default_window(tiny_artifact, tmp_path):
    out = tmp_path / "eval.json"
    assert cli.main(["eval", str(tiny_artifact), "--text", "builtin:pydoc-held-out", "--max-tokens", "140",
                     "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert (written["window"], written["stride"]) == (128, 64)  # 512 capped at the max context
    assert written["tokens_scored"] == 139 and written["text"] == "builtin:pydoc-held-out"


def test_cli_compare_an_artifact_with_a_copy_of_itself(tiny_artifact, text_file, tmp_path, capsys):
    copy = shutil.copytree(tiny_artifact, tmp_path / "copy")
    out = tmp_path / "compare.json"
    assert cli.main(["compare", str(tiny_artifact), str(copy), "--text", str(text_file), "--max-tokens", "90",
                     "--window", "32", "--stride", "8", "--json", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "top-1" in shown and "KL" in shown
    written = json.loads(out.read_text())
    assert written["top1_agreement"] == 1.0 and abs(written["mean_kl"]) < 1e-9
    assert written["reference"]["perplexity"] == written["candidate"]["perplexity"]
    assert written["tokens_scored"] == 89 and written["kl_direction"] == "KL(reference || candidate)"


def one_line_error(capsys) -> str:
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines at the terminal width
    assert err.startswith("error:") and "Traceback" not in err
    return err


@pytest.mark.parametrize("args, message", [
    (["--text", "missing.txt"], "--text missing.txt: no such file"),
    (["--text", "builtin:nope"], "--text builtin:nope: unknown built-in text; give builtin:pydoc-held-out or "
                                 "builtin:pydoc-calibration"),
    (["--window", "1"], "error: --window 1: window must be >= 2"),  # not a default stride 1 the user never gave
    (["--window", "16", "--stride", "0"], "stride must be between 1 and the window (16)"),
    (["--window", "16", "--stride", "17"], "stride must be between 1 and the window (16)"),
    (["--window", "1000"], "--window 1000 exceeds the max context of"),
    (["--max-tokens", "1"], "--max-tokens must be >= 2"),
])
def test_cli_eval_bad_input_one_line_exit_2(tiny_artifact, text_file, capsys, monkeypatch, args, message):
    monkeypatch.chdir(text_file.parent)
    base = ["eval", str(tiny_artifact), "--text", text_file.name]
    assert cli.main(base + args) == 2
    assert message in one_line_error(capsys)


@pytest.mark.parametrize("content, count", [("a", 1), ("", 0)])
def test_cli_eval_refuses_texts_shorter_than_two_tokens(tiny_artifact, tmp_path, capsys, content, count):
    path = tmp_path / "short.txt"
    path.write_text(content)
    assert cli.main(["eval", str(tiny_artifact), "--text", str(path)]) == 2
    assert f"{count} token(s); scoring needs at least 2" in one_line_error(capsys)


def test_cli_compare_errors(tiny_artifact, text_file, tmp_path, capsys):
    assert cli.main(["compare", str(tiny_artifact), str(tiny_artifact), "--text", str(tmp_path / "no.txt")]) == 2
    assert "no such file" in one_line_error(capsys)
    other = shutil.copytree(tiny_artifact, tmp_path / "other")
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + " ")
    manifest = json.loads((other / "manifest.json").read_text())  # a consistent artifact with another tokenizer
    manifest["files"]["tokenizer.json"]["bytes"] += 1
    (other / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["compare", str(tiny_artifact), str(other), "--text", str(text_file)]) == 2
    assert "have different tokenizers" in one_line_error(capsys)
    assert cli.main(["compare", str(tiny_artifact), str(tmp_path), "--text", str(text_file)]) == 2
    assert "not an artifact" in one_line_error(capsys)


def test_cli_compare_refuses_another_vocabulary_before_loading_either(tiny_artifact, text_file, tmp_path, capsys,
                                                                       monkeypatch):
    other = shutil.copytree(tiny_artifact, tmp_path / "padded")  # same tokenizer, a padded vocabulary
    manifest = json.loads((other / "manifest.json").read_text())
    vocab = manifest["model"]["config"]["vocab_size"]
    manifest["model"]["config"]["vocab_size"] = vocab + 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr("runtime.Engine.load", lambda *a, **k: pytest.fail("an artifact was loaded"))
    assert cli.main(["compare", str(tiny_artifact), str(other), "--text", str(text_file)]) == 2
    assert f"scores {vocab} vocabulary entries and {other} {vocab + 64}" in one_line_error(capsys)


def test_evaluating_an_engine_takes_turns_with_its_generations(tiny_engine, tokens):
    """decode_logits_for(engine) holds the engine's batch-1 cache per chunk: a generation in another thread
    neither sees the evaluation's keys in its cache nor writes into the evaluation's."""
    import threading

    prompt = [int(t) for t in tokens[:20]]
    alone_tokens = tiny_engine.generate(prompt, max_new_tokens=24).token_ids
    alone = evaluate(tokens[:240], decode_logits_for(tiny_engine), window=48, stride=24)
    generated, errors = [], []

    def generate_repeatedly():
        try:
            for _ in range(6):
                generated.append(tiny_engine.generate(prompt, max_new_tokens=24).token_ids)
        except Exception as error:  # pragma: no cover - reported by the assertion below
            errors.append(error)

    thread = threading.Thread(target=generate_repeatedly)
    thread.start()
    together = [evaluate(tokens[:240], decode_logits_for(tiny_engine), window=48, stride=24) for _ in range(3)]
    thread.join()
    assert not errors
    assert generated == [alone_tokens] * 6
    assert [result.perplexity for result in together] == [alone.perplexity] * 3


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_a_nan_or_infinite_logit_is_an_error_not_a_nan_perplexity(poison):
    vocab, tokens = 7, np.arange(12) % 7

    def logits_for(chunk):
        logits = np.zeros((len(chunk), vocab), np.float32)
        logits[5, 3] = poison  # row 5 of the first window predicts token 6
        return logits

    with pytest.raises(EvaluationError, match=r"the model's logits are NaN or infinite at position 5 \(predicting token 6; the window from token 0"):
        evaluate(tokens, logits_for, window=12, stride=6)
    with pytest.raises(EvaluationError, match="the reference's logits are NaN or infinite"):
        evaluate(tokens, lambda chunk: np.zeros((len(chunk), vocab)), window=12, stride=6, reference_logits_for=logits_for)


def test_the_build_reports_window_cut_to_the_context_keeps_half_as_context():
    from compiler.accuracy import report_window_and_stride

    assert report_window_and_stride(512, 256, 2048) == (512, 256)  # fits: the recipe's own
    assert report_window_and_stride(64, 64, 128) == (64, 64)  # fits: even a stride equal to the window
    assert report_window_and_stride(512, 256, 128) == (128, 64)  # was (128, 128): one token of context
    assert report_window_and_stride(512, 256, 300) == (300, 150)  # was (300, 256): 44 tokens of context
    assert report_window_and_stride(512, 32, 128) == (128, 32)  # a smaller stride stands


def test_eval_warns_when_this_pythons_builtin_text_is_not_the_reports(capsys):
    from types import SimpleNamespace

    from compiler.cli_evaluate import _warn_if_not_the_report_text
    from runtime.evaluate import tokens_fingerprint

    ids = list(range(100, 160))
    report = {"text": "pydoc_data.topics (Python's documentation), last 10% (held out)", "tokens": 50,
              "tokens_sha256": tokens_fingerprint(ids[:50]), "python": "3.11.7"}
    artifact = SimpleNamespace(name="int4", manifest={"accuracy": {"held_out": report}})
    builtin, other_file = SimpleNamespace(text="builtin:pydoc-held-out"), SimpleNamespace(text="notes.txt")
    _warn_if_not_the_report_text(builtin, artifact, ids)  # the same first 50 tokens: silent
    _warn_if_not_the_report_text(other_file, artifact, ids[::-1])  # not the built-in text: nothing to compare
    assert capsys.readouterr().err == ""
    _warn_if_not_the_report_text(builtin, artifact, ids[1:])
    err = " ".join(capsys.readouterr().err.split())
    assert "is not the one int4's build report scored (Python 3.11.7)" in err


def test_encode_text_tokenizes_only_the_prefix_it_needs(tiny_artifact):
    """--max-tokens N of a large text: the whole text's first N ids, from a prefix of it (a 9 MB file was tokenized
    whole for 50 tokens: 11 s and 1.7 GB). A prefix cut inside a long word must not change the ids kept."""
    from runtime.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(tiny_artifact / "tokenizer.json", 1)
    encoded = []
    inner = tokenizer.tokenizer

    class Counting:  # records how much text each encode call was given
        def encode(self, text, add_special_tokens):
            encoded.append(len(text))
            return inner.encode(text, add_special_tokens=add_special_tokens)

    counting = type("T", (), {"tokenizer": Counting()})()
    text = builtin_text("pydoc-held-out") * 20  # ~0.9 M characters
    whole = encode_text(tokenizer, text)
    for count in (1, 2, 57, 1000, 5000):
        encoded.clear()
        assert encode_text(counting, text, count) == whole[:count]
        assert max(encoded) <= max(4 * 8 * count, 4 * 4096) < len(text)  # a prefix, at most 2 doublings past 8/token
    long_word = "x" * 40_000 + "yz " + TEXT * 50  # one pre-token longer than any first prefix
    assert encode_text(counting, long_word, 30) == encode_text(tokenizer, long_word)[:30]
    assert encode_text(counting, TEXT, 10_000) == encode_text(tokenizer, TEXT)  # short: all of it


def test_eval_with_fewer_tokens_than_the_report_still_recognizes_its_text(tiny_artifact, capsys):
    """`aotlm eval --text builtin:pydoc-held-out --max-tokens 100` on an artifact whose report scored 600 tokens
    warned that this Python's text was not the report's (naming the same Python twice): only 100 were compared."""
    from types import SimpleNamespace

    from compiler.cli_evaluate import _evaluation_tokens
    from runtime.evaluate import tokens_fingerprint
    from runtime.tokenizer import TextTokenizer

    held_out = encode_text(TextTokenizer(tiny_artifact / "tokenizer.json", 1), builtin_text("pydoc-held-out"))
    report = {"text": "pydoc_data.topics (Python's documentation), last 10% (held out)", "tokens": 600,
              "tokens_sha256": tokens_fingerprint(held_out[:600]), "python": "3.11.7"}
    artifact = SimpleNamespace(name="int4", manifest={"accuracy": {"held_out": report}},
                               tokenizer_file=tiny_artifact / "tokenizer.json")
    args = SimpleNamespace(text="builtin:pydoc-held-out", max_tokens=100)
    assert _evaluation_tokens(args, [artifact]) == held_out[:100]
    assert capsys.readouterr().err == ""
    report["tokens_sha256"] = tokens_fingerprint(held_out[1:601])  # another text: still warned about
    assert _evaluation_tokens(args, [artifact]) == held_out[:100]
    assert "is not the one int4's build report scored" in " ".join(capsys.readouterr().err.split())


def test_a_paragraph_break_only_at_the_end_does_not_leave_a_blank_held_out_part():
    text = ("A paragraph of notes. " * 5 + "\n\n") * 8  # every paragraph ends with a blank line, the last one too
    calibration, held_out = split_held_out(text)
    assert calibration + held_out == text
    assert held_out.strip(), repr(held_out)  # today: "\n\n", one scored token
    assert len(held_out) >= 0.05 * len(text)


def test_a_paragraph_break_near_the_end_does_not_shrink_the_held_out_part():
    text = "word " * 2000 + "\n\nThe end.\n"  # the only break after 90% is at 99.9%
    _, held_out = split_held_out(text)
    assert len(held_out) >= 0.05 * len(text)


def test_the_builtin_split_is_unchanged():
    calibration, held_out = split_pydoc_text()
    assert held_out.startswith("\n\n") and 0.90 <= len(calibration) / (len(calibration) + len(held_out)) < 0.901


# -- refusals and boundaries of evaluate and split_held_out ---------------------------
def test_a_reference_with_another_vocabulary_is_refused_by_name():
    rng = np.random.default_rng(0)
    model, reference = rng.normal(size=(10, 7)), rng.normal(size=(10, 8))
    with pytest.raises(EvaluationError, match=r"^the reference's logits have shape \(9, 8\), the model's \(9, 7\): "
                                              r"top-1 agreement and KL need the same vocabulary$"):
        evaluate(np.arange(10) % 7, lambda ids: model[: len(ids)], window=10, stride=5,
                 reference_logits_for=lambda ids: reference[: len(ids)])


@pytest.mark.parametrize("count", [0, 1])
def test_evaluate_refuses_fewer_than_two_tokens(count):
    with pytest.raises(EvaluationError, match=rf"^the text has {count} token\(s\); scoring needs at least 2$"):
        evaluate(np.zeros(count, np.int64), lambda ids: np.zeros((len(ids), 5)), window=8, stride=4)


@pytest.mark.parametrize("rows", [9, 11])
def test_logits_with_a_row_per_token_too_many_or_too_few_are_refused(rows):
    with pytest.raises(EvaluationError, match=rf"^logits_for returned shape \({rows}, 5\); expected \[10, vocab\]$"):
        evaluate(np.arange(10) % 5, lambda ids: np.zeros((rows, 5)), window=10, stride=5)


def test_sliding_window_statistics_match_a_numpy_reference():
    """Several windows, a stride below the window, and a model whose logits depend on the left context the window
    gives it: each token's NLL / KL / top-1 must come from the first window that scores it (HF's sliding window)."""
    rng = np.random.default_rng(3)
    vocab, n, window, stride = 11, 23, 8, 3
    tokens = rng.integers(0, vocab, size=n)
    table_model, table_ref = rng.normal(size=(vocab, vocab)), rng.normal(size=(vocab, vocab))

    def logits(table):  # row i: the chunk's tokens so far, weighted by how far back they are
        def logits_for(ids):
            weights = 0.5 ** np.arange(len(ids))[::-1]
            return np.stack([(table[ids[: i + 1]] * weights[-(i + 1):, None]).sum(0) for i in range(len(ids))])
        return logits_for

    result = evaluate(tokens, logits(table_model), window=window, stride=stride,
                      reference_logits_for=logits(table_ref))
    nll, ref_nll, kl, agree = [], [], [], []
    for t in range(1, n):  # the first window that holds t after its first position: starts at a multiple of stride
        start = 0 if t < window else stride * -(-(t - window + 1) // stride)
        context = tokens[start:t]
        lm, lr = logits(table_model)(context)[-1], logits(table_ref)(context)[-1]
        pm, pr = np.exp(lm - lm.max()), np.exp(lr - lr.max())
        pm, pr = pm / pm.sum(), pr / pr.sum()
        nll.append(-np.log(pm[tokens[t]]))
        ref_nll.append(-np.log(pr[tokens[t]]))
        kl.append((pr * np.log(pr / pm)).sum())
        agree.append(lm.argmax() == lr.argmax())
    assert result.tokens_scored == n - 1 and result.windows == len(window_spans(n, window, stride))
    assert result.mean_nll == pytest.approx(np.mean(nll), rel=1e-12)
    assert result.perplexity == pytest.approx(np.exp(np.mean(nll)), rel=1e-12)
    assert result.reference_perplexity == pytest.approx(np.exp(np.mean(ref_nll)), rel=1e-12)
    assert result.mean_kl == pytest.approx(np.mean(kl), rel=1e-12)
    assert result.top1_agreement == pytest.approx(np.mean(agree), rel=1e-12)


def test_a_paragraph_boundary_at_exactly_95_percent_still_starts_the_held_out_part():
    text = "a" * 95 + "\n\nbcd"  # 100 characters: the boundary at 95, "by 95%"
    assert split_held_out(text) == ("a" * 95, "\n\nbcd")
    assert split_held_out("a" * 96 + "\n\nbc") == ("a" * 90, "a" * 6 + "\n\nbc")  # at 96%: at 90% exactly


def test_a_paragraph_boundary_at_exactly_90_percent_starts_the_held_out_part():
    text = "a" * 90 + "\n\nbb\n\ncccc"  # 100 characters: boundaries at 90 and at 94
    assert split_held_out(text) == ("a" * 90, "\n\nbb\n\ncccc")


def test_a_blank_tail_after_the_last_paragraph_boundary_is_not_the_whole_held_out_part():
    text = "x" * 92 + "\n\n" + "   \n  \n\t"  # its only boundary (at 92%) leads to whitespace alone
    calibration, held_out = split_held_out(text)
    assert calibration + held_out == text and held_out.strip()
    assert (calibration, held_out) == (text[:91], text[91:])  # at 90% exactly


@pytest.mark.parametrize("token_ids, message", [
    ([10.7, 20.7, 30.7], r"^token ids must be integers; got 10.7 \(float\)$"),  # an int64 cast scored 10 and 20
    (np.array([10.7, 20.7]), r"^token ids must be integers; got float64 values"),
    (np.array([[1, 2, 3]]), r"^token_ids must be one flat list of token ids; got a 2-D array; pass ids\[0\]$"),
    (np.array([True, False, True]), r"^token ids must be integers; got bool values"),
    ([True, 5, 6, 7], r"^token ids must be integers; got True \(bool\)$"),  # was scored as token 1
    ([5, 6, 7, 2**63], r"^token id 9223372036854775808 is outside any vocabulary$"),  # blamed 5.0 as a float
    ([[1, 2, 3]], r"^token_ids must be one flat list of token ids; got a list of lists \(pass ids\[0\]\)$"),
])
def test_evaluate_refuses_token_ids_that_are_not_one_flat_list_of_integers(token_ids, message):
    with pytest.raises(EvaluationError, match=message):
        evaluate(token_ids, lambda ids: np.zeros((len(ids), 5)), window=8, stride=4)


@pytest.mark.parametrize("bad", [-502, 512, 5000])
def test_decode_logits_refuse_ids_outside_the_vocabulary(tiny_engine, bad):
    """A negative id wrapped to a row from the end in onnxruntime's Gather (-502 scored as 10, without a word); one
    past the table was a RuntimeError from inside onnxruntime."""
    with pytest.raises(EvaluationError, match=rf"^token id {bad} is outside this model's vocabulary \(0\.\.511\)$"):
        evaluate([10, 20, bad, 40], decode_logits_for(tiny_engine), window=8, stride=4)


def test_encode_text_refuses_a_negative_max_tokens(tiny_artifact):
    from runtime.engine import Engine
    engine = Engine.load(tiny_artifact)
    try:
        with pytest.raises(EvaluationError, match=r"^max_tokens must be a whole number of 0 or more"):
            encode_text(engine.tokenizer, "hello world, and more words", max_tokens=-1)  # dropped the last id
        assert len(encode_text(engine.tokenizer, "hello world, and more words", max_tokens=3)) == 3
    finally:
        engine.close()


def test_cli_eval_with_its_json_on_stdout_keeps_the_table_on_stderr(tiny_artifact, text_file, capsys):
    assert cli.main(["eval", str(tiny_artifact), "--text", str(text_file), "--max-tokens", "60", "--window", "40",
                     "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["tokens_scored"] == 59 and "perplexity on" in captured.err  # `| jq` gets JSON


def test_cli_eval_with_its_json_on_dev_stdout_keeps_the_table_on_stderr(tiny_artifact, text_file, tmp_path):
    """--json /dev/stdout: the table went to stdout first, and `| jq` failed at its first line."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "compiler.cli", "eval", str(tiny_artifact), "--text", str(text_file),
                           "--max-tokens", "60", "--window", "40", "--json", "/dev/stdout"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tokens_scored"] == 59 and "perplexity on" in done.stderr
