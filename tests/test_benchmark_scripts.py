"""The maintained GPU benchmark scripts run end to end on the CPU (`--smoke`: Triton's interpreter or the tiny
model's shape), so none rots unseen between device calls. Their figures mean nothing here; what is checked
is that every section runs, checks what it checks and writes what it says it writes.

Scripts with smoke runs of their own elsewhere: kernels_bench (test_kernels), decode_layer_bench with
decode_baseline_kernels (test_decode_layer_bench), fp8_gemv_sweep (test_fp8_kernels), grammar_mask_cost
(test_guided_and_penalties), spec_timing (test_speculative_engine), peer_compare (test_peer_compare),
sm90_compile (test_sm90_compile), floor, kernel_trace and qwen3_8b (test_floor)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def run(script: str, *args: str, timeout: int = 900) -> str:
    """Run benchmarks/<script> with args; its stdout (a failure shows the tail of both streams)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_gemv_bench(tmp_path):
    out = tmp_path / "gemv.json"
    run("gemv_bench.py", "--smoke", "--sweep", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"qkv_m1", "qkv_m16", "lm_head_m1", "lm_head_m16"}
    for row in rows.values():
        assert row["gemv_rel_err"] < 1e-4 and row["gemv_ms"] > 0 and row["cublas_ms"] > 0
        assert row["sweep_best_config"]["BLOCK_M"] == 16


def test_pdl_chain_bench(tmp_path):
    out = tmp_path / "pdl_chain.json"
    run("pdl_chain_bench.py", "--smoke", "--out", str(out))
    res = json.loads(out.read_text())
    row = res["shapes"]["swept_m1"]
    assert row["sweep_us"] and row["fp8_sweep_us"] and row["stream_config"]["BLOCK_K"] == 256
    chain = res["chain"]["m1"]
    assert chain["stream_rel_err"] < 1e-4 and chain["cublas_rel_err"] < 1e-4 and chain["fp8_stream_us_per_layer"] > 0


def test_decode_profile(tmp_path):
    out = tmp_path / "decode.json"
    run("decode_profile.py", "--smoke", "--out", str(out), "--batches", "1,2", "--ctx", "16", "--steps", "2",
        "--block-scaled", "--kv-cache-dtype", "fp8_e4m3", "--host-profile", "1")
    runs = json.loads(out.read_text())["runs"]
    assert [r["batch"] for r in runs] == [1, 2]
    for r in runs:
        assert r["quantization"] == "fp8-block" and r["kv_cache_dtype"] == "fp8_e4m3"
        assert r["step_ms"] > 0 and r["floor_ms"] > 0 and r["host_ms"] > 0 and r["host_profile"]
        assert r["timed_keys"] == [16 + 2 + 1, 16 + 2 + 2]        # after the smoke run's 2 warm steps


def test_fp8_tma_tiles(tmp_path):
    out = tmp_path / "tma.json"
    run("fp8_tma_tiles.py", "--smoke", "--out", str(out))
    res = json.loads(out.read_text())
    assert set(res["cases"]) == {"qkv", "down"}
    for case in res["cases"].values():
        assert all("us" in r for r in case.values()), case          # every tile checked against its reference
        assert any(r["config"] and r["config"].get("TMA") for r in case.values())
    assert set(res["patch"]) == {"qkv", "down"}                     # the patch path runs in a smoke run
    assert set(res["engine"]) == {"table", "patched"} and all(r["step_ms"] > 0 for r in res["engine"].values())


def test_fp8_block_gemm_tiles(tmp_path):
    out = tmp_path / "block.json"
    run("fp8_block_gemm_tiles.py", "--smoke", "--reps", "1", "--prefills", "1x16", "--out", str(out))
    res = json.loads(out.read_text())
    row = res["kernels"]["qkv"]["17"]
    assert all("us" in r for r in row.values()), row
    assert res["candidate"] in row
    verdict = res["engine"]["1x16"]
    assert verdict["triton"] > 0 and verdict[res["candidate"]] > 0 and verdict["speedup"] > 0


def test_h200_e2e(tmp_path):
    # The chunked-prefill mix is two more cores through the same start_core / bench path as the closed loop.
    run("h200_e2e.py", "--smoke", "--skip", "chunked_prefill_mix", "--out", str(tmp_path))
    res = json.loads((tmp_path / "h200_e2e.json").read_text())
    for section in ("copy_bandwidth", "bf16_peak", "batch1_decode", "decode_steps", "inprocess_closed_loop",
                    "closed_loop_ipc", "transformers_peer"):
        assert "error" not in res[section], (section, res[section])
    assert res["batch1_decode"]["triton_ctx16"]["ms_per_token"] > 0
    assert res["decode_steps"]["b2"]["ms_per_step"] > 0
    assert "output_throughput" in res["closed_loop_ipc"]["c2"]
    assert res["transformers_peer"]["generate_b2"]["output_throughput"] > 0
    assert not any(res["jit_compilations_in_timed_runs"].values())
    assert "kernels compiled inside timed runs | none" in (tmp_path / "h200_e2e.md").read_text()


def test_spec_serving(tmp_path):
    run("spec_serving.py", "--smoke", "--out", str(tmp_path))
    res = json.loads((tmp_path / "spec_serving.json").read_text())["8b"]
    assert "error" not in res, res
    assert set(res["ratio_spec_over_plain"]) == {"c2"}
    assert "core_spec_num_plain_steps" in res["spec_adaptive"]["c2"]     # the core's policy counters came back
    assert "| 2 |" in (tmp_path / "spec_serving.md").read_text()


def test_spec_cpu(tmp_path):
    run("spec_cpu.py", "--num-prompts", "2", "--prompt-len", "8", "--max-tokens", "6", "--repeats", "1",
        "--modes", "plain,chain-gamma3", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "spec_trained_pair_cpu.json").read_text())["rows"]
    assert {(r["mode"], r["batch"]) for r in rows} == {("plain", 1), ("chain-gamma3", 1), ("plain", 2),
                                                       ("chain-gamma3", 2)}
    assert all(r["identical_to_plain"] for r in rows)           # greedy drafting changes no token
    assert all(r["mean_acceptance_length"] >= 1 for r in rows if r["mode"] != "plain")


def test_flood_fairness(tmp_path):
    # `llmserve-bench flood` with a core of its own on the tiny model: three phases, the table, the JSON.
    table = run("flood_fairness.py", "--out", str(tmp_path), "--smoke")
    assert "flood and probe" in table and "flood throughput with the probe / alone" in table
    result = json.loads((tmp_path / "flood_fairness.json").read_text())
    phases, summary = result["phases"], result["summary"]
    assert phases["probe_alone"]["probes"] > 0 and phases["flood_and_probe"]["probes"] > 0
    assert phases["probe_alone"]["flood_output_tokens"] == 0 and phases["flood_alone"]["probes"] == 0
    assert phases["flood_alone"]["flood_output_tokens"] > 0 and phases["flood_and_probe"]["flood_output_tokens"] > 0
    assert summary["probe_p50_ttft_ms_alone"] > 0 and summary["flood_throughput_ratio"] > 0
    assert result["card"] == "cpu" and result["environment"]["git_commit"]
    assert "--fairness-preempt-steps" in result["core_args"]


def test_table_sweeps_import(tmp_path):
    """The sweeps that write the GEMV tile tables need a GPU for any run; on the CPU their imports and
    parsers must still resolve against the kernels they time."""
    for script in ("skinny_gemm_bench.py", "fp8_skinny_gemm.py"):
        assert "usage:" in run(script, "--help", timeout=300)


def test_gpu_checks_stages(tmp_path):
    """Every script gpu_checks.sh runs exists, and an unknown stage fails the run."""
    text = (BENCH / "gpu_checks.sh").read_text()
    for script in set(re.findall(r"benchmarks/([\w]+\.py)", text)):
        assert (BENCH / script).is_file(), script
    proc = subprocess.run(["bash", str(BENCH / "gpu_checks.sh"), "no-such-stage"], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, OUT=str(tmp_path)), timeout=60)
    assert proc.returncode == 1 and "unknown stage" in proc.stdout


def test_ngram_timing(tmp_path):
    """Tiny shapes on the CPU with the step graphs' bookkeeping: an executor per depth, each request
    proposing every draft, and the host-cost section."""
    out = tmp_path / "ngram"
    env_run = dict(os.environ, LLMSERVE_CPU_STEP_GRAPHS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(BENCH / "ngram_timing.py"), "--smoke", "--batch-sizes", "1,4",
                           "--depths", "2,3", "--host-context", "300", "--out", str(out)], cwd=ROOT, env=env_run,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "ngram_timing.json").read_text())
    assert [(r["batch"], r["k"]) for r in res["rows"]] == [(1, 2), (1, 3), (4, 2), (4, 3)]
    for r in res["rows"]:
        assert r["full_length_share"] == 1.0 and r["verify_graph"] and r["t_step"] > 0 and r["t_decode"] > 0
    assert [h["lookup"] for h in res["host_cost"]] == [[2, 4], [5, 5]] and res["host_cost"][0]["matched_share"] > 0
    assert "| 4 | 3 |" in (out / "ngram_timing.md").read_text()


def test_ngram_cpu(tmp_path):
    run("ngram_cpu.py", "--num-prompts", "2", "--max-tokens", "8", "--text-len", "16", "--settings", "k3-2..4",
        "--host-batch", "4", "--host-context", "400", "--host-steps", "5", "--out", str(tmp_path))
    res = json.loads((tmp_path / "ngram_trained_pair_cpu.json").read_text())
    assert [(r["setting"], r["batch"]) for r in res["rows"]] == [("plain", 2), ("k3-2..4", 2), ("plain", 1), ("k3-2..4", 1)]
    assert all(r["identical_to_plain"] for r in res["rows"]) and res["device"] == "cpu"
    assert len(res["host_cost"]) == 3 and "acceptance length" in (tmp_path / "ngram_trained_pair_cpu.md").read_text()


def test_embed_throughput(tmp_path):
    out = run("embed_throughput.py", "--smoke", "--out", str(tmp_path))
    res = json.loads((tmp_path / "embed_throughput.json").read_text())
    whats = [(r["what"], r["budget"]) for r in res["rows"]]
    assert whats == [("embed", 32), ("embed", 64), ("rerank", 64), ("generation alone", 8192),
                     ("generation beside embeddings", 8192), ("generation beside embeddings", 16)]
    for r in res["rows"][:3]:
        assert r["docs_per_s"] > 0 and r["tokens_per_s"] == r["docs_per_s"] * r["doc_len"]
        assert r["floor_ms"] > 0 and 0 < r["fraction_of_floor"] and r["jit_compilations"] == 0
    gen = res["rows"][3:]
    assert gen[0]["median_itl_ms"] > 0 and gen[0]["embed_docs_per_s"] is None
    assert gen[1]["embed_docs_per_s"] > 0
    assert "generation beside embeddings" in out and (tmp_path / "embed_throughput.md").is_file()
