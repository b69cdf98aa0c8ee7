"""compiler/cli_serve.py: `aotlm serve`'s refusals before it loads anything, and the options it hands the engine,
its scheduler and the HTTP server (serving itself, and the graceful stop, are tests/runtime/test_server.py's)."""
from __future__ import annotations

import math
import os
import re
import socket

import pytest

from compiler import cli_serve
from compiler.cli import main
from runtime import Engine


class GoneReader:
    """A stream whose reader left (`aotlm serve 2>&1 | tee log`, and Ctrl-C ended tee first)."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


class StoppedWhileStarting:
    """runtime.server.ApiServer that records what it was given, and Ctrl-C comes before it listens."""
    given: dict = {}

    def __init__(self, engine, host, port, **keywords):
        scheduler = engine.scheduler
        StoppedWhileStarting.given = dict(engine=engine, host=host, port=port, slots=scheduler.slots,
                                          max_queue=scheduler.max_queue, prefill_chunk=scheduler.prefill_chunk,
                                          huge_pages=engine.huge_pages, idle_exit_s=scheduler.idle_exit_s,
                                          **keywords)
        raise KeyboardInterrupt


def test_serve_hands_on_its_options_and_closes_the_engine_when_stopped_while_starting(capsys, monkeypatch,
                                                                                      tiny_artifact):
    monkeypatch.setattr("runtime.server.ApiServer", StoppedWhileStarting)
    monkeypatch.setenv("AOTLM_API_KEY", "from-the-environment")
    assert main(["serve", str(tiny_artifact), "--port", "0", "--slots", "2", "--max-queue", "7",
                 "--prefill-chunk", "16", "--prefix-caching", "--model-name", "m", "--quiet",
                 "--max-connections", "9", "--keep-alive-timeout", "75", "--allowed-origins", "https://a.example",
                 "--allowed-origins", "*", "--no-huge-pages"]) == 130
    given = StoppedWhileStarting.given
    assert given["bound_socket"].fileno() == -1 and given["huge_pages"] is None  # the port let go; 4 KiB pages
    assert {key: given[key] for key in ("host", "port", "slots", "max_queue", "prefill_chunk", "model_name",
                                        "api_key", "log_requests", "max_connections")} == {
        "host": "127.0.0.1", "port": 0, "slots": 2, "max_queue": 7, "prefill_chunk": 16, "model_name": "m",
        "api_key": "from-the-environment", "log_requests": False, "max_connections": 9}
    assert given["log"] is cli_serve._log_line  # --quiet keeps errors and refusals
    assert given["idle_exit_s"] == math.inf  # a server's worker never ends: no thread to start mid-run
    assert given["keep_alive_s"] == 75.0 and given["allowed_origins"] == ("https://a.example", "*")
    assert given["engine"].prefix_caching is True and given["engine"].scheduler is None  # closed
    assert main(["serve", str(tiny_artifact), "--host", "::1", "--port", "0", "--api-key", "given"]) == 130
    given = StoppedWhileStarting.given
    assert (given["host"], given["port"], given["slots"], given["max_queue"], given["prefill_chunk"]) == (
        "::1", 0, 8, 256, None)
    assert given["api_key"] == "given" and given["log"] is cli_serve._log_line and given["model_name"] is None
    assert given["log_requests"] is True
    from runtime.server import MAX_CONNECTIONS

    assert given["max_connections"] == MAX_CONNECTIONS == 1024  # as --help says
    assert given["engine"].prefix_caching is False
    assert given["keep_alive_s"] == 5.0 and given["allowed_origins"] == ()
    assert given["huge_pages"] is not None  # Engine.load's default: its report
    monkeypatch.setattr(cli_serve, "load_dependent_outputs", lambda *args: "outputs depend on the load")
    assert main(["serve", str(tiny_artifact), "--port", "0"]) == 130
    assert "warning: outputs depend on the load" in capsys.readouterr().err  # the int8 cache's caveat is said


def test_serve_no_spin_opens_sessions_that_never_spin(monkeypatch, tiny_artifact):
    import runtime.onnxruntime_backend as backend

    monkeypatch.setattr("runtime.server.ApiServer", StoppedWhileStarting)
    allowed = []
    real = backend.session_options
    monkeypatch.setattr(backend, "session_options", lambda *a, **k: allowed.append(k.get("spin_during_run", True))
                        or real(*a, **k))
    assert main(["serve", str(tiny_artifact), "--port", "0", "--no-spin", "--no-huge-pages"]) == 130
    assert main(["serve", str(tiny_artifact), "--port", "0", "--no-huge-pages"]) == 130
    assert allowed == [False, False, True, True]  # prefill and decode sessions, each load


@pytest.mark.parametrize("host, advice", [
    ("127.0.0.1", "another process holds it (a server listening, or one still loading): choose another --port"),
    ("no-such-host.invalid", "'no-such-host.invalid' is no address, nor a name this machine resolves"),
])
def test_serve_says_it_cannot_listen_before_it_loads_the_model(capsys, monkeypatch, tiny_artifact, host, advice):
    """A taken port (or an address not this machine's) was found after the whole load: 6-9 s and 2 GB for the
    default model, at every restart of a replica."""
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("loaded before binding"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(tiny_artifact), "--host", host, "--port", str(port)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"cannot listen on {host}:{port}: " in err and advice in err


def test_the_port_refuses_connections_until_the_server_listens(tiny_engine):
    """Bound before the load and listened on after it: a client that comes early is refused, not left hanging."""
    from runtime.server import ApiServer, bind_socket

    bound = bind_socket("127.0.0.1", 0)
    port = bound.getsockname()[1]
    with pytest.raises(OSError, match="Address already in use"):  # a second server loading meanwhile: refused now,
        bind_socket("127.0.0.1", port)  # not at its listen after its whole load
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    server = ApiServer(tiny_engine, "127.0.0.1", port, bound_socket=bound)
    try:
        assert server.url == f"http://127.0.0.1:{port}" and server.socket is bound
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        server.server_close()


@pytest.mark.parametrize("flag", ["--slots", "--max-queue", "--prefill-chunk"])
def test_serve_refuses_counts_below_one_before_loading(capsys, flag):
    """They were checked by the scheduler after the whole load, and named as its options (slots: 0 must be ...)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "artifact", flag, "0"])
    assert exit_info.value.code == 2 and f"argument {flag}: 0: give 1 or more" in capsys.readouterr().err


@pytest.mark.parametrize("argv, environment, message", [
    (["--model-name", "  "], None, "--model-name: give a non-empty name"),
    # bytes that are not UTF-8: /v1/models published the lone surrogate, which strict JSON parsers reject
    (["--model-name", "m\udce9"], None, "--model-name is not valid Unicode at character 1"),
    (["--api-key", ""], None, "--api-key / AOTLM_API_KEY: empty; give a key"),
    ([], " ", "--api-key / AOTLM_API_KEY: empty; give a key"),
    # headers arrive as ISO-8859-1, clients send UTF-8: no request could ever match it
    (["--api-key", "clé-ü"], None, "--api-key / AOTLM_API_KEY: use printable ASCII characters only"),
])
def test_serve_refuses_an_empty_name_or_key_before_loading(capsys, monkeypatch, tmp_path, argv, environment,
                                                           message):
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("loaded"))
    if environment is None:
        monkeypatch.delenv("AOTLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("AOTLM_API_KEY", environment)
    assert main(["serve", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_serve_takes_ports_0_to_65535_and_finite_shutdown_timeouts_from_0(capsys):
    assert [cli_serve.port_number(text) for text in ("0", "65535")] == [0, 65535]
    assert [cli_serve.seconds(text) for text in ("0", "2.5")] == [0.0, 2.5]
    for flag, value, said in (("--port", "65536", "65536 is not a TCP port; give 1 to 65535, or 0 for any free one"),
                              ("--port", "-1", "-1 is negative; give 0 or more"),
                              ("--shutdown-timeout", "-1", "-1 must be a finite number of seconds, 0 or more"),
                              ("--shutdown-timeout", "inf", "inf must be a finite number of seconds, 0 or more"),
                              ("--shutdown-timeout", "nan", "nan must be a finite number of seconds, 0 or more"),
                              # argparse had printed the type function's name: "invalid port_number value: 'x'"
                              ("--port", "x", "'x' is not a whole number"),
                              ("--slots", "x", "'x' is not a whole number"),
                              ("--keep-alive-timeout", "x", "'x' is not a number"),
                              ("--threads", "x", "'x' is not a whole number")):
        with pytest.raises(SystemExit) as exit_info:  # argparse's one-line usage error
            main(["serve", "artifact", flag, value])
        assert exit_info.value.code == 2 and f"argument {flag}: {said}" in capsys.readouterr().err


class StoppedAtOnce:
    """runtime.server.ApiServer that listens and is stopped (Ctrl-C) before any request."""

    def __init__(self, engine, host, port, **keywords):
        self.model_name, self.url, self.under_way = "m", f"http://{host}:{port}", 0

    def serve_forever(self):
        raise KeyboardInterrupt

    def server_close(self):
        pass

    def drain(self, timeout_s):
        return 0


def test_serve_lists_the_chat_route_only_for_a_model_with_a_chat_template(capsys, monkeypatch, tiny_artifact,
                                                                          chat_artifact):
    """A model without a template had /v1/chat/completions listed, and every chat request then refused."""
    monkeypatch.setattr("runtime.server.ApiServer", StoppedAtOnce)
    for artifact, routes in ((chat_artifact[0], "POST /v1/completions, /v1/chat/completions;"),
                             (tiny_artifact, "POST /v1/completions (no chat template: /v1/chat/completions refuses);")):
        assert main(["serve", str(artifact), "--port", "0"]) == 130
        err = " ".join(capsys.readouterr().err.split())
        assert routes in err, err


class AnsweredOnClose:
    """runtime.server.ApiServer with two requests under way past the shutdown timeout, whose threads answer (a 503
    saying to retry) as soon as closing the engine fails them, before the stop looks again."""

    def __init__(self):
        self.under_way = 2

    def server_close(self):
        pass

    def drain(self, timeout_s):
        return self.under_way


def test_the_stop_counts_every_request_it_stopped_even_those_answered_at_once(capsys):
    """The count was read after closing the engine: a request whose thread had answered meanwhile went uncounted
    (a request and a stream stopped together were logged as "stopped 1 request(s)")."""
    server = AnsweredOnClose()

    class Closing:
        def close(self):
            server.under_way = 0  # the close fails their requests; their threads answer and leave

    cli_serve._stop_gracefully(server, Closing(), 0.1)
    err = capsys.readouterr().err
    assert "stopping: 2 request(s) under way" in err
    assert "stopped 2 request(s) before they finished" in err and "without an answer" not in err


def test_each_log_line_is_one_write(monkeypatch):
    """print() wrote a line's text and its newline apart: lines of connections' threads came out glued together,
    with blank lines between."""
    import io
    import threading

    writes = []

    class Recording(io.StringIO):
        def write(self, text):
            writes.append(text)
            return len(text)

    monkeypatch.setattr(cli_serve.sys, "stderr", Recording())
    threads = [threading.Thread(target=lambda: [cli_serve._log_line(f"line {i}") for i in range(200)])
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(writes) == 800 and all(text.endswith("\n") and text.count("\n") == 1 for text in writes)
    # dated, with the zone's offset: a log past midnight or a clock change is read in order
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[+-]\d{4} line 199\n", writes[-1]), writes[-1]


def test_serve_warns_where_an_int8_caches_outputs_would_depend_on_the_load():
    """An int8 cache whose prefill attends in float: chunks and cached prefixes read earlier keys as int8 codes, so
    a seeded request's text changed with the load (a review: 10 of 12 seeds on SmolLM2). Said at start, with the fix."""
    from compiler.cli_serve import load_dependent_outputs

    def manifest(dtype, prefill_attention=None):
        passes = [{"fuse_attention": {}}]
        if prefill_attention is not None:
            passes.append({"quantize_kv_cache": {"prefill_attention": prefill_attention}})
        return {"kv_cache": {"dtype": dtype}, "recipe": {"passes": passes}}

    text = load_dependent_outputs(manifest("int8", "float"), 64, False)
    assert "with --prefill-chunk a prompt read partly from the cache" in text
    assert "prefill_attention: int8" in text
    assert "--prefill-chunk and --prefix-caching" in load_dependent_outputs(manifest("int8", "float"), 64, True)
    assert load_dependent_outputs(manifest("int8", "float"), None, True) is not None
    assert load_dependent_outputs(manifest("int8", "float"), None, False) is None  # whole prompts: no cache read
    assert load_dependent_outputs(manifest("int8", "int8"), 64, True) is None  # the prefill reads int8 as well
    assert load_dependent_outputs(manifest("float32"), 64, True) is None


def test_the_whole_stop_keeps_within_its_timeout(monkeypatch):
    """The wait for the stopped requests' answers came on top of --shutdown-timeout: 25 + 5 s, past Kubernetes' 30 s
    grace with one client that never read (SIGKILL, its summary lost)."""
    waits = []

    class Stuck:
        under_way = 1

        def server_close(self):
            pass

        def drain(self, timeout_s):
            waits.append(timeout_s)
            now[0] += timeout_s
            return 1

    now = [100.0]
    monkeypatch.setattr(cli_serve.time, "monotonic", lambda: now[0])
    cli_serve._stop_gracefully(Stuck(), type("Closing", (), {"close": lambda self: None})(), 25.0)
    assert waits[0] == 25.0 and waits[1] == 0.5 and now[0] - 100.0 <= 25.5


def test_a_log_whose_reader_is_gone_loses_lines_not_requests(monkeypatch, tiny_artifact):
    """`aotlm serve 2>&1 | tee log`, and Ctrl-C ended tee first: every log line raised BrokenPipeError in the request's
    thread, caught as "client went away" — each reply was dropped, the drain cut every request."""
    import http.client
    import json

    from runtime import Engine
    from runtime.server import ApiServer

    monkeypatch.setattr(cli_serve.sys, "stderr", GoneReader())
    monkeypatch.setattr(cli_serve.console, "quiet", False)  # a notice meanwhile sets it: given back after the test
    cli_serve._log_line("a line nobody reads")  # no exception
    engine = Engine.load(tiny_artifact)
    engine.start_scheduler(slots=1)

    def broken_log(line):
        raise BrokenPipeError(32, "Broken pipe")

    server = ApiServer(engine, port=0, log=broken_log)
    server.start()
    try:
        for stream in (False, True):
            connection = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
            connection.request("POST", "/v1/completions", body=json.dumps(
                {"prompt": "x", "max_tokens": 3, "ignore_eos": True, "stream": stream}))
            response = connection.getresponse()
            body = response.read().decode()
            connection.close()
            assert response.status == 200 and (body.rstrip().endswith("data: [DONE]") if stream else
                                               json.loads(body)["usage"]["completion_tokens"] == 3), body
    finally:
        server.shutdown()
        server.server_close()
        engine.close()


def test_a_stop_notice_on_a_closed_stderr_still_exits_with_the_signals_status(monkeypatch):
    """SIGTERM with stderr's reader gone: the "terminated" notice raised BrokenPipeError, and the exit status was 1."""
    from compiler import cli

    # _file, not file: the property's value is sys.stderr of the moment, which restoring would pin for good
    monkeypatch.setattr(cli.console, "_file", GoneReader())
    monkeypatch.setattr(cli.console, "quiet", False)  # the broken pipe sets it: given back after the test
    assert cli._stopped_by(cli._Terminated()) == 143


def test_serve_refuses_an_origin_with_a_path_and_a_keep_alive_of_zero(capsys):
    from compiler.cli import main

    for flags, said in ((["--allowed-origins", "https://app.example/"], "is not a web origin"),
                        (["--keep-alive-timeout", "0"], "--keep-alive-timeout")):
        with pytest.raises(SystemExit):
            main(["serve", "/nonexistent", *flags])
        assert said in capsys.readouterr().err


def test_an_allowed_origin_is_written_as_a_browser_sends_it():
    from compiler.cli_serve import web_origin

    assert web_origin("https://App.Example.com:443") == "https://app.example.com"
    assert web_origin("HTTPS://App.Example.com") == "https://app.example.com"
    assert web_origin("http://localhost:80") == "http://localhost" and web_origin("http://localhost:5173") == \
        "http://localhost:5173"


def test_a_stop_at_the_thread_limit_closes_the_engine_here(monkeypatch):
    """SIGTERM while the process was at its thread limit: the closing thread could not start, and the stop ended in
    a traceback with the engine never closed (requests under way never told to retry)."""
    import threading

    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda thread: (_ for _ in ()).throw(
        RuntimeError("can't start new thread")) if thread.name == "aotlm-close" else real_start(thread))
    closed = []

    class Closable:
        def close(self):
            closed.append(threading.current_thread() is threading.main_thread())
    cli_serve._close(Closable())
    assert closed == [True]


@pytest.mark.parametrize("host", ["", " ", "127.0.0.1 ", " ::1"])
def test_an_empty_or_space_padded_host_is_refused(host, capsys):
    """`--host "$UNSET"` listened on every interface: an API without a key, open to the network."""
    with pytest.raises(SystemExit) as stop:
        main(["serve", "artifact", "--host", host])
    assert stop.value.code == 2 and "give an address or a name without spaces" in capsys.readouterr().err


def test_a_bracketed_ipv6_host_is_taken_and_refusals_advise_what_fits():
    import errno

    assert cli_serve.listen_address("[::1]") == "::1" and cli_serve.listen_address("::1") == "::1"
    said = {code: str(cli_serve.cannot_listen("::", 80, OSError(code, os.strerror(code))))
            for code in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL)}
    assert said[errno.EADDRINUSE].startswith("cannot listen on [::]:80: Address already in use; another process holds")
    assert "ports below 1024 need root" in said[errno.EACCES] and "--port" not in said[errno.EADDRNOTAVAIL]
    unknown = str(cli_serve.cannot_listen("nowhere.invalid", 8000, socket.gaierror(-2, "Name or service not known")))
    assert "'nowhere.invalid' is no address, nor a name this machine resolves" in unknown and "--port" not in unknown


def test_serve_fits_its_connections_to_the_open_file_limit(capsys, monkeypatch, tiny_artifact):
    """Under systemd's LimitNOFILE=1024 accept failed with EMFILE below --max-connections' 1024."""
    from runtime import descriptors

    monkeypatch.setattr("runtime.server.ApiServer", StoppedWhileStarting)
    monkeypatch.setattr(descriptors, "raised_descriptor_limit", lambda: 64)
    monkeypatch.setattr(descriptors, "open_descriptors", lambda: 7)
    assert main(["serve", str(tiny_artifact), "--port", "0", "--no-huge-pages"]) == 130
    fit = 64 - 7 - descriptors.SPARE_DESCRIPTORS
    assert StoppedWhileStarting.given["max_connections"] == fit
    assert f"at most {fit} connections are served at once, not 1024" in capsys.readouterr().err
