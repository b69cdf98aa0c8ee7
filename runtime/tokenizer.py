"""Text <-> token ids with the artifact's tokenizer.json (Hugging Face `tokenizers`), and streaming detokenization."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

from runtime.errors import ArtifactError


def whole_text(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` set to encode a text whole. Some tokenizer.json files ship with truncation or padding set: a long
    prompt would be cut without a word (the model answering another prompt, no context error), a short one padded;
    so would the build's calibration and held-out texts."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


class TextTokenizer:
    def __init__(self, path: str | Path, bos_token_id: int | None = None):
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception on a bad file
            raise ArtifactError(f"{path}: cannot read the tokenizer ({error}); rebuild the artifact") from None
        self.tokenizer = whole_text(self.tokenizer)
        self.bos_token_id = bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The tokenizer.json's post-processor adds BOS when the model wants one; add nothing by hand. A chat
        # template writes its special tokens itself: add_special_tokens=False there.
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def stream_decoder(self, stop_strings: tuple[str, ...] = (), prompt_ids: Sequence[int] = ()) -> "StreamDecoder":
        """A decoder for the tokens generated after prompt_ids, whose last tokens it reads as context."""
        return StreamDecoder(self, stop_strings, context=prompt_ids[-CONTEXT_TOKENS:] if prompt_ids else ())


# Prompt tokens a stream decoder reads before the generated ones (vLLM reads 5): a SentencePiece tokenizer (Llama 2,
# Mistral) decodes a text's first "▁word" without its space, so the first generated word would lose the space that
# separates it from the prompt ("is" + "Paris"); decoded after the prompt's last tokens, it keeps it (" Paris").
CONTEXT_TOKENS = 5


class StreamDecoder:
    """Turns tokens arriving one by one into text pieces, holding back incomplete UTF-8 sequences, and with stop
    strings, everything from the first stop string on.

    Decodes the window since the last emitted boundary, so each step costs O(window), not O(text). A streamed text
    ends before a stop string, as the result's text does (vLLM's and OpenAI's rule): a tail that could be the
    start of a stop string is held back until the next tokens tell, and `finish()` returns it when generation
    ends some other way. `stopped` turns true when a stop string has appeared.
    """

    def __init__(self, tokenizer: TextTokenizer, stop_strings: tuple[str, ...] = (), context: Sequence[int] = ()):
        """context: token ids before the first pushed one (the prompt's last ones), read but never returned."""
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(context)
        self.prefix_offset = 0  # start of the window re-decoded for context (spaces depend on it)
        self.read_offset = len(self.tokens)  # tokens before this were already decoded into `text`
        self.stop_strings = tuple(stop for stop in stop_strings if stop)
        self.text = ""  # all decoded text, kept only to look for stop strings
        self.emitted = 0  # text[:emitted] was returned; no stop string starts before it
        self.stopped = False
        self.pieces: list[str] = []  # everything returned: the result's text is their join

    @property
    def streamed_text(self) -> str:
        """The text returned so far (after `finish()`, the whole text). A result's text is this, so that it equals
        the stream even where decoding all tokens at once differs: a byte-fallback tokenizer turns a whole run of
        byte tokens into U+FFFD when the run ends inside a character, complete characters before it included."""
        return "".join(self.pieces)

    def push(self, token_id: int) -> str:
        """The text this token makes safe to show ("" while it is held back, and after a stop string)."""
        self.tokens.append(token_id)
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        piece = ""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            piece = full[len(prefix) :]
        if self.stop_strings:  # held back while it may begin a stop string
            self.text += piece
            piece = self._release()
        if piece:
            self.pieces.append(piece)
        return piece

    def finish(self) -> str:
        """The rest of the text once generation has ended without a stop string ("" after one): the tail held back in
        case it began a stop string, and tokens that end inside a UTF-8 sequence (decoded as U+FFFD)."""
        if self.stopped:
            return ""
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        pending = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.tokens)
        piece = pending
        if self.stop_strings:
            self.text += pending
            piece = self._release()
            if not self.stopped:  # nothing more can complete a stop string
                piece, self.emitted = piece + self.text[self.emitted :], len(self.text)
        if piece:
            self.pieces.append(piece)
        return piece

    def _release(self) -> str:
        if self.stopped:
            return ""
        starts = [i for i in (self.text.find(stop, self.emitted) for stop in self.stop_strings) if i >= 0]
        if starts:
            self.stopped = True
            end = min(starts)
        else:
            end = len(self.text) - self._could_start_a_stop()
        piece, self.emitted = self.text[self.emitted : end], end
        return piece

    def _could_start_a_stop(self) -> int:
        """Length of the longest unemitted tail of the text that some stop string begins with."""
        unemitted = len(self.text) - self.emitted
        longest = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, unemitted), longest, -1):
                if self.text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
