"""An HTTP server speaking OpenAI's completions and chat-completions API (runtime/openai_api.py) over the engine's
scheduler, so that OpenAI's client libraries, curl, and serving benchmarks (vLLM's `vllm bench serve --backend
openai`) can use an artifact. `aotlm serve ARTIFACT` runs it.

    GET  /health                 200 while serving, 503 once a stop began (drain)
    GET  /v1/models              the one model served
    GET  /v1/models/{model}      that model (OpenAI's retrieve: the client's models.retrieve); another name: 404
    GET  /metrics                Prometheus' text format: latencies, tokens, requests, load (runtime/server_metrics.py)
    POST /v1/completions         prompt -> text
    POST /v1/chat/completions    messages -> the assistant's reply (the model's chat template)
    POST /tokenize, /detokenize; GET /tokenizer_info: vLLM's tokenizer routes (runtime/tokenizer_api.py)

Python's http.server, one thread per connection (ThreadingHTTPServer). A request's thread submits its choices to the
scheduler (thread-safe: its one worker runs every graph, batching the requests of all connections together) and
waits on their handles (echo with logprobs, how lm-evaluation-harness scores, too: the scheduler's prompt_logprobs).
A streamed response is server-sent events: a chunk per text piece and one at each choice's end, then `data: [DONE]`,
sent chunked: the connection stays open for the next request (an HTTP/1.0 client, or one that sent Connection:
close, reads to the close). A client that goes away cancels its requests: noticed within POLL_S while waiting,
or at the next write; the scheduler frees their slots at its next step.
Latencies count from the moment the request's headers were read: its body, template and tokenization are in TTFT.
With an api_key, the /v1 and tokenizer routes ask for it as OpenAI's clients send it (`Authorization: Bearer KEY`;
else 401); /health and /metrics stay open, as vLLM leaves them.
Bodies come with a Content-Length or in chunks (runtime/http_body.py; a framing that could be read two ways is refused
and the connection closed). Errors carry OpenAI's error body: 400 for a bad request, 404 for another model or an
unknown path, 503 with Retry-After when the scheduler's queue is full, no thread can start for it or the server is
stopping, 500 when a request fails while running.
A graceful stop (drain(), after serve_forever returned) refuses new requests and waits for those under way; closing
the engine then fails the rest, and they are told to send the request again.
"""
from __future__ import annotations

import contextlib
import hmac
import json
import queue
import re
import select
import socket
import threading
import time
import traceback
import uuid
from concurrent.futures import TimeoutError as ResultTimeout  # the built-in TimeoutError only from Python 3.11
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import unquote, urlsplit

from runtime import http_body, openai_api, tokenizer_api
from runtime.deadlines import Deadlines
from runtime.descriptors import OUT_OF_DESCRIPTORS
from runtime.errors import QueueFullError, RequestError, ThreadLimitError
from runtime.openai_api import ApiError, ParsedRequest
from runtime.request_handle import END
from runtime.results import GenerationResult
from runtime.server_metrics import ServerMetrics

MAX_BODY_BYTES = 16 << 20
POLL_S = 0.25  # how often a waiting request's thread looks whether its client is still there
# A body the server refuses unread (413, 401, a stop's 503, one that cannot be framed) is still arriving when the
# answer goes out; closing then resets the connection, and a client that writes its whole body before reading
# (http.client, httpx) sees the reset, not the answer. So the server stops sending, then reads and drops what arrives (a lingering close, as nginx's), for
# LINGER_S or LINGER_BYTES at most.
LINGER_S = 5.0
LINGER_BYTES = 64 << 20
SOCKET_TIMEOUT_S = 60.0  # a body that stops arriving, an idle keep-alive connection, a stream nobody reads
# The request line and headers must arrive within this of the connection's start or its previous response, however
# they trickle in: the socket timeout alone let a client send a byte every 59 s and hold a thread for ever.
HEADER_DEADLINE_S = 60.0
# A kept-alive connection waits this long for its next request's first line, then closes (uvicorn's
# timeout_keep_alive, which vLLM serves behind, is 5 s): since streams keep their connections, idle clients' pools
# held --max-connections for 60 s each
KEEP_ALIVE_S = 5.0
# A body must arrive within HEADER_DEADLINE_S plus its announced bytes at this rate (a chunked one's count as
# MAX_BODY_BYTES): a byte every 55 s held a thread for ever; a 16 MiB body may take 256 s more.
MIN_BODY_BYTES_PER_S = 64 << 10
# What a response echoes of a request's headers, checked: http.server lets NUL and folded lines through, which an
# echo would send on (a header split in two by a proxy); a request id as gateways make them, without "; " (the log's
# field separator) or spaces
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
ORIGIN = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+")
HEADER_NAMES = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*")
ACCEPT_RETRY_S = 0.1  # between accepts refused for want of descriptors
MAX_CONNECTIONS = 1024  # open at once; one more is answered 503 and closed (a thread each: 1000 idle ones left none)
DEADLINES = Deadlines()  # every connection's header and body deadline, on one thread
ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat
TOKENIZER_ROUTES = {"/tokenize": tokenizer_api.tokenize, "/detokenize": tokenizer_api.detokenize}  # vLLM's, POST
GET_ROUTES = ("/health", "/v1/models", "/models", "/metrics", "/tokenizer_info")
MODEL_ROUTE = "/v1/models/"  # GET /v1/models/{model}: the id percent-encoded by OpenAI's clients ("org%2Fname")
KEYED_ROUTES = (*TOKENIZER_ROUTES, "/tokenizer_info", "/models")  # beside /v1/*: with an API key, they ask for it


def json_bytes(body: dict) -> bytes:
    """A response body as UTF-8 JSON. A lone surrogate (one a client sent, quoted back in an error message) cannot be
    UTF-8: it goes out as its JSON escape (\\ud800), so that no text in a body can cut the response off."""
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")


def listen_host(host: str) -> str:
    """host as bind_socket looks it up: an IPv6 address may come in a URL's brackets ([::1]). ValueError for an empty
    or space-padded one (an empty one had meant every interface)."""
    if not isinstance(host, str) or not host or host != host.strip():
        raise ValueError(f"host {host!r}: give an address or a name without spaces (0.0.0.0 or :: for every "
                         f"interface, 127.0.0.1 for this machine only)")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and not listening yet (connections to it are refused), for ApiServer's
    bound_socket: `aotlm serve` takes its port before loading the model, so a taken one is said at once. host: an
    address or a name, looked up as a server's (an IPv4 address first where it has both, as "localhost"'s; a name
    with only IPv6 addresses, or a link-local address with its zone, fe80::1%eth0, binds too). "::" takes IPv4
    connections too wherever the system allows (IPV6_V6ONLY off, as `python -m http.server --bind ::`; some systems
    default to IPv6 only); in a URL's brackets too ([::1]). Raises ValueError for an empty or space-padded host (an
    empty one had meant every interface), OSError where it cannot bind (socket.gaierror: a name that does not
    resolve)."""
    host = listen_host(host)
    found = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    family, kind, protocol, _, address = min(found, key=lambda entry: entry[0] != socket.AF_INET)
    sock = socket.socket(family, kind, protocol)
    try:
        reuse = hasattr(socket, "SO_REUSEADDR")
        if reuse:  # as http.server's allow_reuse_address: a restart within TIME_WAIT binds
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and address[0] == "::" and hasattr(socket, "IPV6_V6ONLY"):
            with contextlib.suppress(OSError):  # a system without IPv4 on IPv6 sockets: "::" is IPv6 only there
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        if reuse:  # and off once bound: two sockets that both ask for it share a port until one listens (Linux),
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)  # so a second server loading meanwhile
            # would bind it too and fail at its listen, after its whole load (on again at listen: server_activate)
    except BaseException:
        sock.close()
        raise
    return sock


class ApiServer(ThreadingHTTPServer):
    """Serves `engine` (whose scheduler the caller may start with its own options; else submit starts a default one)
    at (host, port); port 0 picks a free one (see `url`). log: called with one line per finished request."""

    daemon_threads = True  # a connection still open does not keep the process alive at exit
    block_on_close = False
    request_queue_size = 1024  # the listen backlog (socketserver's 5 drops a benchmark's burst of connections)

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 8000, *, model_name: str | None = None,
                 log: Callable[[str], None] | None = None, api_key: str | None = None,
                 max_connections: int = MAX_CONNECTIONS, log_requests: bool = True,
                 keep_alive_s: float = KEEP_ALIVE_S, allowed_origins: tuple[str, ...] = (),
                 bound_socket: socket.socket | None = None):
        """log: where lines go (stderr for `aotlm serve`): errors, refusals and, with log_requests, one line per
        answered request (`--quiet` turns those off, as vLLM's --disable-log-requests, and keeps the errors).
        keep_alive_s: how long an idle kept-alive connection waits for its next request (a load balancer that pools
        connections longer must be given more, or it sends into a connection as it closes: a 502).
        allowed_origins: the web origins (scheme://host[:port], or "*") whose pages may call the API from a browser
        (CORS); none by default: a page anywhere could otherwise drive a server without a key on 127.0.0.1.
        bound_socket: a socket bind_socket(host, port) bound earlier, to listen on instead of binding host:port."""
        if isinstance(keep_alive_s, bool) or not isinstance(keep_alive_s, (int, float)) or not 0 < keep_alive_s < 1e6:
            raise ValueError(f"keep_alive_s: {keep_alive_s!r} must be a number of seconds > 0 and below 1,000,000")
        self.keep_alive_s = float(keep_alive_s)
        self.allowed_origins = tuple(allowed_origins)
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections: {max_connections!r} must be an integer >= 1")
        if api_key is not None and not (api_key and api_key.isascii() and api_key.isprintable()):
            raise ValueError("api_key: give printable ASCII characters (HTTP headers carry ISO-8859-1, where clients "
                             "send a key's UTF-8 bytes: no request would match it)")
        self.engine = engine
        self.max_connections = max_connections
        self._connections = 0  # open now, each served by a thread of its own
        self._connections_lock = threading.Lock()
        self.api_key = api_key
        self.model_name = model_name or engine.manifest["name"]
        self.log = _safe_log(log) if log else (lambda line: None)
        self.log_request = self.log if log_requests else (lambda line: None)
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine.max_context)
        self.closing = False  # drain() began: requests get 503, /health says so (load balancers look elsewhere)
        self._under_way = 0  # POSTs being answered
        self._under_way_changed = threading.Condition()
        # bound here, unless the caller bound it earlier: an address or a name (bind_socket), whatever its family
        self._bound_socket = bound_socket or bind_socket(host, port)
        self.address_family = self._bound_socket.family
        self._accept_refused = False  # the last accept failed for want of descriptors (get_request)
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        """The socket bound by bind_socket, with the names http.server would set (server_name: the address itself,
        without http.server's reverse lookup, which nothing reads and which held readiness for a silent resolver's
        10 s)."""
        self.socket.close()  # the one socketserver made before binding
        self.socket = self._bound_socket
        self.server_address = self.socket.getsockname()
        host, port = self.server_address[:2]
        self.server_name, self.server_port = host, port

    def server_activate(self) -> None:
        """listen(), with SO_REUSEADDR on again: the connections it accepts inherit it, and so do the TIME_WAIT
        sockets they leave on this port when the server closes first; without it a restart could not bind the port
        for a minute (tcp_fin_timeout)."""
        if hasattr(socket, "SO_REUSEADDR"):
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        super().server_activate()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]  # a zone (fe80::1%eth0) is "%25" in a URL (RFC 6874)
        return f"http://[{host.replace('%', '%25')}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> threading.Thread:
        """Serve on a thread of its own (tests, notebooks); stop with shutdown() then server_close()."""
        thread = threading.Thread(target=self.serve_forever, name="aotlm-server", daemon=True)
        thread.start()
        return thread

    def get_request(self):
        """accept(), but a process out of descriptors (EMFILE) waits a moment before it tries again and says so
        once: socketserver retried at once, for ever, with a core busy and no word of why no client was answered."""
        try:
            connection = super().get_request()
        except OSError as error:
            if error.errno in OUT_OF_DESCRIPTORS:
                if not self._accept_refused:
                    self.log(f"cannot accept connections: {error.strerror} ({self._connections} open); new ones "
                             f"wait until some close (raise ulimit -n, or lower --max-connections)")
                self._accept_refused = True
                time.sleep(ACCEPT_RETRY_S)
            raise
        if self._accept_refused:
            self._accept_refused = False
            self.log(f"accepting connections again ({self._connections} open)")
        return connection

    def process_request(self, request, client_address) -> None:
        """A thread for the connection, unless max_connections are open (or no thread can start): then a 503 it can
        retry, and the connection closes; the server goes on answering the others."""
        with self._connections_lock:
            room = self._connections < self.max_connections
            self._connections += room
            open_now = self._connections
        if room:
            try:
                return super().process_request(request, client_address)
            except RuntimeError as error:  # can't start new thread: the process is out of threads or memory
                self._connection_done()
                reason = f"no thread could start for it ({error}; {open_now - 1} open)"
        else:
            reason = f"{open_now} connections open, at most {self.max_connections} (--max-connections)"
        _refuse_connection(request, "the server has too many connections open" if not room else
                           "the server could not start a thread for this connection")
        self.metrics.refused_connection()
        self.log(f"a connection from {client_address[0]} refused: {reason}")
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connection_done()

    def _connection_done(self) -> None:
        with self._connections_lock:
            self._connections -= 1

    @property
    def open_connections(self) -> int:
        return self._connections

    @property
    def under_way(self) -> int:
        """Requests (POSTs) being answered now."""
        return self._under_way

    def drain(self, timeout_s: float) -> int:
        """A graceful stop's wait, once serve_forever() has returned (Ctrl-C) or shutdown(): from now on a request
        on a connection still open gets 503 and /health 503; wait up to timeout_s for the requests under way to be
        answered. Returns how many still are. Closing the engine then fails those: a non-streamed one gets 503, a
        stream an error event and [DONE]; drain() again (briefly) lets their answers go out."""
        deadline = time.monotonic() + timeout_s
        with self._under_way_changed:
            self.closing = True
            while self._under_way and (left := deadline - time.monotonic()) > 0:
                self._under_way_changed.wait(min(left, 60.0))  # a wait beyond threading.TIMEOUT_MAX overflows
            return self._under_way

    def _admit(self) -> bool:
        with self._under_way_changed:
            if self.closing:
                return False
            self._under_way += 1
            return True

    def _answered(self) -> None:
        with self._under_way_changed:
            self._under_way -= 1
            self._under_way_changed.notify_all()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive between requests, streams included (their bodies go out chunked)
    timeout = SOCKET_TIMEOUT_S
    # TCP_NODELAY: headers and body go out as two writes, and a stream's events one by one; Nagle's algorithm held
    # each after the first until the client's delayed ACK (every keep-alive request took 44 ms, /health too)
    disable_nagle_algorithm = True
    server: ApiServer
    _streaming = False  # the response under way is a stream: its headers are out
    _chunked = False  # the stream's body goes out in chunks (HTTP/1.1): its end leaves the connection open
    _stream_ended = False  # the stream's last part went out: a failure after it (logging) is not the client's
    _unread_body = 0  # bytes of a refused body that may still be arriving (read and dropped after the answer)
    _answered_one = False  # a request was read on this connection: the next waits at most keep_alive_s to begin
    request_id = "-"  # the request's X-Request-Id: the client's (a gateway's), else one made up per request
    headers = None  # the request's headers, once read (http.server sets them): None before, for every request
    _interim = False  # the response under way is a 1xx

    def version_string(self) -> str:  # the Server header: http.server's adds Python's version
        return "aotlm"

    def send_response_only(self, code, message=None) -> None:
        self._interim = code < 200  # 100 Continue: the response's own headers follow later
        super().send_response_only(code, message)

    def end_headers(self) -> None:
        """Every response's common headers: its X-Request-Id; CORS for an allowed origin; and, for an HTTP/1.0 client
        that asked to keep the connection, that it is kept (without it the client waited for a close that came only
        keep_alive_s later: 5 s per request under `ab -k`)."""
        if not self._interim:
            self.send_header("X-Request-Id", self.request_id)
        if not self._interim and self.headers is not None:  # its headers were read (not a 400 for its line)
            origin = self.headers.get("Origin")
            allowed = self.server.allowed_origins
            if origin and ("*" in allowed or origin in allowed) and ORIGIN.fullmatch(origin):  # echoed: checked
                self.send_header("Access-Control-Allow-Origin", origin)
                self.send_header("Access-Control-Expose-Headers", "X-Request-Id, Retry-After")
                self.send_header("Vary", "Origin")
            if self.request_version == "HTTP/1.0" and not self.close_connection:
                self.send_header("Connection", "keep-alive")
        super().end_headers()

    def log_message(self, format, *args) -> None:  # http.server's own access log: ours goes through server.log
        pass

    def handle_one_request(self) -> None:
        self._headers_late = self._headers_in = self._body_late = self._body_in = False
        # a kept-alive connection's previous request's id and headers are not this one's (a 400 for a garbled line
        # carried them, and its log line blamed that request)
        self.headers, self.request_id = None, f"req-{uuid.uuid4().hex}"
        # a kept-alive connection's last response may have been a stream
        self._streaming = self._chunked = self._stream_ended = False
        self._deadline_lock = threading.Lock()  # the cut and the headers' end: one of them first, never both
        # a kept-alive connection's next request may begin as late as keep_alive_s (above 60 s behind a balancer
        # that pools longer): the header deadline counts from then, or it cut such connections at 60 s
        self._header_deadline = DEADLINES.add(HEADER_DEADLINE_S + (self.server.keep_alive_s if self._answered_one
                                                                    else 0), self._cut_late_headers)
        if self._answered_one:  # idle between requests: the next one's first line within keep_alive_s, else closed
            self.connection.settimeout(self.server.keep_alive_s)  # (http.server closes it on the read's timeout)
        try:
            super().handle_one_request()
        finally:
            DEADLINES.cancel(self._header_deadline)
            self._answered_one = True

    def parse_request(self) -> bool:
        self.connection.settimeout(self.timeout)  # the request line is in: its headers and body get the usual time
        parsed = super().parse_request()  # reads the headers (and answers Expect: 100-continue)
        DEADLINES.cancel(self._header_deadline)  # they are in (or the reading failed): the deadline no longer applies
        if parsed:
            self._take_request_id()
        with self._deadline_lock:
            self._headers_in = True
            late = self._headers_late
        if late:  # the cut ended them early: what was read is not the request
            self.close_connection = True
            return False
        return parsed

    def _cut_late_headers(self) -> None:
        """The header deadline passed: end the connection, whose reading thread then sees it closed; unless the
        headers came in meanwhile (a cancel racing with the deadline may come too late)."""
        with self._deadline_lock:
            if self._headers_in:
                return
            self._headers_late = True
        self._shut(socket.SHUT_RDWR)

    def _shut(self, how: int) -> None:
        try:
            self.connection.shutdown(how)
        except OSError:  # closed already
            pass

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:  # reset between requests (a client that left without reading its last response): no one
            self.close_connection = True  # to answer, and not the server's error to print

    def finish(self) -> None:
        super().finish()  # the answer is out (flushed)
        if self._unread_body:
            self._linger(self._unread_body)

    def _linger(self, unread: int) -> None:
        """Stop sending, then read and drop up to `unread` bytes of the refused body (see LINGER_S)."""
        deadline = time.monotonic() + LINGER_S
        try:
            self.connection.shutdown(socket.SHUT_WR)
            while unread > 0 and (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(min(unread, 1 << 20))
                if not chunk:  # the client read the answer and closed
                    return
                unread -= len(chunk)
        except OSError:  # it reset, or the time ran out: the connection closes either way
            pass

    # -- routes ----------------------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if not self._authorized(path):
            return
        try:  # a GET's body (rare) is read and dropped: left unread, it would be read as the next request
            self._read_body()
        except ApiError as error:
            return self._send_error(error)
        if path == "/health":
            self._send_json(*((503, {"status": "shutting down"}) if self.server.closing else (200, {"status": "ok"})))
        elif path == "/metrics":
            text = self.server.metrics.render(self.server.model_name, self.server.engine.scheduler,
                                             self.server.under_way).encode()
            self._send(200, text, "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/tokenizer_info":
            try:
                info = tokenizer_api.tokenizer_info(self.server.engine)
            except Exception as error:  # noqa: BLE001 -- a broken chat template: said, not a dropped connection
                return self._send_error(ApiError(f"{type(error).__name__}: {error}", 500, "server_error"))
            self._send_json(200, info)
        elif path in ("/v1/models", "/models"):
            self._send_json(200, {"object": "list", "data": [self._model()]})
        elif path.startswith(MODEL_ROUTE):
            name, served = unquote(path[len(MODEL_ROUTE):]), self.server.model_name
            if name != served:
                return self._send_error(openai_api.unknown_model(name, served))
            self._send_json(200, self._model())
        elif path in ROUTES or path in TOKENIZER_ROUTES:
            self._send_error(ApiError(f"{path} takes POST", status=405))
        else:
            self._send_error(_not_found(path))

    def _model(self) -> dict:
        """The model served, as /v1/models lists it and /v1/models/{model} retrieves it."""
        return {"id": self.server.model_name, "object": "model", "created": self.server.created, "owned_by": "aotlm",
                "max_model_len": self.server.engine.max_context}

    def do_HEAD(self) -> None:
        """GET's status and headers without its body (uptime monitors ask /health this way); _send leaves it out."""
        self.do_GET()

    def do_OPTIONS(self) -> None:
        """The methods a route takes, in the Allow header; for a browser's CORS preflight from an allowed origin
        (--allowed-origins), also what it may send (none by default: the browser then refuses the page's request)."""
        path = urlsplit(self.path).path
        if self._drained(path):
            headers = {"Allow": _allowed(path)}
            origin, allowed = self.headers.get("Origin"), self.server.allowed_origins
            if origin and ("*" in allowed or origin in allowed) and self.headers.get("Access-Control-Request-Method"):
                asked = self.headers.get("Access-Control-Request-Headers", "")  # echoed only as a list of names
                headers |= {"Access-Control-Allow-Methods": _allowed(path),
                            "Access-Control-Allow-Headers": asked if HEADER_NAMES.fullmatch(asked) else
                            "authorization, content-type",
                            "Access-Control-Max-Age": "600"}
            self._send(204, b"", "text/plain", headers)

    def _refuse_method(self) -> None:
        """PUT, DELETE, PATCH: no route takes them. 405 with the methods it does take, in OpenAI's error body."""
        path = urlsplit(self.path).path
        if self._drained(path):
            self._send_error(ApiError(f"{path} does not take {self.command}; it takes {_allowed(path)}", 405))

    do_PUT = do_DELETE = do_PATCH = _refuse_method

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a request line or header it cannot parse, a URL over 64 KiB, too many headers,
        HTTP/2, a method no server knows: 501) in OpenAI's error body as every other, counted in /metrics, with a
        status line even where the request line did not parse (http.server answers those as HTTP/0.9: a bare HTML
        page that HTTP/1.1 clients cannot read). The connection closes: what follows cannot be trusted to start a
        request."""
        if getattr(self, "_headers_late", False):  # the deadline cut the request short: nothing to answer, no 400
            self.close_connection = True
            return
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            self.request_version = self.protocol_version
        self.command = getattr(self, "command", None) or ""
        self.path = getattr(self, "path", "")
        self._refuse_unread(0)
        self._send_error(ApiError(message or HTTPStatus(code).phrase, code))

    def _take_request_id(self) -> None:
        """A gateway's X-Request-Id, echoed (vLLM's --enable-request-id-headers, OpenAI's x-request-id), where it is
        letters, digits and ._:/+=- (REQUEST_ID), at most 128; else the one made up for this request stays."""
        given = self.headers.get("X-Request-Id", "") if self.headers is not None else ""
        if REQUEST_ID.fullmatch(given):  # (not "; " and spaces, which would read as more fields in its log line)
            self.request_id = given

    def handle_expect_100(self) -> bool:
        """Expect: 100-continue (curl's, for bodies over 1 MiB): a request refused before its body is read (a wrong
        API key, a stop under way) gets its answer now rather than "100 Continue" and an upload it then drops."""
        self._take_request_id()  # before parse_request's end: this answer carries and logs it
        path = urlsplit(self.path).path
        refusal = self._access_refusal(path) or (_shutting_down() if self.command == "POST" and self.server.closing
                                                 else None)
        if refusal is None:
            return super().handle_expect_100()
        self._refuse_unread(http_body.unread_bytes(self.headers, LINGER_BYTES))
        self._send_error(refusal)
        return False

    def _refuse_unread(self, unread: int) -> None:
        """The answer goes out with the body unread: the connection closes after it, first reading and dropping up to
        `unread` bytes still arriving (see LINGER_S)."""
        self.close_connection = True
        self._unread_body = max(self._unread_body, unread)

    def _drained(self, path: str) -> bool:
        """Read the body of a request no route reads (the connection can then serve the next one); False when it
        was answered already: an unknown path (404) or a body that cannot be read."""
        try:
            self._read_body()
            if _allowed(path) is None:
                raise _not_found(path)
        except ApiError as error:
            self._send_error(error)
            return False
        return True

    def do_POST(self) -> None:
        arrival = time.perf_counter()
        path = urlsplit(self.path).path
        handles: list = []
        if not self._authorized(path):
            return
        if not self.server._admit():
            self._refuse_unread(http_body.unread_bytes(self.headers, LINGER_BYTES))
            self._send_error(_shutting_down())
            return
        try:
            if path in TOKENIZER_ROUTES:
                return self._send_json(200, TOKENIZER_ROUTES[path](self.server.engine, self._read_json(),
                                                                   self.server.model_name))
            if path not in ROUTES:
                self._read_body()  # drained, so that the connection can serve the next request
                raise (ApiError(f"{path} takes GET", status=405) if _is_get_route(path) else _not_found(path))
            request = openai_api.parse(self.server.engine, self._read_json(), chat=ROUTES[path],
                                       model_name=self.server.model_name)
            request_id = openai_api.new_id(request.chat)
            events: queue.SimpleQueue | None = queue.SimpleQueue() if request.stream else None
            handles = self._submit(request, arrival, events)
            if request.stream:
                self._stream(request, request_id, handles, events)
            else:
                self._respond(request, request_id, handles)
        except ApiError as error:
            self._fail(error)
        except OSError:  # the client went away, or stopped reading for SOCKET_TIMEOUT_S: nobody to answer
            self.close_connection = True
            self._cancel(handles, "client went away" if handles else None)
        except Exception as error:  # noqa: BLE001 -- a bug or a broken artifact: said to the client, not a traceback
            # the log gets where it came from (the innermost frames, one line): the client, only the message
            frames = " | ".join(line.strip().replace("\n", " ") for line in
                                traceback.format_exception(error, limit=-4)[1:-1])
            self.server.log(f"{self.command} {self.path}: {type(error).__name__}: {str(error)[:300]} at {frames}; "
                            f"{self.request_id}")
            self._fail(ApiError(f"{type(error).__name__}: {error}", 500, "server_error"))
        finally:
            try:
                for handle in handles:  # whatever ended this request's response ends its requests too
                    if not handle.done():
                        handle.cancel()
            finally:
                self.server._answered()

    def _fail(self, error: ApiError) -> None:
        """Answer with the error: as a response, or as a stream's last event once the stream has begun."""
        if not self._streaming:
            return self._send_error(error)
        if self._stream_ended:  # its client has the whole stream: nothing more may go on this connection's
            self.server.log(f"{self.command} {self.path}: after the stream: {error}; {self.request_id}")
            self.close_connection = True
            return
        self.server.log(f"{self.command} {self.path}: the stream ended: {error}; {self.request_id}")
        try:
            self._write_stream(_event(error.body()) + b"data: [DONE]\n\n", last=True)
        except OSError:
            self.close_connection = True

    def _authorized(self, path: str) -> bool:
        """Whether the request may go on; else it was answered 401 or 403 (its body unread: the connection ends)."""
        refusal = self._access_refusal(path)
        if refusal is None:
            return True
        self._refuse_unread(http_body.unread_bytes(self.headers, LINGER_BYTES))
        self._send_error(refusal)
        return False

    def _access_refusal(self, path: str) -> ApiError | None:
        """The 403 for a web page's request from an origin --allowed-origins does not name (a browser sends a simple
        POST, text/plain, without a preflight: the server ran it, and only its answer was hidden from the page), or
        the 401 for a request to a keyed route without the server's API key; None when it may go on."""
        keyed = path.startswith("/v1/") or path in KEYED_ROUTES
        origin = self.headers.get("Origin")
        if keyed and origin is not None and not ("*" in self.server.allowed_origins or
                                                 origin in self.server.allowed_origins):
            return ApiError(f"a web page's request (Origin {origin[:200]!r}), and this server serves no page from "
                            f"there: start it with --allowed-origins ORIGIN to serve that page (API clients send no "
                            f"Origin header)", 403, "permission_error")
        key = self.server.api_key
        if key is None or not keyed:
            return None
        scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
        # RFC 9110 11.1: the scheme is case-insensitive ("bearer" too); the key is compared in constant time
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode()):
            return None
        return ApiError("a missing or wrong API key: send the header 'Authorization: Bearer <key>' with the server's "
                        "key", 401, "authentication_error")

    # -- requests ----------------------------------------------------------------------------------------------------
    def _submit(self, request: ParsedRequest, arrival: float, events: queue.SimpleQueue | None = None) -> list:
        """The request's choices, submitted; with `events` (a stream), their pieces go there tagged with their
        position, then END (the scheduler's thread puts them: no thread per choice carries them over)."""
        engine = self.server.engine
        # The running scheduler's own submit: once a stop closed it, it refuses, where engine.submit would start a
        # fresh default one (a KV cache allocated, a request run) under a server that is going away.
        scheduler = engine.scheduler
        if scheduler is None and self.server.closing:
            raise _shutting_down()
        if scheduler is not None and len(request.choices) > scheduler.slots + scheduler.max_queue:
            raise ApiError(f"{len(request.choices)} choices (prompts x n), but this server holds at most "
                           f"{scheduler.slots + scheduler.max_queue} requests at once ({scheduler.slots} slots, "
                           f"{scheduler.max_queue} waiting); ask for fewer", param="n")
        submit = engine.submit if scheduler is None else scheduler.submit  # None: the first starts a default one
        handles = []
        try:
            for choice in request.choices:
                sink = None if events is None else _Tagged(events, len(handles))
                handles.append(submit(choice.prompt_ids, choice.params, arrival=arrival, pieces=sink))
        except RequestError as error:  # all of the request's choices run, or none
            held = scheduler or engine.scheduler
            # what filled the queue, said before this request's own choices leave it (it read "0 waiting" after)
            room = held.fullness() if held is not None and isinstance(error, QueueFullError) else "its queue is full"
            for handle in handles:
                handle.cancel()
            if self.server.closing:  # the engine closed under a request admitted before the stop
                raise _shutting_down() from None
            if isinstance(error, QueueFullError):
                choices = (f"its {len(request.choices)} choices need {len(request.choices)} places; "
                           if len(request.choices) > 1 else "")
                raise ApiError(f"the server is full: {choices}{room}; retry later, or start it with a larger "
                               f"--max-queue (or --slots)", status=503, kind="service_unavailable") from None
            if isinstance(error, ThreadLimitError):
                raise ApiError(str(error), status=503, kind="service_unavailable") from None
            raise ApiError(str(error)) from None
        return handles

    def _respond(self, request: ParsedRequest, request_id: str, handles: list) -> None:
        results = []
        for handle in handles:
            while True:
                try:
                    results.append(handle.result(timeout=POLL_S))
                    break
                except ResultTimeout:
                    if self._client_gone():
                        self.server.metrics.answered(self._route(), 499)  # nginx's "client closed request"
                        return self._cancel(handles, "client went away")
                except Exception as error:  # the request failed in the scheduler (a graph run raised; a stop)
                    self._cancel(handles)
                    return self._send_error(self._failure(error))
        body = openai_api.response(self.server.engine, request, request_id, self.server.model_name, results)
        self._finished(request, request_id, results, handles)  # first: a client scraping /metrics next sees it
        self._send_json(200, body)

    def _stream(self, request: ParsedRequest, request_id: str, handles: list, events: queue.SimpleQueue) -> None:
        self.send_response(200)
        self.server.metrics.answered(self._route(), 200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        # nginx buffers a proxied response by default (4 KiB bursts, TTFT +0.6-0.9 s): this response asks it not to
        self.send_header("X-Accel-Buffering", "no")
        # No length to give: chunks mark the body's end, so the connection serves the next request, as uvicorn's
        # streams do; an HTTP/1.0 client (or one that asked to close) reads to the close instead
        self._chunked = self.request_version == "HTTP/1.1" and not self.close_connection
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self._streaming = True
        created, model = request.created, self.server.model_name
        results: list[GenerationResult | None] = [None] * len(handles)
        started: set[int] = set()  # choices whose first chunk (the role; echo: the prompt) went out
        logprobs = [openai_api.StreamLogprobs(self.server.engine, request, handle,
                                              request.prompt_texts[choice.index // request.n] if request.echo else "")
                    for choice, handle in zip(request.choices, handles)]
        pending: list[bytes] = []  # events not written yet: those ready together go out in one write
        while any(result is None for result in results):
            if pending and events.empty():  # nothing more ready: out with them before waiting for more
                self._write_stream(b"".join(pending))
                pending.clear()
            try:
                position, item = events.get(timeout=POLL_S)
            except queue.Empty:
                if self._client_gone():
                    self.close_connection = True  # the stream is cut short: what was sent does not end its body
                    return self._cancel(handles, "client went away")
                continue
            if item is END:  # the choice ended: its result (set right after END), or the error it failed with
                try:
                    item = handles[position].result()
                except BaseException as error:  # noqa: BLE001 -- the request failed: the stream says so
                    item = error
            if isinstance(item, BaseException):
                self._cancel(handles)
                error = self._failure(item)
                # logged as a response's 500 is
                self.server.log(f"{self.command} {self.path}: the stream ended: {error}; {self.request_id}")
                pending.append(_event(error.body()))
                break
            if isinstance(item, str) and (not item or request.echo_only):  # echo-only: the prompt, at the end
                continue
            choice, first = request.choices[position], position not in started
            started.add(position)
            text = request.prompt_texts[choice.index // request.n] if first and request.echo else ""
            if isinstance(item, GenerationResult):
                item = openai_api.as_requested(request, item)
                results[position] = item
                pending.append(_event(openai_api.chunk(
                    request, request_id, model, created, choice.index, text, item, first=first,
                    logprobs=logprobs[position].of_end(item),
                    stopped_by=openai_api.stop_reason(self.server.engine, choice.params, item))))
            else:
                pending.append(_event(openai_api.chunk(request, request_id, model, created, choice.index, text + item,
                                                       first=first, logprobs=logprobs[position].of_piece(item))))
        else:
            if request.include_usage:
                pending.append(_event(openai_api.usage_chunk(request, request_id, model, created, results)))
        if all(results):
            self._finished(request, request_id, results, handles)  # before the end: a client may scrape right after
        self._write_stream(b"".join(pending) + b"data: [DONE]\n\n", last=True)

    def _cancel(self, handles: list, reason: str | None = None) -> None:
        """Cancel the request's handles (a client that left, a choice that failed); each goes into /metrics as it
        ends: a cancelled one's tokens so far (its TTFT and gaps too: the slow requests users leave are those an
        SLO must see), a failed one as a failure."""
        running = sum(not handle.done() for handle in handles)
        for handle in handles:
            handle.cancel()
            self._count_when_done(handle)
        if reason and running:
            self.server.log(f"{self.command} {self.path}: {reason}; {running} of its {len(handles)} request(s) "
                            f"cancelled; {self.request_id}")
        elif reason:  # every choice had ended (its 200 line is logged): only the response's last bytes were lost
            self.server.log(f"{self.command} {self.path}: {reason} before the response's last bytes went out; "
                            f"{self.request_id}")

    def _failure(self, error: BaseException) -> ApiError:
        """What a request that failed in the scheduler tells its client: a stop's (retry elsewhere), else 500."""
        scheduler = self.server.engine.scheduler
        if self.server.closing and isinstance(error, RequestError) and (scheduler is None or scheduler.closed):
            return _shutting_down(under_way=True)  # the stop closed the scheduler under it: not its own failure
        return ApiError(f"the request failed: {error}", 500, "server_error")

    def _client_gone(self) -> bool:
        """The client closed its end: its socket reads as ended. poll() rather than a non-blocking recv(): a socket
        with a timeout waits that long inside recv() whatever its flags (60 s here, then a TimeoutError that would
        read as gone), and poll(), unlike select(), watches descriptors numbered 1024 or more. The peek consumes
        nothing the client sends meanwhile. A client that only shut down its sending side reads as gone too. Windows
        has no poll(): select() there, which has no limit on descriptor numbers."""
        if hasattr(select, "poll"):
            watcher = select.poll()
            watcher.register(self.connection, select.POLLIN)
            events = watcher.poll(0)
            if not events:  # nothing to read: still there
                return False
            if events[0][1] & (select.POLLERR | select.POLLNVAL):
                return True
        else:
            readable, _, failed = select.select([self.connection], [], [self.connection], 0)
            if failed:
                return True
            if not readable:
                return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    # -- bodies --------------------------------------------------------------------------------------------------
    def _read_body(self) -> bytes:
        """The body, by its Content-Length or in chunks (runtime/http_body.py), within its deadline (see
        MIN_BODY_BYTES_PER_S); ApiError when it cannot be read, and the connection then closes."""
        announced = http_body.unread_bytes(self.headers, MAX_BODY_BYTES)
        allowed = HEADER_DEADLINE_S + announced / MIN_BODY_BYTES_PER_S
        deadline = DEADLINES.add(allowed, self._cut_slow_body)
        try:
            body = http_body.read_body(self.headers, self.rfile, MAX_BODY_BYTES, LINGER_BYTES)
        except http_body.BodyError as error:
            self._refuse_late_body(allowed)  # a chunked body cut short reads as malformed: the cut is the cause
            self._refuse_unread(error.unread)
            raise
        finally:
            DEADLINES.cancel(deadline)
            with self._deadline_lock:  # a deadline firing from now on finds the body in (cancel may come late)
                self._body_in = True
        self._refuse_late_body(allowed)  # what was read before the cut is not the body
        return body

    def _refuse_late_body(self, allowed: float) -> None:
        with self._deadline_lock:
            late = self._body_late
        if late:
            self.close_connection = True
            raise ApiError(f"the request body did not arrive within {allowed:.0f} s (at least "
                           f"{MIN_BODY_BYTES_PER_S >> 10} KiB/s after {HEADER_DEADLINE_S:.0f} s)", 408)

    def _cut_slow_body(self) -> None:
        """The body's deadline passed: stop reading (the read under way ends), so that a 408 can still go out;
        unless the body came in meanwhile (its keep-alive connection then serves the next request)."""
        with self._deadline_lock:
            if self._body_in:
                return
            self._body_late = True
        self._shut(socket.SHUT_RD)

    def _read_json(self):
        raw = self._read_body()
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as error:  # bad UTF-8 or JSON, a 5000-digit number, nesting 10^5 deep
            raise ApiError(f"the request body is not JSON that can be read: {str(error)[:200]}") from None

    def _send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        self._send(status, json_bytes(body), "application/json", headers)

    def _send(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self.server.metrics.answered(self._route(), status)
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:  # the body was not read (too long, no length): the connection ends here
                self.send_header("Connection", "close")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":  # HEAD: GET's headers, Content-Length included, and no body
                self.wfile.write(data)
        except OSError:  # the client left, or stopped reading
            self.close_connection = True

    def _route(self) -> str:
        """The path as /metrics labels it: one of the server's, else "other" (any path would be a label value)."""
        path = urlsplit(self.path).path
        if path.startswith(MODEL_ROUTE):
            return MODEL_ROUTE + "{model}"  # one label, whatever name was asked for
        return path if path in (*ROUTES, *TOKENIZER_ROUTES, *GET_ROUTES) else "other"

    def _send_error(self, error: ApiError) -> None:
        headers = {"Retry-After": "1"} if error.status == 503 else None
        if error.status == 405:
            headers = {"Allow": _allowed(urlsplit(self.path).path)}
        self._send_json(error.status, error.body(), headers)
        self.server.log(f"{self.command} {self.path} {error.status}: {error}; {self.request_id}")

    def _write_stream(self, data: bytes, last: bool = False) -> None:
        """Part of a stream's body, in one write: a chunk of it when chunked, and after the last part the empty
        chunk that ends the body."""
        if self._stream_ended or not (data or last):  # nothing may follow the end; an empty chunk would be it
            return
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data) + (b"0\r\n\r\n" if last else b"")
        self._stream_ended = last
        self.wfile.write(data)

    @staticmethod
    def _first_count(handle) -> bool:
        """Whether this is the first time the handle goes into /metrics (a response and a cancel path may both try)."""
        counted = getattr(handle, "_counted", False)
        handle._counted = True
        return not counted

    def _count_when_done(self, handle) -> None:
        """Into /metrics once, when the scheduler ends it (at once if it has)."""
        if self._first_count(handle):
            handle.add_done_callback(self.server.metrics.ended)

    def _finished(self, request: ParsedRequest, request_id: str, results: list[GenerationResult],
                  handles: list) -> None:
        """Into /metrics, and a line in the log: the response's id (to match a user's report), tokens, how each
        choice ended, and the first choice's queue, TTFT, TPOT (- for one token) and end-to-end times."""
        for handle, result in zip(handles, results):
            if self._first_count(handle):
                self.server.metrics.finished(result)
        first = results[0].timings
        usage = openai_api.usage(request, results)
        ends = ", ".join(sorted({result.finish_reason for result in results}))
        line = (f"{self.command} {self.path} 200: {_count(usage['prompt_tokens'], 'prompt token')} "
                f"({usage['prompt_tokens_details']['cached_tokens']} cached), {usage['completion_tokens']} out "
                f"({ends})")
        if len(results) > 1:
            line += f" over {len(results)} choices"
        if first is not None:
            trace = first.trace
            tpot = "-" if trace.tpot is None else f"{1e3 * trace.tpot:.2f} ms"
            line += (f"; {'choice 0: ' if len(results) > 1 else ''}queue {1e3 * trace.queue:.1f} ms, TTFT "
                     f"{1e3 * first.ttft_s:.1f} ms, TPOT {tpot}, E2E {1e3 * first.e2e_s:.1f} ms")
        self.server.log_request(f"{line}; {request_id}; {self.request_id}")


def _event(body: dict) -> bytes:
    """A server-sent event carrying body."""
    return b"data: " + json_bytes(body) + b"\n\n"


class _Tagged:
    """A streamed choice's piece queue (RequestHandle's pieces): what the scheduler puts goes into the stream's one
    queue, tagged with the choice's position."""

    __slots__ = ("events", "position")

    def __init__(self, events: queue.SimpleQueue, position: int):
        self.events, self.position = events, position

    def put(self, item) -> None:
        self.events.put((self.position, item))


def _refuse_connection(connection, reason: str) -> None:
    """A 503 written straight to a connection no thread will serve (at most a moment's wait: it goes into the
    socket's empty send buffer)."""
    body = json_bytes({"error": {"message": f"{reason}; retry", "type": "server_error", "param": None, "code": 503}})
    try:
        connection.settimeout(1.0)
        connection.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                           b"X-Request-Id: req-" + uuid.uuid4().hex.encode() + b"\r\nConnection: close\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    except OSError:
        pass


MAX_LOG_LINE = 1000  # characters: a line quoting a client's path or field says its start
# C0 and C1 control characters as \xNN, a backslash doubled: http.server's own log escapes them so (its table is
# private, and not in every Python 3.11 release)
CONTROL_CHARACTERS = str.maketrans({code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7f, 0xa0))}
                                   | {ord("\\"): "\\\\"})


def _safe_log(log: Callable[[str], None]) -> Callable[[str], None]:
    """log, given lines without control characters (a request line's escape sequences rewrote the terminal's earlier
    lines and set its title; http.server's own log escapes them as these do) and cut to MAX_LOG_LINE."""
    def safe(line: str) -> None:
        line = line.translate(CONTROL_CHARACTERS)
        try:  # a log that fails (its pipe's reader gone) loses the line, never the request it was about
            log(line if len(line) <= MAX_LOG_LINE else f"{line[:MAX_LOG_LINE]}... ({len(line):,} characters)")
        except Exception:  # noqa: BLE001 -- the caller's logger, whatever it raises
            pass
    return safe


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _shutting_down(under_way: bool = False) -> ApiError:
    """A request refused, or (under_way) one accepted but stopped before it finished, as the server stops."""
    what = ("the server was stopped before this request finished" if under_way else
            "the server is shutting down and takes no more requests")
    return ApiError(f"{what}; send this one again, to another replica or once the server is back", status=503,
                    kind="service_unavailable")


def _allowed(path: str) -> str | None:
    """The methods a route takes, as an Allow header lists them; None for a path that is no route."""
    if path in ROUTES or path in TOKENIZER_ROUTES:
        return "POST, OPTIONS"
    return "GET, HEAD, OPTIONS" if _is_get_route(path) else None


def _is_get_route(path: str) -> bool:
    return path in GET_ROUTES or path.startswith(MODEL_ROUTE)


def _not_found(path: str) -> ApiError:
    return ApiError(f"no route {path}; this server has /v1/completions, /v1/chat/completions, /v1/models, "
                    f"/v1/models/{{model}}, /health, /metrics, /tokenize, /detokenize and /tokenizer_info", status=404,
                    kind="not_found_error")
