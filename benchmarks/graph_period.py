"""How close a decode step comes to its kernels replayed back to back: Engine.step()'s median wall time at
batch 1 (Qwen3-8B shape, dummy weights), against the same device work looped with no host work between
(the decode graph alone; then with the lm_head's greedy argmax; then its copy to the host; then the
placeholder fill before the graph, as a step runs them). A step whose time matches the last loop loses
nothing to the host; what the loops add to the graph alone is the device's own cost of each boundary.

    python benchmarks/graph_period.py [--quantization fp8] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_8b import write_qwen3_8b_dir  # noqa: E402


def period_ms(fn, n: int = 200) -> float:
    """Mean device period of fn() called n times back to back."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


@torch.inference_mode()
def main() -> None:
    from llmserve_core import Engine, EngineConfig
    from llmserve_proto import SamplingParams
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=write_qwen3_8b_dir(tempfile.mkdtemp()), load_format="dummy",
                                 max_model_len=2048, max_num_seqs=1, gpu_memory_utilization=0.85, warmup=False,
                                 quantization=args.quantization))
    engine.add_request("r", [1000 + j for j in range(512)],
                       SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0.0))
    for _ in range(20):          # the prefill, then steady decoding
        engine.step()
    times = []
    for _ in range(100):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    graphs, model = engine.runner.graphs, engine.runner.model
    ids = graphs.input_ids[:1]
    res = {"quantization": args.quantization, "engine_step_ms": statistics.median(times),
           "graph_ms": period_ms(lambda: graphs.replay(1)),
           "graph_argmax_ms": period_ms(lambda: model.greedy_tokens(graphs.replay(1)[0])),
           "graph_argmax_copy_ms": period_ms(
               lambda: model.greedy_tokens(graphs.replay(1)[0]).to("cpu", non_blocking=True)),
           # extra[0] and extra[1] hold the last load's placeholder row and its source row.
           "fill_graph_argmax_ms": period_ms(lambda: ids.index_copy_(
               0, graphs.extra[:1], model.greedy_tokens(graphs.replay(1)[0])[graphs.extra[1:2]]))}
    for key, value in res.items():
        print(f"[{args.quantization or 'bf16'}] {key}: {value if isinstance(value, str) or value is None else round(value, 3)}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
