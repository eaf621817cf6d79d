"""A scripted core: a ROUTER that speaks the protocol to one client and sends exactly what a test queues,
so the moments a client test is about happen every run."""
from __future__ import annotations

import queue
import threading
import time

import zmq

from llmserve_proto import (Abort, Generate, Heartbeat, Hello, ModelInfo, OutputBatch, RequestOutput, Welcome,
                            decode_client, encode)

WAIT_S = 60.0


class ScriptedCore(threading.Thread):
    """A ROUTER that welcomes one client, hands the test every other message it sends, and sends what the
    test queues (heartbeats on its own, so the client never declares it dead)."""

    def __init__(self, endpoint: str, model_dir: str):
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.welcome = Welcome(protocol_version=1, model_info=ModelInfo(model=model_dir, vocab_size=1024,
                                                                        max_model_len=512),
                               heartbeat_interval_s=0.2, client_timeout_s=30.0)
        self.received: queue.SimpleQueue = queue.SimpleQueue()
        self.outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = threading.Event()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.start()

    def run(self) -> None:
        peer, last_beat = None, 0.0
        while not self.stopping.is_set():
            if self.sock.poll(20):
                peer, frame = self.sock.recv_multipart()
                msg = decode_client(frame)
                if isinstance(msg, Hello):
                    self.sock.send_multipart([peer, encode(self.welcome)])
                elif isinstance(msg, (Generate, Abort)):
                    self.received.put(msg)
            if peer is None:
                continue
            while not self.outgoing.empty():
                self.sock.send_multipart([peer, encode(self.outgoing.get())])
            if time.monotonic() - last_beat > 0.2:
                self.sock.send_multipart([peer, encode(Heartbeat())])
                last_beat = time.monotonic()
        self.sock.close()

    def expect(self, kind):
        msg = self.received.get(timeout=WAIT_S)
        assert isinstance(msg, kind), msg
        return msg

    def send(self, *outputs: RequestOutput) -> None:
        self.outgoing.put(OutputBatch(outputs=list(outputs)))

    def close(self) -> None:
        self.stopping.set()
        self.join(WAIT_S)
