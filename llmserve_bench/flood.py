"""`llmserve-bench flood`: what one client's flood costs another client, and what fair shares cost the flood.

Two connections to one core. The flooder keeps --flood-concurrency requests of --input-len / --output-len
tokens in flight (a closed loop: as one ends, the next is sent), far more than the engine's running slots,
so it always has a queue. The prober sends one short request every 1 / --probe-rate seconds. Three phases
of --phase-seconds each, the core idle between them:
  1. probe alone:   the prober's time to first token on an otherwise idle engine;
  2. flood alone:   the flooder's output throughput;
  3. flood + probe: both at once.
The table puts the prober's TTFT under the flood beside its TTFT alone, and the flood's throughput beside
its throughput alone (the ratio is what the probes, and the fairness preemptions they cause, cost it). The
flood's throughput counts its tokens received inside the phase; at the phase's end the probes still in
flight are awaited and then every flood request is aborted.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass, field

from llmserve_client import AsyncClient, RequestError
from llmserve_bench.metrics import latency_stats
from llmserve_bench.runner import make_workload
from llmserve_bench.workload import WorkloadConfig

PHASES = ("probe_alone", "flood_alone", "flood_and_probe")
CORE_COUNTERS = ("num_steps", "num_preemptions", "num_fairness_preemptions", "total_generated_tokens")
PROBE_GRACE_S = 60.0         # how long probes in flight at a phase's end may still take


@dataclass
class FloodConfig:
    flood_concurrency: int = 1024
    input_len: int = 512
    output_len: int = 400
    probe_rate: float = 1.0
    probe_input_len: int = 32
    probe_output_len: int = 8
    phase_seconds: float = 40.0
    seed: int = 0


@dataclass
class Phase:
    name: str
    start: float = 0.0
    end: float = 0.0
    flood_token_times: list[float] = field(default_factory=list)
    flood_done: int = 0
    flood_rejected: int = 0
    probe_ttfts: list[float] = field(default_factory=list)
    probe_failed: int = 0
    core: dict = field(default_factory=dict)

    def summary(self) -> dict:
        inside = sum(1 for t in self.flood_token_times if t <= self.end)
        seconds = self.end - self.start
        out = {"seconds": round(seconds, 3), "probes": len(self.probe_ttfts), "probes_failed": self.probe_failed,
               **latency_stats("ttft", self.probe_ttfts), "flood_output_tokens": inside,
               "flood_output_throughput": inside / seconds if seconds > 0 else 0.0,
               "flood_requests_done": self.flood_done, "flood_rejected": self.flood_rejected}
        out.update({f"core_{k}": v for k, v in self.core.items()})
        return out


async def run_flood(endpoint: str, cfg: FloodConfig, connect_timeout: float = 60.0, tokenizer: str | None = None,
                    log=print) -> dict:
    """The three phases against the core at `endpoint`; returns {"config", "model_info", "phases", "summary"}."""
    async with AsyncClient(endpoint, connect_timeout=connect_timeout, client_name="llmserve-bench flood") as flooder, \
            AsyncClient(endpoint, connect_timeout=connect_timeout, client_name="llmserve-bench probe") as prober:
        info = flooder.model_info
        flood_wl = make_workload(WorkloadConfig(input_len=cfg.input_len, output_len=cfg.output_len, seed=cfg.seed),
                                 info, tokenizer)
        probe_wl = make_workload(WorkloadConfig(input_len=cfg.probe_input_len, output_len=cfg.probe_output_len,
                                                seed=cfg.seed + 1), info, tokenizer)
        # One request first: a fresh core's first-request costs stay out of the numbers.
        await prober.generate(probe_wl.next().prompt_token_ids, detokenize=False, max_tokens=2, ignore_eos=True)
        phases = []
        for name in PHASES:
            phase = Phase(name)
            await _run_phase(phase, cfg, flooder if "flood" in name else None, flood_wl,
                             prober if "probe" in name else None, probe_wl)
            log(f"llmserve-bench flood: {name}: {_one_line(phase.summary())}")
            phases.append(phase)
    by_name = {p.name: p.summary() for p in phases}
    return {"config": asdict(cfg), "model_info": {"model": info.model, "max_model_len": info.max_model_len},
            "phases": by_name, "summary": _summary(by_name),
            "probe_ttfts_s": {p.name: p.probe_ttfts for p in phases if p.probe_ttfts}}


async def _run_phase(phase: Phase, cfg: FloodConfig, flooder, flood_wl, prober, probe_wl) -> None:
    stats_client = flooder or prober
    before = await stats_client.stats()
    phase.start = time.monotonic()
    phase.end = phase.start + cfg.phase_seconds
    flood = [asyncio.ensure_future(_flood_worker(flooder, flood_wl, phase)) for _ in range(cfg.flood_concurrency)] \
        if flooder is not None else []
    probes: list[asyncio.Future] = []
    if prober is not None:
        rng = random.Random(cfg.seed)
        at = phase.start + rng.random() / cfg.probe_rate      # not in step with anything the flood does
        while at < phase.end:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            probes.append(asyncio.ensure_future(_probe(prober, probe_wl.next(), phase)))
            at += 1.0 / cfg.probe_rate
    await asyncio.sleep(max(0.0, phase.end - time.monotonic()))
    if probes:
        await asyncio.wait(probes, timeout=PROBE_GRACE_S)
    for task in flood + probes:
        task.cancel()                   # closing a stream aborts its request in the core
    await asyncio.gather(*flood, *probes, return_exceptions=True)
    after = await _idle_stats(stats_client)
    phase.core = {k: after.get(k, 0) - before.get(k, 0) for k in CORE_COUNTERS}


async def _flood_worker(client: AsyncClient, workload, phase: Phase) -> None:
    while True:
        spec = workload.next()
        try:
            stream = await client.stream(spec.prompt_token_ids, detokenize=False, max_tokens=spec.max_tokens,
                                         ignore_eos=True, temperature=0.0)
            async with stream:
                async for chunk in stream:
                    if chunk.token_ids:
                        now = time.monotonic()
                        phase.flood_token_times.extend([now] * len(chunk.token_ids))
            phase.flood_done += 1
        except RequestError:            # e.g. the core's queue cap: a flooder tries again
            phase.flood_rejected += 1
            await asyncio.sleep(0.05)


async def _probe(client: AsyncClient, spec, phase: Phase) -> None:
    try:
        c = await client.generate(spec.prompt_token_ids, detokenize=False, max_tokens=spec.max_tokens,
                                  ignore_eos=True, temperature=0.0)
        if c.timings.ttft is None:
            phase.probe_failed += 1
        else:
            phase.probe_ttfts.append(c.timings.ttft)
    except RequestError:
        phase.probe_failed += 1


async def _idle_stats(client: AsyncClient, timeout: float = 120.0) -> dict:
    """The core's stats once the aborted requests are gone (the next phase starts on an idle engine)."""
    deadline = time.monotonic() + timeout
    while True:
        s = await client.stats()
        if (s.get("running", 0) == 0 and s.get("waiting", 0) == 0) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.1)


def _summary(p: dict) -> dict:
    alone, flood, both = p["probe_alone"], p["flood_alone"], p["flood_and_probe"]
    return {"probe_p50_ttft_ms_alone": alone["median_ttft_ms"], "probe_p99_ttft_ms_alone": alone["p99_ttft_ms"],
            "probe_p50_ttft_ms_flood": both["median_ttft_ms"], "probe_p99_ttft_ms_flood": both["p99_ttft_ms"],
            "flood_output_throughput_alone": flood["flood_output_throughput"],
            "flood_output_throughput_with_probe": both["flood_output_throughput"],
            "flood_throughput_ratio": (both["flood_output_throughput"] / flood["flood_output_throughput"]
                                       if flood["flood_output_throughput"] else None),
            "fairness_preemptions_with_probe": both.get("core_num_fairness_preemptions", 0)}


def _one_line(s: dict) -> str:
    return (f"{s['probes']} probes, TTFT p50 {s['median_ttft_ms']:.0f} ms p99 {s['p99_ttft_ms']:.0f} ms; "
            f"flood {s['flood_output_throughput']:.0f} tok/s; fairness preemptions "
            f"{s.get('core_num_fairness_preemptions', 0)}")


def format_table(result: dict) -> str:
    p = result["phases"]
    rows = [("phase", "probes", "probe TTFT p50 ms", "probe TTFT p99 ms", "flood out tok/s", "fair preempt")]
    for name in PHASES:
        s = p[name]
        probed = s["probes"] > 0
        rows.append((name.replace("_", " "), str(s["probes"]) if probed else "-",
                     f"{s['median_ttft_ms']:.1f}" if probed else "-", f"{s['p99_ttft_ms']:.1f}" if probed else "-",
                     f"{s['flood_output_throughput']:.0f}" if "flood" in name else "-",
                     str(s.get("core_num_fairness_preemptions", 0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    sm = result["summary"]
    ratio = sm["flood_throughput_ratio"]
    lines.append(f"flood throughput with the probe / alone: {ratio:.3f}" if ratio is not None else
                 "flood throughput: none measured")
    if p["flood_and_probe"]["probes"] < 100:
        lines.append(f"(p99 of {p['flood_and_probe']['probes']} probes: about their maximum)")
    return "\n".join(lines)
