"""Qwen3-30B-A3B as the engine serves it, dummy weights, bf16 and FP8 (--quantization fp8), against floors
measured in the same run (benchmarks/floor.py's copy rate and matmul peaks; FP8's too):

  (a) batch-1 decode, a step per token, against the bytes it must read: attention's projections, the router
      and the norms of every layer, the experts the step's routing selected (counted from its ids: 8 a
      layer at batch 1), the final norm, the lm_head, one embedding row and the K/V;
  (b) decode steps at batch 8, 64 and 256 against the same floor, counting the distinct experts each
      step's routing selected (nearly all 128 a layer from batch 64 on);
  (c) prefill of 1 x 4,096 and 8 x 2,048 tokens (tokens/s) against the FLOP floor: 2 x active weights x
      tokens (attention's projections, the router, the 8 routed experts; the lm_head per sampled row) plus
      attention's QK^T and PV, over the bf16 peak (FP8 projections and experts over the FP8 peak);
  (d) the EAGLE-3 step over the MoE target (a dummy draft of RedHatAI's Qwen3-30B-A3B speculator shape: one
      Llama layer, hidden 2048, 32 / 4 heads, intermediate 6144, draft vocabulary 32,000, aux layers 2, 24,
      45, 0.46B weights with the embedding) at every depth against a plain decode step at batch 1 and 16,
      the experts its verify rows select, and the adaptive policy's choice on the step costs it measured:
      at the dummy draft's acceptance, and at per-draft acceptances of 0.5 / 0.7 / 0.9, with the
      break-even acceptance of each depth;
  (e) no kernel compiles inside a timed window (kernels/jit_count.py): a compile there fails the run.

Each kind builds one engine (CUDA graphs, async scheduling, the warm-up off: each stage runs its shapes
untimed first), with a KV pool of --kv-blocks blocks (30B-A3B's bf16 weights are ~61 GB of the H100's 80).
Decode steps are wall-clock medians of Engine.step() in steady decoding (host work included); the experts
a step selected are read from the routing ids of a few untimed steps after the timed ones (the ids the
captured graphs write, kept by a tap on route), averaged, and the floor held at the timed steps' middle
context. Prefill is timed from the first step to the sampled token read back, after one untimed run.

    python benchmarks/moe_e2e.py --out $OUT/moe_e2e                 # bf16 then FP8, ~5 min on an H100
    python benchmarks/moe_e2e.py --smoke --out /tmp/moe_e2e          # a tiny MoE shape on the CPU
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from floor import StepShape, measure_bf16_peak, measure_copy_bandwidth, moe_step_floor  # noqa: E402
from moe_bench import measure_fp8_peak  # noqa: E402
from peer_compare import commit_of  # noqa: E402
from qwen3_moe import QWEN3_30B_A3B_CONFIG, write_qwen3_moe_dir  # noqa: E402
from llmserve_core import Engine, EngineConfig  # noqa: E402
from llmserve_core.engine.step_graphs import StepGraphs  # noqa: E402
from llmserve_core.kernels.jit_count import jit_compilations  # noqa: E402
from llmserve_core.models.tiny_draft import speculators_config  # noqa: E402
from llmserve_core.speculative.policy import AcceptanceModel, SpecPolicy, batch_bucket  # noqa: E402
from llmserve_proto import SamplingParams  # noqa: E402

GPU = dict(device="cuda", dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=4224,
           ctx=128, warm=5, steps=20, counted=3, prefills=((1, 4096), (8, 2048)), reps=3, spec_batches=(1, 16))
SMOKE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160,
             ctx=8, warm=1, steps=2, counted=1, prefills=((1, 32), (2, 16)), reps=1, spec_batches=(1, 2))
SMOKE_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=16,
                   num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16)
SMOKE_RATES = {"copy_bandwidth": 1e11, "bf16_peak": 1e12, "fp8_peak": None}
ACCEPTANCES = (0.5, 0.7, 0.9)
GAMMA = 3


class RoutingTap:
    """The routing ids of each MoE layer's call, kept where they can be read after a step: an eager call's
    as it returns them, a captured graph's as the tensors the capture wrote (each replay rewrites them).
    Installed before the engine is built, so it sees the graphs being captured."""

    def __init__(self):
        self.capturing: tuple | None = None          # (graph, bucket) being captured
        self.captured: dict[tuple, list[torch.Tensor]] = {}
        self.graphs: list[StepGraphs] = []
        self.eager: list[torch.Tensor] | None = None   # a list while counting an eager step
        self._undo = []

    def install(self) -> None:
        from llmserve_core.kernels import fused_moe
        from llmserve_core.layers import moe
        call = StepGraphs._call

        def tapped_call(graphs, n):
            if graphs not in self.graphs:
                self.graphs.append(graphs)
            self.capturing = (graphs, n)
            try:
                return call(graphs, n)
            finally:
                self.capturing = None
        self._patch(StepGraphs, "_call", tapped_call)
        for module, name in ((fused_moe, "route"), (moe, "route_reference")):
            self._patch(module, name, self._tapped(getattr(module, name)))

    def _patch(self, owner, name, value) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _tapped(self, route):
        def tapped(*args, **kwargs):
            weights, ids = route(*args, **kwargs)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                self.captured.setdefault(self.capturing, []).append(ids)
            elif self.eager is not None:
                self.eager.append(ids)
            return weights, ids
        return tapped

    def uninstall(self) -> None:
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo, self.captured, self.graphs = [], {}, []

    def counted_step(self, engine, layers: int) -> list[list[int]]:
        """Run one step; the distinct experts each of its MoE forwards selected per layer (ids -1 aside)."""
        replays = {id(g): g.replays for g in self.graphs}
        self.eager = []
        engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        forwards = [self.eager[i:i + layers] for i in range(0, len(self.eager), layers)]
        self.eager = None
        for g in self.graphs:
            if g.replays > replays.get(id(g), 0) and (g, g.last_bucket) in self.captured:
                forwards.append(self.captured[(g, g.last_bucket)][-layers:])
        return [[int(ids[ids >= 0].unique().numel()) for ids in forward] for forward in forwards]


def write_models(tmp: Path, smoke: bool) -> tuple[str, str, dict]:
    """(target dir, draft dir, target config): config files only, for load_format dummy."""
    overrides = SMOKE_SHAPE if smoke else {}
    target = write_qwen3_moe_dir(str(tmp / "target"), **overrides)
    cfg = dict(QWEN3_30B_A3B_CONFIG, **overrides)
    layers = cfg["num_hidden_layers"]
    draft_cfg = speculators_config(cfg, draft_vocab_size=min(32000, cfg["vocab_size"]),
                                   intermediate_size=3 * cfg["hidden_size"],
                                   aux_layer_ids=(2, layers // 2, layers - 3), norm_before_residual=True,
                                   speculative_tokens=GAMMA, verifier="Qwen/Qwen3-30B-A3B-Instruct-2507")
    draft = tmp / "draft"
    draft.mkdir(parents=True, exist_ok=True)
    (draft / "config.json").write_text(json.dumps(draft_cfg, indent=1))
    return target, str(draft), cfg


def kv_blocks(p: dict) -> int:
    """16-token blocks for the largest stage: the largest decode batch at its context and steps, a spec batch
    (up to GAMMA + 1 tokens a drafting step, every depth), or the largest prefill."""
    steps = p["warm"] + p["steps"] + p["counted"]
    decode = p["max_num_seqs"] * (p["ctx"] + steps + GAMMA + 2)
    spec = max(p["spec_batches"]) * (p["ctx"] + steps + GAMMA * (steps + 2) * (GAMMA + 1) + GAMMA + 2)
    prefill = sum(n * length + 1 for n, length in p["prefills"][-1:])
    return -(-max(decode, spec, prefill) // 16) + p["max_num_seqs"]


def prompts(engine, n: int, length: int, rng: torch.Generator) -> list[list[int]]:
    vocab = engine.model_info.vocab_size
    return [torch.randint(3, vocab, (length,), generator=rng).tolist() for _ in range(n)]


def start_decoding(engine, n: int, ctx: int, rng, tag: str) -> list[str]:
    params = SamplingParams(max_tokens=engine.max_model_len - ctx - 2 * GAMMA - 2, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(n)]
    for rid, prompt in zip(ids, prompts(engine, n, ctx, rng)):
        engine.add_request(rid, prompt, params)
    while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
        engine.step()
    if len(engine.scheduler.running) != n:
        raise RuntimeError(f"{tag}: {len(engine.scheduler.running)} of {n} requests running: the KV pool is short")
    return ids


def finish(engine, ids: list[str]) -> None:
    for rid in ids:
        if rid in engine.requests:
            engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def timed_steps(engine, steps: int, windows: list) -> list[float]:
    """Milliseconds of each of `steps` engine steps; the JIT compilations inside join `windows`."""
    before = jit_compilations()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    windows.append(jit_compilations() - before)
    return times


def experts_read(tap: RoutingTap, engine, layers: int, counted: int) -> float:
    """The (layer, expert) pairs a step's target forward selected, averaged over `counted` steps."""
    totals = [sum(forward) for _ in range(counted) for forward in tap.counted_step(engine, layers)]
    return statistics.mean(totals) if totals else float("nan")


def floor_of(cfg, shape, experts, rates, fp8: bool) -> dict:
    f = moe_step_floor(cfg, shape, experts, rates["copy_bandwidth"], rates["bf16_peak"],
                       linear_bytes=1 if fp8 else None, linear_peak=rates.get("fp8_peak") if fp8 else None)
    return {"floor_ms": f.ms, "floor_bytes": f.bytes, "floor_flops": f.flops, "bound": f.bound}


def decode_stage(engine, tap, cfg, p, rates, fp8, batch, rng, windows) -> dict:
    if engine.policy is not None:
        engine.policy.pinned = 0
    ids = start_decoding(engine, batch, p["ctx"], rng, f"decode{batch}")
    for _ in range(p["warm"]):
        engine.step()
    times = timed_steps(engine, p["steps"], windows)
    experts = experts_read(tap, engine, cfg["num_hidden_layers"], p["counted"])
    finish(engine, ids)
    middle = p["ctx"] + p["warm"] + p["steps"] // 2 + 1
    floor = floor_of(cfg, StepShape(decode_contexts=(middle,) * batch), experts, rates, fp8)
    step_ms = statistics.median(times)
    return {"batch": batch, "step_ms": step_ms, "experts_per_layer": experts / cfg["num_hidden_layers"], **floor,
            "of_floor": floor["floor_ms"] / step_ms, "tokens_per_s": batch / step_ms * 1e3}


def prefill_stage(engine, tap, cfg, p, rates, fp8, n, length, rng, windows) -> dict:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times, experts = [], float("nan")
    for rep in range(p["reps"] + 2):             # the first run compiles what these rows need, the second counts
        for i, prompt in enumerate(prompts(engine, n, length, rng)):
            engine.add_request(f"prefill{n}x{length}-{rep}-{i}", prompt, params)
        if rep == 1:                             # the experts selected, from the routing ids of an untimed run
            experts = statistics.mean(sum(f) for f in tap.counted_step(engine, cfg["num_hidden_layers"]))
            finish(engine, [])
            continue
        before = jit_compilations()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if rep:
            times.append((time.perf_counter() - t0) * 1e3)
            windows.append(jit_compilations() - before)
    shape = StepShape(prefill_chunks=((0, length),) * n, sampled_chunks=n)
    floor = floor_of(cfg, shape, experts, rates, fp8)
    ms = statistics.median(times) if times else float("nan")
    return {"prompts": n, "length": length, "ms": ms, "tokens_per_s": n * length / ms * 1e3,
            "experts_per_layer": experts / cfg["num_hidden_layers"], **floor, "of_floor": floor["floor_ms"] / ms}


def break_even(ratio: float, depth: int, margin: float) -> float | None:
    """The per-draft acceptance above which drafting `depth` deep beats plain decoding at this cost ratio."""
    lo, hi = 0.0, 1.0
    if sum(hi ** j for j in range(depth + 1)) < ratio * (1 + margin):
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** j for j in range(depth + 1)) < ratio * (1 + margin) else (lo, mid)
    return hi


def spec_stage(engine, tap, cfg, p, batch, rng, windows) -> dict:
    """Plain steps, then steps drafting at each depth (pinned), at one batch size; then the policy's choices
    on the step costs the engine measured meanwhile."""
    policy = engine.policy
    policy.pinned = 0
    ids = start_decoding(engine, batch, p["ctx"], rng, f"spec{batch}")
    layers = cfg["num_hidden_layers"]
    out = {"batch": batch, "depths": []}
    for _ in range(p["warm"]):
        engine.step()
    out["plain_ms"] = statistics.median(timed_steps(engine, p["steps"], windows))
    out["plain_experts_per_layer"] = experts_read(tap, engine, layers, p["counted"]) / layers
    for depth, width in policy.widths.items():
        policy.pinned = depth
        for _ in range(p["warm"] + 2):           # the first drafting steps after plain ones catch the draft up
            engine.step()
        emitted = engine.total_generated_tokens
        step_ms = statistics.median(timed_steps(engine, p["steps"], windows))
        per_step = (engine.total_generated_tokens - emitted) / p["steps"] / batch
        verify_experts = experts_read(tap, engine, layers, p["counted"]) / layers
        out["depths"].append({"depth": depth, "verify_rows": width, "step_ms": step_ms,
                              "ratio": step_ms / out["plain_ms"], "tokens_per_request_step": per_step,
                              "verify_experts_per_layer": verify_experts,
                              "break_even_acceptance": break_even(step_ms / out["plain_ms"], depth,
                                                                  policy.switch_margin)})
    policy.pinned = None
    finish(engine, ids)
    costs = engine.step_costs
    out["measured_costs_ms"] = {f"{b}x{w}": 1e3 * s for (b, w), s in sorted(costs.median.items())
                                if b == batch_bucket(batch)}
    out["policy_choice"] = {"measured": SpecPolicy(policy.widths, acceptance=policy.acceptance).decide(
        batch, batch, costs).gamma}
    for acc in ACCEPTANCES:
        chooser = SpecPolicy(policy.widths, acceptance=AcceptanceModel(GAMMA, prior=acc, prior_weight=1e9))
        out["policy_choice"][f"acceptance {acc}"] = chooser.decide(batch, batch, costs).gamma
    out["measured_acceptance"] = [policy.acceptance.conditional(j) for j in range(GAMMA)]
    return out


def run_kind(kind: str, target: str, draft: str, cfg: dict, p: dict, rates: dict, args, deadline: float) -> dict:
    fp8 = kind == "fp8"
    tap = RoutingTap()
    tap.install()
    t0 = time.time()
    engine = Engine(EngineConfig(
        model=target, load_format="dummy", device=p["device"], dtype=p["dtype"], quantization="fp8" if fp8 else None,
        max_num_seqs=p["max_num_seqs"], max_num_batched_tokens=p["max_num_batched_tokens"],
        max_model_len=p["max_model_len"], num_kv_blocks=args.kv_blocks or kv_blocks(p), block_size=16,
        enable_prefix_caching=False, warmup=False, speculative_model=draft, speculative_gamma=GAMMA,
        speculative_policy="adaptive"))
    res = {"kind": kind, "build_s": time.time() - t0, "decode": [], "prefill": [], "spec": [], "skipped": [],
           "errors": [], "timed_window_compiles": []}
    if torch.cuda.is_available():
        res["memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    rng = torch.Generator().manual_seed(0)
    windows = res["timed_window_compiles"]
    stages = [("decode", b, lambda b=b: decode_stage(engine, tap, cfg, p, rates, fp8, b, rng, windows))
              for b in [1, *args.batches]]
    stages += [("prefill", f"{n}x{n_len}", lambda n=n, n_len=n_len: prefill_stage(
        engine, tap, cfg, p, rates, fp8, n, n_len, rng, windows)) for n, n_len in p["prefills"]]
    stages += [("spec", b, lambda b=b: spec_stage(engine, tap, cfg, p, b, rng, windows)) for b in p["spec_batches"]]
    try:
        for name, what, stage in stages:
            if time.time() > deadline:
                res["skipped"].append(f"{name} {what}")
                continue
            t1 = time.time()
            try:
                row = stage()
            except Exception as e:       # reported; the other stages still run
                traceback.print_exc()
                res["errors"].append(f"{name} {what}: {type(e).__name__}: {e}"[:500])
                finish(engine, list(engine.requests))
                continue
            row["seconds"] = time.time() - t1
            res[name].append(row)
            print(f"  {kind} {name} {what}: {json.dumps(row, default=float)[:300]}", flush=True)
    finally:
        tap.uninstall()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return res


def _acceptance(p: float | None) -> str:
    return "none" if p is None else f"{p:.2f}"


def report(result: dict) -> str:
    lines = []
    for res in result["kinds"]:
        k = res["kind"]
        lines.append(f"{k}: built in {res['build_s']:.0f} s" + (f", {res['memory_gb']:.1f} GB" if "memory_gb" in res
                                                                  else ""))
        lines.append(f"  {'decode batch':<14}{'step ms':>9}{'floor ms':>10}{'of floor':>9}{'experts/layer':>15}"
                     f"{'tok/s':>9}")
        for r in res["decode"]:
            lines.append(f"  {r['batch']:<14}{r['step_ms']:>9.3f}{r['floor_ms']:>10.3f}{r['of_floor']:>8.0%}"
                         f"{'' if r['bound'] == 'memory' else '*':<1}{r['experts_per_layer']:>14.1f}"
                         f"{r['tokens_per_s']:>9.0f}")
        for r in res["prefill"]:
            lines.append(f"  prefill {r['prompts']} x {r['length']}: {r['ms']:.1f} ms, {r['tokens_per_s']:.0f} tok/s, "
                         f"floor {r['floor_ms']:.1f} ms ({r['of_floor']:.0%}, {r['bound']})")
        for r in res["spec"]:
            depths = ", ".join(f"d{d['depth']} {d['step_ms']:.2f} ms ({d['ratio']:.2f}x, {d['verify_experts_per_layer']:.0f}"
                               f" experts, break-even {_acceptance(d['break_even_acceptance'])})" for d in r["depths"])
            lines.append(f"  spec batch {r['batch']}: plain {r['plain_ms']:.2f} ms ({r['plain_experts_per_layer']:.0f} "
                         f"experts); {depths}; policy {r['policy_choice']}")
        lines.append(f"  kernels compiled in timed windows: {sum(res['timed_window_compiles'])}"
                     + (f"; skipped (budget): {res['skipped']}" if res["skipped"] else ""))
        lines += [f"  ERROR {e}" for e in res["errors"]]
    r = result["meta"]["rates"]
    lines.append(f"copy {r['copy_bandwidth'] / 1e12:.2f} TB/s, bf16 {r['bf16_peak'] / 1e12:.0f} TFLOP/s, fp8 "
                 f"{(r.get('fp8_peak') or 0) / 1e12:.0f} TFLOP/s; * = compute-bound floor")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder: moe_e2e.json and moe_e2e.md")
    ap.add_argument("--kinds", default="bf16,fp8", help="bf16 and / or fp8 (--quantization fp8 at load)")
    ap.add_argument("--batches", default=None, help="decode batches besides 1 (default 8,64,256; smoke 4)")
    ap.add_argument("--kv-blocks", type=int, default=None, help="the KV pool in 16-token blocks (default: what "
                    "the stages need)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds: start no new stage after this")
    ap.add_argument("--smoke", action="store_true", help="a tiny MoE shape on the CPU (checks the script runs)")
    ap.add_argument("--commit", default=None, help="the tree's commit (default: .commit, else git)")
    args = ap.parse_args(argv)
    args.commit = args.commit or commit_of(str(ROOT))
    kinds = args.kinds.split(",")
    if not set(kinds) <= {"bf16", "fp8"}:
        ap.error(f"--kinds: bf16 and / or fp8, got {args.kinds}")
    if not args.smoke and not torch.cuda.is_available():
        ap.error("needs a CUDA device (or --smoke)")
    p = SMOKE if args.smoke else GPU
    args.batches = [int(b) for b in (args.batches or ("4" if args.smoke else "8,64,256")).split(",")]
    if max(args.batches) > p["max_num_seqs"]:
        ap.error(f"--batches: at most {p['max_num_seqs']}")
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = dict(SMOKE_RATES) if args.smoke else {"copy_bandwidth": measure_copy_bandwidth(),
                                                  "bf16_peak": measure_bf16_peak(), "fp8_peak": measure_fp8_peak()}
    with tempfile.TemporaryDirectory() as tmp:
        target, draft, cfg = write_models(Path(tmp), args.smoke)
        result = {"meta": {"gpu": torch.cuda.get_device_name() if not args.smoke else "cpu (smoke)",
                           "torch": torch.__version__, "commit": args.commit, "rates": rates, "config": cfg,
                           "engine": {k: v for k, v in p.items()}}, "kinds": []}
        for i, kind in enumerate(kinds):
            # each kind gets its share of what is left of the budget
            deadline = t_start + args.budget * (i + 1) / len(kinds)
            try:
                result["kinds"].append(run_kind(kind, target, draft, cfg, p, rates, args, deadline))
            except Exception as e:       # the engine did not build (out of memory, say): the next kind still runs
                traceback.print_exc()
                result["kinds"].append({"kind": kind, "build_s": float("nan"), "decode": [], "prefill": [], "spec": [],
                                        "skipped": [], "errors": [f"build: {type(e).__name__}: {e}"[:500]],
                                        "timed_window_compiles": []})
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            (out / "moe_e2e.json").write_text(json.dumps(result, indent=1, default=float))
    result["meta"]["seconds"] = time.time() - t_start
    text = report(result)
    (out / "moe_e2e.json").write_text(json.dumps(result, indent=1, default=float))
    (out / "moe_e2e.md").write_text(f"commit {args.commit}, {result['meta']['gpu']}\n\n```\n{text}\n```\n")
    print(text)
    compiled = sum(sum(res["timed_window_compiles"]) for res in result["kinds"])
    errors = sum(len(res["errors"]) for res in result["kinds"])
    print(f"{'no kernel' if not compiled else f'{compiled} kernels'} compiled inside timed windows, {errors} errors; "
          f"{result['meta']['seconds']:.0f} s; {out / 'moe_e2e.json'}")
    return 0 if compiled == 0 and errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
