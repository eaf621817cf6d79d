"""benchmarks/moe_bench.py and moe_tune.py end to end on the CPU (Triton's interpreter, tiny shapes): the
bench's checks pass and fill its table; the sweep writes a table the kernels' lookup reads and can use."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch

from llmserve_core.kernels import fused_moe, tuned

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)      # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_smoke_run_checks_and_fills_the_table(tmp_path, capsys, monkeypatch):
    bench = load("moe_bench", monkeypatch)
    out = tmp_path / "moe.json"
    assert bench.main(["--smoke", "--kinds", "bf16,fp8_block", "--rows", "1,12", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(c["kind"], c["rows"], c["path"]) for c in result["cases"]] == [
        ("bf16", 1, "decode"), ("bf16", 12, "grouped"), ("fp8_block", 1, "decode"), ("fp8_block", 12, "grouped")]
    for case in result["cases"]:
        assert case["ok"] and case["us_per_layer"] > 0 and case["floor_us"] > 0
        assert case["distinct_experts"] == (2 if case["rows"] == 1 else 8)     # top-2 of 8 experts
    assert "checks: all passed" in capsys.readouterr().out


def test_tune_smoke_run_writes_a_table_the_lookup_uses(tmp_path, monkeypatch):
    load("moe_bench", monkeypatch)
    tune = load("moe_tune", monkeypatch)
    assert tune.main(["--smoke", "--kinds", "bf16", "--rows", "1", "--budget", "5", "--out", str(tmp_path)]) == 0
    table = json.loads(tuned.config_path("fused_moe", "cpu", tmp_path / "configs").read_text())
    key = "E=8,N=64,K=64,rows=1,dtype=fp32"
    assert list(table["configs"]) == [key] and fused_moe.usable(table["configs"][key], 1, 2, None)
    assert json.loads((tmp_path / "tune_bf16.json").read_text())[0]["tried"] >= 2
    monkeypatch.setattr(tuned, "CONFIG_DIR", tmp_path / "configs")
    tuned.clear_cache()
    try:
        cfg = fused_moe.moe_config(1, 8, 64, 64, 2, torch.float32, torch.float32, None, torch.device("cpu"))
        assert cfg == table["configs"][key]
    finally:
        tuned.clear_cache()


def test_e2e_smoke_run_measures_every_stage(tmp_path, capsys, monkeypatch):
    """benchmarks/moe_e2e.py on a tiny MoE shape, CPU: decode at batch 1 and 2, both prefills, the EAGLE-3
    step at every depth with the policy's choices, for bf16 (float32 here) and FP8 experts; the experts
    each step read come from its routing ids (top-4 of 16: 4 a layer at batch 1)."""
    e2e = load("moe_e2e", monkeypatch)
    assert e2e.main(["--smoke", "--batches", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "moe_e2e.json").read_text())
    assert [r["kind"] for r in result["kinds"]] == ["bf16", "fp8"]
    for res in result["kinds"]:
        assert [r["batch"] for r in res["decode"]] == [1, 2] and res["decode"][0]["experts_per_layer"] == 4
        assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 and 4 <= r["experts_per_layer"] <= 8 for r in res["decode"])
        assert [(r["prompts"], r["length"]) for r in res["prefill"]] == [(1, 32), (2, 16)]
        assert all(r["bound"] == "compute" and r["tokens_per_s"] > 0 for r in res["prefill"])
        for spec in res["spec"]:
            assert [d["depth"] for d in spec["depths"]] == [1, 2, 3]
            assert all(4 <= d["verify_experts_per_layer"] <= 16 for d in spec["depths"])
            assert set(spec["policy_choice"]) == {"measured", "acceptance 0.5", "acceptance 0.7", "acceptance 0.9"}
        assert res["timed_window_compiles"] and not res["skipped"]
    assert "compiled inside timed windows" in capsys.readouterr().out
    assert (tmp_path / "moe_e2e.md").is_file()
