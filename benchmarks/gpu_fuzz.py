"""Differential fuzzer: seeded random Qwen3 engines against transformers (float32) or the torch backend.

Each seed makes one case: a random Qwen3 (query and KV heads, one KV head and heads == KV heads included;
head_dim 64 / 128 / 256; tied or untied; a vocabulary that is no multiple of any tile), a dtype, an
attention backend, CUDA graphs or eager, async scheduling or not, block size, a token budget from 16 to
8,192 (chunked prefill), a KV pool from tiny (preemption) to ample, prompts across tile and block edges with
shared prefixes and a second pass (prefix-cache hits), EAGLE-3 with a random draft (chain, static or
dynamic tree) or none, and on a GPU sometimes a device slowed under every forward (the host runs steps ahead of
it, as under a big model). Greedy outputs are checked:
- float32: token-exact against transformers' Qwen3ForCausalLM (float32, CPU); a divergence where the
  reference's two candidates are within TIE_TOL is a near tie, not a fault, and ends that prompt's compare;
- bfloat16 / float16: against the torch attention backend (same device and dtype, eager) given the same
  tokens (prompt logprobs): every generated token must be the reference's top-1 or within GAP_TOL of it,
  and the logprobs the engine reports must be within LOGPROB_TOL of the reference's.
The KV pool must end with every block free and its invariants whole.

Cases run in a worker process that is replaced after any case that raised (a device-side assert leaves the
CUDA context unusable) or died; a case past --case-timeout is killed and counted as a failure (a hang).

    python benchmarks/gpu_fuzz.py --budget 420 --out DIR     # as many cases as fit in 420 s, from seed 0
    python benchmarks/gpu_fuzz.py --seed 17                  # replay one case here, with its traceback
    python benchmarks/gpu_fuzz.py --device cpu --budget 25   # the CPU backends (torch; triton interpreted)

Prints a line per case and the seeds of any failures; --out gets fuzz.json and fuzz.md (the record).
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TIE_TOL = 1e-4            # float32: relative logit gap under which two tokens are a near tie
GAP_TOL = {"bfloat16": 0.2, "float16": 0.08}        # logprob below the reference's top-1 a token may be
LOGPROB_TOL = {"bfloat16": 0.15, "float16": 0.05}   # |engine - reference| of a reported logprob
EDGES = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513)


@dataclass
class Case:
    seed: int
    device: str
    dtype: str
    backend: str
    model: dict                     # Qwen3Config overrides
    engine: dict                    # EngineConfig fields (besides model, device, dtype, backend, draft)
    prompts: list[list[int]]
    max_tokens: list[int]
    ignore_eos: bool
    passes: int                     # 2: the prompts run again, through the prefix cache
    eagle: dict | None = None       # speculative_* fields; None: no draft
    step_graphs: bool = False       # on the CPU: the graphs' bookkeeping (LLMSERVE_CPU_STEP_GRAPHS)
    logprobs_every: int = 0         # bf16/fp16: every n-th prompt also reports its tokens' logprobs
    lag: bool = False               # on a GPU: every eager forward waits ~2 ms on the device (the host runs ahead)

    def describe(self) -> str:
        m, e = self.model, self.engine
        eagle = "none" if self.eagle is None else ",".join(f"{k.replace('speculative_', '')}={v}"
                                                             for k, v in self.eagle.items())
        # (on a GPU the torch backend never captures; on the CPU the graphs' bookkeeping runs for any backend)
        graphs = "eager" if e.get("enforce_eager") or (self.backend == "torch" and self.device != "cpu") else "graphs"
        return (f"{self.dtype} {self.backend} {graphs} heads {m['num_attention_heads']}/{m['num_key_value_heads']}"
                f" hd {m['head_dim']} hidden {m['hidden_size']} layers {m['num_hidden_layers']} vocab {m['vocab_size']}"
                f"{' tied' if m['tie_word_embeddings'] else ''} block {e['block_size']} budget "
                f"{e['max_num_batched_tokens']}{'' if e['enable_chunked_prefill'] else ' unchunked'} kv "
                f"{e['num_kv_blocks']} seqs {e['max_num_seqs']} prompts {[len(p) for p in self.prompts]} "
                f"new {max(self.max_tokens)} passes {self.passes} eagle {eagle}"
                f"{' async' if e.get('async_scheduling') else ''}{' warmup' if e.get('warmup') else ''}"
                f"{' lag' if self.lag else ''}")


def available_backends(device: str) -> list[str]:
    if device == "cpu":
        return ["torch", "triton"]
    names = ["torch", "triton"]
    try:
        from llmserve_core.layers.attention.triton_fa4_backend import TritonFA4Backend
        TritonFA4Backend()
        names += ["triton-fa4", "flash-attn"]
    except ImportError:
        pass
    return names


def make_case(seed: int, device: str, backends: list[str]) -> Case:
    """The case of a seed (the same on the same machine: the backends it may pick are the ones present)."""
    r = random.Random(seed)
    cpu = device == "cpu"
    model = _random_model(r, cpu)
    # (the CPU runs the model eagerly whatever the backend: low precision there checks little but the checks)
    dtype = "float32" if cpu and r.random() < 0.9 else r.choice(["float32", "bfloat16", "float16"])
    usable = [b for b in backends if b != "flash-attn" or (dtype != "float32" and model["head_dim"] <= 128)]
    backend = r.choice(usable)
    if cpu and dtype != "float32":
        backend = "triton"          # against the torch backend: the CPU's other one
    eagle = _random_eagle(r) if r.random() < 0.3 else None
    lookahead = _lookahead(eagle)
    block_size = r.choice([4, 8, 16] if cpu else [8, 16, 16, 32, 64, 128])
    budget = int(math.exp(r.uniform(math.log(5 if cpu else 16), math.log(160 if cpu else 8192))))
    longest = (40 if backend == "triton" else 70) if cpu else r.choice([130, 300, 700])
    max_new = r.randint(1, 6 if cpu else 24)
    prompts = _random_prompts(r, model["vocab_size"], longest, block_size, budget, 4 if cpu else 8)
    max_tokens = [r.randint(1, max_new) for _ in prompts]
    need = max(len(p) + m for p, m in zip(prompts, max_tokens)) + lookahead
    model["max_position_embeddings"] = r.choice([need + r.randrange(2, 40), 2048 if cpu else 4096, 32768])
    chunked = r.random() < 0.85
    per_request = [-(-(len(p) + m + lookahead) // block_size) for p, m in zip(prompts, max_tokens)]
    tiny_pool = r.random() < 0.35
    engine = dict(block_size=block_size, max_num_batched_tokens=budget,
                  enable_chunked_prefill=chunked, max_num_seqs=r.choice([1, 2, 3, 4, 8, 16, 32]),
                  num_kv_blocks=max(per_request) + r.randrange(0, 3) if tiny_pool else sum(per_request) + 4,
                  enable_prefix_caching=r.random() < 0.8, async_scheduling=r.random() < 0.7,
                  enforce_eager=r.random() < 0.3, warmup=not cpu and r.random() < 0.15)
    if not chunked:                 # then a whole prompt must fit one step
        engine["max_model_len"] = need + 1
        engine["max_num_batched_tokens"] = max(budget, need + 1)
        model["max_position_embeddings"] = max(model["max_position_embeddings"], need + 1)
    if engine["warmup"]:
        engine["max_num_seqs"] = min(engine["max_num_seqs"], 8)       # the warm-up's rounds grow with it
    return Case(seed, device, dtype, backend, model, engine, prompts, max_tokens, ignore_eos=r.random() < 0.7,
                passes=2 if r.random() < 0.35 else 1, eagle=eagle, step_graphs=cpu and not engine["enforce_eager"],
                logprobs_every=r.choice([2, 3]) if dtype != "float32" else 0, lag=not cpu and r.random() < 0.2)


def _random_model(r: random.Random, cpu: bool) -> dict:
    kv = r.choice([1, 1, 2] if cpu else [1, 1, 2, 4])
    group = r.choice([1, 2, 4] if cpu else [1, 2, 4, 8])
    hidden = r.choice([32, 64] if cpu else [128, 256, 512])
    return dict(hidden_size=hidden, num_hidden_layers=r.randint(1, 2 if cpu else 3), num_attention_heads=kv * group,
                num_key_value_heads=kv, head_dim=r.choice([16, 32] if cpu else [64, 128, 256]),
                intermediate_size=8 * r.randint(hidden // 8, 3 * hidden // 8 + 8),
                vocab_size=r.randrange(200, 700 if cpu else 4096) | 1,        # odd: no tile divides it
                tie_word_embeddings=r.random() < 0.5, rope_theta=r.choice([10000.0, 1000000.0]),
                rms_norm_eps=1e-6, initializer_range=0.02)


def _random_eagle(r: random.Random) -> dict:
    policy = r.choice(["always", "always", "adaptive"])
    kind = r.choice(["chain", "chain", "static", "dynamic"])
    if kind == "chain":
        return dict(speculative_gamma=r.randint(1, 4), speculative_policy=policy)
    if kind == "static":
        return dict(speculative_tree=r.choice(["eagle-small", "binary"]), speculative_policy=policy)
    return dict(speculative_eagle_topk=r.randint(2, 3), speculative_num_steps=r.randint(2, 3),
                speculative_policy=policy)


def _lookahead(eagle: dict | None) -> int:
    if eagle is None:
        return 0
    from llmserve_core.config import EngineConfig
    return EngineConfig(model="", **eagle).draft_shape().lookahead


def _random_prompts(r: random.Random, vocab: int, longest: int, block: int, budget: int, most: int) -> list:
    """Lengths at tile, block and budget edges and between; some share a prefix with an earlier prompt."""
    edges = [n for n in EDGES + (block - 1, block, block + 1, budget - 1, budget, budget + 1) if 1 <= n <= longest]
    prompts = []
    for _ in range(r.randint(1, most)):
        n = r.choice(edges) if r.random() < 0.6 else r.randint(1, longest)
        tokens = [r.randrange(vocab) for _ in range(n)]
        if prompts and r.random() < 0.3:                        # a shared prefix: block-aligned or not
            base = r.choice(prompts)
            k = min(len(base), r.choice([block, 2 * block, r.randint(1, len(base))]))
            tokens = base[:k] + tokens[:max(1, n - k)]
        prompts.append(tokens[:longest])
    return prompts


# ---- one case ---------------------------------------------------------------------------------------

def run_case(case: Case, root: str) -> dict:
    """Build, run and check one case; {"ok": bool, "why": str, ...}. Raises where the engine raised."""
    from llmserve_core import Engine, EngineConfig
    from llmserve_proto import SamplingParams

    model_dir = _model_dir(case, root)
    draft_dir = _draft_dir(case, model_dir, root) if case.eagle else None
    config = EngineConfig(model=model_dir, device=case.device, dtype=case.dtype, attention_backend=case.backend,
                          speculative_model=draft_dir, **(case.eagle or {}), **case.engine)
    before = os.environ.get("LLMSERVE_CPU_STEP_GRAPHS")
    os.environ["LLMSERVE_CPU_STEP_GRAPHS"] = "1" if case.step_graphs else "0"     # read as the engine builds
    try:
        engine = Engine(config)
    finally:
        if before is None:
            del os.environ["LLMSERVE_CPU_STEP_GRAPHS"]
        else:
            os.environ["LLMSERVE_CPU_STEP_GRAPHS"] = before
    if case.lag:
        _slow_device(engine.runner.model)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=case.ignore_eos,
                             logprobs=1 if case.logprobs_every and i % case.logprobs_every == 0 else None)
              for i, m in enumerate(case.max_tokens)]
    outputs = [engine.generate(case.prompts, params) for _ in range(case.passes)]
    st = engine.stats()
    engine.block_manager.check_invariants()
    if st["used_kv_blocks"] or st["running"] or st["waiting"]:
        return dict(ok=False, why=f"blocks or requests left after the run: {st}")
    eos = set(engine.model_info.eos_token_ids)
    del engine
    _free_device(case.device)
    if case.dtype == "float32":
        return _against_transformers(case, model_dir, outputs, eos)
    return _against_torch_backend(case, model_dir, outputs)


def _slow_device(model) -> None:
    """Each eager forward of `model` first keeps the device busy for ~2 ms, so the host runs steps ahead of
    it: whatever the host reuses before the device has read it shows."""
    import torch
    forward = model.forward

    def slow(*args, **kwargs):
        torch.cuda._sleep(4_000_000)
        return forward(*args, **kwargs)
    model.forward = slow


def _model_dir(case: Case, root: str) -> str:
    from llmserve_core.models.tiny import write_random_qwen3
    path = os.path.join(root, f"model-{case.seed}")
    if not os.path.exists(os.path.join(path, "config.json")):
        write_random_qwen3(path, seed=case.seed, **case.model)
    return path


def _draft_dir(case: Case, model_dir: str, root: str) -> str:
    from llmserve_core.models.tiny_draft import make_tiny_draft
    path = os.path.join(root, f"draft-{case.seed}")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_draft(path, model_dir, seed=case.seed + 1)
    return path


def _free_device(device: str) -> None:
    import gc
    gc.collect()
    if device != "cpu":
        import torch
        torch.cuda.empty_cache()


def _against_transformers(case: Case, model_dir: str, outputs, eos: set[int]) -> dict:
    return against_transformers(model_dir, case.prompts, case.max_tokens, outputs, None if case.ignore_eos else eos)


def against_transformers(model_dir: str, prompts, max_tokens, outputs, eos: set[int] | None = None) -> dict:
    """float32: each pass's greedy tokens (outputs: per pass, one Completion per prompt) exact against
    transformers' greedy continuation, cut after the first of `eos` (None: ignore_eos), but for near ties."""
    import torch
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ties = 0
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        ref, logits = _hf_greedy(hf, prompt, m)
        if eos is not None:
            stop = next((j for j, t in enumerate(ref) if t in eos), None)
            ref = ref if stop is None else ref[:stop + 1]
        for p, out in enumerate(outputs):
            got = out[i].token_ids
            k = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
            if k is None:
                if len(got) != len(ref):
                    return dict(ok=False, why=f"pass {p} prompt {i}: {len(got)} tokens, transformers {len(ref)}")
                continue
            row = logits[k]
            gap = float(row[ref[k]] - row[got[k]])
            if gap > TIE_TOL * max(1.0, abs(float(row[ref[k]]))):
                return dict(ok=False, why=f"pass {p} prompt {i} (len {len(prompt)}): token {k} is {got[k]}, "
                                          f"transformers {ref[k]} (logit gap {gap:.3g}); got {got}, want {ref}")
            ties += 1
    return dict(ok=True, why=f"token-exact ({ties} near ties)" if ties else "token-exact")


def _hf_greedy(hf, prompt: list[int], n: int):
    """Greedy ids and each step's float32 logits (a KV-cached loop)."""
    import inspect

    import torch
    # transformers 5.2x renamed past_key_values to cache (argument and output)
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    ids, rows = [], []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            row = out.logits[0, -1].float()
            rows.append(row)
            ids.append(int(row.argmax()))
            if len(ids) < n:
                out = hf(torch.tensor([[ids[-1]]]), use_cache=True, **{name: getattr(out, name)})
    return ids, rows


def _against_torch_backend(case: Case, model_dir: str, outputs) -> dict:
    return against_torch_backend(torch_reference(model_dir, case.device, case.dtype, case.prompts, case.max_tokens),
                                 case.dtype, case.prompts, outputs)


def torch_reference(model_dir: str, device: str, dtype: str, prompts, max_tokens):
    """The reference engine of against_torch_backend: the torch attention backend, eager, one long step."""
    from llmserve_core import Engine, EngineConfig
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens)) + 1
    return Engine(EngineConfig(model=model_dir, device=device, dtype=dtype, attention_backend="torch",
                               enforce_eager=True, enable_prefix_caching=False, warmup=False, max_num_seqs=8,
                               max_num_batched_tokens=max(longest, 2048), num_kv_blocks=8 * (-(-longest // 16) + 1),
                               block_size=16))


def against_torch_backend(ref, dtype: str, prompts, outputs) -> dict:
    """bf16 / fp16: the reference engine (torch_reference) given the same tokens: each generated token its top-1
    or within GAP_TOL of it, and each reported logprob within LOGPROB_TOL of its own."""
    from llmserve_proto import SamplingParams

    gap_tol, lp_tol = GAP_TOL[dtype], LOGPROB_TOL[dtype]
    worst_gap = worst_lp = 0.0
    for p, out in enumerate(outputs):
        seqs = [prompt + c.token_ids for prompt, c in zip(prompts, out)]
        scored = ref.generate(seqs, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, ignore_eos=True))
        for i, (prompt, c, s) in enumerate(zip(prompts, out, scored)):
            for j, tok in enumerate(c.token_ids):
                entry = s.prompt_logprobs[len(prompt) + j - 1]       # scores position len(prompt) + j
                gap = entry.top[0][1] - entry.logprob
                worst_gap = max(worst_gap, gap)
                if gap > gap_tol:
                    return dict(ok=False, why=f"pass {p} prompt {i} (len {len(prompt)}): token {j} ({tok}) is "
                                              f"{gap:.3f} below the torch backend's top-1 {entry.top[0][0]}")
                if c.logprobs is not None:
                    diff = abs(c.logprobs[j].logprob - entry.logprob)
                    worst_lp = max(worst_lp, diff)
                    if diff > lp_tol:
                        return dict(ok=False, why=f"pass {p} prompt {i}: token {j}'s logprob "
                                                  f"{c.logprobs[j].logprob:.4f}, the torch backend's {entry.logprob:.4f}")
    return dict(ok=True, why=f"top-1 within {worst_gap:.3f}, logprobs within {worst_lp:.3f}",
                worst_gap=worst_gap, worst_logprob=worst_lp)


def replay(seed: int, device: str) -> dict:
    """One case in this process (a traceback, where it raises, is the engine's)."""
    case = make_case(seed, device, available_backends(device))
    print(f"seed {seed}: {case.describe()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="llmserve-fuzz-") as root:
        t0 = time.perf_counter()
        result = run_case(case, root)
    result["seconds"] = time.perf_counter() - t0
    print(f"seed {seed}: {'ok' if result['ok'] else 'FAILED'} ({result['why']}) in {result['seconds']:.1f} s")
    return result


def run_here(device: str, budget: float, start_seed: int = 0, min_cases: int = 1, max_cases: int = 50) -> dict:
    """Cases in this process while the budget lasts (at least min_cases): the CPU mode of the test suite, where
    no CUDA context can be lost. A case that raises is a failure with its seed, as in a worker."""
    t0, results, backends = time.monotonic(), [], available_backends(device)
    with tempfile.TemporaryDirectory(prefix="llmserve-fuzz-") as root:
        seed = start_seed
        while len(results) < max_cases and (len(results) < min_cases or time.monotonic() - t0 < budget):
            case = make_case(seed, device, backends)
            started = time.perf_counter()
            try:
                result = run_case(case, root)
            except Exception as e:  # noqa: BLE001 (reported with its seed)
                result = dict(ok=False, why=f"raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
            results.append(dict(result, seed=seed, case=case.describe(), seconds=time.perf_counter() - started))
            seed += 1
    return dict(cases=len(results), failures=[r["seed"] for r in results if not r["ok"]], results=results,
                wall_s=round(time.monotonic() - t0, 1))


# ---- many cases, each worker process replaced after a case that raised or died -------------------------

def _worker(conn, device: str, log_path: str) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)                 # the engine's, the kernels' and the device's own prints
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    backends = available_backends(device)
    with tempfile.TemporaryDirectory(prefix="llmserve-fuzz-") as root:
        while True:
            seed = conn.recv()
            if seed is None:
                return
            case = make_case(seed, device, backends)
            print(f"== seed {seed}: {case.describe()}", flush=True)
            t0 = time.perf_counter()
            try:
                result = run_case(case, root)
            except BaseException as e:  # noqa: BLE001 (reported with its seed; the worker then exits)
                traceback.print_exc()
                result = dict(ok=False, why=f"raised {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                              raised=True)
            result.update(seed=seed, case=case.describe(), seconds=time.perf_counter() - t0)
            conn.send(result)
            if result.get("raised"):
                return


class Pool:
    """One worker at a time; a fresh one after a case that raised, died or hung."""

    def __init__(self, device: str, log_dir: str, target=None):
        self.device, self.log_dir, self.target = device, log_dir, target or _worker
        self.ctx = mp.get_context("spawn")
        self.proc = self.conn = None
        self.started = 0

    def ensure(self) -> None:
        if self.proc is None or not self.proc.is_alive():
            self.started += 1
            self.log = os.path.join(self.log_dir, f"worker-{self.started}.log")
            self.conn, child = self.ctx.Pipe()
            self.proc = self.ctx.Process(target=self.target, args=(child, self.device, self.log), daemon=True)
            self.proc.start()

    def run(self, seed: int, timeout: float) -> dict:
        self.ensure()
        self.conn.send(seed)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = None
            try:
                if self.conn.poll(1.0):
                    result = self.conn.recv()
            except (EOFError, OSError):            # the worker died: its end of the pipe closed
                self.proc.join(30)
            if result is not None:
                if result.get("raised"):
                    self.proc.join(30)
                    self.proc = None
                return result
            if not self.proc.is_alive():
                code = self.proc.exitcode
                self.proc = None
                return dict(ok=False, seed=seed, why=f"worker died (exit code {code})", raised=True)
        self.stop(kill=True)
        return dict(ok=False, seed=seed, why=f"no result in {timeout:.0f} s (a hang?)", raised=True)

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            try:
                self.conn.send(None)
            except OSError:
                self.proc.kill()
        self.proc.join(30)
        self.proc = None

    def tail(self, lines: int = 12) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


def fuzz(device: str, budget: float, start_seed: int, case_timeout: float, out_dir: str | None,
         max_cases: int | None = None, target=None) -> dict:
    """Cases from start_seed on, each in a worker process, while the budget lasts (a case started is let
    finish, up to 90 s past the budget); the record, rewritten in out_dir after every case, so a run cut
    short still leaves it. target: the worker's function (tests stand one in)."""
    t0 = time.monotonic()
    log_dir = out_dir or tempfile.mkdtemp(prefix="llmserve-fuzz-logs-")
    os.makedirs(log_dir, exist_ok=True)
    pool, results, seed, slowest = Pool(device, log_dir, target), [], start_seed, 0.0
    head = dict(device=_device_name(device), commit=_commit(), budget_s=budget, versions=_versions())

    def record() -> dict:
        return dict(head, cases=len(results), failures=[r["seed"] for r in results if not r["ok"]],
                    seeds=[r["seed"] for r in results], wall_s=round(time.monotonic() - t0, 1),
                    workers=pool.started, results=results)
    try:
        while time.monotonic() - t0 + min(slowest, 60) < budget and (max_cases is None or len(results) < max_cases):
            started = time.monotonic()
            result = pool.run(seed, min(case_timeout, max(60.0, budget - (started - t0) + 90)))
            result.setdefault("seconds", time.monotonic() - started)
            slowest = max(slowest, result["seconds"])
            results.append(result)
            status = "ok" if result["ok"] else "FAILED"
            print(f"seed {seed}: {status} {result['seconds']:.1f} s  {result.get('case', '')}  {result['why']}",
                  flush=True)
            if not result["ok"]:
                print(pool.tail(), flush=True)
            if out_dir:
                _write_record(record(), out_dir)
            seed += 1
    finally:
        pool.stop()
    rec = record()
    failed = rec["failures"]
    print(f"{len(results)} cases (seeds {start_seed}..{seed - 1}) in {rec['wall_s']} s on {rec['device']}: "
          f"{len(failed)} failed{': seeds ' + ' '.join(map(str, failed)) if failed else ''}")
    if out_dir:
        _write_record(rec, out_dir)
    return rec


def _write_record(record: dict, out_dir: str) -> None:
    with open(os.path.join(out_dir, "fuzz.json"), "w") as f:
        json.dump(record, f, indent=1)
    lines = [f"# Differential fuzz: {record['cases']} cases, {len(record['failures'])} failed",
             "", f"{record['device']}, commit {record['commit']}, {record['wall_s']} s of a {record['budget_s']} s "
             f"budget, {record['workers']} worker process(es); {record['versions']}", "",
             "| seed | result | s | case | detail |", "|---|---|---|---|---|"]
    for r in record["results"]:
        lines.append(f"| {r['seed']} | {'ok' if r['ok'] else 'FAILED'} | {r['seconds']:.1f} | {r.get('case', '')} | "
                     f"{r['why']} |")
    with open(os.path.join(out_dir, "fuzz.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _device_name(device: str) -> str:
    if device == "cpu":
        return f"CPU ({platform.machine()})"
    import torch
    return torch.cuda.get_device_name()


def _commit() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with open(os.path.join(here, ".commit")) as f:
            return f.read().strip()
    except OSError:
        pass
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions() -> str:
    import torch
    import transformers
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "none"
    return f"torch {torch.__version__}, triton {tv}, transformers {transformers.__version__}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda where present)")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds to keep starting cases")
    ap.add_argument("--seed", type=int, default=None, help="replay this one case in this process")
    ap.add_argument("--start-seed", type=int, default=0, help="the first seed of a budgeted run")
    ap.add_argument("--max-cases", type=int, default=None, help="stop after this many cases")
    ap.add_argument("--case-timeout", type=float, default=300.0, help="seconds before a case counts as hung")
    ap.add_argument("--out", default=None, help="folder for fuzz.json, fuzz.md and the workers' logs")
    args = ap.parse_args(argv)
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.seed is not None:
        return 0 if replay(args.seed, device)["ok"] else 1
    record = fuzz(device, args.budget, args.start_seed, args.case_timeout, args.out, args.max_cases)
    return 1 if record["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
