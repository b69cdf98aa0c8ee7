"""The sampling defaults a model ships with: read by the loaders, recorded in the manifest, applied by the runtime to
the options a request leaves out (generation_config "auto", vLLM's default), shown by `aotlm inspect`. aotlm ignored
them, decoding greedily where transformers and vLLM sampled at the model's settings."""
from __future__ import annotations

import json

import pytest

from compiler.frontend.generation_defaults import describe, from_generation_config, from_gguf
from runtime import ArtifactError, Engine, RequestError
from tests.compiler.test_cli_inputs import run_cli, wide_console  # noqa: F401 -- wide_console: autouse fixture
from tests.conftest import edited_copy

QWEN_LIKE = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
             "max_new_tokens": 24, "eos_token_id": [2], "bos_token_id": 1}


def test_generation_config_json_gives_the_keys_it_sets_and_the_sampling_ones_only_with_do_sample():
    assert from_generation_config(QWEN_LIKE, "generation_config.json") == ({"source": "generation_config.json", "values": {
        "repetition_penalty": 1.05, "max_new_tokens": 24, "temperature": 0.7, "top_p": 0.8, "top_k": 20}}, [])
    greedy = {**QWEN_LIKE, "do_sample": False}  # transformers decodes greedily and ignores them
    assert from_generation_config(greedy, "g")[0]["values"] == {"repetition_penalty": 1.05, "max_new_tokens": 24}
    assert from_generation_config({"eos_token_id": 2, "bos_token_id": 1}, "g") == ({}, [])  # a base model's file
    gemma = {"do_sample": True, "top_k": 64, "top_p": 0.95}  # asks to sample, names no temperature: 1, as the peers
    assert from_generation_config(gemma, "g")[0]["values"] == {"top_k": 64, "top_p": 0.95, "temperature": 1.0}
    kept, warnings = from_generation_config({"do_sample": True, "temperature": -1, "top_p": 0.9}, "g")
    assert kept["values"] == {"top_p": 0.9} and len(warnings) == 1 and warnings[0].startswith("g: temperature: -1")


def test_a_gguf_s_general_sampling_hints_are_read_as_llama_cpp_applies_them():
    import numpy as np

    fields = {"general.sampling.temp": 0.6000000238418579, "general.sampling.top_k": np.int32(40),
              "general.sampling.penalty_repeat": 1.2999999523162842}
    assert from_gguf(fields.get, "the GGUF's general.sampling") == ({"source": "the GGUF's general.sampling", "values": {
        "temperature": 0.6, "top_k": 40, "repetition_penalty": 1.3}}, [
        "the GGUF's general.sampling: penalty_repeat 1.3 is applied over the whole sequence, as transformers and vLLM "
        "apply it; llama.cpp applies it to the last penalty_last_n tokens (64 by default)"])
    assert describe(from_gguf(fields.get, "s")[0]) == "temperature 0.6, top_k 40, repetition_penalty 1.3 (s)"
    # llama.cpp samples at its 0.8 where the hints name no temperature; penalty_last_n 0 turns its penalty off
    hints = {"general.sampling.top_k": 40, "general.sampling.penalty_repeat": 1.3, "general.sampling.penalty_last_n": 0,
             "general.sampling.mirostat": 2}
    kept, notes = from_gguf(hints.get, "s")
    assert kept["values"] == {"top_k": 40, "temperature": 0.8} and notes == [
        "s: mirostat 2 is not a sampler aotlm has; left out"]


def test_an_hf_folder_s_defaults_reach_the_manifest_and_every_path_applies_them(capsys, tiny_artifact, tmp_path):
    """The defaults a request leaves out come from the model: the batch-1 path, the scheduler and the server alike;
    what a request sets wins; generation_config "none" is aotlm's greedy."""
    from compiler.frontend.random_init import random_model
    from tests.compiler.test_frontend import TINY, write_hf_folder

    folder = tmp_path / "m"
    weights = random_model(TINY, 0)
    write_hf_folder(folder, TINY, weights.state_dict)
    (folder / "tokenizer.json").write_text(weights.tokenizer_json)
    (folder / "generation_config.json").write_text(json.dumps({**QWEN_LIKE, "temperature": 1.5, "top_k": 0,
                                                               "repetition_penalty": 1.3}))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: sampled\nmodel: {{source: hf, path: {folder}}}\nexport: {{max_context: 64}}\n"
                      f"passes: [cleanup]\n")
    status, output = run_cli(capsys, "build", recipe, "--output", tmp_path / "out")
    assert status == 0, output
    artifact = tmp_path / "out" / "sampled"
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["generation_defaults"] == {"source": "generation_config.json", "values": {
        "repetition_penalty": 1.3, "max_new_tokens": 24, "temperature": 1.5, "top_p": 0.8, "top_k": 0}}
    # the runtimes before generation_defaults sampled such a model greedily without a word: now they refuse it
    assert manifest["format_version"] == 2 and manifest["requires"] == ["generation_defaults"]
    status, output = run_cli(capsys, "inspect", artifact)
    assert ("generation: stops at token ids [2]; model defaults repetition_penalty 1.3, max_new_tokens 24, "
            "temperature 1.5, top_p 0.8, top_k 0 (generation_config.json)") in " ".join(output.split()), output
    assert "format v2 (requires generation_defaults)" in output

    engine = Engine.load(artifact)
    model = dict(temperature=1.5, top_p=0.8, top_k=0, repetition_penalty=1.3)
    assert engine.sampling_defaults == model
    prompt, options = [5, 6, 7], dict(max_new_tokens=12, ignore_eos=True, seed=3)
    expected = engine.generate(prompt, **options, **model).token_ids
    assert engine.generate(prompt, **options).token_ids == expected  # the model's defaults, on the batch-1 path
    assert engine.submit(prompt, **options).result().token_ids == expected  # and on the scheduler's
    assert engine.generate(prompt, **options, temperature=0).token_ids == engine.generate(
        prompt, **options, temperature=0, top_p=0.8, repetition_penalty=1.3).token_ids  # what the request sets wins
    engine.close()
    plain = Engine.load(artifact, generation_config="none")
    assert plain.generation_defaults == {} and plain.generate(prompt, **options).token_ids == plain.generate(
        prompt, **options, temperature=0).token_ids  # aotlm's greedy
    plain.close()
    with pytest.raises(RequestError, match="generation_config must be 'auto'"):
        Engine.load(artifact, generation_config="vllm")


def test_the_server_takes_the_model_s_defaults_for_fields_a_request_leaves_out(tiny_artifact, tmp_path):
    """As vLLM's --generation-config auto: max_tokens too, capped to what the context leaves."""
    from runtime.openai_api import _sampling

    artifact = edited_copy(tiny_artifact, tmp_path, lambda manifest: manifest.update(generation_defaults={
        "source": "generation_config.json", "values": {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 20}}))
    engine = Engine.load(artifact)
    try:
        params = _sampling(engine, {}, [1, 2, 3], chat=False, logprobs=None, echo=False)
        assert (params.temperature, params.top_p, params.max_new_tokens) == (0.6, 0.9, 20)
        params = _sampling(engine, {"temperature": 0, "max_tokens": 5}, [1, 2, 3], chat=True, logprobs=None, echo=False)
        assert (params.temperature, params.top_p, params.max_new_tokens) == (0, 0.9, 5)
        params = _sampling(engine, {}, list(range(120)), chat=True, logprobs=None, echo=False)
        assert params.max_new_tokens == engine.max_context + 1 - 120  # the model's 20 does not fit: what is left
    finally:
        engine.close()
    plain = Engine.load(artifact, generation_config="none")
    params = _sampling(plain, {}, [1, 2, 3], chat=False, logprobs=None, echo=False)
    assert (params.temperature, params.top_p, params.max_new_tokens) == (1.0, 1.0, 16)  # OpenAI's
    broken = edited_copy(tiny_artifact, tmp_path, lambda manifest: manifest.update(generation_defaults={
        "values": {"temperature": -2}}), name="broken")
    with pytest.raises(ArtifactError, match="manifest generation_defaults: temperature: -2"):
        Engine.load(broken)


def test_run_and_chat_take_the_model_s_temperature_for_their_sampling_flags(capsys, tiny_artifact, tmp_path):
    """--top-k alone was refused as ignored by greedy decoding: with the model's temperature it samples."""
    artifact = edited_copy(tiny_artifact, tmp_path, lambda manifest: manifest.update(generation_defaults={
        "source": "generation_config.json", "values": {"temperature": 0.8}}))
    status, output = run_cli(capsys, "run", artifact, "--prompt", "hi", "--top-k", "5", "--max-new-tokens", "2")
    assert status == 0, output
    status, output = run_cli(capsys, "run", artifact, "--prompt", "hi", "--top-k", "5", "--generation-config", "none")
    assert status == 2 and "--top-k: it shapes sampling, but --temperature 0 (the default) decodes greedily" in output
    status, output = run_cli(capsys, "run", artifact, "--prompt", "hi", "--top-k", "5", "--temperature", "0")
    assert status == 2 and "--top-k: it shapes sampling, but --temperature 0 (given) decodes greedily" in output


def test_bench_times_greedy_decoding_as_its_workload_says(capsys, tiny_artifact, tmp_path, monkeypatch):
    """With the model's defaults, bench timed top-k/top-p sampling and a penalty against greedy baselines, and its
    JSON still said "greedy"."""
    artifact = edited_copy(tiny_artifact, tmp_path, lambda manifest: manifest.update(generation_defaults={
        "source": "generation_config.json", "values": {"temperature": 0.8, "top_k": 5}}))
    loaded = []
    load = Engine.load.__func__

    def recording(cls, *args, **options):
        engine = load(cls, *args, **options)
        loaded.append(engine.sampling_defaults)
        return engine

    monkeypatch.setattr(Engine, "load", classmethod(recording))
    status, output = run_cli(capsys, "bench", artifact, "--requests", "2", "--prompt-tokens", "8", "--output-tokens",
                             "4", "--out", tmp_path / "b.json")
    assert status == 0 and loaded == [{}], (loaded, output)
    assert json.loads((tmp_path / "b.json").read_text())["settings"]["decoding"].startswith("greedy")


def test_what_a_caller_sets_wins_over_the_model_s_default():
    from runtime.sampling import sampling_params

    assert sampling_params(None, {"temperature": 0.0}, {"temperature": 1.5, "top_p": 0.9}).temperature == 0.0
    assert sampling_params(None, {}, {"temperature": 1.5, "top_p": 0.9}).top_p == 0.9


@pytest.mark.parametrize("values", [{"ignore_eos": True}, {"seed": 1}, {"stop_strings": ["x"]}])
def test_a_manifest_s_defaults_hold_only_the_model_s_sampling_settings(values):
    """An edited manifest's ignore_eos or seed would have applied to every request."""
    from runtime.sampling import model_defaults

    with pytest.raises(ArtifactError, match="manifest generation_defaults: .* is not the model's sampling defaults"):
        model_defaults({"generation_defaults": {"source": "generation_config.json", "values": values}})


def test_min_p_comes_from_either_source():
    assert from_gguf({"general.sampling.min_p": 0.05}.get, "s")[0]["values"] == {"min_p": 0.05, "temperature": 0.8}
    assert from_generation_config({"do_sample": True, "min_p": 0.05}, "g")[0]["values"] == {
        "min_p": 0.05, "temperature": 1.0}


def test_a_list_of_prompts_and_a_chat_take_the_model_s_defaults_too(chat_artifact, tmp_path):
    defaults = {"temperature": 1.5, "top_k": 0, "top_p": 1.0}
    artifact = edited_copy(chat_artifact[0], tmp_path, lambda manifest: manifest.update(generation_defaults={
        "source": "generation_config.json", "values": defaults}))
    engine = Engine.load(artifact)
    try:
        options = dict(max_new_tokens=8, ignore_eos=True, seed=3)
        one = engine.generate([5, 6, 7], **options).token_ids
        assert one != engine.generate([5, 6, 7], **options, temperature=0).token_ids  # sampled: the model's
        assert [r.token_ids for r in engine.generate([[5, 6, 7], [5, 6, 7]], **options)] == [one, one]
        messages = [{"role": "user", "content": "hello there"}]
        chatted = engine.chat(messages, **options).token_ids
        assert chatted == engine.chat(messages, **options, **defaults).token_ids
        assert chatted != engine.chat(messages, **options, temperature=0).token_ids
    finally:
        engine.close()


def test_a_model_without_defaults_records_none_and_an_older_build_s_are_named_unrecorded(capsys, tiny_artifact,
                                                                                           tmp_path):
    """An artifact built before the manifest recorded the model's defaults ran greedily, and inspect said the model
    had none, though its generation_config.json set a temperature: absent now means not recorded."""
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    assert manifest["generation_defaults"] == {"source": None, "values": {}}
    assert manifest["format_version"] == 1 and "requires" not in manifest  # nothing an older runtime would miss
    status, output = run_cli(capsys, "inspect", tiny_artifact)
    assert status == 0 and "model defaults none (aotlm's: greedy)" in " ".join(output.split()), output

    older = edited_copy(tiny_artifact, tmp_path, lambda manifest: manifest.pop("generation_defaults"))
    status, output = run_cli(capsys, "inspect", older)
    assert status == 0 and "model defaults not recorded (aotlm left them out where a model ships none, and did not " \
        "read them before commit ea7d399): rebuild it to apply any the model ships" in " ".join(output.split()), output
    # what this runtime enforces of a format-1 artifact is named, though its manifest lists nothing
    settings = edited_copy(tiny_artifact, tmp_path, lambda manifest: manifest["engines"]["prefill"].update(
        session_config={"session.disable_quant_qdq": "1"}), "settings")
    status, output = run_cli(capsys, "inspect", settings)
    assert "format v1 (requires session_config)" in output and "session: intra_op_threads" in output, output
    assert Engine.load(older).generation_defaults == {}
