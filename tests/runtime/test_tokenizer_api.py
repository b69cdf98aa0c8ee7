"""runtime/tokenizer_api.py called directly (no HTTP): the answers of vLLM's /tokenize, /detokenize and
/tokenizer_info and the fields they refuse. Over HTTP, with a chat template: tests/runtime/test_server.py."""
from __future__ import annotations

import pytest

from runtime import Engine
from runtime.openai_api import ApiError
from runtime.tokenizer_api import detokenize, tokenize, tokenizer_info

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    return Engine.load(tiny_artifact)


@pytest.fixture(scope="module")
def chat_engine(chat_artifact):
    return Engine.load(chat_artifact[0])


def refused(call, *args) -> ApiError:
    with pytest.raises(ApiError) as error:
        call(*args)
    return error.value


def test_a_prompt_is_tokenized_as_completions_run_it(tiny_artifact):
    from tokenizers.processors import TemplateProcessing

    engine = Engine.load(tiny_artifact)  # its own: a tokenizer whose post-processor adds BOS, as Llama's does
    bos = engine.manifest["tokenizer"]["bos_token_id"]
    bos_text = engine.tokenizer.tokenizer.id_to_token(bos)
    engine.tokenizer.tokenizer.post_processor = TemplateProcessing(single=f"{bos_text} $A",
                                                                   special_tokens=[(bos_text, bos)])
    with_bos = engine.tokenizer.encode("The keeper", add_special_tokens=True)
    assert with_bos[0] == bos and with_bos[1:] == engine.tokenizer.encode("The keeper", add_special_tokens=False)
    assert tokenize(engine, {"prompt": "The keeper", "model": MODEL}, MODEL) == {
        "count": len(with_bos), "max_model_len": engine.max_context, "tokens": with_bos, "token_strs": None}
    plain = tokenize(engine, {"prompt": "The keeper", "add_special_tokens": False, "return_token_strs": False}, MODEL)
    assert plain["tokens"] == with_bos[1:] and plain["token_strs"] is None


def test_chat_messages_end_with_the_generation_prompt_unless_told_not_to(chat_engine):
    messages = [{"role": "user", "content": "2+2?"}]
    assert tokenize(chat_engine, {"messages": messages}, MODEL)["tokens"] == chat_engine.chat_prompt_ids(messages, True)
    bare = tokenize(chat_engine, {"messages": messages, "add_generation_prompt": False}, MODEL)["tokens"]
    assert bare == chat_engine.chat_prompt_ids(messages, False) != chat_engine.chat_prompt_ids(messages, True)


@pytest.mark.parametrize("body, param, message", [
    ({}, "prompt", "give a prompt (a string) or messages (chat), one of them"),
    ({"messages": []}, "messages", "messages: a non-empty list of {role, content} objects"),
    ({"messages": "hi"}, "messages", "messages: a non-empty list"),
    ({"prompt": ["hi"]}, "prompt", "prompt: must be a string, got list"),
    ({"prompt": "hi", "tokens": [1]}, "tokens", "unrecognized request field 'tokens'"),
])
def test_tokenize_refuses_what_it_cannot_answer_naming_the_field(engine, body, param, message):
    error = refused(tokenize, engine, body, MODEL)
    assert error.param == param and message in str(error)


def test_tokenize_messages_refuses_add_special_tokens_rather_than_ignoring_it(engine):
    """vLLM adds the tokenizer's special tokens on top of the template's with true (its default there is false); the
    field was taken and ignored."""
    body = {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}
    error = refused(tokenize, engine, body, MODEL)
    assert error.param == "add_special_tokens" and "not supported with messages" in str(error)


def test_a_chat_request_the_template_refuses_names_the_messages(engine):
    """The tiny artifact has no chat template: the engine's RequestError comes back as the messages' fault."""
    error = refused(tokenize, engine, {"messages": [{"role": "user", "content": "hi"}]}, MODEL)
    assert error.param == "messages"


def test_detokenize_spells_special_tokens_and_refuses_ids_outside_the_vocabulary(engine):
    eos = engine.eos_token_ids[0]
    ids = engine.tokenizer.encode("The keeper", add_special_tokens=False)
    assert detokenize(engine, {"tokens": [*ids, eos]}, MODEL) == {
        "prompt": "The keeper" + engine.tokenizer.tokenizer.id_to_token(eos)}
    vocab = engine.manifest["model"]["config"]["vocab_size"]
    error = refused(detokenize, engine, {"tokens": [1, vocab]}, MODEL)
    assert (error.param, str(error)) == ("tokens",
                                         f"tokens: {vocab} is outside this model's vocabulary (0..{vocab - 1})")
    for tokens in ([1, 2.5], [1, True], None):
        assert "tokens: required, a list of token ids" in str(refused(detokenize, engine, {"tokens": tokens}, MODEL))
    assert refused(detokenize, engine, {"tokens": [1], "prompt": "x"}, MODEL).param == "prompt"


def test_tokenizer_info_names_the_special_tokens_and_the_limits(engine):
    manifest = engine.manifest
    assert tokenizer_info(engine) == {
        **engine.special_token_texts(), "pad_token": None, "bos_token_id": manifest["tokenizer"]["bos_token_id"],
        "eos_token_ids": list(engine.eos_token_ids), "chat_template": None, "model_max_length": engine.max_context,
        "vocab_size": manifest["model"]["config"]["vocab_size"]}
    assert manifest["tokenizer"]["bos_token_id"] is not None
    assert engine.max_context != manifest["model"]["config"]["vocab_size"]


def test_tokenizer_info_gives_the_pad_token_the_model_names(engine, monkeypatch):
    """pad_token was always null, though a tokenizer_config.json names one (the build keeps it for templates)."""
    monkeypatch.setitem(engine.manifest["tokenizer"], "template_tokens", {"pad_token": "<pad>"})
    assert tokenizer_info(engine)["pad_token"] == "<pad>"
