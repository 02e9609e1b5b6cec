"""A loopback HTTP proxy in front of the local S3 server that loses answers, for fault tests.

    proxy = CuttingProxy(upstream_url).start()          # http://127.0.0.1:PORT, point AWS_ENDPOINT_URL at it
    proxy.drop_answer(lambda request: request.method == "PUT" and "if-none-match" in request.headers)
    proxy.cut_body(lambda request: request.method == "GET" and request.path.endswith("/x.json"), keep_bytes=5)
    proxy.answer_error(lambda request: request.method == "PUT", status=500, times=100)

A rule applies to the next request it matches, once (`times`): `drop_answer`
forwards the whole request, lets the server apply it, and closes the client's
connection instead of answering (the answer is lost on the way back);
`cut_body` forwards the answer's head and its first `keep_bytes` body bytes,
then closes (a truncated body); `answer_error` lets the server apply the
request and answers an S3 error instead (as a server that fails while, or
after, it writes: 500 InternalError, 503 SlowDown). Every other byte passes
through unchanged.
Each client connection gets its own upstream connection; requests are parsed
(Content-Length or chunked bodies), answers are relayed as they come, which is
enough for clients that do not pipeline (botocore, aiohttp).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    """Lower-cased names."""


@dataclass
class _Rule:
    matches: Callable[[Request], bool]
    action: str  # "drop", "cut" or "error"
    times: int
    keep_bytes: int = 0
    status: int = 500
    code: str = "InternalError"


@dataclass
class CuttingProxy:
    upstream_url: str
    requests: list[Request] = field(default_factory=list)
    """Every request seen, in order."""
    applied: list[tuple[str, Request]] = field(default_factory=list)
    """(action, request) for each answer lost or cut."""

    def __post_init__(self) -> None:
        parts = urlsplit(self.upstream_url)
        self._upstream = (parts.hostname, parts.port)
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "CuttingProxy":
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="cutting-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(300):  # set at once when quiet: the bound only ends a start that hangs
            raise RuntimeError("the cutting proxy did not start")
        return self

    def stop(self) -> None:
        """Close the listener and every relayed connection, then end the loop and its thread."""

        async def shutdown() -> None:
            self._server.close()
            relays = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(300)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(300)
        self._loop.close()

    def drop_answer(self, matches: Callable[[Request], bool], times: int = 1) -> None:
        with self._lock:
            self._rules.append(_Rule(matches, "drop", times))

    def cut_body(self, matches: Callable[[Request], bool], keep_bytes: int = 0, times: int = 1) -> None:
        with self._lock:
            self._rules.append(_Rule(matches, "cut", times, keep_bytes))

    def answer_error(
        self, matches: Callable[[Request], bool], status: int = 500, code: str = "InternalError", times: int = 1
    ) -> None:
        with self._lock:
            self._rules.append(_Rule(matches, "error", times, status=status, code=code))

    def _rule_for(self, request: Request) -> _Rule | None:
        with self._lock:
            self.requests.append(request)
            for rule in self._rules:
                if rule.times > 0 and rule.matches(request):
                    rule.times -= 1
                    self.applied.append((rule.action, request))
                    return rule
        return None

    # -- the relay -----------------------------------------------------------

    async def _client(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_writer.close()
            return
        pending: list[tuple[Request, _Rule | None]] = []  # the request whose answer comes next, and its rule
        answer_ready = asyncio.Event()

        async def requests_up() -> None:
            while True:
                head = await _read_head(client_reader)
                if head is None:
                    return
                request = _parse_request(head)
                pending.append((request, self._rule_for(request)))
                answer_ready.set()
                upstream_writer.write(head)
                await _relay_body(client_reader, upstream_writer, request.headers)
                await upstream_writer.drain()

        async def answers_down() -> None:
            while True:
                await answer_ready.wait()
                head = await _read_head(upstream_reader)
                if head is None:
                    return
                if head.startswith(b"HTTP/1.1 100"):
                    client_writer.write(head)  # "100 Continue": the answer proper follows
                    continue
                answer_ready.clear()
                request, rule = pending.pop(0)
                if rule is not None and rule.action == "drop":
                    return  # the server applied the request; its answer never reaches the client
                if rule is not None and rule.action == "error":
                    if request.method != "HEAD" and head.split(b" ", 2)[1] not in (b"204", b"304"):
                        await _relay_body(upstream_reader, _Discard(), _parse_headers(head))
                    client_writer.write(_error_answer(rule.status, rule.code))
                    await client_writer.drain()
                    return  # "Connection: close": the client opens a new connection for its retry
                client_writer.write(head)
                if rule is not None and rule.action == "cut":
                    client_writer.write(await _read_some(upstream_reader, rule.keep_bytes))
                    await client_writer.drain()
                    return
                status = head.split(b" ", 2)[1]
                if request.method != "HEAD" and status not in (b"204", b"304"):
                    await _relay_body(upstream_reader, client_writer, _parse_headers(head))
                await client_writer.drain()

        tasks = [asyncio.ensure_future(requests_up()), asyncio.ensure_future(answers_down())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except (OSError, asyncio.IncompleteReadError):
            pass  # one side went away: close both
        finally:
            for task in tasks:
                task.cancel()
            for writer in (client_writer, upstream_writer):
                writer.close()


class _Discard:
    """A writer that drops what it is given: the server's answer an error replaces."""

    def write(self, data: bytes) -> None:
        pass


def _error_answer(status: int, code: str) -> bytes:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected by the test proxy</Message></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} Injected\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def _read_some(reader: asyncio.StreamReader, num_bytes: int) -> bytes:
    data = b""
    while len(data) < num_bytes:
        block = await reader.read(num_bytes - len(data))
        if not block:
            break
        data += block
    return data


def _parse_headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return headers


def _parse_request(head: bytes) -> Request:
    method, path, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
    return Request(method, path, _parse_headers(head))


async def _relay_body(
    reader: asyncio.StreamReader, writer: "asyncio.StreamWriter | _Discard", headers: dict[str, str]
) -> None:
    """Copy one message body (Content-Length or chunked; none when neither is given)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readuntil(b"\r\n")
            writer.write(size_line)
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    line = await reader.readuntil(b"\r\n")
                    writer.write(line)
                    if line == b"\r\n":
                        return
            writer.write(await reader.readexactly(size + 2))
    left = int(headers.get("content-length", "0") or 0)
    while left > 0:
        block = await reader.read(min(left, 1 << 16))
        if not block:
            raise asyncio.IncompleteReadError(b"", left)
        writer.write(block)
        left -= len(block)
