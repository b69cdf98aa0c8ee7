"""benchmarks/chunked_prefill.py at CI size on the tiny artifact: every setting served, every metric measured."""
from __future__ import annotations

import sys

from tests.conftest import REPO


def test_chunked_prefill_small(tiny_artifact, monkeypatch, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import chunked_prefill
    import generate

    monkeypatch.setattr(generate, "RESULTS", tmp_path)
    result = chunked_prefill.main(["--artifact", str(tiny_artifact), "--chunks", "none,16", "--decoders", "2",
                                   "--decode-tokens", "48", "--long-prompt", "64", "--long-at", "0.05",
                                   "--repeats", "1"])
    assert set(result["medians"]) == {"None", "16"}
    for medians in result["medians"].values():
        assert medians["max_itl_ms"] >= medians["p99_itl_ms"] >= medians["p50_itl_ms"] > 0
        assert medians["long_ttft_ms"] > 0 and medians["output_tokens_per_s"] > 0
    for runs in result["runs"].values():  # the gaps the plot draws: 2 requests x 47 gaps, the maximum among them
        assert len(runs[0]["itl_ms"]) == 2 * 47 and max(runs[0]["itl_ms"]) == runs[0]["max_itl_ms"]
    assert (tmp_path / "chunked_prefill-itl.png").stat().st_size > 0


def test_chunked_prefill_writes_where_asked_and_refuses_one_token_decoders(tiny_artifact, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import chunked_prefill
    import pytest

    out = tmp_path / "sub" / "c.json"
    chunked_prefill.main(["--artifact", str(tiny_artifact), "--chunks", "none", "--decoders", "1", "--decode-tokens",
                          "8", "--long-prompt", "16", "--long-at", "0.01", "--repeats", "1", "--out", str(out)])
    assert out.is_file()
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a long prompt that fits: the refusal is the one-token decoders' own
        chunked_prefill.main(["--artifact", str(tiny_artifact), "--decode-tokens", "1", "--long-prompt", "16",
                              "--out", str(out)])
    assert "--decode-tokens must be >= 2" in capsys.readouterr().err
    assert chunked_prefill.median_of([None, 3.0, 5.0]) == 4.0 and chunked_prefill.median_of([None]) is None
