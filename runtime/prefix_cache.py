"""Prefix caching's rules (Engine.load(prefix_caching=True)): when a prompt's start that a cache holds is worth
taking rather than prefilling, and in what pieces the rest after it runs. The batch-1 path (runtime/engine.py) and
the scheduler's slots (runtime/scheduler.py) both follow them."""
from __future__ import annotations

from typing import Sequence

import numpy as np

# The rest of a prompt after a reused prefix runs through the prefill graph in one run where it takes a past
# (backend.prefill_takes_past), else through the decode graph, which returns every position's logits and whose
# onnxruntime arena grows faster than the tokens of a run (the default model: +177 MB after 250, +1.5 GB after
# 1000), so there it goes in runs of at most this many.
PREFIX_REST_TOKENS = 256
# A prefix is reused when it holds at least this many tokens. Through the decode graph the rest must also be at most
# twice the prefix: it computes the rest more slowly than the prefill graph would (the lm_head over every position;
# a 512-token prompt's rest after 128 cached tokens took 0.93x a whole prefill, after 8 1.30x). Through the prefill
# graph a prefix pays or breaks even (of 512: after 8 cached tokens 0.97x, after 128 0.72x, benchmarks/
# prefix_caching.py; after 16 of 1024 and 2000, 0.99-1.02x: a review's scratch runs).
PREFIX_MIN_TOKENS = 16
# A prompt piece through the prefill graph holds at least this many tokens unless the whole prompt is shorter: a
# one-row run takes onnxruntime's matrix-vector kernels, whose sums round otherwise (2e-5 in a logit on the default
# model, where runs of 2 to 4 rows after a past equal a whole prefill bit for bit), and on INT4 weights the decode
# graph's 8-bit activations made that a different greedy reply (a repeated prompt, n copies at temperature 0).
PREFILL_PIECE_MIN_TOKENS = 2


def scored_rows_reusable(backend) -> bool:
    """Whether a scored prompt's rows (prompt_logprobs: filled through the decode graph) may be a later prompt's
    prefix. Not on an int8 cache: the decode graph's later rows read the earlier ones as int8 codes, where a prefill
    attends to them in float, and a later request's greedy reply changed with them."""
    return getattr(backend, "cache_dtype", None) is not np.int8


def rest_piece_tokens(backend, limit: int | None = None) -> int:
    """Tokens per decode-graph run for the rest of a prompt after a past (a later chunk, or the rest after a cached
    prefix): at most `limit` (PREFIX_REST_TOKENS when None), and at most the engine's decode_max_tokens where it
    bounds a call (TensorRT)."""
    limit = limit or PREFIX_REST_TOKENS
    return min(limit, backend.max_decode_tokens or limit)


def prefix_key(ids: np.ndarray) -> bytes | None:
    """The first PREFIX_MIN_TOKENS ids as bytes (None where fewer): reusable_prefix is 0 for a cache and a prompt
    whose keys differ, so a scheduler compares only those whose keys match (a dict lookup, not a comparison each)."""
    return ids[:PREFIX_MIN_TOKENS].tobytes() if len(ids) >= PREFIX_MIN_TOKENS else None


def reusable_prefix(cached_ids: Sequence[int], prompt_ids: Sequence[int], backend=None) -> int:
    """How many of the prompt's first tokens to take from a cache holding `cached_ids`: their common prefix, but
    never the prompt's last token (its logits choose the first output token), nor its last two where the rest runs
    through the prefill graph (PREFILL_PIECE_MIN_TOKENS), and 0 unless the prefix holds at least PREFIX_MIN_TOKENS.
    Where the rest runs through the decode graph (`backend` None, or its prefill graph takes no past), also 0 unless
    the prefix holds at least half as many as the rest, and unless the rest fits one decode call where the engine
    bounds it (TensorRT's decode_max_tokens, 1 by default): else a prefill of the whole prompt is the faster."""
    limit = min(len(cached_ids), len(prompt_ids) - 1)
    differs = np.flatnonzero(np.asarray(cached_ids[:limit]) != np.asarray(prompt_ids[:limit]))
    common = int(differs[0]) if differs.size else limit
    through_prefill_graph = backend is not None and backend.prefill_takes_past
    if through_prefill_graph:  # a rest of one token would run as one row (PREFILL_PIECE_MIN_TOKENS)
        common = min(common, len(prompt_ids) - PREFILL_PIECE_MIN_TOKENS)
    if common < PREFIX_MIN_TOKENS:
        return 0
    if through_prefill_graph:
        return common
    rest = len(prompt_ids) - common
    rest_per_run = None if backend is None else backend.max_decode_tokens
    if rest_per_run is not None and rest > rest_per_run:
        return 0
    return common if 2 * common >= rest else 0
