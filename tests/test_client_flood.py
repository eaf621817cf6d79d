"""A core that sends faster than the client reads: the client's transport thread must still ping the core
(which drops a client silent for client_timeout) and still send its requests, however long the flood."""
from __future__ import annotations

import time

from llmserve_client import Client
from llmserve_client import transport as transport_module
from llmserve_proto import Generate, Heartbeat, Hello, Ping, decode_client, encode
from helpers.scripted_core import WAIT_S, ScriptedCore

FLOOD_S = 4.0
PING_EVERY_S = 1.0     # the client pings every min(1 s, client_timeout / 4); the scripted core's is 30 s


class FloodingCore(ScriptedCore):
    """Welcomes one client, then sends heartbeats at about 3,000 a second for FLOOD_S, more than the
    client (slowed by the test to about 1,000 a second) reads; notes when each ping and Generate arrives."""

    def __init__(self, endpoint: str, model_dir: str):
        self.pings: list[float] = []
        self.generates: list[float] = []
        self.flood_start: float | None = None
        super().__init__(endpoint, model_dir)

    def run(self) -> None:
        peer, beat = None, encode(Heartbeat())
        while not self.stopping.is_set():
            while self.sock.poll(0 if self.flood_start else 20):
                peer, frame = self.sock.recv_multipart()
                msg = decode_client(frame)
                if isinstance(msg, Hello):
                    self.sock.send_multipart([peer, encode(self.welcome)])
                    self.flood_start = time.monotonic()
                elif isinstance(msg, Ping):
                    self.pings.append(time.monotonic())
                elif isinstance(msg, Generate):
                    self.generates.append(time.monotonic())
            if self.flood_start is not None and time.monotonic() - self.flood_start < FLOOD_S:
                for _ in range(30):
                    self.sock.send_multipart([peer, beat])
                time.sleep(0.01)
            elif self.flood_start is not None:
                time.sleep(0.01)
        self.sock.close()


def test_a_client_flooded_by_its_core_still_pings_and_sends(tiny_model_dir, tmp_path, monkeypatch):
    slow = transport_module.Transport._dispatch

    def slow_dispatch(self, frame, now, welcomed):
        time.sleep(0.001)
        return slow(self, frame, now, welcomed)
    monkeypatch.setattr(transport_module.Transport, "_dispatch", slow_dispatch)
    core = FloodingCore(f"ipc://{tmp_path}/core.sock", tiny_model_dir)
    try:
        with Client(core.endpoint, connect_timeout=WAIT_S) as c:
            deadline = time.monotonic() + WAIT_S
            while core.flood_start is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert core.flood_start is not None, "the client never said hello"
            time.sleep(FLOOD_S / 2)
            sent = time.monotonic()
            c.stream([1, 2, 3], max_tokens=4)          # never answered: only its arrival counts
            time.sleep(FLOOD_S / 2 + 0.5)
        window = [core.flood_start] + [t for t in core.pings if t < core.flood_start + FLOOD_S]
        gaps = [b - a for a, b in zip(window, window[1:])] + [core.flood_start + FLOOD_S - window[-1]]
        # Slack for a busy machine, but well under the flood: the old drain loop sent nothing until it ended.
        assert max(gaps) < PING_EVERY_S + 1.5, (gaps, len(core.pings))
        assert core.generates and core.generates[0] - sent < 1.5, (core.generates, sent)
    finally:
        core.close()
