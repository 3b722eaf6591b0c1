"""HttpClient against real servers on 127.0.0.x and ::1: keep-alive, framing, limits, failures."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from tests.support.polling import until
from tests.unit.metrics.metrics_builders import vllm_fixture

from endpoint_picker.metrics.http import HttpClient, ScrapeError

TIMEOUT = 5.0  # generous: only the timeout test is about timing
Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


def response(body: bytes, *headers: str, status: str = "200 OK", length: bool = True) -> bytes:
    """Raw HTTP/1.1 response bytes, with a Content-Length unless ``length`` is false."""
    lines = [f"HTTP/1.1 {status}", *headers]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class RawServer:
    """A TCP server whose connections are served by ``serve(reader, writer, index)``."""

    def __init__(self, host: str, serve: Serve) -> None:
        self.host = host
        self.port = 0
        self.connections = 0
        self._serve = serve
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> RawServer:
        self._server = await asyncio.start_server(self._on_connection, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        index, self.connections = self.connections, self.connections + 1
        try:
            await self._serve(reader, writer, index)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)
            self._writers.discard(writer)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for writer in list(self._writers):  # handlers waiting to read see EOF and end
            writer.transport.abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request head (a GET has no body)."""
    return await reader.readuntil(b"\r\n\r\n")


@pytest.fixture
async def raw_servers() -> AsyncIterator[Callable[[str, Serve], Awaitable[RawServer]]]:
    started: list[RawServer] = []

    async def make(host: str, serve: Serve) -> RawServer:
        server = await RawServer(host, serve).start()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop()


@pytest.fixture
def client_for() -> Any:
    made: list[HttpClient] = []

    def make(host: str, port: int, **kw: Any) -> HttpClient:
        kw.setdefault("timeout", TIMEOUT)
        client = HttpClient(host, port, **kw)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


async def test_keep_alive_one_connection_for_many_gets(servers: Any, client_for: Any) -> None:
    """Twenty GETs travel on one TCP connection (one client port as the server sees it)."""
    server = await servers("127.0.0.41", vllm_fixture())
    client = client_for(server.host, server.port)
    for _ in range(20):
        assert await client.get() == vllm_fixture()
    assert server.hits == 20
    assert len(set(server.peers)) == 1
    assert client.connections == 1
    assert client.connected


async def test_interleaved_large_pages_keep_apart(raw_servers: Any, client_for: Any) -> None:
    """Every connection reads into one shared buffer: pages arriving piece by piece on four
    connections at once, each larger than that buffer, still come out whole and each its own."""
    bodies = [bytes([65 + i]) * 300_000 + b"%d" % i for i in range(4)]

    def dribbling(body: bytes) -> Serve:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
            while True:
                await read_request(reader)
                data = response(body)
                for at in range(0, len(data), 8192):  # small writes, yielding between them
                    writer.write(data[at : at + 8192])
                    await writer.drain()
                    await asyncio.sleep(0)

        return serve

    started = [
        await raw_servers(f"127.0.0.{50 + i}", dribbling(body)) for i, body in enumerate(bodies)
    ]
    clients = [client_for(server.host, server.port) for server in started]
    for _ in range(3):
        assert await asyncio.gather(*(client.get() for client in clients)) == bodies


async def test_request_asks_for_plain_kept_alive_text(servers: Any, client_for: Any) -> None:
    """The request names the host, asks for keep-alive and no compression."""
    server = await servers("127.0.0.42", b"x")
    await client_for(server.host, server.port).get()
    assert server.headers["Host"] == f"127.0.0.42:{server.port}"
    assert server.headers["Accept-Encoding"] == "identity"
    assert server.headers["Connection"] == "keep-alive"


async def test_connection_close_header_reconnects(servers: Any, client_for: Any) -> None:
    """A server answering ``Connection: close`` is asked on a new connection each time."""
    server = await servers("127.0.0.43", b"page")
    server.close = True
    client = client_for(server.host, server.port)
    for _ in range(5):
        assert await client.get() == b"page"
    assert client.connections == 5
    assert not client.connected


async def test_server_closing_after_each_response(raw_servers: Any, client_for: Any) -> None:
    """A server that silently closes after each response is reconnected to, no scrape lost."""

    async def one_answer(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
    ) -> None:
        await read_request(reader)
        writer.write(response(b"page"))
        await writer.drain()

    server = await raw_servers("127.0.0.44", one_answer)
    client = client_for(server.host, server.port)
    for _ in range(5):
        assert await client.get() == b"page"
    assert server.connections == 5


async def test_keep_alive_race_is_retried_once(raw_servers: Any, client_for: Any) -> None:
    """A kept-alive connection closed before answering is retried once on a new one."""

    async def one_answer_then_close(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        await read_request(reader)
        writer.write(response(f"page {index}".encode()))  # looks kept alive
        await read_request(reader)  # the next request: dropped unanswered

    server = await raw_servers("127.0.0.45", one_answer_then_close)
    client = client_for(server.host, server.port)
    assert [await client.get() for _ in range(3)] == [b"page 0", b"page 1", b"page 2"]
    assert client.connections == 3


async def test_new_connection_closed_before_response_fails(
    raw_servers: Any, client_for: Any
) -> None:
    """A fresh connection closed without an answer is an error, not an endless retry."""

    async def hang_up(reader: asyncio.StreamReader, _: asyncio.StreamWriter, __: int) -> None:
        await read_request(reader)

    server = await raw_servers("127.0.0.46", hang_up)
    client = client_for(server.host, server.port)
    with pytest.raises(ScrapeError, match="closed before the response"):
        await client.get()
    assert server.connections == 1


@pytest.mark.parametrize("chunk_size", [1, 1000, 1 << 20])
async def test_chunked_body(servers: Any, client_for: Any, chunk_size: int) -> None:
    """Chunked pages are reassembled whole, on a connection that stays kept alive."""
    server = await servers("127.0.0.47", vllm_fixture()[: 5000 if chunk_size == 1 else None])
    server.chunked, server.chunk_size = True, chunk_size
    client = client_for(server.host, server.port)
    for _ in range(2):
        assert await client.get() == server.body
    assert client.connections == 1


async def test_body_until_eof(raw_servers: Any, client_for: Any) -> None:
    """A body with neither length nor chunks runs to the end of the connection."""

    async def until_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(response(b"", "Connection: close", length=False))
        for part in (b"vllm:", b"num_requests_waiting 1\n"):
            writer.write(part)
            await writer.drain()

    server = await raw_servers("127.0.0.48", until_eof)
    client = client_for(server.host, server.port)
    assert await client.get() == b"vllm:num_requests_waiting 1\n"
    assert await client.get() == b"vllm:num_requests_waiting 1\n"
    assert server.connections == 2


@pytest.mark.parametrize("framing", ["content-length", "chunked", "eof"])
async def test_oversize_body_is_refused(raw_servers: Any, client_for: Any, framing: str) -> None:
    """A body over the cap fails the GET however it is framed, and drops the connection."""
    body = b"x" * 3000

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        if framing == "content-length":
            writer.write(response(body))
        elif framing == "chunked":
            writer.write(response(b"", "Transfer-Encoding: chunked", length=False))
            for _ in range(3):
                writer.write(b"3e8\r\n" + body[:1000] + b"\r\n")
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(response(body, length=False))
        await writer.drain()
        if framing != "eof":  # the client must stop reading by itself, not at the server's EOF
            await reader.read()

    server = await raw_servers("127.0.0.49", big)
    client = client_for(server.host, server.port, max_body=2500)
    with pytest.raises(ScrapeError, match="too large"):
        await client.get()
    assert not client.connected
    exact = client_for(server.host, server.port, max_body=3000)
    assert await exact.get() == body


async def test_non_200_is_an_error(servers: Any, client_for: Any) -> None:
    """A non-200 status fails the GET; the next GET reads the page again."""
    server = await servers("127.0.0.50", b"page", status=503)
    client = client_for(server.host, server.port)
    with pytest.raises(ScrapeError, match="HTTP 503"):
        await client.get()
    server.status = 200
    assert await client.get() == b"page"


async def test_timeout_drops_the_connection(servers: Any, client_for: Any) -> None:
    """A slow answer times out; the next GET gets its own page, never the late one."""
    server = await servers("127.0.0.51", b"late page")
    server.delay = 3.0
    client = client_for(server.host, server.port, timeout=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await client.get()
    assert 0.15 <= loop.time() - started < 2.5
    assert not client.connected
    server.body, server.delay = b"fresh page", 0.0
    client._timeout = TIMEOUT  # only the first answer is meant to be late
    assert await client.get() == b"fresh page"
    assert client.connections == 2
    assert server.peers[0] != server.peers[1]


async def test_refused_connection(client_for: Any) -> None:
    """Nothing listening is an OSError, raised at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.52", 0))
    port = sock.getsockname()[1]
    sock.close()
    client = client_for("127.0.0.52", port)
    with pytest.raises(ConnectionRefusedError):
        await client.get()
    assert not client.connected


@pytest.mark.parametrize(
    "garbage",
    [b"SSH-2.0-OpenSSH_9.6\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"],
)
async def test_garbage_response(raw_servers: Any, client_for: Any, garbage: bytes) -> None:
    """A response that is not HTTP is an error and drops the connection."""

    async def babble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(garbage)
        await reader.read()

    server = await raw_servers("127.0.0.53", babble)
    client = client_for(server.host, server.port)
    with pytest.raises(ScrapeError, match="malformed"):
        await client.get()
    assert not client.connected


async def test_cut_short_response(raw_servers: Any, client_for: Any) -> None:
    """A connection closed mid-body is an error, not a short page."""

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(response(b"x" * 100)[:-50])
        await writer.drain()

    server = await raw_servers("127.0.0.54", cut)
    with pytest.raises(ScrapeError, match="mid-response"):
        await client_for(server.host, server.port).get()


async def test_stray_bytes_after_a_response_drop_the_connection(
    raw_servers: Any, client_for: Any
) -> None:
    """An unasked-for second response is discarded with its connection, never read later."""

    async def chatty(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        while True:
            await read_request(reader)
            extra = response(b"stray") if index == 0 else b""
            writer.write(response(f"page {index}".encode()) + extra)

    server = await raw_servers("127.0.0.55", chatty)
    client = client_for(server.host, server.port)
    assert await client.get() == b"page 0"
    assert await client.get() == b"page 1"
    assert await client.get() == b"page 1"
    assert client.connections == 2


async def test_cancellation_closes_the_connection(raw_servers: Any, client_for: Any) -> None:
    """A cancelled GET leaves no open connection behind: the server sees the client hang up."""
    asked, hung_up = asyncio.Event(), asyncio.Event()

    async def silent(reader: asyncio.StreamReader, _: asyncio.StreamWriter, __: int) -> None:
        await read_request(reader)
        asked.set()
        if await reader.read() == b"":  # EOF: the client closed its end
            hung_up.set()

    server = await raw_servers("127.0.0.56", silent)
    client = client_for(server.host, server.port)
    task = asyncio.create_task(client.get())
    await asyncio.wait_for(asked.wait(), TIMEOUT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not client.connected
    await asyncio.wait_for(hung_up.wait(), TIMEOUT)


async def test_close_ends_a_kept_alive_connection(servers: Any, client_for: Any) -> None:
    """close() hangs up an idle kept-alive connection; the next GET opens a new one."""
    server = await servers("127.0.0.57", b"page")
    client = client_for(server.host, server.port)
    await client.get()
    assert server.open_connections == 1
    client.close()
    await until(lambda: server.open_connections == 0)
    assert await client.get() == b"page"
    assert client.connections == 2


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
async def test_ipv6(servers: Any, client_for: Any) -> None:
    """An IPv6 endpoint is reached, bracketed in the Host header, and kept alive."""
    server = await servers("::1", b"page")
    client = client_for("::1", server.port)
    assert client.url == f"http://[::1]:{server.port}/metrics"
    assert [await client.get() for _ in range(3)] == [b"page"] * 3
    assert server.headers["Host"] == f"[::1]:{server.port}"
    assert len(set(server.peers)) == 1


@pytest.mark.parametrize(
    ("address", "url"),
    [("10.0.0.7", "http://10.0.0.7:8000/metrics"), ("fd00::7", "http://[fd00::7]:8000/metrics")],
)
def test_url_brackets_ipv6(address: str, url: str) -> None:
    """IPv6 pod addresses are bracketed in the URL."""
    assert HttpClient(address, 8000, timeout=1.0).url == url
