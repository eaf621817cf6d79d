"""benchmarks/decode_layer_bench.py end to end on the CPU (Triton's interpreter, tiny shapes): its GPU
checks run and pass, and every row of the before/after table is filled."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_run_checks_and_fills_the_table(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("decode_layer_bench",
                                                  os.path.join(ROOT, "benchmarks", "decode_layer_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)      # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    out = tmp_path / "layer.json"
    assert bench.main([str(out), "--smoke", "--budget-s", "600"]) == 0
    result = json.loads(out.read_text())
    assert {(c["kv"], c["ok"]) for c in result["checks"]} == {("bf16", True), ("fp8", True)}
    assert all(c["decode"] < 1e-5 and c["decode_before"] < 1e-5 and c["qk_q"] < 1e-5 for c in result["checks"])
    assert len(result["shapes"]) == 2 and not result["skipped"]
    for row in result["shapes"]:
        assert set(row["before"]) == {"qk_norm_rope_us", "store_kv_us", "decode_split_reduce_us",
                                      "attention_block_us", "layer_us"}
        assert set(row["after"]) == {"qk_norm_rope_store_us", "decode_us", "attention_block_us", "layer_us"}
        assert all(v > 0 for v in (*row["before"].values(), *row["after"].values()))
    assert "checks: all passed" in capsys.readouterr().out
