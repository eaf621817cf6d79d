"""Starting, waiting for and stopping real llmserve-core processes in tests.

Waits are for readiness (the handshake, stats, a socket file), never fixed sleeps, and their deadlines
are generous: on a loaded 2-core CI machine a core that loads in 5 s alone may take a minute.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from llmserve_client import Client
from llmserve_proto import decode_core
from llmserve_proto.messages import Heartbeat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
ENGINE_ARGS = ["--device", "cpu", "--max-model-len", "512", "--num-kv-blocks", "256", "--block-size", "16"]
READY_TIMEOUT = 180.0      # model load + handshake; seconds alone, a minute or more on a busy machine
STOP_TIMEOUT = 60.0


def start_core(model_dir: str, endpoint: str, log_path: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llmserve_core", "--model", model_dir, "--listen", endpoint,
                             *ENGINE_ARGS, "--heartbeat-interval", "0.2", "--client-timeout", "3",
                             "--log-interval", "0.5", *extra],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))


def wait_ready(endpoint: str, proc: subprocess.Popen | None = None, log_path: str | None = None) -> None:
    """Until the core at `endpoint` answers a handshake; fails early with its log if it exits."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            with Client(endpoint, connect_timeout=5):
                return
        except Exception:
            if proc is not None and proc.poll() is not None:
                tail = open(log_path).read()[-3000:] if log_path else ""
                raise AssertionError(f"core exited with {proc.returncode} before it was ready:\n{tail}")
            if time.monotonic() > deadline:
                raise


def stop_core(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout)


def wait_idle(client: Client, timeout: float = 60.0) -> dict:
    """Stats once nothing runs or waits; fails if KV blocks stay held."""
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if s["running"] == 0 and s["waiting"] == 0 and s["live_requests"] == 0 and s["used_kv_blocks"] == 0:
            return s
        assert time.monotonic() < deadline, f"engine never went idle: {s}"
        time.sleep(0.05)


def recv_reply(sock):
    """The next message that is not a heartbeat (the core sends those on its own schedule)."""
    while True:
        msg = decode_core(sock.recv())
        if not isinstance(msg, Heartbeat):
            return msg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
