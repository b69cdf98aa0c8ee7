"""What prefix caching saves: a multi-turn chat's TTFT per turn with and without it, and where reusing stops paying.

    .venv/bin/python benchmarks/prefix_caching.py [--artifact artifacts/smollm2-135m] [--turns 6]
        [--message-tokens 48] [--reply-tokens 32] [--repeats 3] [--chats 8] [--slots 8] [--sweep-length 512]

1. A chat (the artifact's template) of --turns user messages, each about --message-tokens tokens of Python's
   documentation, each answered with --reply-tokens greedy tokens (stop tokens off, so replies are that long). Two
   engines of the same artifact run it turn by turn, one with Engine.load(prefix_caching=True): each turn's prompt
   holds every earlier turn, which the cached engine finds in its cache. Per turn: the prompt's tokens, the tokens
   reused, both TTFTs (medians over --repeats conversations) and whether the replies are equal.
2. --chats chats at once, each a client submitting its next turn when its reply is in, through the scheduler's
   --slots slots, on each engine: TTFT by turn, tokens reused, output tokens/s.
3. The raw cost behind the reuse rule (runtime/prefix_cache.py, PREFIX_MIN_TOKENS): for a --sweep-length prompt whose
   first P tokens are cached, the rest through the decode graph (in pieces of PREFIX_REST_TOKENS) and, where the
   artifact's prefill graph takes a past, through it in one run, against a whole prefill, for several P.
Writes benchmarks/results/prefix_caching.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import artifact_manifest, output_file, require_at_least_one, thread_count, usable_cpus  # noqa: E402
from generate import REPO, machine_info, versions, write_result  # noqa: E402

from runtime import Engine, bench  # noqa: E402
from runtime.engine import last_token_logits  # noqa: E402
from runtime.prefix_cache import PREFIX_REST_TOKENS  # noqa: E402
from compiler.console import print_table  # noqa: E402


def messages_for(encode, turns: int, tokens: int) -> list[list[int]]:
    """`turns` consecutive pieces of Python's documentation, `tokens` token ids each, one per user message."""
    ids = bench.text_token_ids(encode, turns * tokens)
    return [ids[i * tokens:(i + 1) * tokens] for i in range(turns)]


def conversation(engines: dict[str, Engine], messages: list[str], reply_tokens: int, reverse: bool = False) -> list[dict]:
    """One chat, turn by turn on every engine (in reverse order if `reverse`, so that alternate repeats put each
    engine first: the one that runs second finds the caches warm); the plain engine's replies continue the chat."""
    history, rows = [], []
    for message in messages:
        history.append({"role": "user", "content": message})
        row = {}
        for name, engine in (reversed(engines.items()) if reverse else engines.items()):
            result = engine.chat(history, max_new_tokens=reply_tokens, ignore_eos=True)
            row[name] = {"ttft_ms": 1e3 * result.timings.ttft_s, "cached": result.timings.cached_prompt_tokens,
                         "prompt_tokens": result.timings.prompt_tokens, "token_ids": result.token_ids}
        rows.append(row)
        reply = engines["plain"].tokenizer.decode(row["plain"]["token_ids"])
        history.append({"role": "assistant", "content": reply})
    return rows


def scheduled_chats(engine: Engine, chats: list[list[str]], reply_tokens: int, slots: int) -> dict:
    """Every chat a client thread of its own, submitting its next turn when the last one's reply is in, all through
    the engine's scheduler: TTFT by turn (the median over chats), what was reused, output tokens/s."""
    import threading

    engine.start_scheduler(slots=slots)
    results: list[list] = [[] for _ in chats]

    def client(index: int) -> None:
        history = []
        for message in chats[index]:
            history.append({"role": "user", "content": message})
            result = engine.submit(engine.chat_prompt_ids(history), max_new_tokens=reply_tokens,
                                   ignore_eos=True).result()
            results[index].append(result)
            history.append({"role": "assistant", "content": result.text})

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(index,)) for index in range(len(chats))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    engine.close()
    turns = len(chats[0])
    return {"ttft_ms_by_turn": [1e3 * statistics.median(r[turn].timings.ttft_s for r in results) for turn in range(turns)],
            "cached_by_turn": [statistics.median(r[turn].timings.cached_prompt_tokens for r in results)
                               for turn in range(turns)],
            "prompt_tokens_by_turn": [statistics.median(r[turn].timings.prompt_tokens for r in results)
                                      for turn in range(turns)],
            "output_tokens_per_s": sum(len(x.token_ids) for r in results for x in r) / wall, "wall_s": wall,
            "replies": [[x.token_ids for x in r] for r in results]}


def sweep(engine: Engine, prompt: list[int], prefixes: list[int], repeats: int) -> list[dict]:
    """Per cached prefix P: the rest after P prefilled tokens through the decode graph (in pieces), and through the
    prefill graph in one run where the artifact's takes a past (engines.prefill.takes_past), against a whole
    prefill; the three interleaved within each repeat."""
    backend, n = engine.backend, len(prompt)
    ids = np.array([prompt], dtype=np.int64)
    ones = np.ones((1, n), dtype=np.int64)

    def timed(run) -> float:
        started = time.perf_counter()
        run()
        return time.perf_counter() - started

    def decode_rest(prefix: int) -> None:
        for start in range(prefix, n, PREFIX_REST_TOKENS):
            end = min(start + PREFIX_REST_TOKENS, n)
            backend.run("decode", ids[:, start:end], np.arange(start, end)[None], ones[:, :end])

    def prefill_rest(prefix: int) -> None:
        backend.run("prefill", ids[:, prefix:], np.arange(prefix, n)[None], ones)

    def cache_prefix(prefix: int) -> None:
        backend.run("prefill", ids[:, :prefix], np.arange(prefix)[None], ones[:, :prefix])

    whole = lambda: last_token_logits(backend.run("prefill", ids, np.arange(n)[None], ones), [n])  # noqa: E731
    rows = []
    for prefix in prefixes:
        times: dict[str, list[float]] = {"decode": [], "prefill": [], "whole": []}
        for _ in range(repeats):
            times["whole"].append(timed(whole))
            cache_prefix(prefix)
            times["decode"].append(timed(lambda: decode_rest(prefix)))
            if backend.prefill_takes_past:
                cache_prefix(prefix)
                times["prefill"].append(timed(lambda: prefill_rest(prefix)))
        rows.append({"prefix": prefix, "rest": n - prefix, "rest_ms": 1e3 * statistics.median(times["decode"]),
                     "rest_prefill_graph_ms": 1e3 * statistics.median(times["prefill"]) if times["prefill"] else None,
                     "whole_prefill_ms": 1e3 * statistics.median(times["whole"])})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=REPO / "artifacts" / "smollm2-135m")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--message-tokens", type=int, default=48)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep-length", type=int, default=512)
    parser.add_argument("--chats", type=int, default=8, help="concurrent chats through the scheduler")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--threads", type=thread_count, default=usable_cpus())
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/prefix_caching.json)")
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the work, not a traceback after it
    require_at_least_one(parser, args, "--turns", "--message-tokens", "--reply-tokens", "--repeats", "--sweep-length",
                         "--chats", "--slots")
    manifest = artifact_manifest(parser, args.artifact)
    if not manifest["tokenizer"].get("chat_template"):
        parser.error(f"{args.artifact}: the artifact has no chat template; this benchmark runs a chat")
    if args.sweep_length >= manifest["kv_cache"]["max_context"]:
        parser.error(f"--sweep-length must be below the artifact's max context ({manifest['kv_cache']['max_context']})")
    console = Console(width=None if sys.stdout.isatty() else 160)
    greedy = {"intra_op_threads": args.threads, "generation_config": "none"}  # replies compared token for token
    engines = {"plain": Engine.load(args.artifact, **greedy),
               "cached": Engine.load(args.artifact, **greedy, prefix_caching=True)}
    encode, decode = engines["plain"].tokenizer.encode, engines["plain"].tokenizer.decode
    messages = [decode(ids) for ids in messages_for(encode, args.turns, args.message_tokens)]
    # The last turn's prompt, its replies stood in by --reply-tokens tokens each: a chat that outgrows the context
    # was a RequestError traceback after the turns before it had run
    reply = decode(encode(" yes" * args.reply_tokens)[-args.reply_tokens:])
    history = [entry for message in messages[:-1] for entry in ({"role": "user", "content": message},
                                                                {"role": "assistant", "content": reply})]
    needed = len(engines["plain"].chat_prompt_ids([*history, {"role": "user", "content": messages[-1]}]))
    if needed + args.reply_tokens > manifest["kv_cache"]["max_context"]:
        parser.error(f"--turns {args.turns} of --message-tokens {args.message_tokens} and --reply-tokens "
                     f"{args.reply_tokens} need about {needed + args.reply_tokens} tokens of context by the last turn; "
                     f"this artifact's max context is {manifest['kv_cache']['max_context']}: give fewer or shorter "
                     f"turns")
    runs = []
    for repeat in range(args.repeats):
        console.print(f"conversation {repeat + 1}/{args.repeats}")
        for engine in engines.values():  # warm, and the cache no longer holds the last conversation's turns
            engine.generate("warm up", max_new_tokens=4)
        runs.append(conversation(engines, messages, args.reply_tokens, reverse=repeat % 2 == 1))
    turns = []
    for turn in range(args.turns):
        plain = [run[turn]["plain"] for run in runs]
        cached = [run[turn]["cached"] for run in runs]
        turns.append({"turn": turn + 1, "prompt_tokens": plain[0]["prompt_tokens"],
                      "cached_tokens": statistics.median(r["cached"] for r in cached),
                      "ttft_plain_ms": statistics.median(r["ttft_ms"] for r in plain),
                      "ttft_cached_ms": statistics.median(r["ttft_ms"] for r in cached),
                      "replies_equal": all(p["token_ids"] == c["token_ids"] for p, c in zip(plain, cached))})
    table = Table(title=f"{args.turns}-turn chat, {args.reply_tokens}-token replies: TTFT, medians of {args.repeats}")
    for column in ("turn", "prompt tokens", "reused", "TTFT ms, whole prefill", "TTFT ms, prefix cached", "ratio",
                   "replies equal"):
        table.add_column(column, justify="right")
    for row in turns:
        table.add_row(str(row["turn"]), str(row["prompt_tokens"]), f"{row['cached_tokens']:g}",
                      f"{row['ttft_plain_ms']:.1f}", f"{row['ttft_cached_ms']:.1f}",
                      f"{row['ttft_cached_ms'] / row['ttft_plain_ms']:.2f}x", "yes" if row["replies_equal"] else "NO")
    print_table(table, console)
    pieces = [decode(ids) for ids in messages_for(encode, args.chats * args.turns, args.message_tokens)]
    chats = [pieces[i * args.turns:(i + 1) * args.turns] for i in range(args.chats)]
    scheduled = {}
    for name, engine in engines.items():
        console.print(f"{args.chats} concurrent chats through {args.slots} slots: {name}")
        scheduled[name] = scheduled_chats(engine, chats, args.reply_tokens, args.slots)
    table = Table(title=f"{args.chats} chats at once, {args.turns} turns each, through the scheduler ({args.slots} "
                        f"slots): TTFT by turn, the median over chats")
    for column in ("turn", "prompt tokens", "reused", "TTFT ms, whole prefill", "TTFT ms, prefix cached"):
        table.add_column(column, justify="right")
    plain, cached = scheduled["plain"], scheduled["cached"]
    for turn in range(args.turns):
        table.add_row(str(turn + 1), f"{plain['prompt_tokens_by_turn'][turn]:g}", f"{cached['cached_by_turn'][turn]:g}",
                      f"{plain['ttft_ms_by_turn'][turn]:.0f}", f"{cached['ttft_ms_by_turn'][turn]:.0f}")
    print_table(table, console)
    console.print(f"output tokens/s: {plain['output_tokens_per_s']:.1f} whole prefill, {cached['output_tokens_per_s']:.1f}"
                  f" prefix cached; replies equal: {plain['replies'] == cached['replies']}")
    prompt = bench.text_token_ids(encode, args.sweep_length)
    prefixes = sorted({p for p in (8, 16, 32, 64, 128, 171, 256, 384, args.sweep_length - 1) if p < args.sweep_length})
    console.print(f"sweep: a {args.sweep_length}-token prompt, cached prefixes {prefixes}")
    costs = sweep(engines["plain"], prompt, prefixes, args.repeats)
    table = Table(title=f"the rest after a cached prefix against a whole {args.sweep_length}-token prefill: through the "
                        f"decode graph (pieces of {PREFIX_REST_TOKENS}) and the prefill graph (one run, where it takes "
                        f"a past), medians of {args.repeats}")
    for column in ("cached prefix", "rest", "decode graph ms", "ratio", "prefill graph ms", "ratio",
                   "whole prefill ms"):
        table.add_column(column, justify="right")
    for row in costs:
        whole, by_prefill = row["whole_prefill_ms"], row["rest_prefill_graph_ms"]
        table.add_row(str(row["prefix"]), str(row["rest"]), f"{row['rest_ms']:.1f}", f"{row['rest_ms'] / whole:.2f}x",
                      "-" if by_prefill is None else f"{by_prefill:.1f}",
                      "-" if by_prefill is None else f"{by_prefill / whole:.2f}x", f"{whole:.1f}")
    print_table(table, console)
    result = {"settings": {k: str(v) for k, v in vars(args).items()}, "machine": machine_info(),
              "versions": versions(), "turns": turns, "sweep": costs,
              "scheduled": {name: {k: v for k, v in r.items() if k != "replies"} | {
                  "replies_equal": r["replies"] == scheduled["plain"]["replies"]} for name, r in scheduled.items()},
              "runs": [[{name: {k: v for k, v in r.items() if k != "token_ids"} for name, r in row.items()}
                        for row in run] for run in runs]}
    console.print(f"wrote {write_result('prefix_caching.json', result, args.out)}")
    return result


if __name__ == "__main__":
    main()
