"""benchmarks/gpu_fuzz.py's CPU mode: the same seeded generator and checks on the CPU backends (torch, and
Triton's kernels in the interpreter), for a small budget; and its worker pool, which must survive a case
that kills its process (a device-side assert does that on a GPU) or hangs, naming the seed."""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import gpu_fuzz  # noqa: E402

BUDGET_S = float(os.environ.get("LLMSERVE_FUZZ_CPU_BUDGET", "20"))


def test_cpu_fuzz_cases_pass():
    record = gpu_fuzz.run_here("cpu", BUDGET_S, start_seed=0, min_cases=2)
    bad = [f"seed {r['seed']}: {r['case']}: {r['why']}" for r in record["results"] if not r["ok"]]
    assert not bad, "\n".join(bad) + "\n(replay: python benchmarks/gpu_fuzz.py --device cpu --seed N)"


def test_cases_are_seeded_and_varied():
    backends = ["torch", "triton", "triton-fa4", "flash-attn"]
    cases = [gpu_fuzz.make_case(seed, "cuda", backends) for seed in range(300)]
    assert gpu_fuzz.make_case(7, "cuda", backends) == cases[7]
    assert {c.dtype for c in cases} == {"float32", "bfloat16", "float16"}
    assert {c.backend for c in cases} == set(backends)
    assert {c.model["head_dim"] for c in cases} == {64, 128, 256}
    assert any(c.model["num_key_value_heads"] == 1 for c in cases)
    assert any(c.model["num_attention_heads"] == c.model["num_key_value_heads"] for c in cases)
    assert all(c.model["vocab_size"] % 2 for c in cases)              # no power-of-two tile divides it
    assert {c.model["tie_word_embeddings"] for c in cases} == {True, False}
    budgets = [c.engine["max_num_batched_tokens"] for c in cases if c.engine["enable_chunked_prefill"]]
    assert min(budgets) < 32 and max(budgets) > 2048
    assert {c.engine["enforce_eager"] for c in cases} == {True, False}
    assert {c.eagle is None for c in cases} == {True, False}
    assert any(c.passes == 2 for c in cases) and any(c.lag for c in cases)
    assert not any(c.backend == "flash-attn" and (c.dtype == "float32" or c.model["head_dim"] > 128) for c in cases)
    for c in cases:                     # every request fits the pool and the model's length
        assert c.engine["num_kv_blocks"] * c.engine["block_size"] >= max(len(p) for p in c.prompts)
        assert all(len(p) + m <= c.model["max_position_embeddings"] for p, m in zip(c.prompts, c.max_tokens))


def fake_worker(conn, device, log_path):
    """Seeds 0 and 3 pass, 1 kills the process (as a device-side assert does), 2 raises, 4 hangs."""
    while True:
        seed = conn.recv()
        if seed is None:
            return
        if seed == 1:
            os._exit(134)
        if seed == 4:
            time.sleep(60)
        result = dict(ok=seed != 2, why="raised RuntimeError" if seed == 2 else "fine", seconds=0.0, case="fake")
        if seed == 2:
            result["raised"] = True
        conn.send(dict(result, seed=seed))
        if seed == 2:
            return


def test_pool_survives_crashes_and_hangs(tmp_path):
    record = gpu_fuzz.fuzz("cpu", budget=120, start_seed=0, case_timeout=4, out_dir=str(tmp_path), max_cases=5,
                           target=fake_worker)
    by_seed = {r["seed"]: r for r in record["results"]}
    assert [by_seed[s]["ok"] for s in range(5)] == [True, False, False, True, False]
    assert "died (exit code 134)" in by_seed[1]["why"] and "a hang" in by_seed[4]["why"]
    assert record["failures"] == [1, 2, 4] and record["workers"] == 3
    assert (tmp_path / "fuzz.json").exists() and "| 1 | FAILED |" in (tmp_path / "fuzz.md").read_text()
