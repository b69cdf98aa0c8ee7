"""runtime/tokenizer.StreamDecoder with stop strings: the streamed text ends before the first stop string, as the
result's text does; a tail that may begin one is held back, and released when it turns out not to."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers

from runtime.errors import ArtifactError
from runtime.tokenizer import StreamDecoder, TextTokenizer


def cut_at_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    """The reference rule the streams must follow: the text before the stop string that completes first, as text
    arriving one character at a time stops (vLLM's rule); of two completing at one character, the one listed first."""
    found = [(start + len(stop), listed, start) for listed, stop in enumerate(stop_strings)
             if stop and (start := text.find(stop)) >= 0]
    return text[: min(found)[2]] if found else text


class PieceTokenizer:
    """Token i decodes to pieces[i]: enough for StreamDecoder, which only calls decode_unchecked()."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in token_ids)

    decode_unchecked = decode


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
    (["abcdef"], ("bcde", "cd"), ["ab"], True, ""),  # two stops in one piece: the one completing first, not the
    (list("abcdef"), ("bcde", "cd"), ["a", "", "", "b"], True, ""),  # first listed: cut as when pushed one by one
    (["abcdef"], ("cde", "bcde"), ["ab"], True, ""),  # two completing at one character: the one listed first
    (["abcdef"], ("bcde", "cde"), ["a"], True, ""),
])
def test_streamed_text_ends_before_the_first_stop(pieces, stops, given, stopped, tail):
    assert stream(pieces, stops) == (given, stopped, tail)
    assert "".join(given) + tail == cut_at_stop("".join(pieces), stops)


def held_back_by_brute_force(text: str, emitted: int, stops: tuple[str, ...]) -> int:
    """The longest unemitted tail of `text` that some stop string begins with, trying every length."""
    return max([length for stop in stops for length in range(1, min(len(stop) - 1, len(text) - emitted) + 1)
                if text.endswith(stop[:length])], default=0)


def test_the_held_back_tail_is_the_longest_any_stop_begins_with():
    """_could_start_a_stop finds its tail by scanning for each stop's first character (it had tried every length,
    O(len(stop)) slices per token); on random texts over a small alphabet it agrees with trying every length."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        letters = "ab "[: rng.integers(1, 4)]
        stops = tuple("".join(rng.choice(list(letters), rng.integers(0, 7))) for _ in range(rng.integers(1, 5)))
        decoder = StreamDecoder(PieceTokenizer([]), stops)
        decoder.text = "".join(rng.choice(list(letters), rng.integers(0, 12)))
        decoder.emitted = int(rng.integers(0, len(decoder.text) + 1))
        assert decoder._could_start_a_stop() == held_back_by_brute_force(decoder.text, decoder.emitted, stops), (
            decoder.text, decoder.emitted, stops)


@pytest.mark.parametrize("pieces, stops, min_tokens, given, stopped", [
    (["a\n", "b", "\nc", "d"], ("\n",), 1, ["a\n", "b", ""], True),  # the first token's "\n" is not a stop
    (["a\n", "\n", "b\n"], ("\n",), 2, ["a\n", "\n", "b"], True),  # nor the second's, with 2
    (["xa", "b"], ("ab",), 1, ["x", ""], True),  # a stop that ends in a later token's text counts
    (["a\n\n", "Y"], ("\n\nX", "\n"), 1, ["a", "\n\nY"], False),  # a short stop inside a held tail does not
    (["a\n", "b"], ("\n",), 0, ["a"], True),  # 0: every stop counts
])
def test_min_tokens_lets_no_stop_string_end_within_the_first_tokens(pieces, stops, min_tokens, given, stopped):
    decoder = StreamDecoder(PieceTokenizer(pieces), stops, min_tokens=min_tokens)
    pushed = []
    for token in range(len(pieces)):
        pushed.append(decoder.push(token))
        if decoder.stopped:
            break
    assert (pushed, decoder.stopped) == (given, stopped)


class ByteTokenizer:
    """Token i decodes to pieces[i] as bytes, joined and decoded with U+FFFD for incomplete UTF-8 (byte-level BPE)."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, token_ids: list[int]) -> str:
        return b"".join(self.pieces[i] for i in token_ids).decode("utf-8", errors="replace")

    decode_unchecked = decode


@pytest.mark.parametrize("stops", [(), ("zz",)])
def test_a_generation_ending_inside_a_character_streams_what_its_result_holds(stops):
    pieces = [b"h", "é".encode()[:1]]  # the second token ends half-way through a two-byte character
    tokenizer = ByteTokenizer(pieces)
    decoder = StreamDecoder(tokenizer, stops)
    streamed = decoder.push(0) + decoder.push(1)
    assert streamed == "h"  # the incomplete byte is held back while more tokens may complete it
    streamed += decoder.finish()
    assert streamed == tokenizer.decode([0, 1]) == "h\ufffd"


def test_a_stop_string_completed_only_at_finish_ends_the_text_before_it():
    """The last token's text ends inside a character, so push() held it back whole, stop string included; finish()
    decodes it, finds the stop, and must give nothing from the stop on (the engine then reports finish "stop")."""
    decoder = StreamDecoder(ByteTokenizer([b"xb\xc3"]), ("b",))
    assert decoder.push(0) == ""
    assert (decoder.finish(), decoder.stopped, decoder.streamed_text) == ("x", True, "x")


def test_a_prompt_ending_inside_a_four_byte_character_leaves_the_context_whole(monkeypatch):
    """A byte-level decoder (errors="replace") gives one U+FFFD for 1-3 bytes of a 4-byte character: every one of
    the prompt's bytes of it leaves the context, so that the stream equals the generated tokens decoded alone."""
    emoji = "😀".encode()
    pieces = [b"go", emoji[:1], emoji[1:2], emoji[2:3], emoji[3:], b"a"]
    tokenizer = TextTokenizer.__new__(TextTokenizer)  # its decoding only: the bytes above, as a byte-level BPE's
    monkeypatch.setattr(tokenizer, "decode_unchecked", ByteTokenizer(pieces).decode, raising=False)
    decoder = tokenizer.stream_decoder((), [0, 1, 2, 3])
    text = "".join(decoder.push(token) for token in (4, 5)) + decoder.finish()
    assert text == ByteTokenizer(pieces).decode([4, 5]) == "\ufffda"


def test_special_tokens_decode_to_no_text(tiny_artifact):
    tokenizer = TextTokenizer(tiny_artifact / "tokenizer.json")
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert 2 in tokenizer.special_ids  # the tiny model's EOS
    assert tokenizer.decode(ids + [2]) == tokenizer.decode(ids)
    decoder = tokenizer.stream_decoder()
    assert "".join(decoder.push(token) for token in ids + [2]) + decoder.finish() == tokenizer.decode(ids)


def test_a_run_of_special_tokens_is_not_decoded_again_at_every_token(tiny_artifact):
    """EOS after EOS (ignore_eos, as `aotlm bench` runs) stayed in the window each push re-decodes: 2000 of them
    took 4 to 95 us a push, 99 ms for the request. Left out, the text is the same."""
    tokenizer = TextTokenizer(tiny_artifact / "tokenizer.json")
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    decoder = tokenizer.stream_decoder((), ids[:1])
    pieces = [decoder.push(token) for token in ids[1:] + [2] * 2000 + ids]
    assert len(decoder.tokens) <= 2 * len(ids) and decoder.pushed == 2 * len(ids) - 1 + 2000
    assert "".join(pieces) + decoder.finish() == tokenizer.decode(ids[1:] + [2] + ids)


@pytest.mark.parametrize("text, stops, expected", [
    ("abcdef", ("bcde", "cd"), "ab"),  # the stop that completes first wins, whichever is listed first
    ("The answer is", ("answer", "swe"), "The an"),
    ("abcdef", ("zz",), "abcdef"), ("abcdef", (), "abcdef"), ("abcabc", ("bc",), "a"),
])
def test_cut_at_stop_ends_before_the_stop_completing_first(text, stops, expected):
    assert cut_at_stop(text, stops) == expected
    for size in (1, 2, len(text)):  # the stream cuts there too, whatever the pieces
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        given, _, tail = stream(pieces, stops)
        assert "".join(given) + tail == expected, (size, given, tail)


def test_overlapping_stops_cut_the_stream_and_the_result_alike():
    pieces = list("xyD<|unused_351")
    stops = ("unused_351", "D<|unu")  # the second starts earlier but is listed later
    given, stopped, tail = stream(pieces, stops)
    assert stopped and "".join(given) + tail == cut_at_stop("".join(pieces), stops) == "xy"


def byte_fallback_tokenizer(folder) -> TextTokenizer:
    """Llama 2 / Mistral style: SentencePiece BPE with byte_fallback, its decoder Replace + ByteFallback + Fuse +
    Strip; ASCII letters are tokens, every other character falls back to its UTF-8 bytes."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for char in "▁" + "abcdefghijklmnopqrstuvwxyzL":
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.save(str(folder / "tokenizer.json"))
    return TextTokenizer(folder / "tokenizer.json")


def test_a_byte_fallback_stream_keeps_whole_characters_and_is_the_results_text(tmp_path):
    """Cut inside the last character, decoding every token at once turns the whole run of byte tokens into U+FFFD,
    complete characters before it included; the result's text was that, and differed from the stream. It is now
    the stream (StreamDecoder.streamed_text), which keeps them."""
    tokenizer = byte_fallback_tokenizer(tmp_path)
    ids = tokenizer.encode("Le café 中文😀", add_special_tokens=False)
    for cut in range(1, len(ids) + 1):
        for stops in ((), ("zz",)):
            decoder = tokenizer.stream_decoder(stops)
            pieces = [decoder.push(token) for token in ids[:cut]] + [decoder.finish()]
            assert "".join(pieces) == decoder.streamed_text
    decoder = tokenizer.stream_decoder(())
    for token in ids[:-1]:  # the emoji's last byte never came
        decoder.push(token)
    decoder.finish()
    assert decoder.streamed_text.startswith("Le café 中文") and decoder.streamed_text.endswith("\ufffd")
    assert "中文" not in tokenizer.decode(ids[:-1])  # why the result's text is the stream, not one decode


def byte_fallback_engine(tiny_artifact, tmp_path):
    """The tiny artifact with byte_fallback_tokenizer's tokenizer.json in place of its own."""
    import hashlib
    import json
    import shutil

    from runtime import Engine

    artifact = shutil.copytree(tiny_artifact, tmp_path / "artifact")
    byte_fallback_tokenizer(tmp_path)
    shutil.copy(tmp_path / "tokenizer.json", artifact / "tokenizer.json")
    manifest = json.loads((artifact / "manifest.json").read_text())
    data = (artifact / "tokenizer.json").read_bytes()
    manifest["files"]["tokenizer.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    return Engine.load(artifact)


def test_a_stray_byte_after_a_whole_character_is_one_replacement_character(tmp_path):
    """ByteFallback rewrites a whole run of byte tokens holding an invalid byte as U+FFFD per byte, the "ü" decoded
    before it included: the stream sliced that by length and added U+FFFDs ("ü��x"; transformers' decode "���x").
    Now the new tokens' bytes: what the bytes say, with Python's errors="replace" (llama.cpp's raw bytes so read).
    Fuzzed: never more U+FFFD than decoding every token at once gives, and no character of that lost."""
    tokenizer = byte_fallback_tokenizer(tmp_path)
    x = tokenizer.tokenizer.token_to_id("x")
    rng = np.random.default_rng(0)
    cases = [[3 + 0xC3, 3 + 0xBC, 3 + 0xA1, x]]
    for _ in range(300):  # text with bytes dropped and stray ones added
        ids = tokenizer.encode("Le café, ü 中文😀 x", add_special_tokens=False)
        for _ in range(2):
            ids.insert(int(rng.integers(len(ids) + 1)), 3 + int(rng.choice([0x80, 0xA1, 0xBC, 0xC3, 0xE4])))
        cases.append([t for t in ids if rng.random() > 0.1])
    for ids in cases:
        for stops in ((), ("zz",)):
            decoder = tokenizer.stream_decoder(stops)
            text = "".join([decoder.push(token) for token in ids] + [decoder.finish()])
            whole = tokenizer.decode_unchecked(ids)  # transformers' and vLLM's text: a broken run all U+FFFD
            assert text == decoder.streamed_text and text.count("\ufffd") <= whole.count("\ufffd"), (ids, text, whole)
            remaining = iter(text)  # every character the whole decode kept, the stream kept, in order
            assert all(char in remaining for char in whole.replace("\ufffd", "")), (ids, text, whole)
    decoder = tokenizer.stream_decoder(())
    assert [decoder.push(token) for token in cases[0]] + [decoder.finish()] == ["", "ü", "", "\ufffdx", ""]


def test_results_equal_their_streams_with_a_byte_fallback_tokenizer(tiny_artifact, tmp_path):
    """End to end, through Engine.stream and the scheduler: the tiny model sampling random ids, most of them byte
    tokens of this tokenizer, ends runs inside characters all the time (50 of 120 requests differed before)."""
    engine = byte_fallback_engine(tiny_artifact, tmp_path)
    options = dict(max_new_tokens=12, temperature=1.5, ignore_eos=True)
    for seed in range(12):
        generation = engine.stream([1, 40, 41], seed=seed, **options)
        assert "".join(generation) == generation.result.text
        handle = engine.submit([1, 40, 41], seed=seed, **options)
        assert "".join(handle) == handle.result().text == generation.result.text
    engine.close()


def test_a_tokenizer_file_that_truncates_or_pads_encodes_prompts_whole(tmp_path):
    """Hugging Face tokenizer.json files may set truncation and padding; a long prompt was cut to max_length."""
    tokenizer = byte_fallback_tokenizer(tmp_path).tokenizer
    text = "Le café " * 8
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    tokenizer.enable_truncation(max_length=4)
    tokenizer.enable_padding(length=64)
    tokenizer.save(str(tmp_path / "cutting.json"))
    assert len(Tokenizer.from_file(str(tmp_path / "cutting.json")).encode(text, add_special_tokens=False).ids) == 64
    assert TextTokenizer(tmp_path / "cutting.json").encode(text, add_special_tokens=False) == whole


def test_the_first_generated_word_keeps_the_space_after_the_prompt(tmp_path):
    """A SentencePiece tokenizer decodes a text's first "▁word" without its space: the tokens of " the end" streamed
    after the prompt "to" gave "the end", so prompt + text read "tothe end". The decoder now reads the prompt's last
    tokens first (as vLLM does), and gives " the end"; text that does not start with a space is unchanged."""
    tokenizer = byte_fallback_tokenizer(tmp_path)
    prompt = tokenizer.encode("go to")
    for continuation in (" the end", "day é"):
        ids = tokenizer.encode(continuation, add_special_tokens=False)[1:]  # less the "▁" the normalizer put first
        texts = []
        for context in (prompt, ()):
            decoder = tokenizer.stream_decoder((), context)
            texts.append("".join(decoder.push(token) for token in ids) + decoder.finish())
            assert texts[-1] == decoder.streamed_text
        assert texts == [continuation, continuation.lstrip()]  # without the prompt: the old text


def test_a_prompt_ending_inside_a_character_keeps_the_generated_text(tmp_path):
    """Prompt ids ending with the first two bytes of 中 (byte fallback), then the model generates its third byte and
    "ab": the context's text ended in U+FFFD, the full text did not, and the stream lost "\\ufffdab" but for "b"."""
    tokenizer = byte_fallback_tokenizer(tmp_path)
    first_two, third = [3 + 0xE4, 3 + 0xB8], 3 + 0xAD
    prompt = tokenizer.encode("go", add_special_tokens=True) + first_two
    generated = [third, *tokenizer.encode("ab", add_special_tokens=False)[1:]]  # less the space prefix's "▁"
    decoder = tokenizer.stream_decoder((), prompt)
    text = "".join(decoder.push(token) for token in generated) + decoder.finish()
    alone = tokenizer.stream_decoder((), ())
    assert text == "".join(alone.push(token) for token in generated) + alone.finish() == "\ufffdab"


def test_a_prompt_ending_inside_a_character_still_gives_its_whole_words_as_context(tmp_path):
    """Only the incomplete character's bytes leave the context, not the words before them: "▁the" generated after
    "go to" + two bytes of 中 reads " the", its space kept (decoded alone, a SentencePiece text drops it)."""
    tokenizer = byte_fallback_tokenizer(tmp_path)
    prompt = tokenizer.encode("go to", add_special_tokens=True) + [3 + 0xE4, 3 + 0xB8]
    generated = tokenizer.encode("the", add_special_tokens=False)  # "▁" (the word's space), "t", "h", "e"
    assert tokenizer.tokenizer.id_to_token(generated[0]) == "▁"
    decoder = tokenizer.stream_decoder((), prompt)
    text = "".join(decoder.push(token) for token in generated) + decoder.finish()
    assert text == " the"


def test_a_stop_string_found_at_the_end_inside_a_character_is_a_stop(tiny_artifact, tmp_path):
    """Every token generated is the lead byte of a two-byte character (a logit bias forces it): push() holds all the
    text back, and only finish() finds the stop string in it; the request still ended on a stop, not on its length."""
    engine = byte_fallback_engine(tiny_artifact, tmp_path)
    lead_byte = 3 + 0xC3
    for stream in (False, True):
        options = dict(max_new_tokens=3, ignore_eos=True, logit_bias={lead_byte: 100}, stop_strings=("\ufffd",))
        generation = engine.stream([1, 40, 41], **options)
        pieces = list(generation)
        result = generation.result if stream else engine.generate([1, 40, 41], **options)
        assert result.token_ids == [lead_byte] * 3 and (pieces, result.text, result.finish_reason) == ([], "", "stop")


@pytest.mark.parametrize("token_ids, message", [
    ([99999, 100], r"decode: token id 99999 is outside this model's vocabulary \(0\.\.511\)"),  # was dropped: "b"
    ([-1], r"decode: token id -1 is outside"),  # tokenizers' OverflowError
    ([2**40], r"decode: token id 1099511627776 is outside"),
    ("abc", "decode: token_ids must be a list of token ids \\(integers\\), got str"),  # "Can't extract `str` to `Vec`"
    (None, "decode: token_ids must be a list of token ids"), (5, "decode: token_ids must be a list of token ids"),
    ([1.0], r"decode: token ids must be integers; got 1.0 \(float\)"),
    ([[5, 6]], r"decode: token ids must be integers; got \[5, 6\] \(list\)"),
    ([None], r"decode: token ids must be integers; got None \(NoneType\)"),
    (np.array([[5, 6, 7]]), r"decode: token_ids must be one flat list of token ids; got a 2-D array \(pass ids\[0\]\)"),
    (np.array(5), r"decode: token_ids must be one flat list of token ids; got a 0-D array"),  # TypeError from numpy
])
def test_the_engines_tokenizer_refuses_what_is_not_token_ids_naming_it(tiny_engine, token_ids, message):
    from runtime import RequestError

    with pytest.raises(RequestError, match=message):
        tiny_engine.tokenizer.decode(token_ids)


def test_the_engines_tokenizer_decodes_any_sequence_of_ids_and_encodes_only_text(tiny_engine):
    import numpy as np

    from runtime import RequestError

    tokenizer = tiny_engine.tokenizer
    ids = tokenizer.encode("hello")
    assert tokenizer.decode(np.array(ids)) == tokenizer.decode(tuple(ids)) == tokenizer.decode(ids)
    assert tokenizer.decode([np.int32(i) for i in ids]) == tokenizer.decode(ids)
    with pytest.raises(RequestError, match=r"encode: text must be a str, got bytes; decode it to str first"):
        tokenizer.encode(b"hello")  # was tokenizers' "TextInputSequence must be str"
    for text in (None, ["a", "b"], 5):
        with pytest.raises(RequestError, match=f"encode: text must be a str, got {type(text).__name__}"):
            tokenizer.encode(text)
    with pytest.raises(RequestError, match="encode: add_special_tokens must be True or False, got 'no'"):
        tokenizer.encode("hello", add_special_tokens="no")


def test_a_tokens_bytes_are_its_own_and_join_to_the_texts_bytes(tmp_path, tiny_artifact):
    """OpenAI's logprobs `bytes`: each token's own, to be joined across the tokens of a character split among them
    (chat's logprobs gave [] for the first parts and the whole character's bytes at the last)."""
    text = "Le café 中文😀 ok"
    for tokenizer in (byte_fallback_tokenizer(tmp_path), TextTokenizer(tiny_artifact / "tokenizer.json")):
        ids = tokenizer.encode(text, add_special_tokens=False)
        parts = [tokenizer.token_bytes(token) for token in ids]
        assert any(len(part) and not _is_utf8(part) for part in parts)  # some token spells part of a character
        joined = b"".join(parts)
        assert joined.decode() == text or joined.decode() == " " + text  # SentencePiece: the word marker first
    plain = TextTokenizer(tiny_artifact / "tokenizer.json")
    assert plain._spelling == "byte-level" and byte_fallback_tokenizer(tmp_path)._spelling == "byte-fallback"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_a_tokenizer_panic_is_the_artifacts_error_not_a_base_exception(tiny_artifact, tmp_path):
    """A normalizer regex that gives up (oniguruma's retry limit) panics in Rust: pyo3's PanicException is a
    BaseException, which went past the server's `except Exception` and cut the connection without an answer."""
    data = json.loads((tiny_artifact / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "Replace", "pattern": {"Regex": "(a+)+$"}, "content": "x"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    tokenizer = TextTokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(ArtifactError, match="the artifact's tokenizer failed to encode this text"):
        tokenizer.encode("a" * 40 + "c")
    assert tokenizer.encode("hello", add_special_tokens=False)  # other text is tokenized


def test_a_tokenizer_file_an_older_tokenizers_cannot_read_names_the_upgrade(tmp_path):
    """tokenizers 0.19 could not read the files 0.20 and later write, and the error said to rebuild an artifact that
    was fine: where the manifest's tools name a newer release than the installed one, the fix is the upgrade."""
    import tokenizers

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"version": "1.0", "model": {"type": "NoSuchModel"}}))
    with pytest.raises(ArtifactError, match=rf"cannot read the tokenizer \(.+\); tokenizers {tokenizers.__version__} "
                                            r"is installed and 999.0.0 wrote it: .* -m pip install -U 'tokenizers>=999.0.0'"):
        TextTokenizer(path, built_with="999.0.0")
    for built_with in (tokenizers.__version__, None, "0.22.0rc1"):  # not older, or not said: the file is at fault
        with pytest.raises(ArtifactError, match=r"cannot read the tokenizer \(.+\); rebuild the artifact$"):
            TextTokenizer(path, built_with=built_with)


def test_the_engine_tells_the_tokenizer_which_release_wrote_its_file(tiny_artifact, monkeypatch):
    import runtime.engine
    from runtime import Engine

    seen = []
    real = runtime.engine.TextTokenizer
    monkeypatch.setattr(runtime.engine, "TextTokenizer", lambda *args: (seen.append(args[3]), real(*args))[1])
    Engine.load(tiny_artifact).close()
    assert seen == [json.loads((tiny_artifact / "manifest.json").read_text())["tools"]["tokenizers"]] and seen[0]


def test_an_rc_release_compares_by_its_numbers():
    """The tokenizers upgrade hint compared only all-digit releases: "0.22.0rc1" made it silent."""
    from runtime.tokenizer import _older

    assert _older("0.21.1", "0.22.0rc1") and not _older("0.22.0rc1", "0.21.1") and _older("0.19.0+cpu", "0.20.0")


@pytest.mark.parametrize("token_id", [-1, 512, 10**6, True, 3.0])
def test_token_bytes_refuses_what_is_not_an_id_of_the_vocabulary(tiny_engine, token_id):
    """-1 was tokenizers' OverflowError, an id past the table b'' without a word."""
    from runtime import RequestError

    with pytest.raises(RequestError, match=rf"^token_bytes: {re.escape(repr(token_id))} is not a token id of this "
                                           rf"model's vocabulary \(0\.\.511\)$"):
        tiny_engine.tokenizer.token_bytes(token_id)
    assert tiny_engine.tokenizer.token_bytes(np.int64(100)) == tiny_engine.tokenizer.token_bytes(100)


@pytest.mark.parametrize("text, origin", [("a\udcff", "bytes that were not UTF-8"),
                                          ("a\ud800", "half of a surrogate pair, as a JSON \\ud800 escape writes one")])
def test_a_lone_surrogate_is_said_to_come_from_where_it_can(text, origin):
    """A JSON "\\ud800" escape, valid UTF-8 on the wire, was blamed on bytes that were not UTF-8."""
    from runtime import RequestError
    from runtime.tokenizer import check_unicode

    with pytest.raises(RequestError, match=re.escape(f"a lone surrogate: {origin}); give UTF-8 text")):
        check_unicode(text, "the prompt")
