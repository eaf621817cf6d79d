"""Prometheus text exposition (format 0.0.4) of the frontend's counters and the core's gauges.

Kept in-house rather than pulling prometheus_client in: a few counters and two histograms, rendered on
scrape. Names follow Prometheus conventions (unit suffixes, _total on counters) with vLLM's meanings.
"""
from __future__ import annotations

import bisect
from collections import defaultdict

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
               240.0, 480.0, 960.0)

# The core's stats keys exposed as gauges: stats key -> (metric name, help).
CORE_GAUGES = {
    "running": ("llmserve_num_requests_running", "Requests in the engine's running batch."),
    "waiting": ("llmserve_num_requests_waiting", "Requests queued in the engine."),
    "kv_usage": ("llmserve_kv_cache_usage_ratio", "Share of KV cache blocks in use (0..1)."),
    "prefix_hit_rate": ("llmserve_prefix_cache_hit_rate", "Share of prompt tokens served from the prefix cache."),
    "free_kv_blocks": ("llmserve_kv_cache_free_blocks", "Empty KV cache blocks (neither used nor cached)."),
    "cached_kv_blocks": ("llmserve_kv_cache_cached_blocks", "Unused KV cache blocks holding a cached prefix (evictable)."),
    "used_kv_blocks": ("llmserve_kv_cache_used_blocks", "KV cache blocks held by requests."),
    "total_kv_blocks": ("llmserve_kv_cache_total_blocks", "KV cache blocks in the pool."),
    "num_preemptions": ("llmserve_num_preemptions", "Requests preempted since the core started."),
}


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)     # last: above the largest bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.requests = defaultdict(int)          # finish_reason -> count
        self.errors = defaultdict(int)            # HTTP status -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def on_finished(self, completion) -> None:
        """Account a request the core finished (any finish reason, including a client's abort)."""
        self.requests[completion.finish_reason or "abort"] += 1
        self.prompt_tokens += completion.usage.prompt_tokens
        self.generation_tokens += completion.usage.completion_tokens
        t = completion.timings
        if t.ttft is not None:
            self.ttft.observe(t.ttft)
        if t.e2e is not None:
            self.e2e.observe(t.e2e)

    def on_error(self, status: int) -> None:
        self.errors[status] += 1

    def render(self, core_stats: dict | None) -> str:
        lines: list[str] = []
        base = f'model_name="{_escape(self.model_name)}"'

        def head(name, kind, help_):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")

        head("llmserve_requests_total", "counter", "Finished requests by finish reason.")
        for reason in sorted(set(self.requests) | {"stop", "length", "abort"}):
            lines.append(f'llmserve_requests_total{{{base},finish_reason="{reason}"}} {self.requests[reason]}')
        head("llmserve_request_errors_total", "counter", "Requests answered with an error, by HTTP status.")
        for status in sorted(self.errors):
            lines.append(f'llmserve_request_errors_total{{{base},status="{status}"}} {self.errors[status]}')
        head("llmserve_prompt_tokens_total", "counter", "Prompt tokens of finished requests.")
        lines.append(f"llmserve_prompt_tokens_total{{{base}}} {self.prompt_tokens}")
        head("llmserve_generation_tokens_total", "counter", "Generated tokens of finished requests.")
        lines.append(f"llmserve_generation_tokens_total{{{base}}} {self.generation_tokens}")
        for name, hist, help_ in (
                ("llmserve_time_to_first_token_seconds", self.ttft, "Time from request to first token."),
                ("llmserve_e2e_request_latency_seconds", self.e2e, "Time from request to its last token.")):
            head(name, "histogram", help_)
            cumulative = 0
            for bound, n in zip(hist.buckets, hist.counts):
                cumulative += n
                lines.append(f'{name}_bucket{{{base},le="{bound}"}} {cumulative}')
            lines.append(f'{name}_bucket{{{base},le="+Inf"}} {hist.count}')
            lines.append(f"{name}_sum{{{base}}} {hist.sum!r}")
            lines.append(f"{name}_count{{{base}}} {hist.count}")
        # Over several cores the unlabelled series are the totals and each core adds its own, labelled
        # core="ENDPOINT" (so sum only one kind).
        per_core = (core_stats or {}).get("cores", [])
        head("llmserve_core_up", "gauge", "1 while a core answers, 0 once it is gone.")
        lines.append(f"llmserve_core_up{{{base}}} {0 if core_stats is None else 1}")
        for c in per_core:
            lines.append(f'llmserve_core_up{{{base},core="{_escape(c["endpoint"])}"}} {int(c["up"])}')
        if per_core:
            head("llmserve_core_requests_in_flight", "gauge", "Requests this frontend has in flight on each core.")
            for c in per_core:
                lines.append(f'llmserve_core_requests_in_flight{{{base},core="{_escape(c["endpoint"])}"}} '
                             f'{c["in_flight"]}')
            head("llmserve_core_requests_routed_total", "counter", "Requests this frontend sent to each core.")
            for c in per_core:
                lines.append(f'llmserve_core_requests_routed_total{{{base},core="{_escape(c["endpoint"])}"}} '
                             f'{c["routed"]}')
        for key, (name, help_) in CORE_GAUGES.items():
            value = (core_stats or {}).get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                head(name, "gauge", help_)
                lines.append(f"{name}{{{base}}} {float(value)!r}")
                for c in per_core:
                    v = c.get(key)
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        lines.append(f'{name}{{{base},core="{_escape(c["endpoint"])}"}} {float(v)!r}')
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
