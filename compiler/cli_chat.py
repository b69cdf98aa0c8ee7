"""`aotlm chat ARTIFACT`: a conversation on the terminal (or a pipe), one line per user message.

Each reply streams to stdout as it is decoded; a line on stderr gives its TTFT, how many prompt tokens came from the
cache (the engine runs with prefix caching: a turn prefills only what the last turn did not leave in the cache),
and its TPOT. When the conversation no longer fits the artifact's context with room for a reply, its oldest turns
are dropped (said on stderr). An empty line is skipped; /exit, /quit or the end of input ends the chat; another
command (a line of one /word) is said to be unknown, not sent to the model. Ctrl-C during a reply stops that reply
and leaves the message and its partial reply out of the conversation, which goes on; Ctrl-C at the prompt ends the
chat (exit status 130); SIGTERM ends it at any point (143).
"""
from __future__ import annotations

import codecs
import contextlib
import re
import sys
import time

from rich.markup import escape

from compiler.console import console, message
from compiler.cli_sampling import add_sampling_options, sampling_options
from compiler.errors import NO_SPIN_HELP, UsageError, text_argument, thread_count, user_path

EXIT_COMMANDS = ("/exit", "/quit")
COMMAND = re.compile(r"/[A-Za-z?]+")  # a line of just this is a command (/help, /clear...), not a message


def add_chat_parser(commands) -> None:
    chat = commands.add_parser("chat", help="talk with an instruct model, turn by turn (prefix caching on)",
                                description="A line per message. /exit, /quit or end of input (Ctrl-D) ends the chat; "
                                            "Ctrl-C stops a reply (the conversation goes on without that exchange), "
                                            "and at the prompt ends the chat.")
    chat.add_argument("artifact", type=user_path, help="an artifact folder whose model has a chat template")
    chat.add_argument("--system", metavar="TEXT", type=text_argument, help="a system message before the conversation")
    chat.add_argument("--max-new-tokens", type=int, default=256, help="tokens per reply at most (default 256)")
    add_sampling_options(chat)
    chat.add_argument("--threads", type=thread_count, default=None,
                      help="onnxruntime intra-op threads (default: the artifact's; at most the CPUs this process may "
                           "use)")
    chat.add_argument("--no-spin", action="store_true", help=NO_SPIN_HELP)
    chat.set_defaults(handler=chat_command)


def checked_system(system: str | None) -> None:
    """--system's text, refused before the load where it is not UTF-8 (bytes in argv): every turn had been refused
    with an error naming messages[0], a message the user never wrote, and the exit status was 0."""
    from runtime import RequestError
    from runtime.tokenizer import check_unicode

    if system:
        try:
            check_unicode(system, "--system")
        except RequestError as problem:
            raise UsageError(str(problem)) from None


def chat_command(args) -> None:
    from runtime import Engine, RequestError
    from runtime.engine import SINGLE_STREAM_SPIN
    from runtime.manifest import read_manifest
    from runtime.sampling import sampling_params
    from runtime.tokenizer import check_unicode

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    checked_system(args.system)
    manifest = read_manifest(args.artifact)
    options = sampling_options(args, manifest)  # flags greedy decoding would ignore, bad values: refused before loading
    if not manifest["tokenizer"].get("chat_template"):  # before loading seconds of weights
        raise UsageError(f"{args.artifact}: its model has no chat template; use `aotlm run --prompt` for plain text")
    engine = Engine.load(args.artifact, intra_op_threads=args.threads, huge_pages=False,
                         spin_after_run=SINGLE_STREAM_SPIN, prefix_caching=True,
                         generation_config=args.generation_config, spin_during_run=not args.no_spin)
    # once for every turn (sampling_options checked the values); the model's defaults for the flags not given
    sampling = sampling_params(None, options, engine.sampling_defaults)
    _undecodable_bytes_kept(sys.stdin)
    # --system "": an empty system message, which keeps a template's default one out (SmolLM2's, Qwen's)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    if system:  # every message was refused as too long, where the system message left room for none
        least = len(engine.chat_prompt_ids(system + [{"role": "user", "content": ""}]))
        room = min(args.max_new_tokens, engine.max_context // 2)
        if least + room >= engine.max_context:  # least has an empty message: any real one adds a token
            engine.close()
            raise UsageError(f"--system: with it, the prompt takes {least} tokens before any message, which leaves "
                             f"no room for a message and a reply ({room} tokens) in the {engine.max_context}-token "
                             f"context; shorten it, or lower --max-new-tokens")
    turns: list[dict] = []  # user and assistant messages, oldest first
    first = True
    while (line := _read_line(first)) is not None:
        first = False
        text = line.strip()
        if not text:
            continue
        if text in EXIT_COMMANDS:
            break
        if COMMAND.fullmatch(text):  # a command this chat does not have, not a message for the model (ollama's rule)
            message(f"[yellow]unknown command {escape(text)}; {' or '.join(EXIT_COMMANDS)} ends the chat (to send it "
                    f"to the model, write more than the one word)[/yellow]")
            continue
        received = time.perf_counter()  # the turn's TTFT counts from here: rendering and tokenizing are in it
        try:
            check_unicode(text, "the message")  # where in it, not where in the rendered conversation
        except RequestError as error:
            message(f"[yellow]{escape(str(error))}[/yellow]")
            continue
        user_message = {"role": "user", "content": text}
        turns.append(user_message)
        try:
            prompt = _fitting_prompt(engine, system, turns, args.max_new_tokens)
            if prompt is None:
                turns.pop()
                with_system = " with the system message and" if system else " with"
                message(f"[yellow]that message alone does not fit the context ({engine.max_context} tokens)"
                        f"{with_system} room for a reply; send a shorter one[/yellow]")
                continue
            generation = engine.stream(prompt, sampling, arrival=received)
            try:
                for piece in generation:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            finally:  # an interrupted reply frees the batch-1 cache; the next turn reuses its prefix where the record of
                # what the cache holds survived (a Ctrl-C inside a graph run leaves the record stale: no reuse)
                generation.close()
        except KeyboardInterrupt as stop:  # Ctrl-C during a reply stops it, not the conversation
            if type(stop) is not KeyboardInterrupt:  # SIGTERM (cli's _Terminated): the program ends, as at the prompt
                with contextlib.suppress(OSError):  # its notice on a line of its own (a hung-up terminal takes none)
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                raise
            if turns and turns[-1] is user_message:  # not popped yet (the "does not fit" branch pops it first)
                turns.pop()
            sys.stdout.write("\n")
            sys.stdout.flush()
            message("[yellow]reply stopped; that message is left out of the conversation (Ctrl-C at the "
                    "prompt, or /exit, ends the chat)[/yellow]")
            continue
        except RequestError as error:  # this message cannot be served (not UTF-8, say): the conversation goes on
            turns.pop()
            message(f"[yellow]{escape(str(error))}[/yellow]")
            continue
        sys.stdout.write("\n")
        result = generation.result
        turns.append({"role": "assistant", "content": result.text})
        timings = result.timings
        # TPOT needs a token after the first (as `aotlm run`'s table shows it): "-" for a one-token reply, not 0.00
        tpot = f"{1e3 * timings.tpot_s:.2f} ms" if timings.output_tokens >= 2 else "-"
        message(f"[dim]TTFT {1e3 * timings.ttft_s:.1f} ms, {timings.cached_prompt_tokens} of "
                f"{timings.prompt_tokens} prompt tokens from the cache, TPOT {tpot}, "
                f"{timings.output_tokens} tokens ({escape(result.finish_reason)})[/dim]")  # one line, as the README says


def _undecodable_bytes_kept(stream) -> None:
    """Bytes that are not UTF-8 read as lone surrogates (as Python reads them under the C locale), so that
    check_unicode names where a message goes wrong: under a UTF-8 locale stdin's errors are strict, and a Latin-1
    byte was a UnicodeDecodeError from readline, a traceback ending the chat."""
    ascii_locale = codecs.lookup(getattr(stream, "encoding", None) or "utf-8").name == "ascii"
    try:  # under an ASCII locale (PYTHONUTF8=0 LC_ALL=C) no typed character but ASCII could be read: UTF-8 then
        stream.reconfigure(errors="surrogateescape", **({"encoding": "utf-8"} if ascii_locale else {}))
    except (AttributeError, ValueError, OSError):  # not a text file (a test's StringIO): nothing to undo
        pass


def _read_line(first: bool = False) -> str | None:
    """The next user message, or None at the end of input; a prompt marker on a terminal. The first line loses a
    UTF-8 byte-order mark (a file saved by Notepad, piped in), as `aotlm eval` drops one from its --text file: it was
    tokenized into the first message (3 tokens of SmolLM2's)."""
    if sys.stdin is None:  # closed (<&-): no input, as /dev/null's
        return None
    terminal = sys.stdin.isatty()
    if terminal:
        console.print("[bold]>[/bold] ", end="")
    try:
        line = sys.stdin.readline()
    except KeyboardInterrupt:  # the notice goes on a line of its own, not after the prompt marker
        if terminal:
            console.print()
        raise
    if not line and terminal:  # Ctrl-D: the shell's prompt on a line of its own
        console.print()
    return (line.removeprefix("\ufeff") if first else line) if line else None


def _fitting_prompt(engine, system: list[dict], turns: list[dict], max_new_tokens: int) -> list[int] | None:
    """The prompt's token ids, dropping the oldest exchanges (and saying so) until it leaves room for the reply; None
    when the last message alone does not fit."""
    room = min(max_new_tokens, engine.max_context // 2)  # a long --max-new-tokens must not crowd out every turn
    if len(engine.chat_prompt_ids(system + turns[-1:])) + room > engine.max_context:
        return None  # before dropping anything: the conversation stays as it was
    while True:
        ids = engine.chat_prompt_ids(system + turns)
        if len(ids) + room <= engine.max_context:
            return ids
        if len(turns) <= 1:
            return None
        del turns[:2]  # the oldest user message and its reply
        message("[dim]dropped the oldest exchange to fit the context[/dim]")
