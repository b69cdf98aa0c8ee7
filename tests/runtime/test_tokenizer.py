"""runtime/tokenizer.StreamDecoder with stop strings: the streamed text ends before the first stop string, as the
result's text does; a tail that may begin one is held back, and released when it turns out not to."""
from __future__ import annotations

import pytest

from runtime.tokenizer import StreamDecoder


class PieceTokenizer:
    """Token i decodes to pieces[i]: enough for StreamDecoder, which only calls decode()."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in token_ids)


def stream(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], bool, str]:
    """Push every piece until a stop; returns what each push gave, whether it stopped, and finish()'s tail."""
    decoder = StreamDecoder(PieceTokenizer(pieces), stops)
    given = []
    for token in range(len(pieces)):
        given.append(decoder.push(token))
        if decoder.stopped:
            break
    return given, decoder.stopped, decoder.finish()


@pytest.mark.parametrize("pieces, stops, given, stopped, tail", [
    (["x", "a", "b", "y"], ("ab",), ["x", "", ""], True, ""),  # "a" held back, then the stop: never shown
    (["x", "a", "c"], ("ab",), ["x", "", "ac"], False, ""),  # "a" released once "ac" cannot begin "ab"
    (["x", "a"], ("ab",), ["x", ""], False, "a"),  # generation ends some other way: finish() gives the tail
    (["hel", "lo\n", "\nbye"], ("\n\n",), ["hel", "lo", ""], True, ""),  # a stop across two pieces
    (["a", "b", "d"], ("abc", "bd"), ["", "", "a"], True, ""),  # the earliest of several stops wins
    (["say ", "STOP now"], ("STOP",), ["say ", ""], True, ""),  # the stop inside one piece
    (["one", "two"], (), ["one", "two"], False, ""),  # no stop strings: nothing held back
    (["a", "b"], ("",), ["a", "b"], False, ""),  # an empty stop string matches nothing
])
def test_streamed_text_ends_before_the_first_stop(pieces, stops, given, stopped, tail):
    assert stream(pieces, stops) == (given, stopped, tail)
    text = "".join(pieces)
    for stop in (s for s in stops if s):  # the result's rule (runtime/engine.py): cut at each stop string in turn
        text = text.split(stop, 1)[0]
    assert "".join(given) + tail == text
