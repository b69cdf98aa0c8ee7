"""Log-likelihoods served over HTTP, as lm-evaluation-harness asks for them, against transformers on the same weights.

    .venv/bin/python benchmarks/served_loglikelihood.py [--artifact artifacts/smollm2-135m] [--items 24]
        [--choices 4] [--context-words 40] [--concurrency 4]

Cloze items from the held-out part of Python's documentation (runtime.evaluate.builtin_text): a context of N words,
the word that follows it as the right choice, and words from elsewhere in the text as the wrong ones. Each
(context, choice) pair is one request of lm-eval's `local-completions` loglikelihood: {"prompt": [token ids],
"max_tokens": 1, "logprobs": 1, "echo": true, "temperature": 0}, the ids split as lm-eval splits them (the context's
own encoding, the rest of the whole's), scored as it scores them (the sum of token_logprobs[context:-1]; greedy where
each is its top_logprobs' max). C clients send them to `aotlm serve`'s ApiServer in this process.
The reference: transformers' LlamaForCausalLM on the artifact's source weights (generate.prepare_folders), the
float64 log-softmax of its logits at the same positions.
Prints a table; writes benchmarks/results/served_loglikelihood.json.
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import artifact_manifest, output_file, require_at_least_one, thread_count  # noqa: E402
from generate import REPO, machine_info, prepare_folders, versions, write_result  # noqa: E402

from runtime import Engine  # noqa: E402
from runtime.evaluate import builtin_text  # noqa: E402
from runtime.server import ApiServer  # noqa: E402
from compiler.console import print_table  # noqa: E402


def cloze_items(text: str, items: int, choices: int, context_words: int, seed: int = 0) -> list[dict]:
    """`items` (context, [right word, wrong words...]) from evenly spaced places of the text."""
    words = text.split()
    rng = np.random.default_rng(seed)
    places = np.linspace(context_words, len(words) - 1, items).astype(int)
    built = []
    for place in places:
        right = words[place]
        wrong: list[str] = []
        while len(wrong) < choices - 1:
            word = words[rng.integers(len(words))]
            if word != right and word not in wrong:
                wrong.append(word)
        built.append({"context": " ".join(words[place - context_words:place]),
                      "choices": [" " + word for word in [right, *wrong]]})
    return built


def requests_of(engine: Engine, items: list[dict]) -> list[dict]:
    """One request per (item, choice): lm-eval's split, the context's own ids then the rest of the whole's."""
    encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    out = []
    for number, item in enumerate(items):
        context = encode(item["context"])
        for choice_number, choice in enumerate(item["choices"]):
            whole = encode(item["context"] + choice)
            out.append({"item": number, "choice": choice_number, "ids": context + whole[len(context):],
                        "context_tokens": len(context)})
    return out


def served(server: ApiServer, request: dict) -> tuple[float, bool, float]:
    """(log-likelihood, greedy, seconds) of one request, as lm-eval reads the response."""
    body = {"model": server.model_name, "prompt": request["ids"], "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}
    connection = http.client.HTTPConnection(*server.server_address[:2], timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    seconds = time.perf_counter() - started
    connection.close()
    if response.status != 200:
        raise SystemExit(f"the server answered {response.status}: {answer}")
    logprobs = answer["choices"][0]["logprobs"]
    scored = logprobs["token_logprobs"][request["context_tokens"]:-1]
    tops = logprobs["top_logprobs"][request["context_tokens"]:-1]
    return float(sum(scored)), all(value == max(top.values()) for value, top in zip(scored, tops)), seconds


def reference(model, request: dict) -> tuple[float, bool]:
    import torch

    ids = request["ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    log_probs = torch.log_softmax(logits, dim=-1)
    positions = range(request["context_tokens"], len(ids))
    return (float(sum(log_probs[p - 1, ids[p]] for p in positions)),
            all(int(log_probs[p - 1].argmax()) == ids[p] for p in positions))


def accuracy(requests: list[dict], key: str) -> float:
    best: dict[int, tuple[float, int]] = {}
    for request in requests:
        score = (request[key], -request["choice"])  # a tie goes to the lower choice, as argmax does
        if request["item"] not in best or score > best[request["item"]][0]:
            best[request["item"]] = (score, request["choice"])
    return sum(choice == 0 for _, choice in best.values()) / len(best)


def render(report: dict, console: Console) -> None:
    summary = report["summary"]
    table = Table(title="log-likelihoods over HTTP (lm-eval's requests) against transformers")
    table.add_column("")
    table.add_column("value", justify="right")
    for name, value in (
            ("items x choices", f"{summary['items']} x {summary['choices']}"),
            ("accuracy, served", f"{summary['accuracy_served']:.3f}"),
            ("accuracy, transformers", f"{summary['accuracy_reference']:.3f}"),
            ("max |log-likelihood diff|", f"{summary['max_abs_diff']:.2e}"),
            ("mean |log-likelihood diff|", f"{summary['mean_abs_diff']:.2e}"),
            ("greedy flags equal", f"{summary['greedy_equal']}/{summary['requests']}"),
            ("requests/s", f"{summary['requests_per_s']:.1f}"),
            ("latency p50 / p99 ms", f"{summary['latency_ms']['p50']:.1f} / {summary['latency_ms']['p99']:.1f}")):
        table.add_row(name, value)
    print_table(table, console)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", type=Path, default=REPO / "artifacts" / "smollm2-135m")
    parser.add_argument("--items", type=int, default=24)
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--context-words", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=4, help="clients sending at once (and scheduler slots)")
    parser.add_argument("--threads", type=thread_count, default=2, help="transformers' torch threads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the work, not a traceback after it
    require_at_least_one(parser, args, "--items", "--context-words", "--concurrency")
    if args.choices < 2:
        parser.error(f"--choices must be >= 2 (a right word and a wrong one), got {args.choices}")
    manifest = artifact_manifest(parser, args.artifact)
    console = Console()

    engine = Engine.load(args.artifact, generation_config="none")  # scored as transformers scores, no model defaults
    requests = requests_of(engine, cloze_items(builtin_text("pydoc-held-out"), args.items, args.choices,
                                               args.context_words))
    engine.start_scheduler(slots=args.concurrency)
    server = ApiServer(engine, port=0)
    server.start()
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("requests over HTTP", total=len(requests))

            def send(request):
                answer = served(server, request)
                progress.advance(task)
                return answer

            started = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                answers = list(pool.map(send, requests))
            wall = time.perf_counter() - started
    finally:
        server.shutdown()
        server.server_close()
        engine.close()
    for request, (loglikelihood, greedy, seconds) in zip(requests, answers):
        request.update(served=loglikelihood, served_greedy=greedy, seconds=seconds)

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    hf_folder, _ = prepare_folders(manifest, console, want_genai=False)
    model = AutoModelForCausalLM.from_pretrained(hf_folder, attn_implementation="eager", dtype=torch.float32).eval()
    with Progress(console=console, transient=True) as progress:
        for request in progress.track(requests, description="transformers"):
            request["reference"], request["reference_greedy"] = reference(model, request)

    diffs = np.array([abs(r["served"] - r["reference"]) for r in requests])
    latency = np.array([r["seconds"] for r in requests]) * 1e3
    report = {
        "benchmark": "served_loglikelihood", "artifact": str(args.artifact),
        "args": {k: str(v) for k, v in vars(args).items()}, "machine": machine_info(), "versions": versions(),
        "summary": {
            "items": args.items, "choices": args.choices, "requests": len(requests),
            "accuracy_served": accuracy(requests, "served"), "accuracy_reference": accuracy(requests, "reference"),
            "max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()),
            "greedy_equal": sum(r["served_greedy"] == r["reference_greedy"] for r in requests),
            "requests_per_s": len(requests) / wall,
            "latency_ms": {"p50": float(np.percentile(latency, 50)), "p99": float(np.percentile(latency, 99))},
        },
        "requests": [{k: v for k, v in r.items() if k != "ids"} | {"tokens": len(r["ids"])} for r in requests],
    }
    render(report, console)
    path = write_result("served_loglikelihood.json", report, args.out)
    console.print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
