"""Prefix caching on the batch-1 path (Engine.load(prefix_caching=True)): a prompt that begins with what the cache
holds from the previous request prefills only the rest, and makes the tokens a whole prefill makes."""
from __future__ import annotations

import numpy as np
import pytest

import runtime.engine
from runtime import Engine, RequestError


@pytest.fixture
def cached(tiny_artifact):
    return Engine.load(tiny_artifact, prefix_caching=True)


def turns(engine: Engine, first: list[int], count: int, seed: int = 0):
    """A conversation: each prompt is the previous prompt, its reply and a new message (10 tokens)."""
    rng, prompt, results = np.random.default_rng(seed), list(first), []
    for _ in range(count):
        results.append(engine.generate(prompt, max_new_tokens=6, stop_token_ids=()))
        prompt = prompt + results[-1].token_ids + rng.integers(3, 500, size=10).tolist()
    return results


def test_each_turn_reuses_the_previous_turns_tokens_and_makes_the_same_tokens(cached, tiny_engine):
    first = [1] + list(range(40, 70))
    ours, plain = turns(cached, first, 4), turns(tiny_engine, first, 4)
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain]
    # the cache holds the previous prompt and its output but the last token (sampled, never fed back)
    expected = [0] + [len(r.prompt_token_ids) + len(r.token_ids) - 1 for r in ours[:-1]]
    assert [r.timings.cached_prompt_tokens for r in ours] == expected
    assert [r.timings.cached_prompt_tokens for r in plain] == [0] * 4  # off by default
    assert ours[1].timings.summary()["cached_prompt_tokens"] == expected[1]


def test_the_rest_runs_in_bounded_pieces_and_its_logits_equal_a_whole_prefill(cached, tiny_engine, monkeypatch):
    monkeypatch.setattr(runtime.engine, "PREFIX_REST_TOKENS", 4)
    calls = []
    run = cached.backend.run
    monkeypatch.setattr(cached.backend, "run", lambda phase, ids, *rest: calls.append((phase, ids.shape[1])) or run(
        phase, ids, *rest))
    prompt = [1] + list(range(100, 140))
    cached.generate(prompt, max_new_tokens=1, stop_token_ids=())
    longer = prompt + list(range(200, 211))  # 11 more: pieces of 4, 4 and 3
    calls.clear()
    written: list[int] = list(longer[:len(prompt)])
    mask = np.ones((1, cached.max_context), dtype=np.int64)
    ours = cached._prefill_rest(longer, len(prompt), mask, written)
    assert calls == [("decode", 4), ("decode", 4), ("decode", 3)]
    whole = tiny_engine.backend.run("prefill", np.array([longer]), np.arange(len(longer))[None],
                                    np.ones((1, len(longer)), dtype=np.int64))
    np.testing.assert_allclose(ours, runtime.engine.last_token_logits(whole, [len(longer)])[0], atol=1e-5)


def test_the_same_prompt_again_runs_only_its_last_token(cached, tiny_engine):
    prompt = [1] + list(range(10, 50))
    first = cached.generate(prompt, max_new_tokens=5, stop_token_ids=())
    again = cached.generate(prompt, max_new_tokens=5, stop_token_ids=())
    assert again.timings.cached_prompt_tokens == len(prompt) - 1
    assert again.token_ids == first.token_ids == tiny_engine.generate(prompt, max_new_tokens=5,
                                                                      stop_token_ids=()).token_ids


@pytest.mark.parametrize("prefix, rest", [(10, 5), (20, 50)])
def test_a_short_prefix_is_not_worth_reusing(cached, prefix, rest):
    """Fewer than PREFIX_MIN_TOKENS, or less than half the rest: the prefill graph computes it faster."""
    common = [1] + list(range(300, 300 + prefix - 1))
    cached.generate(common + [5, 6], max_new_tokens=2, stop_token_ids=())
    result = cached.generate(common + list(range(7, 7 + rest)), max_new_tokens=2, stop_token_ids=())
    assert result.timings.cached_prompt_tokens == 0


def test_any_other_run_on_the_cache_ends_the_reuse(cached, tiny_engine):
    prompt = [1] + list(range(60, 100))
    cached.generate(prompt, max_new_tokens=3, stop_token_ids=())
    other = [1] + list(range(400, 440))  # as evaluation or a benchmark would, straight on the backend
    cached.backend.run("prefill", np.array([other]), np.arange(len(other))[None], np.ones((1, 41), dtype=np.int64))
    result = cached.generate(prompt, max_new_tokens=3, stop_token_ids=())
    assert result.timings.cached_prompt_tokens == 0
    assert result.token_ids == tiny_engine.generate(prompt, max_new_tokens=3, stop_token_ids=()).token_ids


def test_a_stream_left_early_leaves_what_it_wrote(cached, tiny_engine):
    prompt = [1] + list(range(20, 60))
    stream = cached.stream(prompt, max_new_tokens=30, stop_token_ids=())
    for index, _ in enumerate(stream):
        if index == 3:
            break
    result = cached.generate(prompt + [7, 8], max_new_tokens=4, stop_token_ids=())
    assert result.timings.cached_prompt_tokens == len(prompt)  # the prompt; its outputs differ from 7, 8
    assert result.token_ids == tiny_engine.generate(prompt + [7, 8], max_new_tokens=4, stop_token_ids=()).token_ids


def test_a_failed_run_ends_the_reuse(cached, monkeypatch):
    prompt = [1] + list(range(60, 100))
    cached.generate(prompt, max_new_tokens=3, stop_token_ids=())
    run = cached.backend.run

    def failing(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(cached.backend, "run", failing)
    with pytest.raises(RuntimeError):
        cached.generate(prompt + list(range(5, 25)), max_new_tokens=3, stop_token_ids=())
    monkeypatch.setattr(cached.backend, "run", run)
    cached.backend.runs += 1  # what the failed run did to the count (the stand-in above does not)
    assert cached.generate(prompt, max_new_tokens=3, stop_token_ids=()).timings.cached_prompt_tokens == 0


def test_prefix_caching_must_be_a_bool(tiny_artifact):
    with pytest.raises(RequestError, match="prefix_caching must be True or False, got 'yes'"):
        Engine.load(tiny_artifact, prefix_caching="yes")
