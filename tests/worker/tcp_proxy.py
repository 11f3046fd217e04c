"""A TCP proxy on 127.0.0.1 that a test can cut: an outage of one service (S3, PostgreSQL,
Redis) as its clients see it, without stopping the shared server behind it.

``cut()`` closes every open connection and resets each new one at once (the listening
socket stays bound, so no other process can take its port meanwhile); ``restore()`` passes
traffic again. Clients see resets and closed connections: what a restarting server gives.
``silence()`` is the other failure: the connections open now stay open but nothing more
passes on them, either way (a server gone behind a load balancer or a partition), while new
connections pass as before.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from collections.abc import Iterator
from typing import cast


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0): the peer learns at once, no TIME_WAIT."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        self._silenced: set[socket.socket] = set()
        self.connections = 0  # connections passed through, over the proxy's life
        threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True).start()

    def url_host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        """Start an outage: drop every connection, reset every new one."""
        with self._lock:
            self._cut = True
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            _reset(sock)

    def silence(self) -> None:
        """Pass nothing more on the connections open now, and close none of them."""
        with self._lock:
            self._silenced |= self._open

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        self.cut()
        try:
            yield
        finally:
            self.restore()

    def close(self) -> None:
        self._closed = True
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                cut = self._cut
            if cut:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._cut:
                    _reset(client)
                    _reset(upstream)
                    continue
                self._open.update((client, upstream))
                self.connections += 1
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        """Copy both ways until both sides have closed (or the proxy cuts them). A side
        that closes is passed on as a half-close, so data still in flight is delivered."""
        peer = {a: b, b: a}
        with selectors.DefaultSelector() as sel:
            sel.register(a, selectors.EVENT_READ)
            sel.register(b, selectors.EVENT_READ)
            open_sides = 2
            try:
                while open_sides:
                    for key, _ in sel.select(timeout=1.0):
                        src = cast(socket.socket, key.fileobj)
                        data = src.recv(65536)
                        if data:
                            with self._lock:
                                silenced = src in self._silenced
                            if not silenced:
                                peer[src].sendall(data)
                            continue
                        sel.unregister(src)
                        peer[src].shutdown(socket.SHUT_WR)
                        open_sides -= 1
                    if a.fileno() < 0 or b.fileno() < 0:  # cut
                        return
            except (OSError, ValueError):
                return
            finally:
                with self._lock:
                    self._open -= {a, b}
                    self._silenced -= {a, b}
                for sock in (a, b):
                    with contextlib.suppress(OSError):
                        sock.close()
