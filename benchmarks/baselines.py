"""Peers for `aotlm bench --baseline NAME`: the same requests served by transformers or onnxruntime-genai.

Each loader returns serve(prompt_ids, output_tokens, arrival) -> runtime.metrics.RequestTrace, like
runtime.bench.aotlm_server, so the bench runner queues and times every backend alike. Model setup is
generate.py's: the artifact's weights written once as a Hugging Face folder (transformers, eager attention,
fp32) and built once into onnxruntime-genai's fp32 CPU model, both cached under benchmarks/results/cache/.
Greedy, batch 1, and no early stop: exactly `output_tokens` new tokens.

Trace points: prefill_start = the model is called with the prompt (after any per-request setup, which counts
as queueing, as the aotlm engine's cache setup does); genai's prefill_end = append_tokens returned;
transformers has no separate prefill end (prefill then runs to the first token, sampling included).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # generate.py, whether imported or run from anywhere
from generate import Genai, Transformers, prepare_folders  # noqa: E402

from runtime.metrics import RequestTrace  # noqa: E402

NAMES = (Transformers.name, Genai.name)  # == runtime.bench.BASELINES
REQUIRES = {Transformers.name: (("torch", "transformers"), "the `compiler` and `dev` extras (scripts/bootstrap)"),
            Genai.name: (("onnxruntime_genai",), "pip install 'aotlm[bench]'")}


def check_installed(names) -> None:
    """Refuse a baseline whose packages are missing before any backend is served (the check in load() came after
    aotlm had served the whole workload, and exited 1 with nothing written)."""
    import importlib

    from runtime.bench import BenchError

    for name in names:
        modules, install = REQUIRES[name]
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as error:
                raise BenchError(f"--baseline {name}: {module} is not installed ({error}); {install}, or drop "
                                 f"--baseline {name}") from None


def load(name: str, manifest: dict, threads: int, console):
    """Build (once, cached) the peer's model files for the artifact's weights, load it, return its serve()."""
    if name == Genai.name:
        try:
            import onnxruntime_genai  # noqa: F401
        except ImportError as error:
            raise SystemExit(f"{Genai.name} is not installed ({error}); pip install 'aotlm[bench]'") from None
    hf_folder, genai_folder = prepare_folders(manifest, console, want_genai=name == Genai.name)
    if name == Transformers.name:
        return _transformers(Transformers(hf_folder, threads))
    if name == Genai.name:
        return _genai(Genai(genai_folder, threads))
    raise ValueError(f"unknown baseline {name!r}; known: {', '.join(NAMES)}")


def _trace(arrival, prefill_start, prefill_end, times, prompt_ids) -> RequestTrace:
    return RequestTrace(arrival=arrival, prefill_start=prefill_start, first_token=times[0], token_times=times,
                        finish=time.perf_counter(), prompt_tokens=len(prompt_ids), output_tokens=len(times),
                        prefill_end=prefill_end)


def _transformers(loaded: Transformers):
    from transformers.generation.streamers import BaseStreamer

    torch, model = loaded.torch, loaded.model

    class TokenClock(BaseStreamer):  # generate() calls put() with the prompt, then once per new token
        def __init__(self):
            self.times, self.seen_prompt = [], False

        def put(self, value):
            if self.seen_prompt:
                self.times.append(time.perf_counter())
            self.seen_prompt = True

        def end(self):
            pass

    def serve(prompt_ids: list[int], output_tokens: int, arrival: float) -> RequestTrace:
        input_ids = torch.tensor([prompt_ids])
        clock = TokenClock()
        with torch.inference_mode():
            started = time.perf_counter()
            model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, streamer=clock,
                           max_new_tokens=output_tokens, min_new_tokens=output_tokens,
                           pad_token_id=loaded.pad_token_id)
        return _trace(arrival, started, None, clock.times, prompt_ids)

    return serve


def _genai(loaded: Genai):
    og, model = loaded.og, loaded.model

    def serve(prompt_ids: list[int], output_tokens: int, arrival: float) -> RequestTrace:
        params = og.GeneratorParams(model)
        total = len(prompt_ids) + output_tokens  # min_length = max_length: end-of-sequence cannot end it early
        params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=1)
        generator = og.Generator(model, params)  # allocates its KV cache
        tokens = np.asarray(prompt_ids, dtype=np.int32)
        started = time.perf_counter()
        generator.append_tokens(tokens)
        prefill_end = time.perf_counter()
        times = []
        for _ in range(output_tokens):  # the first only picks from append_tokens' logits
            generator.generate_next_token()
            times.append(time.perf_counter())
        return _trace(arrival, started, prefill_end, times, prompt_ids)

    return serve
