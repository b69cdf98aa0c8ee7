"""Prefix caching's rules (Engine.load(prefix_caching=True)): when a prompt's start that a cache holds is worth
taking rather than prefilling, and in what pieces the rest after it runs. The batch-1 path (runtime/engine.py) and
the scheduler's slots (runtime/scheduler.py) both follow them."""
from __future__ import annotations

from typing import Sequence

import numpy as np

# The rest of a prompt after a reused prefix runs through the decode graph, which returns every position's logits and whose onnxruntime arena grows faster than the tokens of a
# run (the default model: +177 MB after 250, +1.5 GB after 1000), so it goes in runs of at most this many.
PREFIX_REST_TOKENS = 256
# A prefix is reused when it holds at least this many tokens, and at least half as many as the rest of the prompt:
# the decode graph computes the rest more slowly than the prefill graph would (the lm_head over every position).
PREFIX_MIN_TOKENS = 16


def rest_piece_tokens(backend, limit: int | None = None) -> int:
    """Tokens per decode-graph run for the rest of a prompt after a past (a later chunk, or the rest after a cached
    prefix): at most `limit` (PREFIX_REST_TOKENS when None), and at most the engine's decode_max_tokens where it
    bounds a call (TensorRT)."""
    limit = limit or PREFIX_REST_TOKENS
    return min(limit, backend.max_decode_tokens or limit)


def reusable_prefix(cached_ids: Sequence[int], prompt_ids: Sequence[int], rest_per_run: int | None = None) -> int:
    """How many of the prompt's first tokens to take from a cache holding `cached_ids`: their common prefix, but
    never the prompt's last token (its logits choose the first output token), and 0 unless the prefix holds at
    least PREFIX_MIN_TOKENS and at least half as many as the rest of the prompt. rest_per_run: the tokens one
    decode call takes where the engine bounds it (TensorRT's decode_max_tokens, 1 by default): the rest must fit
    one call, or a prefill of the whole prompt is the faster."""
    limit = min(len(cached_ids), len(prompt_ids) - 1)
    differs = np.flatnonzero(np.asarray(cached_ids[:limit]) != np.asarray(prompt_ids[:limit]))
    common = int(differs[0]) if differs.size else limit
    rest = len(prompt_ids) - common
    if rest_per_run is not None and rest > rest_per_run:
        return 0
    return common if common >= PREFIX_MIN_TOKENS and 2 * common >= rest else 0
