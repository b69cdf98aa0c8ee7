"""compiler/calibration.py and the build's held-out text (compiler/accuracy.py): the texts are tokenized whole, as
the runtime encodes them, and the report's source names the built-in text only when it is that text."""
from __future__ import annotations

import dataclasses
import json
import re
from argparse import Namespace

import numpy as np
import pytest

from compiler import cli_evaluate
from compiler.accuracy import (HeldOut, first_repeated_run, held_out_tokens, quantization_summary, repeated_text_warning,
                               report_window_and_stride)
from compiler.pass_reports import format_accuracy
from compiler.calibration import BUILTIN_SOURCE, resolve, resolve_passes, split_text
from compiler.errors import BuildError
from compiler.recipe import PassSpec
from passes.calibration import CalibrationSet, CalibrationSpec
from runtime.evaluate import split_held_out
from runtime.tokenizer import TextTokenizer


def with_settings(tiny_artifact, **settings) -> str:
    """The tiny artifact's tokenizer.json as some files ship: with truncation or padding set."""
    data = json.loads((tiny_artifact / "tokenizer.json").read_text())
    data.update(settings)
    return json.dumps(data)


TRUNCATION = {"truncation": {"direction": "Right", "max_length": 100, "strategy": "LongestFirst", "stride": 0}}
PADDING = {"padding": {"strategy": {"Fixed": 1024}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "<pad>"}}


def test_calibration_and_held_out_texts_are_tokenized_whole(tiny_artifact):
    """With truncation set, calibration saw 100 tokens of Python's documentation ("too short for 4 samples of 64")
    and the report scored 100 held-out tokens; with padding, 626 pad ids. The runtime encodes texts whole."""
    whole = TextTokenizer(tiny_artifact / "tokenizer.json")
    calibration, held_out, _ = split_text("pydoc")
    for settings in (TRUNCATION, PADDING):
        tokenizer_json = with_settings(tiny_artifact, **settings)
        found = resolve(CalibrationSpec(text="pydoc", samples=4, length=64, seed=1), tokenizer_json)
        assert found.source["tokens_available"] == len(whole.encode(calibration, add_special_tokens=False)) > 1024
        ids = held_out_tokens("pydoc", tokenizer_json, 400).tokens
        assert list(ids) == whole.encode(held_out, add_special_tokens=False)[:400]


BOS_PROCESSOR = {"post_processor": {  # as Llama's tokenizer.json: every encoding with special tokens starts with <s>
    "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                             {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}}


def test_calibration_text_gets_no_bos_from_a_tokenizer_that_adds_one(tiny_artifact):
    whole = TextTokenizer(tiny_artifact / "tokenizer.json")
    calibration, held_out, _ = split_text("pydoc")
    tokenizer_json = with_settings(tiny_artifact, **BOS_PROCESSOR)
    found = resolve(CalibrationSpec(text="pydoc", samples=2, length=64, seed=1), tokenizer_json)
    assert found.source["tokens_available"] == len(whole.encode(calibration, add_special_tokens=False))
    scored = held_out_tokens("pydoc", tokenizer_json, 5).tokens
    assert list(scored) == whole.encode(held_out, add_special_tokens=False)[:5]


def test_a_calibration_file_whose_path_says_pydoc_is_not_the_builtin_text():
    """The report's text was taken for the built-in one when its path held "pydoc", and eval warned of another
    Python's documentation, naming the same Python twice."""
    args = Namespace(text="builtin:pydoc-held-out")
    for source, builtin in (("/home/me/mypydoc-notes.txt, last 10% (held out)", False),
                            ("pydoc_data.topics (Python's documentation), last 10% (held out)", True)):
        manifest = {"accuracy": {"held_out": {"tokens_sha256": "abc", "tokens": 100, "text": source}}}
        artifact = Namespace(manifest=manifest)
        assert cli_evaluate._report_tokens(args, artifact) == (("abc", 100) if builtin else (None, 0))


def test_first_repeated_run_finds_where_a_run_of_the_seen_text_starts():
    seen = "".join(f"<{i:03d}>" for i in range(200))  # 1000 characters, no run repeated within
    text = "-" * 10 + seen[100:100 + 119] + "|" + seen[300:300 + 160] + "|"
    # 119 characters in a row of `seen` are not enough (length 160 finds no run under 121); the 160 after are
    assert first_repeated_run(text, seen, length=160) == 10 + 119 + 1
    assert first_repeated_run(text, seen, length=300) is None  # it finds no run under 226 characters
    assert first_repeated_run(text[::-1], seen, length=20) is None  # the order counts
    for start in range(300, 340):  # a run is found wherever it starts against the indexed pieces
        assert first_repeated_run("|" + seen[start:start + 160], seen, length=160) == 1


def test_held_out_text_that_repeats_the_calibration_part_is_named(tiny_artifact, tmp_path):
    """The built-in text's held-out `while`/`with` topics repeat its calibration part's `compound` topic word for word
    past about their 10,000th token: a report scoring that many tokens must say so, and the default 4096 is clean."""
    tokenizer_json = (tiny_artifact / "tokenizer.json").read_text()
    assert held_out_tokens("pydoc", tokenizer_json, 4096).repeats_calibration_from is None
    whole = held_out_tokens("pydoc", tokenizer_json, 10**6)
    assert 4096 < whole.repeats_calibration_from < len(whole.tokens)
    assert f"set accuracy.max_tokens to {whole.repeats_calibration_from} or less" in repeated_text_warning(whole)
    # A file of its own: a paragraph of the first 90% copied into the held-out 10% is found where it starts
    paragraphs = [" ".join(f"word{i}x{j}" for j in range(40)) for i in range(60)]
    text = tmp_path / "notes.txt"
    text.write_text("\n\n".join(paragraphs + [paragraphs[3]]))
    held_out = split_text(str(text))[1]
    copied_from = len(TextTokenizer(tiny_artifact / "tokenizer.json").encode(
        held_out[:held_out.index(paragraphs[3])], add_special_tokens=False))
    repeated = held_out_tokens(str(text), tokenizer_json, 10**6)
    # the run starts a few characters early: the paragraph before ends as the one before the original does ("x39")
    assert copied_from - 8 <= repeated.repeats_calibration_from <= copied_from
    assert repeated_text_warning(held_out_tokens(str(text), tokenizer_json, copied_from - 8)) is None


def test_split_text_reads_a_file_by_its_path_and_refuses_what_it_cannot_read(tmp_path, monkeypatch):
    calibration, held_out, source = split_text("pydoc")
    assert len(calibration) > 9 * len(held_out) > 0 and source == {"source": f"{BUILTIN_SOURCE}, first 90%"}
    notes = tmp_path / "mypydoc notes.txt"  # "pydoc" in a path is a file like any other
    paragraphs = [f"paragraph {i} " * 20 for i in range(20)]
    notes.write_text("\n\n".join(paragraphs), encoding="utf-8")
    monkeypatch.setenv("HOME", str(tmp_path))
    calibration, held_out, source = split_text("~/mypydoc notes.txt")
    assert (calibration, held_out) == split_held_out(notes.read_text(encoding="utf-8"))
    assert source == {"source": f"{notes.resolve()}, first 90%"}
    with pytest.raises(BuildError, match=r"calibration.text: .*: a folder; give a UTF-8 text file, or 'pydoc' for "
                                         r"the built-in text"):
        split_text(str(tmp_path))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 10)
    with pytest.raises(BuildError, match=r"calibration.text: .*latin1.txt: the byte at offset 3 \(line 1, byte 4 of the line\) is "
                                         r"0xe9: not UTF-8"):
        split_text(str(tmp_path / "latin1.txt"))


def test_one_calibration_set_per_distinct_spec_shared_by_the_passes_that_name_it(tiny_artifact):
    @dataclasses.dataclass(frozen=True)
    class Options:
        calibration: CalibrationSpec | None = None

    tokenizer_json = (tiny_artifact / "tokenizer.json").read_text()
    spec, other = CalibrationSpec(samples=2, length=16, seed=1), CalibrationSpec(samples=2, length=16, seed=2)
    messages = []
    passes = resolve_passes((PassSpec("quantize", Options(spec)), PassSpec("cleanup", Options()),
                             PassSpec("quantize_kv_cache", Options(spec)), PassSpec("quantize", Options(other))),
                            tokenizer_json, messages.append)
    first, plain, second, third = (p.options.calibration for p in passes)
    assert isinstance(first, CalibrationSet) and first is second and third is not first and plain is None
    assert first.token_ids.shape == (2, 16) and not np.array_equal(first.token_ids, third.token_ids)
    assert first.source["characters"] == len(split_text("pydoc")[0]) and first.progress == messages.append
    assert resolve_passes(passes, tokenizer_json)[0].options.calibration is first  # a resolved set stays as it is


def test_held_out_tokens_name_the_last_tenth_of_the_text(tiny_artifact):
    held_out = held_out_tokens("pydoc", (tiny_artifact / "tokenizer.json").read_text(), 50)
    assert held_out.source == f"{BUILTIN_SOURCE}, last 10% (held out)" and len(held_out.tokens) == 50
    assert repeated_text_warning(held_out) is None


@pytest.mark.parametrize("window, stride, max_context, expected", [
    (64, 32, 128, (64, 32)), (128, 256, 128, (128, 256)),  # within the context: as the recipe says
    (512, 256, 128, (128, 64)), (512, 16, 128, (128, 16)), (512, 256, 1, (1, 1)),  # cut: half kept as context
    # no stride given: half the window, as `aotlm eval`'s default (a fixed 256 made 9 windows of 2048 where eval has 3)
    (2048, None, 2048, (2048, 1024)), (512, None, 2048, (512, 256)), (512, None, 128, (128, 64)), (1, None, 1, (1, 1)),
])
def test_the_report_window_is_cut_to_the_context_keeping_half_as_context(window, stride, max_context, expected):
    assert report_window_and_stride(window, stride, max_context) == expected


def _layer(node, error):
    return {"node": node, "method": "awq", "bits": 4, "block_size": 32, "relative_output_error": error, "extra": 1}


def test_quantization_summary_takes_the_decode_graphs_reports_and_its_five_worst_layers():
    totals = {"quantized": 6, "skipped": 1, "weight_bytes_before": 3 * 2**20, "weight_bytes_after": 2**20,
              "graph_bytes_before": 4 * 2**20, "graph_bytes_after": 2 * 2**20,
              "mean_relative_output_error": 0.01, "max_relative_output_error": 0.05}
    decode = {"totals": totals, "embedding": {"quantized": True},
              "layers": [_layer(f"n{i}", e) for i, e in enumerate([0.01, None, 0.05, 0.02, 0.03, 0.04, 0.005])]}
    decode["layers"][6]["note"] = "K=80 padded to 3 blocks of 32 (the last holds 16 values)"  # the least error:
    # padded layers are named whether or not they are among the worst
    decode["layers"][4]["bits"] = 8  # an override: per channel, its block the whole input
    kv = {"dtype": "int8", "granularity": "head", "quantized_layers": 2, "relative_error": {"key_mean": 0.001,
                                                                                             "value_mean": 0.002}}
    reports = [{"name": "quantize", "phase": "decode", "report": {**decode, "totals": {}}},  # an earlier run
               {"name": "quantize", "phase": "decode", "report": decode},
               {"name": "quantize", "phase": "prefill", "report": {**decode, "totals": {"quantized": 0}}},
               {"name": "quantize_kv_cache", "phase": "decode", "report": {**kv, "other": 0}}]
    summary = quantization_summary(reports)
    assert summary["totals"] == totals and summary["embedding"] == {"quantized": True}
    assert [layer["node"] for layer in summary["worst_layers"]] == ["n2", "n5", "n4", "n3", "n0"]
    assert summary["worst_layers"][0] == {k: v for k, v in _layer("n2", 0.05).items() if k != "extra"}
    assert summary["padded_layers"] == [{"node": "n6", "note": "K=80 padded to 3 blocks of 32 (the last holds 16 "
                                                             "values)"}]
    assert summary["kv_cache"] == kv
    assert quantization_summary([]) == {}
    held_out = {"text": "notes.txt, last 10% (held out)", "tokens_scored": 300, "window": 64, "stride": 32,
                "reference_perplexity": 10.0, "perplexity": 10.5, "perplexity_increase": 0.05, "top1_agreement": 0.9,
                "mean_kl": 0.0123, "repeats_calibration_from": 250}
    assert format_accuracy({"quantization": summary, "held_out": held_out}).splitlines() == [
        "quantized 6 MatMuls (1 skipped): weights 3.0 MiB -> 1.0 MiB; graph 4.0 MiB -> 2.0 MiB",
        "layer output error of the weights on calibration data (E||xΔW||²/E||xW||², the weights' rounding alone): "
        "mean 1.00e-02, max 5.00e-02",
        "worst layers: n2 5.00e-02 (awq int4 block 32), n5 4.00e-02 (awq int4 block 32), n4 3.00e-02 (awq int8)",
        "note: in 1 quantized layer the block size does not divide the input size: the last block is padded with "
        "zeros (e.g. n6: K=80 padded to 3 blocks of 32 (the last holds 16 values); all in the manifest)",
        "KV cache stored as int8 (head scales, 2 layers): relative round-off on calibration data, keys 1.00e-03, "
        "values 2.00e-03",
        "held-out text: notes.txt, last 10% (held out), 300 tokens scored (window 64, stride 32)",
        "perplexity: float 10.000 -> quantized 10.500 (+5.00%); top-1 agreement 90.00%; mean KL(float || quantized) "
        "0.0123 nats",
        "warning: the held-out text repeats the calibration text from its token 250 on"]
    whole = format_accuracy({"quantization": summary, "held_out": {**held_out, "max_context": 64}})
    assert "note: positions" not in whole  # the window spans the context
    short = format_accuracy({"quantization": summary, "held_out": {**held_out, "max_context": 2048}})
    assert ("note: positions 64 to 2047 of the context are not scored here: set accuracy.window: 2048 in the recipe "
            "to score them") in short
    # a broken build's perplexity past 1e308: null in the manifest (JSON has no infinity), read as inf
    broken = {**held_out, "perplexity": None, "perplexity_increase": None}
    assert "perplexity: float 10.000 -> quantized inf (inf); top-1" in format_accuracy({"held_out": broken})
    # a handful of held-out tokens (accuracy.max_tokens: 2 scored 1) gave figures with no word of their size
    few = format_accuracy({"held_out": {**held_out, "tokens_scored": 11}})
    assert ("warning: only 11 held-out tokens scored: the perplexity, top-1 and KL below are noise at that size"
            in few) and "noise" not in format_accuracy({"held_out": held_out})
    # round to nearest without calibration: no per-layer errors, and the console had said nothing of them
    unmeasured = {**summary, "totals": {**totals, "mean_relative_output_error": None,
                                        "max_relative_output_error": None}, "worst_layers": []}
    assert ("layer output error: not measured (round to nearest without calibration data; add quantize.calibration "
            "to the recipe to measure it)") in format_accuracy({"quantization": unmeasured}).splitlines()


def test_a_build_without_calibration_has_no_layer_errors_to_rank():
    """Round to nearest without calibration data records no output error per layer (None): no "worst layers" line,
    nothing to format (a None there would fail every RTN build's report), and a line that says it was not measured."""
    totals = {"quantized": 2, "skipped": 0, "weight_bytes_before": 2**20, "weight_bytes_after": 2**18,
              "graph_bytes_before": 2**21, "graph_bytes_after": 2**20, "mean_relative_output_error": None,
              "max_relative_output_error": None}
    layers = [{**_layer(f"n{i}", None), "method": "rtn"} for i in range(2)]
    summary = quantization_summary([{"name": "quantize", "phase": "decode",
                                     "report": {"totals": totals, "embedding": {}, "layers": layers}}])
    lines = format_accuracy({"quantization": summary}).splitlines()
    assert lines == ["quantized 2 MatMuls (0 skipped): weights 1.0 MiB -> 0.2 MiB; graph 2.0 MiB -> 1.0 MiB",
                     "layer output error: not measured (round to nearest without calibration data; add "
                     "quantize.calibration to the recipe to measure it)"]


def test_first_repeated_run_at_the_edges_of_both_texts():
    seen = "".join(f"<{i:03d}>" for i in range(200)) + "x"  # 1001 characters: the last indexed piece ends the text
    assert first_repeated_run(seen[300:460], seen, length=160) == 0  # a run that starts the text
    assert first_repeated_run("|" + seen[-121:], seen, length=160) == 1  # the shortest run found, at seen's end
    assert first_repeated_run("|" + seen[320:440] + "|", seen, length=160) is None  # 120 characters: too short


def test_too_short_a_text_says_its_count_is_of_the_calibration_part(tiny_artifact, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("word " * 40)  # 200 characters (and tokens, byte-level): 180 in the calibration part
    with pytest.raises(BuildError, match=r"has 180 tokens.*\(the calibration part: .*notes.txt, first 90%, 180 "
                                         r"characters; the rest is held out"):
        resolve(CalibrationSpec(text=str(notes), samples=4, length=64), (tiny_artifact / "tokenizer.json").read_text())


def test_a_repeat_from_the_first_token_does_not_advise_max_tokens_0():
    warning = repeated_text_warning(HeldOut(np.arange(10), "notes.txt, last 10% (held out)", 0))
    assert "max_tokens to 0" not in warning  # accuracy.max_tokens must be >= 2: the advice cannot be followed
    assert "accuracy.enabled: false" in warning


def test_a_later_repeat_still_advises_where_to_cut():
    assert "set accuracy.max_tokens to 7 or less" in repeated_text_warning(HeldOut(np.arange(10), "x", 7))


# -- the held-out token a repeat starts at, and the warning's threshold ----------------
def test_a_repeat_from_the_second_token_does_not_advise_max_tokens_1():
    """Token 0 is never scored (nothing predicts it): a repeat from token 1 leaves no unseen text at any max_tokens."""
    warning = repeated_text_warning(HeldOut(np.arange(10), "notes.txt, last 10% (held out)", 1))
    assert "max_tokens to 1" not in warning and "accuracy.enabled: false" in warning
    assert "max_tokens to 2 or less" in repeated_text_warning(HeldOut(np.arange(10), "x", 2))


def test_the_repeat_starts_at_the_first_token_inside_the_repeated_run(tiny_artifact, tmp_path):
    """A token that ends where the repeated run starts holds none of it: the warning's token is the next one."""
    paragraphs = [" ".join(f"word{i}x{j}" for j in range(40)) for i in range(60)]
    text = tmp_path / "notes.txt"
    text.write_text("\n\n".join(paragraphs + ["ZQJ", paragraphs[3]]))  # "ZQJ" ends where the copied run starts
    held_out = split_text(str(text))[1]
    assert "ZQJ" in held_out
    tokenizer_json = (tiny_artifact / "tokenizer.json").read_text()
    before_run = TextTokenizer(tiny_artifact / "tokenizer.json").encode(
        held_out[:held_out.index("ZQJ") + 3], add_special_tokens=False)
    assert held_out_tokens(str(text), tokenizer_json, 10**6).repeats_calibration_from == len(before_run)


def test_a_calibration_file_is_read_as_aotlm_eval_reads_it(tmp_path):
    """No byte-order mark (it would be a junk token at the calibration text's start), CRLF kept as eval scores it,
    and the held-out part starting at a CRLF paragraph break, as at an LF one."""
    from runtime.text_files import read_text_file

    paragraphs = [f"Paragraph {index} says something about lighthouses." for index in range(40)]
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n\r\n".join(paragraphs).encode())
    calibration, held_out, _ = split_text(str(path))
    assert not calibration.startswith("\ufeff") and calibration.startswith("Paragraph 0 ")
    assert (calibration, held_out) == split_held_out(read_text_file(path))
    assert held_out.startswith("\r\n\r\nParagraph 36 ") and "\r\n" in calibration
    assert split_held_out("\n\n".join(paragraphs))[1].startswith("\n\nParagraph 37 ")  # an LF file: shorter


def test_a_sample_is_fed_at_positions_from_0_as_the_artifacts_prefill_numbers_it():
    """Shifted by one, every statistic after the first attention (RoPE) came from activations the artifact never
    computes, and no test noticed (a mutation audit)."""
    import types

    import numpy as np

    from passes.calibration import _feeds

    def value(name: str):
        return types.SimpleNamespace(name=name, type="tensor(int64)", shape=["batch", "sequence"])

    session = types.SimpleNamespace(get_inputs=lambda: [value("input_ids"), value("position_ids"),
                                                        value("attention_mask")])
    feeds = _feeds(session, np.arange(100, 106))
    assert feeds["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert feeds["input_ids"].tolist() == [[100, 101, 102, 103, 104, 105]]


def test_the_calibration_record_tells_apart_texts_of_one_path(tiny_artifact, tmp_path):
    """The record named the path alone: an edited file (or pydoc of another Python release) gave other weights from
    the same recipe, and the two manifests said the same."""
    notes = tmp_path / "notes.txt"
    tokenizer_json = (tiny_artifact / "tokenizer.json").read_text()
    spec = CalibrationSpec(text=str(notes), samples=4, length=16, seed=0)
    notes.write_text("\n\n".join(f"paragraph {i}: " + "some words here " * 8 for i in range(20)))
    first = resolve(spec, tokenizer_json).describe()
    assert resolve(spec, tokenizer_json).describe() == first  # the same text: the same record
    notes.write_text(notes.read_text().swapcase())  # the calibration part changed, the held-out part too
    second = resolve(spec, tokenizer_json).describe()
    assert first["text"] == second["text"] and first["characters"] == second["characters"]
    assert first["text_sha256"] != second["text_sha256"] and first["samples_sha256"] != second["samples_sha256"]
    other_draw = resolve(dataclasses.replace(spec, seed=1), tokenizer_json).describe()
    assert other_draw["text_sha256"] == second["text_sha256"]
    assert other_draw["samples_sha256"] != second["samples_sha256"]


@pytest.mark.parametrize("content, refusal", [
    (" \n\t " * 50_000, "holds only whitespace"),
    ("\x00" * 200_000, "looks binary (200,000 of its 200,000 characters are control characters"),
    ("text " * 1000 + "\x07" * 100, "looks binary"),
])
def test_a_calibration_file_without_text_is_refused(tmp_path, content, refusal):
    """NUL bytes are UTF-8 and whitespace is text to the decoder: a build calibrated on them (one token repeated in
    every sample) and succeeded."""
    path = tmp_path / "calibration.txt"
    path.write_text(content)
    with pytest.raises(BuildError, match=rf"calibration.text: {path} {re.escape(refusal)}"):
        split_text(str(path))
    path.write_text("text " * 1000 + "\x07" * 10)  # a few control characters in real text: read
    assert split_text(str(path))[0]


def test_a_long_calibration_text_is_tokenized_in_pieces_to_the_same_ids(tiny_artifact, monkeypatch):
    """The whole text's Encoding holds ~600 bytes a token (a 20 MB file took 2.9 GB for ids of 8 bytes each): the
    text is tokenized a paragraph-cut piece at a time, and the ids are those of the whole text."""
    import compiler.calibration as calibration_module
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_artifact / "tokenizer.json"))
    text = split_text("pydoc")[0][:200_000]
    pieces = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda part, **kwargs: (pieces.append(len(part)), encode(part, **kwargs))[1],
                        raising=False)
    for corpus in (text, text.replace("\n\n", "\n"), text.replace("\n", " ")):  # paragraphs; a document a line; one
        pieces.clear()
        ids = calibration_module.encode_in_pieces(tokenizer, corpus, piece=20_000)
        assert len(pieces) >= 5 and max(pieces) <= 40_000  # pieces, not the whole text (one, without blank lines)
        np.testing.assert_array_equal(ids, encode(corpus, add_special_tokens=False).ids)


@pytest.mark.parametrize("line_end", ["\r\n", "\r\n\r\n", "\n\n\n", "\r\n\r\n\r\n"])
def test_a_crlf_text_is_cut_into_pieces_between_its_line_ends_not_inside_one(line_end):
    """Cut between a \r and its \n, a CRLF file's pieces were other tokens than the whole text's (SmolLM2's: '.',
    'čĊč', 'Ċ' against '.', 'č', 'Ċ', 'č'). A tokenizer whose pre-tokens are whitespace runs, with CRLF merges."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    import compiler.calibration as calibration_module

    vocab = {character: index for index, character in enumerate(sorted(ByteLevel.alphabet()))}
    vocab.update({"čĊ": len(vocab), "čĊčĊ": len(vocab) + 1, "ĊĊ": len(vocab) + 2})  # ByteLevel: \r č, \n Ċ
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("č", "Ċ"), ("čĊ", "čĊ"), ("Ċ", "Ċ")]))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s+"), "isolated"),
                                                       ByteLevel(add_prefix_space=False, use_regex=False)])
    text = ("word " * 10 + line_end) * 3000
    ids = calibration_module.encode_in_pieces(tokenizer, text, piece=2000)
    assert ids.tolist() == tokenizer.encode(text, add_special_tokens=False).ids


def test_the_held_out_text_comes_from_the_first_calibrating_pass_and_is_checked_against_every_one(tiny_artifact,
                                                                                                  tmp_path):
    """With an RTN quantize first (no calibration set), the report took the built-in text and never looked at the
    file a later quantize_kv_cache calibrated on, whose calibration part held what the report scored."""
    tokenizer_json = (tiny_artifact / "tokenizer.json").read_text()
    held_out = split_text("pydoc")[1]
    corpus = tmp_path / "corpus.txt"  # the built-in text's held-out part, in the first 90% of a user's corpus
    corpus.write_text(held_out + "\n\n" + "other words here. " * 2000)
    checked = held_out_tokens("pydoc", tokenizer_json, 512, other_texts=(str(corpus),))
    assert checked.repeats_calibration_from == 0
    assert held_out_tokens("pydoc", tokenizer_json, 512).repeats_calibration_from is None  # alone: not seen


def test_a_file_that_reports_no_size_but_holds_text_is_read():
    """/proc's files report 0 bytes: /proc/self/status was refused as "an empty file"."""
    from compiler.calibration import check_text_file

    assert check_text_file("/proc/self/status").name == "status"


def test_an_empty_calibration_file_is_refused(tmp_path):
    from compiler.calibration import check_text_file

    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(BuildError, match=r"empty.txt: an empty file; give a UTF-8 text file"):
        check_text_file(str(tmp_path / "empty.txt"))


def test_a_long_run_of_whitespace_is_cut_after_not_walked_through():
    """Stepping a cut back out of a run of whitespace walked through the whole window when the run covered it: one
    character a piece, a 3 MiB run of spaces never ended."""
    import time

    from tokenizers import Tokenizer, models, pre_tokenizers

    import compiler.calibration as calibration_module

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "word": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    text = "word " * 50 + " " * 200_000 + "word " * 50
    started = time.monotonic()
    ids = calibration_module.encode_in_pieces(tokenizer, text, piece=1000)
    assert time.monotonic() - started < 5 and ids.tolist() == tokenizer.encode(text, add_special_tokens=False).ids
