"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling with a seed."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.random  # noqa: F401  numpy 2 loads it on first use (~20 ms): here, not in a request's TTFT

from runtime.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None  # None = the model's end-of-sequence tokens
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens: {self.max_new_tokens} must be at least 1")
        if self.temperature < 0:
            raise RequestError(f"temperature: {self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise RequestError(f"top_k: {self.top_k} must be >= 0 (0 = no limit)")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p: {self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """One per request, so a seed makes that request's samples reproducible whatever else runs."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """logits: [vocab] float32 -> token id."""
        if self.params.greedy:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / self.params.temperature
        if 0 < self.params.top_k < scaled.size:
            kth_largest = np.partition(scaled, -self.params.top_k)[-self.params.top_k]
            scaled = np.where(scaled < kth_largest, -np.inf, scaled)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if self.params.top_p < 1.0:
            order = np.argsort(-probs)
            cumulative = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = order[: int(np.searchsorted(cumulative, self.params.top_p)) + 1]
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept / kept.sum()
        return int(self.rng.choice(probs.size, p=probs))
