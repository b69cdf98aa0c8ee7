"""Text <-> token ids with the artifact's tokenizer.json (Hugging Face `tokenizers`), and streaming detokenization."""
from __future__ import annotations

import functools
import json
import operator
import re
from pathlib import Path
from typing import Sequence

import tokenizers
from tokenizers import Tokenizer

from runtime.errors import ArtifactError, RequestError
from runtime.manifest import utf8_path
from runtime.versions import pip_install, release


def whole_text(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` set to encode a text whole. Some tokenizer.json files ship with truncation or padding set: a long
    prompt would be cut without a word (the model answering another prompt, no context error), a short one padded;
    so would the build's calibration and held-out texts."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


BYTE_OF_SYMBOL = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback: one byte a token


def check_unicode(text: str, what: str = "the text") -> None:
    """Refuse a lone surrogate (bytes read with surrogateescape from a pipe or argv, that were not UTF-8), naming where
    it is in `what`: the tokenizer would fail on it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        # a lone surrogate: bytes read with surrogateescape (argv, a pipe), or half a pair escaped in JSON ("\ud800")
        origin = ("bytes that were not UTF-8" if 0xDC80 <= ord(text[error.start]) <= 0xDCFF else
                  "half of a surrogate pair, as a JSON \\ud800 escape writes one")
        raise RequestError(f"{what} is not valid Unicode at character {error.start} ({text[error.start]!r}, a lone "
                           f"surrogate: {origin}); give UTF-8 text") from None


def _is_panic(error: BaseException) -> bool:
    """tokenizers' Rust panics (a tokenizer.json whose normalizer regex gives up on some text, say) reach Python as
    pyo3's PanicException, a BaseException: past a server's `except Exception`, they cut the connection without an
    answer. They are the artifact's tokenizer failing: an ArtifactError (_panic_error), which the answer says."""
    return type(error).__name__ == "PanicException"


def _panic_error(error: BaseException, what: str) -> ArtifactError:
    return ArtifactError(f"the artifact's tokenizer failed to {what} this text ({str(error)[:200]}); its "
                         f"tokenizer.json cannot handle it")


def _older(installed: str, other: str) -> bool:
    """Whether release `installed` comes before `other` ("0.19.1" < "0.22.0")."""
    return release(installed) < release(other)


class TextTokenizer:
    """The artifact's tokenizer (a Hugging Face tokenizers file): encode(text) -> ids (special tokens as the
    tokenizer's post-processor adds them); decode(ids) -> text (special tokens left out, ids outside the vocabulary
    refused); token_bytes(id); stream_decoder, for text as tokens arrive. `tokenizer`: the tokenizers.Tokenizer."""

    def __init__(self, path: str | Path, bos_token_id: int | None = None, vocab_size: int | None = None,
                 built_with: str | None = None):
        """vocab_size: the model's (Engine.load passes its manifest's), which decode checks ids against; the
        tokenizer's own size when not given. built_with: the tokenizers release that wrote the file (the manifest's
        tools), named when the installed one is older and cannot read it."""
        file = utf8_path(path)  # a C locale's surrogates: the file's UTF-8 name; refused (not "rebuild") where none
        try:
            self.tokenizer = Tokenizer.from_file(file)
        except Exception as error:  # tokenizers raises a bare Exception on a bad file
            installed = tokenizers.__version__
            fix = (f"tokenizers {installed} is installed and {built_with} wrote it: "
                   + pip_install(f"-U 'tokenizers>={built_with}'") if isinstance(built_with, str) and _older(installed, built_with)
                   else "rebuild the artifact")
            raise ArtifactError(f"{path}: cannot read the tokenizer ({str(error)[:300]}); {fix}") from None
        self.tokenizer = whole_text(self.tokenizer)
        self.bos_token_id = bos_token_id
        self.vocab_size = vocab_size if vocab_size is not None else self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The tokenizer.json's post-processor adds BOS when the model wants one; add nothing by hand. A chat
        # template writes its special tokens itself: add_special_tokens=False there (but for a GGUF artifact's BOS,
        # which Engine.chat_prompt_ids adds as llama.cpp does).
        if not isinstance(text, str):  # tokenizers' own: "TextInputSequence must be str"
            hint = "; decode it to str first (e.g. text.decode())" if isinstance(text, (bytes, bytearray)) else ""
            raise RequestError(f"encode: text must be a str, got {type(text).__name__}{hint}")
        if not isinstance(add_special_tokens, bool):
            raise RequestError(f"encode: add_special_tokens must be True or False, got {add_special_tokens!r}")
        check_unicode(text)
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except BaseException as error:
            if _is_panic(error):
                raise _panic_error(error, "encode") from None
            raise

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (special tokens left out); RequestError for anything but a list of ids in the
        vocabulary (tokenizers dropped an id past it without a word, and raised OverflowError for a negative one)."""
        return self.decode_unchecked(self._checked_ids(token_ids))

    def decode_unchecked(self, token_ids: list[int]) -> str:
        """decode without the check, for ids known to be valid: the decode loop's (StreamDecoder), which the model
        sampled or a prompt check passed."""
        try:  # no cost unless it raises: the decode loop calls it twice a token
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)
        except BaseException as error:
            if _is_panic(error):
                raise _panic_error(error, "decode") from None
            raise

    def _checked_ids(self, token_ids) -> list[int]:
        if isinstance(token_ids, (str, bytes, bytearray)) or not hasattr(token_ids, "__iter__"):
            raise RequestError(f"decode: token_ids must be a list of token ids (integers), got "
                               f"{type(token_ids).__name__}")
        if getattr(token_ids, "ndim", 1) != 1:  # a tokenizer's input_ids [1, n]: iterating gives arrays, not ids
            raise RequestError(f"decode: token_ids must be one flat list of token ids; got a {token_ids.ndim}-D "
                               f"array (pass ids[0])")
        ids = list(token_ids)
        bad = next((t for t in ids if isinstance(t, bool) or not hasattr(type(t), "__index__")), _NONE)
        if bad is not _NONE:
            raise RequestError(f"decode: token ids must be integers; got {bad!r} ({type(bad).__name__})")
        ids = [int(t) for t in ids]
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"decode: token id {bad} is outside this model's vocabulary (0..{self.vocab_size - 1})")
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs `bytes`): a character spelled by several tokens has its
        bytes split among them, where decoding a token alone gives U+FFFD. Byte-level BPE spells bytes as GPT-2's
        printable characters, SentencePiece's byte fallback as <0xNN> (its word marker is a space); for any other
        tokenizer, the token decoded alone. RequestError for an id outside the vocabulary (tokenizers gave b'' for
        one past it, OverflowError for a negative one)."""
        if isinstance(token_id, bool) or not hasattr(type(token_id), "__index__") or \
                not 0 <= operator.index(token_id) < self.vocab_size:
            raise RequestError(f"token_bytes: {token_id!r} is not a token id of this model's vocabulary "
                               f"(0..{self.vocab_size - 1})")
        piece = self.tokenizer.id_to_token(token_id)
        if piece is not None and self._spelling == "byte-level" and all(c in BYTE_OF_SYMBOL for c in piece):
            return bytes(BYTE_OF_SYMBOL[c] for c in piece)
        if piece is not None and self._spelling == "byte-fallback":
            byte = BYTE_TOKEN.fullmatch(piece)
            return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @functools.cached_property
    def _spelling(self) -> str | None:
        """How the vocabulary spells bytes, from its decoder: "byte-level", "byte-fallback" or None."""
        decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        kinds = {part.get("type") for part in decoder.get("decoders", [decoder])}
        return "byte-level" if "ByteLevel" in kinds else "byte-fallback" if "ByteFallback" in kinds else None

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of special tokens (BOS, EOS, chat markers): decode leaves their text out."""
        return frozenset(i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special)

    def stream_decoder(self, stop_strings: tuple[str, ...] = (), prompt_ids: Sequence[int] = (),
                       min_tokens: int = 0) -> "StreamDecoder":
        """A decoder for the tokens generated after prompt_ids, whose last tokens it reads as context: up to the last
        whole character (a prompt given as ids may end inside one, which the generated bytes complete).
        min_tokens: a stop string counts only where it ends after the first min_tokens tokens' text."""
        context = list(prompt_ids[-CONTEXT_TOKENS:]) if prompt_ids else []
        while context and self.decode_unchecked(context).endswith("\ufffd"):  # prompt ids: checked at submit
            context.pop()
        return StreamDecoder(self, stop_strings, context=context, min_tokens=min_tokens)


# Prompt tokens a stream decoder reads before the generated ones (vLLM reads 5): a SentencePiece tokenizer (Llama 2,
# Mistral) decodes a text's first "▁word" without its space, so the first generated word would lose the space that
# separates it from the prompt ("is" + "Paris"); decoded after the prompt's last tokens, it keeps it (" Paris").
CONTEXT_TOKENS = 5


_NONE = object()  # next()'s default where None is a value to report


class StreamDecoder:
    """Turns tokens arriving one by one into text pieces, holding back incomplete UTF-8 sequences, and with stop
    strings, everything from the first stop string on.

    Decodes the window since the last emitted boundary, so each step costs O(window), not O(text). A streamed text
    ends before a stop string, as the result's text does (vLLM's and OpenAI's rule): a tail that could be the
    start of a stop string is held back until the next tokens tell, and `finish()` returns it when generation
    ends some other way. `stopped` turns true when a stop string has appeared (`stop_string`: which; of several, the
    one that completes first in the text, whatever the tokens, and of two completing at one character the one listed
    first, as vLLM's check_stop_strings picks). With min_tokens (vLLM's min_tokens),
    a stop string counts only where it ends after the text of the first min_tokens pushed tokens.
    """

    def __init__(self, tokenizer: TextTokenizer, stop_strings: tuple[str, ...] = (), context: Sequence[int] = (),
                 min_tokens: int = 0):
        """context: token ids before the first pushed one (the prompt's last ones), read but never returned."""
        self.tokenizer = tokenizer
        self.skipped_ids = getattr(tokenizer, "special_ids", frozenset())  # decode leaves their text out
        self.min_tokens = min_tokens
        self.pushed = 0
        self.stops_from = 0  # a stop string must end after text[:stops_from] (the first min_tokens tokens' text)
        self.tokens: list[int] = list(context)
        self.prefix_offset = 0  # start of the window re-decoded for context (spaces depend on it)
        self.read_offset = len(self.tokens)  # tokens before this were already decoded into `text`
        self.stop_strings = tuple(stop for stop in stop_strings if stop)
        self.text = ""  # all decoded text, kept only to look for stop strings
        self.emitted = 0  # text[:emitted] was returned; no stop string starts before it
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text (vLLM's stop_reason)
        self.pieces: list[str] = []  # everything returned: the result's text is their join

    @property
    def streamed_text(self) -> str:
        """The text returned so far (after `finish()`, the whole text). A result's text is this, so that it equals
        the stream even where decoding all tokens at once differs: a byte-fallback tokenizer turns a whole run of
        byte tokens into U+FFFD when the run ends inside a character, complete characters before it included."""
        return "".join(self.pieces)

    def push(self, token_id: int) -> str:
        """The text this token makes safe to show ("" while it is held back, and after a stop string)."""
        if token_id not in self.skipped_ids:  # decode leaves a special token's text out: the same text
            # without it, and a run of them (EOS after EOS under ignore_eos) no longer grows the window re-decoded
            self.tokens.append(token_id)
        self.pushed += 1
        prefix = self.tokenizer.decode_unchecked(self.tokens[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode_unchecked(self.tokens[self.prefix_offset :])
        piece = ""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            piece = self._new_text(prefix, full)
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
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
        prefix = self.tokenizer.decode_unchecked(self.tokens[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode_unchecked(self.tokens[self.prefix_offset :])
        pending = self._new_text(prefix, full) if len(full) > len(prefix) else ""
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

    def _new_text(self, prefix: str, full: str) -> str:
        """The text of the tokens after read_offset: what decoding them after the prefix's added. A byte-fallback
        decoder rewrites a whole run of byte tokens that holds an invalid byte as U+FFFD per byte, characters it had
        decoded whole before included ("ü" then a stray byte: "���"), so that `full` no longer starts with `prefix`;
        then the new tokens' own bytes, decoded (a stray byte is one U+FFFD, as Python's errors="replace" has it).
        Slicing had added a U+FFFD per byte of the rewritten run."""
        if full.startswith(prefix):
            return full[len(prefix) :]
        new_bytes = b"".join(self.tokenizer.token_bytes(token) for token in self.tokens[self.read_offset :])
        return new_bytes.decode("utf-8", errors="replace")

    def _release(self) -> str:
        if self.stopped:
            return ""
        if self.pushed <= self.min_tokens:  # a stop string must end in a later token's text
            self.stops_from = len(self.text)
        # Of the stops found, the one that completes first, as text arriving a character at a time would stop (of
        # two completing at one character, the one listed first, as vLLM's check_stop_strings keeps it): the earliest
        # start made the cut depend on how the tokens split the text ("The answer" under stops "answer", "swe": "The "
        # as one token, "The an" byte by byte).
        found = [(start + len(stop), listed, start, stop) for listed, stop in enumerate(self.stop_strings)
                 if (start := self.text.find(stop, max(self.emitted, self.stops_from - len(stop) + 1))) >= 0]
        if found:
            self.stopped = True
            _, _, end, self.stop_string = min(found)
        else:
            end = len(self.text) - self._could_start_a_stop()
        piece, self.emitted = self.text[self.emitted : end], end
        return piece

    def _could_start_a_stop(self) -> int:
        """Length of the longest unemitted tail of the text that some stop string begins with."""
        text, unemitted = self.text, len(self.text) - self.emitted
        longest = 0
        for stop in self.stop_strings:
            # Tails from the longest down, visiting only those that start with the stop's first character: trying
            # every length cost O(len(stop)) slices a token: 5.2 ms a token under 64 stops of 1000 characters, 0.05 now.
            most = min(len(stop) - 1, unemitted)
            if most <= longest:  # an empty stop string too
                continue
            start = text.find(stop[0], len(text) - most)
            while start != -1 and len(text) - start > longest:
                if stop.startswith(text[start:]):
                    longest = len(text) - start
                    break
                start = text.find(stop[0], start + 1)
        return longest
