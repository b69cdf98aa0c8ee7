"""runtime/http_body.py: bodies framed by Content-Length or in chunks, and every framing that could be read two ways
refused (the connection then closes)."""
from __future__ import annotations

import http.client
import io

import pytest

from runtime.http_body import MAX_LINE_BYTES, BodyError, read_body, unread_bytes

LINGER = 1000


def headers(*lines: str) -> http.client.HTTPMessage:
    return http.client.parse_headers(io.BytesIO("".join(f"{line}\r\n" for line in lines).encode() + b"\r\n"))


def read(head: list[str], body: bytes, max_bytes: int = 100) -> tuple[bytes, bytes]:
    """(the body read, what is left in the stream: the next request's bytes)."""
    stream = io.BytesIO(body)
    return read_body(headers(*head), stream, max_bytes, LINGER), stream.read()


def refusal(head: list[str], body: bytes, max_bytes: int = 100) -> BodyError:
    with pytest.raises(BodyError) as caught:
        read(head, body, max_bytes)
    return caught.value


def test_a_body_is_read_by_its_length_and_the_next_request_is_left_alone():
    assert read(["Content-Length: 5"], b"hello" + b"GET /") == (b"hello", b"GET /")
    assert read([], b"GET /") == (b"", b"GET /")
    assert read(["Content-Length: 2", "Content-Length: 2"], b"ab") == (b"ab", b"")  # the same value twice: one


def test_a_chunked_body_is_joined_without_its_extensions_and_trailers():
    body = b"5;name=value\r\nhello\r\nA\r\n, world!!!\r\n0\r\nX-Checksum: 1\r\n\r\n" + b"GET /"
    assert read(["Transfer-Encoding: chunked"], body) == (b"hello, world!!!", b"GET /")
    assert read(["Transfer-Encoding: Chunked"], b"0\r\n\r\n") == (b"", b"")


@pytest.mark.parametrize("head, status, message", [
    (["Content-Length: 4", "Transfer-Encoding: chunked"], 400, "not both"),
    (["Content-Length: 0", "Content-Length: 37"], 400, "2 different values"),
    (["Transfer-Encoding: gzip, chunked"], 501, "only chunked is read"),
    (["Transfer-Encoding: chunked, gzip"], 400, "does not end in chunked"),
])
def test_framings_that_could_be_read_two_ways_are_refused_and_the_rest_dropped(head, status, message):
    error = refusal(head, b"0\r\n\r\nGET /v1/models HTTP/1.1\r\n\r\n")
    assert (error.status, error.unread) == (status, LINGER) and message in str(error)


@pytest.mark.parametrize("body, message, unread", [
    (b"zz\r\nhi\r\n0\r\n\r\n", "is not a hexadecimal number", LINGER),
    (b"-2\r\nhi\r\n0\r\n\r\n", "is not a hexadecimal number", LINGER),
    (b"2\r\nhello\r\n0\r\n\r\n", "longer than its size line says", LINGER),
    (b"5\r\nhi", "ended inside a chunk (2 of its 5 bytes)", 0),
    (b"2\r\nhi\r\n", "ended before a chunk's size line", 0),
    (b"1" * (MAX_LINE_BYTES + 1) + b"\r\n", "longer than 4096 bytes", LINGER),
])
def test_a_malformed_chunked_body_is_a_400_naming_what_is_wrong(body, message, unread):
    error = refusal(["Transfer-Encoding: chunked"], body)
    assert (error.status, error.unread) == (400, unread) and message in str(error)


def test_a_body_over_the_limit_is_a_413_however_it_is_framed():
    error = refusal(["Content-Length: 101"], b"x" * 101)
    assert (error.status, error.unread) == (413, 101) and "101 bytes, at most 100" in str(error)
    error = refusal(["Transfer-Encoding: chunked"], b"40\r\n" + b"x" * 64 + b"\r\n40\r\n" + b"x" * 64 + b"\r\n0\r\n\r\n")
    assert (error.status, error.unread) == (413, LINGER) and "more than 100 bytes" in str(error)
    assert read(["Transfer-Encoding: chunked"], b"64\r\n" + b"x" * 100 + b"\r\n0\r\n\r\n")[0] == b"x" * 100
    assert read(["Content-Length: 100"], b"x" * 100)[0] == b"x" * 100  # exactly the limit: read


def test_a_content_length_that_is_not_a_number_is_a_400():
    for value in ("abc", "-1", "1e3", "\u0661", "1" * 13):
        error = refusal([f"Content-Length: {value}"], b"")
        assert error.status == 400 and "is not a number of bytes" in str(error)


def test_unread_bytes_is_what_a_refusal_may_still_receive():
    assert unread_bytes(headers("Content-Length: 50"), LINGER) == 50
    assert unread_bytes(headers("Content-Length: 5000"), LINGER) == LINGER
    assert unread_bytes(headers("Transfer-Encoding: chunked"), LINGER) == LINGER
    assert unread_bytes(headers("Content-Length: x"), LINGER) == 0
    assert unread_bytes(headers(), LINGER) == 0
