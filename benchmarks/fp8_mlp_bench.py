"""The fused FP8 MLP (kernels/fp8_mlp.py) against the three-launch chain it replaces, in one GPU run.

  1. the MLP alone at the Qwen3-8B shape (gate_up 24576 x 4096, down 4096 x 12288), 1, 2 and 4 rows, per-channel
     and 128 x 128 block scales: the chain as the engine runs it (Fp8Linear's GEMV table, SiLU-and-mul, all under
     PDL) against fused tiles, each checked against its torch reference, then timed in a CUDA graph of back-to-back
     calls over weight copies larger than L2; TB/s of FP8 weight;
  2. the whole batch-1 decode step (Engine.step(), host work included, FP8 weights quantized at load, 512
     context), the fused MLP off and on, alternating on one engine (its decode graphs recaptured at each switch).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/fp8_mlp_bench.py --out $OUT/fp8_mlp.json   # H200, ~3 min
    python3 benchmarks/fp8_mlp_bench.py --smoke --out /tmp/fp8_mlp.json                     # CPU interpreter
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

if "--smoke" in sys.argv[1:]:     # a smoke run is the CPU interpreter's, on a machine with a GPU too
    os.environ["TRITON_INTERPRET"] = "1"
import llmserve_core.kernels  # noqa: E402,F401  (the interpreter on CPU for --smoke)
from llmserve_core.kernels import fp8_mlp as fp8_mlp_module  # noqa: E402
from llmserve_core.kernels.fp8_format import dequantize_weight, quantize_per_block, quantize_per_channel  # noqa: E402
from llmserve_core.kernels.fp8_mlp import fp8_mlp, fp8_mlp_reference, fp8_mlp_supported  # noqa: E402
from llmserve_core.kernels.silu_mul import silu_mul  # noqa: E402
from llmserve_core.layers.fp8_linear import Fp8Linear  # noqa: E402

HIDDEN, INTER = 4096, 12288
SMOKE_HIDDEN, SMOKE_INTER = 64, 128
ROTATE_BYTES = 320 << 20     # weight bytes per timed replay: several times the H200's 60 MB L2
# (BLOCK_I, BLOCK_K, BLOCK_H, MERGE_P, ARRIVE, num_warps, num_stages, ATOMIC): the deterministic per-chunk merge
# with different slices, chunk widths and counter round trips (ARRIVE chunks at once), and float32 atomic sums
CANDIDATES = ((128, 128, 128, 32, 8, 8, 3, False), (128, 128, 128, 32, 32, 8, 3, False),
              (128, 128, 128, 32, 1, 8, 3, False), (128, 128, 128, 32, 8, 8, 4, False),
              (128, 128, 128, 32, 8, 4, 3, False), (64, 128, 128, 64, 8, 4, 3, False),
              (64, 128, 128, 64, 8, 4, 4, False), (32, 128, 128, 128, 8, 4, 4, False),
              (128, 128, 256, 32, 4, 8, 3, False), (64, 128, 512, 64, 8, 4, 3, False),
              (128, 128, 128, 32, 8, 8, 3, True), (64, 128, 128, 64, 8, 4, 3, True), (128, 128, 256, 32, 4, 8, 3, True))
SMOKE_CANDIDATES = ((32, 32, 32, 2, 1, 4, 1, False), (32, 32, 32, 2, 2, 4, 1, False), (32, 32, 32, 2, 1, 4, 1, True))


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def layers(wgu, sgu, wd, sd, block, device):
    """The chain's two Fp8Linear layers as the engine's decode chain runs them."""
    out = []
    for w, s in ((wgu, sgu), (wd, sd)):
        layer = Fp8Linear(w.shape[1], w.shape[0], block).to(device)
        layer.weight.data, layer.weight_scale.data = w, s
        layer.fused, layer.fast_kernel, layer.pdl = True, "stream", device == "cuda"
        out.append(layer)
    return out


def kernel_section(args, cuda, dev, res):
    from gemv_bench import launches_us
    from floor import measure_copy_bandwidth
    hidden, inter = (HIDDEN, INTER) if cuda else (SMOKE_HIDDEN, SMOKE_INTER)
    bw = measure_copy_bandwidth() / 1e12 if cuda else 1.0
    res["meta"]["copy_tb_s"] = bw
    gen = torch.Generator(device=dev).manual_seed(0)
    mlp_bytes = 3 * inter * hidden
    copies = max(2, -(-ROTATE_BYTES // mlp_bytes)) if cuda else 1
    block = (128, 128) if cuda else (32, 32)
    if not cuda:
        fp8_mlp_module.SCALE_BLOCK = 32
    t0 = time.time()
    for scale in ("channel", "block"):
        def quantize(n, k):
            w = torch.randn(n, k, device=dev, generator=gen) * 0.02
            return quantize_per_channel(w) if scale == "channel" else quantize_per_block(w, block)
        sets = [(*quantize(2 * inter, hidden), *quantize(hidden, inter)) for _ in range(copies)]
        blk = None if scale == "channel" else block
        chains = [layers(*s, blk, dev) for s in sets]
        for m in (1, 2, 4):
            x = (torch.randn(m, hidden, device=dev, generator=gen) * 0.5).to(torch.bfloat16 if cuda else torch.float32)
            case = {}

            def chain(i):
                gate_up, down = chains[i]
                return down(silu_mul(gate_up(x), pdl=cuda))
            calls, configs = {"chain": chain}, {}
            for bi, bk, bh, mp, arrive, warps, stages, atomic in (CANDIDATES if cuda else SMOKE_CANDIDATES):
                cfg = dict(BLOCK_I=bi, BLOCK_K=bk, BLOCK_H=bh, MERGE_P=mp, ARRIVE=arrive, num_warps=warps,
                           num_stages=stages, ATOMIC=atomic)
                if not fp8_mlp_supported(hidden, inter, blk, blk, cfg):
                    continue
                label = f"fused_i{bi}_k{bk}_h{bh}_a{arrive}_w{warps}_s{stages}" + ("_atomic" if atomic else "")
                calls[label] = lambda i, cfg=cfg: fp8_mlp(x, *sets[i], blk, config=cfg, pdl=cuda)
                configs[label] = cfg
            # The chain rounds gate_up and h to x's dtype between its launches: it is held to the float MLP of
            # the dequantized weights, within e4m3's rounding of the activations; a fused tile to its own arithmetic.
            wgu, sgu, wd, sd = sets[0]
            gate, up = (x.float() @ dequantize_weight(wgu, sgu, blk).t()).chunk(2, dim=-1)
            float_mlp = (torch.nn.functional.silu(gate) * up) @ dequantize_weight(wd, sd, blk).t()
            for label, call in calls.items():
                cfg = configs.get(label)
                ref = float_mlp if cfg is None else fp8_mlp_reference(x, *sets[0], blk, k_group=cfg["BLOCK_K"],
                                                                        h_group=cfg["BLOCK_I"])
                if time.time() - t0 > args.budget_s and label != "chain":
                    case[label] = {"skipped": "time budget"}
                    continue
                try:
                    err = rel_err(call(0), ref)
                    row = {"rel_err": err, "config": cfg}
                    if err > (6e-2 if label == "chain" else 1e-2):
                        row["error"] = "mismatch against the reference"
                    elif cuda:
                        us = launches_us([lambda i=i: call(i) for i in range(copies)] * 2)
                        row.update(us=us, tb_s=mlp_bytes / us / 1e6, fraction_of_copy=mlp_bytes / us / 1e6 / bw)
                    case[label] = row
                except Exception as e:     # a tile the compiler refuses is reported, not fatal
                    traceback.print_exc(limit=1)
                    case[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
            res["kernel"][f"m{m}_{scale}"] = case
            timed = {k: v for k, v in case.items() if "us" in v}
            if timed:
                best = min((k for k in timed if k != "chain"), key=lambda k: timed[k]["us"], default=None)
                c = timed.get("chain", {})
                line = f"m{m} {scale:<8} chain {c.get('us', float('nan')):6.1f} us ({c.get('tb_s', 0):.2f} TB/s)"
                if best:
                    line += f"  best {best} {timed[best]['us']:6.1f} us ({timed[best]['tb_s']:.2f} TB/s)"
                print(line + f"  [{time.time() - t0:.0f} s]", flush=True)
            save(args, res)
        sets = chains = None     # this scale's weights go before the next one's come
        if cuda:
            torch.cuda.empty_cache()


def engine_section(args, cuda, res):
    """Batch-1 TPOT with the fused MLP off and on, alternating on one engine."""
    from llmserve_core import Engine, EngineConfig
    from llmserve_core.models.qwen3 import Qwen3MLP
    from llmserve_proto import SamplingParams
    from fp8_h200 import decode_steps
    from qwen3_8b import write_qwen3_8b_dir
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_qwen3_8b_dir(os.path.join(tmp, "qwen3-8b"))
        engine = Engine(EngineConfig(model=model_dir, load_format="dummy", device="cuda", quantization="fp8",
                                     max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=4096,
                                     gpu_memory_utilization=0.5))
        runner = engine.runner
        engine.add_request("b1", list(range(1000, 1512)), SamplingParams(max_tokens=4000, ignore_eos=True))
        mlps = [m for m in runner.model.modules() if isinstance(m, Qwen3MLP)]
        table = fp8_mlp_module.MEASURED
        # The fused arm runs the tile that was fastest alone at one row (section 1), else the table's.
        timed = {k: v for k, v in res["kernel"].get("m1_channel", {}).items() if k != "chain" and "us" in v}
        best = min(timed, key=lambda k: timed[k]["us"]) if timed else None
        fused_table = {(1, "channel"): timed[best]["config"]} if best else table
        out = {"chain_ms": [], "fused_ms": [], "config": fused_table.get((1, "channel")), "tile": best}
        for arm in ("chain", "fused", "chain", "fused"):
            fp8_mlp_module.MEASURED = fused_table if arm == "fused" else {}
            runner.graphs.release()
            runner.graphs = runner._capture_graphs()
            out[f"{arm}_ms"].append(decode_steps(engine, 150))
            print(f"   batch-1 decode, {arm}: {out[f'{arm}_ms'][-1]:.3f} ms", flush=True)
        fp8_mlp_module.MEASURED = table
        out["mlps"] = len(mlps)
        out["fused_over_chain"] = min(out["fused_ms"]) / min(out["chain_ms"])
        res["engine"] = out
        save(args, res)


def save(args, res):
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--budget-s", type=float, default=150.0, help="stop starting new kernel timings after this long")
    p.add_argument("--skip-engine", action="store_true", help="the kernels only")
    p.add_argument("--smoke", action="store_true", help="tiny shapes through the CPU interpreter")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    res = {"meta": {"gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke)",
                    "commit": open(os.path.join(ROOT, ".commit")).read().strip()
                    if os.path.exists(os.path.join(ROOT, ".commit")) else commit.strip() or "unknown"},
           "kernel": {}}
    kernel_section(args, cuda, "cuda" if cuda else "cpu", res)
    if cuda and not args.skip_engine:
        engine_section(args, cuda, res)
    save(args, res)


if __name__ == "__main__":
    main()
