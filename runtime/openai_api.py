"""OpenAI's completions and chat-completions API over the engine: request bodies checked and turned into prompts and
SamplingParams, results turned into response bodies and streamed chunks. Plain dicts in and out; runtime/server.py
carries them over HTTP.

The fields are OpenAI's, plus vLLM's sampling extras (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
min_tokens).
A field the request leaves out takes the model's own default where it ships one (Engine.sampling_defaults, from
generation_config.json or a GGUF's hints; its max_new_tokens as max_tokens, capped to the room left). Else, where
OpenAI's API and the engine's defaults differ, the API's meaning holds:
- temperature defaults to 1 (the engine's own default is greedy); max_tokens to 16 for completions (or what the
  context leaves after the prompt, when less), and to what the context leaves for chat;
- n samples of a prompt are n requests, seeded seed, seed + 1, ... when a seed is given (with prefix caching the
  shared prompt is prefilled once); any integer from -2**63 to 2**64 - 1 is a seed (a negative one is taken modulo
  2**64; vLLM takes int64);
- finish_reason is "stop" or "length"; a reply the max context cut short is "length" too.
A field the server cannot honour (tools, a non-text response_format, best_of above 1, suffix) is refused with a
400 that names it, never silently ignored; so is a field it does not know.
Logprobs cover every completion token usage counts, a final stop token included (vLLM's); with echo, the prompt's
tokens first (the first one's null: nothing predicts it). Completions' top_logprobs hold the N likeliest and the
chosen token (OpenAI's "up to logprobs+1 elements"); chat's hold exactly N. Completions' echo with max_tokens 0
(OpenAI's legacy scoring request) answers the prompt and its logprobs alone.
Every response also carries "timings": per choice, the request's server-side timings (Timings.summary(): queue,
TTFT, prefill, TPOT, E2E in ms, cached prompt tokens). It is not in OpenAI's schema; its clients ignore it.
"""
from __future__ import annotations

import difflib
import json
import re
import time
import uuid
from dataclasses import dataclass, field as dataclass_field, replace

from runtime.errors import RequestError
from runtime.request_handle import LoggedPiece
from runtime.results import GenerationResult
from runtime.sampling import MAX_HINTED_NAME, MAX_LOGPROBS, SamplingParams, is_integer

MAX_CHOICES = 128  # n times the prompts of one request: each is a scheduler request
# The API's sampling fields that map one to one onto SamplingParams (the API name -> the engine's).
SAMPLING_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "seed": "seed", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
    "min_tokens": "min_new_tokens",
}
COMMON_FIELDS = {"model", "max_tokens", "n", "stream", "stream_options", "stop", "user", *SAMPLING_FIELDS}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "logprobs"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                               "add_generation_prompt"}  # vLLM's: false ends the prompt with the last message
NOT_SUPPORTED = {  # field -> why it is refused, said after "{field}: "
    "tools": "tool calls are not supported by this server",
    "tool_choice": "tool calls are not supported by this server",
    "functions": "function calls are not supported by this server",
    "function_call": "function calls are not supported by this server",
    "parallel_tool_calls": "tool calls are not supported by this server",
    "best_of": "above 1 is not supported by this server; ask for n choices and keep the best yourself",
    "suffix": "insertion (suffix) is not supported by this server",
}
# OpenAI's own chat fields (its client's chat.completions.create arguments) that this server has nothing for: refused
# as such, never taken for a typo of a field it has (difflib would offer store -> stream, reasoning_effort ->
# response_format, web_search_options -> stream_options).
OPENAI_ONLY = ("store", "metadata", "service_tier", "reasoning_effort", "modalities", "audio", "prediction",
               "web_search_options", "verbosity", "prompt_cache_key", "prompt_cache_retention", "safety_identifier")
NOT_SUPPORTED.update({name: "OpenAI's field is not supported by this server" for name in OPENAI_ONLY},
                     store="this server keeps no responses: send store false, or leave it out")
# vLLM's extensions beyond the sampling ones this server takes: refused as such, never taken for a typo of a field it
# has (difflib offered return_tokens_as_token_ids -> stop_token_ids, truncate_prompt_tokens -> max_completion_tokens).
VLLM_ONLY = ("return_tokens_as_token_ids", "truncate_prompt_tokens", "prompt_logprobs", "length_penalty",
             "use_beam_search", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
             "add_special_tokens", "allowed_token_ids", "bad_words", "guided_json", "guided_regex", "guided_choice",
             "guided_grammar", "structured_outputs", "chat_template", "chat_template_kwargs", "documents",
             "continue_final_message", "priority", "request_id", "logits_processors", "kv_transfer_params")
NOT_SUPPORTED.update({name: "vLLM's field is not supported by this server" for name in VLLM_ONLY})
# Values of refused fields that ask for what the server does anyway (store=False: it keeps nothing; tool_choice
# "none" and parallel_tool_calls false: no tool calls; the text leaves special tokens out and ends before a stop
# string).
HARMLESS = {"best_of": 1, "store": False, "tool_choice": "none", "parallel_tool_calls": False,
            "include_stop_str_in_output": False, "skip_special_tokens": True}
# Fields of one endpoint sent to the other, and the field meant there: difflib ties max_completion_tokens with
# max_tokens and min_tokens (the opposite), and picks min_tokens.
SAME_FIELD = {"max_completion_tokens": "max_tokens"}
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_ERROR_MESSAGE = 2000  # characters: a message quoting what a client sent (a 15 MB message) says its start


class ApiError(Exception):
    """A request the API refuses: its HTTP status and OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", param: str | None = None):
        if len(message) > MAX_ERROR_MESSAGE:  # a 15 MB value quoted back made a 30 MB answer and a 30 MB log line
            message = f"{message[:MAX_ERROR_MESSAGE]}... ({len(message):,} characters in all)"
        if param is not None and len(param) > MAX_HINTED_NAME:
            param = param[:MAX_HINTED_NAME] + "..."
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class Choice:
    """One request the scheduler runs for an API request: the index-th choice of the response."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class ParsedRequest:
    chat: bool
    choices: list[Choice]  # n per prompt: choice i samples prompt i // n
    prompts: list[list[int]]
    prompt_texts: list[str]  # per prompt, for echo
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    echo: bool = False
    logprobs: int | None = None  # alternatives per token in the response, None = no logprobs
    # Completions' echo with max_tokens 0: the prompt (and its logprobs) alone. The scheduler runs one token to score
    # the prompt; the answer leaves it out (as_requested).
    echo_only: bool = False
    # When the request was taken (seconds since the epoch): the responses' `created`, streamed or not (vLLM's
    # created_time; a response built after a long generation had said when it ended)
    created: int = dataclass_field(default_factory=lambda: int(time.time()))


STREAM_OPTIONS = {"include_usage", "include_obfuscation"}


def parse(engine, body: dict, *, chat: bool, model_name: str) -> ParsedRequest:
    """Check a request body (a JSON object) and turn it into the scheduler requests it asks for; ApiError says what is
    wrong, naming the field as the API spells it."""
    fields = request_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, model_name, NOT_SUPPORTED)
    stream = flag(fields, "stream")
    options = fields.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - STREAM_OPTIONS):
        raise ApiError(f"stream_options: {_json(options)} must be an object with include_usage (and include_obfuscation)",
                       param="stream_options")
    if options is not None and not stream:
        raise ApiError("stream_options: only with stream: true", param="stream_options")
    include_usage = flag(options or {}, "include_usage", "stream_options.include_usage")
    # OpenAI pads its chunks with random text against side channels unless this is false; this server never pads
    if flag(options or {}, "include_obfuscation", "stream_options.include_obfuscation", default=False):
        raise ApiError("stream_options.include_obfuscation: true is not supported: this server does not pad its "
                       "chunks; send false or leave it out", param="stream_options.include_obfuscation")
    logprobs = _chat_logprobs(fields) if chat else _completion_logprobs(fields)
    echo = flag(fields, "echo")
    echo_only = echo and not chat and is_integer(fields.get("max_tokens")) and fields["max_tokens"] == 0
    if echo_only and fields.get("min_tokens", 0) != 0:  # said here: below it reads max_tokens as the 1 run to score
        raise ApiError(f"min_tokens: {_json(fields['min_tokens'])} with echo and max_tokens 0, which generate nothing; "
                       f"leave min_tokens out", param="min_tokens")
    if echo_only:
        fields = {**fields, "max_tokens": 1}
    # The prompt last: rendering and tokenizing cost more than the checks above.
    if chat:
        prompts = [_chat_prompt(engine, fields)]
        texts = [""]
    else:
        prompts, texts = _completion_prompts(engine, fields)
    n = fields.get("n", 1)
    if not is_integer(n) or not 1 <= n <= MAX_CHOICES // len(prompts):
        raise ApiError(f"n: {_json(n)} must be an integer in 1..{MAX_CHOICES // len(prompts)} (at most {MAX_CHOICES} "
                       f"choices per request)", param="n")
    choices = []
    for prompt_index, prompt_ids in enumerate(prompts):
        params = _sampling(engine, fields, prompt_ids, chat, logprobs, echo,
                           f"prompt[{prompt_index}]" if len(prompts) > 1 else "the prompt")
        for sample in range(n):
            seeded = params if params.seed is None else replace(params, seed=params.seed + sample)
            choices.append(Choice(prompt_index * n + sample, prompt_ids, seeded))
    return ParsedRequest(chat, choices, prompts, texts, n, stream, include_usage, echo, logprobs, echo_only)


def request_fields(body, known: set[str], model_name: str, refused: dict[str, str] | None = None) -> dict:
    """A body's fields, null ones left out (not given, as in OpenAI's), after refusing what is not an object, a
    field the server refuses (`refused`: field -> why), one it does not know, and another model's name."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    refused = refused or {}
    fields = {name: value for name, value in body.items() if value is not None}
    for name in fields:
        if name in refused and not _harmless(name, fields[name]):
            raise ApiError(f"{name}: {refused[name]}", param=name)
        if name not in known and name not in refused:
            close = _meant(name, known)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ApiError(f"unrecognized request field {name!r}{hint}", param=name)
    model = fields.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(f"model: {_json(model)} must be a string (the name /v1/models lists)", param="model")
    if model is not None and model != model_name:
        raise unknown_model(model, model_name)
    return fields


def unknown_model(name: str, served: str) -> ApiError:
    """A request for a model this server does not serve (a field, or GET /v1/models/{model}): OpenAI's 404."""
    return ApiError(f"the model {name!r} does not exist; this server serves {served!r}", status=404,
                    kind="not_found_error", param="model")


def _harmless(name: str, value) -> bool:
    """A refused field's value asks for what the server does anyway: a number equal to HARMLESS' (JSON does not tell
    1 from 1.0), or the same true/false or string."""
    if name not in HARMLESS:
        return False
    harmless = HARMLESS[name]
    if isinstance(harmless, bool) or isinstance(value, bool):
        return value is harmless
    if isinstance(harmless, int):
        return isinstance(value, (int, float)) and value == harmless
    return value == harmless


def _meant(name: str, known: set[str]) -> list[str]:
    """The known field an unknown one was likely meant as: SAME_FIELD's (also for a near spelling of it), else a close
    spelling (difflib's; vLLM's own fields never get here: NOT_SUPPORTED names them)."""
    if len(name) > MAX_HINTED_NAME:  # difflib's time grows with the name's length squared (a 15 MB name took 3 s)
        return []
    for other, meant in SAME_FIELD.items():
        near = name == other or difflib.get_close_matches(name, [other], n=1, cutoff=0.9)
        if meant in known and other not in known and near:
            return [meant]
    return difflib.get_close_matches(name, sorted(known), n=1)


def flag(fields: dict, name: str, shown: str | None = None, default: bool = False) -> bool:
    """A true/false field (absent: default); shown: its name in the message, when nested."""
    value = fields.get(name)
    if value is None:  # absent, or null (a nested object's nulls are still in it)
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{shown or name}: {_json(value)} must be true or false", param=shown or name)
    return value


def _completion_prompts(engine, fields: dict) -> tuple[list[list[int]], list[str]]:
    """OpenAI's prompt: a string, a list of token ids, or a list of either (one choice each)."""
    prompt = fields.get("prompt")
    if prompt is None:
        raise ApiError("prompt: required (a string, a list of token ids, or a list of those)", param="prompt")
    one = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_integer(t) for t in prompt))
    prompts = [prompt] if one else prompt
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, str) or (isinstance(p, list) and all(is_integer(t) for t in p)) for p in prompts):
        raise ApiError("prompt: must be a string, a list of token ids, or a non-empty list of those", param="prompt")
    if len(prompts) > MAX_CHOICES:
        raise ApiError(f"prompt: {len(prompts)} prompts, at most {MAX_CHOICES} per request", param="prompt")
    ids = [_checked(lambda p=p: engine.prompt_ids(p), "prompt", f"prompt[{index}]: " if not one else "")
           for index, p in enumerate(prompts)]
    texts = [p if isinstance(p, str) else engine.tokenizer.decode(i) for p, i in zip(prompts, ids)]
    return ids, texts


def _chat_prompt(engine, fields: dict) -> list[int]:
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages: required, a non-empty list of {role, content} objects", param="messages")
    fmt = fields.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(f"response_format: {_json(fmt)}: only {{\"type\": \"text\"}} is supported by this server",
                       param="response_format")
    add_generation_prompt = flag(fields, "add_generation_prompt", default=True)
    # content given as OpenAI's text parts: the chat template's renderer passes or joins them (runtime/chat.py)
    return _checked(lambda: engine.chat_prompt_ids(messages, add_generation_prompt), "messages")


def _completion_logprobs(fields: dict) -> int | None:
    value = fields.get("logprobs")
    if value is not None and (not is_integer(value) or not 0 <= value <= MAX_LOGPROBS):
        raise ApiError(f"logprobs: {_json(value)} must be an integer in 0..{MAX_LOGPROBS}", param="logprobs")
    return value


def _chat_logprobs(fields: dict) -> int | None:
    wanted = flag(fields, "logprobs")
    top = fields.get("top_logprobs")
    if top is not None and (not is_integer(top) or not 0 <= top <= MAX_LOGPROBS):
        raise ApiError(f"top_logprobs: {_json(top)} must be an integer in 0..{MAX_LOGPROBS}", param="top_logprobs")
    if top is not None and not wanted:
        raise ApiError("top_logprobs: only with logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def _sampling(engine, fields: dict, prompt_ids: list[int], chat: bool, logprobs: int | None,
              echo: bool, prompt_name: str = "the prompt") -> SamplingParams:
    """prompt_name: which prompt the context messages name (one of a list: "prompt[2]")."""
    options = {engine_name: fields[name] for name, engine_name in SAMPLING_FIELDS.items() if name in fields}
    for name, value in getattr(engine, "sampling_defaults", {}).items():  # the model's own, for what the request
        options.setdefault(name, value)  # leaves out (vLLM's --generation-config auto)
    model = getattr(engine, "generation_defaults", {})  # its max_new_tokens: below, capped to the room left
    options.setdefault("temperature", 1.0)  # OpenAI's default; the engine's is greedy
    seed = options.get("seed")
    if seed is not None and not (is_integer(seed) and -2 ** 63 <= seed < 2 ** 64):  # int64 as vLLM's, or uint64
        raise ApiError(f"seed: {json.dumps(seed)[:40]} must be an integer from -2**63 to 2**64 - 1, or null", param="seed")
    if seed is not None and seed < 0:  # any integer is a seed to OpenAI (clients send -1); numpy's take >= 0
        options["seed"] = seed % 2 ** 64
    if options.get("top_k") == -1:  # vLLM's "no limit"
        options["top_k"] = 0
    elif is_integer(options.get("top_k")) and options["top_k"] < -1:  # the engine's message would not name -1
        raise ApiError(f"top_k: {options['top_k']} must be -1 or an integer >= 0 (0 or -1 = no limit)", param="top_k")
    if "stop" in fields:
        options["stop_strings"] = fields["stop"]
    if chat and "max_tokens" in fields and "max_completion_tokens" in fields:
        raise ApiError("give max_completion_tokens or max_tokens, not both", param="max_tokens")
    max_name = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"  # as the client sent it
    max_tokens = fields.get(max_name)
    room = engine.max_context + 1 - len(prompt_ids)  # the last token is never fed back
    if room < 1:  # the prompt does not fit, whatever max_tokens asks for: no max_tokens would fix it
        prompt_field = "messages" if chat else "prompt"
        raise ApiError(f"{prompt_field}: {prompt_name} has {len(prompt_ids)} tokens and this model's context is "
                       f"{engine.max_context}: no token can follow it; shorten it", param=prompt_field)
    if max_tokens is None:
        # the model's max_new_tokens; else chat: what the context leaves; completions: OpenAI's 16; never more than
        # what the context leaves
        max_tokens = min(model.get("max_new_tokens") or (room if chat else COMPLETION_MAX_TOKENS), room)
    options["max_new_tokens"] = max_tokens
    options["logprobs"] = logprobs
    if echo and logprobs is not None:  # the prompt's logprobs too, as lm-evaluation-harness scores a continuation
        options["prompt_logprobs"] = logprobs
    try:
        params = SamplingParams(**options)
    except RequestError as error:
        asked = options.get("min_new_tokens")
        if str(error).startswith("min_new_tokens:") and max_name not in fields and is_integer(asked) and \
                asked > max_tokens:  # past a limit the client never set
            default = ("the model's max_new_tokens, or what the context leaves when less" if model.get(
                "max_new_tokens") else f"what the context leaves after the prompt's {len(prompt_ids)} tokens" if chat
                       else f"OpenAI's {COMPLETION_MAX_TOKENS}, or what the context leaves when less")
            error = RequestError(f"{error} (no {max_name} was given: its default here is {max_tokens}, {default})")
        raise _api_error(error, chat, max_name=max_name) from None
    if params.max_new_tokens > room:
        raise ApiError(f"{max_name}: {prompt_name} has {len(prompt_ids)} tokens and this model's context is "
                       f"{engine.max_context}: at most {room} tokens can follow it, {params.max_new_tokens} "
                       f"were asked for", param=max_name)
    try:  # what submit would refuse (stop ids or logit_bias outside the vocabulary...), before any choice runs
        engine._check_request(prompt_ids, params)
    except RequestError as error:
        if str(error).startswith("the prompt ") and prompt_name != "the prompt":  # which of a list of prompts
            error = RequestError(f"{prompt_name}: {error}")
        raise _api_error(error, chat, default="messages" if chat else "prompt", max_name=max_name) from None
    return params


# The engine's names in its messages -> the API's. max_new_tokens is max_tokens or max_completion_tokens: the one the
# client sent (_api_error's max_name).
ENGINE_NAMES = {"stop_strings": "stop", "min_new_tokens": "min_tokens"}


def _api_error(error: RequestError, chat: bool, default: str | None = None,
               max_name: str = "max_tokens") -> ApiError:
    """The engine's message ("max_new_tokens: 0 must be ...") with the field named as the API names it."""
    message = str(error)
    field = message.split(":", 1)[0]
    if field == "logprobs" and chat:
        field = "top_logprobs"
    field = max_name if field == "max_new_tokens" else ENGINE_NAMES.get(field, field)
    if ":" in message and field != message.split(":", 1)[0]:
        message = field + ":" + message.split(":", 1)[1]
    return ApiError(_in_json_words(message), param=field if field in COMPLETION_FIELDS | CHAT_FIELDS else default)


def _json(value) -> str:
    """A value of the request as its JSON spells it (true, null, {"type": ...}), not as Python's repr does; a long one
    cut, and said to be."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text):,} characters)"


JSON_WORDS = {"True": "true", "False": "false", "None": "null"}


def _in_json_words(message: str) -> str:
    """An engine message in the words of the client's JSON: the engine's own phrases ("must be True or False",
    "ignore_eos=True") and a bare value right after the field ("logprobs: True must be ...", a JSON boolean the
    engine printed as Python); never the text of a quoted value (a model name "x=True" stays as sent)."""
    message = message.replace(" must be True or False", " must be true or false")
    message = message.replace("ignore_eos=True", "ignore_eos: true")
    return re.sub(r"^([\w\[\]']+): (True|False|None)\b", lambda m: f"{m[1]}: {JSON_WORDS[m[2]]}", message)


def _checked(call, param: str | None, which: str = ""):
    """call(), a RequestError as the API's 400 (`which`: the element of a list it is about, as its message's start)."""
    try:
        return call()
    except RequestError as error:
        raise ApiError(f"{which}{_in_json_words(str(error))}", param=param) from None


# -- responses -----------------------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def finish_reason(result: GenerationResult) -> str:
    return "stop" if result.finish_reason == "stop" else "length"  # "max_context": the context cut it short


def stop_reason(engine, params: SamplingParams, result: GenerationResult) -> str | int | None:
    """vLLM's stop_reason beside finish_reason: the stop string that ended the text, or the id of a stop_token_ids
    token that ended it; None where an end-of-sequence token did (vLLM checks those first), or no stop."""
    if result.stop_string is not None:
        return result.stop_string
    token = result.stop_token_id
    end_of_sequence = token in engine.eos_token_ids and not params.ignore_eos
    return token if token is not None and token in params.stop_token_ids and not end_of_sequence else None


def usage(request: ParsedRequest, results: list[GenerationResult]) -> dict:
    """Prompt tokens count once per prompt (as OpenAI's n does); completion tokens are every token the model produced,
    a final stop token included (the engine's output_tokens, vLLM's count)."""
    completion = 0 if request.echo_only else sum(r.timings.output_tokens if r.timings else 0 for r in results)
    cached = sum(r.timings.cached_prompt_tokens for r in results[::request.n] if r.timings)
    prompt_tokens = sum(map(len, request.prompts))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def timings(result: GenerationResult) -> dict | None:
    return None if result.timings is None else {k: round(v, 3) if isinstance(v, float) else v
                                                for k, v in result.timings.summary().items()}


def response(engine, request: ParsedRequest, request_id: str, model_name: str,
             results: list[GenerationResult]) -> dict:
    """The whole (not streamed) response body; results in choice order. An echo's logprobs begin with the prompt's
    (its results' prompt_logprobs), as OpenAI's and vLLM's do."""
    choices = []
    for choice, result in zip(request.choices, results):
        result = as_requested(request, result)
        logprobs = None
        if request.logprobs is not None:
            token_ids, entries = _scored_output(result)
            echo = None
            if request.echo:
                token_ids, entries = result.prompt_token_ids + token_ids, result.prompt_logprobs + entries
                echo = (request.prompt_texts[choice.index // request.n], len(result.prompt_token_ids))
            output_end = len(token_ids) - 1 - (result.stop_token_id is not None)
            logprobs = logprobs_body(engine, request, token_ids, entries, echo=echo, output_end=output_end)
        ended = {"finish_reason": finish_reason(result), "stop_reason": stop_reason(engine, choice.params, result)}
        if request.chat:
            entry = {"index": choice.index, "message": {"role": "assistant", "content": result.text},
                     "logprobs": logprobs, **ended}
        else:
            prefix = request.prompt_texts[choice.index // request.n] if request.echo else ""
            entry = {"index": choice.index, "text": prefix + result.text, "logprobs": logprobs, **ended}
        choices.append(entry)
    return {"id": request_id, "object": "chat.completion" if request.chat else "text_completion",
            "created": request.created, "model": model_name, "choices": choices,
            "usage": usage(request, results), "timings": [timings(result) for result in results]}


def as_requested(request: ParsedRequest, result: GenerationResult) -> GenerationResult:
    """The result as the request asked for it: an echo-only one's without the token run to score the prompt (no text,
    tokens or stop token; finish_reason "length", as OpenAI's for max_tokens 0)."""
    if not request.echo_only:
        return result
    return replace(result, text="", token_ids=[], logprobs=None if result.logprobs is None else [],
                   finish_reason="length", stop_token_id=None, stop_token_logprobs=None)


def _scored_output(result: GenerationResult) -> tuple[list[int], list[dict]]:
    """The output tokens whose logprobs the API reports, with their entries: token_ids, then the stop token that
    ended the request if one did (vLLM's output ids and logprobs hold it; usage counts it), so that an echo's
    entries are the prompt's and each completion token's (lm-evaluation-harness drops the last)."""
    if result.stop_token_id is None:
        return list(result.token_ids), list(result.logprobs)
    return [*result.token_ids, result.stop_token_id], [*result.logprobs, result.stop_token_logprobs]


def chunk(request: ParsedRequest, request_id: str, model_name: str, created: int, index: int, text: str | None,
          result: GenerationResult | None = None, first: bool = False, logprobs: dict | None = None,
          stopped_by: str | int | None = None) -> dict:
    """One streamed chunk of choice `index`: its next text piece, or (result given) its end, with stopped_by as its
    stop_reason (stop_reason()); logprobs: its tokens' (logprobs_body). A chat choice's first chunk also carries the
    role; the server sends it with the first piece, not before (a client times its first token at the first chunk,
    as vLLM's benchmark does)."""
    end = result is not None
    ended = {"finish_reason": finish_reason(result) if end else None, "stop_reason": stopped_by}
    if request.chat:
        delta = {} if end and not first else {"content": text or ""}
        entry = {"index": index, "delta": {"role": "assistant", **delta} if first else delta, "logprobs": logprobs,
                 **ended}
    else:
        entry = {"index": index, "text": text or "", "logprobs": logprobs, **ended}
    body = {"id": request_id, "object": "chat.completion.chunk" if request.chat else "text_completion",
            "created": created, "model": model_name, "choices": [entry]}
    if request.include_usage:  # OpenAI: every chunk but the last, which carries the usage, has it as null
        body["usage"] = None
    if end:
        body["timings"] = timings(result)
    return body


class StreamLogprobs:
    """One streamed choice's logprobs, chunk by chunk: each piece's tokens (a LoggedPiece's), then at its end those
    of the result beyond them (the last steps', when they released no text, and the stop token). Joined, they are
    the whole response's logprobs. A chunk with no tokens has none (null). With echo, the first chunk, which
    carries the prompt's text, begins with the prompt's tokens (the handle's prompt_logprobs)."""

    def __init__(self, engine, request: ParsedRequest, handle, echo_text: str = ""):
        self.engine, self.request, self.handle, self.echo_text = engine, request, handle, echo_text
        self.token_ids: list[int] = []  # the tokens sent so far (an echo's prompt first): context for the next ones'
        self.sent = 0  # output tokens whose entries went out
        self.echo_pending = request.echo  # the prompt's tokens are still to go out, with the first chunk
        self.text_offset = 0  # where the next token's text begins in the choice's text
        self.output_end: int | None = None  # the output's last token's index in token_ids, once it has ended

    def of_piece(self, piece: str) -> dict | None:
        if self.request.logprobs is None:
            return None
        logged = isinstance(piece, LoggedPiece)
        return self._body(piece.token_ids if logged else [], piece.logprobs if logged else [],
                          self.handle.prompt_logprobs, ends_output=logged and piece.final)

    def of_end(self, result: GenerationResult) -> dict | None:
        if self.request.logprobs is None:
            return None
        token_ids, entries = _scored_output(result)
        return self._body(token_ids[self.sent:], entries[self.sent:], result.prompt_logprobs,
                          ends_output=result.stop_token_id is None, stop_token=result.stop_token_id is not None)

    def _body(self, token_ids, entries, prompt_entries, ends_output: bool = False, stop_token: bool = False,
              ) -> dict | None:
        """ends_output: the output's last token is token_ids' last, or the one before a stop_token that ends them."""
        self.sent += len(token_ids)
        echo = None
        if self.echo_pending:
            self.echo_pending = False
            echo = (self.echo_text, len(self.handle.prompt_token_ids))
            token_ids, entries = [*self.handle.prompt_token_ids, *token_ids], [*prompt_entries, *entries]
        if not token_ids:
            return None
        start = len(self.token_ids)
        self.token_ids.extend(token_ids)
        if ends_output or stop_token:  # a stop token's output ended just before it, in this chunk or an earlier one
            self.output_end = len(self.token_ids) - 1 - stop_token
        body = logprobs_body(self.engine, self.request, self.token_ids, entries, start, self.text_offset, echo,
                             self.output_end)
        # A chunk ends with an output token (the first one too: it goes out with the first piece, or at the end
        # with the stop token), so the echo does not bear on the next offset.
        if not self.request.chat and body["tokens"]:
            self.text_offset = body["text_offset"][-1] + _width(self.engine, token_ids[-1], body["tokens"][-1])
        return body


def usage_chunk(request: ParsedRequest, request_id: str, model_name: str, created: int,
                results: list[GenerationResult]) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk" if request.chat else "text_completion",
            "created": created, "model": model_name, "choices": [], "usage": usage(request, results)}


CONTEXT_TOKENS = 4  # the tokens before one that decoding it in context reads
MAX_CHARACTER_TOKENS = 4  # a UTF-8 character has at most 4 bytes: at most this many tokens spell parts of it


def _token_texts(engine, token_ids: list[int], start: int = 0, output_end: int | None = None) -> list[str]:
    """The texts of token_ids[start:] as they read in the output: each decoded after the tokens before it, so that a
    tokenizer that drops a word's leading space when it decodes a token alone (SentencePiece's) keeps it, and the
    texts join to the output's. A token that ends inside a UTF-8 character has the text it completes, or "" until
    then; but the output's last token (at output_end, once the output has ended) has the U+FFFD its text ends with
    there, and a stop token after it only its own text."""
    decode = lambda ids: engine.tokenizer.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    texts = []
    for position in range(start, len(token_ids)):
        before, prefix = _context(decode, token_ids, position)
        whole = decode(before + [token_ids[position]])
        if output_end is None or position <= output_end:  # a character cut short may yet be completed
            prefix = prefix.rstrip("\ufffd")
        text = whole[len(prefix):] if whole.startswith(prefix) else whole
        texts.append(text if position == output_end else text.rstrip("\ufffd"))
    return texts


def _context(decode, token_ids: list[int], position: int) -> tuple[list[int], str]:
    """The tokens token_ids[position]'s text is read after, and their text: the CONTEXT_TOKENS before it, and more
    (up to a character's bytes) while they begin inside a character. Its cut bytes decode to U+FFFD, and a context
    that reads only U+FFFD after them (a character still incomplete before the token) would lose them with that
    character's U+FFFD, putting them into the token's text ("\ufffd🏼" after "👌" in one-byte tokens)."""
    context_start = max(0, position - CONTEXT_TOKENS)
    while True:
        before = token_ids[context_start:position]
        text = decode(before)
        if (context_start == 0 or not text.startswith("\ufffd")
                or len(before) >= CONTEXT_TOKENS + MAX_CHARACTER_TOKENS - 1):
            return before, text
        context_start -= 1


def _token_text(engine, token: int) -> str:
    """An alternative token's text, decoded alone (it was not output: it has no context)."""
    return engine.tokenizer.tokenizer.decode([token], skip_special_tokens=False)


def _by_text(engine, ranked: list[tuple[int, float]], chosen: int, chosen_text: str) -> dict[str, float]:
    """Completions' top_logprobs map text -> logprob, most likely first. The chosen token is keyed by its text as
    `tokens` shows it (in context: a token that ends a character spelled by several reads as that character, where
    alone it decodes to "\ufffd", so top_logprobs[i][tokens[i]] had raised KeyError), the alternatives by their text
    decoded alone. Tokens with the same text (byte tokens that each begin a character: all "\ufffd") share one
    key, which keeps the likeliest one's logprob; a later, less likely one had overwritten it."""
    texts: dict[str, float] = {}
    for token, logprob in ranked:
        texts.setdefault(chosen_text if token == chosen else _token_text(engine, token), logprob)
    return texts


def _width(engine, token: int, text: str, shown: str | None = None, offset: int = 0) -> int:
    """How far a token moves text_offset: the length of its text, or 0 for a special token (BOS, say), whose text
    the choice's text leaves out (an output, an echo of ids: decoded without special tokens), so that each offset
    points into the choice's text. shown: an echoed prompt's text, where a prompt string may spell a special
    token ("</s>"): there it keeps its width."""
    if token not in engine.tokenizer.special_ids or (shown is not None and shown.startswith(text, offset)):
        return len(text)
    return 0


def _top(entry: dict[int, float], count: int) -> list[tuple[int, float]]:
    """The `count` likeliest of a result's logprobs entry (the chosen token first, then the likeliest): chat's
    top_logprobs, which hold the chosen token only where it is among them."""
    return sorted(entry.items(), key=lambda item: -item[1])[:count]


def _top_and_chosen(entry: dict[int, float], count: int, chosen: int) -> list[tuple[int, float]]:
    """Completions' top_logprobs: the `count` likeliest, and the chosen token after them where it is not among them
    (OpenAI's "the logprob of the sampled token, so there may be up to logprobs+1 elements"; vLLM's too)."""
    top = _top(entry, count)
    return top if any(token == chosen for token, _ in top) else [*top, (chosen, entry[chosen])]


LOGPROB_FLOOR = -9999.0  # what the API says for a log-probability of -inf (vLLM's serving code clamps to it)


def logprobs_body(engine, request: ParsedRequest, token_ids: list[int], entries, start: int = 0,
                  text_offset: int = 0, echo: tuple[str, int] | None = None, output_end: int | None = None) -> dict:
    """The logprobs of output tokens token_ids[start:] (entries: theirs, in order) in the request's format: chat's
    content list, or completions' parallel lists. The tokens before start read as context for their texts (a
    stream's earlier chunks); text_offset: where the first one's text begins in the choice's text. echo: (the
    prompt's text as echoed, how many of token_ids, from the first, are the prompt's). output_end: the index of the
    output's last token once it has ended (a stop token may follow it)."""
    count = request.logprobs
    # a masked token's -inf is no JSON number (json.dumps writes -Infinity, which strict parsers refuse): vLLM's floor
    entries = [None if entry is None else {token: max(value, LOGPROB_FLOOR) for token, value in entry.items()}
               for entry in entries]
    texts = _token_texts(engine, token_ids, start, output_end)
    chosen = token_ids[start:]
    if request.chat:
        def described(token: int, text: str, logprob: float) -> dict:
            # bytes: the token's own (OpenAI's "to combine across tokens"), where its text is "" or U+FFFD for a
            # character it spells only part of
            return {"token": text, "logprob": logprob, "bytes": list(engine.tokenizer.token_bytes(token))}

        return {"content": [{**described(token, text, entry[token]),
                             "top_logprobs": [described(alt, _token_text(engine, alt), logprob)
                                              for alt, logprob in _top(entry, count)]}
                            for token, text, entry in zip(chosen, texts, entries)]}
    offsets = []
    for position, (token, text) in enumerate(zip(chosen, texts), start):
        offsets.append(text_offset)
        echoed = echo is not None and position < echo[1]
        text_offset += _width(engine, token, text, echo[0] if echoed else None, text_offset)
    return {"tokens": texts,  # an echo's first token has None: nothing predicts it
            "token_logprobs": [None if entry is None else entry[token] for token, entry in zip(chosen, entries)],
            "top_logprobs": [None if entry is None else _by_text(engine, _top_and_chosen(entry, count, token), token,
                                                                 text)
                             for token, text, entry in zip(chosen, texts, entries)],
            "text_offset": offsets}
