"""The HTTP server (runtime/server.py) and OpenAI's API mapping (runtime/openai_api.py), over real sockets against the
tiny model: responses equal the engine's own results, streams join to the whole text, bad requests get OpenAI's
error bodies with the field named, and a client that leaves cancels its requests."""
from __future__ import annotations

import http.client
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from runtime import Engine
from runtime.server import ApiServer, json_bytes
from tests.runtime.faults import failing_run
from tests.runtime.test_scheduler import slowed

REPO = Path(__file__).resolve().parents[2]


def serve(engine, **scheduler) -> tuple[ApiServer, list[str]]:
    if scheduler:
        engine.start_scheduler(**scheduler)
    lines: list[str] = []
    server = ApiServer(engine, port=0, log=lines.append)
    server.start()
    return server, lines


def stop(server: ApiServer) -> None:
    server.shutdown()
    server.server_close()
    server.engine.close()


@pytest.fixture(scope="module")
def served(tiny_artifact):
    server, lines = serve(Engine.load(tiny_artifact), slots=4)
    yield server
    stop(server)


@pytest.fixture(scope="module")
def chat_served(chat_artifact):
    server, lines = serve(Engine.load(chat_artifact[0]), slots=2)
    yield server
    stop(server)


def request(server: ApiServer, method: str, path: str, body=None, raw: bytes | None = None):
    """(status, headers, parsed JSON body) of one request on a fresh connection."""
    connection = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, dict(response.getheaders()), strict_json(payload)


def strict_json(text):
    """JSON as a strict parser (JavaScript's JSON.parse) reads it: NaN and -Infinity are no JSON numbers."""
    def refuse(constant):
        raise AssertionError(f"the body holds {constant}, which is not JSON")
    return json.loads(text, parse_constant=refuse)


def post(server, path, body):
    return request(server, "POST", path, body)


def events(server: ApiServer, path: str, body: dict) -> tuple[dict, list[dict], bool]:
    """A streamed request: (headers, its events' JSON bodies, whether it ended with [DONE])."""
    connection = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    connection.request("POST", path, body=json.dumps({**body, "stream": True}).encode())
    response = connection.getresponse()
    assert response.status == 200
    lines = response.read().decode().split("\n\n")
    connection.close()
    data = [line.removeprefix("data: ") for line in lines if line]
    assert all(line.startswith("data: ") for line in lines if line)
    done = data[-1] == "[DONE]"
    return dict(response.getheaders()), [strict_json(d) for d in data if d != "[DONE]"], done


def test_a_greedy_completion_is_the_engines_own_result(served):
    status, _, body = post(served, "/v1/completions", {"prompt": "Hello world", "max_tokens": 8, "temperature": 0})
    expected = served.engine.generate("Hello world", max_new_tokens=8)
    assert status == 200
    assert body["object"] == "text_completion" and body["model"] == served.engine.manifest["name"]
    (choice,) = body["choices"]
    assert (choice["index"], choice["text"]) == (0, expected.text)
    assert choice["finish_reason"] == {"stop": "stop"}.get(expected.finish_reason, "length")
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == expected.timings.output_tokens
    assert body["usage"]["total_tokens"] == len(expected.prompt_token_ids) + expected.timings.output_tokens
    (timings,) = body["timings"]
    assert timings["output_tokens"] == expected.timings.output_tokens and 0 < timings["ttft_ms"] <= timings["e2e_ms"]


def test_prompts_and_n_samples_each_get_a_choice_seeded_in_turn(served):
    prompts = ["Once upon", [1, 30, 31, 32]]
    body = {"prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0.9, "seed": 5, "ignore_eos": True}
    status, _, response = post(served, "/v1/completions", body)
    assert status == 200
    texts = [choice["text"] for choice in sorted(response["choices"], key=lambda c: c["index"])]
    expected = [served.engine.generate(prompt, max_new_tokens=6, temperature=0.9, seed=5 + sample,
                                       ignore_eos=True).text for prompt in prompts for sample in range(2)]
    assert texts == expected and len(set(texts)) > 1
    assert response["usage"]["prompt_tokens"] == len(served.engine.prompt_ids("Once upon")) + 4  # once per prompt
    assert response["usage"]["completion_tokens"] == 4 * 6


def test_a_streamed_completion_joins_to_the_whole_text_then_gives_its_usage(served):
    body = {"prompt": "The keeper", "max_tokens": 12, "temperature": 0, "echo": True}
    _, _, whole = post(served, "/v1/completions", body)
    # include_obfuscation false: what the server does anyway (OpenAI's client sends it when asked to)
    options = {"include_usage": True, "include_obfuscation": False}
    headers, chunks, done = events(served, "/v1/completions", {**body, "stream_options": options})
    assert done and headers["Content-Type"] == "text/event-stream" and headers["Cache-Control"] == "no-cache"
    assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI: null on every chunk before the usage's own
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"] and text.startswith("The keeper")
    ends = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(ends) == 1 and ends[0]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert ends[0]["timings"]["output_tokens"] == whole["usage"]["completion_tokens"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["object"] == "text_completion"
    assert chunks[0]["id"].startswith("cmpl-") and whole["id"].startswith("cmpl-")  # OpenAI's, chat's chatcmpl-


def test_completion_logprobs_are_the_engines(served):
    status, _, body = post(served, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                        "logprobs": 2})
    expected = served.engine.generate("Hello", max_new_tokens=4, logprobs=2)
    logprobs = body["choices"][0]["logprobs"]
    assert status == 200 and len(logprobs["tokens"]) == len(expected.token_ids)
    assert logprobs["token_logprobs"] == pytest.approx([e[t] for t, e in zip(expected.token_ids, expected.logprobs)])
    for top, entry in zip(logprobs["top_logprobs"], expected.logprobs):  # greedy: the chosen token is the likeliest
        assert len(top) <= 2 and max(top.values()) == pytest.approx(max(entry.values()))
    assert logprobs["text_offset"][0] == 0 and "".join(logprobs["tokens"]) == body["choices"][0]["text"]


def test_alternatives_that_decode_alike_keep_the_likeliest_ones_logprob(served):
    """Completions key top_logprobs by text, and byte tokens that each begin a character all decode alone to U+FFFD:
    the last (least likely) of them had overwritten the likeliest one's logprob."""
    status, _, body = post(served, "/v1/completions", {"prompt": "Hello world", "max_tokens": 4, "temperature": 0,
                                                        "logprobs": 20})
    expected = served.engine.generate("Hello world", max_new_tokens=4, logprobs=20)
    decode = lambda token: served.engine.tokenizer.tokenizer.decode([token], skip_special_tokens=False)  # noqa: E731
    shared = 0
    logprobs = body["choices"][0]["logprobs"]
    for top, entry, chosen, shown in zip(logprobs["top_logprobs"], expected.logprobs, expected.token_ids,
                                         logprobs["tokens"]):
        likeliest: dict[str, float] = {}
        for token, logprob in sorted(entry.items(), key=lambda item: -item[1]):
            likeliest.setdefault(shown if token == chosen else decode(token), logprob)
        shared += len(entry) - len(likeliest)
        assert top == pytest.approx(likeliest) and shown in top  # the chosen token under the text `tokens` shows
    assert status == 200 and shared > 0  # some alternatives did decode alike


def test_a_token_that_ends_a_character_is_keyed_by_its_text_in_top_logprobs(served):
    """A character spelled by several byte tokens: `tokens` shows it on the token that ends it, which decoded alone
    is "\ufffd"; top_logprobs keyed the chosen token by that, so top_logprobs[i][tokens[i]] raised KeyError."""
    engine = served.engine
    lead, tail = (engine.tokenizer.tokenizer.token_to_id(piece) for piece in ("ç", "ģ"))  # bytes 0xe7 0x81 ...
    if lead is None or tail is None:
        pytest.skip("the tiny vocabulary lacks GPT-2's byte symbols for 0xe7 / 0x81")
    status, _, body = post(served, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "temperature": 0,
                                                        "logprobs": 1, "ignore_eos": True,
                                                        "logit_bias": {str(lead): 100}})
    logprobs = body["choices"][0]["logprobs"]
    assert status == 200 and all(shown in top for shown, top in zip(logprobs["tokens"], logprobs["top_logprobs"]))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", [[1, 40, 41, 42], "Hi</s> there"])
def test_text_offsets_point_into_the_choices_text_past_special_tokens(served, stream, prompt):
    """A special token the choice's text leaves out (the BOS an id prompt begins with; the end-of-sequence token
    that ends the output) takes no width; one a prompt string spells ("</s>") is in the echoed text and keeps it.
    Every other token's offset finds its text."""
    assert {1, 2} <= served.engine.tokenizer.special_ids
    body = {"prompt": prompt, "max_tokens": 8, "logprobs": 1, "min_tokens": 3, "logit_bias": {"2": 100}, "echo": True,
            "temperature": 0}  # greedy: the same tokens every run
    logprobs, text = completion_logprobs(served, body, stream)
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert tokens[-1] == "</s>" and offsets[-1] == len(text)  # the stop token
    for token, offset, following in zip(tokens, offsets, offsets[1:]):
        assert text.startswith(token, offset) or (token in ("<s>", "</s>") and following == offset)
    if isinstance(prompt, str):
        assert text.startswith(prompt) and text.startswith("</s>", offsets[tokens.index("</s>")])
    else:
        assert tokens[0] == "<s>" and offsets[:2] == [0, 0]


def completion_logprobs(served, body: dict, stream: bool) -> tuple[dict, str]:
    """A completion's (logprobs, text) for `body`: the whole response's, or its stream's joined."""
    if stream:
        _, chunks, _ = events(served, "/v1/completions", {**body, "stream": True})
        return streamed_logprobs(chunks, chat=False), "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    choice = post(served, "/v1/completions", body)[2]["choices"][0]
    return choice["logprobs"], choice["text"]


def streamed_logprobs(chunks: list[dict], chat: bool) -> dict:
    """A stream's logprobs joined into the whole response's shape (each chunk holds its own tokens')."""
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    if chat:
        return {"content": [token for part in parts for token in part["content"]]}
    return {key: [value for part in parts for value in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


@pytest.mark.parametrize("stop", [False, True])
def test_streamed_logprobs_join_to_the_whole_responses(served, stop):
    """Greedy, so both runs sample the same tokens. With a stop string that is a later token's whole text, that
    token's text never streams: its logprobs come with the last chunk, as in the whole response."""
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    if stop:
        tokens = post(served, "/v1/completions", body)[2]["choices"][0]["logprobs"]["tokens"]
        stop_at = next(i for i in range(3, 12) if tokens[i] and tokens[i] not in "".join(tokens[:i + 1])[:-1])
        body["stop"] = tokens[stop_at]
    status, _, whole = post(served, "/v1/completions", body)
    _, chunks, done = events(served, "/v1/completions", body)
    expected = whole["choices"][0]["logprobs"]
    assert status == 200 and done and streamed_logprobs(chunks, chat=False) == expected
    assert sum(bool(c["choices"][0]["logprobs"]) for c in chunks[:-1]) > 1  # each piece's own, not all at the end
    assert len(expected["tokens"]) == whole["usage"]["completion_tokens"]
    if stop:
        assert whole["choices"][0]["finish_reason"] == "stop" and len(expected["tokens"]) == stop_at + 1
        # the stop's last token released no text: its logprobs (with any held back before it) end the stream
        assert chunks[-1]["choices"][0]["logprobs"]["tokens"][-1] == body["stop"]


def test_echo_with_logprobs_scores_the_prompt_as_lm_evaluation_harness_asks(served, monkeypatch):
    """lm-eval's local-completions loglikelihood request: prompts as token ids, echo, logprobs 1, max_tokens 1; it
    sums token_logprobs[context length:-1] and calls the continuation greedy where each is its top_logprobs' max.
    The prompt runs in pieces of 4 positions here, against the expected logits' one piece."""
    from runtime import evaluate
    from runtime.evaluate import decode_logits_for, log_softmax

    monkeypatch.setattr(evaluate, "PROMPT_PIECE_TOKENS", 4)
    prompts = [[1, 40, 41, 42, 43, 44], [1, 50, 51, 52]]
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    status, _, response = post(served, "/v1/completions", body)
    assert status == 200
    for prompt, choice in zip(prompts, sorted(response["choices"], key=lambda c: c["index"])):
        logprobs = choice["logprobs"]
        expected = log_softmax(decode_logits_for(served.engine)(np.array(prompt)))  # row i predicts token i + 1
        scored = [expected[i - 1, prompt[i]] for i in range(1, len(prompt))]
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1 and logprobs["token_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:-1] == pytest.approx(scored, abs=1e-4)
        greedy = [max(top.values()) == lp for lp, top in zip(logprobs["token_logprobs"][1:-1],
                                                             logprobs["top_logprobs"][1:-1])]
        assert greedy == [expected[i - 1].argmax() == prompt[i] for i in range(1, len(prompt))]
        assert logprobs["top_logprobs"][0] is None and len(logprobs["tokens"]) == len(prompt) + 1
        # the generated token's entry (from the prompt's decode-graph pass) is the scheduler's, as without echo
        alone = post(served, "/v1/completions", {**body, "prompt": prompt, "echo": False})[2]["choices"][0]
        assert logprobs["token_logprobs"][-1] == pytest.approx(alone["logprobs"]["token_logprobs"][0], abs=1e-4)
        assert choice["text"] == served.engine.tokenizer.decode(prompt) + alone["text"]


def test_a_masked_tokens_logprob_is_vllms_floor_not_minus_infinity(served, monkeypatch):
    """json.dumps wrote -Infinity for a token the model masks (logit -inf), which strict JSON parsers refuse."""
    from runtime import evaluate

    real = evaluate._logprobs
    monkeypatch.setattr(evaluate, "_logprobs", lambda row, token, alternatives: {
        k: (-np.inf if k == token else v) for k, v in real(row, token, alternatives).items()})
    body = {"prompt": [1, 40, 41, 42], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    status, _, response = post(served, "/v1/completions", body)
    assert status == 200 and response["choices"][0]["logprobs"]["token_logprobs"][1:4] == [-9999.0] * 3


def test_nan_logits_at_a_scored_prompt_position_fail_that_request(served, monkeypatch):
    """NaN logits at a prompt position became NaN logprobs (and a body no strict parser reads); the sampled
    position's NaN was already an error."""
    from runtime import evaluate

    real = evaluate.prompt_entries

    def poisoned(logits, *args):
        logits = logits.copy()
        logits[1] = np.nan
        return real(logits, *args)

    monkeypatch.setattr(evaluate, "prompt_entries", poisoned)
    body = {"prompt": [1, 40, 41, 42, 43], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    status, _, response = post(served, "/v1/completions", body)
    assert status == 500 and "logits contain NaN at prompt position 1" in response["error"]["message"], response
    assert post(served, "/v1/completions", {**body, "echo": False})[0] == 200  # the server goes on


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_a_streamed_echo_with_logprobs_joins_to_the_whole_response(served, max_tokens):
    """The first chunk carries the prompt's text and its tokens' logprobs; joined, the chunks are the whole
    response's text and logprobs (the stop token's too)."""
    body = {"prompt": [1, 40, 41, 42, 43], "max_tokens": max_tokens, "logprobs": 2, "echo": True, "temperature": 0,
            "min_tokens": 2 if max_tokens > 1 else 0, "logit_bias": {"2": 30}}
    whole = post(served, "/v1/completions", body)[2]["choices"][0]
    _, chunks, done = events(served, "/v1/completions", {**body, "stream": True})
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert done and "".join(texts) == whole["text"]
    assert texts[0].startswith(served.engine.tokenizer.decode(body["prompt"]))
    first = next(c["choices"][0]["logprobs"] for c in chunks if c["choices"])
    assert first["token_logprobs"][0] is None and len(first["tokens"]) >= len(body["prompt"]) + 1  # and an output's
    assert streamed_logprobs(chunks, chat=False) == whole["logprobs"]


def test_a_scoring_request_a_stop_outlasts_is_told_to_retry(tiny_artifact):
    """Echo with logprobs runs in the scheduler like any request: closing the engine after a drain fails it, and
    its client hears why."""
    server, _ = serve(Engine.load(tiny_artifact), slots=1)
    slowed(server.engine.scheduler, 0.15)
    body = {"prompt": [1, 40, 41], "max_tokens": 30, "logprobs": 1, "echo": True, "ignore_eos": True}
    outcome = in_thread(post, server, "/v1/completions", body)
    try:
        assert wait_for(lambda: server.under_way == 1)
        server.shutdown()
        assert server.drain(0.3) == 1
        server.engine.close()
        assert server.drain(10) == 0
        status, _, response = outcome.result(timeout=10)
        assert status == 503 and "send this one again" in response["error"]["message"]
    finally:
        stop(server)


def test_scoring_requests_share_decode_steps_with_other_requests(tiny_artifact):
    """Scoring requests from several clients are in the scheduler's slots at once, beside a plain request: more than
    one request decodes in a step (the batch-1 path would have run them one after another)."""
    server, _ = serve(Engine.load(tiny_artifact), slots=4)
    scheduler = slowed(server.engine.scheduler, 0.01)
    most = [0]
    step = scheduler._decode

    def counted_decode():
        most[0] = max(most[0], sum(s is not None and s.next_token is not None for s in scheduler._running))
        step()

    scheduler._decode = counted_decode
    body = {"max_tokens": 12, "logprobs": 1, "echo": True, "ignore_eos": True, "temperature": 0}
    try:
        outcomes = [in_thread(post, server, "/v1/completions", {**body, "prompt": [1, *range(40 + i, 50 + i)]})
                    for i in range(3)]
        plain = post(server, "/v1/completions", {**body, "prompt": [1, 7, 8], "echo": False})
        assert plain[0] == 200
        for outcome in outcomes:
            status, _, response = outcome.result(timeout=60)
            assert status == 200 and len(response["choices"][0]["logprobs"]["token_logprobs"]) == 11 + 12
        assert most[0] >= 2
    finally:
        stop(server)


@pytest.mark.parametrize("echo", [True, False])
def test_logprobs_end_with_the_stop_token_that_usage_counts(served, echo):
    """A request the end-of-sequence token ends at once (biased to it) has one completion token and no text: its
    logprobs hold that token, as vLLM's do, so that lm-eval's [context:-1] still drops only the generated one."""
    prompt = [1, 40, 41, 42, 43]
    body = {"prompt": prompt, "max_tokens": 1, "logprobs": 1, "echo": echo, "logit_bias": {"2": 100}}
    choice_body = post(served, "/v1/completions", body)[2]
    logprobs, choice = choice_body["choices"][0]["logprobs"], choice_body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice_body["usage"]["completion_tokens"] == 1
    assert len(logprobs["token_logprobs"]) == (len(prompt) if echo else 0) + 1
    assert logprobs["tokens"][-1] == "</s>" and logprobs["token_logprobs"][-1] < 0
    _, chunks, _ = events(served, "/v1/completions", {**body, "echo": False})
    assert streamed_logprobs(chunks, chat=False)["tokens"] == ["</s>"]


def test_streamed_chat_logprobs_join_to_the_whole_responses(chat_served):
    body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 8, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "ignore_eos": True}
    whole = post(chat_served, "/v1/chat/completions", body)[2]["choices"][0]["logprobs"]
    _, chunks, done = events(chat_served, "/v1/chat/completions", body)
    assert done and len(whole["content"]) == 8 and streamed_logprobs(chunks, chat=True) == whole


def test_a_chat_reply_is_engine_chat_streamed_or_whole(chat_served):
    messages = [{"role": "system", "content": "Hi"}, {"role": "user", "content": [{"type": "text", "text": "2+"},
                                                                                     {"type": "text", "text": "2?"}]}]
    flat = [messages[0], {"role": "user", "content": "2+\n2?"}]  # a line a part, as vLLM joins them
    expected = chat_served.engine.chat(flat, max_new_tokens=6, logprobs=1)
    status, _, body = post(chat_served, "/v1/chat/completions", {"messages": messages, "max_tokens": 6,
                                                                 "temperature": 0, "logprobs": True, "top_logprobs": 1})
    assert status == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(
        [e[t] for t, e in zip(expected.token_ids, expected.logprobs)])
    assert all(len(t["top_logprobs"]) == 1 for t in choice["logprobs"]["content"])
    _, chunks, done = events(chat_served, "/v1/chat/completions", {"messages": flat, "max_tokens": 6,
                                                                   "temperature": 0})
    first_piece = chunks[0]["choices"][0]["delta"]  # the role comes with the first text, not before it
    assert done and first_piece["role"] == "assistant" and first_piece["content"]
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected.text
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_usage_counts_cached_prompt_tokens_once_per_prompt(tiny_artifact):
    """prompt_tokens_details.cached_tokens: the prompt tokens prefix caching reused, counted once per prompt as
    prompt_tokens are (n choices share the prompt); nothing asserted it before."""
    server, _ = serve(Engine.load(tiny_artifact, prefix_caching=True), slots=2)
    try:
        prompt = [1] + list(range(40, 80))
        first = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})[2]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        body = {"prompt": prompt, "max_tokens": 2, "n": 2, "temperature": 0.8, "seed": 3}
        second = post(server, "/v1/completions", body)[2]
        per_choice = [timings["cached_prompt_tokens"] for timings in second["timings"]]
        assert per_choice[0] > 0 and second["usage"]["prompt_tokens"] == len(prompt)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == per_choice[0]  # the prompt's, once
    finally:
        stop(server)


def test_the_engines_max_context_ending_is_length_in_the_api():
    """OpenAI's finish_reason is "stop" or "length": a reply the max context cut short is "length"."""
    from runtime import openai_api
    from runtime.results import GenerationResult

    def ended(reason: str) -> GenerationResult:
        return GenerationResult("", [5], [1], reason, None)

    assert [openai_api.finish_reason(ended(reason)) for reason in ("max_context", "length", "stop")] == [
        "length", "length", "stop"]


def test_completions_alternatives_hold_the_sampled_token_and_chats_the_asked_number(served, chat_served):
    """A sampled token outside the likeliest N: completions' top_logprobs list it after them (OpenAI's "up to
    logprobs+1 elements", vLLM's), with its own logprob; chat's list exactly N (the greedy tests never sample one
    outside them)."""
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 2.0, "seed": 7, "logprobs": 1, "ignore_eos": True}
    logprobs = post(served, "/v1/completions", body)[2]["choices"][0]["logprobs"]
    # keyed by each token's text alone: byte tokens that begin a character all read U+FFFD there and share one key,
    # which holds the likeliest one's logprob
    assert all(logprob in top.values() or "\ufffd" in top
               for logprob, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]))
    sampled_below = [top for top in logprobs["top_logprobs"] if len(top) == 2]
    assert sampled_below, "every sampled token was the likeliest: the check above said little"
    assert all(len(top) <= 2 and list(top.values())[0] >= list(top.values())[-1] for top in logprobs["top_logprobs"])
    none_asked = post(served, "/v1/completions", {**body, "logprobs": 0})[2]["choices"][0]["logprobs"]
    assert [list(top.values()) for top in none_asked["top_logprobs"]] == [[lp] for lp in none_asked["token_logprobs"]]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 2.0, "seed": 7,
            "logprobs": True, "top_logprobs": 1, "ignore_eos": True}
    content = post(chat_served, "/v1/chat/completions", chat)[2]["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) == 1 for entry in content)


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(chat_served):
    messages = [{"role": "user", "content": "2+2?"}]
    room = chat_served.engine.max_context + 1 - len(chat_served.engine.chat_prompt_ids(messages))
    status, _, body = post(chat_served, "/v1/chat/completions", {"messages": messages, "temperature": 0,
                                                                 "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == room
    assert body["choices"][0]["finish_reason"] == "length"


def test_max_token_errors_name_the_field_the_client_sent_or_the_prompt(chat_served):
    """A chat request's max_completion_tokens was reported as max_tokens; a prompt that leaves no room, sent with
    neither, was reported as asking for too many tokens (1 for chat, 16 for completions) it never asked for."""
    engine, messages = chat_served.engine, [{"role": "user", "content": "2+2?"}]
    status, _, body = post(chat_served, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_completion_tokens"
    assert body["error"]["message"].startswith("max_completion_tokens: 0 must be")
    status, _, body = post(chat_served, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 999})
    assert status == 400 and body["error"]["param"] == "max_completion_tokens"
    long = [{"role": "user", "content": "word " * engine.max_context}]
    status, _, body = post(chat_served, "/v1/chat/completions", {"messages": long})
    assert status == 400 and body["error"]["param"] == "messages"
    assert body["error"]["message"].startswith("messages: the prompt has")
    assert "no token can follow it; shorten it" in body["error"]["message"]
    status, _, body = post(chat_served, "/v1/completions", {"prompt": [5] * (engine.max_context + 1)})
    assert status == 400 and body["error"]["param"] == "prompt" and "no token can follow" in body["error"]["message"]
    # Sent with a max_tokens, such a prompt was blamed on it ("max_tokens: ... at most 0 tokens can follow it, 1 were
    # asked for"), and no max_tokens could fix it
    for path, body in (("/v1/completions", {"prompt": [5] * (engine.max_context + 1), "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": long, "max_completion_tokens": 1})):
        status, _, answer = post(chat_served, path, body)
        assert status == 400 and answer["error"]["param"] == ("messages" if "messages" in body else "prompt")
        assert "no token can follow it; shorten it" in answer["error"]["message"]
    # one of a list of prompts: which one
    context = engine.max_context
    status, _, body = post(chat_served, "/v1/completions", {"prompt": ["Hi", [5] * (context + 1)]})
    assert status == 400 and body["error"]["message"].startswith(f"prompt: prompt[1] has {context + 1} tokens")
    status, _, body = post(chat_served, "/v1/completions", {"prompt": [[5] * context, "Hi"], "max_tokens": 2})
    assert status == 400 and body["error"]["message"].startswith(f"max_tokens: prompt[0] has {context} tokens")
    status, _, body = post(chat_served, "/v1/completions", {"prompt": ["Hi", "a" * (context * 256 + 1)]})
    assert status == 400 and body["error"]["message"].startswith("prompt[1]: the prompt has"), body  # untokenized
    status, _, body = post(chat_served, "/v1/completions", {"prompt": [5, 10**9]})
    assert status == 400 and not body["error"]["message"].startswith("prompt[")  # one prompt: no index


def test_a_completion_without_max_tokens_takes_16_or_what_the_context_leaves(chat_served):
    engine = chat_served.engine
    room = 9
    prompt = [5] * (engine.max_context + 1 - room)
    for ids, expected in (([5, 6], 16), (prompt, room)):
        status, _, body = post(chat_served, "/v1/completions", {"prompt": ids, "ignore_eos": True, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == expected


def test_a_negative_seed_is_a_seed(chat_served):
    """OpenAI takes any integer (clients send -1); numpy's generators take >= 0: -1 is 2**64 - 1."""
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    texts = [post(chat_served, "/v1/completions", {**body, "seed": seed})[2]["choices"][0]["text"]
             for seed in (-1, 2 ** 64 - 1, -1)]
    assert texts[0] == texts[1] == texts[2]
    # Out of range, or not an integer: the HTTP API's rule, not the Python API's ">= 0 or None" (-2**70 had been
    # taken modulo 2**64: seed 0's text, silently)
    for seed in (1.5, "1", -2 ** 70, 2 ** 64, True):
        status, _, answer = post(chat_served, "/v1/completions", {**body, "seed": seed})
        assert status == 400 and answer["error"]["param"] == "seed", (seed, answer)
        assert "must be an integer from -2**63 to 2**64 - 1, or null" in answer["error"]["message"], answer


def test_temperature_defaults_to_openais_1_not_the_engines_greedy(served):
    body = {"prompt": "Hello", "max_tokens": 8, "seed": 3, "ignore_eos": True}
    text = post(served, "/v1/completions", body)[2]["choices"][0]["text"]
    sampled = served.engine.generate("Hello", max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True).text
    greedy = served.engine.generate("Hello", max_new_tokens=8, ignore_eos=True).text
    assert text == sampled != greedy


def test_top_k_minus_one_is_vllms_no_limit(served):
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    status, _, limited = post(served, "/v1/completions", {**body, "top_k": -1})
    assert status == 200 and limited["choices"][0]["text"] == post(served, "/v1/completions", body)[2][
        "choices"][0]["text"]
    status, _, refused = post(served, "/v1/completions", {**body, "top_k": -2})
    assert status == 400 and "must be -1 or an integer >= 0 (0 or -1 = no limit)" in refused["error"]["message"]  # what the API takes, not the engine


def test_logprobs_up_to_twenty_alternatives_are_given(served):
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "logprobs": 20}
    status, _, response = post(served, "/v1/completions", body)
    tops = response["choices"][0]["logprobs"]["top_logprobs"]
    # keyed by text, so alternatives that decode alike (bytes of cut characters: U+FFFD) share one key
    assert status == 200 and len(tops) == 2 and all(1 < len(top) <= 20 for top in tops)


def test_echo_gives_each_choice_its_own_prompt(served):
    """Choice i samples prompt i // n: its echoed text, and the offsets into it (a "</s>" the prompt spells keeps its
    width), are that prompt's."""
    prompts = ["Hi there", "Hi</s> there"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "ignore_eos": True}
    choices = post(served, "/v1/completions", body)[2]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # listed in index order, as OpenAI's are
    for choice in choices:
        text, logprobs = choice["text"], choice["logprobs"]
        assert text.startswith(prompts[choice["index"] // 2])
        for token, offset, following in zip(logprobs["tokens"], logprobs["text_offset"], logprobs["text_offset"][1:]):
            assert text.startswith(token, offset) or (token == "<s>" and following == offset)


def test_chat_logprobs_without_top_logprobs_give_the_chosen_tokens_only(chat_served):
    body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 3, "temperature": 0, "logprobs": True,
            "ignore_eos": True}
    content = post(chat_served, "/v1/chat/completions", body)[2]["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(entry["top_logprobs"] == [] and entry["logprob"] <= 0 for entry in content)


def test_chat_logprobs_bytes_are_each_tokens_own_and_join_to_the_text(chat_served):
    """OpenAI's `bytes` are the token's own, to be joined across a character's tokens: a token spelling only part of
    one (its text "") had [] and the one completing it the whole character's bytes."""
    from runtime.openai_api import logprobs_body

    engine = chat_served.engine
    ids = engine.tokenizer.encode("ok 😀🌟 中文", add_special_tokens=False)
    body = logprobs_body(engine, SimpleNamespace(chat=True, logprobs=1), ids, [{token: -0.5} for token in ids])
    content = body["content"]
    partial = [entry for entry in content if entry["token"] == ""]
    assert partial and all(entry["bytes"] for entry in partial)  # bytes where the text is not out yet
    assert b"".join(bytes(entry["bytes"]) for entry in content).decode() == "ok 😀🌟 中文"
    assert "".join(entry["token"] for entry in content) == "ok 😀🌟 中文"  # the texts still join to the text
    for token, entry in zip(ids, content):
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"] == list(engine.tokenizer.token_bytes(token))


def test_chat_with_both_max_tokens_fields_is_told_to_give_one(chat_served):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 3}
    status, _, response = post(chat_served, "/v1/chat/completions", body)
    assert status == 400 and response["error"]["param"] == "max_tokens"
    assert "give max_completion_tokens or max_tokens, not both" in response["error"]["message"]


def test_a_lone_surrogate_in_a_role_is_a_400_not_a_dropped_connection(chat_served):
    """The template quoted an unknown role back in its error, and a lone surrogate there could not be encoded as
    UTF-8: the server dropped the connection with no response."""
    status, _, body = post(chat_served, "/v1/chat/completions", {"messages": [{"role": "\ud800", "content": "x"}]})
    assert status == 400 and "messages[0]['role'] is not valid Unicode" in body["error"]["message"]
    # whatever text a body quotes goes out as JSON: a lone surrogate as its escape
    assert json.loads(json_bytes({"error": "x\ud800y"})) == {"error": "x\ud800y"}


def test_chat_without_the_generation_prompt_ends_the_prompt_with_the_last_message(chat_served):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is"}]
    prompt = chat_served.engine.chat_prompt_ids(messages, add_generation_prompt=False)
    assert len(prompt) < len(chat_served.engine.chat_prompt_ids(messages))
    expected = chat_served.engine.generate(prompt, max_new_tokens=4, ignore_eos=True)
    status, _, body = post(chat_served, "/v1/chat/completions", {
        "messages": messages, "add_generation_prompt": False, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["prompt_tokens"] == len(prompt)
    assert body["choices"][0]["message"]["content"] == expected.text


def test_chat_on_a_model_without_a_template_says_so(served):
    status, _, body = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "no chat template" in body["error"]["message"]


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/v1/completions", {"prompt": "x", "max_tokns": 3}, 400, "max_tokns", "did you mean max_tokens?"),
    # the chat API's name, sent to completions: difflib scores min_tokens as close as max_tokens, and picked it
    ("/v1/completions", {"prompt": "x", "max_completion_tokens": 3}, 400, "max_completion_tokens",
     "did you mean max_tokens?"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of", "best_of: above 1 is not supported"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 4}, 400, "min_tokens",
     "min_tokens: 4 must be an integer from 0 to the most new tokens asked for (2)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": 1}, 400,
     "add_generation_prompt", "must be true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, 400, "tools",
     "tool calls are not supported"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/completions", {"prompt": "x", "model": 3}, 400, "model", "must be a string"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "prompt: required"),
    ("/v1/completions", {"prompt": [1.5, 2]}, 400, "prompt", "list of token ids"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "prompt", "outside this model's vocabulary"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "non-empty list"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10 ** 9]}, 400, "stop_token_ids", "outside this model"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 300}}, 400, "logit_bias", "must be a number in"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "n: 0 must be an integer in 1..128"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature: -1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens: 0 must be"),  # no echo
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_token": 3}, 400,
     "max_completion_token", "did you mean max_completion_tokens?"),
    ("/v1/completions", {"prompt": "x", "max_completion_token": 3}, 400, "max_completion_token",
     "did you mean max_tokens?"),
    ("/v1/completions", {"prompt": "x", "length_penalty": 1}, 400, "length_penalty",  # not presence_penalty's typo
     "length_penalty: vLLM's field is not supported by this server"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 3}, 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens: vLLM's field is not supported by this server"),
    ("/v1/completions", {"prompt": "x", "best_of": 1.5}, 400, "best_of", "best_of: above 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, 400,
     "tool_choice", "tool calls are not supported"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 500}, 400, "max_tokens", "at most 128 tokens can follow"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "stop: an empty string"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "must be true or false"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "only with stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", "only with logprobs: true"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages: required"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "usage": True}},
     400, "stream_options", "must be an object with include_usage"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_obfuscation": True}}, 400,
     "stream_options.include_obfuscation", "this server does not pad its chunks; send false or leave it out"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_object"}}, 400, "response_format", 'only {"type": "text"} is supported'),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 65}, 400, "n", "n: 65 must be an integer in 1..64"),  # per prompt
    ("/v1/completions", {"prompt": ["x"] * 129}, 400, "prompt", "prompt: 129 prompts, at most 128"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "logprobs: 21 must be an integer in 0..20"),
    ("/v1/completions", {"prompt": "x", "best_of": True}, 400, "best_of", "best_of: above 1"),  # true is not 1
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", "only text parts"),
])
def test_a_bad_request_gets_openais_error_naming_the_field(served, path, body, status, param, message):
    answered, _, response = post(served, path, body)
    assert answered == status
    assert response["error"]["param"] == param and message in response["error"]["message"]
    assert response["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


@pytest.mark.parametrize("raw, message", [
    (b"[" * 100_000, "not JSON that can be read"),  # nesting too deep for the parser
    (b'{"prompt": "x", "n": ' + b"1" * 5000 + b"}", "not JSON that can be read"),  # past int()'s digits
    ('{"prompt": "x", "logit_bias": {"\u00b2": 1}}'.encode(), "logit_bias: key"),  # a digit to isdigit, not to int
])
def test_bodies_that_break_the_parsers_are_400s_and_the_server_goes_on(served, raw, message):
    status, _, body = request(served, "POST", "/v1/completions", raw=raw)
    assert status == 400 and message in body["error"]["message"]
    assert post(served, "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200


def test_min_tokens_holds_back_the_stop_token_ids(served):
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    tokens = served.engine.generate(served.engine.prompt_ids("Hello"), max_new_tokens=8, ignore_eos=True).token_ids
    stop = {**body, "stop_token_ids": [tokens[1]]}
    assert post(served, "/v1/completions", stop)[2]["usage"]["completion_tokens"] == 2  # the stop token counts
    held = post(served, "/v1/completions", {**stop, "min_tokens": 4})[2]
    assert held["usage"]["completion_tokens"] >= 4 and held["choices"][0]["text"].startswith(
        served.engine.tokenizer.decode(tokens[:1]))


def test_null_fields_are_not_given_and_best_of_one_is_one(served, chat_served):
    body = {"prompt": "x", "max_tokens": 2, "suffix": None, "tools": None, "seed": None, "best_of": 1, "min_tokens": 0}
    assert post(served, "/v1/completions", body)[0] == 200
    assert post(served, "/v1/completions", {**body, "best_of": 1.0})[0] == 200  # JSON's 1.0 is JavaScript's 1
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    for harmless in ({"tool_choice": "none"}, {"parallel_tool_calls": False}, {"skip_special_tokens": True}):
        assert post(chat_served, "/v1/chat/completions", {**chat, **harmless})[0] == 200, harmless


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_answers_the_prompt_and_its_logprobs_alone(served, stream):
    """OpenAI's legacy scoring request (vLLM's echo_without_generation): the prompt's text and logprobs, no completion
    token in the text, the logprobs or the usage, finish_reason "length"."""
    prompt = [1, 40, 41, 42, 43]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    scored = post(served, "/v1/completions", {**body, "max_tokens": 1})[2]["choices"][0]
    if stream:
        _, chunks, done = events(served, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        assert done and len(chunks) == 2 and chunks[-1]["usage"]["completion_tokens"] == 0
        choice = {**chunks[0]["choices"][0], "logprobs": streamed_logprobs(chunks, chat=False)}
    else:
        status, _, response = post(served, "/v1/completions", body)
        assert status == 200 and response["usage"]["completion_tokens"] == 0
        choice = response["choices"][0]
    assert choice["text"] == served.engine.tokenizer.decode(prompt) and choice["finish_reason"] == "length"
    assert {key: values[:len(prompt)] for key, values in scored["logprobs"].items()} == choice["logprobs"]
    status, _, refused = post(served, "/v1/completions", {**body, "min_tokens": 2})  # it had said "(1)" asked for
    assert status == 400 and refused["error"]["param"] == "min_tokens" and "generate nothing" in refused["error"][
        "message"]


def test_more_choices_than_the_server_ever_holds_is_a_400_not_a_503(slow_server):
    server, _ = slow_server  # 1 slot, 1 waiting: a request of 3 choices could never be admitted whole
    status, _, body = post(server, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "n" and "at most 2 requests at once" in body["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1})[0] == 200


def test_stop_token_ids_stop_besides_the_end_of_sequence_tokens_as_in_vllm(served):
    from runtime.openai_api import parse

    engine, name = served.engine, served.model_name
    (choice,) = parse(engine, {"prompt": "x", "stop_token_ids": [7]}, chat=False, model_name=name).choices
    assert choice.params.stop_ids(engine.eos_token_ids) == {7, *engine.eos_token_ids}
    (choice,) = parse(engine, {"prompt": "x", "stop_token_ids": [7], "ignore_eos": True}, chat=False,
                      model_name=name).choices
    assert choice.params.stop_ids(engine.eos_token_ids) == {7}


def test_each_choice_says_which_stop_ended_it_as_vllms_stop_reason(served):
    """vLLM's stop_reason beside finish_reason: the stop string, a stop_token_ids id, or null (an end-of-sequence
    token, the length); streamed, on the last chunk of each choice."""
    full = post(served, "/v1/completions", {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True})[2]
    (choice,) = full["choices"]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    text = choice["text"]
    stop = text[3:5]
    assert text.find(stop) == 3 and stop.strip()
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": ["never here", stop]}
    (choice,) = post(served, "/v1/completions", body)[2]["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (text[:3], "stop", stop)
    _, chunks, done = events(served, "/v1/completions", body)
    assert done and [c["choices"][0]["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [stop]
    token = served.engine.generate("Hello", max_new_tokens=1, ignore_eos=True).token_ids[0]
    (choice,) = post(served, "/v1/completions", {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                 "stop_token_ids": [token]})[2]["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("", "stop", token)
    eos = served.engine.eos_token_ids[0]
    (choice,) = post(served, "/v1/completions", {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "stop_token_ids": [eos],
                                                 "logit_bias": {str(eos): 100}})[2]["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)  # the end of sequence: vLLM's null


def test_an_error_inside_a_stream_ends_it_with_an_error_event(served, monkeypatch):
    import runtime.openai_api

    def broken(*args, **keywords):
        raise KeyError("a bug")

    monkeypatch.setattr(runtime.openai_api, "chunk", broken)
    _, chunks, done = events(served, "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert done and chunks == [{"error": {"message": "KeyError: 'a bug'", "type": "server_error", "param": None,
                                          "code": 500}}]


def test_an_error_outside_the_api_is_a_500_with_its_message(chat_served, monkeypatch):
    from runtime import ArtifactError

    def broken(messages, add_generation_prompt=True):
        raise ArtifactError("the chat template cannot be read")

    monkeypatch.setattr(chat_served.engine, "chat_prompt_ids", broken)
    status, _, body = post(chat_served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 500 and "chat template cannot be read" in body["error"]["message"]


def test_a_body_that_stops_arriving_times_out_and_the_server_goes_on(served, monkeypatch):
    import runtime.server

    monkeypatch.setattr(runtime.server._Handler, "timeout", 0.5)
    connection = socket.create_connection(served.server_address[:2])
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    connection.settimeout(30)
    assert connection.recv(4096) == b""  # the server closed it
    connection.close()
    assert post(served, "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200


def test_headers_that_trickle_in_past_the_deadline_end_the_connection(served, monkeypatch):
    """A byte of header every half second kept each recv inside the socket timeout, so a client could hold a server
    thread for ever (slowloris); the request line and headers now have a deadline as a whole."""
    import runtime.server

    monkeypatch.setattr(runtime.server, "HEADER_DEADLINE_S", 1.0)
    refused = 'aotlm:http_requests_total{model_name="tiny-random",route="other",status="400"}'
    refused_before = scrape(served.server_address).get(refused, 0)
    connection = socket.create_connection(served.server_address[:2])
    connection.settimeout(0.1)
    started, closed = time.monotonic(), False
    for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
        try:
            connection.sendall(bytes([byte]))
            closed = connection.recv(4096) == b""
        except TimeoutError:
            pass
        except OSError:  # reset: closed too
            closed = True
        if closed or time.monotonic() - started > 10:
            break
        time.sleep(0.05)
    connection.close()
    assert closed and time.monotonic() - started < 5
    assert post(served, "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200  # the server goes on
    # cut inside the headers, it is no request: no 400 was answered or counted (the parser had answered the part)
    assert scrape(served.server_address).get(refused, 0) == refused_before


def test_a_request_line_cut_by_the_deadline_is_no_request(served, monkeypatch):
    """Half a request line at the deadline: the parser answered the half ("Bad HTTP/0.9 request type", a 400 in the
    log and /metrics); the cut is no request."""
    import runtime.server

    monkeypatch.setattr(runtime.server, "HEADER_DEADLINE_S", 0.5)
    refused = 'aotlm:http_requests_total{model_name="tiny-random",route="other",status="400"}'
    refused_before = scrape(served.server_address).get(refused, 0)
    connection = socket.create_connection(served.server_address[:2])
    connection.sendall(b"POST /v1/completions")
    connection.settimeout(10)
    assert connection.recv(4096) == b""  # closed, unanswered
    connection.close()
    assert scrape(served.server_address).get(refused, 0) == refused_before


@pytest.mark.parametrize("framing", [b"Content-Length: 100\r\n\r\n{", b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"])
def test_a_body_that_trickles_in_past_its_deadline_is_answered_408(served, monkeypatch, framing):
    """Once the headers were in, a body sent a byte every 55 s held a thread for ever (each read within the socket
    timeout); the body now has a deadline as a whole, and its refusal still goes out (a chunked one cut short had
    read as malformed: a 400)."""
    import runtime.server

    monkeypatch.setattr(runtime.server, "HEADER_DEADLINE_S", 0.5)
    monkeypatch.setattr(runtime.server, "MAX_BODY_BYTES", 1024)  # a chunked body's deadline counts the most it may be
    connection = socket.create_connection(served.server_address[:2])
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + framing)
    connection.settimeout(10)
    answer = b""
    while chunk := connection.recv(4096):  # to the close
        answer += chunk
    connection.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"the request body did not arrive within 1 s" in answer, answer
    assert post(served, "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200


def test_answers_go_out_without_waiting_for_the_clients_acknowledgement(served, monkeypatch):
    """Headers and body are two writes, a stream's events one each: with Nagle's algorithm on, every keep-alive
    request waited for the client's delayed ACK (44 ms each, /health too)."""
    from runtime.server import _Handler

    nodelay = []
    setup = _Handler.setup
    monkeypatch.setattr(_Handler, "setup", lambda self: (setup(self), nodelay.append(
        self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))))
    assert request(served, "GET", "/health")[0] == 200
    assert nodelay and nodelay[-1]


def test_connections_past_the_limit_get_503_and_each_holds_one_thread(tiny_artifact):
    """Every connection held a thread and a header-deadline timer thread: 1000 idle ones left the server no thread
    to start, and it cut /health unanswered. Past max_connections one is refused at once; deadlines share a thread."""
    server = ApiServer(Engine.load(tiny_artifact), port=0, max_connections=3)
    server.start()
    idle = []
    try:
        threads = threading.active_count()
        for _ in range(3):
            idle.append(socket.create_connection(server.server_address[:2]))
        deadline = time.monotonic() + 10
        while server.open_connections < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.open_connections == 3 and threading.active_count() <= threads + 3 + 1  # + the deadlines'
        extra = socket.create_connection(server.server_address[:2])
        extra.settimeout(10)
        answer = extra.recv(4096)
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"too many connections open" in answer, answer
        idle.pop().close()
        while server.open_connections > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert request(server, "GET", "/health")[0] == 200
    finally:
        for connection in idle:
            connection.close()
        stop(server)


def test_a_client_that_leaves_without_reading_its_response_is_no_error(served, capfd):
    connection = socket.create_connection(served.server_address[:2])
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    connection.settimeout(30)
    assert connection.recv(1, socket.MSG_PEEK)  # the response arrived; closing with it unread resets the connection
    connection.close()
    assert post(served, "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200
    assert "Traceback" not in capfd.readouterr().err  # socketserver printed the reset as the server's error


def scrape(address) -> dict[str, float]:
    """/metrics of the server at address (host, port) as {series with its labels: value}, after checking the text
    format's shape."""
    connection = http.client.HTTPConnection(*address[:2], timeout=60)
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain; version=0.0.4")
    series = exposition_series(response.read().decode())
    connection.close()
    return series


def exposition_series(text: str) -> dict[str, float]:
    """Prometheus' text format as {series with its labels: value}."""
    series = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return series


def test_metrics_count_what_the_server_served(tiny_artifact):
    server, _ = serve(Engine.load(tiny_artifact), slots=2)
    try:
        assert scrape(server.server_address)['aotlm:generation_tokens_total{model_name="tiny-random"}'] == 0
        bodies = [post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3, "n": 2, "ignore_eos": True})[2],
                  post(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})[2]]
        events(server, "/v1/completions", {"prompt": "y", "max_tokens": 2, "ignore_eos": True})
        post(server, "/v1/completions", {"prompt": "x", "n": 0})
        series = scrape(server.server_address)
    finally:
        stop(server)
    label = 'model_name="tiny-random"'
    assert series[f"aotlm:generation_tokens_total{{{label}}}"] == sum(
        body["usage"]["completion_tokens"] for body in bodies) + 2
    assert series[f'aotlm:http_requests_total{{{label},route="/v1/completions",status="200"}}'] == 3
    assert series[f'aotlm:http_requests_total{{{label},route="/v1/completions",status="400"}}'] == 1
    assert series[f"aotlm:time_to_first_token_seconds_count{{{label}}}"] == 4  # one per choice
    assert series[f"aotlm:request_generation_tokens_sum{{{label}}}"] == series[
        f"aotlm:generation_tokens_total{{{label}}}"] and series[f"aotlm:request_prompt_tokens_count{{{label}}}"] == 4
    # per request: the one-token request has no mean gap; per gap (as vLLM's time_per_output_token_seconds, which
    # counted per request here): 2 + 2 (n=2, 3 tokens each) + 0 + 1 (the stream's 2 tokens)
    assert series[f"aotlm:request_time_per_output_token_seconds_count{{{label}}}"] == 3
    assert series[f"aotlm:inter_token_latency_seconds_count{{{label}}}"] == 5
    assert series[f"aotlm:time_per_output_token_seconds_count{{{label}}}"] == 5
    buckets = [v for k, v in series.items() if k.startswith("aotlm:e2e_request_latency_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == 4  # cumulative, +Inf last
    assert series[f"aotlm:kv_cache_slots{{{label}}}"] == 2 and series[f"aotlm:num_requests_running{{{label}}}"] == 0


def test_metrics_histograms_and_counters_of_hand_made_traces():
    """Binary-exact timings, some on a bucket's bound (Prometheus' buckets count values <= le) and one past the last
    bound (+Inf only): every series has a hand-computed value."""
    from runtime.metrics import RequestTrace
    from runtime.results import GenerationResult, Timings
    from runtime.server_metrics import ServerMetrics

    def finished(**trace) -> GenerationResult:
        trace = RequestTrace(first_token=trace["token_times"][0], output_tokens=len(trace["token_times"]), **trace)
        return GenerationResult("", [], [], "length", Timings(trace))

    metrics = ServerMetrics(max_context=4000)
    # ttft 0.5 and e2e 1.0 (bounds), queue 0.125, gaps 0.125 and 0.375, tpot 0.25
    metrics.finished(finished(arrival=0.0, prefill_start=0.125, token_times=[0.5, 0.625, 1.0], finish=1.0,
                              prompt_tokens=10, cached_prompt_tokens=4))
    # one token, 3000 s after arrival (past the last bound, 2560): no gap, no tpot, no queue
    metrics.finished(finished(arrival=0.0, prefill_start=0.0, token_times=[3000.0], finish=3000.0, prompt_tokens=5))
    metrics.finished(GenerationResult("", [], [], "cancelled", None))  # cancelled before its first token: not counted
    scheduler = SimpleNamespace(counts=lambda: (3, 5), slots=8, token_counts=lambda: {  # the scheduler's, as made
        "prompt_tokens": 15, "generation_tokens": 4, "prefix_cache_queries": 10, "prefix_cache_hits": 4})
    series = exposition_series(metrics.render("m", scheduler))

    def value(name, le=None):
        return series[f'aotlm:{name}{{model_name="m"' + ("" if le is None else f',le="{le}"') + "}"]

    assert (value("num_requests_running"), value("num_requests_waiting"), value("kv_cache_slots")) == (3, 5, 8)
    assert (value("prompt_tokens_total"), value("generation_tokens_total"), value("prefix_cache_queries_total"),
            value("prefix_cache_hits_total")) == (15, 4, 10, 4)
    ttft = "time_to_first_token_seconds"
    assert [value(f"{ttft}_bucket", le) for le in ("0.25", "0.5", "2560.0", "+Inf")] == [0, 1, 1, 2]
    assert (value(f"{ttft}_count"), value(f"{ttft}_sum")) == (2, 3000.5)
    e2e = "e2e_request_latency_seconds"
    assert [value(f"{e2e}_bucket", le) for le in ("0.75", "1.0", "+Inf")] == [0, 1, 2]
    assert (value(f"{e2e}_count"), value(f"{e2e}_sum")) == (2, 3001.0)
    queue = "request_queue_time_seconds"
    assert [value(f"{queue}_bucket", le) for le in ("0.001", "0.1", "0.25")] == [1, 1, 2]
    assert value(f"{queue}_sum") == 0.125
    for gaps in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert [value(f"{gaps}_bucket", le) for le in ("0.1", "0.25", "0.5")] == [0, 1, 2]
        assert (value(f"{gaps}_count"), value(f"{gaps}_sum")) == (2, 0.5)
    tpot = "request_time_per_output_token_seconds"
    assert [value(f"{tpot}_bucket", le) for le in ("0.1", "0.25")] == [0, 1]
    assert (value(f"{tpot}_count"), value(f"{tpot}_sum")) == (1, 0.25)
    # vLLM's phases: prefill 0.125 -> 0.5 (no prefill_end: to the first token) and 0 -> 3000; decode 0.5 -> 1.0 and
    # none; inference 0.125 -> 1.0 and 0 -> 3000
    assert value("request_prefill_time_seconds_sum") == 0.375 + 3000.0
    assert value("request_decode_time_seconds_sum") == 0.5
    assert value("request_inference_time_seconds_sum") == 0.875 + 3000.0
    assert series['aotlm:request_success_total{model_name="m",finished_reason="length"}'] == 2
    assert series['aotlm:request_success_total{model_name="m",finished_reason="abort"}'] == 1
    assert series['aotlm:kv_cache_usage_perc{model_name="m"}'] == 3 / 8
    # vLLM's length histograms, 1-2-5 buckets up to the context (4000: the last bound 2000); prompts 10 and 5
    prompt, generated = "request_prompt_tokens", "request_generation_tokens"
    assert [value(f"{prompt}_bucket", le) for le in ("2", "5", "10", "2000", "+Inf")] == [0, 1, 2, 2, 2]
    assert (value(f"{prompt}_count"), value(f"{prompt}_sum")) == (2, 15)
    assert [value(f"{generated}_bucket", le) for le in ("1", "2", "5")] == [1, 1, 2]
    assert value(f"{generated}_sum") == 4
    assert f'aotlm:{prompt}_bucket{{model_name="m",le="5000"}}' not in series
    from runtime.server_metrics import length_buckets

    assert length_buckets(1000)[-1] == 1000 and length_buckets(999)[-1] == 500  # up to the context, as vLLM's


def test_metrics_show_the_requests_running_and_waiting(slow_server):
    server, _ = slow_server
    running = server.engine.submit([1, 2, 3], max_new_tokens=100, ignore_eos=True)
    next(iter(running))
    waiting = server.engine.submit([1, 2], max_new_tokens=2)
    series = scrape(server.server_address)
    made = len(list(itertools.islice(running, 3))) + 1  # pieces of text it streamed: each took a token at least
    later = scrape(server.server_address)
    running.cancel()
    waiting.cancel()
    label = 'model_name="tiny-random"'
    assert (series[f"aotlm:num_requests_running{{{label}}}"], series[f"aotlm:num_requests_waiting{{{label}}}"]) == (1, 1)
    # the token counters move while a request runs (vLLM's per step; they had moved only when a request finished)
    assert series[f"aotlm:prompt_tokens_total{{{label}}}"] == 3
    assert series[f"aotlm:generation_tokens_total{{{label}}}"] >= 1
    assert later[f"aotlm:generation_tokens_total{{{label}}}"] >= made == 4


def test_an_api_key_guards_the_v1_routes_not_health_or_metrics(tiny_artifact):
    engine = Engine.load(tiny_artifact)
    for bad in (dict(api_key="clé"), dict(api_key=""), dict(max_connections=0), dict(max_connections=True)):
        with pytest.raises(ValueError, match="api_key: give printable ASCII|max_connections: .* must be an integer"):
            ApiServer(engine, port=0, **bad)  # a key no client can send; a server that refuses every connection
    server = ApiServer(engine, port=0, api_key="s3cret")
    server.start()
    try:
        body = json.dumps({"prompt": "x", "max_tokens": 1})
        answers = []
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}, {"Authorization": "Bearer s3cret"},
                        {"Authorization": "bearer s3cret"}):  # the scheme is case-insensitive (RFC 9110 11.1)
            connection = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
            connection.request("POST", "/v1/completions", body=body, headers=headers)
            response = connection.getresponse()
            answers.append((response.status, json.loads(response.read()).get("error", {}).get("type")))
            connection.close()
        assert answers == [(401, "authentication_error")] * 4 + [(200, None)] * 2
        assert request(server, "GET", "/v1/models")[0] == request(server, "GET", "/models")[0] == 401  # its alias
        assert request(server, "GET", "/tokenizer_info")[0] == 401 and post(server, "/tokenize", {"prompt": "x"})[0] == 401
        connection = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
        connection.request("POST", "/tokenize", body=json.dumps({"prompt": "x"}),
                           headers={"Authorization": "Bearer s3cret"})
        assert connection.getresponse().status == 200
        connection.close()
        assert request(server, "GET", "/health")[0] == 200
    finally:
        stop(server)


def test_what_a_client_sends_reaches_the_log_escaped_and_cut_and_its_error_cut(tiny_artifact):
    """A request line's escape sequences went to the terminal raw (ESC[2K ESC[1A rewrote earlier lines); a 15 MB
    field name came back as a 30 MB error and a 30 MB log line."""
    server, lines = serve(Engine.load(tiny_artifact))
    try:
        with socket.create_connection(server.server_address[:2], timeout=30) as connection:
            connection.sendall(b"GET /\x1b[2K\x1b[1Afake HTTP/1.1\r\nHost: x\r\n\r\n")
            assert connection.recv(4096).startswith(b"HTTP/1.1 404")
        name = "x" * 100_000
        status, _, body = post(server, "/v1/completions", {"prompt": "hi", name: 1})
        message = body["error"]["message"]
        assert status == 400 and len(message) < 2100 and "characters in all" in message
    finally:
        stop(server)
    assert any("/\\x1b[2K\\x1b[1Afake 404" in line for line in lines), lines
    assert all("\x1b" not in line and len(line) < 1100 for line in lines), [line[:200] for line in lines]


def test_the_tokenizer_routes_split_text_as_the_server_does(chat_served):
    """vLLM's /tokenize, /detokenize and /tokenizer_info, as lm-evaluation-harness' remote tokenizer calls them."""
    engine = chat_served.engine
    status, _, body = post(chat_served, "/tokenize", {"prompt": "The keeper", "add_special_tokens": False,
                                                      "return_token_strs": True})
    ids = engine.tokenizer.encode("The keeper", add_special_tokens=False)
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == engine.max_context
    assert body["token_strs"] == [engine.tokenizer.tokenizer.id_to_token(token) for token in ids]
    assert post(chat_served, "/tokenize", {"prompt": "The keeper"})[2]["tokens"] == engine.prompt_ids("The keeper")
    messages = [{"role": "user", "content": "2+2?"}]
    assert post(chat_served, "/tokenize", {"messages": messages})[2]["tokens"] == engine.chat_prompt_ids(messages)
    parts = [{"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]}]
    assert post(chat_served, "/tokenize", {"messages": parts})[2]["tokens"] == engine.chat_prompt_ids(
        [{"role": "user", "content": "2+\n2?"}])
    assert post(chat_served, "/detokenize", {"tokens": ids})[2] == {"prompt": "The keeper"}
    status, _, info = request(chat_served, "GET", "/tokenizer_info")
    assert status == 200 and info["chat_template"] == (chat_served.engine.artifact_dir / "chat_template.jinja").read_text()
    # the template's own names (this artifact's tokenizer_config names other tokens than config.json's ids)
    assert (info["bos_token"], info["eos_token"], info["eos_token_ids"]) == ("A", "B", list(engine.eos_token_ids))
    for path, body, param, message in [
            ("/tokenize", {"prompt": "x", "messages": messages}, "prompt", "one of them"),
            ("/tokenize", {"promt": "x"}, "promt", "did you mean prompt?"),
            ("/tokenize", {"prompt": 3}, "prompt", "must be a string"),
            # tokenized whole, a 4 MB one took 4.3 s of the server's CPU: refused as generation refuses it
            ("/tokenize", {"prompt": "a" * (chat_served.engine.max_context * 256 + 1)}, "prompt", "characters: more"),
            ("/detokenize", {"tokens": [10 ** 9]}, "tokens", "outside this model's vocabulary"),
            ("/detokenize", {"tokens": "1 2"}, "tokens", "a list of token ids")]:
        status, _, refused = post(chat_served, path, body)
        assert (status, refused["error"]["param"]) == (400, param) and message in refused["error"]["message"]
    assert request(chat_served, "GET", "/tokenize")[0] == 405 and post(chat_served, "/tokenizer_info", {})[0] == 405


def test_the_end_tokens_text_tokenizes_to_its_id(served):
    """How lm-evaluation-harness' remote tokenizer finds the end-of-sequence id: /tokenize of its text."""
    info = request(served, "GET", "/tokenizer_info")[2]
    assert (info["chat_template"], info["eos_token"]) == (None, "</s>")
    eos = post(served, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})[2]["tokens"]
    assert eos == [served.engine.eos_token_ids[0]] == info["eos_token_ids"]


def test_other_methods_get_the_allowed_ones_and_head_gets_the_get_headers(served):
    """HEAD, OPTIONS, PUT, DELETE and PATCH got http.server's 501 HTML page: now HEAD answers like GET without the
    body, OPTIONS lists the route's methods, the others get 405 with them (OpenAI's error body), and the
    connection goes on serving."""
    connection = http.client.HTTPConnection(*served.server_address[:2], timeout=60)

    def ask(method: str, path: str, body: bytes | None = None):
        connection.request(method, path, body=body)
        response = connection.getresponse()
        return response.status, response.getheader("Allow"), response.getheader("Content-Length"), response.read()

    status, _, length, payload = ask("HEAD", "/health")
    assert status == 200 and payload == b"" and int(length) == len(b'{"status": "ok"}')
    assert ask("OPTIONS", "/v1/completions")[:2] == (204, "POST, OPTIONS")
    assert ask("OPTIONS", "/v1/models")[:2] == (204, "GET, HEAD, OPTIONS")
    status, allow, _, payload = ask("DELETE", "/v1/models", b'{"a": 1}')  # its body read, not left on the line
    assert (status, allow) == (405, "GET, HEAD, OPTIONS")
    assert json.loads(payload)["error"]["message"] == "/v1/models does not take DELETE; it takes GET, HEAD, OPTIONS"
    assert ask("PUT", "/v1/chat/completions", b"{}")[:2] == (405, "POST, OPTIONS")
    assert ask("GET", "/v1/completions")[:2] == (405, "POST, OPTIONS")
    status, _, _, payload = ask("PATCH", "/nowhere")
    assert status == 404 and "no route /nowhere" in json.loads(payload)["error"]["message"]
    assert ask("GET", "/health")[0] == 200  # the same connection, still serving
    connection.close()


def test_an_ipv6_address_is_listened_on(tiny_artifact):
    """--host ::1 failed: the server's socket was IPv4 only ("Address family for hostname not supported")."""
    try:
        socket.socket(socket.AF_INET6).close()
    except OSError as error:
        pytest.skip(f"this machine has no IPv6 sockets: {error}")
    server = ApiServer(Engine.load(tiny_artifact), host="::1", port=0)
    server.start()
    try:
        assert server.url == f"http://[::1]:{server.server_address[1]}"
        connection = http.client.HTTPConnection("::1", server.server_address[1], timeout=60)
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200
        connection.close()
    finally:
        stop(server)


def test_a_body_over_the_limit_gets_its_413_even_by_a_client_that_sends_it_all_first(served):
    """http.client writes the whole body before it reads: the server answered 413 and closed with the body still
    arriving, and the client got a broken pipe or a reset instead of the answer."""
    from runtime.server import MAX_BODY_BYTES

    body = json.dumps({"prompt": "a" * (MAX_BODY_BYTES + (1 << 20))}).encode()
    connection = http.client.HTTPConnection(*served.server_address[:2], timeout=60)
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 413 and response.getheader("Connection") == "close"
    assert f"at most {MAX_BODY_BYTES} are read" in json.loads(response.read())["error"]["message"]
    connection.close()
    assert request(served, "GET", "/health")[0] == 200


def test_bodies_and_routes_that_are_not_the_api_are_refused(served):
    status, _, body = request(served, "POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and "not JSON" in body["error"]["message"]
    status, _, body = request(served, "POST", "/v1/completions", raw=b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    assert request(served, "GET", "/v1/completions")[0] == 405
    status, headers, body = request(served, "POST", "/health", {})
    assert status == 405 and headers["Allow"] == "GET, HEAD, OPTIONS"
    assert "/health takes GET" in body["error"]["message"]
    status, _, body = request(served, "POST", "/v2/generate", {})
    assert status == 404 and "/v1/chat/completions" in body["error"]["message"]
    connection = http.client.HTTPConnection(*served.server_address[:2], timeout=60)
    connection.request("POST", "/v2/generate", body=iter([b"{}"]), encode_chunked=True,
                       headers={"Transfer-Encoding": "chunked"})
    response = connection.getresponse()  # its chunked body read: the connection goes on
    assert response.status == 404 and response.getheader("Connection") is None
    assert "/v1/chat/completions" in json.loads(response.read())["error"]["message"]
    connection.close()
    status, _, body = request(served, "GET", "/v1/models")
    assert status == 200 and body["data"][0]["id"] == served.model_name
    assert body["data"][0]["max_model_len"] == served.engine.max_context
    assert request(served, "GET", "/models")[:3:2] == (200, body)  # vLLM's alias, without /v1
    assert request(served, "GET", "/health")[:3:2] == (200, {"status": "ok"})


@pytest.mark.parametrize("length", ["abc", "-1", "1e3", "\u0661"])
def test_a_content_length_that_is_not_a_number_of_bytes_is_a_400_and_the_connection_ends(served, length):
    """Not digits: a 400 naming the header, not a 500 from int() nor a read of -1 bytes (to the end of the stream,
    which a client that keeps its connection open never gives)."""
    client = socket.create_connection(served.server_address[:2], timeout=10)
    client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
    response = http.client.HTTPResponse(client)
    response.begin()
    assert response.status == 400 and response.getheader("Connection") == "close"
    assert "is not a number of bytes" in json.loads(response.read())["error"]["message"]
    client.close()


def test_a_stream_sends_no_chunk_for_an_empty_piece(served, monkeypatch):
    """A piece that adds no text (the bytes of a character not all out yet) is no event: the first event carries
    text (a chat's role comes with it), and none but the end is empty."""
    import runtime.server

    put = runtime.server._Tagged.put

    def with_empty_pieces(self, item):  # an empty piece before every piece the scheduler hands the stream
        put(self, "")
        put(self, item)

    monkeypatch.setattr(runtime.server._Tagged, "put", with_empty_pieces)
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    _, chunks, done = events(served, "/v1/completions", body)
    assert done and all(c["choices"][0]["text"] for c in chunks[:-1])
    whole = post(served, "/v1/completions", body)[2]["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_one_connection_serves_request_after_request(served):
    connection = http.client.HTTPConnection(*served.server_address[:2], timeout=60)
    for text in ("one", "two"):
        connection.request("POST", "/v1/completions", body=json.dumps({"prompt": text, "max_tokens": 2}))
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["choices"]
    connection.close()


@pytest.fixture
def slow_server(tiny_artifact):
    """One slot, a queue of one, every graph run 50 ms or more: a request stays running while the test acts."""
    engine = Engine.load(tiny_artifact)
    server, lines = serve(engine, slots=1, max_queue=1)
    scheduler = engine._scheduler
    run = scheduler.cache.run
    scheduler.cache.run = lambda *args: (time.sleep(0.05), run(*args))[1]
    yield server, lines
    stop(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_runs_for_many_waits_is_answered(slow_server, stream):
    """A 0.35 s step makes each wait for the next token outlast the server's 0.25 s look at its client; the look
    must not wait on the socket (its 60 s timeout, then a TimeoutError) and read the silence as a client gone."""
    server, lines = slow_server
    slowed = server.engine.scheduler.cache.run
    server.engine.scheduler.cache.run = lambda *args: (time.sleep(0.3), slowed(*args))[1]  # 0.35 s a step
    body = {"prompt": "x", "max_tokens": 4, "ignore_eos": True}
    started = time.monotonic()
    if stream:
        _, chunks, done = events(server, "/v1/completions", body)
        assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        status, _, response = post(server, "/v1/completions", body)
        assert status == 200 and response["usage"]["completion_tokens"] == 4
    assert time.monotonic() - started < 20 and not any("went away" in line for line in lines)


def test_a_full_queue_is_503_with_retry_after(slow_server):
    server, _ = slow_server
    running = server.engine.submit([1, 2, 3], max_new_tokens=100, ignore_eos=True)
    next(iter(running))
    waiting = server.engine.submit([1, 2], max_new_tokens=2)
    status, headers, body = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and headers["Retry-After"] == "1" and "--max-queue" in body["error"]["message"]
    assert "the server is full: 1 of 1 queue places taken, 1 of 1 slots busy" in body["error"]["message"], body
    assert body["error"]["type"] == "service_unavailable"
    running.cancel()
    assert waiting.result(timeout=30).finish_reason == "length"


def test_a_request_whose_choices_do_not_fit_the_queue_says_so(slow_server):
    """Its queued choices were withdrawn before the message was made: "full" with 0 waiting."""
    server, _ = slow_server
    running = server.engine.submit([1, 2, 3], max_new_tokens=100, ignore_eos=True)
    next(iter(running))
    status, _, body = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2})
    running.cancel()
    assert status == 503 and ("the server is full: its 2 choices need 2 places; 1 of 1 queue places taken, 1 of 1 "
                              "slots busy") in body["error"]["message"], body


def test_a_request_whose_later_choices_find_the_queue_full_runs_none_of_them(slow_server):
    """All of a request's choices run, or none: the first of two took the one place in the queue, the second found
    it full; the 503 must not leave the first queued, holding the place and running for no one."""
    server, _ = slow_server
    running = server.engine.submit([1, 2, 3], max_new_tokens=100, ignore_eos=True)
    next(iter(running))
    status, _, body = post(server, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    assert len(server.engine.scheduler._waiting) == 0
    running.cancel()


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_its_request_and_frees_the_slot(slow_server, stream):
    server, lines = slow_server
    connection = socket.create_connection(server.server_address[:2])
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 100, "ignore_eos": True, "stream": stream}).encode()
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    scheduler = server.engine._scheduler
    assert wait_for(lambda: scheduler._running[0] is not None)
    received = b""
    while stream and b"data: " not in received:  # the first event came: the request is streaming
        received += connection.recv(4096)
    connection.close()
    assert wait_for(lambda: any("client went away" in line for line in lines), 3.0)
    assert wait_for(lambda: scheduler._running[0] is None, 3.0)  # long before its 100 tokens' end (>= 5 s)
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    answered = {status: scrape(server.server_address).get(
        f'aotlm:http_requests_total{{model_name="tiny-random",route="/v1/completions",status="{status}"}}', 0)
        for status in ("200", "499")}
    assert answered == ({"200": 2, "499": 0} if stream else {"200": 1, "499": 1})  # a stream's 200 went out first
    # the request the client left still counts: its end (vLLM's abort), its TTFT and gaps (the latency histograms
    # had left out exactly the requests slow enough for users to give up on)
    label = 'model_name="tiny-random"'
    assert wait_for(lambda: scrape(server.server_address).get(
        f'aotlm:request_success_total{{{label},finished_reason="abort"}}') == 1, 3.0)
    series = scrape(server.server_address)
    assert series[f'aotlm:request_success_total{{{label},finished_reason="length"}}'] == 1  # the one after it
    assert series[f"aotlm:time_to_first_token_seconds_count{{{label}}}"] == 2


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_that_fails_while_running_is_500_and_the_server_goes_on(served, monkeypatch, stream):
    cache = served.engine._scheduler.cache
    monkeypatch.setattr(cache, "run", failing_run(cache.run, "decode", 2, "out of memory"))
    body = {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}
    if stream:
        _, chunks, done = events(served, "/v1/completions", body)
        assert done and "out of memory" in chunks[-1]["error"]["message"] and chunks[-1]["error"]["code"] == 500
    else:
        status, _, response = post(served, "/v1/completions", body)
        assert status == 500 and "out of memory" in response["error"]["message"]
    monkeypatch.undo()
    assert post(served, "/v1/completions", body)[0] == 200


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_that_fails_while_running_leaves_a_line_in_the_log(tiny_artifact, monkeypatch, stream):
    """A response's 500 was logged and a stream's error event was not: a stream that failed, or that a stop ended,
    left no trace on stderr."""
    server, lines = serve(Engine.load(tiny_artifact), slots=1)
    try:
        cache = server.engine._scheduler.cache
        monkeypatch.setattr(cache, "run", failing_run(cache.run, "decode", 2, "out of memory"))
        body = {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}
        if stream:
            assert "out of memory" in events(server, "/v1/completions", body)[1][-1]["error"]["message"]
        else:
            assert post(server, "/v1/completions", body)[0] == 500
        assert wait_for(lambda: any("out of memory" in line for line in lines), 3.0), lines
        # a stream's 200 went out before it failed: only the failure counter says so
        assert wait_for(lambda: scrape(server.server_address).get(
            'aotlm:request_failure_total{model_name="tiny-random"}') == 1, 3.0)
    finally:
        stop(server)


def test_aotlm_serve_prints_its_address_serves_and_stops_on_ctrl_c(tiny_artifact):
    # SIGINT as a terminal's: a suite started in the background (nohup, &) has it ignored, which the CLI keeps
    process = subprocess.Popen([sys.executable, "-m", "compiler.cli", "serve", str(tiny_artifact), "--port", "0"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = process.stdout.readline()
        assert first.startswith(f"serving {Engine.load(tiny_artifact).manifest['name']} at http://127.0.0.1:")
        host, port = first.split("http://")[1].removesuffix("/v1\n").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 3}))
        assert connection.getresponse().status == 200
        connection.close()
        taken = subprocess.run([sys.executable, "-m", "compiler.cli", "serve", str(tiny_artifact), "--port", port],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
        assert taken.returncode == 2 and "cannot listen on 127.0.0.1:" + port in taken.stderr
        assert "Traceback" not in taken.stderr
    finally:
        process.send_signal(signal.SIGINT)
        try:
            _, errors = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # no server left behind
            process.kill()
            raise
    assert process.returncode == 130 and "Traceback" not in errors
    assert "POST /v1/completions 200:" in errors


def in_thread(function, *args) -> Future:
    """function(*args) on a thread of its own; the future's result() is its return value, or raises its error."""
    future: Future = Future()

    def call():
        try:
            future.set_result(function(*args))
        except BaseException as error:  # noqa: BLE001 -- result() raises it in the test
            future.set_exception(error)
    threading.Thread(target=call, daemon=True).start()
    return future


def test_a_graceful_stop_finishes_the_requests_under_way_and_refuses_new_ones(slow_server):
    server, _ = slow_server
    idle = http.client.HTTPConnection(*server.server_address[:2], timeout=60)  # kept open across the stop
    idle.request("GET", "/health")
    assert idle.getresponse().read() and server.under_way == 0
    streamed = in_thread(events, server, "/v1/completions", {"prompt": "x", "max_tokens": 40, "ignore_eos": True})
    answered = in_thread(post, server, "/v1/completions", {"prompt": "y", "max_tokens": 40, "ignore_eos": True})
    assert wait_for(lambda: server.under_way == 2)
    server.shutdown()
    left = in_thread(server.drain, 60)
    assert wait_for(lambda: server.closing) and not left.done()  # ~80 steps of 50 ms to go, one slot
    idle.request("GET", "/health")
    health = idle.getresponse()
    assert health.status == 503 and json.loads(health.read()) == {"status": "shutting down"}
    idle.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 2}))
    refused = idle.getresponse()
    assert refused.status == 503 and "shutting down" in json.loads(refused.read())["error"]["message"]
    assert refused.getheader("Connection") == "close" and refused.getheader("Retry-After") == "1"
    idle.close()
    assert left.result(timeout=60) == 0
    _, chunks, done = streamed.result(timeout=10)
    assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"
    status, _, body = answered.result(timeout=10)
    assert status == 200 and body["usage"]["completion_tokens"] == 40


@pytest.mark.parametrize("stream", [False, True])
def test_requests_a_stop_outlasts_are_told_to_retry(slow_server, stream):
    server, lines = slow_server
    body = {"prompt": "x", "max_tokens": 100, "ignore_eos": True}
    outcome = in_thread(events if stream else post, server, "/v1/completions", body)
    assert wait_for(lambda: server.engine.scheduler.counts()[0] == 1)
    server.shutdown()
    assert server.drain(0.2) == 1
    server.engine.close()
    assert server.drain(30) == 0
    if stream:
        _, chunks, done = outcome.result(timeout=10)
        message = chunks[-1]["error"]["message"]
        assert done and chunks[-1]["error"]["code"] == 503
    else:
        status, _, response = outcome.result(timeout=10)
        message = response["error"]["message"]
        assert status == 503
    # accepted and partly served: not "takes no more requests", which told a client its request was never taken
    assert message == ("the server was stopped before this request finished; send this "
                       "one again, to another replica or once the server is back"), message


def test_a_request_whose_body_outlasts_the_stop_is_told_to_retry_not_run(slow_server):
    """Its body arrives after the engine closed: a 503, not a fresh scheduler started to run it (engine.submit
    would start one)."""
    server, _ = slow_server
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    client = socket.create_connection(server.server_address[:2], timeout=60)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5])
    assert wait_for(lambda: server.under_way == 1)
    server.shutdown()
    assert server.drain(0) == 1
    server.engine.close()
    client.sendall(body[5:])
    response = http.client.HTTPResponse(client)
    response.begin()
    assert response.status == 503 and "shutting down" in json.loads(response.read())["error"]["message"]
    client.close()
    assert server.drain(10) == 0 and server.engine.scheduler is None


@pytest.mark.parametrize("timeout, status", [(60, 200), (0, 503)])
def test_aotlm_serve_on_sigterm_waits_for_the_request_under_way_then_exits(tiny_artifact, timeout, status):
    """A request whose body is still arriving when SIGTERM comes is under way: the stop waits --shutdown-timeout for
    it and answers it (a stop that cut it off would leave the client a closed connection); past the timeout, it
    gets a 503 saying to send it again. Then the process exits: 0 when the request finished (uvicorn's; 143 marked a
    systemd unit failed), 143 when the stop had to cut it."""
    process = subprocess.Popen([sys.executable, "-m", "compiler.cli", "serve", str(tiny_artifact), "--port", "0",
                                "--shutdown-timeout", str(timeout)], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        host, port = process.stdout.readline().split("http://")[1].removesuffix("/v1\n").split(":")
        body = json.dumps({"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}).encode()
        client = socket.create_connection((host, int(port)), timeout=60)
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                       + body[:5])
        label = 'aotlm:http_requests_in_progress{model_name="tiny-random"}'
        assert wait_for(lambda: scrape((host, int(port)))[label] == 1)
        process.send_signal(signal.SIGTERM)
        said = "stopping: 1 request(s) under way" if timeout else "stopped 1 request(s) before they finished"
        assert any(line.startswith(said) for line in iter(process.stderr.readline, ""))
        client.sendall(body[5:])
        response = http.client.HTTPResponse(client)
        response.begin()
        answer = json.loads(response.read())
        assert response.status == status
        assert answer["usage"]["completion_tokens"] == 3 if status == 200 else "send this one again" in str(answer)
        client.close()
        assert process.wait(timeout=60) == (0 if status == 200 else 143)
        errors = process.stderr.read()
    finally:
        process.kill()
        process.communicate()
    said = "stopped: every request under way finished" if status == 200 else "terminated"
    assert said in errors and "Traceback" not in errors and "without an answer" not in errors


def test_aotlm_serve_stopped_as_soon_as_it_prints_its_url_exits_0(tiny_artifact):
    """The URL line came before the stop's handler: a supervisor that sent SIGTERM as soon as it read the URL got 143
    (2 of 5 tries), not the clean drain's 0. Three tries here."""
    for _ in range(3):
        process = subprocess.Popen([sys.executable, "-m", "compiler.cli", "serve", str(tiny_artifact), "--port", "0"],
                                   cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            assert "http://" in process.stdout.readline()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0, process.stderr.read()
        finally:
            process.kill()
            process.communicate()


def test_the_log_line_of_a_request_counts_its_tokens_and_says_whose_timings_it_shows(slow_server):
    server, lines = slow_server
    post(server, "/v1/completions", {"prompt": [5], "max_tokens": 2, "ignore_eos": True})
    post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "n": 2, "ignore_eos": True})
    post(server, "/v1/completions", {"prompt": [5], "max_tokens": 1})
    assert wait_for(lambda: len(lines) == 3)
    # what an operator looks for: how each ended, the queue and end-to-end times, and the id a user reports
    assert re.fullmatch(r"POST /v1/completions 200: 1 prompt token \(0 cached\), 2 out \(length\); queue [\d.]+ "
                        r"ms, TTFT [\d.]+ ms, TPOT [\d.]+ ms, E2E [\d.]+ ms; cmpl-[0-9a-f]+; req-[0-9a-f]{32}",
                        lines[0]), lines[0]
    assert lines[1].startswith("POST /v1/completions 200: 2 prompt tokens (0 cached), 4 out (length) over 2 "
                               "choices; choice 0: queue ")
    assert ", TPOT -, " in lines[2]  # one token: no time per output token (it read 0.00 ms)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stopped", [False, True])
def test_an_output_that_ends_inside_a_character_joins_to_its_text(served, stream, stopped):
    """Byte 228 (0xE2) begins a 3-byte character; an output that ends on it reads U+FFFD in its text, so its last
    token's text must show it too, and a stop token after it only its own "</s>" (the U+FFFD had been no token's, or
    the stop token's, whose offset then found "\ufffd" where its text said "\ufffd</s>")."""
    body = {"prompt": "Hi", "max_tokens": 2, "logprobs": 1, "logit_bias": {"228": 50}, "temperature": 0,
            "ignore_eos": True}
    if stopped:  # 228, then the end-of-sequence token
        body = {**body, "max_tokens": 4, "min_tokens": 1, "logit_bias": {"228": 50, "2": 100}, "ignore_eos": False}
    logprobs, text = completion_logprobs(served, body, stream)
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    if stopped:
        assert (text, tokens, offsets) == ("\ufffd", ["\ufffd", "</s>"], [0, 1])
    else:
        assert text == "\ufffd\ufffd" and "".join(tokens) == text and offsets == [0, 0], (tokens, text)


def test_a_model_is_retrieved_by_its_id_as_openais_client_asks(served):
    """OpenAI's client.models.retrieve(id) asks GET /v1/models/{id}, the id percent-encoded (a name with a slash reads
    "org%2Fname"): the model /v1/models lists; another id is a 404 that names the model served."""
    name = served.engine.manifest["name"]
    listed = request(served, "GET", "/v1/models")[2]["data"][0]
    assert request(served, "GET", f"/v1/models/{name}")[::2] == (200, listed)
    status, _, body = request(served, "GET", "/v1/models/gpt-4")
    assert (status, body["error"]["type"], body["error"]["param"]) == (404, "not_found_error", "model")
    assert repr(name) in body["error"]["message"]
    named = ApiServer(served.engine, port=0, model_name="org/tiny")  # the same engine under a name with a slash
    named.start()
    try:
        status, _, model = request(named, "GET", "/v1/models/org%2Ftiny")
        assert (status, model["id"], model["object"]) == (200, "org/tiny", "model")
        assert request(named, "GET", "/v1/models/org/tiny")[::2] == (200, model)  # clients that do not encode it
    finally:
        named.shutdown()
        named.server_close()


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_texts_join_to_the_text_where_characters_span_many_tokens(served, stream):
    """The tiny tokenizer spells "👌🏼" in 8 one-byte tokens. A token's text is read after the CONTEXT_TOKENS before
    it; for 🏼's last byte those begin inside 👌, whose cut bytes decode to U+FFFD: they are not the partial character
    just before it (stripped as one), so they must not land in its text ("\\ufffd🏼")."""
    prompt = "👌🏼 é"
    count = len(served.engine.prompt_ids(prompt))
    body = {"prompt": prompt, "max_tokens": 1, "logprobs": 0, "echo": True, "temperature": 0}
    logprobs, text = completion_logprobs(served, body, stream)
    tokens, offsets = logprobs["tokens"][:count], logprobs["text_offset"][:count]
    assert "".join(tokens) == prompt and text.startswith(prompt), tokens
    assert all(text.startswith(token, offset) for token, offset in zip(tokens, offsets))


@pytest.mark.parametrize("field, value", [("service_tier", "auto"), ("reasoning_effort", "low"),
                                          ("web_search_options", {}), ("metadata", {"a": "b"})])
def test_openais_own_fields_the_server_lacks_are_refused_as_such_not_taken_for_typos(chat_served, field, value):
    """OpenAI's client has these as arguments of chat.completions.create; a look-alike suggestion ("store: did you
    mean stream?", "reasoning_effort: did you mean response_format?") would point at another field entirely."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, field: value}
    status, _, error = post(chat_served, "/v1/chat/completions", body)
    assert (status, error["error"]["param"]) == (400, field)
    assert error["error"]["message"] == f"{field}: OpenAI's field is not supported by this server"


def test_store_false_asks_for_what_the_server_does_anyway(chat_served):
    """OpenAI's store=False (keep no copy of the exchange) is what this server does: served, where store=True and
    store=0 (not the boolean OpenAI takes) are refused, saying what to send."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert post(chat_served, "/v1/chat/completions", {**body, "store": False})[0] == 200
    assert post(chat_served, "/v1/chat/completions", {**body, "store": 0})[0] == 400
    status, _, error = post(chat_served, "/v1/chat/completions", {**body, "store": True})
    assert (status, error["error"]["message"]) == (400, "store: this server keeps no responses: send store false, or "
                                                        "leave it out")


def test_metrics_label_a_models_route_once_whatever_name_was_asked(served):
    """/v1/models/{model} is one route label: a label per name asked for would let any client grow the metric's
    series without bound (the comment said so; no test held it: a mutation audit)."""
    for name in ("tiny-random", "someone-else", "a%2Fb"):
        request(served, "GET", f"/v1/models/{name}")
    routes = {key for key in scrape(served.server_address) if key.startswith("aotlm:http_requests_total")}
    asked = [key for key in routes if "/v1/models/" in key]
    assert asked and all('route="/v1/models/{model}"' in key for key in asked), asked


def test_a_connection_refused_at_max_connections_is_counted_and_a_bug_is_logged_with_its_frames(tiny_artifact,
                                                                                                 monkeypatch):
    """A refused connection reached the log only (and --quiet hid it); a 500 from a bug was one line with no place."""
    import runtime.openai_api

    server, lines = serve(Engine.load(tiny_artifact), slots=1)
    try:
        server.max_connections = 1
        held = socket.create_connection(server.server_address[:2])
        held.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        held.recv(4096)  # its thread serves it: one connection open
        refused = socket.create_connection(server.server_address[:2])
        refused.settimeout(10)
        assert refused.recv(4096).startswith(b"HTTP/1.1 503")
        refused.close()
        held.close()
        assert wait_for(lambda: server._connections == 0, 5.0)
        server.max_connections = 8
        assert scrape(server.server_address)['aotlm:http_connections_refused_total{model_name="tiny-random"}'] == 1

        def broken(*args, **kwargs):
            raise KeyError("choices")

        monkeypatch.setattr(runtime.openai_api, "response", broken)
        assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 500
        line = next(line for line in lines if "KeyError" in line)
        assert "at File " in line and "in broken" in line, line  # where it was raised, on one line
    finally:
        stop(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_metrics_are_recorded_before_its_last_bytes_go_out(served, monkeypatch, stream):
    """A client that scrapes /metrics right after its answer (a kept-alive stream ends at its last chunk, before the
    handler returns) must find its request there."""
    import runtime.server

    counts = []
    ttft = served.metrics._histograms["time_to_first_token_seconds"]
    if stream:
        write = runtime.server._Handler._write_stream

        def watched(self, data, last=False):
            if last:
                counts.append(sum(ttft.counts))
            return write(self, data, last)

        monkeypatch.setattr(runtime.server._Handler, "_write_stream", watched)
    else:
        send_json = runtime.server._Handler._send_json

        def watched(self, status, body, headers=None):
            counts.append(sum(ttft.counts))
            return send_json(self, status, body, headers)

        monkeypatch.setattr(runtime.server._Handler, "_send_json", watched)
    before = sum(ttft.counts)
    body = {"prompt": "x", "max_tokens": 2, "ignore_eos": True}
    events(served, "/v1/completions", body) if stream else post(served, "/v1/completions", body)
    assert counts == [before + 1]


def test_a_finished_stream_whose_last_bytes_fail_is_not_logged_as_cancelled(tiny_artifact, monkeypatch):
    """Every choice ended and its 200 line is logged; the end's write then fails (a client that stopped reading):
    the log says the last bytes were lost, not that the (finished) requests were cancelled."""
    import runtime.server

    write = runtime.server._Handler._write_stream

    def cut(self, data, last=False):
        if last:
            raise ConnectionResetError("the client reset the connection")
        return write(self, data, last)

    server, lines = serve(Engine.load(tiny_artifact), slots=2)
    try:
        monkeypatch.setattr(runtime.server._Handler, "_write_stream", cut)
        connection = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
        connection.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "x", "max_tokens": 2, "ignore_eos": True, "stream": True}))
        with pytest.raises(http.client.IncompleteRead):  # the chunks before the end, then the connection's close
            connection.getresponse().read()
        connection.close()
        assert wait_for(lambda: any("went away" in line for line in lines), 5.0), lines
    finally:
        stop(server)
    assert any(" 200: " in line for line in lines), lines
    assert not any("cancelled" in line for line in lines), lines
    assert any("before the response's last bytes went out" in line for line in lines), lines


@pytest.mark.parametrize("fields, said", [
    ({"logprobs": True}, "logprobs: true must be an integer in 0..20"),  # Python's True, to a JSON client
    ({"ignore_eos": "false"}, "must be true or false"),
    ({"stream_options": {"include_usag": True}}, 'stream_options: {"include_usag": true} must be an object'),
])
def test_errors_spell_json_values_as_json_does(served, fields, said):
    status, _, body = post(served, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **fields})
    assert status == 400 and said in body["error"]["message"], body
    assert "True" not in body["error"]["message"] and "False" not in body["error"]["message"]


@pytest.mark.parametrize("fields, quoted", [
    ({"model": "x=True"}, "'x=True'"), ({"Debug=True": 1}, "'Debug=True'"),
    ({"logit_bias": {"x=True": 1}}, "'x=True'"),
])
def test_the_clients_own_text_is_quoted_as_sent(served, fields, quoted):
    """The rewrite of Python's True had reached quoted values: model 'x=True' came back as 'x: true'."""
    status, _, body = post(served, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **fields})
    assert status in (400, 404) and quoted in body["error"]["message"], body


def test_a_refusal_about_one_of_several_prompts_names_it(served):
    status, _, body = post(served, "/v1/completions", {"prompt": ["hi", ""], "max_tokens": 2})
    assert status == 400 and body["error"]["message"].startswith("prompt[1]: the prompt is empty"), body
    status, _, body = post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["\ud800"]})
    assert status == 400 and body["error"]["param"] == "stop", body  # it was null


def test_min_tokens_past_the_default_max_tokens_says_where_that_limit_comes_from(served):
    """It named "the most new tokens asked for (16)", a number the client never sent."""
    status, _, body = post(served, "/v1/completions", {"prompt": "hi", "min_tokens": 3000})
    message = body["error"]["message"]
    assert status == 400 and message.startswith("min_tokens: 3000") and message.endswith(
        "(no max_tokens was given: its default here is 16, OpenAI's 16, or what the context leaves when less)"), body
    status, _, body = post(served, "/v1/completions", {"prompt": "hi", "min_tokens": -1})
    assert status == 400 and "no max_tokens was given" not in body["error"]["message"], body  # not about the limit
    status, _, body = post(served, "/v1/completions", {"prompt": "hi", "min_tokens": 3000, "temperature": -1})
    assert status == 400 and "no max_tokens was given" not in body["error"]["message"], body  # another field's
    status, _, body = post(served, "/v1/completions", {"prompt": "hi", "n": [1] * 100})
    assert body["error"]["message"].startswith("n: [1, 1") and "(300 characters)" in body["error"]["message"], body


def test_created_is_when_the_request_was_taken_streamed_or_not(tiny_engine, monkeypatch):
    """A non-streamed response said when its answer was built (10 s after the request on a long generation), a
    streamed one when the request came: vLLM takes both at the request's start."""
    from runtime import openai_api

    clock = [1_700_000_000.0]
    monkeypatch.setattr(openai_api, "time", SimpleNamespace(time=lambda: clock[0]))
    request = openai_api.parse(tiny_engine, {"prompt": "hi", "max_tokens": 2}, chat=False,
                               model_name=tiny_engine.manifest["name"])
    result = tiny_engine.generate(request.choices[0].prompt_ids, max_new_tokens=2)
    clock[0] += 10  # the generation's time
    body = openai_api.response(tiny_engine, request, "cmpl-1", tiny_engine.manifest["name"], [result])
    assert body["created"] == 1_700_000_000


def test_a_restart_binds_the_port_its_closed_connections_left_in_time_wait(tiny_artifact):
    """The listener's SO_REUSEADDR was off (cleared after the bind), so the connections it accepted, and the TIME_WAIT
    sockets they left when the server closed first, had it off: a restart could not bind the port for a minute."""
    engine = Engine.load(tiny_artifact)
    server, _ = serve(engine)
    port = server.server_address[1]
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/health", headers={"Connection": "close"})  # the server closes first
        assert connection.getresponse().status == 200
        connection.close()
    finally:
        stop(server)
    again = ApiServer(engine, port=port)  # binds (bind_socket) and listens (server_activate), as a restart does
    again.server_close()


def test_every_interface_on_ipv6_takes_ipv4_too_and_names_resolve_to_their_family(monkeypatch):
    """"::" was IPv6 only where the system defaults to it (net.ipv6.bindv6only=1, Windows, the BSDs); a name with only
    IPv6 addresses was looked up for IPv4 ("Name or service not known")."""
    from runtime.server import bind_socket

    class IPv6Only(socket.socket):  # a host whose IPv6 sockets default to IPv6 only (net.ipv6.bindv6only=1)
        def __init__(self, family=-1, *args, **kwargs):
            super().__init__(family, *args, **kwargs)
            if self.family == socket.AF_INET6:
                self.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)

    with monkeypatch.context() as patched:
        patched.setattr(socket, "socket", IPv6Only)
        every = bind_socket("::", 0)
    try:
        every.listen()
        with socket.create_connection(("127.0.0.1", every.getsockname()[1]), timeout=10):
            pass  # an IPv4 client reaches "::"
    finally:
        every.close()
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *rest: real("::1" if host == "v6name" else host, *rest))
    named = bind_socket("v6name", 0)
    try:
        assert named.family == socket.AF_INET6 and named.getsockname()[0] == "::1"
    finally:
        named.close()
    both = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args: both)  # "localhost" where ::1 comes first
    local = bind_socket("localhost", 0)
    try:
        assert local.family == socket.AF_INET  # IPv4 first, as the clients that try 127.0.0.1 expect
    finally:
        local.close()


def test_the_server_makes_no_reverse_lookup(tiny_artifact, monkeypatch):
    """http.server's getfqdn, whose result nothing read, held readiness for a silent resolver's 10 s."""
    monkeypatch.setattr(socket, "getfqdn", lambda *args: pytest.fail("a reverse lookup"))
    server = ApiServer(Engine.load(tiny_artifact), port=0)
    try:
        assert server.server_name == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
    finally:
        server.server_close()


def test_a_library_caller_gets_a_word_for_an_empty_host_and_may_bracket_ipv6(tiny_engine):
    """ApiServer(engine, "") had listened on every interface; through getaddrinfo it became a bare gaierror."""
    from runtime.server import bind_socket

    for host in ("", " 127.0.0.1"):
        with pytest.raises(ValueError, match="give an address or a name without spaces"):
            ApiServer(tiny_engine, host, 0)
    bracketed = bind_socket("[::1]", 0)
    try:
        assert bracketed.getsockname()[0] == "::1"
    finally:
        bracketed.close()
