"""A lean HTTP/1.1 GET client for ``/metrics``: one kept-alive connection per endpoint.

A general client (aiohttp) spends ~240 µs of user CPU per request, most of it in its own
bookkeeping; this one ~100 µs, most of that asyncio's (benchmarks/bench_metrics.py). It does only
what a scrape needs: the same pre-encoded GET on one persistent connection, read with httptools'
C parser (status, headers, ``Content-Length``, chunked bodies) fed from an ``asyncio.Protocol``.

- One request at a time per connection. The connection is reopened when the server closed it
  (``Connection: close``, an idle timeout, an error); a request on a kept-alive connection that
  the server closes before answering is sent once more on a new connection (a GET is safe to
  repeat, and that race is how keep-alive ends).
- ``timeout`` covers connect and response together. On a timeout, a cancellation or any error
  the connection is dropped, so a late response can never be read as the next one's.
- The body is capped at ``max_body`` while it arrives (not only by ``Content-Length``).
- ``Accept-Encoding: identity``: gunzipping tens of KB 20 times a second costs more CPU than it
  saves on a pod network.
- A numeric address (a pod IP, IPv4 or IPv6) connects without a resolver; a host name would go
  through the event loop's resolver (a thread), which scraping pod IPs never does.
- Reads land in one buffer per thread (``asyncio.BufferedProtocol``), reused by every connection:
  the transport fills it and the parser consumes it within one callback, so no two connections
  ever hold it at once. A plain ``Protocol`` gets a fresh 256 KiB ``bytes`` per read, which the
  allocator maps and unmaps each time (mmap, mremap, munmap and a page fault per 4 KiB touched):
  that was two thirds of a scrape's kernel CPU.

Errors: ``ScrapeError`` for a response that is no usable page (status, size, malformed, cut
short); refused or reset connections stay ``OSError``, timeouts ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Final

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser

from endpoint_picker.errors import EppError
from endpoint_picker.types import ascii_int, format_hostport

MAX_BODY: Final = 16 * 1024 * 1024  # a /metrics page bigger than this is not a model server's
READ_BUFFER_SIZE: Final = 256 * 1024  # a vLLM page (about 64 KB) in one read


class _ReadBuffer(threading.local):
    """The buffer every connection of a thread's event loop reads into."""

    def __init__(self) -> None:
        self.view = memoryview(bytearray(READ_BUFFER_SIZE))


_read_buffer = _ReadBuffer()


class ScrapeError(EppError):
    """One scrape got no usable page: a bad status, too large, malformed, or cut short."""


class HttpStatusError(ScrapeError):
    """The server answered with a status other than 200."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class _ClosedBeforeResponse(ScrapeError):
    """The server closed the connection before sending any byte of the response."""


class _Connection(asyncio.BufferedProtocol):
    """One TCP connection: sends a request, parses its response with httptools."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_body: int) -> None:
        self._loop = loop
        self._max_body = max_body
        self._parser = HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self.open = False
        self.responses = 0  # complete responses read on this connection
        self._waiter: asyncio.Future[bytes] | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._started = False  # a byte of the current response has arrived
        self._headers_done = False
        self._framed = False  # Content-Length or chunked: the end is known without EOF
        self._error: ScrapeError | None = None  # raised inside a parser callback

    # --- used by HttpClient ----------------------------------------------------------------------
    def request(self, data: bytes) -> asyncio.Future[bytes]:
        """Send ``data``; the future resolves to the response body."""
        assert self._transport is not None, "not connected"
        assert self._waiter is None, "one request at a time"
        waiter = self._waiter = self._loop.create_future()
        self._chunks = []
        self._size = 0
        self._started = self._headers_done = self._framed = False
        self._transport.write(data)
        return waiter

    def close(self) -> None:
        """Drop the connection now (unsent and unread bytes are discarded)."""
        self.open = False
        if self._transport is not None:
            self._transport.abort()

    # --- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self.open = True

    def get_buffer(self, sizehint: int) -> memoryview:
        return _read_buffer.view

    def buffer_updated(self, nbytes: int) -> None:
        if self._waiter is None:  # nothing was asked: the stream is out of step
            self._fail(ScrapeError("unsolicited data from the server"))
            return
        self._started = True
        try:  # the parser copies what it keeps (on_body's bytes) before the buffer is reused
            self._parser.feed_data(_read_buffer.view[:nbytes])
        except (HttpParserError, HttpParserUpgrade) as exc:
            self._fail(self._error or ScrapeError(f"malformed HTTP response: {exc}"))

    def eof_received(self) -> bool | None:
        if self._waiter is not None and self._headers_done and not self._framed:
            self.on_message_complete()  # a body without length or chunks ends at EOF
        return None  # close the transport; connection_lost fails a pending request

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._transport = None
        if self._started:
            error = ScrapeError("connection closed mid-response")
        else:
            error = _ClosedBeforeResponse("connection closed before the response")
        error.__cause__ = exc
        self._fail(error)

    # --- httptools callbacks (inside feed_data; raising stops the parser) -------------------------
    def on_message_begin(self) -> None:
        if self._waiter is None:  # bytes after the response: another response nobody asked for
            raise self._stop(ScrapeError("unsolicited data after the response"))

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length":
            self._framed = True
            length = ascii_int(value.decode("latin-1"), 2**63 - 1)
            if length is None:
                raise self._stop(ScrapeError("bad content-length"))
            if length > self._max_body:
                raise self._stop(ScrapeError(f"page too large ({length} bytes)"))
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True
        status = self._parser.get_status_code()
        if status != 200:
            raise self._stop(HttpStatusError(status))

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self._max_body:
            raise self._stop(ScrapeError(f"page too large (over {self._max_body} bytes)"))
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        waiter, self._waiter = self._waiter, None
        chunks, self._chunks = self._chunks, []
        self.responses += 1
        if not self._parser.should_keep_alive():  # Connection: close, HTTP/1.0, EOF-framed
            self.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(b"".join(chunks))  # one chunk: that very bytes object, no copy

    # --- helpers ---------------------------------------------------------------------------------
    def _stop(self, error: ScrapeError) -> ScrapeError:
        self._error = error
        return error

    def _fail(self, error: ScrapeError) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        self.close()


class HttpClient:
    """GETs of one URL over one kept-alive connection, reopened whenever it closes."""

    def __init__(
        self,
        address: str,
        port: int,
        path: str = "/metrics",
        *,
        timeout: float,
        max_body: int = MAX_BODY,
    ) -> None:
        self._address = address
        self._port = port
        self._timeout = timeout
        self._max_body = max_body
        self._hostport = format_hostport(address, port)
        self.url = ""
        self._request = b""
        self.set_path(path)
        self._connection: _Connection | None = None
        self.connections = 0  # opened so far

    def set_path(self, path: str) -> None:
        """GET ``path`` (with its query, already percent-encoded) from the next request on."""
        self.url = f"http://{self._hostport}{path}"
        self._request = (
            f"GET {path} HTTP/1.1\r\n"
            f"Host: {self._hostport}\r\n"
            "User-Agent: endpoint-picker\r\n"
            "Accept: text/plain\r\n"
            "Accept-Encoding: identity\r\n"
            "Connection: keep-alive\r\n"
            "\r\n"
        ).encode("ascii")

    @property
    def connected(self) -> bool:
        """Whether a connection is open (kept alive for the next request)."""
        return self._connection is not None and self._connection.open

    async def get(self) -> bytes:
        """The body of a 200 response, within ``timeout`` seconds (connect included)."""
        try:
            async with asyncio.timeout(self._timeout):
                connection = self._connection
                if connection is not None and connection.open:
                    try:
                        return await connection.request(self._request)
                    except _ClosedBeforeResponse:
                        pass  # the server ended keep-alive as we asked: ask a new connection
                connection = await self._connect()
                return await connection.request(self._request)
        except BaseException:  # timeout, cancellation, error: never reuse a connection in doubt
            self.close()
            raise

    def close(self) -> None:
        """Drop the connection, if any; the next ``get`` opens a new one."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    async def _connect(self) -> _Connection:
        self.close()
        loop = asyncio.get_running_loop()
        max_body = self._max_body
        _, connection = await loop.create_connection(
            lambda: _Connection(loop, max_body), self._address, self._port
        )
        self._connection = connection
        self.connections += 1
        return connection
