"""EAGLE-3 step timing at the Qwen3-8B shape: what speedup do a draft step, a verify step and a plain
decode step imply at a given acceptance length?

Dummy weights for both models (timing does not depend on weight values): the target is Qwen3-8B's
shape (benchmarks/qwen3_8b.py), the draft the shape of RedHatAI's Qwen3-8B EAGLE-3 speculator (one
Llama layer, hidden 4096, 32 / 8 heads, head_dim 128, intermediate 12288, draft vocabulary 32000,
norm_before_residual, aux layers 2, 18, 33). Per batch size, with every request at context ~512:

  t_decode   plain decode step through the model runner (CUDA graphs unless --enforce-eager) + sampling
  t_decode_eager  the same forward without graphs
  t_catchup  the draft's catch-up forward (--catchup-rows rows per request: the accepted tokens + bonus)
             and its first proposal
  t_draft    one single-token draft step and its proposal
  t_verify   the packed target forward over 1 + gamma rows per request with aux capture, logits,
             greedy verification and fusing the accepted rows' aux states for the next catch-up
  t_catchup_graph, t_draft_graph, t_verify_graph  the same through the executor's CUDA graphs (when
             captured; the catch-up graph pads every request to 1 + gamma rows)
  t_step     a whole speculative engine step through SpecExecutor.execute (host work included): a
             steady greedy chain or dynamic-tree step is one graph (catch-up, draft forwards, verify);
             t_step_unfused replays the catch-up, draft and verify graphs one by one instead

and the implied speedup AL * t_decode / (t_catchup + (gamma - 1) * t_draft + t_verify) at acceptance
lengths 2.0, 2.5, 3.0 (plus AL * t_decode / t_step). Times are CUDA-event medians after warmup.

    python benchmarks/spec_timing.py --out $OUT/spec_timing                            # on the GPU
    python benchmarks/spec_timing.py --smoke --out /tmp/spec_smoke                     # tiny shapes on the CPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from llmserve_core import Engine, EngineConfig  # noqa: E402
from llmserve_core.engine.spec.state import SpecState  # noqa: E402
from llmserve_core.engine.request import Request  # noqa: E402
from llmserve_core.engine.scheduler import ScheduledBatch  # noqa: E402
from llmserve_core.layers.sampler import SamplingTensors, sample  # noqa: E402
from llmserve_core.models.tiny_draft import speculators_config  # noqa: E402
from llmserve_core.speculative.propose import greedy_propose  # noqa: E402
from llmserve_core.speculative.verify import greedy_verify  # noqa: E402
from llmserve_proto import SamplingParams  # noqa: E402

ACCEPTANCE_LENGTHS = (2.0, 2.5, 3.0)
GREEDY = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)


def write_models(tmp: Path, smoke: bool) -> tuple[str, str]:
    """(target dir, draft dir): config files only, loaded with load_format dummy."""
    if smoke:
        from llmserve_core.models.tiny_draft import make_tiny_draft
        from llmserve_core.models.tiny import make_tiny_model
        target = make_tiny_model(tmp / "target", seed=0)
        return target, make_tiny_draft(tmp / "draft", target, seed=1)
    from qwen3_8b import QWEN3_8B_CONFIG, write_qwen3_8b_dir
    target = write_qwen3_8b_dir(str(tmp / "target"))
    cfg = speculators_config(QWEN3_8B_CONFIG, draft_vocab_size=32000, intermediate_size=12288,
                             aux_layer_ids=(2, 18, 33), norm_before_residual=True, verifier="Qwen/Qwen3-8B")
    draft = tmp / "draft"
    draft.mkdir(parents=True, exist_ok=True)
    (draft / "config.json").write_text(json.dumps(cfg, indent=2))
    return target, str(draft)


def timer(device: torch.device, warmup: int, iters: int):
    def measure(fn) -> float:
        """Median milliseconds of fn(); events bracket host work too, so a host-bound step shows up."""
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)
    return measure


def decoding_requests(engine: Engine, batch: int, context: int) -> list[Request]:
    """`batch` requests at `context` tokens, the last one's KV not yet computed (about to decode), with
    blocks for their drafts. KV contents are whatever the pool holds: timing does not read them."""
    reqs = []
    for i in range(batch):
        req = Request(f"r{i}", [(7 * i + j) % 1000 + 3 for j in range(context)], GREEDY, frozenset(), engine.max_model_len)
        engine.block_manager.allocate(req, context + engine.lookahead + 1)
        req.num_computed_tokens = context - 1
        req.speculative = True
        reqs.append(req)
    return reqs


def spans(ex, reqs, start: int, rows: int):
    """The executor's ForwardBatch for `rows` rows per request from position `start` (a fresh step's staging)."""
    ex.staging.new_step()
    for r in reqs:
        ex.builder.add(r.block_ids, start, rows)
    return ex.builder.finish(uniform_rows=True).batch


@torch.inference_mode()
def time_batch(engine: Engine, batch: int, args, measure) -> dict:
    ex, runner, draft = engine.spec, engine.runner, engine.spec.proposer.draft
    device, gamma = runner.device, ex.gamma
    reqs = decoding_requests(engine, batch, args.context)
    try:
        n = args.context                                   # num_tokens of every request
        sched = ScheduledBatch(reqs, [1] * batch)
        out: dict = {"batch": batch}

        def decode():
            runner.launch(sched).results()
        out["t_decode"] = measure(decode)
        if args.dynamic_tree or args.tree:
            return whole_step_only(engine, reqs, sched, n, out, measure, args.profile)

        st = SamplingTensors.from_params([GREEDY] * batch, device)

        def decode_eager():
            prepared = runner.prepare(sched)
            hidden = runner.model(prepared.input_ids, prepared.batch, runner.kv_caches)
            sample(runner.model.compute_logits(hidden[prepared.sample_rows]), st)
        out["t_decode_eager"] = measure(decode_eager)

        hidden_size = draft.cfg.hidden_size
        rows = args.catchup_rows
        catchup_ids = torch.randint(0, 1000, (batch * rows,), device=device)
        catchup_hidden = torch.randn(batch * rows, hidden_size, device=device, dtype=runner.dtype)
        last = torch.arange(rows - 1, batch * rows, rows, device=device)

        def catchup():
            normed, _ = draft(catchup_ids, catchup_hidden, spans(ex, reqs, n - 1 - rows, rows), ex.proposer.kv)
            greedy_propose(draft.compute_logits(normed[last]), draft.d2t)
        out["t_catchup"] = measure(catchup)

        step_ids = torch.randint(0, 1000, (batch,), device=device)
        step_hidden = torch.randn(batch, hidden_size, device=device, dtype=runner.dtype)

        def draft_step():
            normed, _ = draft(step_ids, step_hidden, spans(ex, reqs, n - 1, 1), ex.proposer.kv)
            greedy_propose(draft.compute_logits(normed), draft.d2t)
        out["t_draft"] = measure(draft_step)

        width = 1 + gamma
        verify_ids = torch.randint(0, 1000, (batch * width,), device=device)
        drafts = torch.randint(0, 1000, (batch, gamma), device=device)
        num_draft = torch.full((batch,), gamma, device=device)

        def verify():
            hidden, aux = runner.model(verify_ids, spans(ex, reqs, n - 1, width), runner.kv_caches,
                                       aux_layer_ids=ex.proposer.aux_layer_ids)
            result = greedy_verify(runner.model.compute_logits(hidden), drafts, num_draft)
            keep = torch.arange(batch * rows, device=device) % (batch * width)   # ~AL rows per request
            draft.combine_aux([a[keep] for a in aux])
            result.num_accepted.tolist()                   # the host needs the counts: a real sync point
        out["t_verify"] = measure(verify)

        # The fixed-shape graphs the executor replays on CUDA (absent with --enforce-eager or on the CPU).
        graphs = ex.graphs
        if "catch-up" in graphs and graphs["catch-up"].bucket_for(batch):
            padded_rows = ex.proposer.catchup_rows                  # the graph pads every request to its most rows
            padded_ids = torch.randint(0, 1000, (batch * padded_rows,), device=device)
            padded_hidden = torch.randn(batch * padded_rows, hidden_size, device=device, dtype=runner.dtype)

            def catchup_graph():
                logits, _ = graphs["catch-up"].run(padded_ids, padded_hidden, spans(ex, reqs, n - 1 - padded_rows,
                                                                                    padded_rows))
                greedy_propose(logits, draft.d2t)
            out["t_catchup_graph"] = measure(catchup_graph)
        if "draft step" in graphs and graphs["draft step"].bucket_for(batch):
            def draft_step_graph():
                logits, _ = graphs["draft step"].run(step_ids, step_hidden, spans(ex, reqs, n - 1, 1))
                greedy_propose(logits, draft.d2t)
            out["t_draft_graph"] = measure(draft_step_graph)
        if "verify" in graphs and graphs["verify"].bucket_for(batch):
            def verify_graph():
                logits, *aux = graphs["verify"].run(verify_ids, None, spans(ex, reqs, n - 1, width))
                result = greedy_verify(logits, drafts, num_draft)
                keep = torch.arange(batch * rows, device=device) % (batch * width)
                draft.combine_aux([a[keep] for a in aux])
                result.num_accepted.tolist()
            out["t_verify_graph"] = measure(verify_graph)

        zero = torch.zeros(1, hidden_size, device=device, dtype=runner.dtype)

        def spec_step():
            for r in reqs:    # the state a request has after a step that accepted nothing (no allocation timed)
                r.spec_state = SpecState(n - 2, zero)
            ex.execute(sched)
        out["t_step"] = measure(spec_step)
        time_unfused(ex, spec_step, out, measure)
        host_split(ex, spec_step, out, measure)
        if args.profile and device.type == "cuda":
            profile_step(spec_step, out)

        # What the engine runs: graphs where it has them.
        t_draft, t_verify = out.get("t_draft_graph", out["t_draft"]), out.get("t_verify_graph", out["t_verify"])
        drafting = out.get("t_catchup_graph", out["t_catchup"]) + (gamma - 1) * t_draft + t_verify
        out["t_spec_components"] = drafting
        for al in ACCEPTANCE_LENGTHS:
            out[f"speedup_al{al}"] = al * out["t_decode"] / drafting
            out[f"speedup_vs_eager_al{al}"] = al * out["t_decode_eager"] / drafting
            out[f"speedup_step_al{al}"] = al * out["t_decode"] / out["t_step"]
        return out
    finally:
        for r in reqs:
            engine.block_manager.release(r)


def time_unfused(ex, spec_step, out: dict, measure) -> None:
    """The same step without the fused graph (catch-up, draft forwards and verify replayed one by one),
    so the fused graph's gain is a ratio inside this run."""
    if not (ex.proposer.fused and "fused step" in ex.graphs):
        return
    ex.proposer.fused = False
    try:
        out["t_step_unfused"] = measure(spec_step)
    finally:
        ex.proposer.fused = True


def host_split(ex, spec_step, out: dict, measure, steps: int = 20) -> None:
    """Where a fused step's wall time goes besides the graph: t_fused_graph replays the step's graph alone
    (its GPU time), host_pre_ms is the host work from the step's start to the replay (the batch built and
    loaded into the graph's inputs), host_run_ms the replay's launch, and host_post_ms the work after it
    returns to the host (the readback's wait included)."""
    graphs = ex.graphs.get("fused step")
    if graphs is None or not ex.proposer.fused:
        return
    stamps = []
    replay = graphs.replay

    def stamped(*a, **kw):
        stamps.append(time.perf_counter())
        result = replay(*a, **kw)
        stamps.append(time.perf_counter())
        return result
    graphs.replay = stamped
    try:
        pre, launch, post = [], [], []
        for _ in range(steps):
            stamps.clear()
            t0 = time.perf_counter()
            spec_step()
            t1 = time.perf_counter()
            if len(stamps) == 2:
                pre.append(stamps[0] - t0)
                launch.append(stamps[1] - stamps[0])
                post.append(t1 - stamps[1])
    finally:
        del graphs.replay
    if not pre:
        return
    out["host_pre_ms"] = 1000 * statistics.median(pre)
    out["host_run_ms"] = 1000 * statistics.median(launch)      # the replay's launch
    out["host_post_ms"] = 1000 * statistics.median(post)
    if graphs.capture:
        out["t_fused_graph"] = measure(graphs.graphs[graphs.last_bucket][0].replay)


def profile_step(spec_step, out: dict, calls: int = 10) -> None:
    """Where a whole step's time goes on the GPU: kernel time by kind, busy time (the union of kernel
    intervals) against the step's wall time, and the longest kernels (CUDA only)."""
    from kernel_trace import profile_calls, summarize
    kernels, wall = profile_calls(spec_step, calls)
    summary = summarize(kernels, calls)
    out["profile"] = {"wall_ms_per_step": wall / calls, "busy_ms_per_step": summary["busy_ms_per_step"],
                      "kernels_per_step": summary["kernels_per_step"], "gpu_ms_by_kind": summary["gpu_ms_by_kind"],
                      "top_kernels": summary["kernels"][:20]}


def whole_step_only(engine, reqs, sched, n, out, measure, profile: bool) -> dict:
    """A tree's step has no chain components to sum: its whole step against a decode."""
    ex, runner = engine.spec, engine.runner
    hidden_size = ex.proposer.draft.cfg.hidden_size

    zero = torch.zeros(1, hidden_size, device=runner.device, dtype=runner.dtype)

    def spec_step():
        for r in reqs:    # no allocation timed
            r.spec_state = SpecState(n - 2, zero)
        ex.execute(sched)
    out["t_step"] = measure(spec_step)
    time_unfused(ex, spec_step, out, measure)
    host_split(ex, spec_step, out, measure)
    if profile and runner.device.type == "cuda":
        profile_step(spec_step, out)
    for al in ACCEPTANCE_LENGTHS + (3.5,):
        out[f"speedup_step_al{al}"] = al * out["t_decode"] / out["t_step"]
    return out


def host_lines(result: dict) -> list[str]:
    """One line per batch: the fused step's wall time against its graph alone, and the host's share."""
    lines = [f"- batch {row['batch']}: step {row['t_step']:.2f} ms, its graph alone {row['t_fused_graph']:.2f} ms; host "
             f"{row['host_pre_ms']:.2f} ms before the replay (its inputs loaded), {row['host_run_ms']:.2f} ms launching "
             f"it, {row['host_post_ms']:.2f} ms after it (readback wait included)"
             for row in result["rows"] if "t_fused_graph" in row]
    return ["", "The fused step's host work (medians of 20 steps):"] + lines if lines else []


def profile_lines(result: dict) -> list[str]:
    """One line per profiled batch: wall against GPU busy time per step, by kernel kind."""
    lines = []
    for row in result["rows"]:
        p = row.get("profile")
        if p:
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(p["gpu_ms_by_kind"].items()))
            lines.append(f"- batch {row['batch']}: a whole step {p['wall_ms_per_step']:.2f} ms of wall time, GPU busy "
                         f"{p['busy_ms_per_step']:.2f} ms ({kinds}), {p['kernels_per_step']:.0f} kernels")
    return ["", "Profiled steps (torch profiler, 10 steps):"] + lines if lines else []


def markdown(result: dict) -> str:
    lines = [f"# EAGLE-3 step timing: {result['shape']} on {result['device_name']}, commit {result['commit']}", "",
             f"gamma {result['gamma']}, context {result['context']}, catch-up rows {result['catchup_rows']}, "
             f"{result['dtype']}, attention {result['attention_backend']}, decode graphs "
             f"{'off' if result['enforce_eager'] else 'on'}; milliseconds (CUDA-event medians).", "",
             "| batch | decode | decode eager | catch-up | catch-up graph | draft step | draft graph | verify | "
             "verify graph | spec step | step unfused | step / decode | "
             + " | ".join(f"x @AL {al}" for al in ACCEPTANCE_LENGTHS) + " | x step @AL 2.5 |",
             "|---" * (13 + len(ACCEPTANCE_LENGTHS)) + "|"]

    def ms(row, key):
        return f"{row[key]:.2f}" if key in row else "-"
    if result.get("dynamic_tree") or result.get("tree"):
        kind = (f"static tree {result['tree']} (depth {result['gamma']})" if result.get("tree") else
                f"dynamic tree (steps, top-k, nodes) {result['dynamic_tree']}")
        lines[2] = (f"{kind}, context {result['context']}, "
                    f"{result['dtype']}, attention {result['attention_backend']}; milliseconds (CUDA-event medians).")
        lines[4:6] = ["| batch | decode | spec step | step unfused | step / decode | x step @AL 2.5 | x step @AL 3.0 | "
                      "x step @AL 3.5 |", "|---|---|---|---|---|---|---|---|"]
        for row in result["rows"]:
            if "error" in row:
                lines.append(f"| {row['batch']} | failed: {row['error']} |")
                continue
            lines.append(f"| {row['batch']} | {row['t_decode']:.2f} | {row['t_step']:.2f} | {ms(row, 't_step_unfused')} | "
                         f"{row['t_step'] / row['t_decode']:.2f} | {row['speedup_step_al2.5']:.2f} | "
                         f"{row['speedup_step_al3.0']:.2f} | {row['speedup_step_al3.5']:.2f} |")
        return "\n".join(lines + host_lines(result) + profile_lines(result)) + "\n"
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['batch']} | failed: {row['error']} |")
            continue
        lines.append(f"| {row['batch']} | {row['t_decode']:.2f} | {row['t_decode_eager']:.2f} | {row['t_catchup']:.2f} "
                     f"| {ms(row, 't_catchup_graph')} | {row['t_draft']:.2f} | {ms(row, 't_draft_graph')} "
                     f"| {row['t_verify']:.2f} | {ms(row, 't_verify_graph')} | {row['t_step']:.2f} "
                     f"| {ms(row, 't_step_unfused')} "
                     f"| {row['t_step'] / row['t_decode']:.2f} | "
                     + " | ".join(f"{row[f'speedup_al{al}']:.2f}" for al in ACCEPTANCE_LENGTHS)
                     + f" | {row['speedup_step_al2.5']:.2f} |")
    lines += ["", "x @AL: AL * t_decode / (t_catchup + (gamma - 1) * t_draft + t_verify), against the plain decode "
              "the engine runs (graphs on CUDA), with the graph catch-up / draft step / verify where they exist. x step: "
              "AL * t_decode / t_step, the executor's whole step (catch-up of 1 row, graphs where available, host "
              "work included): a steady chain step replays one graph (catch-up, draft steps and verify); `step "
              "unfused` is the same step replaying the three graphs one by one."]
    return "\n".join(lines + host_lines(result) + profile_lines(result)) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for spec_timing.json and spec_timing.md")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--catchup-rows", type=int, default=3, help="draft catch-up rows per request (~ acceptance length)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the script, not the GPU")
    ap.add_argument("--commit", default=None, help="the commit to name (default: git rev-parse, where there is a .git)")
    ap.add_argument("--dynamic-tree", default=None, metavar="STEPS,TOPK,NODES",
                    help="time a dynamic tree's whole step instead of a chain's components, e.g. 6,4,32")
    ap.add_argument("--profile", action="store_true", help="also profile whole steps: GPU busy time and kernels")
    ap.add_argument("--tree", default=None, metavar="NAME",
                    help="time a static tree's whole step (e.g. eagle-small at --gamma 3) instead of a chain's components")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.smoke:
        batches = [b for b in batches if b <= 4] or [1]
        args.context, args.warmup, args.iters = min(args.context, 48), 1, 3
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    tree = {}
    if args.tree:
        tree = dict(speculative_tree=args.tree, speculative_num_draft_tokens=None)
        args.dynamic_tree = None
    elif args.dynamic_tree:
        steps, topk, nodes = (int(v) for v in args.dynamic_tree.split(","))
        tree = dict(speculative_tree="dynamic", speculative_num_steps=steps, speculative_eagle_topk=topk,
                    speculative_num_draft_tokens=nodes)
        args.gamma = steps
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = write_models(Path(tmp), args.smoke)
        block_size = 16
        per_seq = -(-(args.context + 2 * (args.gamma + 1) + 1 + (tree.get("speculative_num_draft_tokens") or 32))
                    // block_size)
        engine = Engine(EngineConfig(
            model=target, device=device.type, load_format="dummy", speculative_model=draft,
            speculative_gamma=None if tree else args.gamma, max_num_seqs=max(batches), max_model_len=args.context + 64,
            speculative_policy="always", warmup=False, **tree,   # time_batch warms up what it times
            num_kv_blocks=max(batches) * per_seq + 1, block_size=block_size, enforce_eager=args.enforce_eager,
            attention_backend=args.attention_backend, max_num_batched_tokens=max(8192, max(batches) * (args.gamma + 1))))
        measure = timer(device, args.warmup, args.iters)
        rows = []
        for b in batches:
            try:
                rows.append(time_batch(engine, b, args, measure))
            except Exception as e:        # one failing size (e.g. out of memory) must not lose the others
                traceback.print_exc()
                rows.append({"batch": b, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(json.dumps(rows[-1]), flush=True)
        result = {
            "commit": commit, "shape": "tiny (smoke)" if args.smoke else "Qwen3-8B + EAGLE-3 speculator (dummy)",
            "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "dtype": str(engine.runner.dtype).replace("torch.", ""), "attention_backend": engine.runner.attn_backend.name,
            "enforce_eager": args.enforce_eager or engine.runner.graphs is None, "gamma": args.gamma,
            "context": args.context, "catchup_rows": args.catchup_rows, "warmup": args.warmup, "iters": args.iters,
            "dynamic_tree": args.dynamic_tree, "tree": args.tree,
            "rows": rows,
        }
    (out_dir / "spec_timing.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out_dir / "spec_timing.md").write_text(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
