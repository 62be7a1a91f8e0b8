"""A loopback TCP proxy for broker-outage tests: a network partition on demand.

The clients under test reach the broker only through it (the broker advertises the proxy's
address on its proxied listener: scripts/broker with ``DPSTREAM_BROKER_PROXY_PORT``,
docs/operations.md, "A test broker"), while the test itself talks to the broker's plain
listener, which the proxy never touches.

``blackhole()`` is a partition, not a refusal: every connection stays open and nothing moves in
either direction; a new connection is accepted and then hangs (no upstream connection is made
until the partition heals). Bytes already on their way are held, not dropped, and delivered in
order by ``restore()``, as TCP retransmission delivers them when a real partition heals; a
connection an endpoint closed meanwhile is closed on the other side once the partition heals.
``reset()`` aborts every connection (both sides see it at once).

``latency_s`` (settable at any time) delays every byte by that much in each direction, without
slowing the flow (a network farther away than loopback).

``hold_together(api_key, count, window_s)`` makes requests of one Kafka API (e.g. 19,
CreateTopics) from the clients wait until ``count`` of them are waiting, or ``window_s`` after
the first, and then forwards them together: clients that would send them at about the same time
(workers started together) send them at the same instant. The proxy splits the client -> broker
byte stream into Kafka request frames for this (a 4-byte size, then the API key); the order of
the requests on each connection is kept.

The proxy runs an asyncio event loop in a daemon thread; its methods may be called from any
thread and return once the change is in effect.
"""
from __future__ import annotations

import asyncio
import socket
import threading


class KafkaProxy:
    """``KafkaProxy(("127.0.0.1", broker_proxied_port), port=0).start()``; ``.address`` is
    ``host:port`` to give the clients. Counters for checking the harness itself:
    ``forwarded`` (bytes moved, both directions), ``accepted`` (connections accepted) and
    ``open_connections`` (their numbers)."""

    def __init__(self, upstream: tuple[str, int], port: int = 0, host: str = "127.0.0.1"):
        self.upstream, self.host = upstream, host
        self.port = port
        self.forwarded = 0
        self.accepted = 0
        self.latency_s = 0.0  # one way
        self._conns: set = set()  # the StreamWriters of both sides of every connection
        self._loop = asyncio.new_event_loop()
        self._open: asyncio.Event | None = None
        self._server = None
        self._hold: tuple[int, int, float] | None = None  # (api key, count, window) of hold_together
        self._round: dict | None = None  # the requests waiting now: {"waiting": n, "go": Event}
        self.released: list[int] = []  # how many requests each hold_together round released at once
        self._thread = threading.Thread(target=self._loop.run_forever, name="kafka-proxy", daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def open_connections(self) -> set[int]:
        """The open client connections, by their number in order of acceptance."""
        return {w.dpstream_number for w in list(self._conns) if w.dpstream_side == "client"}

    @property
    def blackholed(self) -> bool:
        return not self._open.is_set()

    def start(self) -> "KafkaProxy":
        self._thread.start()
        self._call(self._listen())
        return self

    def blackhole(self) -> None:
        """From now on nothing is forwarded in either direction; connections stay open and new
        ones are accepted and hang."""
        self._call(self._set(False))

    def restore(self) -> None:
        """Forward again: held bytes first, in order; hanging new connections reach the broker."""
        self._call(self._set(True))

    def reset(self) -> None:
        """Abort every connection, both sides (new ones are accepted as before)."""
        self._call(self._reset())

    def hold_together(self, api_key: int, count: int, window_s: float) -> None:
        """From now on, requests of ``api_key`` go to the broker ``count`` at a time (or those
        waiting ``window_s`` after the first of a round); :attr:`released` records each round's size."""
        self._hold = (api_key, count, window_s)

    def stop_holding(self) -> None:
        """Requests go through as they come again (those waiting now go at once)."""
        self._call(self._stop_holding())

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> "KafkaProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- on the proxy's loop
    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _listen(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self._server = await asyncio.start_server(self._serve, sock=sock, backlog=256)

    async def _set(self, forwarding: bool) -> None:
        if forwarding:
            self._open.set()
        else:
            self._open.clear()

    async def _stop_holding(self) -> None:
        self._hold = None
        if self._round is not None:
            self._release(self._round)

    async def _reset(self) -> None:
        for w in list(self._conns):
            self._conns.discard(w)
            w.transport.abort()

    async def _shutdown(self) -> None:
        self._server.close()
        await self._reset()
        self._open.set()  # let every held coroutine see its closed connection and end

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        client_w.dpstream_side, client_w.dpstream_number = "client", self.accepted
        self._conns.add(client_w)
        upstream_w = None
        try:
            await self._open.wait()  # accepted during a partition: hangs until it heals
            if client_w.transport.is_closing():
                return
            upstream_r, upstream_w = await asyncio.open_connection(*self.upstream)
            upstream_w.dpstream_side, upstream_w.dpstream_number = "upstream", client_w.dpstream_number
            self._conns.add(upstream_w)
            # connections opened once hold_together is on are read request by request
            pumps = [asyncio.ensure_future(self._pump(client_r, upstream_w, requests=self._hold is not None)),
                     asyncio.ensure_future(self._pump(upstream_r, client_w))]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)  # either side gone: both go
            for p in pumps:
                p.cancel()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (client_w, upstream_w):
                if w is not None:
                    self._conns.discard(w)
                    w.transport.abort()
                    sender = getattr(w, "dpstream_sender", None)
                    if sender is not None:
                        sender.cancel()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, requests: bool = False) -> None:
        pending = bytearray()  # requests=True: the bytes of requests not complete yet
        try:
            while True:
                await self._open.wait()
                data = await reader.read(65536)
                if not data:
                    return
                await self._open.wait()  # read just as the partition began: held, delivered when it heals
                if requests:
                    pending += data
                    while len(pending) >= 6 and len(pending) >= 4 + int.from_bytes(pending[:4], "big"):
                        size = 4 + int.from_bytes(pending[:4], "big")
                        frame = bytes(pending[:size])
                        del pending[:size]
                        hold = self._hold
                        if hold is not None and int.from_bytes(frame[4:6], "big", signed=True) == hold[0]:
                            await self._together(hold)
                        await self._forward(writer, frame)
                    continue
                await self._forward(writer, data)
        except OSError:
            return

    async def _forward(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        queue = getattr(writer, "dpstream_delayed", None)
        if queue is None and self.latency_s <= 0:
            writer.write(data)
            await writer.drain()
            self.forwarded += len(data)
            return
        if queue is None:  # from now on this direction goes through its own queue, in order
            queue = writer.dpstream_delayed = asyncio.Queue()
            writer.dpstream_sender = asyncio.ensure_future(self._send_later(writer, queue))
        await queue.put((asyncio.get_running_loop().time() + self.latency_s, data))

    async def _send_later(self, writer: asyncio.StreamWriter, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                due, data = await queue.get()
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                writer.write(data)
                await writer.drain()
                self.forwarded += len(data)
        except OSError:
            writer.transport.abort()

    async def _together(self, hold: tuple[int, int, float]) -> None:
        """Wait for this round of hold_together to be released."""
        _, count, window_s = hold
        if self._round is None:
            go = asyncio.Event()
            self._round = {"waiting": 0, "go": go}
            asyncio.get_running_loop().call_later(window_s, self._release, self._round)
        this = self._round
        this["waiting"] += 1
        if this["waiting"] >= count:
            self._release(this)
        await this["go"].wait()

    def _release(self, this: dict) -> None:
        if this["go"].is_set():
            return
        self.released.append(this["waiting"])
        this["go"].set()
        if self._round is this:
            self._round = None
