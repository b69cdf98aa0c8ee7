"""Sampling options beyond temperature, top-k and top-p, on every path a request takes: the repetition penalty
(transformers'), presence and frequency penalties (OpenAI's formula), and log-probabilities in the result."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from runtime import RequestError
from runtime.sampling import Sampler, SamplingParams


def steps(vocab: int, count: int, seed: int = 0) -> np.ndarray:
    """Logit rows whose top tokens repeat from row to row (a few large entries), so that penalties change picks."""
    rng = np.random.default_rng(seed)
    rows = rng.normal(0, 1, size=(count, vocab)).astype(np.float32)
    rows[:, :4] += np.float32(3.0)  # tokens 0..3 lead every row: unpenalized greedy repeats them
    rows[:, 4] = -rows[:, 4] ** 2 - 1  # one always-negative logit: multiplied, not divided
    return rows


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_equals_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    processor = RepetitionPenaltyLogitsProcessor(penalty)
    prompt = [4, 9, 9, 17]
    sampler = Sampler(SamplingParams(repetition_penalty=penalty), prompt)
    history, changed = list(prompt), 0
    for row in steps(32, 24):
        theirs = processor(torch.tensor([history]), torch.tensor(row[None]).clone())[0].numpy()
        np.testing.assert_allclose(sampler._penalize(row), theirs, rtol=1e-6)
        token = sampler(row)
        assert token == int(np.argmax(theirs))
        changed += token != int(np.argmax(row))
        history.append(token)
    assert changed > 0  # the penalty changed picks: the comparison covers it


def test_presence_and_frequency_penalties_follow_openais_formula():
    """logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty, over the output only."""
    sampler = Sampler(SamplingParams(presence_penalty=0.25, frequency_penalty=0.5), prompt_ids=[1])
    for token in (2, 2, 3):
        forced = np.zeros(6, dtype=np.float32)
        forced[token] = 100.0
        assert sampler(forced) == token
    flat = np.zeros(6, dtype=np.float32)
    np.testing.assert_array_equal(sampler._penalize(flat), [0, 0, -1.25, -0.75, 0, 0])  # the prompt's 1: untouched
    assert not flat.any()  # the step's row is not written to
    assert sampler(flat) == 0


@pytest.mark.parametrize("penalty, penalized", [(dict(presence_penalty=0.25), [0, 0, -0.25, -0.25, 0, 0]),
                                                (dict(frequency_penalty=0.5), [0, 0, -1.0, -0.5, 0, 0])])
def test_presence_or_frequency_penalty_alone_applies(penalty, penalized):
    """Each is an option of its own: a request that sets only one is penalized by it (the formula test sets both)."""
    sampler = Sampler(SamplingParams(**penalty), prompt_ids=[1])
    for token in (2, 2, 3):
        forced = np.zeros(6, dtype=np.float32)
        forced[token] = 100.0
        assert sampler(forced) == token
    np.testing.assert_array_equal(sampler._penalize(np.zeros(6, dtype=np.float32)), penalized)
    assert sampler(np.array([0, 0, 0.2, 0, 0, 0], dtype=np.float32)) == 0  # token 2 led, by less than its penalty


def test_unpenalized_requests_keep_no_history():
    sampler = Sampler(SamplingParams(), prompt_ids=list(range(1000)))
    row = steps(16, 1)[0]
    assert sampler(row) == sampler(row) == int(np.argmax(row))
    assert not sampler._seen and not sampler._output_counts


@pytest.mark.parametrize("options, message", [
    (dict(repetition_penalty=0.0), "repetition_penalty: 0.0 must be a finite number > 0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty: nan must be a finite number > 0"),
    (dict(repetition_penalty="1.2"), "repetition_penalty: '1.2' must be a finite number > 0"),
    # 0 and inf once converted to the logits' float32: a divide-by-zero warning, then an inf logit
    (dict(repetition_penalty=1e-300),
     "repetition_penalty: 1e-300 must be a finite number > 0 within float32's range \\(1.4e-45"),
    (dict(repetition_penalty=1e300), "repetition_penalty: 1e\\+300 must be a finite number > 0 within float32's range"),
    (dict(presence_penalty=2.5), r"presence_penalty: 2.5 must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=float("-inf")), r"frequency_penalty: -inf must be a number in \[-2, 2\]"),
])
def test_bad_penalties_are_refused(options, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**options)


def test_a_penalty_that_overflows_the_logits_is_a_request_error():
    """Any finite penalty > 0 is accepted, but a tiny one divides a positive logit to infinity: numpy then failed
    inside its sampling ("probabilities contain NaN")."""
    sampler = Sampler(SamplingParams(repetition_penalty=1e-39, temperature=1.0, seed=0), prompt_ids=[0, 1])
    with pytest.raises(RequestError, match="repetition_penalty: 1e-39 overflows the logits"):
        sampler(np.array([1.0, 2.0, 0.5], dtype=np.float32))
    everything_seen = Sampler(SamplingParams(repetition_penalty=3e38, temperature=1.0, seed=0), prompt_ids=[0, 1, 2])
    with pytest.raises(RequestError, match="drives every token's logit to -infinity"):  # was numpy's ValueError
        everything_seen(np.array([-2.0, -3.0, -4.0], dtype=np.float32))


def test_penalized_requests_under_batching_make_their_alone_tokens(tiny_engine):
    """The history is per request: a batch neighbour's tokens never penalize another row."""
    cases = [dict(repetition_penalty=1.5), dict(presence_penalty=1.0, frequency_penalty=0.7),
             dict(repetition_penalty=1.2, temperature=0.9, seed=4), {}]
    prompt = [1, 30, 31, 32, 30]
    try:
        expected = [tiny_engine.generate(prompt, max_new_tokens=24, ignore_eos=True, **case).token_ids
                    for case in cases]
        assert len({tuple(tokens) for tokens in expected}) == len(cases)  # each setting changed the tokens
        handles = [tiny_engine.submit(prompt, max_new_tokens=24, ignore_eos=True, **case) for case in cases]
        assert [handle.result(timeout=60).token_ids for handle in handles] == expected
    finally:
        tiny_engine.close()


def test_cli_run_passes_the_penalties(tiny_artifact, capsys):
    from compiler.cli import main
    from runtime import Engine

    assert main(["run", str(tiny_artifact), "--prompt", "hello", "--max-new-tokens", "12",
                 "--repetition-penalty", "1.6", "--frequency-penalty", "0.5"]) == 0
    expected = Engine.load(tiny_artifact).generate("hello", max_new_tokens=12, repetition_penalty=1.6,
                                                   frequency_penalty=0.5)
    assert capsys.readouterr().out == "hello" + expected.text + "\n"
    assert main(["run", str(tiny_artifact), "--prompt", "hello", "--presence-penalty", "3"]) == 2


# -- the sampling distribution ---------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [dict(temperature=0.7), dict(temperature=1.0, top_k=5),
                                     dict(temperature=1.3, top_p=0.8), dict(temperature=0.9, min_p=0.05),
                                     dict(temperature=1.1, top_k=12, top_p=0.9, min_p=0.1)])
def test_the_distribution_sampled_from_equals_transformers_warpers(options):
    """Temperature, then top-k, top-p and min-p, as transformers' generate chains its logits warpers."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = [TemperatureLogitsWarper(options["temperature"])]
    if "top_k" in options:
        warpers.append(TopKLogitsWarper(options["top_k"]))
    if "top_p" in options:
        warpers.append(TopPLogitsWarper(options["top_p"]))
    if "min_p" in options:
        warpers.append(MinPLogitsWarper(options["min_p"]))
    sampler = Sampler(SamplingParams(seed=0, **options))
    for row in np.random.default_rng(3).normal(0, 2, size=(20, 64)):
        scores = torch.tensor(row[None], dtype=torch.float64)
        for warper in warpers:
            scores = warper(torch.zeros((1, 1), dtype=torch.long), scores)
        theirs = torch.softmax(scores, dim=-1)[0].numpy()
        np.testing.assert_allclose(sampler.distribution(row), theirs, rtol=1e-9, atol=1e-12)
    kept = (sampler.distribution(row) > 0).sum()
    assert kept < 64 or options == dict(temperature=0.7)  # each filter removed tokens: the comparison covers it


def test_logprobs_alternatives_that_tie_go_to_the_lower_token_id_and_greedy_is_one_token():
    from runtime.sampling import _logprobs

    logits = np.array([0.0, 1.0, 3.0, 3.0, 3.0, 2.0], dtype=np.float32)
    assert list(_logprobs(logits, 5, 2)) == [5, 2, 3]  # of the three tied at 3.0, the two lowest ids
    assert list(_logprobs(logits, 5, 1)) == [5, 2]  # one alternative (argmax's path): the lowest id too
    wide = np.random.default_rng(0).standard_normal(49152).astype(np.float32) * 4  # a real vocabulary's width
    reference = wide.astype(np.float64) - wide.max()
    reference -= np.log(np.exp(reference).sum())
    entry = _logprobs(wide, 7, 3)
    assert list(entry)[1:] == list(np.argsort(-reference, kind="stable")[:3])
    assert [entry[t] for t in entry] == pytest.approx([reference[t] for t in entry], abs=1e-7)
    assert list(_logprobs(logits, 0, 10)) == [0, 2, 3, 4, 5, 1]  # more than the vocabulary: all of it, by rank
    np.testing.assert_array_equal(Sampler(SamplingParams()).distribution(logits), [0, 0, 1, 0, 0, 0])


@pytest.mark.parametrize("magnitude", [1e9, 1e18, 3e38])
def test_logprobs_stay_exact_at_huge_logits_and_say_nothing_of_an_overflow(magnitude):
    """A broken build's absurd logits are debugged with logprobs: largest + log(sum) lost the difference to rounding
    (three tied tokens each read 0, probabilities summing to 3, from 1e18), and a span past float32 warned."""
    import warnings

    from runtime.sampling import _logprobs

    tied = np.full(3, magnitude, dtype=np.float32)
    assert _logprobs(tied, 0, 2) == pytest.approx({0: -np.log(3), 1: -np.log(3)}, abs=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spread = _logprobs(np.array([magnitude, -magnitude, 0.0], dtype=np.float32), 1, 1)
    assert spread[0] == 0.0 and spread[1] == pytest.approx(-2 * float(np.float32(magnitude)), rel=1e-6)


def test_top_p_reached_exactly_keeps_no_more_tokens():
    """The smallest set of likeliest tokens whose mass reaches top_p, as transformers' TopPLogitsWarper keeps: four
    equally likely tokens (0.25 each, exact in floats) and top_p 0.5 keep two, not three."""
    from transformers import TopPLogitsWarper

    theirs = TopPLogitsWarper(0.5)(torch.zeros((1, 1), dtype=torch.long), torch.zeros((1, 4), dtype=torch.float64))
    assert int(torch.isfinite(theirs).sum()) == 2
    distribution = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0)).distribution(np.zeros(4))
    assert sorted(distribution) == [0.0, 0.0, 0.5, 0.5]


def test_top_p_of_zero_is_refused():
    """(0, 1], vLLM's range: the likeliest token alone is greedy decoding (temperature 0) or top_k 1."""
    with pytest.raises(RequestError, match=r"top_p: 0.0 must be a number in \(0, 1\]"):
        SamplingParams(top_p=0.0)


def test_min_p_is_refused_outside_0_1():
    with pytest.raises(RequestError, match=r"min_p: 1.5 must be a number in \[0, 1\]"):
        SamplingParams(min_p=1.5)


# -- logprobs --------------------------------------------------------------------------------------------------
def test_logprobs_are_the_models_log_softmax_at_each_output_token(tiny_engine):
    """Checked against the same artifact's logits for the whole sequence, teacher-forced through evaluation's
    path (one decode run over prompt + output), and its log-softmax."""
    from runtime.evaluate import decode_logits_for, log_softmax

    prompt = [1, 30, 31, 32, 30]
    try:
        for run in (lambda **k: tiny_engine.generate(prompt, **k),
                    lambda **k: tiny_engine.submit(prompt, **k).result(timeout=60)):
            result = run(max_new_tokens=12, ignore_eos=True, logprobs=3, temperature=0.8, seed=5,
                         repetition_penalty=1.3)
            full = np.array(prompt + result.token_ids)
            expected = log_softmax(decode_logits_for(tiny_engine)(full))[len(prompt) - 1:-1]  # rows predicting outputs
            assert len(result.logprobs) == len(result.token_ids) == 12
            for row, token, got in zip(expected, result.token_ids, result.logprobs):
                top = [int(i) for i in np.argsort(-row, kind="stable")[:3]]
                assert list(got) == [token] + [i for i in top if i != token]  # the chosen first, then the top 3
                np.testing.assert_allclose([got[i] for i in got], [row[i] for i in got], atol=1e-4)
    finally:
        tiny_engine.close()


def test_logprobs_stop_where_the_tokens_do_and_are_off_by_default(tiny_engine):
    prompt = [1, 30, 31, 32, 30]
    free = tiny_engine.generate(prompt, max_new_tokens=10, ignore_eos=True, logprobs=0)
    assert [list(entry) for entry in free.logprobs] == [[token] for token in free.token_ids]
    stopped = tiny_engine.generate(prompt, max_new_tokens=10, stop_token_ids=(free.token_ids[4],), logprobs=0)
    assert stopped.finish_reason == "stop" and stopped.logprobs == free.logprobs[:4]  # none for the stop token
    assert tiny_engine.generate(prompt, max_new_tokens=3, ignore_eos=True).logprobs is None
    with pytest.raises(RequestError, match=r"logprobs: 21 must be an integer in 0..20"):
        SamplingParams(logprobs=21)


def test_cli_run_passes_min_p_and_refuses_it_with_greedy_decoding(tiny_artifact, capsys):
    from compiler.cli import main
    from runtime import Engine

    assert main(["run", str(tiny_artifact), "--prompt", "hello", "--max-new-tokens", "12", "--temperature", "0.9",
                 "--min-p", "0.2", "--seed", "3"]) == 0
    expected = Engine.load(tiny_artifact).generate("hello", max_new_tokens=12, temperature=0.9, min_p=0.2, seed=3)
    assert capsys.readouterr().out == "hello" + expected.text + "\n"
    assert main(["run", str(tiny_artifact), "--prompt", "hello", "--min-p", "0.2"]) == 2
    assert "--min-p: it shapes sampling, but --temperature 0" in capsys.readouterr().err


# -- ignore_eos ------------------------------------------------------------------------------------------------
def _eos_at_third_token(engine, prompt, count: int) -> list[int]:
    """Make the engine's end-of-sequence token the third of its greedy tokens for `prompt` (the first that differs
    from the two before it), so that a request stops there unless it ignores end-of-sequence tokens."""
    tokens = engine.generate(prompt, max_new_tokens=count, ignore_eos=True).token_ids
    eos = next(token for index, token in enumerate(tokens) if index >= 2 and token not in tokens[:index])
    engine.eos_token_ids = (eos,)
    return tokens


def test_ignore_eos_generates_past_the_models_end_of_sequence_tokens(tiny_engine):
    prompt = [1, 30, 31, 32, 30]
    eos_before = tiny_engine.eos_token_ids
    try:
        tokens = _eos_at_third_token(tiny_engine, prompt, 16)
        stopped = tokens[:tokens.index(tiny_engine.eos_token_ids[0])]
        for run in (tiny_engine.generate, lambda *a, **k: tiny_engine.submit(*a, **k).result(timeout=60)):
            plain = run(prompt, max_new_tokens=16)
            assert (plain.token_ids, plain.finish_reason) == (stopped, "stop")
            ignoring = run(prompt, max_new_tokens=16, ignore_eos=True)
            assert (ignoring.token_ids, ignoring.finish_reason) == (tokens, "length")
            # stop ids the request names still stop it
            named = run(prompt, max_new_tokens=16, ignore_eos=True, stop_token_ids=[tokens[5]])
            assert named.token_ids == tokens[:tokens.index(tokens[5])]
            # and without ignore_eos they stop besides the end-of-sequence token (vLLM's rule), not instead of it
            besides = run(prompt, max_new_tokens=16, stop_token_ids=[tokens[5]])
            end = min(tokens.index(tiny_engine.eos_token_ids[0]), tokens.index(tokens[5]))
            assert (besides.token_ids, besides.finish_reason) == (tokens[:end], "stop")
            assert run(prompt, max_new_tokens=16, stop_token_ids=[]).token_ids == stopped
    finally:
        tiny_engine.eos_token_ids = eos_before
        tiny_engine.close()


def test_min_new_tokens_holds_back_the_stop_tokens_then_lets_them_stop():
    logits = np.array([0.0, 4.0, 5.0, 1.0], dtype=np.float32)  # the end token 2 is the likeliest, then 1
    sampler = Sampler(SamplingParams(min_new_tokens=2, logprobs=0, stop_token_ids=[1]), eos_token_ids=[2])
    assert [sampler(logits) for _ in range(3)] == [3, 3, 2]  # the stop id held back as well, then the end token
    assert sampler.logprobs[0][3] == pytest.approx(1.0 - np.log(np.exp(logits).sum()))  # the model's, unmasked
    ignoring = Sampler(SamplingParams(min_new_tokens=1, ignore_eos=True), eos_token_ids=[2])
    assert [ignoring(logits) for _ in range(2)] == [1, 2]  # as vLLM: held back under ignore_eos too
    with pytest.raises(RequestError, match=r"min_new_tokens: 5 must be an integer from 0 to the most new tokens "
                                           r"asked for \(4\)"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)
    with pytest.raises(RequestError, match="min_new_tokens: True must be an integer"):
        SamplingParams(min_new_tokens=True)
    cornered = Sampler(SamplingParams(min_new_tokens=1, stop_token_ids=[0, 1, 3]), eos_token_ids=[2])
    with pytest.raises(RequestError, match="every token this request may sample is a stop"):
        cornered(logits)


def test_min_new_tokens_on_both_paths(tiny_engine):
    prompt = [1, 30, 31, 32, 30]
    eos_before = tiny_engine.eos_token_ids
    try:
        tokens = _eos_at_third_token(tiny_engine, prompt, 16)
        eos = tiny_engine.eos_token_ids[0]
        end = tokens.index(eos)
        alone = tiny_engine.generate(prompt, max_new_tokens=16, min_new_tokens=end + 3)
        batched = tiny_engine.submit(prompt, max_new_tokens=16, min_new_tokens=end + 3).result(timeout=60)
    finally:
        tiny_engine.eos_token_ids = eos_before
        tiny_engine.close()
    assert batched.token_ids == alone.token_ids and len(alone.token_ids) >= end + 3  # without: `end` tokens
    assert alone.token_ids[:end] == tokens[:end]


def test_prompt_logprobs_come_from_the_pass_that_prefills_the_prompt(tiny_artifact, monkeypatch):
    """The pass runs in pieces of 4 positions here; the tokens decoded after it, and their logprobs, are the ones a
    prefill gives, and a later request reuses the cache it left."""
    from runtime import Engine, evaluate
    from runtime.evaluate import decode_logits_for, log_softmax

    monkeypatch.setattr(evaluate, "PROMPT_PIECE_TOKENS", 4)
    engine = Engine.load(tiny_artifact, prefix_caching=True)
    prompt = [1, *range(30, 54)]
    options = dict(max_new_tokens=8, ignore_eos=True, logprobs=1)
    engine.generate(prompt, **options)
    plain = engine.generate(prompt, **options)
    assert plain.prompt_logprobs is None and plain.timings.cached_prompt_tokens > 0  # a prefix from the first run
    scored = engine.generate(prompt, **options, prompt_logprobs=2)
    assert scored.token_ids == plain.token_ids and scored.timings.cached_prompt_tokens == 0
    for ours, prefilled in zip(scored.logprobs, plain.logprobs):
        assert list(ours) == list(prefilled) and list(ours.values()) == pytest.approx(list(prefilled.values()),
                                                                                      abs=1e-4)
    after = engine.generate(prompt, **options)  # reuses what the scored request left in the cache
    assert after.timings.cached_prompt_tokens > 0 and after.token_ids == plain.token_ids
    expected = log_softmax(decode_logits_for(engine)(np.array(prompt)))  # one piece; row i predicts token i + 1
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(prompt)
    for position, (entry, token) in enumerate(zip(scored.prompt_logprobs[1:], prompt[1:])):
        likeliest = [int(t) for t in np.argsort(-expected[position], kind="stable")[:2]]
        assert list(entry) == [token, *(t for t in likeliest if t != token)]  # the token, then the 2 likeliest
        assert list(entry.values()) == pytest.approx([expected[position, t] for t in entry], abs=1e-5)
    with pytest.raises(RequestError, match="prompt_logprobs: -1 must be an integer in 0..20"):
        SamplingParams(prompt_logprobs=-1)
    engine.close()


def test_ignore_eos_must_be_a_bool():
    with pytest.raises(RequestError, match="ignore_eos: 'false' must be True or False"):
        SamplingParams(ignore_eos="false")
    assert SamplingParams(ignore_eos=np.bool_(True)).ignore_eos is True


def test_cli_run_ignore_eos(tiny_artifact, capsys, monkeypatch):
    from compiler.cli import main
    from runtime import Engine

    engine = Engine.load(tiny_artifact)
    tokens = _eos_at_third_token(engine, "hello", 12)
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: engine))
    stopped_ids = tokens[:tokens.index(engine.eos_token_ids[0])]
    stopped = engine.tokenizer.decode(stopped_ids)
    assert main(["run", str(tiny_artifact), "--prompt", "hello", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr()
    assert out.out == "hello" + stopped + "\n" and f"{len(stopped_ids) + 1} output tokens (stop)" in out.err  # the end token counts
    assert main(["run", str(tiny_artifact), "--prompt", "hello", "--max-new-tokens", "12", "--ignore-eos"]) == 0
    out = capsys.readouterr()
    assert out.out == "hello" + engine.tokenizer.decode(tokens) + "\n" and "12 output tokens (length)" in out.err


def test_min_new_tokens_keeps_stop_strings_from_ending_the_first_tokens_on_both_paths(tiny_engine):
    prompt = [1, 30, 31, 32, 30]
    whole = tiny_engine.generate(prompt, max_new_tokens=12, ignore_eos=True).text
    stop = whole[len(whole) // 3:len(whole) // 3 + 3]
    try:
        for run in (tiny_engine.generate, lambda *a, **k: tiny_engine.submit(*a, **k).result(timeout=60)):
            assert len(run(prompt, max_new_tokens=12, ignore_eos=True, stop_strings=[stop]).text) < len(whole)
            held = run(prompt, max_new_tokens=12, ignore_eos=True, stop_strings=[stop], min_new_tokens=12)
            assert (held.text, held.finish_reason) == (whole, "length")
    finally:
        tiny_engine.close()


def test_cli_run_min_new_tokens(tiny_artifact, capsys, monkeypatch):
    from compiler.cli import main
    from runtime import Engine

    engine = Engine.load(tiny_artifact)
    tokens = _eos_at_third_token(engine, "hello", 12)
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: engine))
    end = tokens.index(engine.eos_token_ids[0])
    assert main(["run", str(tiny_artifact), "--prompt", "hello", "--max-new-tokens", "12",
                 "--min-new-tokens", str(end + 2)]) == 0
    counted = re.search(r"(\d+) output tokens", capsys.readouterr().err)
    assert counted and int(counted[1]) >= end + 2  # without: end + 1, the end token counted
    assert main(["run", str(tiny_artifact), "--prompt", "hello", "--max-new-tokens", "4", "--min-new-tokens", "5"]) == 2
    said = " ".join(capsys.readouterr().err.split())  # rich wraps it at the terminal's width
    assert "--min-new-tokens: 5 must be an integer from 0 to the most new tokens asked for (4)" in said


# -- logit_bias ------------------------------------------------------------------------------------------------
def test_logit_bias_is_added_before_the_penalties_and_leaves_logprobs_the_models():
    row = steps(64, 1)[0]
    bias = {2: 3.0, 40: -100.0, 7: 1.5}
    params = SamplingParams(temperature=0.8, top_k=20, logit_bias={str(k): v for k, v in bias.items()},
                            repetition_penalty=1.4, logprobs=0)
    biased = row.copy()
    for token, value in bias.items():
        biased[token] += np.float32(value)
    seen = [2, 5]
    expected = biased.copy()  # vLLM's order: the bias, then the penalty on the biased logits
    expected[seen] = np.where(expected[seen] > 0, expected[seen] / 1.4, expected[seen] * 1.4)
    sampler = Sampler(params, prompt_ids=seen)
    reference = Sampler(SamplingParams(temperature=0.8, top_k=20))
    np.testing.assert_allclose(sampler.distribution(sampler._penalize(biased)), reference.distribution(expected))
    token = sampler(row)
    np.testing.assert_array_equal(row, steps(64, 1)[0])  # the step's row is not changed in place
    raw = row.astype(np.float64) - row.max()
    assert sampler.logprobs[0][token] == pytest.approx(raw[token] - np.log(np.exp(raw).sum()))  # unbiased
    assert Sampler(SamplingParams(logit_bias={40: 100})).__call__(row) == 40  # greedy: forced
    assert Sampler(SamplingParams(logit_bias={int(np.argmax(row)): -100})).__call__(row) != int(np.argmax(row))
    # under a penalty too: the sampler penalized the unbiased row and dropped the bias (a mutation audit)
    assert Sampler(SamplingParams(repetition_penalty=1.3, logit_bias={40: 100}), prompt_ids=[2, 5])(row) == 40
    top = int(np.argmax(row))
    assert Sampler(SamplingParams(presence_penalty=0.5, logit_bias={top: -100}), prompt_ids=[2])(row) != top


@pytest.mark.parametrize("bias, message", [([3], "must be a dict of token id -> bias"),
                                           ({"x": 1}, "key 'x' must be a token id"),
                                           ({3: 100.5}, "100.5 for token 3 must be a number in \\[-100, 100\\]"),
                                           ({3: float("nan")}, "nan for token 3"), ({True: 1}, "key True"),
                                           # int() raised ValueError past 4300 digits: a 500 with Python's advice
                                           ({"1" * 5000: 1}, "key '1111.* must be a token id")])
def test_bad_logit_biases_are_refused(bias, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(logit_bias=bias)


def test_logit_bias_on_both_paths(tiny_engine):
    prompt = [1, 30, 31, 32, 30]
    plain = tiny_engine.generate(prompt, max_new_tokens=10, ignore_eos=True).token_ids
    banned = {token: -100 for token in set(plain)}
    try:
        alone = tiny_engine.generate(prompt, max_new_tokens=10, ignore_eos=True, logit_bias=banned)
        batched = [tiny_engine.submit(prompt, max_new_tokens=10, ignore_eos=True, **options)
                   for options in (dict(logit_bias=banned), {})]
        assert [handle.result(timeout=60).token_ids for handle in batched] == [alone.token_ids, plain]
    finally:
        tiny_engine.close()
    assert not set(alone.token_ids) & set(plain)
    vocab = tiny_engine.manifest["model"]["config"]["vocab_size"]
    for run in (tiny_engine.generate, tiny_engine.submit):
        with pytest.raises(RequestError, match=f"logit_bias: token {vocab} is outside this model's vocabulary"):
            run(prompt, logit_bias={vocab: 1})
    tiny_engine.close()


def test_cli_run_says_when_the_context_ended_the_reply_and_ends_its_line_when_interrupted(tiny_artifact, capsys,
                                                                                          monkeypatch):
    from compiler.cli import main
    from runtime import Engine

    assert main(["run", str(tiny_artifact), "--prompt", "hello", "--max-new-tokens", "500", "--ignore-eos"]) == 0
    err = " ".join(capsys.readouterr().err.split())  # rich wraps the note at the console's width
    assert "(max_context)" in err and "note: stopped at the artifact's max context of 128 tokens" in err
    assert "ask for at most" in err
    assert main(["run", str(tiny_artifact), "--prompt", "hello", "--max-new-tokens", "5"]) == 0
    assert "note:" not in capsys.readouterr().err

    def interrupted(self, *args, **kwargs):
        yield "some text"
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "stream", interrupted)
    assert main(["run", str(tiny_artifact), "--prompt", "hello"]) == 130
    out = capsys.readouterr()
    assert out.out == "hellosome text\n" and "interrupted" in out.err


def test_min_p_of_one_keeps_only_the_likeliest_token():
    """min_p 1 (allowed) keeps the tokens at least as likely as the likeliest: the top one (ties too). A strict
    comparison kept none, and sampling failed on an all-zero distribution."""
    logits = np.random.default_rng(3).standard_normal(50)
    distribution = Sampler(SamplingParams(temperature=1.0, min_p=1.0, seed=0)).distribution(logits)
    np.testing.assert_array_equal(distribution, np.eye(1, 50, int(np.argmax(logits)))[0])


INTEGER_OPTIONS = ("max_new_tokens", "top_k", "min_new_tokens", "logprobs", "prompt_logprobs", "seed")


def test_numpy_integer_options_are_stored_as_python_ints():
    """Integer options given as numpy integers (an array's element, a value read by pandas) are stored as Python
    ints: numpy's fixed-width arithmetic wraps around, and the scheduler's capacity check, prompt + max_new_tokens - 1,
    read np.int32(2**31 - 1) as a negative need and admitted a request that outgrew its slot (its failing decode
    step then failed every request decoding beside it)."""
    params = SamplingParams(max_new_tokens=np.int32(2**31 - 1), top_k=np.int64(5), min_new_tokens=np.uint8(2),
                            logprobs=np.int16(3), prompt_logprobs=np.int64(1), seed=np.uint64(7))
    for name in INTEGER_OPTIONS:
        assert type(getattr(params, name)) is int, name
    assert params.max_new_tokens == 2**31 - 1


@pytest.mark.parametrize("huge", [np.int32(2**31 - 1), np.int64(2**63 - 1)])
def test_a_numpy_max_new_tokens_past_the_cache_is_refused_at_submit(tiny_engine, huge):
    with pytest.raises(RequestError, match="max context"):
        tiny_engine.submit([5, 6, 7], max_new_tokens=huge, ignore_eos=True)
    tiny_engine.close()


@pytest.mark.parametrize("options, hint", [
    (dict(max_tokens=8), "'max_tokens': did you mean max_new_tokens?"),  # OpenAI's name
    (dict(stop=["\n"]), "'stop': did you mean stop_strings"),
    (dict(temprature=0.7), "'temprature': did you mean temperature?"),
])
def test_sampling_params_built_directly_name_an_unknown_option_as_generate_does(options, hint):
    """SamplingParams(max_tokens=8) raised the dataclass' TypeError ("unexpected keyword argument 'max_tokens'"), with
    no hint, where engine.generate(prompt, max_tokens=8) said what this API calls it."""
    with pytest.raises(RequestError, match=re.escape(f"unknown sampling option {hint}")):
        SamplingParams(**options)
    params = SamplingParams(8, top_k=3)  # the rest builds as before
    assert (params.max_new_tokens, params.top_k) == (8, 3)


def test_the_fast_paths_draw_what_numpys_full_vocabulary_routines_draw():
    """Sorting, partitioning and checking the whole vocabulary per token cost ~3 ms a token at 49k entries with
    top_p (30% of a 16-slot step of the default model). The shortcuts must keep the same tokens, draws and seeds:
    compared here with the routines they replace, on peaked (model-like), flat and sparse distributions."""
    from runtime.sampling import _draw, _kth_largest, _top_p_kept

    rng = np.random.default_rng(0)
    for trial in range(60):
        scale = (0.5, 3.0, 12.0)[trial % 3]  # flat to peaked
        logits = (rng.standard_normal(4096) * scale).astype(np.float32)
        for k in (1, 2, 7, 50, 1000):
            assert _kth_largest(logits, k) == np.partition(logits, -k)[-k]
        probs = np.exp(logits.astype(np.float64) - logits.max())
        probs /= probs.sum()
        tied = np.round(probs, 4 + trial % 3)  # ties at the cut, as float16 logits make them
        tied /= tied.sum()
        for p in (probs, tied):
            order = np.argsort(-p, kind="stable")  # ties: the lower id first
            for top_p in (0.1, 0.5, 0.9, 0.999):
                kept = _top_p_kept(p, top_p)
                expected = order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]
                assert np.array_equal(np.sort(kept), np.sort(expected)), (trial, top_p)
        sparse = np.where(probs >= np.sort(probs)[-20], probs, 0.0)  # what top-k leaves
        for p in (probs, sparse / sparse.sum()):
            ours, numpys = np.random.default_rng(trial), np.random.default_rng(trial)
            assert [_draw(ours, p) for _ in range(20)] == [int(numpys.choice(p.size, p=p)) for _ in range(20)]


def test_seeded_samples_are_those_of_the_sampler_before_its_shortcuts():
    """The tokens a seed gives, and the distribution they are drawn from: the full-vocabulary version of
    distribution() and rng.choice, written out. Tied tokens at the top_p cut: the lower id kept first."""
    def reference_distribution(logits, params):
        scaled = (logits.astype(np.float64) - logits.max()) / params.temperature
        if 0 < params.top_k < scaled.size:
            scaled = np.where(scaled < np.partition(scaled, -params.top_k)[-params.top_k], -np.inf, scaled)
        probs = np.exp(scaled)
        probs /= probs.sum()
        if params.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            keep = order[: int(np.searchsorted(np.cumsum(probs[order]), params.top_p)) + 1]
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept / kept.sum()
        return probs

    rows = (np.random.default_rng(1).standard_normal((40, 8192)) * 6).astype(np.float32)
    rows[20:] = rows[20:].astype(np.float16)  # a half-precision lm_head's logits: ties at the top_p cut are common
    rows[30:] = (rows[30:] / 6).astype(np.float16)  # and flat ones, sorted whole
    rows[38:] = 0.0  # every token tied (the cut falls inside the tie), and a few above the rest
    rows[39, [7, 3000, 5000]] = 2.0
    for options in (dict(temperature=0.8), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=40),
                    dict(temperature=1.2, top_k=50, top_p=0.95)):
        params = SamplingParams(seed=3, **options)
        sampler, rng = Sampler(params, prompt_ids=[]), np.random.default_rng(3)
        expected = [reference_distribution(row, params) for row in rows]
        assert all(np.array_equal(sampler.distribution(row), probs) for row, probs in zip(rows, expected)), options
        assert [sampler(row) for row in rows] == [int(rng.choice(p.size, p=p)) for p in expected], options


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_distribution_refuses_logits_sampling_refuses(bad):
    """distribution() says what sampling says of NaN, +inf or no finite logit (with top_p it raised an IndexError)."""
    from runtime.errors import ModelOutputError

    logits = np.full(8, bad, dtype=np.float32) if bad == -np.inf else np.array([0.0, bad, 1.0], dtype=np.float32)
    for params in (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7), SamplingParams()):
        with pytest.raises(ModelOutputError):
            Sampler(params).distribution(logits)
