"""benchmarks/http_serving.py's aggregation: the server's TPOT is over the same requests as the clients' (vLLM
leaves one-token outputs out of TPOT; the server's `timings` report their TPOT as 0.0 ms)."""
from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import http_serving  # noqa: E402


def record(sent, ttft, tokens, tpot_s, server_tpot_ms):
    e2e = ttft + (tokens - 1) * tpot_s
    return {"sent": sent, "ttft": ttft, "e2e": e2e, "end": sent + e2e, "tokens": tokens,
            "tpot": tpot_s if tokens > 1 else None,
            "server": {"ttft_ms": 1e3 * ttft, "tpot_ms": server_tpot_ms, "output_tokens": tokens}}


def test_one_token_outputs_are_out_of_the_servers_tpot_as_of_the_clients():
    records = [record(0.0, 0.1, 1, 0.0, 0.0), record(0.0, 0.1, 1, 0.0, 0.0), record(0.0, 0.1, 1, 0.0, 0.0),
               record(0.0, 0.1, 5, 0.020, 20.0), record(0.5, 0.1, 5, 0.022, 22.0)]
    level = http_serving.aggregate(records)
    assert level["tpot_ms"]["median"] == pytest.approx(21.0)
    assert level["server_tpot_ms"] == pytest.approx(21.0)  # was 0.0: the median of three zeros and two TPOTs


def test_no_server_tpot_when_every_output_has_one_token():
    level = http_serving.aggregate([record(0.0, 0.1, 1, 0.0, 0.0), record(0.2, 0.1, 1, 0.0, 0.0)])
    assert level["tpot_ms"]["median"] is None and level["server_tpot_ms"] is None
    assert level["output_tokens_per_s"] == pytest.approx(2 / 0.3)
