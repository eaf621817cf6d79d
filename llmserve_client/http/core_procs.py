"""The llmserve-core processes a `llmserve-serve --model` frontend owns: starting M of them (data
parallelism), each on its own GPUs, and stopping them.

Each core is its own process with its own socket in a private directory. On CUDA, core i sees only its
own devices through CUDA_VISIBLE_DEVICES (tensor_parallel_size of them, taken in order from the devices
this process may use); on the CPU they are just M processes.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from llmserve_client.child_process import die_with_parent
from llmserve_client.core_flags import flag_value

log = logging.getLogger("llmserve_client.http")

CORE_STOP_TIMEOUT_S = 30.0     # how long a core may drain on SIGTERM before it is killed


@dataclass
class OwnedCore:
    proc: subprocess.Popen
    endpoint: str
    devices: str | None          # its CUDA_VISIBLE_DEVICES (None: inherited / CPU)


def device_groups(num_cores: int, core_flags: list[str], visible: str | None) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES per core, or None per core on the CPU. Raises ValueError (naming the flag) when
    the visible devices cannot give every core its own."""
    device = flag_value(core_flags, "--device") or "auto"
    if device == "cpu" or num_cores == 1:
        return [None] * num_cores
    if device not in ("auto", "cuda"):
        raise ValueError(f"--data-parallel-size: each core needs its own device; --device {device} names one, "
                         f"pass --device cuda (or leave it out)")
    tp = flag_value(core_flags, "--tensor-parallel-size", "-tp") or "1"
    per_core = int(tp) if tp.isdigit() and int(tp) > 0 else 1
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        ids = [str(i) for i in range(_cuda_device_count())]
        if not ids:
            if device == "auto":
                return [None] * num_cores     # no GPU here: the cores run on the CPU
            raise ValueError("--data-parallel-size: --device cuda, but no CUDA device is visible")
    need = num_cores * per_core
    if len(ids) < need:
        raise ValueError(f"--data-parallel-size: {num_cores} cores x {per_core} GPU(s) each need {need} devices, "
                         f"but only {len(ids)} are visible ({','.join(ids) or 'none'})")
    return [",".join(ids[i * per_core:(i + 1) * per_core]) for i in range(num_cores)]


def _cuda_device_count() -> int:
    """GPUs on this host, without importing torch (a frontend never does): nvidia-smi, else /dev/nvidiaN."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        pass
    return sum(1 for name in os.listdir("/dev") if name.startswith("nvidia") and name[6:].isdigit()) \
        if os.path.isdir("/dev") else 0


def start_cores(model: str, core_flags: list[str], num_cores: int) -> tuple[list[OwnedCore], str | None]:
    """Start num_cores llmserve-core processes; returns them and the private directory to remove afterwards.
    One core listens where a --listen among core_flags says (if any), else each on a socket in a fresh
    private directory. Raises ValueError for devices that cannot be shared out."""
    groups = device_groups(num_cores, core_flags, os.environ.get("CUDA_VISIBLE_DEVICES"))
    listen, tmpdir = flag_value(core_flags, "--listen"), None
    if listen is not None and num_cores > 1:
        raise ValueError("--listen: the cores of --data-parallel-size each get their own socket; leave --listen out")
    if listen is None:
        tmpdir = tempfile.mkdtemp(prefix="llmserve-serve-")   # 0700
    cores = []
    try:
        for i, devices in enumerate(groups):
            endpoint = listen or f"ipc://{tmpdir}/core-{i}.sock"
            flags = core_flags if listen else [*core_flags, "--listen", endpoint]
            cmd = [sys.executable, "-m", "llmserve_core", "--model", model, *flags]
            env = os.environ if devices is None else {**os.environ, "CUDA_VISIBLE_DEVICES": devices}
            log.info("starting llmserve-core %d%s: %s", i, f" on CUDA devices {devices}" if devices else "",
                     " ".join(cmd))
            # Its own session: a terminal's Ctrl-C reaches only us, and we stop the core after the HTTP side.
            proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)
            cores.append(OwnedCore(proc, endpoint, devices))
    except BaseException:
        stop_cores(cores)
        raise
    return cores, tmpdir


def stop_cores(cores: list[OwnedCore]) -> list[int]:
    """SIGTERM every core at once (they drain in parallel), kill the ones still there after the timeout."""
    for c in cores:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    codes = []
    for c in cores:
        try:
            c.proc.wait(CORE_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("llmserve-core (pid %d) did not stop within %.0f s; killing it", c.proc.pid,
                        CORE_STOP_TIMEOUT_S)
            c.proc.kill()
            c.proc.wait()
        codes.append(c.proc.returncode)
    return codes
