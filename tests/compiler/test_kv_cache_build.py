"""A build with quantize_kv_cache end to end on the tiny model: the manifest's int8 cache, the accuracy report
against the float-cache graph, the runtime's int8 buffers, and the scheduler's slots on them."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from compiler.build import build
from compiler.cli import main
from compiler.recipe import parse_recipe
from runtime import Engine
from runtime.errors import ArtifactError
from runtime.evaluate import builtin_text, decode_logits_for, encode_text, evaluate
from runtime.onnxruntime_backend import OnnxRuntimeBackend

KV8 = {"quantize_kv_cache": {"calibration": {"text": "pydoc", "samples": 4, "length": 64, "seed": 1}}}
ACCURACY = {"max_tokens": 400, "window": 64, "stride": 32}


@pytest.fixture(scope="module")
def kv8_artifact(tiny_recipe, tmp_path_factory):
    data = tiny_recipe.to_dict()
    data.update(name="tiny-kv8", passes=data["passes"] + [KV8], accuracy=ACCURACY)
    messages: list[str] = []
    folder = build(parse_recipe(data, origin="test"), tmp_path_factory.mktemp("kv8"), progress=messages.append)
    assert any(m.startswith("kv cache calibration (peaks): sample 4/4") for m in messages), messages
    return folder


@pytest.fixture
def kv8_engine(kv8_artifact):
    engine = Engine.load(kv8_artifact)
    yield engine
    engine.close()


def test_manifest_records_an_int8_cache_and_its_accuracy(kv8_artifact, tiny_artifact):
    manifest = json.loads((kv8_artifact / "manifest.json").read_text())
    # its prefill attends to the prompt alone, in float: a rest after a cached prefix runs the decode graph
    assert manifest["engines"]["prefill"]["takes_past"] is False
    float_manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    assert manifest["kv_cache"]["dtype"] == "int8"
    # format 2: runtimes that read only format 1 refuse it in a line (they ran its first step into onnxruntime's error)
    assert (manifest["format_version"], manifest["requires"]) == (2, ["int8_kv_cache"])
    assert float_manifest["format_version"] == 1 and "requires" not in float_manifest
    assert manifest["kv_cache"]["bytes_per_token"] * 4 == float_manifest["kv_cache"]["bytes_per_token"]
    for engine in manifest["engines"].values():
        cache_io = [v for v in [*engine["inputs"], *engine["outputs"]] if v["name"].startswith(("past_", "present."))]
        assert cache_io and {v["dtype"] for v in cache_io} == {"int8"}
    accuracy = manifest["accuracy"]
    assert accuracy["quantization"]["kv_cache"]["quantized_layers"] == 2
    assert "totals" not in accuracy["quantization"]  # no weight quantization in this recipe
    held_out = accuracy["held_out"]
    # The reference is the same graph with a float cache, i.e. the tiny artifact, scored the same way.
    tokens = np.array(encode_text(Engine.load(tiny_artifact).tokenizer, builtin_text("pydoc-held-out"))[:400])
    reference = evaluate(tokens, decode_logits_for(Engine.load(tiny_artifact).backend), window=64, stride=32)
    assert reference.perplexity == pytest.approx(held_out["reference_perplexity"], rel=1e-4)
    assert held_out["perplexity"] != held_out["reference_perplexity"]  # the cache really is rounded
    assert abs(held_out["perplexity_increase"]) < 0.01 and held_out["top1_agreement"] > 0.9


def test_runtime_allocates_int8_buffers_a_quarter_the_size(kv8_engine, tiny_engine):
    kv8_engine.generate("Hello", max_new_tokens=4)
    tiny_engine.generate("Hello", max_new_tokens=4)
    cache, float_cache = kv8_engine.backend.cache, tiny_engine.backend.cache
    assert cache.dtype == np.int8 and cache.nbytes * 4 == float_cache.nbytes
    assert cache.buffers[0].numpy().dtype == np.int8 and cache.buffers[0].numpy().any()  # written in place


def test_logits_follow_the_float_cache_artifact_within_the_round_off(kv8_engine, tiny_engine):
    prompt = [1, 17, 300, 42, 9, 77, 5]
    ids, positions, mask = np.array([prompt]), np.arange(7)[None], np.ones((1, 7), dtype=np.int64)
    for engine in (kv8_engine, tiny_engine):
        engine.backend.allocate_cache(batch=1)
    exact = tiny_engine.backend.run("prefill", ids, positions, mask).copy()
    approximate = kv8_engine.backend.run("prefill", ids, positions, mask).copy()
    for step in range(4):  # teacher-forced: both read their own caches, fed the same tokens
        spread = exact.max() - exact.min()
        assert np.abs(exact - approximate).max() < 0.02 * spread
        feed = (np.array([[40 + step]]), np.array([[7 + step]]), np.ones((1, 8 + step), dtype=np.int64))
        exact = tiny_engine.backend.run("decode", *feed)[0, -1].copy()
        approximate = kv8_engine.backend.run("decode", *feed)[0, -1].copy()


@pytest.mark.parametrize("prefill_chunk", [None, 5])
def test_scheduler_slots_hold_int8_and_batched_requests_make_their_alone_tokens(kv8_engine, prefill_chunk):
    rng = np.random.default_rng(3)
    requests = [([1] + rng.integers(3, 512, size=int(rng.integers(0, 30))).tolist(), int(rng.integers(1, 20)))
                for _ in range(8)]
    expected = [kv8_engine.generate(p, max_new_tokens=n, ignore_eos=True).token_ids for p, n in requests]
    scheduler = kv8_engine.start_scheduler(slots=3, prefill_chunk=prefill_chunk)
    handles = []
    for index, (prompt, n) in enumerate(requests):
        handles.append(kv8_engine.submit(prompt, max_new_tokens=n, ignore_eos=True))
        time.sleep(0.002 * (index % 3))
    assert [h.result(timeout=60).token_ids for h in handles] == expected
    assert {array.dtype for array in scheduler.cache.arrays} == {np.dtype(np.int8)}


def test_a_cache_type_the_runtime_does_not_keep_is_refused_at_load(kv8_artifact):
    manifest = json.loads((kv8_artifact / "manifest.json").read_text())
    manifest["kv_cache"]["dtype"] = "float16"
    with pytest.raises(ArtifactError, match="kv_cache.dtype 'float16'.*keeps float32, int8 caches"):
        OnnxRuntimeBackend(kv8_artifact, manifest)


def test_inspect_and_run_show_the_int8_cache(capsys, kv8_artifact):
    assert main(["inspect", str(kv8_artifact)]) == 0
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert "int8" in output and "0.12 KiB per token" in output  # 2 layers x 2 kv heads x 16 x 2 x 1 byte
    assert "format v2 (requires int8_kv_cache)," in output
    assert main(["run", str(kv8_artifact), "--prompt", "hi", "--max-new-tokens", "3"]) == 0


def test_a_scored_prompt_on_an_int8_cache_is_no_prefix_for_another(kv8_artifact):
    """A prompt_logprobs request fills its rows through the decode graph, whose later rows read the earlier ones as
    int8 codes: a later request that copied its system prompt from those rows got another greedy reply than alone."""
    system = list(np.random.default_rng(8).integers(3, 512, 34))
    follow_up = system + [11, 12, 13, 14, 15, 16]
    alone = Engine.load(kv8_artifact).generate(follow_up, max_new_tokens=10, ignore_eos=True).token_ids
    engine = Engine.load(kv8_artifact, prefix_caching=True)
    engine.start_scheduler(slots=2)
    try:
        engine.submit(system + [7, 8, 9], max_new_tokens=1, prompt_logprobs=2).result(timeout=60)
        result = engine.submit(follow_up, max_new_tokens=10, ignore_eos=True).result(timeout=60)
        assert result.timings.trace.cached_prompt_tokens == 0 and result.token_ids == alone
        engine.submit(system + [7, 8, 9], max_new_tokens=1).result(timeout=60)  # a prefilled one is a prefix
        assert engine.submit(follow_up, max_new_tokens=2).result(timeout=60).timings.trace.cached_prompt_tokens >= 34
    finally:
        engine.close()


def test_a_scored_prompt_on_an_int8_cache_is_no_prefix_on_the_batch_one_path_either(kv8_artifact):
    system = list(np.random.default_rng(8).integers(3, 512, 34))
    follow_up = system + [11, 12, 13, 14, 15, 16]
    engine = Engine.load(kv8_artifact, prefix_caching=True)
    engine.generate(system + [7, 8, 9], max_new_tokens=3, prompt_logprobs=2)
    assert engine.generate(follow_up, max_new_tokens=2).timings.trace.cached_prompt_tokens == 0
    engine.generate(system + [7, 8, 9], max_new_tokens=3)  # a prefilled one is a prefix
    assert engine.generate(follow_up, max_new_tokens=2).timings.trace.cached_prompt_tokens >= 34


def test_the_report_scores_the_held_out_part_of_the_text_a_later_pass_calibrated_on(tiny_recipe, tmp_path):
    """An RTN quantize (no calibration) before a quantize_kv_cache calibrated on the user's file: the report took
    the built-in text, whose held-out part that file may hold in its calibration part, and never checked it."""
    from compiler.calibration import split_text

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(split_text("pydoc")[0][-60_000:])
    data = tiny_recipe.to_dict()
    passes = [p for p in data["passes"] if (p if isinstance(p, str) else next(iter(p))) != "skip_unused_rows"]
    kv8 = {"quantize_kv_cache": {"calibration": {"text": str(corpus), "samples": 2, "length": 32, "seed": 1}}}
    data.update(name="tiny-rtn-kv8", passes=passes + [{"quantize": {"bits": 8, "method": "rtn"}}, kv8],
                accuracy={"max_tokens": 128, "window": 64, "stride": 32})
    folder = build(parse_recipe(data, origin="test"), tmp_path / "out")
    held_out = json.loads((folder / "manifest.json").read_text())["accuracy"]["held_out"]
    assert held_out["text"].startswith(f"{corpus.resolve()}, last 10%"), held_out["text"]


def test_an_onnxruntime_without_the_int8_caches_inputs_is_refused_at_load(kv8_artifact, monkeypatch):
    """1.25 and 1.26 loaded an int8-cache artifact ("it loaded, and runs") and failed at its first step with a
    traceback from inside onnxruntime: the load names the release it needs."""
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "__version__", "1.26.0")
    with pytest.raises(ArtifactError, match=r"onnxruntime 1.26.0 is installed; an int8 KV cache .* needs 1.27"):
        Engine.load(kv8_artifact)
