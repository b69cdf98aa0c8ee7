"""A request's body, read as HTTP/1.1 frames it (RFC 9112 section 6): by its Content-Length, or in chunks
(Transfer-Encoding: chunked, as clients that stream a body send it: requests with a generator, Go's io.Reader,
fetch with a stream). Whatever cannot frame a body unambiguously is refused and the connection must close: bytes the
server did not read as this request's body would otherwise be read as the next request (request smuggling, behind a
proxy that reuses connections). So: Transfer-Encoding beside Content-Length, Content-Length values that differ,
a coding other than a final "chunked" (501 for one it does not implement), a malformed chunk.
"""
from __future__ import annotations

from runtime.openai_api import ApiError

MAX_LINE_BYTES = 4096  # a chunk's size line or a trailer line


class BodyError(ApiError):
    """The body cannot be read (or not all of it): answer `status`, then close the connection. `unread`: bytes of it
    that may still be arriving (to read and drop after the answer; see server.LINGER_S)."""

    def __init__(self, message: str, status: int = 400, unread: int = 0):  # defaults: unpickled from its message
        super().__init__(message, status)
        self.unread = unread


def unread_bytes(headers, limit: int) -> int:
    """Bytes of the body a request announces, for a refusal that does not read it (at most `limit`; a chunked one's
    length is unknown: `limit`)."""
    if headers.get("Transfer-Encoding"):
        return limit
    length = headers.get("Content-Length", "").strip()
    return min(int(length), limit) if length.isascii() and length.isdigit() and len(length) <= 12 else 0


def read_body(headers, rfile, max_bytes: int, linger_bytes: int) -> bytes:
    """The body of the request whose headers these are, from rfile; BodyError when it cannot be read."""
    codings = headers.get_all("Transfer-Encoding") or []
    lengths = {value.strip() for value in headers.get_all("Content-Length") or []}
    if codings:
        if lengths:
            raise BodyError("send either Content-Length or Transfer-Encoding, not both", 400, linger_bytes)
        names = [name.strip().lower() for value in codings for name in value.split(",")]
        if names != ["chunked"]:
            if names[-1:] == ["chunked"]:  # gzip, chunked: framed, but a coding this server does not undo
                raise BodyError(f"Transfer-Encoding: {', '.join(names)}: only chunked is read (send the body "
                                f"uncompressed)", 501, linger_bytes)
            raise BodyError(f"Transfer-Encoding: {', '.join(names)[:80]} does not end in chunked: the body's end "
                            f"cannot be found", 400, linger_bytes)
        return _read_chunks(rfile, max_bytes, linger_bytes)
    if not lengths:
        return b""
    if len(lengths) > 1:
        raise BodyError(f"Content-Length given {len(lengths)} different values: send one", 400, linger_bytes)
    (length,) = lengths
    if not (length.isascii() and length.isdigit() and len(length) <= 12):
        raise BodyError(f"Content-Length: {length[:20]!r} is not a number of bytes", 400, 0)
    if int(length) > max_bytes:  # not read: the connection cannot serve another request
        raise BodyError(f"the request body has {int(length)} bytes, at most {max_bytes} are read", 413,
                        min(int(length), linger_bytes))
    body = rfile.read(int(length))
    if len(body) < int(length):  # the client closed before its whole body: what came is not the request (uvicorn's
        # h11 refuses it too), even where its first part parses as JSON
        raise BodyError(f"the body ended after {len(body)} of its {int(length)} bytes (Content-Length)", 400, 0)
    return body


def _read_chunks(rfile, max_bytes: int, linger_bytes: int) -> bytes:
    """A chunked body: chunks of `size-in-hex[;extensions] CRLF data CRLF`, a last chunk of size 0, trailer lines
    (dropped), an empty line."""
    body = bytearray()
    while True:
        size = _chunk_size(_line(rfile, "a chunk's size line", linger_bytes), linger_bytes)
        if size == 0:
            break
        if len(body) + size > max_bytes:
            raise BodyError(f"the request body has more than {max_bytes} bytes, at most {max_bytes} are read", 413,
                            linger_bytes)
        data = rfile.read(size)
        if len(data) < size:
            raise BodyError(f"the body ended inside a chunk ({len(data)} of its {size} bytes)", 400, 0)
        body += data
        if _line(rfile, "the end of a chunk", linger_bytes):  # CRLF right after the data
            raise BodyError("a chunk is longer than its size line says", 400, linger_bytes)
    while _line(rfile, "a trailer line", linger_bytes):  # trailer fields: none is used
        pass
    return bytes(body)


def _line(rfile, what: str, linger_bytes: int) -> bytes:
    """One CRLF-terminated line without its end; BodyError for one too long or a body that ended first."""
    line = rfile.readline(MAX_LINE_BYTES + 1)
    if not line.endswith(b"\n"):
        if len(line) > MAX_LINE_BYTES:
            raise BodyError(f"{what} is longer than {MAX_LINE_BYTES} bytes", 400, linger_bytes)
        raise BodyError(f"the body ended before {what}", 400, 0)
    return line.rstrip(b"\r\n")


def _chunk_size(line: bytes, linger_bytes: int) -> int:
    digits = line.split(b";", 1)[0].strip()  # chunk extensions (;name=value) are ignored, as RFC 9112 allows
    if not digits or len(digits) > 12 or any(byte not in b"0123456789abcdefABCDEF" for byte in digits):
        raise BodyError(f"a chunk's size {line[:20]!r} is not a hexadecimal number", 400, linger_bytes)
    return int(digits, 16)
