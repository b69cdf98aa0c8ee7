"""A GGUF's SentencePiece ('llama') tokenizer (Llama 2, TinyLlama, Mistral 7B) against sentencepiece itself.

The reference is a SentencePiece BPE model trained here, with Llama's settings (identity normalization, whitespace
kept, byte fallback, split digits), on one half of Python's documentation; the tokenizer rebuilt from its GGUF
metadata must encode the other half to the same ids and decode them to the same text.
"""
from __future__ import annotations

import dataclasses
import io

import pytest
from tokenizers import Tokenizer

from compiler.errors import BuildError
from compiler.frontend.gguf_loader import load_gguf
from compiler.frontend.gguf_tokenizer import tokenizer_json_from_gguf
from compiler.frontend.random_init import random_model
from tests.compiler.test_frontend import TINY, write_gguf

USER_SYMBOL = "<|user|>"  # a user-defined piece: matched whole, decoded as text
TRICKY = ["", " ", "  two  spaces ", "\n\nnew\nlines\n", "Ünïcödé ☃ 日本語 🎉", "tabs\tand\ttabs", "1234567 3.14",
          " leading", "trailing ", "ﬁ ligature", "a" * 300]


def documentation_lines() -> list[str]:
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-space-prefix"])
def sentencepiece_model(request):
    import sentencepiece

    lines = documentation_lines()
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines[: len(lines) // 2]), model_writer=model, vocab_size=1000, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=request.param, split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=[USER_SYMBOL], unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue()), request.param


def gguf_metadata(processor, space_prefix: bool) -> dict:
    """The tokenizer.ggml.* keys convert_hf_to_gguf writes for a SentencePiece model (its token types:
    1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte)."""
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]

    def kind(i: int) -> int:
        if processor.is_unknown(i):
            return 2
        if processor.is_control(i):
            return 3
        if processor.is_byte(i):
            return 6
        return 4 if pieces[i] == USER_SYMBOL else 1

    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
            "tokenizer.ggml.scores": [processor.get_score(i) for i in range(len(pieces))],
            "tokenizer.ggml.token_type": [kind(i) for i in range(len(pieces))],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": space_prefix}


def rebuilt(metadata: dict) -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json_from_gguf(metadata.get, "x.gguf"))


def test_it_encodes_and_decodes_held_out_text_as_sentencepiece_does(sentencepiece_model):
    """The loader refused tokenizer model 'llama'. Every held-out line (and spaces, newlines, characters only byte
    fallback can spell, long runs) now gives sentencepiece's ids, and those ids decode to sentencepiece's text."""
    processor, space_prefix = sentencepiece_model
    tokenizer = rebuilt(gguf_metadata(processor, space_prefix))
    lines = documentation_lines()
    texts = lines[len(lines) // 2:] + TRICKY
    mismatched = [text for text in texts if tokenizer.encode(text, add_special_tokens=False).ids != processor.encode(text)]
    assert mismatched == []
    assert len(texts) > 4000 and any(processor.is_byte(i) for i in processor.encode(TRICKY[4]))  # byte fallback ran
    undecoded = [text for text in texts if tokenizer.decode(processor.encode(text)) != processor.decode(processor.encode(text))]
    assert undecoded == []


def test_bos_special_and_user_defined_tokens_follow_llama_cpp(sentencepiece_model):
    """BOS goes first (llama.cpp's default for SentencePiece vocabularies, unless add_bos_token says not); </s> in a
    prompt is the special token, and the text after it gets the space prefix again, as llama.cpp tokenizes it (each
    run of text after a special or user-defined token starts as a new text); decoding skips special tokens."""
    processor, space_prefix = sentencepiece_model
    metadata = gguf_metadata(processor, space_prefix)
    tokenizer = rebuilt(metadata)
    assert tokenizer.encode("Hello world").ids == [1] + processor.encode("Hello world")
    assert rebuilt({**metadata, "tokenizer.ggml.add_bos_token": False}).encode("Hi").ids == processor.encode("Hi")
    assert tokenizer.encode("</s>Hello", add_special_tokens=False).ids == [2] + processor.encode("Hello")
    user = processor.piece_to_id(USER_SYMBOL)
    assert tokenizer.encode(f"{USER_SYMBOL}Hi", add_special_tokens=False).ids == [user] + processor.encode("Hi")
    assert tokenizer.decode([1, *processor.encode("Hello world"), 2]) == "Hello world"


def test_damaged_sentencepiece_metadata_is_named():
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab"]
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.0] * 6,
                "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1]}
    # no "▁" piece and no byte pieces to spell it: the unknown token, as sentencepiece gives
    assert rebuilt(metadata).encode("ab", add_special_tokens=False).tokens == ["<unk>", "ab"]
    for broken, message in [
        ({"tokenizer.ggml.scores": None}, r"has 6 tokens and no tokenizer.ggml.scores"),
        ({"tokenizer.ggml.scores": [0.0] * 5}, r"has 6 tokens and 5 scores and 6 token types"),
        ({"tokenizer.ggml.token_type": [1] * 4}, r"has 6 tokens and 6 scores and 4 token types"),
        ({"tokenizer.ggml.unknown_token_id": 9}, r"unknown_token_id 9 is outside the GGUF's 6 tokens"),
        ({"tokenizer.ggml.unknown_token_id": 6}, r"unknown_token_id 6 is outside the GGUF's 6 tokens"),
        ({"tokenizer.ggml.bos_token_id": 6}, r"bos_token_id 6 is outside the GGUF's 6 tokens"),
    ]:
        with pytest.raises(BuildError, match=message):
            rebuilt({**metadata, **broken})


def test_a_gguf_file_with_a_sentencepiece_tokenizer_loads_and_streams_its_text(tmp_path, sentencepiece_model):
    """The whole path: a Llama GGUF file whose tokenizer is SentencePiece loads, and the runtime's tokenizer and
    stream decoder over the artifact's tokenizer.json give sentencepiece's ids and text."""
    from runtime.tokenizer import TextTokenizer

    processor, space_prefix = sentencepiece_model
    config = dataclasses.replace(TINY, vocab_size=processor.get_piece_size())
    original = random_model(config, seed=0)
    path = tmp_path / "spm.gguf"
    write_gguf(path, config, original.state_dict, original.tokenizer_json,
               sentencepiece=gguf_metadata(processor, space_prefix))
    loaded = load_gguf(str(path), progress=False)
    assert loaded.config.vocab_size == 1000
    (tmp_path / "tokenizer.json").write_text(loaded.tokenizer_json)
    tokenizer = TextTokenizer(tmp_path / "tokenizer.json", bos_token_id=1)
    text = "Return the number of items in a container, ☃ included."
    assert tokenizer.encode(text) == [1] + processor.encode(text)
    stream = tokenizer.stream_decoder()
    pieces = [stream.push(token) for token in processor.encode(text)] + [stream.finish()]
    assert "".join(pieces) == processor.decode(processor.encode(text)) == text


@pytest.mark.parametrize("pre, expected", [
    # llama.cpp's own test vectors (models/ggml-vocab-deepseek-{llm,coder}.gguf.out) give these pieces; GPT-2's
    # regex, which every type without an entry got, kept " 4" and " ½" whole
    ("deepseek-llm", ["ied", "Ġ", "4", "Ġ", "Â½", "Ġmonths", ",", "Ġ", "3333333", "!"]),
    ("deepseek-coder", ["ied", "Ġ", "4", "Ġ", "Â½", "Ġmonths", ",", "Ġ", *"3333333", "!"]),
    ("gpt-2", ["ied", "Ġ4", "ĠÂ½", "Ġmonths", ",", "Ġ3333333", "!"]),
    (None, ["ied", "Ġ", "4", "Ġ", "Â½", "Ġmonths", ",", "Ġ", "333", "333", "3", "!"]),  # llama.cpp's DEFAULT
])
def test_each_pre_tokenizer_type_cuts_text_with_llama_cpp_regexes(pre, expected):
    from compiler.frontend.gguf_tokenizer import _pre_tokenizer

    assert [piece for piece, _ in _pre_tokenizer(pre, "x.gguf").pre_tokenize_str("ied 4 ½ months, 3333333!")] == expected


def test_an_unknown_pre_tokenizer_type_is_refused():
    """A type with no entry had been split with GPT-2's regex, silently giving other tokens than llama.cpp."""
    from compiler.frontend.gguf_tokenizer import _pre_tokenizer

    with pytest.raises(BuildError, match=r"pre-tokenizer type 'tekken' \(tokenizer.ggml.pre\) is not supported.*"
                                         r"Supported: .*deepseek-coder.*Hugging Face folder"):
        _pre_tokenizer("tekken", "x.gguf")


def test_scores_that_do_not_rank_the_pieces_are_refused(sentencepiece_model):
    """gguf-py writes -1000 for every piece of a vocabulary converted from a tokenizer.json; llama.cpp then merges
    the leftmost pair among equal scores, which merges ranked by a list cannot reproduce: refused, not guessed."""
    processor, space_prefix = sentencepiece_model
    metadata = gguf_metadata(processor, space_prefix)
    flat = {**metadata, "tokenizer.ggml.scores": [-1000.0] * len(metadata["tokenizer.ggml.scores"])}
    with pytest.raises(BuildError, match=r"share a score with another .* leftmost pair"):
        rebuilt(flat)


def test_a_control_token_outside_the_byte_alphabet_is_not_matched_whole():
    """A byte-level vocabulary spells a newline "Ċ"; a raw "\n\n" marked control is a llama.cpp mislabel. Added as a
    special token it would be cut out of the text whole (and dropped when decoding skips special tokens); a real
    control token still matches whole."""
    from runtime.tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "\n\n", "<|im_start|>"]
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": [1] * (len(tokens) - 2) + [3, 3], "tokenizer.ggml.merges": []}
    assert rebuilt(metadata).encode("a\n\nb<|im_start|>").tokens == ["a", "Ċ", "Ċ", "b", "<|im_start|>"]


def test_added_tokens_stored_as_their_text_are_matched_whole_under_their_own_ids():
    """convert_hf_to_gguf stores added tokens as the text they stand for (DeepSeek-R1-Distill-Qwen's control tokens
    <｜User｜> and <｜begin▁of▁sentence｜>, a user-defined " <tag>"); llama.cpp matches that text whole. Spelled byte by
    byte they had been skipped: a chat prompt's <｜User｜> became 11 byte tokens, and BOS read as "<ï½ľbegin...".
    A whitespace-only control token (a mislabel), whose spelling a merge makes here, keeps its spelling: "ĊĊ"."""
    from runtime.tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    added = ["<｜begin▁of▁sentence｜>", "<｜User｜>", " <tag>", "\n\n"]
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-r1-qwen",
                "tokenizer.ggml.tokens": [*alphabet, *added], "tokenizer.ggml.merges": ["Ċ Ċ"],
                "tokenizer.ggml.token_type": [1] * len(alphabet) + [3, 3, 4, 3],
                "tokenizer.ggml.bos_token_id": len(alphabet), "tokenizer.ggml.add_bos_token": True}
    tokenizer = rebuilt(metadata)
    bos, user, tag, newlines = range(len(alphabet), len(alphabet) + 4)
    encoding = tokenizer.encode("<｜User｜>hi <tag>")
    assert encoding.ids == [bos, user, alphabet.index("h"), alphabet.index("i"), tag]
    assert encoding.tokens[:2] == ["<｜begin▁of▁sentence｜>", "<｜User｜>"]
    assert tokenizer.decode(encoding.ids) == "hi <tag>"  # control tokens skipped, the user-defined one kept as text
    assert tokenizer.get_vocab_size(with_added_tokens=True) == len(metadata["tokenizer.ggml.tokens"])
    assert tokenizer.encode("a\n\nb", add_special_tokens=False).ids == [alphabet.index("a"), newlines,
                                                                        alphabet.index("b")]


def test_merges_that_name_a_piece_missing_from_the_tokens_are_refused_by_name():
    """A merge whose parts or product are not tokens (a token list cut short) stopped in tokenizers' own bare
    Exception, "Error while initializing BPE: Token `ab` out of vocabulary", with no file or key named."""
    from runtime.tokenizer import bytes_to_unicode

    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                "tokenizer.ggml.tokens": list(bytes_to_unicode().values()), "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(BuildError, match=r"x.gguf: the GGUF's tokenizer.ggml.merges do not fit its "
                                         r"tokenizer.ggml.tokens \(.*out of vocabulary\).*convert the model again"):
        rebuilt(metadata)


def test_a_byte_level_token_stored_as_raw_text_keeps_its_id():
    """convert_hf_to_gguf may store a token as its text ("日") rather than byte-level symbols ("æĹ¥"); spelled out
    byte by byte, as transformers does, it is found whole (llama3's ignore_merges) under its own id."""
    from runtime.tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
                "tokenizer.ggml.tokens": [*alphabet, "日"], "tokenizer.ggml.merges": []}
    assert rebuilt(metadata).encode("日").ids == [len(alphabet)]


def test_sentencepiece_merges_make_pieces_of_any_type_as_llama_cpp_does():
    """llama.cpp's try_add_bigram looks the joined text up whatever the token's type, and resegment keeps the token it
    finds: an unused piece (type 5, as convert_hf_to_gguf marks sentencepiece's unused pieces and its [PAD] fillers)
    of the highest score is merged first, "▁ab" becoming "▁" + "ab". Merges had made normal pieces only ("▁a" + "b")."""
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "▁", "a", "b",
                                                                            "ab", "▁a"],
                "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -3.0, -4.0, -5.0, 0.0, -1.0],
                "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 5, 1], "tokenizer.ggml.add_space_prefix": True}
    assert rebuilt(metadata).encode("ab", add_special_tokens=False).tokens == ["▁", "ab"]


# TinyLlama-1.1B-Chat's template (Zephyr's): no bos_token in it; Llama 2's writes one before each [INST].
TINYLLAMA_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\n' + "
                      "message['content'] + eos_token }}{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' "
                      "+ message['content'] + eos_token }}{% endif %}{% if loop.last and add_generation_prompt %}"
                      "{{ '<|assistant|>' }}{% endif %}{% endfor %}")
LLAMA2_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
                   "message['content'].strip() + ' [/INST]' }}{% else %}{{ ' ' + message['content'].strip() + ' ' + "
                   "eos_token }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("template", [TINYLLAMA_TEMPLATE, LLAMA2_TEMPLATE], ids=["no-bos-in-template", "llama2"])
def test_a_gguf_chat_prompt_starts_with_bos_once_as_llama_cpp_tokenizes_it(tmp_path, sentencepiece_model, template):
    """llama.cpp cuts a leading BOS text off the rendered chat prompt and tokenizes it with add_special: the prompt
    starts with BOS when the file's add_bos_token says so. chat_prompt_ids tokenized without special tokens, so a
    template that does not write bos_token (TinyLlama-Chat's, Zephyr's, ChatML finetunes of Mistral) gave a prompt
    without BOS."""
    from compiler.build import build
    from compiler.recipe import parse_recipe
    from runtime import Engine
    from runtime.chat import render

    processor, space_prefix = sentencepiece_model
    config = dataclasses.replace(TINY, vocab_size=processor.get_piece_size())
    original = random_model(config, seed=0)
    path = tmp_path / "spm-chat.gguf"
    write_gguf(path, config, original.state_dict, original.tokenizer_json, chat_template=template,
               sentencepiece=gguf_metadata(processor, space_prefix))
    engine = Engine.load(build(parse_recipe({"name": "spm-chat", "model": {"source": "gguf", "path": str(path)},
                                             "export": {"max_context": 64}}), tmp_path / "out"))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    ids = engine.chat_prompt_ids(messages)
    text = render(template, messages, bos_token="<s>", eos_token="</s>")
    assert ids[0] == 1 and ids[1] != 1
    assert ids == [1] + engine.tokenizer.encode(text.removeprefix("<s>"), add_special_tokens=False)
    assert ids.count(1) == max(1, text.count("<s>"))  # one BOS per <s> the template writes, at least one
    engine.close()


def test_the_unknown_token_s_text_is_matched_whole_and_decodes_to_nothing_as_in_llama_cpp(sentencepiece_model):
    """llama.cpp matches a token of type unknown (2) by its text in a prompt, as it does control tokens
    (tokenizer_st_partition with parse_special), and token_to_piece gives it no text. "<unk>" had been cut into
    the pieces "<", "unk", ">" and decoded as the text "<unk>"."""
    processor, space_prefix = sentencepiece_model
    tokenizer = rebuilt(gguf_metadata(processor, space_prefix))
    ids = tokenizer.encode("a<unk>b", add_special_tokens=False).ids
    assert ids == processor.encode("a") + [0] + processor.encode("b")  # the text after it gets the space prefix
    assert tokenizer.decode(ids) == processor.decode(processor.encode("a")) + (" b" if space_prefix else "b")
