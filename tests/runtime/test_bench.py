"""runtime/bench.py and `aotlm bench` on the tiny artifact: workloads, the queue runner, outputs, bad input.

Timings are never asserted, only their order and the structure they must have (one worker: no overlap).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
from rich.console import Console

from compiler import cli
from runtime import Engine, bench
from runtime.bench import BenchError, make_workload, run_workload
from runtime.metrics import RequestTrace, summarize


@pytest.fixture(scope="module")
def encode(tiny_artifact):
    from runtime.tokenizer import TextTokenizer

    return TextTokenizer(tiny_artifact / "tokenizer.json").encode


def workload(encode, **settings):
    return make_workload(encode, max_context=128, **{"requests": 6, "prompt_tokens": "8:24", "output_tokens": "5",
                                                     **settings})


def in_flight_at_arrivals(traces) -> list[int]:
    """How many requests were in the system (arrived, not finished) when each request arrived, itself included."""
    return [sum(o.arrival <= t.arrival < o.finish for o in traces) for t in traces]


def test_poisson_arrivals_reproducible_with_mean_gap(encode):
    first = workload(encode, requests=4000, arrival="poisson", rate=50.0, seed=7, prompt_tokens="2", output_tokens="1")
    again = workload(encode, requests=4000, arrival="poisson", rate=50.0, seed=7, prompt_tokens="2", output_tokens="1")
    other = workload(encode, requests=4000, arrival="poisson", rate=50.0, seed=8, prompt_tokens="2", output_tokens="1")
    assert first.offsets == again.offsets and first.offsets != other.offsets
    assert first.offsets[0] > 0.0 and np.all(np.diff(first.offsets) > 0)  # vLLM's: the first after one gap
    assert np.mean(np.diff(first.offsets)) == pytest.approx(1 / 50.0, rel=0.1)


def test_lengths_drawn_from_ranges_and_prompts_cut_from_text(encode):
    w = workload(encode, requests=40, prompt_tokens="8:24", output_tokens="3:9", warmup=2, seed=1)
    assert len(w.requests) == 40 and len(w.warmup) == 2
    prompts = [len(r.prompt_ids) for r in w.requests]
    outputs = [r.output_tokens for r in w.requests]
    assert min(prompts) >= 8 and max(prompts) <= 24 and len(set(prompts)) > 3
    assert min(outputs) >= 3 and max(outputs) <= 9 and len(set(outputs)) > 2
    assert w.requests[0].prompt_ids != w.requests[1].prompt_ids  # consecutive cuts, not one prompt repeated
    same = workload(encode, requests=40, prompt_tokens="8:24", output_tokens="3:9", warmup=2, seed=1)
    assert [r.prompt_ids for r in same.requests] == [r.prompt_ids for r in w.requests]
    text = workload(encode, requests=3, prompt_tokens="30", text="short text. ")  # repeated to reach the length
    assert [len(r.prompt_ids) for r in text.requests] == [30, 30, 30]


def test_closed_loop_one_worker_queues_and_exact_outputs(tiny_engine, encode):
    concurrency = 3
    w = workload(encode, requests=8, arrival="concurrency", concurrency=concurrency, output_tokens="4:8", warmup=1)
    done = []
    traces = run_workload(bench.aotlm_server(tiny_engine), w, on_done=lambda: done.append(1))
    assert len(done) == 9  # warm-up included in the progress
    assert [t.output_tokens for t in traces] == [r.output_tokens for r in w.requests]
    assert [t.prompt_tokens for t in traces] == [len(r.prompt_ids) for r in w.requests]
    assert max(in_flight_at_arrivals(traces)) <= concurrency
    served = sorted(traces, key=lambda t: t.prefill_start)
    assert all(b.prefill_start >= a.finish for a, b in zip(served, served[1:]))  # one at a time, never overlapping
    assert all(t.queue > 0 for t in traces)
    for t in traces[1:concurrency]:  # sent together with request 0: they waited for it, and TTFT shows it
        assert t.arrival < traces[0].prefill_start and t.prefill_start >= traces[0].finish
        assert t.ttft > t.first_token - t.prefill_start + (traces[0].finish - t.arrival) * 0.99


def test_poisson_and_all_arrivals_run(tiny_engine, encode):
    w = workload(encode, requests=5, arrival="poisson", rate=200.0, seed=2)
    traces = run_workload(bench.aotlm_server(tiny_engine), w)
    arrivals = np.array([t.arrival for t in traces])
    assert np.allclose(arrivals - arrivals[0], np.subtract(w.offsets, w.offsets[0]), atol=1e-9)  # the scheduled time
    traces = run_workload(bench.aotlm_server(tiny_engine), workload(encode, requests=4, arrival="all"))
    assert len({t.arrival for t in traces}) == 1  # all at once
    assert in_flight_at_arrivals(traces)[-1] == 4  # all queued at once


def test_engine_arrival_counts_queueing(tiny_engine):
    arrival = time.perf_counter()
    time.sleep(0.02)
    trace = tiny_engine.generate([5, 6, 7], max_new_tokens=3, ignore_eos=True, arrival=arrival).timings.trace
    assert trace.arrival == arrival and trace.queue >= 0.02 and trace.ttft >= 0.02


def test_report_json_and_plots(tiny_engine, encode, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    w = workload(encode, requests=4, arrival="concurrency", concurrency=2)
    runs = {"aotlm": run_workload(bench.aotlm_server(tiny_engine), w),
            "again": run_workload(bench.aotlm_server(tiny_engine), w)}
    result = bench.report({"x": 1, **w.settings()}, runs, slo={"ttft_ms": 1e6})
    paths = bench.write_outputs(result, tmp_path / "out" / "bench.json")
    assert [p.name for p in paths] == ["bench.json", "bench-cdf.png", "bench-timeline.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    saved = json.loads(paths[0].read_text())
    assert saved["settings"]["requests"] == 4 and saved["settings"]["arrival"] == "concurrency"
    entry = saved["backends"]["aotlm"]
    assert entry["summary"]["requests"] == 4 and entry["summary"]["goodput"]["fraction"] == 1.0
    assert len(entry["traces"]) == 4 and entry["traces"][0]["output_tokens"] == 5
    assert len(entry["traces"][0]["token_times"]) == 5 and min(t["arrival"] for t in entry["traces"]) == 0.0
    assert bench.compare_table(result).row_count == 2
    assert "one request at a time" not in bench.compare_table(result).title  # no slots recorded: nothing to say
    # a later run stopped after its JSON (SIGTERM, or no matplotlib): no earlier run's plots beside it
    monkeypatch.setattr(bench, "write_cdf_plot", lambda *args: None)
    with pytest.raises(bench.BenchError, match="plot skipped"):
        bench.write_outputs(result, tmp_path / "out" / "bench.json")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench.json"]
    peers = bench.report({"slots": 4, "baselines": ["transformers"], **w.settings()},
                         {"aotlm": runs["aotlm"], "transformers": runs["again"]})
    assert bench.compare_table(peers).title.endswith("; aotlm: 4 slots, transformers: one request at a time")
    modes = bench.report({"slots": 4, "baselines": [], **w.settings()}, {"static": runs["aotlm"], "continuous": runs["again"]})
    assert "one request at a time" not in bench.compare_table(modes).title  # both served by the scheduler


def hand_trace(arrival, prefill_start, token_times, finish, **extra) -> RequestTrace:
    return RequestTrace(arrival=arrival, prefill_start=prefill_start, first_token=token_times[0],
                        token_times=list(token_times), finish=finish, prompt_tokens=8, output_tokens=len(token_times),
                        **extra)


def test_report_records_each_trace_from_the_first_arrival():
    """Binary-exact timestamps, the earliest request listed second: its arrival is the run's zero."""
    later = hand_trace(10.0, 10.25, [11.0, 11.5, 11.75, 12.25, 13.0], 13.5, prefill_end=10.75)
    earlier = hand_trace(9.0, 9.0, [9.5], 9.75)
    records = bench.report({}, {"aotlm": [later, earlier]})["backends"]["aotlm"]["traces"]
    assert records[0] == {"request": 0, "prompt_tokens": 8, "cached_prompt_tokens": 0, "output_tokens": 5,
                          "arrival": 1.0, "prefill_start": 1.25,
                          "prefill_end": 1.75, "first_token": 2.0, "finish": 4.5,
                          "token_times": [2.0, 2.5, 2.75, 3.25, 4.0], "ttft_ms": 1000.0, "tpot_ms": 500.0,
                          "e2e_ms": 3000.0, "queue_ms": 250.0, "prefill_ms": 500.0}
    assert records[1] == {"request": 1, "prompt_tokens": 8, "cached_prompt_tokens": 0, "output_tokens": 1,
                          "arrival": 0.0, "prefill_start": 0.0,
                          "prefill_end": None, "first_token": 0.5, "finish": 0.75, "token_times": [0.5],
                          "ttft_ms": 500.0, "tpot_ms": None, "e2e_ms": 500.0, "queue_ms": 0.0, "prefill_ms": 500.0}


def test_a_trace_record_says_how_many_prompt_tokens_came_from_the_cache():
    """With --prefix-caching a request's prefill_ms covers only the prompt tokens it computed: its record must say how
    many it reused, as the summary does for the run."""
    trace = hand_trace(0.0, 0.0, [0.5, 0.75], 0.75, cached_prompt_tokens=6)
    record = bench.trace_record(trace, 0.0, 3)
    assert record["cached_prompt_tokens"] == 6 and record["request"] == 3
    assert bench.report({}, {"aotlm": [trace]})["backends"]["aotlm"]["summary"]["cached_prompt_tokens"] == 6


def test_compare_table_shows_medians_and_ratios_to_the_first_backend():
    # TTFT 250, 500, 1500 ms (median 500, mean 750); TPOT 250, 500, 1000 ms; over 4 s
    fast = [hand_trace(0.0, 0.0, [0.25, 0.5], 0.5), hand_trace(0.0, 0.25, [0.5, 1.0], 1.0),
            hand_trace(0.0, 0.5, [1.5, 2.5], 4.0)]
    slow = [hand_trace(2 * t.arrival, 2 * t.prefill_start, [2 * x for x in t.token_times], 2 * t.finish)
            for t in fast]  # every time doubled: twice the latencies, half the tokens/s
    result = {"settings": {"arrival": "all"},
              "backends": {name: {"summary": summarize(traces)} for name, traces in (("fast", fast), ("slow", slow))}}
    table = bench.compare_table(result)
    rows = [dict(zip((str(column.header) for column in table.columns), row))
            for row in zip(*(list(column.cells) for column in table.columns))]
    assert [row["backend"] for row in rows] == ["fast", "slow"]
    assert (rows[0]["TTFT p50"], rows[0]["TPOT p50"], rows[0]["E2E p50"]) == ("500.0", "500.0", "1000.0")
    assert (rows[0]["TTFT p99"], rows[0]["out tok/s"]) == ("1480.0", "1.5")  # 500 + 0.98 x 1000; 6 tokens / 4 s
    assert (rows[1]["TTFT p50"], rows[1]["out tok/s"]) == ("1000.0", "0.8")
    assert [rows[1][f"{metric} / fast"] for metric in ("TTFT p50", "TPOT p50", "tok/s")] == ["2.00x", "2.00x", "0.50x"]
    assert [rows[0][f"{metric} / fast"] for metric in ("TTFT p50", "TPOT p50", "tok/s")] == ["1.00x"] * 3


def clocked_engine(monkeypatch, seconds_per_run: list[float]):
    """A stand-in engine whose graph runs take `seconds_per_run`, in order, on bench's clock (a fake
    time.perf_counter): time_phase's statistics then have exact answers. Records (graph, positions, mask width)."""
    clock, durations, runs = [1000.0], iter(seconds_per_run), []

    def run(graph, ids, positions, mask):
        runs.append((graph, positions.tolist(), mask.shape[1]))
        clock[0] += next(durations)
        return np.zeros((*ids.shape, 6), np.float32)  # [batch, seq, vocab]

    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    backend = SimpleNamespace(run=run, allocate_cache=lambda batch: None)
    engine = SimpleNamespace(backend=backend, max_context=64, batch_one=contextlib.nullcontext,
                             manifest={"backend": {"weights": {"bytes": 1000}}, "kv_cache": {"bytes_per_token": 10}})
    return engine, runs


def test_time_phase_prefill_is_the_median_after_a_warm_up_run(monkeypatch):
    engine, _ = clocked_engine(monkeypatch, [9.0, 1.0, 4.0, 2.0])  # the first run warms up: not counted
    [row] = bench.time_phase(engine, "prefill", [8], list(range(3, 20)), batch=2, runs=3,
                             flops_for=lambda tokens: 100.0 * tokens, peaks={"flops": 1e4, "bandwidth": 1.0})
    assert row["runs_ms"] == [1000.0, 4000.0, 2000.0] and row["median_ms"] == 2000.0
    assert row["tokens_per_s"] == 8.0  # 2 x 8 tokens in 2 s
    assert row["flops_per_s"] == 800.0 and row["fraction_of_peak"] == pytest.approx(0.08)


def test_time_phase_decode_times_steps_after_the_warm_up_at_their_context(monkeypatch):
    engine, runs = clocked_engine(monkeypatch, [0.5, 50.0, 50.0, 1.0, 2.0, 3.0, 4.0, 10.0])  # prefill, 2 warm-up, 5
    [row] = bench.time_phase(engine, "decode", [8], list(range(3, 20)), batch=2, steps=5, warmup=2,
                             flops_for=lambda tokens: 1.0, peaks={"flops": 1.0, "bandwidth": 100.0})
    assert row["steps_ms"] == [1000.0, 2000.0, 3000.0, 4000.0, 10000.0]
    assert row["median_ms"] == 3000.0 and row["p90_ms"] == pytest.approx(7600.0)  # 4 + 0.6 x (10 - 4) s
    assert row["tokens_per_s"] == pytest.approx(2 / 3)  # batch 2: two tokens a step
    assert row["bytes_per_step"] == 1000 + 10 * 8 * 2 and row["bytes_per_s"] == pytest.approx(1160 / 3)
    assert row["fraction_of_peak"] == pytest.approx(1160 / 3 / 100)
    # the cache holds the 8 prompt tokens; step k feeds position 8 + k and attends to 9 + k
    assert runs[0] == ("prefill", [list(range(8))] * 2, 8)
    assert runs[1:] == [("decode", [[8 + k]] * 2, 9 + k) for k in range(7)]


def test_time_phase_refuses_a_batch_past_the_engines_max_batch(monkeypatch):
    """TensorRT's optimization profiles bound a run's rows (export.max_batch): --batch past them failed inside
    TensorRT at the first run."""
    engine, runs = clocked_engine(monkeypatch, [1.0] * 8)
    engine.backend.max_batch = 2
    with pytest.raises(bench.BenchError, match=r"--batch 3 exceeds the 2 sequences these engines run at once"):
        bench.time_phase(engine, "prefill", [8], list(range(3, 20)), batch=3, runs=1, flops_for=lambda t: 1.0,
                         peaks={"flops": 1.0, "bandwidth": 1.0})
    assert runs == []


def test_time_phase(tiny_engine):
    peaks = {"flops": 1e11, "bandwidth": 1e10}
    rows = bench.time_phase(tiny_engine, "prefill", [8, 32], list(range(3, 40)), runs=2, flops_for=lambda tokens: 2e5 * tokens, peaks=peaks)
    assert [r["prompt_tokens"] for r in rows] == [8, 32]
    for row in rows:  # the rates follow from the median time: work / seconds, then / the peak
        seconds = row["median_ms"] / 1e3
        assert row["median_ms"] == pytest.approx(float(np.median(row["runs_ms"])))
        assert row["flops_per_s"] == pytest.approx(2e5 * row["prompt_tokens"] / seconds)
        assert row["tokens_per_s"] == pytest.approx(row["prompt_tokens"] / seconds)
        assert row["fraction_of_peak"] == pytest.approx(row["flops_per_s"] / peaks["flops"])
    rows = bench.time_phase(tiny_engine, "decode", [8, 40], list(range(3, 50)), batch=2, steps=4, flops_for=lambda tokens: 2e5 * tokens,
                            peaks=peaks)
    weights = tiny_engine.manifest["backend"]["weights"]["bytes"]
    kv = tiny_engine.manifest["kv_cache"]["bytes_per_token"]
    assert rows[1]["bytes_per_step"] == weights + kv * 40 * 2 and len(rows[1]["steps_ms"]) == 4
    for row in rows:
        seconds = row["median_ms"] / 1e3
        assert row["median_ms"] == pytest.approx(float(np.median(row["steps_ms"])))
        assert row["tokens_per_s"] == pytest.approx(2 / seconds)  # batch 2: two tokens a step
        assert row["bytes_per_s"] == pytest.approx(row["bytes_per_step"] / seconds)
        assert row["fraction_of_peak"] == pytest.approx(row["bytes_per_s"] / peaks["bandwidth"])
    assert tiny_engine.generate([5, 6], max_new_tokens=2).token_ids  # the batch-1 cache is back
    with pytest.raises(BenchError, match="max context"):
        bench.time_phase(tiny_engine, "decode", [120], list(range(130)), flops_for=lambda tokens: 2.0 * tokens, peaks=peaks)


def test_time_phase_decode_without_a_weights_file(tiny_engine, monkeypatch):
    """A TensorRT artifact's engines hold the weights (no backend.weights): decode timing raised KeyError; now the
    bytes columns are left empty."""
    monkeypatch.delitem(tiny_engine.manifest["backend"], "weights")
    peaks = {"flops": 1e11, "bandwidth": 1e10}
    rows = bench.time_phase(tiny_engine, "decode", [8], list(range(3, 20)), steps=2, flops_for=lambda tokens: 1.0,
                            peaks=peaks)
    assert rows[0]["bytes_per_step"] is None and rows[0]["median_ms"] > 0
    console = Console(record=True, width=200)
    console.print(bench.phase_table("decode", rows, peaks))
    assert " - " in console.export_text()


def test_cli_bench_and_phases(tiny_artifact, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "b.json"
    assert cli.main(["bench", str(tiny_artifact), "--requests", "3", "--arrival", "poisson", "--rate", "500",
                     "--prompt-tokens", "8:16", "--output-tokens", "4", "--slo-tpot-ms", "1000", "--out", str(out)]) == 0
    assert out.is_file() and (tmp_path / "b-timeline.png").stat().st_size > 0
    machine = json.loads(out.read_text())["machine"]  # what the numbers depend on, for whoever reads them later
    assert machine["cpu_count"] == os.cpu_count() and machine["onnxruntime"] == ort.__version__
    assert "goodput" in capsys.readouterr().err
    import compiler.plan

    monkeypatch.setattr(compiler.plan, "cpu_device", lambda: {"fp32": 1e11, "bandwidth": 1e10, "name": "fake"})
    for phase, flags in (("prefill", ["--prompt-lengths", "8,16", "--runs", "2"]),
                         ("decode", ["--contexts", "8,16", "--steps", "4"])):
        path = tmp_path / f"{phase}.json"
        assert cli.main(["bench", str(tiny_artifact), "--phase", phase, *flags, "--out", str(path)]) == 0
        written = json.loads(path.read_text())
        assert len(written["rows"]) == 2 and (tmp_path / f"{phase}-steps.png").stat().st_size > 0
        assert written["settings"]["runs" if phase == "prefill" else "steps"] == (2 if phase == "prefill" else 4)
        assert ("steps" if phase == "prefill" else "runs") not in written["settings"]  # a count the phase never used
    # The tiny model is untied: a step gathers one row of its embedding table, so the bytes it reads are plan's
    # count, not the whole weights file (which had been counted, 1.3x here).
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    config = compiler.plan.DecoderConfig.from_dict(manifest["model"]["config"])
    counts = compiler.plan.count_params(config)
    weights = manifest["backend"]["weights"]["bytes"]
    assert not config.tie_word_embeddings
    step = compiler.plan.artifact_step_weight_bytes(tiny_artifact)
    assert step == pytest.approx(weights * (1 - counts["embedding"] / counts["total"]))
    first = json.loads((tmp_path / "decode.json").read_text())["rows"][0]
    assert first["bytes_per_step"] == pytest.approx(step + manifest["kv_cache"]["bytes_per_token"] * 8)
    del manifest["backend"]["weights"]  # as a TensorRT artifact's: its engines hold the weights
    (tmp_path / "engine-weights").mkdir()
    (tmp_path / "engine-weights" / "manifest.json").write_text(json.dumps(manifest))
    assert compiler.plan.artifact_step_weight_bytes(tmp_path / "engine-weights") is None  # was a KeyError


def test_a_shared_prefix_starts_every_prompt_and_prefix_caching_reuses_it(tiny_artifact, encode, tmp_path, capsys):
    """--shared-prefix N: every prompt begins with the same N tokens (a system prompt), then its own cut of the
    text; with --prefix-caching a request finds them in the slot another one left, and the summary counts them."""
    plain = make_workload(encode, max_context=128, requests=6, prompt_tokens="8:16", output_tokens="4")
    shared = make_workload(encode, max_context=128, requests=6, prompt_tokens="8:16", output_tokens="4",
                           shared_prefix=40)
    prefix = shared.requests[0].prompt_ids[:40]
    assert all(r.prompt_ids[:40] == prefix for r in shared.requests + shared.warmup)
    assert [len(r.prompt_ids) - 40 for r in shared.requests] == [len(r.prompt_ids) for r in plain.requests]
    assert shared.settings()["shared_prefix_tokens"] == 40
    summaries = {}
    for flags in ([], ["--prefix-caching"]):
        out = tmp_path / f"bench{len(flags)}.json"
        assert cli.main(["bench", str(tiny_artifact), "--requests", "8", "--arrival", "concurrency", "--concurrency",
                         "1", "--prompt-tokens", "8:16", "--output-tokens", "4", "--shared-prefix", "40", *flags,
                         "--out", str(out)]) == 0
        result = json.loads(out.read_text())
        summaries[bool(flags)] = result["backends"]["aotlm"]["summary"]
        assert result["settings"]["prefix_caching"] is bool(flags)
    assert summaries[False]["cached_prompt_tokens"] == 0
    assert summaries[True]["cached_prompt_tokens"] >= 8 * 40  # one client: each request finds the last one's slot
    assert "reused from the cache" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--arrival", "poisson", "--rate", "0"], "--rate must be a finite number > 0"),
    (["--arrival", "poisson", "--rate", "-2"], "--rate must be a finite number > 0"),
    (["--arrival", "poisson"], "needs --rate"),
    (["--arrival", "concurrency", "--concurrency", "5", "--requests", "4"], "exceeds --requests 4"),
    (["--arrival", "concurrency", "--concurrency", "0"], "--concurrency must be >= 1"),
    (["--baseline", "vllm"], "known baselines: transformers, onnxruntime-genai"),
    (["--prompt-tokens", "128"], "(128) + --output-tokens (64) need 191 cache positions"),
    (["--prompt-tokens", "64:200"], "max context is 128"),
    (["--prompt-tokens", "100", "--output-tokens", "64"], "need 163 cache positions (prompt + output - 1); this "
                                                          "artifact's max context is 128; ask for --output-tokens 29 "
                                                          "or fewer with these prompts"),
    (["--prompt-tokens", "130", "--output-tokens", "4"], "ask for --prompt-tokens 125 or fewer with these output "
                                                         "tokens"),  # 125 + 4 - 1 = 128 (it said 128, which fails)
    (["--prompt-tokens", "200", "--output-tokens", "200"], "ask for --prompt-tokens and --output-tokens of at most "
                                                           "129 together"),
    (["--shared-prefix", "500"], "--shared-prefix 500 leaves no room for the prompts; use at most 127"),  # said -372
    (["--prompt-tokens", "128", "--output-tokens", "2"], "max context is 128"),
    (["--prompt-tokens", "abc"], "not a token count"),
    (["--phase", "prefill", "--prompt-lengths", "128"], "max context (128)"),
    (["--phase", "decode", "--baseline", "transformers"], "does not apply to --phase"),
    (["--concurrency", "4"], "--concurrency applies to --arrival concurrency, not all"),
    (["--arrival", "poisson", "--rate", "2", "--concurrency", "2"], "--concurrency applies to --arrival concurrency, not poisson"),
    (["--slots", "100000000", "--prompt-tokens", "8"], "slots: 100000000 sequences need"),  # was numpy's ArrayMemoryError
    (["--phase", "decode", "--contexts", "16", "--batch", "100000000"], "a batch-100000000 cache: 100000000 sequences need"),  # was bad_alloc
    (["--shared-prefix", "60", "--prompt-tokens", "8"], "--shared-prefix (60) + --prompt-tokens (8) + --output-tokens "
                                                        "(64) need 131 cache positions"),
    (["--shared-prefix", "-1"], "--shared-prefix must be >= 0, got -1"),
    (["--phase", "decode", "--prefix-caching"], "--prefix-caching: it shapes a served workload"),
    (["--phase", "decode", "--steps", "200"], "--steps 200 + 4 warm-up steps fill this artifact's max context "
                                             "(128) with no context left to time them at; give --steps 123 or "
                                             "fewer"),  # said "decode size 1", a size nobody gave
])
def test_cli_bad_input_one_line_exit_2(tiny_artifact, capsys, args, message):
    assert cli.main(["bench", str(tiny_artifact), *args]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines at the terminal width
    assert err.startswith("error:") and message in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--slots", "--prefill-chunk"])
def test_cli_counts_below_one_are_refused_as_serves_are(tiny_artifact, capsys, flag):
    with pytest.raises(SystemExit) as exited:  # argparse's usage error, the words serve's --slots uses
        cli.main(["bench", str(tiny_artifact), flag, "0"])
    assert exited.value.code == 2 and f"argument {flag}: 0: give 1 or more" in capsys.readouterr().err


def test_cli_default_output_path_is_checked_before_the_work(tiny_artifact, tmp_path, capsys, monkeypatch):
    """Without --out the JSON goes to benchmarks/results/ under the current folder: an unusable one is refused
    first (it was a traceback after the whole workload ran), in both modes."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").write_text("a file where the folder should be")
    for args in (["--requests", "1"], ["--phase", "prefill", "--prompt-lengths", "8"]):
        assert cli.main(["bench", str(tiny_artifact), *args]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert err.startswith("error: --out benchmarks/results/bench-") and "Traceback" not in err, err


def test_cli_prints_written_paths_as_given(tiny_artifact, tmp_path, capsys):
    """A path with brackets is text, not rich markup (it was a MarkupError, or a wrong path printed)."""
    out = tmp_path / "m[/]x" / "[bold]r.json"
    assert cli.main(["bench", str(tiny_artifact), "--requests", "2", "--prompt-tokens", "8", "--output-tokens", "3",
                     "--out", str(out)]) == 0
    captured = capsys.readouterr()
    printed = (captured.out + captured.err).replace("\n", "")  # rich wraps a long line at the console's width
    assert out.exists() and f"wrote {out}" in printed, printed


def test_cli_not_an_artifact(tmp_path, capsys):
    assert cli.main(["bench", str(tmp_path)]) == 2
    assert "not an artifact" in " ".join(capsys.readouterr().err.split())  # rich wraps a long tmp path's line


def test_transformers_baseline_serves_same_workload(tiny_artifact, encode, tmp_path, monkeypatch):
    """With two end-of-sequence ids, as the default model's config has: transformers 5 refused the list as
    pad_token_id (TypeError in its warm-up request), and the finished aotlm run was lost."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(cli.__file__).resolve().parents[1] / "benchmarks"))
    import baselines
    import generate
    from rich.console import Console

    monkeypatch.setattr(generate, "RESULTS", tmp_path)  # its Hugging Face folder: not into the checkout's cache
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    manifest["recipe"]["model"]["config"]["eos_token_ids"] = [2, 0]
    threads = torch.get_num_threads()
    try:  # the baseline sets torch's threads for the process: the worker's later tests get them back
        serve = baselines.load("transformers", manifest, threads=1, console=Console(quiet=True))
        w = workload(encode, requests=3, arrival="concurrency", concurrency=2, output_tokens="6")
        traces = run_workload(serve, w)
    finally:
        torch.set_num_threads(threads)
    assert [t.output_tokens for t in traces] == [6, 6, 6] and all(t.queue >= 0 for t in traces)


@pytest.mark.parametrize("arrival, settings", [("all", {}), ("concurrency", {"concurrency": 3}),
                                               ("poisson", {"rate": 400.0})])
def test_scheduled_server_batches_requests(tiny_engine, encode, arrival, settings):
    w = workload(encode, requests=9, arrival=arrival, output_tokens="3:12", warmup=1, **settings)
    for batching in ("continuous", "static"):
        server = bench.ScheduledServer(tiny_engine, batching, slots=3)
        assert server.scheduler.batching == batching
        try:
            traces = run_workload(server, w)
        finally:
            server.close()
        assert [t.output_tokens for t in traces] == [r.output_tokens for r in w.requests]
        if arrival == "concurrency":
            assert max(in_flight_at_arrivals(traces)) <= 3
        spans = sorted((t.prefill_start, t.finish) for t in traces)
        most_at_once = max(sum(s <= start < f for s, f in spans) for start, _ in spans)
        assert most_at_once <= 3  # never more than the slots
        if arrival == "all":
            assert most_at_once >= 2  # served together, not one after another
            # continuous fills a freed slot while the others decode; static waits for its whole batch to end (a
            # ScheduledServer that always ran continuous batching had passed this test)
            admitted_midway = any(len(a.token_times) > 1 and a.token_times[1] < b.prefill_start < a.finish
                                  for a in traces for b in traces)
            assert admitted_midway == (batching == "continuous"), batching


def test_cli_bench_compares_static_and_continuous(tiny_artifact, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "b.json"
    assert cli.main(["bench", str(tiny_artifact), "--requests", "6", "--prompt-tokens", "8:16", "--output-tokens",
                     "4:9", "--batching", "static", "--batching", "continuous", "--slots", "3", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert list(saved["backends"]) == ["aotlm-static", "aotlm-continuous"]
    assert saved["settings"]["slots"] == 3 and saved["settings"]["batching"] == ["static", "continuous"]
    assert all(entry["summary"]["requests"] == 6 for entry in saved["backends"].values())


def test_the_warm_up_does_not_change_the_measured_requests():
    from runtime import bench

    encode = lambda text: list(range(len(text.split())))  # noqa: E731
    text = " ".join(["word"] * 5000)
    loads = [bench.make_workload(encode, max_context=256, requests=6, prompt_tokens="4:40", output_tokens="2:30",
                                 warmup=warmup, text=text) for warmup in (0, 1, 3)]
    assert [len(load.warmup) for load in loads] == [0, 1, 3]
    assert loads[0].requests == loads[1].requests == loads[2].requests


class _FinishedHandle:
    """A scheduler handle already done when its callback is added (as concurrent.futures runs it at once)."""

    def __init__(self, request_id, result=None, error=None):
        self.id, self._result, self._error = request_id, result, error

    def add_done_callback(self, callback):
        callback(self)

    def exception(self):
        return self._error

    def result(self):
        if self._error is not None:
            raise self._error
        return self._result


@pytest.mark.parametrize("handle, message", [
    (lambda i: _FinishedHandle(i, result=type("Result", (), {"timings": None})()), "ended without timings"),
    (lambda i: _FinishedHandle(i, error=RuntimeError("worker failed")), "worker failed")])
def test_a_request_that_ends_without_a_trace_is_raised_not_waited_for(encode, handle, message):
    import threading

    server = object.__new__(bench.ScheduledServer)  # its scheduler replaced: no engine needed
    server.scheduler = type("Scheduler", (), {"submit": lambda self, ids, **kw: handle(0)})()
    outcome = []

    def serve():
        try:
            run_workload(server, workload(encode, requests=2, arrival="all"))
        except Exception as error:  # noqa: BLE001 -- what the main thread raised
            outcome.append(error)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "run_workload waited for a trace that never came"
    assert len(outcome) == 1 and message in str(outcome[0])


def test_phase_timing_without_matplotlib_keeps_its_json_and_says_the_plot_was_skipped(tiny_artifact, tmp_path, capsys,
                                                                                      monkeypatch):
    """The step plot needs the bench extra; without it the measurement's JSON stands and the run says so (a
    BenchError after the work would have read as a failure)."""
    import sys

    import compiler.plan

    monkeypatch.setattr(compiler.plan, "cpu_device", lambda: {"fp32": 1e11, "bandwidth": 1e10, "name": "fake"})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    path = tmp_path / "decode.json"
    assert cli.main(["bench", str(tiny_artifact), "--phase", "decode", "--contexts", "8", "--steps", "2",
                     "--out", str(path)]) == 0
    output = " ".join(capsys.readouterr().err.split())  # the console writes to stderr
    assert len(json.loads(path.read_text())["rows"]) == 1 and not (tmp_path / "decode-steps.png").exists()
    assert "plot skipped: matplotlib is not installed (" in output and "-m pip install 'aotlm[bench]')" in output


def test_a_failed_request_is_counted_and_said_and_the_rest_measured(tiny_artifact, tmp_path, monkeypatch, capsys):
    """vLLM's bench reports completed and failed requests. One failed graph run (the scheduler fails that request
    alone) had ended `aotlm bench` with a traceback, every result lost."""
    from tests.runtime.faults import failing_run

    real_init = bench.ScheduledServer.__init__

    def with_a_failing_prefill(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.scheduler.cache.run = failing_run(self.scheduler.cache.run, "prefill", at=3)  # the 2nd measured one

    monkeypatch.setattr(bench.ScheduledServer, "__init__", with_a_failing_prefill)
    out = tmp_path / "b.json"
    assert cli.main(["bench", str(tiny_artifact), "--requests", "6", "--arrival", "concurrency", "--concurrency", "1",
                     "--prompt-tokens", "8", "--output-tokens", "4", "--slo-e2e-ms", "60000", "--out", str(out)]) == 0
    entry = json.loads(out.read_text())["backends"]["aotlm"]
    assert entry["failed"] == 1 and entry["errors"][0]["request"] == 1, entry["errors"]
    assert "out of memory" in entry["errors"][0]["error"]
    assert entry["summary"]["requests"] == len(entry["traces"]) == 5
    # each record names its request: the failed one's gap had shifted every later record onto the wrong request
    assert [t["request"] for t in entry["traces"]] == [0, 2, 3, 4, 5]
    assert 0 < entry["errors"][0]["arrival"] <= entry["errors"][0]["failed"] <= entry["traces"][2]["arrival"]
    assert entry["summary"]["goodput"]["slo"] == {"e2e_ms": 60000.0}  # --slo-e2e-ms, as vLLM's --goodput e2el
    assert entry["summary"]["goodput"]["good_requests"] == 5
    assert entry["summary"]["goodput"]["fraction"] == 5 / 6 and entry["summary"]["failed"] == 1  # a failure meets none
    assert "aotlm: 1 of 6 requests failed (request 1: RuntimeError" in " ".join(capsys.readouterr().err.split())
    failures = []  # the API: without `failures`, the error is raised
    server = bench.ScheduledServer(Engine.load(tiny_artifact), slots=1)
    try:
        w = make_workload(lambda text: list(range(3, 40)), max_context=128, requests=3, prompt_tokens="8",
                          output_tokens="2", warmup=0)
        traces = run_workload(server, w, failures=failures)  # its 3rd prefill fails
        assert [trace is None for trace in traces] == [False, False, True] and failures[0]["request"] == 2
    finally:
        server.close()


def test_a_request_failing_last_counts_in_the_runs_duration():
    """vLLM's bench divides by the whole run's wall time: the duration had ended at the last completed request, so
    a request that ran 2 s and then failed tripled the throughput."""
    done = hand_trace(0.0, 0.0, [0.5], 1.0)
    failure = {"request": 1, "error": "RuntimeError: out of memory", "arrival": 0.5, "failed": 3.0}
    entry = bench.report({}, {"aotlm": [done, None]}, failures={"aotlm": [failure]})["backends"]["aotlm"]
    assert entry["summary"]["duration_s"] == 3.0 and entry["summary"]["requests_per_s"] == 1 / 3
    assert entry["errors"] == [failure] and [t["request"] for t in entry["traces"]] == [0]
    first_failed = {**failure, "request": 0, "arrival": -1.0}  # the first arrival is the run's zero, failed or not
    entry = bench.report({}, {"aotlm": [None, done]}, failures={"aotlm": [first_failed]})["backends"]["aotlm"]
    assert entry["summary"]["duration_s"] == 4.0 and entry["traces"][0]["arrival"] == 1.0
    assert entry["errors"][0]["arrival"] == 0.0 and entry["errors"][0]["failed"] == 4.0


def test_a_poisson_runs_duration_starts_a_gap_before_its_first_arrival_as_vllms():
    """A server that keeps up reports the offered rate: the duration had started at the first arrival, so N requests
    offered at `rate` reported N / (N - 1) times it (+33% at 4 requests, 2x at 2)."""
    w = make_workload(lambda text: list(range(3, 40)), max_context=128, requests=4, arrival="poisson", rate=20.0,
                      prompt_tokens="8", output_tokens="2", warmup=0)
    start = 100.0
    traces = [hand_trace(start + t, start + t, [start + t + 0.001, start + t + 0.002], start + t + 0.002)
              for t in w.offsets]  # each served at once, in 2 ms
    entry = bench.report(w.settings(), {"aotlm": traces})["backends"]["aotlm"]
    assert entry["summary"]["duration_s"] == pytest.approx(4 / 20.0 + 0.002)
    assert entry["summary"]["requests_per_s"] < 20.0
    assert [t["arrival"] for t in entry["traces"]] == pytest.approx(w.offsets)  # the JSON's times: from the start


def test_a_poisson_run_records_how_late_the_runner_sent_each_request(tiny_engine):
    w = make_workload(lambda text: list(range(3, 40)), max_context=128, requests=5, arrival="poisson", rate=200.0,
                      prompt_tokens="8", output_tokens="2", warmup=0)
    lateness = []
    traces = run_workload(bench.aotlm_server(tiny_engine), w, lateness=lateness)
    assert len(lateness) == 5 and min(lateness) >= 0.0
    entry = bench.report(w.settings(), {"aotlm": traces}, lateness={"aotlm": lateness})["backends"]["aotlm"]
    late = entry["send_lateness_ms"]
    assert late["max"] == pytest.approx(1e3 * max(lateness)) and late["p50"] <= late["p99"] <= late["max"]
    assert bench.late_sends({**entry, "send_lateness_ms": {**late, "p99": 0.5}}) is None  # under 1 ms: nothing said
    message = bench.late_sends({**entry, "send_lateness_ms": {"p50": 1.0, "p99": 1e4, "max": 2e4}})
    assert message.startswith("the runner sent requests late (p99 10000.0 ms, max 20000.0 ms")
    closed = bench.report({}, {"aotlm": traces})["backends"]["aotlm"]
    assert "send_lateness_ms" not in closed and bench.late_sends(closed) is None


def test_the_timeline_puts_each_request_on_its_own_row_failed_ones_included(tmp_path, monkeypatch):
    """Rows had been positions in the list of completed traces: after a failed request every later row had the
    wrong number, and the failure did not show."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    drawn = []
    real_barh = Axes.barh
    monkeypatch.setattr(Axes, "barh", lambda self, y, *args, **kwargs: (
        drawn.append((kwargs.get("label"), [float(v) for v in np.atleast_1d(y)])), real_barh(self, y, *args, **kwargs))[1])
    done = [hand_trace(t, t, [t + 0.5, t + 0.75], t + 1.0) for t in (0.0, 2.0, 3.0)]
    failure = {"request": 1, "error": "RuntimeError: out of memory", "arrival": 1.0, "failed": 1.5}
    result = bench.report({}, {"aotlm": [done[0], None, done[1], done[2]]}, failures={"aotlm": [failure]})
    bench.write_outputs(result, tmp_path / "bench.json")
    assert dict(drawn) == {"queue": [0.0, 2.0, 3.0], "prefill": [0.0, 2.0, 3.0], "decode": [0.0, 2.0, 3.0],
                           "failed": [1.0]}


def test_a_failed_warm_up_is_one_line_not_a_traceback(tiny_artifact, tmp_path, monkeypatch, capsys):
    from tests.runtime.faults import failing_run

    real_init = bench.ScheduledServer.__init__

    def with_a_failing_warm_up(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.scheduler.cache.run = failing_run(self.scheduler.cache.run, "prefill", at=1)

    monkeypatch.setattr(bench.ScheduledServer, "__init__", with_a_failing_warm_up)
    assert cli.main(["bench", str(tiny_artifact), "--requests", "2", "--prompt-tokens", "8", "--output-tokens", "2",
                     "--out", str(tmp_path / "b.json")]) == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "the warm-up request failed (RuntimeError: out of memory); nothing was measured" in error, error
    assert "Traceback" not in error and not (tmp_path / "b.json").exists()


def test_a_bench_json_says_when_what_and_by_which_aotlm(tiny_artifact, tmp_path):
    out = tmp_path / "b.json"
    assert cli.main(["bench", str(tiny_artifact), "--requests", "2", "--prompt-tokens", "8", "--output-tokens", "2",
                     "--out", str(out)]) == 0
    settings = json.loads(out.read_text())["settings"]
    manifest = (tiny_artifact / "manifest.json").read_bytes()
    assert settings["manifest_sha256"] == hashlib.sha256(manifest).hexdigest()
    assert settings["artifact_path"] == str(tiny_artifact.resolve()) and settings["artifact_name"] == "tiny-random"
    assert settings["date"].endswith("+00:00") and settings["aotlm"] and "linear" in settings["percentiles"]


def test_a_plot_path_that_cannot_be_written_is_refused_before_the_run(tiny_artifact, tmp_path, capsys):
    (tmp_path / "b-cdf.png").mkdir()  # a folder where a plot goes: it was a traceback from PIL after the whole run
    assert cli.main(["bench", str(tiny_artifact), "--requests", "2", "--out", str(tmp_path / "b.json")]) == 2
    assert "b-cdf.png: is a folder" in capsys.readouterr().err and not (tmp_path / "b.json").exists()


def test_a_workload_that_fills_the_context_exactly_is_accepted():
    """prompt + output - 1 == max context fits (the last token is never fed back): an off-by-one there refused what
    its own message then suggested (a mutation audit)."""
    workload = make_workload(lambda text: list(range(3, 40)), max_context=16, requests=2, prompt_tokens="8",
                             output_tokens="9", arrival="all")
    assert [len(request.prompt_ids) for request in workload.requests] == [8, 8]
    with pytest.raises(BenchError, match="ask for --output-tokens 9 or fewer"):
        make_workload(lambda text: list(range(3, 40)), max_context=16, requests=2, prompt_tokens="8",
                      output_tokens="10", arrival="all")


def test_a_plot_the_disk_refused_leaves_no_cut_short_png_and_is_named(tmp_path):
    """savefig on a full disk left a 32 KiB PNG that no viewer opens, and an error naming no file."""
    import errno

    class FullDisk:
        def savefig(self, path, dpi):
            Path(path).write_bytes(b"\x89PNG" + bytes(100))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError) as raised:
        bench.save_figure(FullDisk(), tmp_path / "b-cdf.png")
    assert raised.value.filename == str(tmp_path / "b-cdf.png") and list(tmp_path.iterdir()) == []
