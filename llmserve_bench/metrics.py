"""Per-request records and the serving metrics computed from them, named and defined as vLLM's bench does.

- TTFT: first token received - request sent.  E2EL: last output received - request sent.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request with more than one output token.
- ITL: gaps between successive arrivals of new tokens at the client (tokens that arrive in one message,
  e.g. several accepted speculative tokens, form one arrival), pooled over all requests.
- request/output/total token throughput: completed requests, output tokens, prompt + output tokens per
  second of benchmark duration.  Goodput: requests meeting every --slo bound per second.
Each latency gets mean_/median_/std_/pNN_<name>_ms keys (percentiles interpolate linearly, as numpy's), and
<name>_samples: how many values they come from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """One request as the client saw it; times are time.monotonic() seconds."""
    index: int
    prompt_len: int
    max_tokens: int
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)   # client receive time of each output token
    done: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    in_flight_at_send: int = 0      # requests in flight including this one, as it was sent
    group: str = ""                 # workload class ("INPUT:OUTPUT" of its --mix entry) for per-class summaries

    @property
    def ok(self) -> bool:
        return self.error is None and self.done is not None

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def e2el(self) -> float | None:
        return None if self.done is None else self.done - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2 or self.done is None:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)

    @property
    def itl(self) -> list[float]:
        arrivals = sorted(set(self.token_times))
        return [b - a for a, b in zip(arrivals, arrivals[1:])]


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0.0 for no values, as vLLM reports."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: list[float]) -> float:
    if not values:
        return 0.0
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def latency_stats(name: str, seconds: list[float], percentiles=PERCENTILES) -> dict[str, float]:
    """The <name>_samples count says whether the 0s of no samples (kept as vLLM reports them) are measured."""
    ms = [s * 1000.0 for s in seconds]
    out = {f"{name}_samples": len(ms), f"mean_{name}_ms": _mean(ms), f"median_{name}_ms": percentile(ms, 50),
           f"std_{name}_ms": _std(ms)}
    for p in percentiles:
        out[f"p{_pct_label(p)}_{name}_ms"] = percentile(ms, p)
    return out


def latency_samples(d: dict, key: str) -> int:
    """How many values the latency key (e.g. p99_tpot_ms) of a summary comes from; results written before
    the counts existed give their completed requests."""
    return d.get(f"{key.split('_')[1]}_samples", d.get("completed", 0))


def _pct_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def parse_slo(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); ValueError names the bad item."""
    slo: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo: {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--slo: {item!r}: the bound must be a positive number of milliseconds")
        slo[name] = ms
    return slo


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    for name, bound_ms in slo.items():
        value = getattr(r, name)
        if value is not None and value * 1000.0 > bound_ms:
            return False
    return True


def summarize(records: list[RequestRecord], duration: float, slo: dict[str, float] | None = None,
              percentiles=PERCENTILES) -> dict:
    """vLLM-style summary of finished requests over `duration` seconds."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if r.error is not None]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    d = duration if duration > 0 else float("nan")
    s = {
        "duration": duration,
        "completed": len(done),
        "failed": len(failed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "cached_prompt_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / d,
        "output_throughput": total_output / d,
        "total_token_throughput": (total_input + total_output) / d,
        "max_concurrent_requests": max((r.in_flight_at_send for r in records), default=0),
    }
    if slo:
        good = sum(1 for r in done if meets_slo(r, slo))
        s["request_goodput"] = good / d
        s["good_requests"] = good
    s.update(latency_stats("ttft", [r.ttft for r in done if r.ttft is not None], percentiles))
    s.update(latency_stats("tpot", [r.tpot for r in done if r.tpot is not None], percentiles))
    s.update(latency_stats("itl", [g for r in done for g in r.itl], percentiles))
    s.update(latency_stats("e2el", [r.e2el for r in done], percentiles))
    return s


def window_summary(records: list[RequestRecord], start: float, end: float, slo: dict[str, float] | None = None,
                   percentiles=PERCENTILES) -> dict:
    """Steady state of a closed loop between `start` and `end`.

    Throughput counts only what happened inside the window: output tokens received in it, prompt tokens of
    requests whose first token arrived in it (their prefill finished there), requests that finished in it,
    and for goodput those of them that met the SLO. Latencies cover the requests sent inside the window, to
    their end (the closed loop keeps its concurrency until they have finished): requiring them to finish
    inside too would keep out the slowest ones. `window_requests` says how many.
    """
    length = end - start
    inside = lambda t: t is not None and start <= t <= end   # noqa: E731
    out_tokens = sum(1 for r in records if r.ok for t in r.token_times if inside(t))
    prefilled = sum(r.prompt_len for r in records if r.ok and r.token_times and inside(r.token_times[0]))
    finished = [r for r in records if r.ok and inside(r.done)]
    measured = [r for r in records if r.ok and start <= r.sent < end]
    s = summarize(measured, length, None, percentiles)
    s.update({
        "window_seconds": length,
        "window_requests": len(measured),
        "window_output_tokens": out_tokens,
        "window_prefill_tokens": prefilled,
        "window_finished_requests": len(finished),
        "request_throughput": len(finished) / length,
        "output_throughput": out_tokens / length,
        "total_token_throughput": (prefilled + out_tokens) / length,
    })
    if slo:
        s["good_requests"] = sum(1 for r in finished if meets_slo(r, slo))
        s["request_goodput"] = s["good_requests"] / length
    # completed/total_* describe the measured requests the latencies come from.
    return s


def by_group(records: list[RequestRecord], summary) -> dict[str, dict]:
    """`summary(records of one class)` per workload class (e.g. each --mix entry), when there is more than
    one: with a mix of short and long prompts the short requests' ITL/TPOT show what long prefills cost them."""
    groups = sorted({r.group for r in records})
    if len(groups) < 2:
        return {}
    return {g: summary([r for r in records if r.group == g]) for g in groups}


def throughput_timeline(records: list[RequestRecord], t0: float, bin_seconds: float = 1.0) -> list[tuple[float, float]]:
    """(bin start relative to t0, output tokens/s) for each bin from t0 to the last token."""
    times = [t - t0 for r in records for t in r.token_times]
    if not times:
        return []
    n = int(max(times) // bin_seconds) + 1
    counts = [0] * n
    for t in times:
        counts[max(0, int(t // bin_seconds))] += 1
    return [(i * bin_seconds, c / bin_seconds) for i, c in enumerate(counts)]


def stats_summary(samples: list[tuple[float, dict]], start: float | None = None, end: float | None = None) -> dict:
    """Condense the core's stats() samples (time, dict) taken in [start, end] into core_* keys.

    mean/max batch size (running) and queue depth (waiting), mean/max KV usage, the prefix hit rate over the
    span (from the hit/query counters when the core reports them), generated tokens per engine step, the last value
    of every spec_* key (speculative decoding) the core reports, and the acceptance rate and mean acceptance
    length over the span from the spec_* counters when present. spec_num_* and spec_time_* counters are
    reported as their growth over the span; other spec_* values as last reported."""
    sel = [(t, s) for t, s in samples if (start is None or t >= start) and (end is None or t <= end)]
    if not sel:
        return {"core_stats_samples": 0}
    out: dict = {"core_stats_samples": len(sel)}

    def nums(key):
        return [s[key] for _, s in sel if isinstance(s.get(key), (int, float)) and not isinstance(s.get(key), bool)]

    for key, label in (("running", "batch_size"), ("waiting", "queue_depth"), ("kv_usage", "kv_usage")):
        vals = nums(key)
        if vals:
            out[f"core_mean_{label}"] = _mean(vals)
            out[f"core_max_{label}"] = max(vals)
    first, last = sel[0][1], sel[-1][1]
    dq = _delta(first, last, "prefix_queries")
    if dq:
        out["core_prefix_hit_rate"] = _delta(first, last, "prefix_hits") / dq
    elif isinstance(last.get("prefix_hit_rate"), (int, float)):
        out["core_prefix_hit_rate"] = float(last["prefix_hit_rate"])
    steps = _delta(first, last, "num_steps")
    if steps:
        # Generated tokens per engine step: the decode batch size averaged over steps (more than the batch
        # when speculative decoding accepts several tokens per request and step).
        out["core_generated_tokens_per_step"] = _delta(first, last, "total_generated_tokens") / steps
    if isinstance(last.get("num_preemptions"), int):
        out["core_preemptions"] = _delta(first, last, "num_preemptions")
    if isinstance(last.get("jit_compilations"), int):
        # Kernels compiled inside the span: each one stalled the core for seconds.
        out["core_jit_compilations"] = _delta(first, last, "jit_compilations")
    for k, v in last.items():
        if k.startswith(("spec_num_", "spec_time_")):      # counters: what happened inside the span
            out[f"core_{k}"] = _delta(first, last, k)
        elif k.startswith("spec_"):                         # rates since the core started: as last reported
            out[f"core_{k}"] = v
    # Speculative counters (the engine's SpecMetrics fields as spec_*) give the acceptance over this span,
    # which the core's own since-start rates cannot.
    drafted = _delta(first, last, "spec_num_draft_tokens")
    if drafted:
        out["core_spec_acceptance_rate"] = _delta(first, last, "spec_num_accepted_tokens") / drafted
    verified = _delta(first, last, "spec_num_steps")
    if verified:
        out["core_spec_mean_acceptance_length"] = _delta(first, last, "spec_num_emitted_tokens") / verified
    return out


def _delta(a: dict, b: dict, key: str) -> float:
    x, y = a.get(key), b.get(key)
    return (y - x) if isinstance(x, (int, float)) and isinstance(y, (int, float)) else 0
