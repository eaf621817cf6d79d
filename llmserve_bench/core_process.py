"""Start an llmserve-core subprocess for a benchmark and make sure it goes away afterwards.

The core listens on an ipc socket in a fresh private directory and logs to a file there (its periodic stats
lines would tear the progress bar). It runs in its own session, so a Ctrl-C at the terminal reaches only the
bench, which then aborts its requests and stops the core itself: SIGTERM, then SIGKILL if it lingers. A
bench that dies without doing so (SIGKILL) takes its core with it (`die_with_parent`).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from llmserve_client.child_process import die_with_parent
from llmserve_client.core_flags import flag_value


class CoreStartError(RuntimeError):
    def __init__(self, message: str, returncode: int | None = None):
        super().__init__(message)
        self.returncode = returncode


def model_max_len(model_dir: str, core_args: list[str]) -> int | None:
    """max_model_len the core will use, when it can be told without loading anything: --max-model-len among
    the core's flags, else config.json's max_position_embeddings. None under YaRN rope scaling, which the
    core extends by its factor (a rule of the model's, kept in the core): its probe refuses what won't fit."""
    flag = flag_value(core_args, "--max-model-len")     # the last one, as the core's parser takes it
    if flag is not None:
        return int(flag) if flag.isdigit() else None
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if isinstance(rope, dict) and "yarn" in (rope.get("rope_type"), rope.get("type")):
            return None
        n = cfg.get("max_position_embeddings")
        return n if isinstance(n, int) else None
    except (OSError, ValueError):
        return None


class CoreProcess:
    """`with CoreProcess(model, args) as core: ... core.endpoint ...`"""

    def __init__(self, model: str, core_args: list[str] = (), *, python: str = sys.executable,
                 stop_timeout: float = 15.0):
        self.model = model
        self.core_args = list(core_args)
        self.python = python
        self.stop_timeout = stop_timeout
        self.dir = tempfile.mkdtemp(prefix="llmserve-bench-")   # 0700
        self.endpoint = "ipc://" + os.path.join(self.dir, "core.sock")
        self.log_path = os.path.join(self.dir, "core.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> "CoreProcess":
        cmd = [self.python, "-m", "llmserve_core", "--model", self.model, "--listen", self.endpoint, *self.core_args]
        self._log = open(self.log_path, "wb")
        env = dict(os.environ)
        # The child must import the same llmserve packages as this process, wherever they come from.
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True, preexec_fn=die_with_parent)
        return self

    def check_running(self) -> None:
        """Raise CoreStartError with the core's last log lines if it has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise CoreStartError(f"llmserve-core exited with code {self.proc.returncode}:\n{self.log_tail()}",
                                 self.proc.returncode)

    def wait_socket(self, timeout: float) -> None:
        """Wait until the core binds its socket (it binds only after loading the model), or it exits."""
        path = self.endpoint[len("ipc://"):]
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            self.check_running()
            if time.monotonic() > deadline:
                raise CoreStartError(f"llmserve-core did not start listening within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:]).rstrip()
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code. Safe to call twice."""
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
                p.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            except ProcessLookupError:
                pass
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        if p is not None and os.path.isdir(self.dir) and p.returncode == 0:
            shutil.rmtree(self.dir, ignore_errors=True)    # kept on failure: core.log explains it
        return None if p is None else p.returncode

    def __enter__(self) -> "CoreProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
