"""The decoder's projections and the lm_head at 16-64 rows: cuBLAS against kernels.gemv, alone and chained.

On the H200 at the Qwen3-8B shape (bf16). Three parts:
  sweep   every tile of TILES for each projection and row count, GRAPH_CALLS back-to-back calls in one
          CUDA graph over weight copies larger than L2 (gemv_bench.bench), each checked against the
          reference first; the best tile again under PDL (each call then overlaps the one before); cuBLAS
          beside it. The lm_head also as the greedy step runs it: cuBLAS, float32 logits and torch's
          argmax, against gemv_argmax.
  chain   a decoder layer without its attention, LAYERS distinct layers in one graph (add + RMSNorm, qkv,
          o_proj, add + RMSNorm, gate_up, SiLU-and-mul, down): cuBLAS with plain launches (the engine
          before), against gemv with the sweep's best tiles and every kernel under PDL.
Compiles run first, spread over worker processes (the host is slow, and a timed call must not compile).
Prints a table last; --out writes the JSON. The winners go into this card's kernels/configs/gemv/ table
(write_winners): the lm_head's best tile at each row tile, and a projection's where the chain at that row
count ran faster with gemv under PDL than with cuBLAS (elsewhere its entry is removed, and cuBLAS runs it).

    python benchmarks/skinny_gemm_bench.py --out $OUT/skinny.json --configs $OUT/configs
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemv_bench import SHAPES, bench, copy_bandwidth, graph_us  # noqa: E402
from llmserve_core.kernels import tuned  # noqa: E402
from llmserve_core.kernels.gemv import gemv, gemv_argmax, gemv_reference, split_k_tile  # noqa: E402
from pdl_chain_bench import layer_chain  # noqa: E402

ROWS = (16, 32, 64)
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")
LAYERS = 8


def tiles(m: int, n: int, k: int, sms: int) -> list[dict]:
    out = []
    for (bn, warps), bk, stages, per_sm in itertools.product(((64, 4), (128, 4), (128, 8)), (64, 128), (3, 4, 6),
                                                             (2, 4)):
        cfg = split_k_tile(m, n, k, sms, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                           programs_per_sm=per_sm)
        if cfg not in out:
            out.append(cfg)
    return out


def _compile_worker(jobs: list) -> int:
    """Run each (m, n, k, cfg, pdl, argmax) once, so its kernel lands in Triton's on-disk cache."""
    done = 0
    for m, n, k, cfg, pdl, argmax in jobs:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        try:
            (gemv_argmax if argmax else gemv)(x, w, config=dict(cfg), pdl=pdl)
            done += 1
        except Exception as e:      # a tile the compiler rejects: the sweep skips it too
            print(f"  compile skip {cfg}: {type(e).__name__}: {str(e)[:80]}", flush=True)
    torch.cuda.synchronize()
    return done


def precompile(jobs: list, workers: int) -> None:
    t0 = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        done = sum(pool.map(_compile_worker, chunks))
    print(f"precompiled {done}/{len(jobs)} variants in {time.time() - t0:.0f} s", flush=True)


def rel_err(y, ref) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def sweep_part(shapes: list[str]) -> dict:
    dev, dt = "cuda", torch.bfloat16
    out = {}
    for name in shapes:
        n, k = SHAPES[name]
        copies = max(3, -(-256 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = gemv_reference(x.float(), ws[0].float())
            row = {"cublas_us": 1e3 * bench(lambda i: F.linear(x, ws[i]), copies), "tiles": []}
            for cfg in tiles(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count):
                try:
                    err = rel_err(gemv(x, ws[0], config=dict(cfg)), ref)
                    us = 1e3 * bench(lambda i: gemv(x, ws[i], config=dict(cfg)), copies, replays=5)
                except Exception as e:
                    print(f"  skip {name} m={m} {cfg}: {type(e).__name__}", flush=True)
                    continue
                assert err < 1e-2, f"{name} m={m} {cfg}: rel err {err}"
                row["tiles"].append((cfg, us))
            best, row["gemv_us"] = min(row["tiles"], key=lambda t: t[1])
            row["config"] = best
            row["gemv_pdl_us"] = 1e3 * bench(lambda i: gemv(x, ws[i], config=dict(best), pdl=True), copies)
            if name == "lm_head":
                # the greedy step: cuBLAS logits widened to float32 and torch's argmax, against the fused kernel
                want = F.linear(x, ws[0]).float().argmax(-1)
                got = gemv_argmax(x, ws[0], config=dict(best))
                row["argmax_agree"] = (got == want).float().mean().item()
                row["cublas_argmax_us"] = 1e3 * bench(lambda i: F.linear(x, ws[i]).float().argmax(-1), copies)
                row["gemv_argmax_us"] = 1e3 * bench(lambda i: gemv_argmax(x, ws[i], config=dict(best), pdl=True),
                                                    copies)
            for key in ("cublas_us", "gemv_us", "gemv_pdl_us"):
                row[key.replace("_us", "_tb_s")] = n * k * 2 / (row[key] * 1e-6) / 1e12
            out[f"{name}_m{m}"] = row
            print(f"{name:8s} m={m:2d} " + " ".join(f"{a}={b:.4g}" for a, b in row.items() if isinstance(b, float)),
                  best, flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    return out


def chain_part(configs: dict) -> dict:
    """LAYERS decoder layers without attention in one graph, at each row count; microseconds per layer."""
    dev, dt = "cuda", torch.bfloat16
    h = 4096
    layers = []
    for _ in range(LAYERS):
        layers.append({"w": {name: torch.randn(*SHAPES[name], device=dev, dtype=dt) * SHAPES[name][1] ** -0.5
                             for name in PROJECTIONS},
                       "n1": torch.rand(h, device=dev, dtype=dt) + 0.5, "n2": torch.rand(h, device=dev, dtype=dt) + 0.5})
    out = {}
    for m in ROWS:
        hidden0 = torch.randn(m, h, device=dev, dtype=dt)

        def run(kind: str):
            def lin(x, layer, name):
                if kind == "cublas":
                    return F.linear(x, layer["w"][name])
                if kind == "reference":
                    return gemv_reference(x.float(), layer["w"][name].float()).to(dt)
                return gemv(x, layer["w"][name], config=dict(configs[f"{name}_m{m}"]), pdl=kind == "gemv_pdl")

            return layer_chain(hidden0, layers, lin, pdl=kind == "gemv_pdl", reference=kind == "reference")

        ref = run("reference")
        row = {}
        for kind in ("cublas", "gemv", "gemv_pdl"):
            eager = run(kind)
            row[f"{kind}_us_per_layer"], captured = graph_us(lambda: run(kind), LAYERS)
            row[f"{kind}_rel_err"] = rel_err(eager, ref)
            assert row[f"{kind}_rel_err"] < 5e-2, (kind, m, row[f"{kind}_rel_err"])
            assert rel_err(captured, eager) < 1e-3, f"{kind} m={m}: graph replay differs from eager"
        out[f"m{m}"] = row
        print(f"chain m={m}: " + " ".join(f"{a}={b:.4g}" for a, b in row.items()), flush=True)
    return out


def winners(res: dict) -> list[tuple[dict, dict | None]]:
    """The gemv table's entries from a run: the lm_head's best tile at each row tile; a projection's at each
    row tile where the chain ran faster with gemv under PDL than with cuBLAS (else None: its entry removed).
    Projections are decided only where the chain ran."""
    out = []
    for key, row in res["sweep"].items():
        name, m = key.rsplit("_m", 1)
        n, k = SHAPES[name]
        shape = {"N": n, "K": k, "rows": int(m), "dtype": "bf16"}
        if name == "lm_head":
            out.append((shape, row["config"]))
        elif f"m{m}" in res.get("chain", {}):
            chain = res["chain"][f"m{m}"]
            faster = chain["gemv_pdl_us_per_layer"] < chain["cublas_us_per_layer"]
            out.append((shape, row["config"] if faster else None))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="")
    ap.add_argument("--shapes", default=",".join(PROJECTIONS + ("lm_head",)))
    ap.add_argument("--workers", type=int, default=12, help="processes compiling the tiles before any timing")
    ap.add_argument("--configs", default=str(tuned.CONFIG_DIR),
                    help="merge the winners into this card's gemv table under this folder (default: the tree's)")
    args = ap.parse_args()
    torch.manual_seed(0)
    shapes = args.shapes.split(",")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    jobs = []
    for name in shapes:
        n, k = SHAPES[name]
        for m in ROWS:
            for cfg in tiles(m, n, k, sms):
                jobs += [(m, n, k, cfg, False, False), (m, n, k, cfg, True, False)]
                if name == "lm_head":
                    jobs.append((m, n, k, cfg, True, True))
    precompile(jobs, args.workers)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    res = {"commit": args.commit, "copy_bandwidth_tb_s": bw / 1e12, "device": torch.cuda.get_device_name()}
    res["sweep"] = sweep_part(shapes)
    configs = {key: r["config"] for key, r in res["sweep"].items()}
    if all(f"{p}_m{m}" in configs for p in PROJECTIONS for m in ROWS):
        res["chain"] = chain_part(configs)
    print("\n| shape | rows | cuBLAS TB/s | gemv best tile | gemv + PDL | best tile |")
    print("|---|---|---|---|---|---|")
    for key, r in res["sweep"].items():
        name, m = key.rsplit("_m", 1)
        c = r["config"]
        print(f"| {name} | {m} | {r['cublas_tb_s']:.2f} | {r['gemv_tb_s']:.2f} | {r['gemv_pdl_tb_s']:.2f} | "
              f"{c['BLOCK_N']}x{c['BLOCK_K']} split {c['SPLIT_K']} w{c['num_warps']} s{c['num_stages']} |")
    for key, r in res["sweep"].items():
        if "gemv_argmax_us" in r:
            print(f"{key} greedy: cuBLAS+argmax {r['cublas_argmax_us']:.1f} us, gemv_argmax {r['gemv_argmax_us']:.1f} us, "
                  f"agree {r['argmax_agree']:.3f}")
    if "chain" in res:
        print("\n| rows | cuBLAS us/layer | gemv | gemv + PDL |")
        print("|---|---|---|---|")
        for key, r in res["chain"].items():
            print(f"| {key[1:]} | {r['cublas_us_per_layer']:.1f} | {r['gemv_us_per_layer']:.1f} | "
                  f"{r['gemv_pdl_us_per_layer']:.1f} |")
    source = f"benchmarks/skinny_gemm_bench.py ({Path(args.out).name if args.out else 'no result file'})"
    res["table"] = str(tuned.write_configs("gemv", res["device"], winners(res), source, Path(args.configs)))
    print(f"gemv table: {res['table']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
