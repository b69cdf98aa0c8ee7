"""`aotlm serve ARTIFACT`: OpenAI's completions and chat-completions API over HTTP (runtime/server.py), every
connection's requests batched together by the scheduler (continuous batching). The first line on stdout is the
address it listens at; a line per finished request goes to stderr unless --quiet. Ctrl-C or SIGTERM stops it
gracefully: no new requests (503), those under way finish for up to --shutdown-timeout seconds, then the rest are
stopped with a 503 (a stream: an error event and [DONE]) rather than cut off."""
from __future__ import annotations

import argparse
import errno
import math
import os
import signal
import socket
import sys
import threading
import time

from rich.markup import escape

from compiler.console import console, message, warning
from compiler.errors import (NO_SPIN_HELP, UsageError, nonnegative_int, number, positive_float, positive_int,
                             text_argument, thread_count, user_path)


def keep_alive_seconds(text: str) -> float:
    """An argparse type: seconds > 0 and below 1,000,000 (ApiServer's bound)."""
    value = positive_float(text)
    if value >= 1e6:
        raise argparse.ArgumentTypeError(f"{text} must be below 1,000,000 seconds")
    return value


def web_origin(text: str) -> str:
    """An argparse type: "*", or an origin (scheme://host[:port], no path), written as a browser sends it: in lower
    case, without the scheme's default port (https://App.Example.com:443 never matched https://app.example.com)."""
    from runtime.server import ORIGIN  # the server echoes only what this matches

    if text == "*":
        return text
    if ORIGIN.fullmatch(text.lower()):
        origin = text.lower()
        for scheme, port in (("https://", ":443"), ("http://", ":80")):
            if origin.startswith(scheme) and origin.endswith(port):
                origin = origin.removesuffix(port)
        return origin
    raise argparse.ArgumentTypeError(f"{text!r} is not a web origin: give scheme://host[:port] (no path, no trailing "
                                     f"/), e.g. https://app.example.com, or *")


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    value = number(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of seconds, 0 or more")
    return value


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    value = nonnegative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port; give 1 to 65535, or 0 for any free one")
    return value


def listen_address(text: str) -> str:
    """An argparse type: --host, as runtime.server.listen_host takes it, refused before the model loads: `--host
    "$UNSET"` had listened on every interface (an API without a key, open to the network)."""
    from runtime.server import listen_host

    try:
        return listen_host(text)
    except ValueError as problem:
        raise argparse.ArgumentTypeError(str(problem).removeprefix("host ")) from None


def cannot_listen(host: str, port: int, error: OSError) -> UsageError:
    """One line for a refused bind or listen, with the advice that fits what was refused."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if isinstance(error, socket.gaierror):
        advice = f"{host!r} is no address, nor a name this machine resolves: give --host an address of this machine"
    elif error.errno == errno.EADDRINUSE:
        advice = ("another process holds it (a server listening, or one still loading): choose another --port (0: any "
                  "free one)")
    elif error.errno == errno.EACCES:
        advice = "ports below 1024 need root (or CAP_NET_BIND_SERVICE): choose a --port of 1024 or more"
    elif error.errno == errno.EADDRNOTAVAIL:
        advice = "it is not an address of this machine: give --host one of its addresses (0.0.0.0 or :: for all)"
    else:
        advice = "choose another --host or --port"
    return UsageError(f"cannot listen on {where}: {error.strerror or error}; {advice}")


def add_serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="serve an artifact over HTTP: OpenAI's completions and chat API")
    serve.add_argument("artifact", type=user_path, help="an artifact folder (built by `aotlm build`)")
    serve.add_argument("--host", default="127.0.0.1", type=listen_address,
                       help="the address or name to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every "
                            "IPv4 interface; an IPv6 address such as ::1, or :: for every interface, IPv4 too where "
                            "the system allows)")
    serve.add_argument("--port", type=port_number, default=8000, help="TCP port (default 8000; 0: any free one)")
    serve.add_argument("--model-name", default=None, type=text_argument, help="the model's name in the API (default: the artifact's name)")
    serve.add_argument("--slots", type=positive_int, default=None,
                       help="sequences decoded together, each with a max-context KV cache slot (default 8)")
    serve.add_argument("--max-queue", type=positive_int, default=256,
                       help="requests waiting for a slot at most; beyond them the server answers 503 (default 256)")
    serve.add_argument("--prefill-chunk", type=positive_int, default=None,
                       help="prefill at most this many prompt tokens per step while others decode (default: whole)")
    serve.add_argument("--generation-config", choices=("auto", "none"), default="auto",
                       help="auto: fields a request leaves out take the model's own sampling defaults where it ships "
                            "them (generation_config.json, a GGUF's general.sampling), as vLLM's default; none: "
                            "OpenAI's (temperature 1)")
    serve.add_argument("--prefix-caching", action="store_true",
                       help="a prompt whose start a slot already holds (a system prompt, a chat's earlier turns, n "
                            "samples of one prompt) prefills only the rest; each free slot keeps one such record "
                            "(at most --slots), the least recently left overwritten first")
    serve.add_argument("--threads", type=thread_count, default=None,
                       help="onnxruntime intra-op threads (default: the artifact's; at most the CPUs this process may "
                            "use)")
    serve.add_argument("--no-spin", action="store_true", help=NO_SPIN_HELP)
    serve.add_argument("--max-connections", type=positive_int, default=None,
                       help="connections open at once, a thread each; one more is answered 503 and closed "
                            "(default 1024)")
    serve.add_argument("--api-key", default=None,
                       help="ask /v1 and tokenizer requests for 'Authorization: Bearer KEY' (default: $AOTLM_API_KEY, "
                            "which keeps the key out of the process list; unset: no key)")
    serve.add_argument("--shutdown-timeout", type=seconds, default=25.0,
                       help="on Ctrl-C or SIGTERM, seconds the requests under way may take to finish before they are "
                            "stopped (default 25, inside Kubernetes' 30 s grace before its SIGKILL; 0: at once)")
    serve.add_argument("--keep-alive-timeout", type=keep_alive_seconds, default=5.0,
                       help="seconds an idle kept-alive connection waits for its next request (default 5, uvicorn's); "
                            "behind a load balancer that pools connections, give more than its idle timeout")
    serve.add_argument("--allowed-origins", action="append", type=web_origin, default=[], metavar="ORIGIN",
                       help="a web origin (https://app.example.com, or *) whose pages may call the API from a browser "
                            "(CORS); repeatable; none by default")
    serve.add_argument("--no-huge-pages", action="store_true",
                       help="leave the weights on 4 KiB pages: ready 1-5 s sooner (the default model, fp32), decode "
                            "steps 5-8%% slower (README: Huge pages)")
    serve.add_argument("--quiet", action="store_true",
                       help="no line per answered request on stderr (errors and refusals are still logged)")
    serve.set_defaults(handler=serve_command)


def load_dependent_outputs(manifest: dict, prefill_chunk: int | None, prefix_caching: bool) -> str | None:
    """A warning where a request's tokens (greedy or seeded) will depend on the load and on what was served before:
    an int8 KV cache whose prefill attends over the prompt in float, with chunks or cached prefixes, which read
    earlier tokens' keys and values as int8 codes instead."""
    if manifest["kv_cache"].get("dtype") != "int8" or not (prefill_chunk or prefix_caching):
        return None
    options = next((spec["quantize_kv_cache"] for spec in manifest["recipe"]["passes"]
                    if isinstance(spec, dict) and "quantize_kv_cache" in spec), None) or {}
    if options.get("prefill_attention", "float") != "float":
        return None
    flags = " and ".join(flag for flag, on in (("--prefill-chunk", prefill_chunk), ("--prefix-caching",
                                                                                    prefix_caching)) if on)
    return (f"this artifact's KV cache is int8 and its prefill attends over a prompt in float: with {flags} a prompt "
            f"read partly from the cache (as int8) gets other logits, so a request's tokens, greedy or seeded, depend "
            f"on the load and on what was served before (SmolLM2: 10 of 12 seeded requests differed under load); "
            f"rebuild with quantize_kv_cache.prefill_attention: int8 for outputs that do not (prefill attention 4-5x "
            f"slower), or serve without {flags}")


def serve_command(args) -> None:
    from runtime import Engine
    from runtime.descriptors import connections_that_fit
    from runtime.server import MAX_CONNECTIONS, ApiServer, bind_socket

    if args.model_name is not None and not args.model_name.strip():
        raise UsageError("--model-name: give a non-empty name (the API's `model` field)")
    if args.model_name is not None:  # bytes that are not UTF-8: /v1/models published a lone surrogate
        from runtime import RequestError
        from runtime.tokenizer import check_unicode

        try:
            check_unicode(args.model_name, "--model-name")
        except RequestError as problem:
            raise UsageError(str(problem)) from None
    api_key = args.api_key if args.api_key is not None else os.environ.get("AOTLM_API_KEY")
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key / AOTLM_API_KEY: empty; give a key, or leave both unset to serve without one")
    if api_key is not None and not (api_key.isascii() and api_key.isprintable()):  # no client could send it
        raise UsageError("--api-key / AOTLM_API_KEY: use printable ASCII characters only (HTTP headers carry "
                         "ISO-8859-1, where clients send a key's UTF-8 bytes: no request would ever match it)")
    # The port is taken before the model loads (a taken one was found after a 6-9 s, 2 GB load), and listened on
    # only once the scheduler is ready: until then connections are refused, as vLLM binds before building its engine.
    try:
        bound = bind_socket(args.host, args.port)
    except OSError as error:  # the port is taken, the address is not this machine's, ...
        raise cannot_listen(args.host, args.port, error) from None
    try:
        engine = Engine.load(args.artifact, intra_op_threads=args.threads, prefix_caching=args.prefix_caching,
                             huge_pages=not args.no_huge_pages, generation_config=args.generation_config,
                             spin_during_run=not args.no_spin)
    except BaseException:
        bound.close()
        raise
    engine.release_single_stream_cache()  # the server runs every request on the scheduler's slots: room for them
    try:
        if caveat := load_dependent_outputs(engine.manifest, args.prefill_chunk, args.prefix_caching):
            warning(caveat)
        # idle_exit_s inf: a server's worker never ends, so no request waits on a thread that must start (a
        # container at its pids.max refused one mid-run)
        scheduler = engine.start_scheduler(slots=args.slots, max_queue=args.max_queue,
                                           prefill_chunk=args.prefill_chunk, idle_exit_s=math.inf)
        max_connections, fewer = connections_that_fit(args.max_connections or MAX_CONNECTIONS)
        if fewer:
            warning(fewer)
        server = ApiServer(engine, args.host, args.port, model_name=args.model_name,
                           log=_log_line, log_requests=not args.quiet, api_key=api_key,
                           max_connections=max_connections,
                           keep_alive_s=args.keep_alive_timeout, allowed_origins=tuple(args.allowed_origins),
                           bound_socket=bound)
    except OSError as error:  # listen refused (a server that took the port some other way meanwhile)
        bound.close()
        engine.close()
        raise cannot_listen(args.host, args.port, error) from None
    except BaseException:
        bound.close()
        engine.close()
        raise
    try:  # from the URL on: a SIGTERM as soon as a supervisor reads it is a drain, exit 0 (it was 143 there)
        print(f"serving {server.model_name} at {server.url}/v1", flush=True)
        chat_route = (", /v1/chat/completions" if engine.manifest["tokenizer"].get("chat_template") else
                      " (no chat template: /v1/chat/completions refuses)")
        message(escape(f"{scheduler.slots} slots, {scheduler.max_queue} may wait; max context {engine.max_context} "
                       f"tokens; POST /v1/completions{chat_route}; {'API key required; ' if api_key else ''}"
                       f"Ctrl-C stops"))
        from compiler.frontend.generation_defaults import UNRECORDED, describe

        if engine.generation_defaults:  # as vLLM says it: the answers to requests that set none of these change
            message(escape(f"the model's sampling defaults apply to the fields a request leaves out: "
                           f"{describe(engine.manifest['generation_defaults'])}; --generation-config none for "
                           f"OpenAI's"))
        elif "generation_defaults" not in engine.manifest:
            message(escape(f"the model's sampling defaults: {UNRECORDED}"))
        server.serve_forever()
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM or SIGHUP (compiler/cli.py raises the last two as one)
        stopped = _stop_gracefully(server, engine, args.shutdown_timeout)
        # SIGTERM is how systemd and Kubernetes stop a service: a drain that let every request finish is a clean
        # exit (0, as uvicorn's), not a failure (143 marked the unit failed and the container's end "Error")
        if getattr(stop, "signum", None) == signal.SIGTERM and not stopped:
            message("stopped: every request under way finished")
            return
        raise
    except BaseException:  # a bug in the server loop
        _stop_gracefully(server, engine, args.shutdown_timeout)
        raise


def _stop_gracefully(server, engine, timeout_s: float) -> int:
    """No new connections or requests; those under way finish for up to timeout_s (a second Ctrl-C: at once), and
    closing the engine stops the rest, whose clients then hear why: a load balancer's drain, not a cut. Returns how
    many requests it stopped."""
    stopped = 0  # the requests still under way when the wait ended: closing the engine stops them
    deadline = time.monotonic() + timeout_s  # the whole stop, the answers to stopped requests included
    try:
        server.server_close()
        if server.under_way:
            message(escape(f"stopping: {server.under_way} request(s) under way may finish for up to {timeout_s:g} s "
                           f"(Ctrl-C again: stop them now)"))
        stopped = server.drain(timeout_s)
    except KeyboardInterrupt:  # a second Ctrl-C or SIGTERM: stop them now
        stopped = server.under_way
    finally:
        _close(engine)
    # Counted before the close, not after it: the close wakes their threads, which answer them (told to retry: a 503,
    # a stream's error event) and leave under_way at once, so a count taken after it missed those already answered.
    if stopped:
        message(escape(f"stopped {stopped} request(s) before they finished; their clients are told to send them "
                       f"again"))
    try:  # time for those answers to go out, within the timeout (at least a moment: they are a write each)
        cut = server.drain(min(5.0, max(0.5, deadline - time.monotonic()))) if stopped else 0
    except KeyboardInterrupt:
        cut = server.under_way
    if cut:  # a body still arriving, a client that does not read: the process's exit ends their connections
        message(escape(f"{cut} connection(s) still busy are closed without an answer"))
    return stopped


def _close(engine) -> None:
    """engine.close() through more Ctrl-Cs: it waits for the graph run under way (onnxruntime cannot stop one), and
    leaving it would let that run go on while the interpreter exits."""
    closer = threading.Thread(target=engine.close, name="aotlm-close")
    try:
        closer.start()
    except RuntimeError:  # no thread can start (the process is at its thread limit): closed here, uninterruptibly
        engine.close()
        return
    while closer.is_alive():
        try:
            closer.join()
        except KeyboardInterrupt:
            console.print("finishing the step under way", highlight=False)


def _log_line(line: str) -> None:
    # one write per line: print() writes the text and its newline apart, and connections' threads interleaved them
    # (lines glued together, blank lines between). A log whose reader is gone (`2>&1 | tee`, and Ctrl-C ended tee
    # first) loses the line, as Python's logging does: its BrokenPipeError had cut the request it was about
    try:
        # the date and the zone's offset: a log that runs past midnight or a clock change is read in order, beside
        # the manifests' and benchmarks' UTC times (vLLM's lines carry the date too)
        sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S%z')} {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
