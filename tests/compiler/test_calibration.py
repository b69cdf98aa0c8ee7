"""compiler/calibration.py and the build's held-out text (compiler/accuracy.py): the texts are tokenized whole, as
the runtime encodes them, and the report's source names the built-in text only when it is that text."""
from __future__ import annotations

import json
from argparse import Namespace

from compiler import cli_evaluate
from compiler.accuracy import held_out_tokens
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
        ids, _ = held_out_tokens("pydoc", tokenizer_json, 400)
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
