"""Starting, waiting for and stopping llmserve-serve (the OpenAI-compatible HTTP frontend) and the cores
behind it in tests, and an `openai` SDK client for one."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from helpers.daemon import ENV, free_port

MAX_MODEL_LEN = 512
CORE_ARGS = ["--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256", "--block-size", "16",
             "--heartbeat-interval", "0.2", "--client-timeout", "3", "--log-interval", "0"]


def start_core(model_dir: str, endpoint: str, log_path: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llmserve_core", "--model", model_dir, "--listen", endpoint,
                             *CORE_ARGS, *extra], env=ENV, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))


def start_serve(log_path: str, *args: str) -> tuple[subprocess.Popen, str]:
    """Start llmserve-serve (it waits for its core's handshake by itself, so both may start together)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmserve_client.http", "--port", str(port),
                             "--log-level", "warning", *args],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, base: str, log_path: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(log_path).read()[-3000:]
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("llmserve-serve did not come up:\n" + open(log_path).read()[-3000:])


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def sdk(base: str, api_key: str = "unused"):
    """An `openai.OpenAI` client of the server at `base` (openai imported here: only its users need it)."""
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=120)   # a busy machine


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]
