"""The onnxruntime engine against the torch canonical decoder (full recompute, no cache) on a tiny model."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

from runtime import RequestError, SamplingParams, forking

PROMPTS = [[1, 17, 300, 42, 9], [1, 5], [1, 400, 401, 402, 403, 404, 405, 406, 407, 408, 3]]


def full_recompute_logits(decoder, token_ids: list[int]) -> np.ndarray:
    """Last-position logits computed from scratch over the whole sequence (no KV cache)."""
    config = decoder.config
    length = len(token_ids)
    empty = [torch.zeros(1, config.num_kv_heads, length, config.head_dim) for _ in range(config.num_layers)]
    with torch.no_grad():
        logits, _, _ = decoder(torch.tensor([token_ids]), torch.arange(length)[None], torch.ones(1, length, dtype=torch.long),
                               empty, empty, attend_to_cache=False, logits="all")
    return logits[0, -1].numpy()


def reference_greedy(decoder, prompt: list[int], new_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(new_tokens):
        tokens.append(int(np.argmax(full_recompute_logits(decoder, tokens))))
    return tokens[len(prompt):]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_full_recompute(tiny_engine, tiny_reference, prompt):
    decoder, _ = tiny_reference
    result = tiny_engine.generate(prompt, max_new_tokens=24, ignore_eos=True)
    assert result.token_ids == reference_greedy(decoder, prompt, 24)
    assert result.finish_reason == "length"


def test_decode_with_cache_matches_full_recompute_logits(tiny_engine, tiny_reference):
    decoder, _ = tiny_reference
    backend = tiny_engine.backend
    tokens = PROMPTS[0][:]
    ones = np.ones((1, 64), dtype=np.int64)
    logits = backend.run("prefill", np.array([tokens]), np.arange(len(tokens))[None], ones[:, : len(tokens)])
    np.testing.assert_allclose(logits[0], full_recompute_logits(decoder, tokens), atol=1e-4)
    rng = np.random.default_rng(0)
    for _ in range(6):  # feed arbitrary tokens: the cache must hold exactly what a recompute would see
        tokens.append(int(rng.integers(3, 512)))
        logits = backend.run("decode", np.array([[tokens[-1]]]), np.array([[len(tokens) - 1]]), ones[:, : len(tokens)])
        np.testing.assert_allclose(logits[0, -1], full_recompute_logits(decoder, tokens), atol=1e-4)


def test_single_token_steps_reuse_one_logits_array_and_stay_exact(tiny_engine, tiny_reference):
    """Decode steps write their logits into one reused array (run_bound); a multi-token chunk in between gets a
    fresh one, and the next single-token step is still exact."""
    decoder, _ = tiny_reference
    backend = tiny_engine.backend
    tokens = PROMPTS[2][:]
    ones = np.ones((1, 64), dtype=np.int64)
    backend.run("prefill", np.array([tokens]), np.arange(len(tokens))[None], ones[:, : len(tokens)])
    returned = []
    for chunk in ([7], [8], [9, 10, 11], [12], [13]):
        start = len(tokens)
        tokens += chunk
        logits = backend.run("decode", np.array([chunk]), np.arange(start, len(tokens))[None], ones[:, : len(tokens)])
        np.testing.assert_allclose(logits[0, -1], full_recompute_logits(decoder, tokens), atol=1e-4)
        returned.append(logits)
    assert returned[1] is returned[3] is returned[4] and returned[2] is not returned[1]  # the 1st learns the shape
    # ids and positions went into arrays bound once and overwritten in place (exact above: onnxruntime read them)
    step = backend.steps["decode"]
    assert step.bound["input_ids"] is step.inputs[("input_ids", (1, 1))]
    assert step.bound["logits"] is returned[4]


def test_a_new_cache_rebinds_what_decode_steps_reuse(tiny_engine, tiny_reference):
    """allocate_cache clears the bindings' outputs: the next steps must bind their logits and inputs again."""
    decoder, _ = tiny_reference
    backend = tiny_engine.backend
    # a new cache each time; the third is not run, so the last batch-1 steps find what the second's bound
    for batch, steps in ((2, True), (1, True), (2, False), (1, True)):
        backend.allocate_cache(batch=batch)
        if not steps:
            continue
        tokens = PROMPTS[1][:]
        ids = np.array([tokens] * batch)
        backend.run("prefill", ids, np.tile(np.arange(len(tokens)), (batch, 1)), np.ones((batch, len(tokens)), np.int64))
        for token in (5, 6):
            tokens.append(token)
            logits = backend.run("decode", np.full((batch, 1), token), np.full((batch, 1), len(tokens) - 1),
                                 np.ones((batch, len(tokens)), np.int64))
            for row in range(batch):
                np.testing.assert_allclose(logits[row, -1], full_recompute_logits(decoder, tokens), atol=1e-4)
    # the present outputs are the last cache's buffers, after the logits, not those of a cache it replaced
    pointers = [buffer.data_ptr() for buffer in backend.cache.buffers]
    for phase, binding in backend.bindings.items():
        assert [output.data_ptr() for output in binding.get_outputs()[1:]] == pointers, phase


def test_cache_is_bound_once_and_written_in_place(tiny_engine, tiny_reference):
    decoder, _ = tiny_reference
    cache = tiny_engine.backend.cache
    pointers = [buffer.data_ptr() for buffer in cache.buffers]
    prompt = PROMPTS[0]
    result = tiny_engine.generate(prompt, max_new_tokens=5, ignore_eos=True)
    assert tiny_engine.backend.cache is cache
    assert [buffer.data_ptr() for buffer in cache.buffers] == pointers
    # Each graph's present outputs are the past buffers themselves after its runs (get_outputs()[0] is the logits):
    # onnxruntime wrote into them, rather than into outputs of its own that something then copied back.
    for phase, binding in tiny_engine.backend.bindings.items():
        assert [output.data_ptr() for output in binding.get_outputs()[1:]] == pointers, phase
    # The bound buffer holds the keys torch computes for the same tokens (the last token is not fed back).
    written = prompt + result.token_ids[:-1]
    config = decoder.config
    caches = [torch.zeros(1, config.num_kv_heads, 128, config.head_dim) for _ in range(config.num_layers)]
    with torch.no_grad():
        _, keys, values = decoder(torch.tensor([written]), torch.arange(len(written))[None],
                                  torch.ones(1, len(written), dtype=torch.long), caches, caches, False, "all")
    layer0_key = cache.buffers[cache.past_names.index("past_key_values.0.key")].numpy()
    np.testing.assert_allclose(layer0_key[0, :, : len(written)], keys[0][0, :, : len(written)].numpy(), atol=1e-5)


def test_stream_pieces_join_to_the_result_text(tiny_engine):
    generation = tiny_engine.stream("hello world", max_new_tokens=16, ignore_eos=True)
    pieces = list(generation)
    assert "".join(pieces) == generation.result.text
    assert generation.result.timings.output_tokens == 16
    assert len(generation.result.timings.token_times_s) == 16


def test_streamed_text_stops_where_the_result_text_does(tiny_engine):
    full = tiny_engine.generate("hello world", max_new_tokens=16, ignore_eos=True).text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip()  # a visible stop string, so the check below means something
    generation = tiny_engine.stream("hello world", max_new_tokens=16, ignore_eos=True, stop_strings=(stop,))
    pieces = list(generation)
    assert generation.result.finish_reason == "stop"
    assert "".join(pieces) == generation.result.text == full.split(stop, 1)[0]


def test_timings_are_consistent(tiny_engine):
    timings = tiny_engine.generate("abc", max_new_tokens=8, ignore_eos=True).timings
    assert 0 < timings.prefill_s <= timings.ttft_s <= timings.e2e_s
    assert timings.token_times_s == sorted(timings.token_times_s)
    assert timings.tpot_s == pytest.approx((timings.e2e_s - timings.ttft_s) / 7)
    assert len(timings.itl_s) == 7 and sum(timings.itl_s) == pytest.approx(timings.e2e_s - timings.ttft_s)
    assert all(gap > 0 for gap in timings.itl_s)  # each token stamped when sampled, a decode step after the one before
    assert 0 < timings.tokenize_s < timings.ttft_s  # a string prompt: its tokenization is timed, inside the TTFT


def test_seeded_sampling_is_reproducible(tiny_engine):
    sample = lambda seed: tiny_engine.generate("abc", max_new_tokens=12, temperature=1.0, seed=seed,  # noqa: E731
                                               ignore_eos=True).token_ids
    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    greedy = tiny_engine.generate("abc", max_new_tokens=12, ignore_eos=True).token_ids
    assert tiny_engine.generate("abc", max_new_tokens=12, temperature=0.7, top_k=1, seed=3,
                                ignore_eos=True).token_ids == greedy


def test_stop_token_ends_generation(tiny_engine):
    first = tiny_engine.generate("abc", max_new_tokens=4, ignore_eos=True).token_ids
    result = tiny_engine.generate("abc", max_new_tokens=4, stop_token_ids=(first[1],))
    assert result.finish_reason == "stop"
    assert result.token_ids == first[:1]


def test_a_stop_token_sampled_first_ends_generation_with_no_output(tiny_engine):
    first = tiny_engine.generate("abc", max_new_tokens=4, ignore_eos=True).token_ids
    result = tiny_engine.generate("abc", max_new_tokens=4, stop_token_ids=(first[0],))
    assert (result.token_ids, result.text, result.finish_reason, result.stop_token_id) == ([], "", "stop", first[0])


def test_the_models_eos_token_stops_generation_by_default(tiny_engine):
    eos = tiny_engine.manifest["tokenizer"]["eos_token_ids"][0]
    result = tiny_engine.generate("abc", max_new_tokens=4, logit_bias={eos: 100})  # greedy then picks EOS first
    assert (result.token_ids, result.finish_reason, result.stop_token_id) == ([], "stop", eos)


def test_generate_runs_on_a_batch_one_cache_after_the_backend_held_another(tiny_engine):
    """Something else on the backend (an evaluation, a benchmark) may leave a cache of another batch size bound:
    a request allocates its batch-1 cache again rather than running one sequence over it."""
    expected = tiny_engine.generate(PROMPTS[0], max_new_tokens=6, ignore_eos=True).token_ids
    tiny_engine.backend.allocate_cache(batch=2)
    assert tiny_engine.generate(PROMPTS[0], max_new_tokens=6, ignore_eos=True).token_ids == expected
    assert tiny_engine.backend.cache.batch == 1


def test_generation_stops_at_max_context(tiny_engine):
    prompt = [1] + [65] * (tiny_engine.max_context - 4)
    result = tiny_engine.generate(prompt, max_new_tokens=50, ignore_eos=True)
    assert result.finish_reason == "max_context"
    assert len(prompt) + len(result.token_ids) == tiny_engine.max_context + 1  # the last token is never cached


def test_prompt_longer_than_max_context_is_refused(tiny_engine):
    with pytest.raises(RequestError, match="max context is 128"):
        tiny_engine.generate([5] * 200)
    with pytest.raises(RequestError, match="the prompt has 129 tokens, but this artifact's max context is 128"):
        tiny_engine.generate([5] * 129)
    full = tiny_engine.generate([5] * 128, max_new_tokens=4, ignore_eos=True)  # fills the cache: one token
    assert len(full.token_ids) == 1 and full.finish_reason == "max_context"
    assert tiny_engine.submit([5] * 128, max_new_tokens=1, ignore_eos=True).result(timeout=60).token_ids == full.token_ids
    tiny_engine.close()
    with pytest.raises(RequestError, match="empty"):
        tiny_engine.generate([])


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_new_tokens=0)])
def test_bad_sampling_parameters_are_refused(bad):
    with pytest.raises(RequestError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_requests_from_several_threads_take_turns_on_the_batch_one_cache(tiny_engine):
    prompts = [[1, 5 + i, 9, 20 + 3 * i] for i in range(4)]
    alone = [tiny_engine.generate(p, max_new_tokens=12, ignore_eos=True).token_ids for p in prompts]
    results = [None] * len(prompts)

    def run(i):
        results[i] = tiny_engine.generate(prompts[i], max_new_tokens=12, ignore_eos=True).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == alone


def test_a_stream_belongs_to_every_thread_that_resumed_it(tiny_engine):
    """A stream started here and taken over by a worker: the owner had been this thread only, so the worker, which
    started another request inside its loop, hung on its own cache instead of being refused. Every thread that
    resumed it is refused until it ends (this one too, handed it back: it would wait on itself); a thread that
    never touched it waits its turn."""
    options = dict(max_new_tokens=8, ignore_eos=True)
    expected = tiny_engine.generate([2, 6], **options).token_ids
    handed = iter(tiny_engine.stream([1, 5, 9], **options))
    next(handed)
    outcome = []

    def request():
        try:
            outcome.append(tiny_engine.generate([2, 6], **options).token_ids)
        except RequestError as error:
            outcome.append(str(error))

    def take_over():
        next(handed)
        request()

    taker = threading.Thread(target=take_over, daemon=True)
    taker.start()
    taker.join(timeout=20)
    assert not taker.is_alive(), "the thread iterating the stream hung on its own cache"
    request()  # handed back here
    assert ["still iterating another stream" in str(result) for result in outcome] == [True, True]
    waiter = threading.Thread(target=request)  # never touched it: waits for the stream to end
    waiter.start()
    list(handed)
    waiter.join(timeout=20)
    assert outcome[-1] == expected


def test_interleaving_two_streams_in_one_thread_is_refused(tiny_engine):
    first = iter(tiny_engine.stream("abc", max_new_tokens=8, ignore_eos=True))
    next(first)
    with pytest.raises(RequestError, match="still iterating another stream"):
        next(iter(tiny_engine.stream("xyz", max_new_tokens=8, ignore_eos=True)))
    first.close()  # a stream given up on frees the cache
    assert tiny_engine.generate("xyz", max_new_tokens=3, ignore_eos=True).timings.output_tokens == 3


def test_freeing_the_single_stream_cache_under_this_threads_open_stream_is_refused(tiny_engine):
    """It waited for the batch-1 lock this very thread held: for ever."""
    outcome = []

    def release_under_a_stream():
        stream = iter(tiny_engine.stream("abc", max_new_tokens=8, ignore_eos=True))
        next(stream)
        try:
            tiny_engine.release_single_stream_cache()
        except RequestError as error:
            outcome.append(str(error))
        stream.close()

    thread = threading.Thread(target=release_under_a_stream, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive() and "still iterating another stream" in outcome[0]


def interrupted_at_call(call: int, run) -> bool:
    """run() with a KeyboardInterrupt raised at its `call`-th Python call (a trace function's "call" event: where
    Python checks for signals, so where Ctrl-C's KeyboardInterrupt lands); True if it got that far."""
    calls = 0

    def trace(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1
            if calls == call:
                raise KeyboardInterrupt  # raised in the frame being entered; the trace function is then unset
        return None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        run()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(previous)
    return False


def test_ctrl_c_anywhere_in_a_stream_leaves_the_batch_one_cache_to_the_next_request(tiny_engine):
    """A KeyboardInterrupt that landed in contextlib's __exit__ of the stream's `with batch_one()`, as the request
    returned and before that released the lock, left the batch-1 cache held by a stream that had ended: every
    request from another thread then waited forever, and this thread's were refused as "still iterating another
    stream" (1 stream in ~260-290 under random SIGALRMs). Interrupted at each of its Python calls in turn and then
    given up on, a stream must leave the cache to the next request."""
    options = dict(max_new_tokens=3, ignore_eos=True)
    expected = tiny_engine.generate([1, 5, 9], **options).token_ids
    call = 0
    while True:
        call += 1
        stream = tiny_engine.stream([1, 5, 9], **options)
        if not interrupted_at_call(call, lambda: list(stream)):
            break  # the stream made fewer calls: each one has been interrupted
        stream.close()  # given up on (a no-op for one that has ended)
        outcome = []
        other = threading.Thread(target=lambda: outcome.append(tiny_engine.generate([1, 5, 9], **options).token_ids),
                                 daemon=True)
        other.start()
        other.join(timeout=20)
        assert outcome == [expected], f"interrupted at Python call {call}: the next request waited on a held cache"
        assert tiny_engine.generate([1, 5, 9], **options).token_ids == expected, f"call {call}"
        assert forking.RUNS.running == 0, f"call {call}: a run left counted, which every os.fork() would wait for"
    assert call > 10


def test_a_stream_closed_from_another_thread_while_read_frees_the_cache(tiny_artifact):
    """A server's watcher closes a stream its handler thread reads: close() raised Python's "generator already
    executing" and left the stream's generator holding the batch-1 cache, so every later generate waited for as
    long as anything referred to the stream."""
    import time

    from runtime import Engine

    engine = Engine.load(tiny_artifact)
    run = engine.backend.run
    engine.backend.run = lambda *args: (time.sleep(0.02), run(*args))[1]  # the reader is inside a step most of the time
    stream = engine.stream([5], max_new_tokens=100, ignore_eos=True)
    read, stopped = threading.Event(), []

    def reader():
        try:
            for _ in stream:
                read.set()
        except RequestError as error:
            stopped.append(str(error))

    thread = threading.Thread(target=reader)
    thread.start()
    assert read.wait(30)
    time.sleep(0.01)
    stream.close()  # no ValueError, whichever moment it lands
    thread.join(30)
    assert not thread.is_alive() and stopped and "closed before it finished" in stopped[0]
    after = []
    generating = threading.Thread(target=lambda: after.append(engine.generate([5], max_new_tokens=2)), daemon=True)
    generating.start()
    generating.join(30)  # the stream is still referred to here
    assert after and len(after[0].token_ids) == 2, "the batch-1 cache stayed held by the closed stream"
    # a reader that stops and closes it itself (a `with` block, a finally) after another thread's close frees it too
    stream = engine.stream([5], max_new_tokens=100, ignore_eos=True)
    next(stream)
    stream._closed = True  # as another thread's close() leaves it when it lands inside a step
    stream.close()
    after.clear()
    generating = threading.Thread(target=lambda: after.append(engine.generate([5], max_new_tokens=2)), daemon=True)
    generating.start()
    generating.join(30)
    assert after, "the reader's own close() did nothing after another thread's"
    engine.close()


def test_a_server_frees_the_single_stream_cache_and_a_later_generate_makes_it_again(tiny_artifact, tiny_engine):
    """`aotlm serve` runs every request on the scheduler's slots: the batch-1 cache allocated at load (one sequence
    at the max context, 94 MB of SmolLM2's fp32) sat unused beside them. Freed, the scheduler serves, and a later
    generate allocates and binds a new one and makes the same tokens."""
    from runtime import Engine

    prompt = [1, *range(17, 57)]  # past PREFIX_MIN_TOKENS: a second run reuses its cached prefix
    expected = tiny_engine.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids
    with Engine.load(tiny_artifact, prefix_caching=True) as engine:
        assert engine.release_single_stream_cache() == engine.backend.bytes_per_sequence
        assert engine.backend.cache is None and engine.release_single_stream_cache() == 0
        assert all(not binding.get_outputs() for binding in engine.backend.bindings.values())  # nothing held
        assert engine.submit(prompt, max_new_tokens=6, ignore_eos=True).result(timeout=60).token_ids == expected
        assert engine.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids == expected
        assert engine.backend.cache is not None and engine.backend.cache.batch == 1
        assert engine.generate(prompt, max_new_tokens=6, ignore_eos=True).timings.cached_prompt_tokens > 0


@pytest.mark.parametrize("after", [1, 3])
def test_a_ctrl_c_between_two_pieces_of_generate_leaves_the_engine_usable(tiny_engine, monkeypatch, after):
    """An interrupt outside the stream's generator (at Generation.__next__'s entry, or wait's loop) left the stream,
    which nothing names, holding the batch-1 cache while the REPL kept its traceback: every later generate was
    refused with "this thread is still iterating another stream"."""
    import sys

    from runtime.engine import Generation

    calls, interrupted = [0], []
    next_piece = Generation.__next__

    def interrupting(self):
        calls[0] += 1
        if calls[0] == after:
            raise KeyboardInterrupt
        return next_piece(self)

    monkeypatch.setattr(Generation, "__next__", interrupting)
    try:
        tiny_engine.generate([1, 5, 9], max_new_tokens=8, ignore_eos=True)
    except KeyboardInterrupt:
        interrupted.append(sys.exc_info()[2])  # kept, as a notebook keeps the last traceback
    monkeypatch.setattr(Generation, "__next__", next_piece)
    assert interrupted and len(tiny_engine.generate([1, 5, 9], max_new_tokens=3, ignore_eos=True).token_ids) == 3
