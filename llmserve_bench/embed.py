"""`llmserve-bench embed`: embedding and rerank throughput over IPC, documents/s and tokens/s, at given
document lengths and batch sizes (documents per call).

Each point sends calls of `batch` documents, `concurrency` calls in flight, until `num_documents` are done:
a call is one AsyncClient.pool() (one pooling request per document, all in flight at once), its documents
fresh random token ids of exactly `length` tokens (no special tokens, so no two share a cached block; a
rerank pair is scored on its "yes" and "no" logits when the tokenizer has them, else on two random ids:
the cost is the same). One untimed call per task and length first takes kernel compiles out of the
numbers. Only llmserve_client is imported; a core the bench starts runs as a subprocess.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

from llmserve_client import AsyncClient, RequestError
from llmserve_proto import PoolingParams
from llmserve_bench.metrics import percentile
from llmserve_bench.runner import BenchError

TASKS = ("embed", "rerank")
WIDTH = 96


class EmbedBenchError(BenchError):
    """The run cannot go on: the core refused the workload."""


@dataclass
class EmbedConfig:
    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = (512,)
    batch_sizes: tuple[int, ...] = (1, 32)
    num_documents: int = 256
    concurrency: int = 1
    dimensions: int | None = None
    seed: int = 0


@dataclass
class Point:
    task: str
    length: int
    batch_size: int
    documents: int
    tokens: int
    cached_tokens: int
    duration_s: float
    docs_per_s: float
    tokens_per_s: float
    mean_call_ms: float
    p50_call_ms: float
    p99_call_ms: float


async def run_embed_bench(client: AsyncClient, cfg: EmbedConfig, progress=None) -> list[Point]:
    await client.connect()
    info = client.model_info
    served = info.tasks or ["generate"]
    limit = client.max_request_tokens or info.max_model_len
    for length in cfg.lengths:
        if length > limit:
            raise EmbedBenchError(f"--lengths: {length} tokens do not fit this core's {limit}")
    rng = random.Random(f"llmserve-bench embed {cfg.seed}")
    allowed = [t for t in range(info.vocab_size) if t not in set(info.eos_token_ids)]
    labels = await _labels(client, rng, allowed)
    points = []
    for task in cfg.tasks:
        need = "embed" if task == "embed" else "score"
        if need not in served:
            raise EmbedBenchError(f"--tasks: the core does not serve {need!r} requests (it serves {', '.join(served)})")
        params = (PoolingParams(task="embed", dimensions=cfg.dimensions) if task == "embed"
                  else PoolingParams(task="score", token_ids=labels))
        for length in cfg.lengths:
            await _call(client, [rng.choices(allowed, k=length)], params)          # untimed: compiles
            for batch in cfg.batch_sizes:
                points.append(await _point(client, cfg, task, length, batch, params, rng, allowed))
                if progress is not None:
                    progress(points[-1])
    return points


async def _labels(client: AsyncClient, rng: random.Random, allowed: list[int]) -> list[int]:
    try:
        from llmserve_client.pooling import yes_no_ids
        return yes_no_ids(await client.get_tokenizer())
    except Exception:          # noqa: BLE001 - no tokenizer, or no "yes"/"no" in it: any two ids cost the same
        return rng.sample(allowed, 2)


async def _call(client: AsyncClient, prompts, params) -> list:
    try:
        return await client.pool(prompts, params)
    except RequestError as e:
        raise EmbedBenchError(f"the core refused a request: {e}") from None


async def _point(client, cfg: EmbedConfig, task: str, length: int, batch: int, params, rng, allowed) -> Point:
    calls = -(-cfg.num_documents // batch)
    queue = [[rng.choices(allowed, k=length) for _ in range(batch)] for _ in range(calls)]
    latencies: list[float] = []
    cached = 0

    async def worker():
        nonlocal cached
        while queue:
            prompts = queue.pop()
            t0 = time.perf_counter()
            outs = await _call(client, prompts, params)
            latencies.append(time.perf_counter() - t0)
            cached += sum(o.metrics.num_cached_tokens for o in outs if o.metrics is not None)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, calls))))
    duration = time.perf_counter() - start
    docs = calls * batch
    ms = sorted(x * 1e3 for x in latencies)
    return Point(task, length, batch, docs, docs * length, cached, duration, docs / duration, docs * length / duration,
                 sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 99))


COLUMNS = [("task", "task", "s"), ("length", "length", "d"), ("batch", "batch_size", "d"), ("docs", "documents", "d"),
           ("seconds", "duration_s", ".2f"), ("docs/s", "docs_per_s", ".1f"), ("tokens/s", "tokens_per_s", ".0f"),
           ("call ms mean", "mean_call_ms", ".1f"), ("p50", "p50_call_ms", ".1f"), ("p99", "p99_call_ms", ".1f")]


def format_points(points: list[Point], model: str = "") -> str:
    """The table: one row per (task, length, batch size), in llmserve-bench's framed style."""
    head = " Embedding / Rerank Benchmark Result ".center(WIDTH, "=")
    widths = [max(len(title), 8) for title, _, _ in COLUMNS]
    lines = [head] + ([f"model: {model}"] if model else [])
    lines.append("  ".join(t.rjust(w) for (t, _, _), w in zip(COLUMNS, widths)))
    lines.append("-" * WIDTH)
    for p in points:
        d = asdict(p)
        lines.append("  ".join(format(d[key], fmt).rjust(w) for (_, key, fmt), w in zip(COLUMNS, widths)))
    cached = sum(p.cached_tokens for p in points)
    if cached:
        lines.append(f"note: the prefix cache served {cached} prompt tokens (the core saw these documents before?)")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def result_dict(points: list[Point], config: dict, model_info) -> dict:
    from llmserve_bench.report import environment
    return {"mode": "embed", "config": config, "environment": environment(),
            "model_info": {"model": model_info.model, "runner": model_info.runner, "tasks": list(model_info.tasks),
                           "hidden_size": model_info.hidden_size, "max_model_len": model_info.max_model_len},
            "points": [asdict(p) for p in points]}


# ---- the command -----------------------------------------------------------------------------------------

def embed_main(parser, args, core_args: list[str]) -> int:
    """`llmserve-bench embed`: exit 0 done, 1 the run failed, 2 bad arguments, 130 interrupted."""
    from llmserve_bench.cli import _run_with_core, check_core_and_output
    check_core_and_output(parser, args, core_args)
    timeout = args.connect_timeout or (300.0 if args.model else 60.0)
    cfg = EmbedConfig(tasks=args.tasks or (), lengths=args.lengths, batch_sizes=args.batch_sizes,
                      num_documents=args.num_documents, concurrency=args.concurrency, dimensions=args.dimensions,
                      seed=args.seed)
    code, result = _run_with_core(args, core_args, timeout, (),
                                  lambda endpoint: _bench(endpoint, timeout, cfg, not args.no_progress))
    if code is not None:
        return code
    points, info = result
    print(format_points(points, info.name or info.model))
    if args.result_json:
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(result_dict(points, {**vars(args), "core_args": core_args}, info), f, indent=1)
            f.write("\n")
        print(f"llmserve-bench: results written to {args.result_json}", file=sys.stderr)
    return 0


async def _bench(endpoint: str, timeout: float, cfg: EmbedConfig, progress: bool):
    async with AsyncClient(endpoint, connect_timeout=timeout, client_name="llmserve-bench embed") as client:
        if not cfg.tasks:
            served = client.model_info.tasks or []
            cfg.tasks = tuple(t for t in TASKS if ("embed" if t == "embed" else "score") in served)
            if not cfg.tasks:
                raise EmbedBenchError("the core serves no pooling requests (an older core?)")
        report = (lambda p: print(f"llmserve-bench embed: {p.task} length {p.length} batch {p.batch_size}: "
                                  f"{p.docs_per_s:.1f} docs/s, {p.tokens_per_s:.0f} tokens/s", file=sys.stderr))
        return await run_embed_bench(client, cfg, report if progress else None), client.model_info
