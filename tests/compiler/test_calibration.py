"""compiler/calibration.py and the build's held-out text (compiler/accuracy.py): the texts are tokenized whole, as
the runtime encodes them, and the report's source names the built-in text only when it is that text."""
from __future__ import annotations

import json
from argparse import Namespace

from compiler import cli_evaluate
from compiler.accuracy import first_repeated_run, held_out_tokens, repeated_text_warning
from compiler.calibration import resolve, split_text
from passes.calibration import CalibrationSpec
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
