"""Serving over HTTP (`aotlm serve`) against serving in process: what the server's HTTP, JSON and threads cost.

    .venv/bin/python benchmarks/http_serving.py [--artifact artifacts/smollm2-135m] [--concurrency 1,8]
        [--requests 16] [--rounds 2] [--prompt-tokens 128] [--new-tokens 64]

The same closed loop both ways: C clients, each sending its next request when its last one ends (prompts cut from
Python's documentation, greedy, stop tokens ignored so every request makes exactly --new-tokens).
- in process: runtime.bench's ScheduledServer, the engine's scheduler with C slots; metrics from the engine's own
  traces (vLLM's definitions, runtime/metrics.py).
- HTTP: `aotlm serve --slots C` in a process of its own (started here on a free port), the clients in this one:
  streamed /v1/completions requests over http.client: TTFT = request sent -> first streamed text, E2E = -> last
  streamed text, TPOT = (E2E - TTFT) / (output tokens - 1) with the output tokens the server's usage counts. (vLLM's
  `bench serve` times the first and last chunks that carry choices: the same first chunk here, and a last one, the
  choice's end, sent right after the last text.) The server's own timings (each stream's last chunk carries them)
  beside.
Rounds alternate the order of the two (ABBA), and ratios are paired per round (generate.paired_median).
Prints a table; writes benchmarks/results/http_serving.json and, beside it, http_serving-ttft.png: each level's TTFT
distribution in process and over HTTP.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import artifact_manifest, output_file, require_at_least_one, thread_count, usable_cpus  # noqa: E402
from generate import REPO, machine_info, paired_median, versions, write_result  # noqa: E402

from runtime import Engine, bench  # noqa: E402
from runtime.metrics import summarize  # noqa: E402
from compiler.console import print_table  # noqa: E402


def in_process(engine: Engine, workload, slots: int) -> dict:
    server = bench.ScheduledServer(engine, "continuous", slots, max_queue=len(workload.requests) + 1)
    try:
        traces = bench.run_workload(server, workload)
    finally:
        server.close()
    summary = summarize(traces)
    return {"output_tokens": sum(trace.output_tokens for trace in traces),
            "output_tokens_per_s": summary["output_tokens_per_s"], "ttft_ms": summary["ttft_ms"],
            "tpot_ms": summary["tpot_ms"], "ttfts_ms": [1e3 * trace.ttft for trace in traces]}


def start_server(artifact: Path, slots: int, threads: int) -> tuple[subprocess.Popen, str, int]:
    process = subprocess.Popen([sys.executable, "-m", "compiler.cli", "serve", str(artifact), "--port", "0",
                                "--slots", str(slots), "--threads", str(threads), "--quiet",
                                "--generation-config", "none"],  # greedy, as the in-process side
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = process.stdout.readline()
    if "http://" not in line:
        process.kill()
        raise SystemExit(f"aotlm serve did not start: {line}{process.stderr.read()}")
    host, port = line.split("http://")[1].removesuffix("/v1\n").split(":")
    return process, host, int(port)


def stream_one(host: str, port: int, prompt_ids: list[int], new_tokens: int) -> dict:
    """One streamed completion, timed at the client."""
    body = json.dumps({"prompt": prompt_ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection(host, port, timeout=600)
    sent = time.perf_counter()
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"the server answered {response.status}: {response.read()!r}")
    first = last = None
    usage = timings = None
    for raw in response:  # server-sent events: "data: {...}" lines, blank lines between
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        now = time.perf_counter()
        if event.get("usage"):
            usage = event["usage"]
        for choice in event["choices"]:
            if choice["text"]:
                first = first or now
                last = now
            if choice["finish_reason"]:
                timings = event["timings"]
                first, last = first or now, last or now  # tokens that made no text: the end stands in
    connection.close()
    tokens = usage["completion_tokens"]
    return {"sent": sent, "ttft": first - sent, "e2e": last - sent, "end": last, "tokens": tokens,
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else None, "server": timings}


def over_http(host: str, port: int, workload, clients: int) -> dict:
    for request in workload.warmup:
        stream_one(host, port, request.prompt_ids, request.output_tokens)
    pending = list(range(len(workload.requests)))
    lock, records = threading.Lock(), []

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                index = pending.pop(0)
            request = workload.requests[index]
            record = stream_one(host, port, request.prompt_ids, request.output_tokens)
            with lock:
                records.append(record)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return aggregate(records)


def aggregate(records: list[dict]) -> dict:
    """A level's numbers from its stream_one records. A one-token output has no TPOT (vLLM leaves it out of its
    tpots): out of the clients' TPOT, and out of the server's, whose `timings` report it as 0.0 ms."""
    start, end = min(r["sent"] for r in records), max(r["end"] for r in records)
    server_tpots = [r["server"]["tpot_ms"] for r in records if r["server"]["output_tokens"] > 1]
    return {"output_tokens": sum(r["tokens"] for r in records),
            "output_tokens_per_s": sum(r["tokens"] for r in records) / (end - start),
            "ttft_ms": ms([r["ttft"] for r in records]),
            "tpot_ms": ms([r["tpot"] for r in records if r["tpot"] is not None]),
            "server_ttft_ms": float(np.median([r["server"]["ttft_ms"] for r in records])),
            "server_tpot_ms": float(np.median(server_tpots)) if server_tpots else None,
            "ttfts_ms": [1e3 * r["ttft"] for r in records]}


def ms(seconds: list[float]) -> dict:
    """Median and p99 in ms (numpy's linear interpolation, as runtime.metrics); None without samples."""
    if not seconds:
        return {"median": None, "p99": None}
    return {"median": 1e3 * float(np.median(seconds)), "p99": 1e3 * float(np.percentile(seconds, 99))}


def cell(values: list[float | None]) -> str:
    """The median of the rounds' values for a table cell; "-" where a run had none (one-token outputs: no TPOT)."""
    values = [value for value in values if value is not None]
    return f"{float(np.median(values)):.2f}" if values else "-"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=REPO / "artifacts" / "smollm2-135m")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests", type=int, default=16, help="measured requests per level and mode")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", default="128")
    parser.add_argument("--new-tokens", default="64")
    parser.add_argument("--threads", type=thread_count, default=usable_cpus())
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the work, not a traceback after it
    require_at_least_one(parser, args, "--requests", "--rounds")
    try:
        levels = [int(level) for level in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency: {args.concurrency!r} is not comma-separated counts, e.g. 1,8")
    if min(levels) < 1 or max(levels) > args.requests:
        parser.error(f"--concurrency: each level must be in 1..--requests ({args.requests})")
    manifest = artifact_manifest(parser, args.artifact)
    console = Console()
    engine = Engine.load(args.artifact, intra_op_threads=args.threads, generation_config="none")  # greedy
    try:  # bench's own checks name its flag, --output-tokens: this script's is --new-tokens
        workloads = {level: bench.make_workload(engine.tokenizer.encode, max_context=engine.max_context,
                                                requests=args.requests, arrival="concurrency", concurrency=level,
                                                prompt_tokens=args.prompt_tokens, output_tokens=args.new_tokens,
                                                warmup=1) for level in levels}
    except bench.BenchError as problem:
        parser.error(str(problem).replace("--output-tokens", "--new-tokens"))
    runs = {level: {"in_process": [], "http": []} for level in levels}
    with Progress(console=console) as progress:
        task = progress.add_task("rounds x levels x modes", total=args.rounds * len(levels) * 2)
        for round_index in range(args.rounds):
            for level in levels:
                modes = ["in_process", "http"] if round_index % 4 in (0, 3) else ["http", "in_process"]
                for mode in modes:
                    if mode == "in_process":
                        runs[level][mode].append(in_process(engine, workloads[level], level))
                    else:
                        process, host, port = start_server(args.artifact, level, args.threads)
                        try:
                            runs[level][mode].append(over_http(host, port, workloads[level], level))
                        finally:
                            process.terminate()
                            process.wait(timeout=60)
                    progress.advance(task)
    table = Table(title=f"{manifest['name']}: closed loop, {args.prompt_tokens}-token prompts, {args.new_tokens} "
                        f"new tokens, {args.requests} requests per run, {args.rounds} rounds (medians; ratio paired)")
    for column in ("clients", "mode", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                   "server TTFT / TPOT p50 ms", "HTTP / in process tok/s"):
        table.add_column(column, justify="right")
    for level in levels:
        for mode in ("in_process", "http"):
            rows = runs[level][mode]
            median = lambda key, stat=None: cell([r[key][stat] if stat else r[key] for r in rows])  # noqa: E731
            server = f"{median('server_ttft_ms')} / {median('server_tpot_ms')}" if mode == "http" else ""
            ratio = paired_median([r["output_tokens_per_s"] for r in runs[level]["http"]],
                                  [r["output_tokens_per_s"] for r in runs[level]["in_process"]])
            table.add_row(str(level), mode.replace("_", " "), median("output_tokens_per_s"),
                          median("ttft_ms", "median"), median("ttft_ms", "p99"), median("tpot_ms", "median"), server,
                          f"{ratio:.3f}x" if mode == "http" else "")
    print_table(table, console)
    settings = {name: str(value) if isinstance(value, Path) else value for name, value in vars(args).items()}
    result = {"artifact": manifest["name"], "settings": settings, "machine": machine_info(), "versions": versions(),
              "runs": {str(level): run for level, run in runs.items()}}
    path = write_result("http_serving.json", result, args.out)
    plot = bench.write_cdf_plot(path.with_name(f"{path.stem}-ttft.png"), {
        f"TTFT, {level} client{'s' * (level > 1)}, every round": {
            mode.replace("_", " "): [t for run in runs[level][mode] for t in run["ttfts_ms"]] for mode in runs[level]}
        for level in levels}, "ms")
    console.print(f"wrote {path}" + (f", {plot}" if plot else f"; {bench.PLOT_SKIPPED}"), markup=False)
    return result


if __name__ == "__main__":
    main()
