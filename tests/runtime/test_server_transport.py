"""runtime/server.py as an HTTP/1.1 server: one response per request however its body is framed (nothing a client
sent as a body is read as another request), chunked bodies read, refusals that leave the body unread still reach
the client, and http.server's own refusals in OpenAI's error body with a status line."""
from __future__ import annotations

import http.client
import json
import re
import socket

import pytest

from runtime import Engine
from runtime.server import ApiServer
from tests.runtime.test_server import serve, stop

SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def served(tiny_artifact):
    server, _ = serve(Engine.load(tiny_artifact), slots=2)
    yield server
    stop(server)


def exchange(server: ApiServer, data: bytes) -> bytes:
    """Everything the server answers to `data` on one connection, until it closes it (or 10 s of silence)."""
    client = socket.create_connection(server.server_address[:2], timeout=10)
    client.sendall(data)
    answer = b""
    try:
        while chunk := client.recv(1 << 16):
            answer += chunk
    except TimeoutError:
        pass
    client.close()
    return answer


def status_lines(answer: bytes) -> list[str]:
    """The responses' status lines (a response's body ends where the next one's status line begins)."""
    return [line.decode() for line in re.findall(rb"HTTP/1\.1 \d{3} [^\r\n]*(?=\r\n)", answer)]


def test_a_gets_body_is_read_and_dropped_not_answered_as_the_next_request(served):
    answer = exchange(served, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(SMUGGLED)
                      + SMUGGLED + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_lines(answer) == ["HTTP/1.1 200 OK"] * 2
    assert answer.count(b'{"status": "ok"}') == 2 and b'"object": "list"' not in answer


@pytest.mark.parametrize("framing, message", [
    (b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", b"not both"),
    (b"Content-Length: 0\r\nContent-Length: 5\r\n", b"2 different values"),
])
def test_a_body_framed_two_ways_is_a_400_and_nothing_after_it_is_served(served, framing, message):
    answer = exchange(served, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n0\r\n\r\n" + SMUGGLED)
    assert status_lines(answer) == ["HTTP/1.1 400 Bad Request"]
    assert message in answer and b"Connection: close" in answer and b'"object": "list"' not in answer


def test_a_chunked_body_is_served_as_its_content_length_would_be(served):
    connection = http.client.HTTPConnection(*served.server_address[:2], timeout=60)
    body = json.dumps({"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}).encode()
    connection.request("POST", "/v1/completions", body=iter([body[:7], body[7:]]), encode_chunked=True,
                       headers={"Transfer-Encoding": "chunked"})
    response = connection.getresponse()
    chunked = json.loads(response.read())
    connection.request("POST", "/v1/completions", body=body)  # the same connection serves the next request
    response = connection.getresponse()
    assert response.status == 200
    assert chunked["choices"][0]["text"] == json.loads(response.read())["choices"][0]["text"]
    assert chunked["usage"]["completion_tokens"] == 3
    connection.close()


def test_a_refusal_before_the_body_reaches_a_client_that_sends_it_whole(tiny_artifact):
    """A 401 leaves the body unread: the server reads and drops it before closing, so that http.client, which writes
    its whole body before it reads, gets the answer and not a reset (a broken pipe, before the fix)."""
    server = ApiServer(Engine.load(tiny_artifact), port=0, api_key="s3cret")
    server.start()
    try:
        connection = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
        connection.request("POST", "/v1/completions", body=b" " * (4 << 20), headers={"Authorization": "Bearer no"})
        response = connection.getresponse()
        assert (response.status, json.loads(response.read())["error"]["type"]) == (401, "authentication_error")
        connection.close()
        # Expect: 100-continue: the 401 comes at once, not "100 Continue" and then a refusal of the upload
        answer = exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n"
                                  b"Expect: 100-continue\r\n\r\n")
        assert status_lines(answer) == ["HTTP/1.1 401 Unauthorized"] and b"authentication_error" in answer
    finally:
        stop(server)


@pytest.mark.parametrize("request_line, status", [
    (b"HELLO", "400 Bad Request"),
    (b"GET /health HTTP/2.0", "505 HTTP Version Not Supported"),
    (b"TRACE /health HTTP/1.1", "501 Not Implemented"),
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1", "414 Request-URI Too Long"),
])
def test_http_servers_own_refusals_come_in_openais_error_body_with_a_status_line(served, request_line, status):
    answer = exchange(served, request_line + b"\r\nHost: x\r\n\r\n")
    assert status_lines(answer) == [f"HTTP/1.1 {status}"]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Content-Type: application/json" in head and b"Connection: close" in head
    assert json.loads(body)["error"]["code"] == int(status.split()[0])
    code = status.split()[0]
    metrics = exchange(served, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").decode()
    assert re.search(f'aotlm:http_requests_total{{[^}}]*status="{code}"}} 1', metrics)


def dechunk(data: bytes) -> tuple[bytes, bytes]:
    """A chunked body's content, and what followed its last chunk on the connection (RFC 9112 7.1)."""
    content = b""
    while True:
        size_line, data = data.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            assert data.startswith(b"\r\n"), data[:40]  # no trailers: the empty line ends the body
            return content, data[2:]
        content, data = content + data[:size], data[size:]
        assert data.startswith(b"\r\n"), data[:40]
        data = data[2:]


def test_a_stream_ends_its_body_in_chunks_and_the_connection_serves_the_next_request(served):
    """A stream had no length to give and closed its connection: every streamed request paid a new TCP connection
    (and a client's pool saw it dropped). Its body now goes out chunked, as uvicorn's streams do."""
    body = json.dumps({"prompt": "Once", "max_tokens": 5, "stream": True, "ignore_eos": True, "temperature": 0}).encode()
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    answer = exchange(served, request + SMUGGLED + b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, rest = answer.split(b"\r\n\r\n", 1)
    assert b"Transfer-Encoding: chunked" in head and b"Connection: close" not in head, head
    stream, after = dechunk(rest)
    events = [line for line in stream.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    pieces = [json.loads(event.removeprefix("data: "))["choices"][0]["text"] for event in events[:-1]]
    assert "".join(pieces) == served.engine.generate("Once", max_new_tokens=5, ignore_eos=True).text
    assert status_lines(after) == ["HTTP/1.1 200 OK", "HTTP/1.1 200 OK"]  # both, on the same connection


def test_streams_and_responses_share_one_kept_alive_connection(served):
    connection = http.client.HTTPConnection(*served.server_address[:2], timeout=30)
    sockets = []
    for stream in (True, False, True):
        body = {"prompt": "Once", "max_tokens": 3, "stream": stream}
        connection.request("POST", "/v1/completions", body=json.dumps(body).encode())
        response = connection.getresponse()
        payload = response.read()
        assert response.status == 200 and not response.will_close
        assert payload.endswith(b"data: [DONE]\n\n") if stream else json.loads(payload)["choices"]
        sockets.append(connection.sock)
    connection.close()
    assert sockets[0] is not None and sockets.count(sockets[0]) == 3  # never reconnected


def test_an_http_1_0_stream_reads_to_the_close(served):
    body = json.dumps({"prompt": "Once", "max_tokens": 3, "stream": True}).encode()
    answer = exchange(served, b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    head, rest = answer.split(b"\r\n\r\n", 1)
    assert b"Connection: close" in head and b"Transfer-Encoding" not in head, head
    assert rest.startswith(b"data: ") and rest.endswith(b"data: [DONE]\n\n")  # unframed: the close ends it


def test_a_body_shorter_than_its_content_length_is_refused_not_run(served):
    """A client that closed mid-body had what arrived run as the request: a 200 where its start parsed as JSON."""
    body = json.dumps({"prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    submitted = served.engine.scheduler.token_counts()["prompt_tokens"]
    client = socket.create_connection(served.server_address[:2], timeout=10)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body) + 100, body))
    client.shutdown(socket.SHUT_WR)
    answer = b""
    while chunk := client.recv(1 << 16):
        answer += chunk
    client.close()
    assert answer.startswith(b"HTTP/1.1 400") and b"the body ended after %d of its %d bytes" % (
        len(body), len(body) + 100) in answer, answer
    assert served.engine.scheduler.token_counts()["prompt_tokens"] == submitted  # nothing ran


def test_an_idle_kept_alive_connection_closes_after_the_keep_alive_time(served, monkeypatch):
    """Streams keep their connections now: an idle pool's connections held --max-connections for 60 s each (uvicorn
    closes them after 5 s; --keep-alive-timeout sets it). A request begun in time is served as before."""
    import time

    monkeypatch.setattr(served, "keep_alive_s", 0.5)
    client = socket.create_connection(served.server_address[:2], timeout=10)

    def health() -> bytes:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"}"):  # the headers, then the JSON body
            answer += client.recv(4096)
        return answer

    assert health().startswith(b"HTTP/1.1 200")
    assert health().startswith(b"HTTP/1.1 200")  # at once: served on the same connection
    started = time.monotonic()
    assert client.recv(4096) == b""  # then idle: closed by the server
    assert time.monotonic() - started < 5
    client.close()


def test_an_http10_client_that_asks_for_keep_alive_is_told_it(served):
    """http.server kept such a connection open without saying so: the client waited for a close that came only at
    the keep-alive timeout, 5 s a request under `ab -k`."""
    client = socket.create_connection(served.server_address[:2], timeout=10)
    for _ in range(2):  # the second on the same connection, at once
        client.sendall(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\nX-Request-Id: gw-7f3a\r\n\r\n")
        answer = b""
        while not answer.endswith(b"}"):
            answer += client.recv(4096)
        head = answer.split(b"\r\n\r\n")[0].decode()
        assert "\r\nConnection: keep-alive" in head and "\r\nX-Request-Id: gw-7f3a" in head, head
    client.close()


def test_streams_ask_proxies_not_to_buffer_and_cors_answers_only_allowed_origins(served, monkeypatch):
    """nginx's default proxy buffering held a stream's events back in 4 KiB bursts (first token +0.6-0.9 s); a browser
    page's preflight got no Access-Control headers, so no browser app could call the server at all."""
    def request(method, path, headers, body=None):
        connection = http.client.HTTPConnection(*served.server_address[:2], timeout=30)
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        connection.close()
        return response

    stream = request("POST", "/v1/completions", {"Content-Type": "application/json"},
                     json.dumps({"prompt": "x", "max_tokens": 2, "stream": True}))
    assert stream.getheader("X-Accel-Buffering") == "no" and stream.getheader("X-Request-Id").startswith("req-")
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    refused = request("OPTIONS", "/v1/chat/completions", preflight)
    assert refused.status == 204 and refused.getheader("Access-Control-Allow-Origin") is None  # none by default
    monkeypatch.setattr(served, "allowed_origins", ("https://app.example",))
    allowed = request("OPTIONS", "/v1/chat/completions", preflight)
    assert allowed.getheader("Access-Control-Allow-Origin") == "https://app.example"
    assert allowed.getheader("Access-Control-Allow-Methods") == "POST, OPTIONS"
    assert allowed.getheader("Access-Control-Allow-Headers") == "authorization,content-type"
    models = request("GET", "/v1/models", {"Origin": "https://app.example"})
    assert models.getheader("Access-Control-Allow-Origin") == "https://app.example"
    assert models.getheader("Vary") == "Origin"
    other = request("GET", "/v1/models", {"Origin": "https://evil.example"})
    assert other.getheader("Access-Control-Allow-Origin") is None


def test_a_garbled_request_on_a_kept_alive_connection_gets_its_own_id_not_the_previous_ones(served, monkeypatch):
    """The handler kept the previous request's headers: a 400 for a garbled line carried its X-Request-Id and CORS
    headers, and its log line blamed that request. Expect: 100-continue's early answers carry the client's id."""
    monkeypatch.setattr(served, "allowed_origins", ("https://app.example",))
    client = socket.create_connection(served.server_address[:2], timeout=10)
    client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: G3\r\nOrigin: https://app.example\r\n\r\n")
    answer = b""
    while not answer.endswith(b"}"):
        answer += client.recv(4096)
    assert b"X-Request-Id: G3\r\n" in answer and b"Access-Control-Allow-Origin" in answer
    client.sendall(b"GARBAGE\r\n\r\n")
    garbled = b""
    while chunk := client.recv(4096):
        garbled += chunk
    client.close()
    assert garbled.startswith(b"HTTP/1.1 400") and b"G3" not in garbled and b"Access-Control" not in garbled
    assert re.search(rb"X-Request-Id: req-[0-9a-f]{32}\r\n", garbled), garbled
    monkeypatch.setattr(served, "api_key", "right")  # refused at Expect: 100-continue, before its body
    client = socket.create_connection(served.server_address[:2], timeout=10)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\nX-Request-Id: G1\r\n"
                   b"Expect: 100-continue\r\nContent-Length: 4000\r\n\r\n")
    refused = b""
    while b"\r\n\r\n" not in refused:
        refused += client.recv(4096)
    client.close()
    assert refused.startswith(b"HTTP/1.1 401") and b"X-Request-Id: G1\r\n" in refused, refused


def test_request_ids_are_bounded_exposed_to_pages_and_end_every_error_line(tiny_artifact, monkeypatch):
    """An id over 128 characters is not echoed (a new one is made); a page may read X-Request-Id and Retry-After;
    an error's log line ends with the gateway's id; a cut stream's log counts the choices it really cancelled; the
    keep-alive time is a positive number."""
    import types

    from runtime.server import _Handler
    from tests.runtime.test_server import serve, stop

    server, lines = serve(Engine.load(tiny_artifact), slots=2)
    server.allowed_origins = ("https://app.example",)
    try:
        connection = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
        connection.request("POST", "/v1/completions", body=json.dumps({"prompt": 1}),
                           headers={"X-Request-Id": "gw-1", "Origin": "https://app.example"})
        refused = connection.getresponse()
        refused.read()
        connection.request("GET", "/health", headers={"X-Request-Id": "x" * 129})
        long_id = connection.getresponse()
        long_id.read()
        connection.close()
    finally:
        stop(server)
    assert refused.status == 400 and refused.getheader("X-Request-Id") == "gw-1"
    assert refused.getheader("Access-Control-Expose-Headers") == "X-Request-Id, Retry-After"
    assert any(line.startswith("POST /v1/completions 400: ") and line.endswith("; gw-1") for line in lines), lines
    assert re.fullmatch(r"req-[0-9a-f]{32}", long_id.getheader("X-Request-Id"))
    logged = []
    handles = [types.SimpleNamespace(done=lambda: True, cancel=lambda: None),
               types.SimpleNamespace(done=lambda: False, cancel=lambda: None)]
    handler = types.SimpleNamespace(server=types.SimpleNamespace(log=logged.append), command="POST",
                                    path="/v1/completions", request_id="r-1", _count_when_done=lambda handle: None)
    _Handler._cancel(handler, handles, "client went away")
    assert logged == ["POST /v1/completions: client went away; 1 of its 2 request(s) cancelled; r-1"]
    with Engine.load(tiny_artifact) as engine, pytest.raises(ValueError, match="keep_alive_s"):
        ApiServer(engine, port=0, keep_alive_s=0)


def test_a_preflight_needs_its_method_header_and_the_lowest_seed_is_taken(served, monkeypatch):
    monkeypatch.setattr(served, "allowed_origins", ("*",))
    connection = http.client.HTTPConnection(*served.server_address[:2], timeout=30)
    connection.request("OPTIONS", "/v1/completions", headers={"Origin": "https://a.example"})  # not a preflight
    plain = connection.getresponse()
    plain.read()
    connection.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 1, "seed": -2 ** 63,
                                                                   "temperature": 1.0}))
    seeded = connection.getresponse()
    seeded.read()
    connection.close()
    assert plain.getheader("Access-Control-Allow-Methods") is None and plain.getheader("Access-Control-Allow-Origin")
    assert seeded.status == 200


def test_echoed_headers_are_checked_and_a_long_keep_alive_outlasts_the_header_deadline(served, monkeypatch):
    """An Origin or a preflight's header list with NUL or a folded line was echoed as it came (a proxy may split
    the response's header); an id with "; " faked fields in its log line; and a kept-alive connection was cut at the
    60 s header deadline whatever --keep-alive-timeout said (the 502 race it exists to prevent)."""
    import time

    import runtime.server

    monkeypatch.setattr(served, "allowed_origins", ("*",))

    def raw(request: bytes) -> bytes:
        client = socket.create_connection(served.server_address[:2], timeout=10)
        client.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += client.recv(4096)
        client.close()
        return answer.split(b"\r\n\r\n")[0]

    head = raw(b"GET /health HTTP/1.1\r\nHost: x\r\nOrigin: https://a\x00b\r\nX-Request-Id: r-1; POST fake\r\n\r\n")
    assert b"Access-Control-Allow-Origin" not in head and b"fake" not in head and b"X-Request-Id: req-" in head
    head = raw(b"OPTIONS /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://a.example\r\nAccess-Control-Request-"
               b"Method: POST\r\nAccess-Control-Request-Headers: content-type\r\n Set-Cookie: a=b\r\n\r\n")
    assert b"Set-Cookie" not in head and b"Access-Control-Allow-Headers: authorization, content-type" in head
    monkeypatch.setattr(runtime.server, "HEADER_DEADLINE_S", 0.3)
    monkeypatch.setattr(served, "keep_alive_s", 3.0)
    client = socket.create_connection(served.server_address[:2], timeout=10)
    for pause in (0.0, 1.0):  # the second request begins after the header deadline, inside the keep-alive time
        time.sleep(pause)
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"}"):
            chunk = client.recv(4096)
            assert chunk, "closed before the keep-alive time"
            answer += chunk
    client.close()


def test_a_web_pages_request_from_an_origin_not_allowed_is_refused_before_it_runs(served, monkeypatch):
    """A browser sends a simple POST (text/plain) without a preflight: the server ran it, and only the answer was
    hidden from the page, so any page could make a server without a key run its prompts."""
    body = json.dumps({"prompt": "x", "max_tokens": 2})
    before = served.engine.scheduler.token_counts()["generation_tokens"] if served.engine.scheduler else 0

    def post(origin):
        connection = http.client.HTTPConnection(*served.server_address[:2], timeout=30)
        headers = {"Content-Type": "text/plain"} | ({"Origin": origin} if origin else {})
        connection.request("POST", "/v1/completions", body=body, headers=headers)
        response = connection.getresponse()
        answer = json.loads(response.read())
        connection.close()
        return response.status, answer

    status, answer = post("https://evil.example")
    assert status == 403 and "--allowed-origins" in answer["error"]["message"]
    scheduler = served.engine.scheduler
    assert (scheduler.token_counts()["generation_tokens"] if scheduler else 0) == before  # nothing ran
    assert post(None)[0] == 200  # an API client: no Origin
    monkeypatch.setattr(served, "allowed_origins", ("https://app.example",))
    assert post("https://app.example")[0] == 200 and post("https://evil.example")[0] == 403
