"""`llmserve-bench compare A.json B.json`: the main metrics of two results side by side, with B/A ratios.

Closed-loop results are compared on their steady state (the measurement window) when both have one."""
from __future__ import annotations

import json

from llmserve_bench.metrics import latency_samples

MAIN_METRICS = [
    ("request_throughput", "req/s", "higher"),
    ("output_throughput", "tok/s", "higher"),
    ("total_token_throughput", "tok/s", "higher"),
    ("request_goodput", "req/s", "higher"),
    ("mean_ttft_ms", "ms", "lower"), ("median_ttft_ms", "ms", "lower"), ("p99_ttft_ms", "ms", "lower"),
    ("mean_tpot_ms", "ms", "lower"), ("median_tpot_ms", "ms", "lower"), ("p99_tpot_ms", "ms", "lower"),
    ("mean_itl_ms", "ms", "lower"), ("median_itl_ms", "ms", "lower"), ("p99_itl_ms", "ms", "lower"),
    ("mean_e2el_ms", "ms", "lower"), ("median_e2el_ms", "ms", "lower"), ("p99_e2el_ms", "ms", "lower"),
    ("core_mean_batch_size", "", "higher"),
    ("core_prefix_hit_rate", "", "higher"),
]


def load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("summary"), dict):
        raise ValueError(f"{path}: not an llmserve-bench result (no summary)")
    return data


def pick(a: dict, b: dict) -> tuple[dict, dict, str]:
    if a.get("steady_state") and b.get("steady_state"):
        return a["steady_state"], b["steady_state"], "steady state"
    return a["summary"], b["summary"], "whole run"


def compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> tuple[list[dict], str]:
    """Rows {metric, a, b, ratio, better} and the printable table."""
    sa, sb, scope = pick(a, b)
    rows = []
    for key, unit, direction in MAIN_METRICS:
        va, vb = sa.get(key), sb.get(key)
        if not isinstance(va, (int, float)) or not isinstance(vb, (int, float)):
            continue
        if key.endswith("_ms") and not (latency_samples(sa, key) and latency_samples(sb, key)):
            continue    # a 0 that measured nothing would win as the lower latency
        ratio = vb / va if va else None
        better = None
        if ratio is not None and ratio != 1.0:
            better = name_b if (ratio > 1.0) == (direction == "higher") else name_a
        rows.append({"metric": key, "unit": unit, "a": va, "b": vb, "ratio": ratio, "better": better})
    w = max([len(r["metric"]) for r in rows] + [20])
    lines = [f"comparing {scope}: A = {name_a}, B = {name_b}",
             f"{'metric':<{w}} {'A':>12} {'B':>12} {'B/A':>8}  better"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"{r['metric']:<{w}} {r['a']:>12.3f} {r['b']:>12.3f} {ratio:>8}  {r['better'] or ''}")
    return rows, "\n".join(lines)
