"""Turns a recipe's calibration specs into tokens for the passes that calibrate, and names the held-out text.

The text is split once, by `runtime.evaluate.split_held_out` (the same split `aotlm eval --text
builtin:pydoc-held-out` uses): the first 90% calibrates, the rest is held out for the accuracy report, so the
report never scores text the quantizer saw. The compiler imports that one function from the runtime so that
the build's perplexity and `aotlm eval`'s are computed on the same text.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from compiler.artifact import scratch_folder
from compiler.errors import BuildError
from passes.calibration import CalibrationSet, CalibrationSpec, draw_samples
from passes.errors import PassError
from runtime.evaluate import BUILTIN_SOURCE, CALIBRATION_FRACTION, split_held_out, split_pydoc_text, tokens_fingerprint
from runtime.text_files import TextFileError, read_text_file, text_problem
from runtime.tokenizer import whole_text

BUILTIN = "pydoc"
ENCODE_PIECE_CHARACTERS = 1 << 20  # the calibration text is tokenized in pieces of about this many characters


def split_text(spec_text: str) -> tuple[str, str, dict]:
    """(calibration part, held-out part, where it came from) of the recipe's `calibration.text`."""
    if spec_text == BUILTIN:
        calibration, held_out = split_pydoc_text()
        return calibration, held_out, {"source": f"{BUILTIN_SOURCE}, {_first_part()}"}
    path = check_text_file(spec_text)
    try:
        text = read_text_file(path, f"calibration.text: {spec_text}")  # as `aotlm eval --text` reads it: no
    except TextFileError as error:  # byte-order mark, CRLF kept
        raise BuildError(str(error)) from None
    except OSError as error:
        raise BuildError(f"calibration.text: cannot read {path}: {error}") from None
    check_has_text(text, spec_text)
    calibration, held_out = split_held_out(text)
    return calibration, held_out, {"source": f"{path.resolve()}, {_first_part()}"}


def check_has_text(text: str, spec_text: str) -> None:
    """A file of whitespace, or of NUL or other control characters (UTF-8 as far as the decoder goes), holds no text
    to calibrate on: every sample was one token repeated, and the build went on."""
    if not text.strip():
        raise BuildError(f"calibration.text: {spec_text} holds only whitespace; give a UTF-8 text file with the text "
                         f"to calibrate on, or 'pydoc' for the built-in text (Python's documentation)")
    problem = text_problem(text)
    if problem:
        raise BuildError(f"calibration.text: {spec_text} {problem}")


def _first_part() -> str:
    return f"first {CALIBRATION_FRACTION:.0%}"


def held_out_label(source: str) -> str:
    """split_text's source, named as the held-out part of that text."""
    return source.replace(_first_part(), f"last {1 - CALIBRATION_FRACTION:.0%} (held out)")


def check_text_file(spec_text: str) -> Path:
    """A recipe's calibration.text that is a path: an existing file (checked before the export, and by `aotlm plan`,
    which must not size a recipe the build refuses); BuildError saying what is there instead."""
    path = Path(spec_text).expanduser()
    if not path.is_file():
        found = ("a folder" if path.is_dir() else "not a regular file (a FIFO or a device)" if path.exists()
                 else "no such file")
        raise BuildError(f"calibration.text: {spec_text}: {found}; give a UTF-8 text file, or 'pydoc' for the "
                         f"built-in text (Python's documentation)")
    if path.stat().st_size == 0 and not _first_byte(path):  # /proc's files say 0 bytes and hold text
        raise BuildError(f"calibration.text: {spec_text}: an empty file; give a UTF-8 text file with the text to "
                         f"calibrate on, or 'pydoc' for the built-in text (Python's documentation)")
    return path


def _first_byte(path: Path) -> bytes:
    try:
        with open(path, "rb") as stream:
            return stream.read(1)
    except OSError:
        return b""


def resolve(spec: CalibrationSpec, tokenizer_json: str, progress=None) -> CalibrationSet:
    """The spec's text tokenized (no special tokens) and cut into its samples."""
    calibration, _, source = split_text(spec.text)
    tokenizer = whole_text(Tokenizer.from_str(tokenizer_json))
    token_ids = encode_in_pieces(tokenizer, calibration)
    try:
        samples = draw_samples(token_ids, spec.samples, spec.length, spec.seed)
    except PassError as error:  # the count is of the calibration part only: say so, and which text it is
        raise BuildError(f"calibration: {error} (the calibration part: {source['source']}, {len(calibration)} "
                         f"characters; the rest is held out for the accuracy report)") from None
    # The path (or "pydoc") does not say which text it held when built: a file edited later, or pydoc_data of
    # another Python release, gives other weights from the same recipe. The hashes tell two such builds apart.
    source = {**source, "characters": len(calibration), "tokens_available": int(len(token_ids)),
              "text_sha256": hashlib.sha256(calibration.encode()).hexdigest()[:16],
              "samples_sha256": tokens_fingerprint(samples)}
    return CalibrationSet(**dataclasses.asdict(spec), token_ids=samples, source=source, progress=progress,
                          scratch=functools.partial(scratch_folder, "calibration"))


def encode_in_pieces(tokenizer: Tokenizer, text: str, piece: int = ENCODE_PIECE_CHARACTERS) -> np.ndarray:
    """Token ids of `text` (no special tokens), tokenized a piece of `piece` to 2 x `piece` characters at a time, cut
    before a paragraph break (else a line break, else a space): a whole text's Encoding holds strings and offsets for
    every token (~600 bytes each), so a 20 MB file took 2.9 GB to give 8 bytes a token. A text under 2 x `piece`
    characters (the built-in one) is one piece."""
    parts, start = [], 0
    while start < len(text):
        end = len(text)
        if end > start + 2 * piece:  # cut before a paragraph break, else a line break, else a space (a corpus of
            window = (start + piece, start + 2 * piece)  # one document a line has no blank lines), else anywhere
            end = next((cut for cut in (text.find(mark, *window) for mark in ("\r\n\r\n", "\n\n", "\n", " "))
                        if cut > 0),
                       window[1])
            end = _outside_whitespace(text, end, window)
        parts.append(np.asarray(tokenizer.encode(text[start:end], add_special_tokens=False).ids, np.int64))
        start = end
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _outside_whitespace(text: str, cut: int, window: tuple[int, int]) -> int:
    """A cut moved to the start of the run of whitespace it falls in, or where that run begins before the window, to
    its end: a cut between a \r and its \n, or inside \n\n\n, gave other tokens than the whole text's, and walking
    back through a run of 3 MiB of spaces, one character a piece, did not end."""
    start = cut
    while start > window[0] and text[start - 1].isspace():
        start -= 1
    if start > window[0] or not text[start - 1].isspace():
        return start
    while cut < len(text) and text[cut].isspace():
        cut += 1
    return cut


def resolve_passes(passes: tuple, tokenizer_json: str, progress=None) -> tuple:
    """The recipe's passes with each calibration spec (quantize, quantize_kv_cache) replaced by its tokens: one set
    per distinct spec, shared by both phases, whose memo then makes both graphs' quantized weights (and KV-cache
    scales) identical."""
    resolved: dict[CalibrationSpec, CalibrationSet] = {}
    out = []
    for index, spec in enumerate(passes):
        calibration = getattr(spec.options, "calibration", None)
        if calibration is not None and not isinstance(calibration, CalibrationSet):
            if calibration not in resolved:
                try:
                    resolved[calibration] = resolve(calibration, tokenizer_json, progress)
                except BuildError as error:  # which pass's calibration, as the recipe's other errors say
                    raise BuildError(f"passes[{index}].{spec.name}.{error}") from None
            spec = dataclasses.replace(spec, options=dataclasses.replace(spec.options, calibration=resolved[calibration]))
        out.append(spec)
    return tuple(out)
