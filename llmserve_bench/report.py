"""Benchmark output: the summary table, the result JSON and the plot."""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import socket
import subprocess
import sys

from llmserve_bench.metrics import PERCENTILES, latency_samples, throughput_timeline

# (label, key, format) in vLLM's table order; None rows are section titles.
ROWS = [
    (None, "Serving Benchmark Result", None),
    ("Successful requests", "completed", "d"),
    ("Failed requests", "failed", "d"),
    ("Requests finished in window", "window_finished_requests", "d"),
    ("Output tokens in window", "window_output_tokens", "d"),
    ("Benchmark duration (s)", "duration", ".2f"),
    ("Total input tokens", "total_input_tokens", "d"),
    ("Total generated tokens", "total_output_tokens", "d"),
    ("Request throughput (req/s)", "request_throughput", ".2f"),
    ("Request goodput (req/s)", "request_goodput", ".2f"),
    ("Output token throughput (tok/s)", "output_throughput", ".2f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ".2f"),
    ("Max concurrent requests", "max_concurrent_requests", "d"),
]
LATENCY_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                  "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
CORE_ROWS = [
    ("Mean batch size (running)", "core_mean_batch_size", ".2f"),
    ("Max batch size (running)", "core_max_batch_size", "d"),
    ("Mean queue depth (waiting)", "core_mean_queue_depth", ".2f"),
    ("Max queue depth (waiting)", "core_max_queue_depth", "d"),
    ("Mean KV cache usage (%)", "core_mean_kv_usage", "%"),
    ("Max KV cache usage (%)", "core_max_kv_usage", "%"),
    ("Prefix cache hit rate (%)", "core_prefix_hit_rate", "%"),
    ("Generated tokens per engine step", "core_generated_tokens_per_step", ".2f"),
    ("Preemptions", "core_preemptions", "d"),
    ("Kernels JIT-compiled in the core", "core_jit_compilations", "d"),
]
WIDTH = 50


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "%":
        return f"{100.0 * value:.1f}"
    if fmt == "d":
        return str(int(value)) if isinstance(value, (int, float)) else str(value)
    if isinstance(value, float):
        return format(value, fmt)
    return str(value)


def _shown(d: dict, key: str):
    """Latencies of no samples (no requests, or no TPOT/ITL from one-token outputs) print as "-" (the JSON
    keeps vLLM's 0 beside the <name>_samples count)."""
    if key.endswith("_ms") and not latency_samples(d, key):
        return None
    return d.get(key)


def _all_rows(columns: list[dict]) -> list[tuple]:
    rows = list(ROWS)
    for name, title in LATENCY_TITLES.items():
        rows.append((None, title, None))
        rows.append((f"Mean {name.upper()} (ms)", f"mean_{name}_ms", ".2f"))
        rows.append((f"Median {name.upper()} (ms)", f"median_{name}_ms", ".2f"))
        for p in PERCENTILES:
            if p != 50:
                rows.append((f"P{p} {name.upper()} (ms)", f"p{p}_{name}_ms", ".2f"))
    rows.append((None, "Core (stats polled during the run)", None))
    rows.extend(CORE_ROWS)
    spec = sorted({k for c in columns for k in c if k.startswith("core_spec_")})
    rows.extend((k[len("core_"):], k, ".3f") for k in spec)
    return rows


def format_columns(columns: list[tuple[str, dict]]) -> str:
    """A vLLM-style table; several summaries side by side (e.g. steady state | whole run)."""
    dicts = [d for _, d in columns]
    col_w = max(12, *(len(n) + 2 for n, _ in columns))
    total = WIDTH + col_w * (len(columns) - 1)
    lines = []
    for label, key, fmt in _all_rows(dicts):
        if label is None:
            lines.append(f" {key} ".center(total, "=" if not lines else "-"))
            if not lines[:-1] and len(columns) > 1:
                lines.append(" " * (WIDTH - col_w) + "".join(n.rjust(col_w) for n, _ in columns))
            continue
        if all(key not in d for d in dicts):
            continue
        label_w = WIDTH - col_w
        lines.append(f"{label + ':':<{label_w}}" + "".join(_fmt(_shown(d, key), fmt).rjust(col_w) for d in dicts))
    lines.append("=" * total)
    return "\n".join(lines)


def format_groups(summary: dict, title: str) -> str:
    """One line per workload class: how many, and their TTFT / TPOT / ITL / E2E."""
    groups = summary.get("by_group") or {}
    if not groups:
        return ""
    lines = [f" Per class ({title}) ".center(WIDTH, "-")]
    for g, s in groups.items():
        v = lambda key, fmt: _fmt(_shown(s, key), fmt)   # noqa: E731
        lines.append(f"{g}: {s['completed']} requests, TTFT mean {v('mean_ttft_ms', '.1f')} / p99 "
                     f"{v('p99_ttft_ms', '.1f')} ms, TPOT median {v('median_tpot_ms', '.2f')} ms, ITL p99 "
                     f"{v('p99_itl_ms', '.1f')} ms, E2E mean {v('mean_e2el_ms', '.1f')} ms")
    return "\n".join(lines)


def format_table(result) -> str:
    main = _format_main(result)
    groups = format_groups(result.steady_state or result.summary,
                           "steady state" if result.steady_state is not None else "whole run")
    return main + ("\n" + groups if groups else "")


def _format_main(result) -> str:
    if result.steady_state is not None:
        s = result.steady_state
        head = (f"Closed loop: concurrency {result.config.get('max_concurrency')}, measurement window "
                f"{s['window_seconds']:.1f} s: {s['window_output_tokens']} output tokens received in it, "
                f"{s['window_requests']} requests sent in it (their latencies, to their end, are the "
                f"steady-state column); max in flight {result.max_in_flight}.")
        return head + "\n" + format_columns([("steady state", s), ("whole run", result.summary)])
    return format_columns([("", result.summary)])


# ---------------------------------------------------------------- JSON

def environment() -> dict:
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
    }
    for dist in ("llmserve", "torch", "transformers", "msgspec", "pyzmq", "triton"):
        try:
            env[f"{dist}_version"] = importlib.metadata.version(dist)   # read from metadata: no torch import
        except importlib.metadata.PackageNotFoundError:
            env[f"{dist}_version"] = None
    env.update(git_info(os.path.dirname(os.path.abspath(__file__))))
    return env


def git_info(path: str) -> dict:
    try:
        commit = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None}
    return {"git_commit": commit or None, "git_dirty": bool(dirty) if commit else None}


def _r(x):
    return None if x is None else round(x, 6)


def result_dict(result) -> dict:
    t0 = result.t0
    reqs = []
    for r in result.records:
        reqs.append({
            "index": r.index, "group": r.group, "prompt_len": r.prompt_len, "max_tokens": r.max_tokens,
            "output_len": r.output_len, "finish_reason": r.finish_reason, "error": r.error,
            "cached_tokens": r.cached_tokens, "in_flight_at_send": r.in_flight_at_send,
            "sent": _r(r.sent - t0), "done": _r(None if r.done is None else r.done - t0),
            "ttft_ms": _r(None if r.ttft is None else r.ttft * 1e3),
            "tpot_ms": _r(None if r.tpot is None else r.tpot * 1e3),
            "e2el_ms": _r(None if r.e2el is None else r.e2el * 1e3),
            "token_times": [_r(t - t0) for t in r.token_times],
        })
    out = {
        "mode": result.mode,
        "config": result.config,
        "environment": environment(),
        "model_info": result.model_info,
        "summary": result.summary,
        "steady_state": result.steady_state,
        "window": None if result.window is None else {"start": _r(result.window[0] - t0), "end": _r(result.window[1] - t0)},
        "max_in_flight": result.max_in_flight,
        "core_stats": [{"t": _r(t - t0), **s} for t, s in result.stats_samples],
        "requests": reqs,
    }
    return out


def write_json(result, path: str) -> None:
    data = _finite(result_dict(result))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, allow_nan=False)
        f.write("\n")


def _finite(o):
    """NaN/inf (e.g. a rate over a zero duration) become null: strict JSON readers reject them."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


# ---------------------------------------------------------------- plot

def write_plot(result, path: str) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E), output throughput over time, and the core's batch/queue."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or llmserve[bench])") from None
    ok = [r for r in result.records if r.ok]
    series = {"TTFT": [r.ttft for r in ok if r.ttft is not None], "TPOT": [r.tpot for r in ok if r.tpot is not None],
              "ITL": [g for r in ok for g in r.itl], "E2E latency": [r.e2el for r in ok]}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, vals) in zip(axes.flat[:4], series.items()):
        xs = sorted(v * 1e3 for v in vals)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
        ax.set_title(f"{name} CDF ({len(xs)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    ax = axes.flat[4]
    tl = throughput_timeline(result.records, result.t0, 0.5)
    if tl:
        ax.step([t for t, _ in tl], [v for _, v in tl], where="post")
    _shade_window(ax, result)
    ax.set_title("output throughput (tok/s, 0.5 s bins)")
    ax.set_xlabel("s since first request")
    ax.grid(alpha=0.3)
    ax = axes.flat[5]
    ts = [t - result.t0 for t, _ in result.stats_samples]
    for key in ("running", "waiting"):
        ax.step(ts, [s.get(key, 0) for _, s in result.stats_samples], where="post", label=key)
    _shade_window(ax, result)
    ax.set_title("core: running / waiting requests")
    ax.set_xlabel("s since first request")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.suptitle(f"llmserve-bench {result.mode}: {result.model_info.get('name', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _shade_window(ax, result) -> None:
    if result.window is not None:
        ax.axvspan(result.window[0] - result.t0, result.window[1] - result.t0, color="green", alpha=0.1,
                   label="measurement window")
