"""runtime.bench's Poisson workload realizes the asked rate (vLLM's get_request rescales its N gaps to N / rate)."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.bench import make_workload


def encode(text: str) -> list[int]:
    return [ord(c) % 50 for c in text]


@pytest.mark.parametrize("requests", [2, 16, 32, 200])
@pytest.mark.parametrize("seed", [0, 1, 5])
def test_poisson_offsets_realize_the_asked_rate(requests, seed):
    w = make_workload(encode, max_context=64, requests=requests, arrival="poisson", rate=20.0, seed=seed,
                      prompt_tokens="4", output_tokens="2")
    offsets = np.asarray(w.offsets)
    assert offsets[0] > 0.0 and np.all(np.diff(offsets) > 0) and offsets.size == requests
    assert requests / offsets[-1] == pytest.approx(20.0, rel=1e-12)  # seed 0, 32 requests: 17.3 before rescaling


def test_poisson_gaps_stay_random_and_seeded():
    a, b, c = (make_workload(encode, max_context=64, requests=64, arrival="poisson", rate=5.0, seed=s,
                             prompt_tokens="4", output_tokens="2").offsets for s in (3, 3, 4))
    assert a == b and a != c
    gaps = np.diff(a)
    assert 0.5 < gaps.std() / gaps.mean() < 1.5  # exponential-like spread (coefficient of variation ~1), not uniform


def test_one_poisson_request_arrives_one_mean_gap_after_the_start():
    w = make_workload(encode, max_context=64, requests=1, arrival="poisson", rate=4.0, prompt_tokens="4",
                      output_tokens="2")
    assert w.offsets == [0.25]  # vLLM's get_request: the last of N at N / rate
