"""Per-client bound on what the core holds for a client that does not read.

ZMQ's ROUTER keeps up to SEND_HWM messages per peer beyond the kernel's socket buffers. With
ROUTER_MANDATORY a send to a full peer fails with EAGAIN instead of being dropped silently, and the
message lands here, in that client's backlog; later messages queue behind it, so order is kept, and
every turn of the socket thread retries the backlog. A client is disconnected (its requests aborted,
its blocks freed, nothing more sent to it) once its backlog holds more than `max_bytes`, or has not
drained for `max_stall_s`: a client that keeps up empties its backlog within moments, one that stopped
reading never does. So per client the core holds at most SEND_HWM messages plus max_bytes.
"""
from __future__ import annotations

from collections import deque

# Messages ZMQ may queue per client. Outputs are one message per step, so this is many steps of slack.
SEND_HWM = 128


class Backlog:
    __slots__ = ("frames", "bytes", "since")

    def __init__(self, since: float):
        self.frames: deque = deque()
        self.bytes = 0
        self.since = since            # when the client last had nothing waiting here


class Outbox:
    def __init__(self, max_bytes: int, max_stall_s: float):
        self.max_bytes = max_bytes
        self.max_stall_s = max_stall_s
        self.backlogs: dict[bytes, Backlog] = {}

    def send(self, client: bytes, payload, try_send, now: float) -> str | None:
        """Send now if nothing is waiting for this client, else queue behind what is. `try_send(client,
        payload)` returns False when the peer's pipe is full. Returns a reason to disconnect, or None."""
        b = self.backlogs.get(client)
        if b is None:
            if try_send(client, payload):
                return None
            b = self.backlogs[client] = Backlog(now)
        b.frames.append(payload)
        b.bytes += len(payload)
        if b.bytes > self.max_bytes:
            return f"not reading its socket: over {self.max_bytes} bytes of unread messages"
        return None

    def flush(self, try_send, now: float) -> list[tuple[bytes, str]]:
        """Retry every backlog in order; return the clients to disconnect, with the reason."""
        stalled = []
        for client, b in list(self.backlogs.items()):
            while b.frames and client in self.backlogs and try_send(client, b.frames[0]):
                b.bytes -= len(b.frames.popleft())
            if client not in self.backlogs:
                continue                  # try_send found the peer gone and forgot it
            if not b.frames:
                del self.backlogs[client]
            elif now - b.since > self.max_stall_s:
                stalled.append((client, f"not reading its socket: unread messages for {now - b.since:.1f} s"))
        return stalled

    def excuse(self, seconds: float, now: float) -> None:
        """Stop every stall clock for `seconds` in which the core itself was not sending."""
        for b in self.backlogs.values():
            b.since = min(now, b.since + seconds)

    def forget(self, client: bytes) -> None:
        self.backlogs.pop(client, None)

    def queued_bytes(self) -> int:
        return sum(b.bytes for b in self.backlogs.values())
