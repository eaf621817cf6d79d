"""`llmserve-bench soak`: a randomized soak of a real core and HTTP frontend, which it starts and stops.

For --duration seconds it runs, at once: well-behaved clients over IPC and HTTP (small valid requests,
timed), a stats poller, clients with random sampling parameters (some invalid), aborts and streams dropped
half way (IPC and HTTP), one client flooding the core with requests, one that never reads its socket, and
client processes SIGKILLed while they stream (soak_actors.py). Then it stops the load, waits for the core
to go idle and judges the run. It fails (exit 1) when:
  * the core or the frontend died, or did not exit 0 on SIGTERM at the end;
  * KV blocks leaked: once idle, some block is neither free nor cached;
  * the core's or the frontend's RSS grew by more than --max-rss-growth-mb from the end of the warm-up
    to the end;
  * a well-behaved request (or a stats call) waited more than --max-wait seconds, or failed.
It prints a summary (requests, errors by kind, RSS at the start and end, blocks at the end, p99 wait of
the well-behaved clients) and writes it as JSON with --result-json.
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from llmserve_bench import soak_actors as actors
from llmserve_bench.core_process import CoreProcess, CoreStartError
from llmserve_bench.metrics import percentile

DEFAULT_CORE_ARGS = ["--device", "cpu", "--max-model-len", "512", "--num-kv-blocks", "1024", "--block-size", "16",
                     "--max-num-seqs", "32", "--heartbeat-interval", "0.5", "--client-timeout", "5",
                     "--log-interval", "0"]


def _shipped(name: str) -> str | None:
    """A model of the tiny trained pair shipped with llmserve_core (found without importing it)."""
    spec = importlib.util.find_spec("llmserve_core")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "trained_pair", name)
    return path if os.path.isdir(path) else None


def default_model() -> str | None:
    """The tiny trained Qwen3 shipped with llmserve_core."""
    return _shipped("target")


def default_draft() -> str | None:
    """Its EAGLE-3 draft: the soak of the shipped model drafts, so speculation runs under the same chaos."""
    return _shipped("draft")


@dataclass
class SoakConfig:
    model: str
    duration_s: float = 60.0
    core_args: list[str] = field(default_factory=list)
    well_behaved: int = 2            # per transport (IPC and HTTP)
    chaos: int = 2                   # per transport
    flood_inflight: int = 128        # with --max-num-seqs 32: a queue of ~100 flood requests
    never_reader_per_s: int = 1
    kill_every_s: float = 10.0
    max_wait_s: float = 60.0         # loose: a busy 2-core machine runs the tiny model at tens of tokens/s
    max_rss_growth_mb: float = 300.0
    idle_timeout_s: float = 120.0
    seed: int = 0


@dataclass
class SoakResult:
    config: dict
    passed: bool
    failures: list[str]
    duration_s: float
    requests: int
    by_kind: dict
    by_role: dict
    rss_mb: dict
    blocks_end: dict
    well_behaved_waits: dict
    stats_waits: dict
    exit_codes: dict
    commit: str | None = None
    host: str = field(default_factory=platform.node)

    def table(self) -> str:
        lines = [f"soak: {'PASSED' if self.passed else 'FAILED'} after {self.duration_s:.0f} s, "
                 f"{self.requests} requests"]
        lines.append("outcomes by kind: " + ", ".join(f"{k} {v}" for k, v in self.by_kind.items()))
        for name, r in self.rss_mb.items():
            lines.append(f"RSS {name}: {r['start']:.0f} MB after warm-up -> {r['end']:.0f} MB at the end "
                         f"(max {r['max']:.0f}, growth {r['end'] - r['start']:+.0f} MB, bound +{r['bound']:.0f})")
        b = self.blocks_end
        lines.append(f"KV blocks at the end: {b.get('used')} used, {b.get('free')} free or cached of {b.get('total')}")
        w = self.well_behaved_waits
        lines.append(f"well-behaved waits: {w['count']} requests, p50 {w['p50_s']:.3f} s, p99 {w['p99_s']:.3f} s, "
                     f"max {w['max_s']:.3f} s (bound {w['bound_s']:g} s); stats p99 {self.stats_waits['p99_s']:.3f} s")
        lines.append("exit codes: " + ", ".join(f"{k} {v}" for k, v in self.exit_codes.items()))
        for f in self.failures:
            lines.append(f"FAIL: {f}")
        return "\n".join(lines)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commit() -> str | None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def used_blocks(stats: dict) -> int:
    """Blocks held by requests: neither free nor cached (a core that reports cached blocks among the free
    ones has no used_kv_blocks counter)."""
    if "used_kv_blocks" in stats:
        return int(stats["used_kv_blocks"])
    return int(stats["total_kv_blocks"]) - int(stats["free_kv_blocks"])


class Frontend:
    """llmserve-serve --endpoint as a subprocess, logging into the core's directory."""

    def __init__(self, endpoint: str, log_dir: str, env: dict):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, "serve.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "llmserve_client.http", "--endpoint", endpoint,
                                      "--port", str(self.port), "--log-level", "warning"],
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_healthy(self, timeout: float) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CoreStartError(f"llmserve-serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise CoreStartError(f"llmserve-serve was not healthy within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _env() -> dict:
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def _waits(values: list[float], bound: float) -> dict:
    return {"count": len(values), "p50_s": percentile(values, 50), "p99_s": percentile(values, 99),
            "max_s": max(values, default=0.0), "bound_s": bound}


def run_soak(cfg: SoakConfig, log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> SoakResult:
    env = _env()
    core = CoreProcess(cfg.model, [*DEFAULT_CORE_ARGS, *cfg.core_args], stop_timeout=60.0).start()
    frontend = None
    failures: list[str] = []
    tally = actors.Tally()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    samples: dict[str, list[float]] = {"core": [], "frontend": []}
    start_rss: dict[str, float] = {}
    exit_codes: dict[str, int | None] = {}
    blocks: dict = {}
    t_start = time.monotonic()
    try:
        core.wait_socket(600.0)
        frontend = Frontend(core.endpoint, core.dir, env)
        frontend.wait_healthy(600.0)
        log(f"soak: core pid {core.proc.pid}, frontend {frontend.base} (pid {frontend.proc.pid}); logs in {core.dir}")

        def spawn(name, target, *args):
            t = threading.Thread(target=_guard, args=(name, target, tally, *args), name=name, daemon=True)
            t.start()
            threads.append(t)

        seed = cfg.seed
        for i in range(cfg.well_behaved):
            spawn(f"well-behaved-ipc-{i}", actors.well_behaved_ipc, core.endpoint, tally, stop, seed + 1 + i)
            spawn(f"well-behaved-http-{i}", actors.well_behaved_http, frontend.base, tally, stop, seed + 101 + i)
        for i in range(cfg.chaos):
            spawn(f"chaos-ipc-{i}", actors.chaos_ipc, core.endpoint, tally, stop, seed + 201 + i)
            spawn(f"chaos-http-{i}", actors.chaos_http, frontend.base, tally, stop, seed + 301 + i)
        spawn("stats", actors.stats_poller, core.endpoint, tally, stop)
        if cfg.flood_inflight:
            spawn("flood", actors.flood, core.endpoint, tally, stop, cfg.flood_inflight, seed + 401)
        if cfg.never_reader_per_s:
            spawn("never-reader", actors.never_reader, core.endpoint, tally, stop, cfg.never_reader_per_s)
        if cfg.kill_every_s:
            spawn("killer", actors.killer, core.endpoint, tally, stop, cfg.kill_every_s, seed + 501, env)

        warmup = min(10.0, cfg.duration_s / 6)
        t_load = time.monotonic()
        next_report = t_load + 60.0
        while time.monotonic() - t_load < cfg.duration_s:
            time.sleep(1.0)
            dead = _dead(core, frontend)
            if dead:
                failures.append(dead)
                break
            for name, pid in (("core", core.proc.pid), ("frontend", frontend.proc.pid)):
                samples[name].append(rss_mb(pid))
            if not start_rss and time.monotonic() - t_load >= warmup:
                start_rss = {name: s[-1] for name, s in samples.items()}
            if time.monotonic() >= next_report:
                next_report += 60.0
                log(f"soak: {time.monotonic() - t_load:.0f} s, {sum(tally.by_kind().values())} requests, "
                    f"RSS core {samples['core'][-1]:.0f} MB, frontend {samples['frontend'][-1]:.0f} MB")
        stop.set()
        for t in threads:
            t.join(120.0)
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            failures.append(f"clients still blocked 120 s after the end: {', '.join(stuck)}")
        if not _dead(core, frontend):
            blocks = _wait_idle(core.endpoint, cfg.idle_timeout_s, failures)
            for name, pid in (("core", core.proc.pid), ("frontend", frontend.proc.pid)):
                samples[name].append(rss_mb(pid))
    except CoreStartError as e:
        failures.append(str(e))
    finally:
        stop.set()
        if frontend is not None:
            exit_codes["frontend"] = frontend.stop()
        exit_codes["core"] = core.stop()
    for name, code in exit_codes.items():
        if code != 0:
            failures.append(f"{name} exited with status {code} when stopped (0 expected); log: "
                            f"{core.log_path if name == 'core' else frontend.log_path}")
    rss = {}
    for name, s in samples.items():
        if s:
            start = start_rss.get(name, s[0])
            rss[name] = {"start": start, "end": s[-1], "max": max(s), "bound": cfg.max_rss_growth_mb}
            if s[-1] - start > cfg.max_rss_growth_mb:
                failures.append(f"{name} RSS grew by {s[-1] - start:.0f} MB (from {start:.0f} to {s[-1]:.0f} MB), "
                                f"more than the bound of {cfg.max_rss_growth_mb:.0f} MB")
    waits = _waits(tally.waits, cfg.max_wait_s)
    stats_waits = _waits(tally.stats_waits, cfg.max_wait_s)
    if waits["max_s"] > cfg.max_wait_s:
        failures.append(f"a well-behaved request waited {waits['max_s']:.1f} s ({tally.slowest[1]}), "
                        f"more than the bound of {cfg.max_wait_s:g} s")
    if stats_waits["max_s"] > cfg.max_wait_s:
        failures.append(f"a stats call waited {stats_waits['max_s']:.1f} s, more than {cfg.max_wait_s:g} s")
    roles = tally.by_role()
    crashed = {k: v for k, v in tally.by_kind().items() if k.startswith("error:actor_crashed")}
    if crashed:
        failures.append(f"soak clients crashed: {crashed}")
    for role in ("well_behaved_ipc", "well_behaved_http", "stats"):
        errors = {k: v for k, v in roles.get(role, {}).items() if k.startswith("error")}
        if errors:
            failures.append(f"{role} requests failed: {errors}")
        if not roles.get(role, {}).get("ok"):
            failures.append(f"{role}: no request succeeded")
    for role in ("chaos_ipc", "chaos_http"):
        wrong = {k: v for k, v in roles.get(role, {}).items() if k in ("error:valid_rejected", "error:invalid_accepted")}
        if wrong:
            failures.append(f"{role}: the core judged requests wrongly: {wrong}")
    by_kind = tally.by_kind()
    requests = sum(n for (role, kind), n in tally.counts.items() if role not in ("killed_clients",))
    return SoakResult(config=asdict(cfg), passed=not failures, failures=failures,
                      duration_s=time.monotonic() - t_start, requests=requests, by_kind=by_kind, by_role=roles,
                      rss_mb=rss, blocks_end=blocks, well_behaved_waits=waits, stats_waits=stats_waits,
                      exit_codes=exit_codes, commit=_commit())


def _guard(name, target, tally, *args) -> None:
    """An actor's own bug is an outcome too, not a silent dead thread."""
    try:
        target(*args)
    except BaseException as e:   # noqa: BLE001 - reported, and the soak goes on
        tally.count(name, f"error:actor_crashed:{type(e).__name__}: {str(e)[:200]}")


def _dead(core: CoreProcess, frontend: Frontend) -> str | None:
    if core.proc.poll() is not None:
        return f"the core died with status {core.proc.returncode}:\n{core.log_tail()}"
    if frontend.proc.poll() is not None:
        return f"the frontend died with status {frontend.proc.returncode}:\n{frontend.log_tail()}"
    return None


def _wait_idle(endpoint: str, timeout: float, failures: list[str]) -> dict:
    """Once the load is gone: nothing running or waiting, and no block held. Returns the blocks then."""
    from llmserve_client import Client, LLMServeError
    deadline = time.monotonic() + timeout
    stats: dict = {}
    try:
        with Client(endpoint, connect_timeout=60, client_name="soak-judge") as c:
            while True:
                stats = c.stats(timeout=60)
                if stats["running"] == 0 and stats["waiting"] == 0 and used_blocks(stats) == 0:
                    break
                if time.monotonic() > deadline:
                    failures.append(f"not idle {timeout:.0f} s after the load stopped: running {stats['running']}, "
                                    f"waiting {stats['waiting']}, {used_blocks(stats)} KV blocks still used")
                    break
                time.sleep(0.2)
    except LLMServeError as e:
        failures.append(f"the core did not answer at the end: {e}")
    if not stats:
        return {}
    return {"used": used_blocks(stats), "free": stats["total_kv_blocks"] - used_blocks(stats),
            "cached": stats.get("cached_kv_blocks"), "total": stats["total_kv_blocks"],
            "running": stats["running"], "waiting": stats["waiting"],
            "generated_tokens": stats.get("total_generated_tokens"), "steps": stats.get("num_steps")}


def write_json(result: SoakResult, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(asdict(result), f, indent=2, sort_keys=True)
        f.write("\n")
