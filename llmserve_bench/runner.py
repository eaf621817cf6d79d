"""Drive a core with a finite workload or a closed loop, over one AsyncClient, sending token ids and reading
token ids back (no detokenization: the client's own cost stays out of the measurement).

Both modes poll the core's stats() in the background, so the summary can say what the engine saw (batch size,
queue depth, KV usage, prefix hits, speculative acceptance) next to what the client saw.
"""
from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass

from llmserve_client import AsyncClient, EngineDeadError, RequestError
from llmserve_bench.metrics import RequestRecord, by_group, stats_summary, summarize, window_summary
from llmserve_bench.progress import Progress
from llmserve_bench.workload import (RequestSpec, TokenizerInfo, Workload, WorkloadConfig, check_lengths,
                                     length_classes)


@dataclass
class BenchResult:
    mode: str                                   # "run" | "closed-loop"
    config: dict
    model_info: dict
    t0: float                                   # monotonic time the first request was sent
    end: float                                  # monotonic time the last request finished
    records: list[RequestRecord]
    stats_samples: list[tuple[float, dict]]
    summary: dict                               # whole run
    steady_state: dict | None = None            # closed loop: the measurement window only
    window: tuple[float, float] | None = None
    max_in_flight: int = 0

    def table(self) -> str:
        from llmserve_bench.report import format_table
        return format_table(self)


@dataclass
class InFlight:
    now: int = 0
    max: int = 0
    tokens: int = 0
    finished: int = 0


@dataclass
class Sampling:
    ignore_eos: bool = True
    temperature: float = 0.0

    def params(self, max_tokens: int) -> dict:
        return {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos, "temperature": self.temperature}


class BenchError(RuntimeError):
    """The run cannot go on (a probe or closed-loop request was rejected)."""


async def probe(client: AsyncClient, workload: Workload, sampling: Sampling) -> None:
    """One short request before measuring, as vLLM's bench does: it fails fast on a core that rejects the
    workload, and takes a fresh core's first-request costs out of the numbers. Its prompt is fresh random
    tokens (own generator), so it neither shifts the seeded workload nor warms the prefix cache for it. The
    generator's seed is a string: an int seed counts by its absolute value (-1 - seed would be seed + 1, and
    the probe would send the first prompt of the next --seed)."""
    rng = random.Random(f"llmserve-bench probe {workload.cfg.seed}")
    n_in, n_out = length_classes(workload.cfg)[0] if not workload.cfg.dataset else (8, 2)
    ids = rng.choices(workload.allowed, k=n_in)
    try:
        await client.generate(ids, detokenize=False, **sampling.params(min(n_out or 2, 2)))
    except RequestError as e:
        raise BenchError(f"the core rejected a probe request: {e}") from None


async def send_one(client: AsyncClient, spec: RequestSpec, rec: RequestRecord, sampling: Sampling,
                   inflight: InFlight, progress: Progress | None, strict: bool = False) -> None:
    """Send one request and fill `rec`. A rejected request is recorded as failed, or raises BenchError
    when `strict` (a closed loop would otherwise spin on instant failures)."""
    inflight.now += 1
    inflight.max = max(inflight.max, inflight.now)
    rec.in_flight_at_send = inflight.now
    rec.sent = time.monotonic()
    try:
        stream = await client.stream(spec.prompt_token_ids, detokenize=False, **sampling.params(spec.max_tokens))
        async with stream:
            async for chunk in stream:
                inflight.tokens += len(chunk.token_ids)
                if progress is not None:
                    progress.update(tokens=inflight.tokens)
        c = stream.completion
        rec.sent = c.timings.sent
        rec.token_times = list(c.timings.token_times)
        rec.done = c.timings.done
        rec.finish_reason = c.finish_reason
        rec.cached_tokens = c.usage.cached_tokens
    except RequestError as e:
        rec.error = str(e)
        rec.done = None
        if strict:
            raise BenchError(f"request {rec.index} was rejected: {e}") from None
    finally:
        inflight.now -= 1
        inflight.finished += 1
        if progress is not None:
            progress.update(done=inflight.finished)


async def poll_stats(client: AsyncClient, samples: list, interval: float, marks: list[float]) -> None:
    """Sample stats() every `interval` seconds, and right at each monotonic time in `marks` (window edges)."""
    pending = sorted(marks)
    while True:
        try:
            samples.append((time.monotonic(), await client.stats(timeout=max(2.0, interval * 4))))
        except (asyncio.TimeoutError, TimeoutError):
            pass
        except EngineDeadError:
            return
        now = time.monotonic()
        pending = [m for m in pending if m > now]
        wake = min([now + interval] + pending[:1])
        await asyncio.sleep(max(0.0, wake - now))


async def _final_sample(client: AsyncClient, samples: list) -> None:
    try:
        samples.append((time.monotonic(), await client.stats(timeout=5.0)))
    except (asyncio.TimeoutError, TimeoutError, EngineDeadError):
        pass


def make_workload(cfg: WorkloadConfig, info, tokenizer: str | None = None) -> Workload:
    """Build the workload for the served model; ValueError (a config error) when it cannot fit or load."""
    check_lengths(cfg, info.max_model_len)
    path = tokenizer or getattr(info, "tokenizer", None) or info.model
    needs_text = cfg.prompt_mode == "natural" or bool(cfg.dataset)
    tok = None
    if needs_text or os.path.isfile(os.path.join(path, "tokenizer.json")):
        try:
            tok = TokenizerInfo(path)
        except Exception as e:   # noqa: BLE001 - any loader failure is a config problem for the user
            if needs_text:
                raise ValueError(f"--tokenizer: cannot load the model's tokenizer from {path}: {e}") from None
    vocab = min(info.vocab_size, tok.vocab_size) if tok else info.vocab_size
    special = set(info.eos_token_ids) | (tok.special_ids if tok else set())
    return Workload(cfg, vocab_size=vocab, special_ids=special, tokenizer=tok, max_model_len=info.max_model_len)


def _info_dict(info) -> dict:
    return {"model": info.model, "name": info.name, "vocab_size": info.vocab_size,
            "max_model_len": info.max_model_len, "eos_token_ids": list(info.eos_token_ids),
            "speculative": info.speculative, "speculative_model": info.speculative_model,
            "tokenizer": getattr(info, "tokenizer", None)}


async def run_finite(client: AsyncClient, workload: Workload, *, num_requests: int, request_rate: float = float("inf"),
                     burstiness: float = 1.0, max_concurrency: int | None = None, sampling: Sampling | None = None,
                     slo: dict | None = None, stats_interval: float = 0.5, progress: bool = True,
                     config: dict | None = None) -> BenchResult:
    """Send num_requests: all at once (rate inf) or with gamma inter-arrival times of mean 1/rate and shape
    `burstiness` (1: Poisson). max_concurrency caps requests in flight; the rest wait their turn."""
    sampling = sampling or Sampling()
    specs = workload.take(num_requests)
    rng = random.Random(workload.cfg.seed + 1)
    gaps = [0.0] * num_requests
    if request_rate != float("inf"):
        gaps = [rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)) for _ in range(num_requests)]
    records = [RequestRecord(i, len(s.prompt_token_ids), s.max_tokens, group=s.group) for i, s in enumerate(specs)]
    inflight, samples = InFlight(), []
    bar = Progress(total=num_requests, label="run", enabled=progress)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(spec, rec):
        if sem is None:
            return await send_one(client, spec, rec, sampling, inflight, bar)
        async with sem:
            await send_one(client, spec, rec, sampling, inflight, bar)

    poller = asyncio.create_task(poll_stats(client, samples, stats_interval, []))
    await asyncio.sleep(0)
    t0 = time.monotonic()
    tasks = []
    try:
        due = t0
        for spec, rec, gap in zip(specs, records, gaps):
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec, rec)))
            due += gap      # gaps come between requests: a wait before the first would idle inside the duration
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        poller.cancel()
        bar.close()
    await _final_sample(client, samples)
    end = max([r.done for r in records if r.done is not None], default=time.monotonic())
    summary = summarize(records, end - t0, slo)
    summary.update(stats_summary(samples))
    if groups := by_group(records, lambda rs: summarize(rs, end - t0, slo)):
        summary["by_group"] = groups
    return BenchResult("run", config or {}, _info_dict(client.model_info), t0, end, records, samples, summary,
                       max_in_flight=inflight.max)


async def run_closed_loop_async(client: AsyncClient, workload: Workload, *, max_concurrency: int,
                                warmup_seconds: float, measurement_seconds: float, sampling: Sampling | None = None,
                                slo: dict | None = None, stats_interval: float = 0.5, progress: bool = True,
                                config: dict | None = None) -> BenchResult:
    """max_concurrency workers each send a request, wait for it, and send the next at once, until the end of the
    measurement window and then for as long as a request sent before that end is in flight; then the rest
    drain. Steady state = the window (window_summary)."""
    sampling = sampling or Sampling()
    records: list[RequestRecord] = []
    inflight, samples = InFlight(), []
    t0 = time.monotonic()
    t_w = t0 + warmup_seconds
    t_e = t_w + measurement_seconds
    bar = Progress(seconds=warmup_seconds + measurement_seconds, label="closed-loop", enabled=progress)

    # Requests sent before the end of the window and still in flight. Until they have all finished the
    # workers keep sending (requests that are not measured), so the measured ones run at the requested
    # concurrency to their end rather than speeding up as the load drains away.
    pending = 0

    async def worker():
        nonlocal pending
        while (measured := time.monotonic() < t_e) or pending:
            spec = workload.next()
            rec = RequestRecord(len(records), len(spec.prompt_token_ids), spec.max_tokens, group=spec.group)
            records.append(rec)
            pending += measured
            try:
                await send_one(client, spec, rec, sampling, inflight, bar, strict=True)
            finally:
                pending -= measured
            bar.update(note="warmup" if time.monotonic() < t_w else
                       "measuring" if time.monotonic() < t_e else "holding the load" if pending else "draining")

    poller = asyncio.create_task(poll_stats(client, samples, stats_interval, [t_w, t_e]))
    workers = [asyncio.create_task(worker()) for _ in range(max_concurrency)]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:
            w.cancel()
        poller.cancel()
        bar.close()
    await _final_sample(client, samples)
    end = max([r.done for r in records if r.done is not None], default=time.monotonic())
    first = min((r.sent for r in records), default=t0)
    summary = summarize(records, end - first, slo)
    summary.update(stats_summary(samples))
    if groups := by_group(records, lambda rs: summarize(rs, end - first, slo)):
        summary["by_group"] = groups
    steady = window_summary(records, t_w, t_e, slo)
    steady.update(stats_summary(samples, t_w - 1e-3, t_e + stats_interval))
    if groups := by_group(records, lambda rs: window_summary(rs, t_w, t_e, slo)):
        steady["by_group"] = groups
    return BenchResult("closed-loop", config or {}, _info_dict(client.model_info), first, end, records, samples,
                       summary, steady, (t_w, t_e), inflight.max)


def run_closed_loop(endpoint: str, *, max_concurrency: int = 4, warmup_seconds: float = 1.0,
                    measurement_seconds: float = 3.0, input_len: int = 64, output_len: int = 32,
                    prompt_mode: str = "random", seed: int = 0, ignore_eos: bool = True, temperature: float = 0.0,
                    slo: dict | None = None, progress: bool = False, connect_timeout: float = 60.0) -> BenchResult:
    """A short closed-loop benchmark against the core at `endpoint` (blocking); `result.table()` prints it.

        from llmserve_bench import run_closed_loop
        print(run_closed_loop("ipc:///tmp/core.sock", max_concurrency=4).table())
    """
    from llmserve_client import run
    wl = WorkloadConfig(prompt_mode=prompt_mode, input_len=input_len, output_len=output_len, seed=seed)
    config = {"mode": "closed-loop", "endpoint": endpoint, "max_concurrency": max_concurrency,
              "warmup_seconds": warmup_seconds, "measurement_seconds": measurement_seconds,
              "workload": _jsonable(wl), "ignore_eos": ignore_eos, "temperature": temperature, "slo": slo or {}}

    async def main():
        async with AsyncClient(endpoint, connect_timeout=connect_timeout, client_name="llmserve-bench") as client:
            workload = make_workload(wl, client.model_info)
            await probe(client, workload, Sampling(ignore_eos, temperature))
            return await run_closed_loop_async(
                client, workload, max_concurrency=max_concurrency, warmup_seconds=warmup_seconds,
                measurement_seconds=measurement_seconds, sampling=Sampling(ignore_eos, temperature), slo=slo,
                progress=progress, config=config)

    return run(main())


def _jsonable(obj) -> dict:
    import dataclasses
    return dataclasses.asdict(obj)
