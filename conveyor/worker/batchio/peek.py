"""Looking at the start of an input before reading it, on streams that cannot seek."""

from __future__ import annotations

from conveyor.worker.batchio.line_reader import ByteStream

HEAD_BYTES = 1024


class PeekedStream:
    """``stream`` with ``head`` (bytes already read from it) put back in front of it."""

    def __init__(self, head: bytes, stream: ByteStream) -> None:
        self._head, self._stream = head, stream

    def read(self, size: int = -1, /) -> bytes:
        if not self._head:
            return self._stream.read(size)
        if size < 0:
            data, self._head = self._head + self._stream.read(), b""
            return data
        data, self._head = self._head[:size], self._head[size:]
        return data  # a short read, as a raw stream may give

    def readline(self, size: int = -1, /) -> bytes:
        if not self._head:
            return self._stream.readline(size)
        end = self._head.find(b"\n") + 1 or len(self._head)
        if size >= 0:
            end = min(end, size)
        data, self._head = self._head[:end], self._head[end:]
        if self._head or data.endswith(b"\n") or len(data) == size:
            return data
        # The head ended inside this line: its rest comes from the stream.
        return data + self._stream.readline(size - len(data) if size >= 0 else -1)


def peek(stream: ByteStream, size: int = HEAD_BYTES) -> tuple[bytes, PeekedStream]:
    """The first ``size`` bytes of ``stream`` (fewer if it is shorter), and a stream that
    reads from the start again."""
    head = b""
    while len(head) < size:
        chunk = stream.read(size - len(head))
        if not chunk:
            break
        head += chunk
    return head, PeekedStream(head, stream)
