"""llmserve-bench: finite and closed-loop serving benchmarks against llmserve-core over its IPC protocol.

Only llmserve_client and llmserve_proto are imported (never torch or the core); a core the bench starts
itself runs as a subprocess. `run_closed_loop(endpoint, ...)` is the short blocking form for scripts:

    from llmserve_bench import run_closed_loop
    result = run_closed_loop("ipc:///path/core.sock", max_concurrency=4, measurement_seconds=3)
    print(result.table())          # result.summary (whole run), result.steady_state (the window)
"""
from llmserve_bench.metrics import RequestRecord, summarize, window_summary
from llmserve_bench.runner import BenchResult, run_closed_loop, run_closed_loop_async, run_finite

__all__ = ["run_closed_loop", "run_closed_loop_async", "run_finite", "BenchResult", "RequestRecord",
           "summarize", "window_summary"]
