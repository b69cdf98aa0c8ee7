"""Requests a serving engineer may send by mistake or at an edge, through Engine.stream/generate and the scheduler:
each is refused with a RequestError that names the problem, or behaves as documented, and never disturbs the
other requests running beside it. On the tiny artifact."""
from __future__ import annotations

import time

import numpy as np
import pytest

from runtime import ArtifactError, Engine, ModelOutputError, RequestError, SamplingParams
from runtime.sampling import Sampler
from tests.runtime.faults import failing_run
from tests.runtime.test_tokenizer import cut_at_stop

PROMPT = [1, 17, 42, 99, 7]


@pytest.fixture
def engine(tiny_engine):
    yield tiny_engine
    tiny_engine.close()


@pytest.mark.parametrize("options, message", [
    (dict(stop_strings=("",)), "an empty string would stop before any text"),
    (dict(stop_strings=("ok", 3)), "must be a string or a list of strings"),
    (dict(stop_token_ids=2), "must be a list of token ids"),
    (dict(top_k=2.5), "top_k: 2.5 must be an integer"),
    (dict(max_new_tokens=None), "max_new_tokens: None must be an integer"),
    (dict(max_new_tokens=True), "max_new_tokens: True must be an integer"),
    (dict(temperature=float("nan")), "temperature: nan must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature: inf must be a finite number >= 0"),  # top_k stopped limiting
    (dict(stop_token_ids=[10**9]), "stop_token_ids: 1000000000 is outside this model's vocabulary"),
    (dict(stop_token_ids=[-5]), "stop_token_ids: -5 is outside this model's vocabulary"),
    (dict(top_p=float("nan")), r"top_p: nan must be a number in \(0, 1\]"),
    (dict(seed=1.5), "seed: 1.5 must be an integer >= 0 or None"), (dict(seed=-1), "seed: -1 must be an integer >= 0"),
    (dict(temprature=0.5), "unknown sampling option 'temprature': did you mean temperature\\?; the options are "
                           "max_new_tokens"),
    # other APIs' names (OpenAI's, vLLM's) say what this one calls them
    (dict(max_tokens=5), "'max_tokens': did you mean max_new_tokens\\?"),
    (dict(stop="\n"), "'stop': did you mean stop_strings \\(text\\) or stop_token_ids \\(ids\\)\\?"),
    (dict(n=4), "'n': there is no n: submit the prompt n times with their own seeds"),
    (dict(sampling_params=None),
     "'sampling_params': did you mean params \\(a SamplingParams, vLLM's sampling_params\\)"),
    # each is looked for after every token, on the thread that steps the whole batch (900,000: 0.9 s a step)
    (dict(stop_strings=["x"] * 65), "stop_strings: 65 strings, the longest 1 character; give at most 64, each at "
                                    "most 1,000 characters"),
    (dict(stop_strings=["x" * 1001]), "stop_strings: 1 string, the longest 1,001 characters; give at most 64"),
    (dict(do_sample=True), "'do_sample': there is no do_sample: temperature 0 \\(the default\\) is greedy"),
    (dict(frobnicate=1), "'frobnicate': not an option; the options are"),
])
def test_bad_sampling_options_are_refused_before_anything_runs(engine, options, message):
    with pytest.raises(RequestError, match=message):
        engine.stream(PROMPT, **options)
    with pytest.raises(RequestError, match=message):
        engine.submit(PROMPT, **options)
    assert engine._scheduler is None or not any(engine._scheduler._running)


@pytest.mark.parametrize("arrival", [float("nan"), float("inf"), "now", True])
def test_an_arrival_that_is_not_a_time_is_refused_before_anything_runs(engine, arrival):
    """It was taken, and the whole generation ran before the trace refused its timestamps."""
    for send in (engine.stream, engine.submit):
        with pytest.raises(RequestError, match="arrival: .* must be a finite time.perf_counter"):
            send(PROMPT, arrival=arrival, max_new_tokens=2)
    assert engine.generate(PROMPT, arrival=time.perf_counter() - 1.0, max_new_tokens=2).timings.ttft_s >= 1.0
    for send in (engine.stream, engine.submit):  # time.time(): another clock, refused before anything runs
        with pytest.raises(RequestError, match="arrival: .* s after time.perf_counter"):
            send(PROMPT, arrival=time.time(), max_new_tokens=2)


def test_submit_block_must_be_a_bool(engine):
    with pytest.raises(RequestError, match="block must be True or False, got 'yes'"):
        engine.submit(PROMPT, max_new_tokens=2, block="yes")


def test_params_and_keywords_together_are_refused(engine):
    with pytest.raises(RequestError, match="either as params or as keywords, not both .*max_new_tokens"):
        engine.generate(PROMPT, SamplingParams(max_new_tokens=3), max_new_tokens=7)
    with pytest.raises(RequestError, match="not both"):
        engine.submit(PROMPT, SamplingParams(max_new_tokens=3), max_new_tokens=7)


def test_a_bare_stop_string_is_one_stop_string(engine):
    text = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True).text
    stop = text[6:9]
    assert SamplingParams(stop_strings=stop).stop_strings == (stop,)
    assert engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True, stop_strings=stop).text == text[:text.find(stop)]


@pytest.mark.parametrize("prompt, message", [
    (b"hello", "the prompt is bytes; decode it to str first"),  # was run as the byte values 104, 101, ...
    (np.array([3.7, 4.2]), r"prompt token ids must be integers; got np.float64\(3.7\)|got 3.7"),  # was 3, 4
    ([1.0, 2.5], r"prompt token ids must be integers; got 1.0 \(float\)"),  # was taken for a list of prompts
    ([5, True], r"prompt token ids must be integers; got True \(bool\)"),
    (np.array([[1, 17, 42]]), r"one flat list of token ids; got a 2-D array: pass ids\[0\]"),  # a numpy TypeError
    ([None], r"prompt token ids must be integers; got None \(NoneType\) at position 0"),  # TypeError from index()
    ([5, 6, None], r"got None \(NoneType\) at position 2"),
    (memoryview(b"hi"), "the prompt is memoryview; decode it to str first"),  # was run as ids 104, 105
    ({5, 6}, "must be a string or a list of token ids, got a set"),  # ids in no given order
    ({"role": "user", "content": "hi"}, r"got a dict; for chat messages use engine.chat\(\[message\]\)"),
    ([{"role": "user", "content": "hi"}], r"the prompt is a list of chat messages: use engine.chat\(messages\)"),
])
def test_prompts_that_are_not_text_or_integer_ids_are_refused(engine, prompt, message):
    with pytest.raises(RequestError, match=message):
        engine.generate(prompt, max_new_tokens=2)
    with pytest.raises(RequestError, match=message):
        engine.submit(prompt, max_new_tokens=2)


def test_a_list_of_arrays_is_a_batch_for_generate_and_refused_by_one_request_calls(engine):
    prompts = [np.array([1, 2]), np.array([3])]  # building the message raised numpy's "inhomogeneous shape" ValueError
    assert len(engine.generate(prompts, max_new_tokens=2)) == 2
    for call in (engine.submit, engine.stream):
        with pytest.raises(RequestError, match=r"one flat list of token ids; got a list of arrays: pass ids\[0\]"):
            call(prompts, max_new_tokens=2)


def test_numpy_integer_ids_are_token_ids(engine):
    ids = engine.prompt_ids(PROMPT)
    assert engine.generate(np.array(ids), max_new_tokens=3).token_ids == engine.generate(ids, max_new_tokens=3).token_ids


@pytest.mark.parametrize("artifact, threads, message", [
    (None, None, "artifact_dir must be a path"), ("x", -1, "intra_op_threads must be an integer >= 0"),
    ("x", "2", "intra_op_threads must be an integer >= 0"),
    ("x", 100_000, r"intra_op_threads: 100000 is more than the \d+ CPUs? this process may use.*; give at most \d+"),
])
def test_engine_load_arguments_are_checked_first(artifact, threads, message):
    with pytest.raises((RequestError, ArtifactError), match=message):
        Engine.load(artifact, intra_op_threads=threads)


def test_engine_load_flags_are_type_checked():
    with pytest.raises(RequestError, match="huge_pages must be True or False, got 'no'"):
        Engine.load("x", huge_pages="no")  # a non-empty string would have read as True
    with pytest.raises(RequestError, match="verify must be True or False, got 'false'"):
        Engine.load("x", verify="false")  # hashed every file, as verify=True does
    for value in ("no", "decode", 1, [1]):  # a bare phase name too: a list says which phases
        with pytest.raises(RequestError, match=r"spin_after_run must be True, False or a list of phases"):
            Engine.load("x", spin_after_run=value)


def test_spin_after_run_names_phases_of_the_artifact(tiny_artifact):
    with pytest.raises(RequestError, match=r"spin_after_run names 'decoder', not a phase of this artifact "
                                           r"\(prefill, decode\)"):
        Engine.load(tiny_artifact, huge_pages=False, spin_after_run=["decoder"])


@pytest.mark.parametrize("prompt, bad", [([5, 100000], 100000), ([5, -1], -1)])
def test_token_ids_outside_the_vocabulary_are_refused(engine, prompt, bad):
    vocab = engine.manifest["model"]["config"]["vocab_size"]
    message = f"prompt token id {bad} is outside this model's vocabulary \\(0..{vocab - 1}\\)"
    with pytest.raises(RequestError, match=message):
        engine.generate(prompt, max_new_tokens=2)
    with pytest.raises(RequestError, match=message):
        engine.submit(prompt, max_new_tokens=2)


def test_a_tiny_temperature_samples_the_argmax_instead_of_nan():
    logits = np.random.default_rng(0).normal(size=512).astype(np.float32)
    assert Sampler(SamplingParams(temperature=1e-310, seed=0))(logits) == int(np.argmax(logits))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logits_that_cannot_be_sampled_are_a_model_output_error(temperature):
    sampler = Sampler(SamplingParams(temperature=temperature, seed=0))
    logits = np.zeros(512, dtype=np.float32)
    logits[[3, 7]] = np.nan
    with pytest.raises(ModelOutputError, match="logits contain NaN at 2 of 512 vocabulary entries"):
        sampler(logits)  # greedy would have returned token 3, the first NaN
    with pytest.raises(ModelOutputError, match="every logit is -inf"):
        sampler(np.full(512, -np.inf, dtype=np.float32))
    logits = np.zeros(512, dtype=np.float32)
    logits[5] = np.inf  # greedy returned 5; sampling computed inf - inf and failed inside numpy
    with pytest.raises(ModelOutputError, match=r"logits are \+inf at 1 of 512 vocabulary entries"):
        sampler(logits)
    logits = np.full(512, -np.inf, dtype=np.float32)
    logits[9] = 1.0  # -inf elsewhere is a mask, not an error
    assert sampler(logits) == 9


def test_overlapping_stop_strings_cut_result_and_stream_at_the_earliest(engine):
    text = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True).text
    stops = (text[8:14], text[5:10])  # the second starts first
    expected = cut_at_stop(text, stops)
    assert expected == text[:5]
    generation = engine.stream(PROMPT, max_new_tokens=24, ignore_eos=True, stop_strings=stops)
    assert "".join(generation) == generation.result.text == expected
    handle = engine.submit(PROMPT, max_new_tokens=24, ignore_eos=True, stop_strings=stops)
    assert "".join(handle) == handle.result(timeout=60).text == expected


def test_a_finished_stream_keeps_its_result_and_a_closed_one_says_it_has_none(engine):
    generation = engine.stream(PROMPT, max_new_tokens=6)
    first = generation.wait()
    assert generation.wait() is first and list(generation) == [] and generation.result is first
    closed = engine.stream(PROMPT, max_new_tokens=6)
    next(closed)
    closed.close()
    with pytest.raises(RequestError, match="closed before it finished"):
        closed.wait()
    assert engine.generate(PROMPT, max_new_tokens=6).token_ids == first.token_ids  # the cache was freed


def test_a_stream_read_in_parts_goes_on_where_it_stopped(engine):
    """`next(iter(stream))` then a loop over it (the first piece timed apart, say) read the whole reply; it closed the
    request when the iterator the first call made was dropped, and the loop then failed."""
    whole = engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    generation = engine.stream(PROMPT, max_new_tokens=8, ignore_eos=True)
    first = next(iter(generation))
    for piece in generation:  # a loop left early leaves it open
        break
    rest = list(generation)
    assert first + piece + "".join(rest) == whole.text and generation.result.token_ids == whole.token_ids


def test_a_stream_is_closed_by_its_with_block_or_when_dropped(engine):
    with engine.stream(PROMPT, max_new_tokens=8) as generation:
        next(generation)
    assert generation.result is None
    with pytest.raises(RequestError, match="closed before it finished"):
        list(generation)
    for _ in engine.stream(PROMPT, max_new_tokens=8):  # nothing else refers to it: freed after the loop
        break
    assert len(engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True).token_ids) == 3  # same thread: not refused
    kept = engine.stream(PROMPT, max_new_tokens=8)
    next(kept)
    with pytest.raises(RequestError, match="finish or close that stream first"):
        engine.generate(PROMPT, max_new_tokens=3)
    kept.close()
    assert len(engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True).token_ids) == 3


def test_a_failed_stream_raises_its_error_again(engine, monkeypatch):
    monkeypatch.setattr(engine.backend, "run", failing_run(engine.backend.run, "decode", at=2))
    generation = engine.stream(PROMPT, max_new_tokens=8, ignore_eos=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        list(generation)
    with pytest.raises(RuntimeError, match="out of memory"):
        generation.wait()


def test_a_handle_iterated_twice_ends_at_once_the_second_time(engine):
    handle = engine.submit(PROMPT, max_new_tokens=6, ignore_eos=True)
    pieces = list(handle)
    assert "".join(pieces) == handle.result(timeout=60).text
    assert list(handle) == []


def test_cancelling_a_finished_request_changes_nothing(engine):
    handle = engine.submit(PROMPT, max_new_tokens=4, ignore_eos=True)
    result = handle.result(timeout=60)
    handle.cancel()
    assert not handle.cancelled and handle.result().finish_reason == "length" and result.token_ids


def test_a_burst_into_free_slots_is_not_refused_as_a_full_queue(engine):
    engine.start_scheduler(slots=8, max_queue=2)
    # Refused only when 8 run and 2 wait, however many the worker has admitted meanwhile.
    handles = [engine.submit(PROMPT, max_new_tokens=100, ignore_eos=True) for _ in range(8 + 2)]
    with pytest.raises(RequestError, match="queue is full"):
        for _ in range(20):  # none of the 100-token requests finishes while these are submitted
            handles.append(engine.submit(PROMPT, max_new_tokens=100, ignore_eos=True))
    assert {len(handle.result(timeout=120).token_ids) for handle in handles} == {100}


@pytest.mark.parametrize("prompts, message", [
    (["fine", ""], r"prompts\[1\]: the prompt is empty"),
    ([[1, 2], [3], None], r"prompts\[2\]: the prompt must be a string or a list of token ids, got NoneType"),
    ([[1, 2], 3], r"prompts\[1\]: the prompt must be a string or a list of token ids, got int"),
    ([[1, 2], [9999]], r"prompts\[1\]: prompt token id 9999 is outside this model's vocabulary"),
])
def test_a_refused_prompt_of_a_list_is_named_by_its_index(engine, prompts, message):
    with pytest.raises(RequestError, match=message):  # "the prompt is empty": which of a list of hundreds?
        engine.generate(prompts, max_new_tokens=2)


def test_a_list_with_one_refused_prompt_runs_none_of_it(engine, monkeypatch):
    scheduler = engine.start_scheduler(slots=2)
    run = scheduler.cache.run
    scheduler.cache.run = lambda *args: time.sleep(0.005) or run(*args)  # 40 tokens take >= 0.2 s: not done first
    accepted = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda *args, **kw: accepted.append(submit(*args, **kw)) or accepted[-1])
    too_long = [1] * engine.max_context
    with pytest.raises(RequestError, match="max context"):
        engine.generate([PROMPT, too_long], max_new_tokens=40)
    assert len(accepted) == 1  # the first prompt was accepted, then cancelled when the second was refused
    result = accepted[0].result(timeout=60)
    assert result.finish_reason == "cancelled" and len(result.token_ids) < 40
    for _ in range(200):  # the accepted first prompt is cancelled; the worker frees its slot at its next step
        if not any(scheduler._running) and not scheduler._waiting:
            break
        time.sleep(0.01)
    assert not any(scheduler._running) and not scheduler._waiting


def test_text_that_is_not_unicode_is_a_request_error(tiny_engine, capsys):
    """Bytes that were not UTF-8, read with surrogateescape (a pipe, argv), left lone surrogates that the
    tokenizer refused with a TypeError traceback."""
    from compiler.cli import main

    with pytest.raises(RequestError, match=r"not valid Unicode at character 1 \('\\udcff', a lone surrogate"):
        tiny_engine.generate("a\udcffb", max_new_tokens=2)
    assert main(["run", str(tiny_engine.artifact_dir), "--prompt", "a\udcffb"]) == 2
    assert "not valid Unicode" in capsys.readouterr().err


def test_an_engine_in_a_with_block_stops_its_scheduler_at_the_end(tiny_artifact):
    with Engine.load(tiny_artifact) as engine:
        handle = engine.submit(PROMPT, max_new_tokens=3, ignore_eos=True)
        assert len(handle.result(timeout=60).token_ids) == 3
        scheduler = engine._scheduler
    assert engine._scheduler is None and scheduler.closed


def test_text_far_too_long_for_the_context_is_refused_before_it_is_tokenized(engine, monkeypatch):
    """tokenizers holds the GIL while it encodes: a 15 MB prompt stalled every thread of a server (its /health too)
    for 25 s before the context check refused it; 500,000 chat messages took 40 s to render."""
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    most = engine.max_context * 256
    for send in (engine.stream, engine.submit):
        with pytest.raises(RequestError, match=rf"the prompt has {most + 1:,} characters: more than {most:,}"):
            send("a" * (most + 1), max_new_tokens=2)
    with pytest.raises(RequestError, match=rf"messages: {engine.max_context + 1:,} of them cannot fit"):
        engine.chat_prompt_ids([{"role": "user", "content": ""}] * (engine.max_context + 1))
    with pytest.raises(RequestError, match=r"messages' content has .* characters: more than"):
        engine.chat_prompt_ids([{"role": "user", "content": [{"type": "text", "text": "a" * most}, {"type": "text",
                                                                                                      "text": "b"}]}])
