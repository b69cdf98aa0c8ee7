"""vLLM's tokenizer routes over the engine's tokenizer, so that a client without the model's own tokenizer can count
and split text as the server does: lm-evaluation-harness' `local-completions` finds them and tokenizes through them
(its remote tokenizer), which lets it score an artifact with no download.

    POST /tokenize        {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}
    POST /detokenize      {"tokens": [ids]} -> {"prompt": text}
    GET  /tokenizer_info  the special tokens' texts and ids, the chat template, the max context

Bodies are checked as runtime/openai_api.py checks the API's: ApiError names the field.
"""
from __future__ import annotations

from runtime.errors import RequestError
from runtime.openai_api import ApiError, _in_json_words, flag, request_fields
from runtime.sampling import is_integer

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def tokenize(engine, body, model_name: str) -> dict:
    """A text's token ids as /v1/completions would run them (add_special_tokens, default true: the tokenizer's BOS),
    or chat messages' as /v1/chat/completions renders them (Engine.chat_prompt_ids: the template writes its special
    tokens; a GGUF file's BOS as llama.cpp adds it)."""
    fields = request_fields(body, TOKENIZE_FIELDS, model_name)
    special = flag(fields, "add_special_tokens", default=True)
    if ("prompt" in fields) == ("messages" in fields):
        raise ApiError("give a prompt (a string) or messages (chat), one of them", param="prompt")
    try:
        if "prompt" in fields:
            if not isinstance(fields["prompt"], str):
                raise ApiError(f"prompt: must be a string, got {type(fields['prompt']).__name__}", param="prompt")
            engine.check_text_length(len(fields["prompt"]), "the prompt")  # as generation refuses it, untokenized
            ids = engine.tokenizer.encode(fields["prompt"], add_special_tokens=special)
        else:
            if not isinstance(fields["messages"], list) or not fields["messages"]:
                raise ApiError("messages: a non-empty list of {role, content} objects", param="messages")
            generation_prompt = flag(fields, "add_generation_prompt", default=True)
            if flag(fields, "add_special_tokens", default=False):  # vLLM's default for messages: false
                raise ApiError("add_special_tokens: true is not supported with messages: the chat template writes "
                               "the special tokens (as /v1/chat/completions runs them); send false or leave it out",
                               param="add_special_tokens")
            ids = engine.chat_prompt_ids(fields["messages"], generation_prompt)
    except RequestError as error:
        raise ApiError(_in_json_words(str(error)), param="messages" if "messages" in fields else "prompt") from None
    answer = {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "token_strs": None}
    if flag(fields, "return_token_strs"):
        answer["token_strs"] = [engine.tokenizer.tokenizer.id_to_token(token) for token in ids]
    return answer


def detokenize(engine, body, model_name: str) -> dict:
    """The text of token ids, special tokens spelled out (transformers' decode, as vLLM's route answers)."""
    tokens = request_fields(body, DETOKENIZE_FIELDS, model_name).get("tokens")
    vocab = engine.manifest["model"]["config"]["vocab_size"]
    if not isinstance(tokens, list) or not all(is_integer(token) for token in tokens):
        raise ApiError("tokens: required, a list of token ids", param="tokens")
    outside = engine._outside_vocabulary(tokens)
    if outside is not None:
        raise ApiError(f"tokens: {outside} is outside this model's vocabulary (0..{vocab - 1})", param="tokens")
    return {"prompt": engine.tokenizer.tokenizer.decode(tokens, skip_special_tokens=False)}


def tokenizer_info(engine) -> dict:
    info = engine.manifest["tokenizer"]
    return {"pad_token": None, **engine.special_token_texts(), "bos_token_id": info.get("bos_token_id"),
            "eos_token_ids": list(info.get("eos_token_ids") or []), "chat_template": engine.chat_template,
            "model_max_length": engine.max_context, "vocab_size": engine.manifest["model"]["config"]["vocab_size"]}
