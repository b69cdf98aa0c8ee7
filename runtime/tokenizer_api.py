"""vLLM's tokenizer routes over the engine's tokenizer, so that a client without the model's own tokenizer can count
and split text as the server does: lm-evaluation-harness' `local-completions` finds them and tokenizes through them
(its remote tokenizer), which lets it score an artifact with no download.

    POST /tokenize        {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}
    POST /detokenize      {"tokens": [ids]} -> {"prompt": text}
    GET  /tokenizer_info  the special tokens' texts and ids, the chat template, the max context

Bodies are checked as runtime/openai_api.py checks the API's: ApiError names the field.
"""
from __future__ import annotations

import difflib

from runtime.errors import RequestError
from runtime.openai_api import ApiError, flat_messages
from runtime.sampling import is_integer

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def tokenize(engine, body, model_name: str) -> dict:
    """A text's token ids as /v1/completions would run them (add_special_tokens, default true: the tokenizer's BOS),
    or chat messages' as /v1/chat/completions renders them (the template writes its special tokens)."""
    fields = _fields(body, TOKENIZE_FIELDS, model_name)
    special = _flag(fields, "add_special_tokens", True)
    if ("prompt" in fields) == ("messages" in fields):
        raise ApiError("give a prompt (a string) or messages (chat), one of them", param="prompt")
    try:
        if "prompt" in fields:
            if not isinstance(fields["prompt"], str):
                raise ApiError(f"prompt: must be a string, got {type(fields['prompt']).__name__}", param="prompt")
            ids = engine.tokenizer.encode(fields["prompt"], add_special_tokens=special)
        else:
            if not isinstance(fields["messages"], list) or not fields["messages"]:
                raise ApiError("messages: a non-empty list of {role, content} objects", param="messages")
            generation_prompt = _flag(fields, "add_generation_prompt", True)
            ids = engine.chat_prompt_ids(flat_messages(fields["messages"]), generation_prompt)
    except RequestError as error:
        raise ApiError(str(error), param="messages" if "messages" in fields else "prompt") from None
    answer = {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "token_strs": None}
    if _flag(fields, "return_token_strs", False):
        answer["token_strs"] = [engine.tokenizer.tokenizer.id_to_token(token) for token in ids]
    return answer


def detokenize(engine, body, model_name: str) -> dict:
    """The text of token ids, special tokens spelled out (transformers' decode, as vLLM's route answers)."""
    tokens = _fields(body, DETOKENIZE_FIELDS, model_name).get("tokens")
    vocab = engine.manifest["model"]["config"]["vocab_size"]
    if not isinstance(tokens, list) or not all(is_integer(token) for token in tokens):
        raise ApiError("tokens: required, a list of token ids", param="tokens")
    outside = next((token for token in tokens if not 0 <= token < vocab), None)
    if outside is not None:
        raise ApiError(f"tokens: {outside} is outside this model's vocabulary (0..{vocab - 1})", param="tokens")
    return {"prompt": engine.tokenizer.tokenizer.decode(tokens, skip_special_tokens=False)}


def tokenizer_info(engine) -> dict:
    info = engine.manifest["tokenizer"]
    return {**engine.special_token_texts(), "pad_token": None, "bos_token_id": info.get("bos_token_id"),
            "eos_token_ids": list(info.get("eos_token_ids") or []), "chat_template": engine.chat_template,
            "model_max_length": engine.max_context, "vocab_size": engine.manifest["model"]["config"]["vocab_size"]}


def _fields(body, known: set[str], model_name: str) -> dict:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    fields = {name: value for name, value in body.items() if value is not None}
    for name in fields:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise ApiError(f"unrecognized request field {name!r}{f'; did you mean {close[0]}?' if close else ''}",
                           param=name)
    if not isinstance(fields.get("model", ""), str):
        raise ApiError(f"model: {fields['model']!r} must be a string (the name /v1/models lists)", param="model")
    if fields.get("model", model_name) != model_name:
        raise ApiError(f"the model {fields['model']!r} does not exist; this server serves {model_name!r}", status=404,
                       kind="not_found_error", param="model")
    return fields


def _flag(fields: dict, name: str, default: bool) -> bool:
    value = fields.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(f"{name}: {value!r} must be true or false", param=name)
    return value
