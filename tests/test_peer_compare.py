"""benchmarks/peer_compare.py: the ratios it reports, and both engine processes wired end to end (with a
stand-in harness and peer here; the H200 run uses nano-vllm and its real harness)."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peer_compare  # noqa: E402


def result(ms, t64, t256):
    return {"batch1": {"ms_per_token": ms}, "tput_64": {"tok_per_s": t64, "best_tok_per_s": t64},
            "tput_256": {"tok_per_s": t256, "best_tok_per_s": t256}}


def test_ratios_are_our_speed_over_the_peers():
    ratios, table = peer_compare.compare(result(5.04, 6551, 9126), result(6.22, 5668, 8142))
    assert ratios["batch1.ms_per_token"] == pytest.approx(6.22 / 5.04)      # less time per token is faster
    assert ratios["tput_256.tok_per_s"] == pytest.approx(9126 / 8142)
    assert "1.23x (met: >= 1.15x)" in table and "1.12x (missed: >= 1.3x)" in table
    ratios, table = peer_compare.compare(result(5.0, 1, 1), None)                # a peer that did not run
    assert ratios == {} and "| - |" in table


STAND_IN_COMMON = '''
import json

def run_workload(name, gen, out_path, extra=None):
    outs = gen([[5, 6, 7], [8, 9]], 4)
    assert [len(o) for o in outs] == [4, 4], outs
    res = {"engine": name, **(extra or {}), "batch1": {"ms_per_token": 2.0},
           "tput_64": {"tok_per_s": 100.0, "best_tok_per_s": 110.0},
           "tput_256": {"tok_per_s": 200.0, "best_tok_per_s": 210.0}}
    with open(out_path, "w") as f:
        json.dump(res, f)
    return res
'''

STAND_IN_PEER = '''
import json, sys
with open(sys.argv[2], "w") as f:
    json.dump({"engine": "stand-in", "model": sys.argv[1], "batch1": {"ms_per_token": 3.0},
               "tput_64": {"tok_per_s": 50.0}, "tput_256": {"tok_per_s": 100.0}, "jit_log": []}, f)
'''


def test_both_processes_run_and_the_table_is_written(tmp_path, tiny_model_dir):
    peer = tmp_path / "peer"
    (peer / "harness" / "model").mkdir(parents=True)
    (peer / "nano-vllm").mkdir()
    (peer / "harness" / "common.py").write_text(textwrap.dedent(STAND_IN_COMMON))
    (peer / "harness" / "run_nanovllm.py").write_text(textwrap.dedent(STAND_IN_PEER))
    out = tmp_path / "out"
    status = peer_compare.main(["--peer", str(peer), "--out", str(out), "--model", tiny_model_dir,
                                "--timeout-s", "240"])
    log = (out / "peer.log").read_text()
    assert status == 0, log
    res = json.loads((out / "peer_compare.json").read_text())
    assert res["exit_status"] == {"nano-vllm": 0, "llmserve": 0}
    assert res["ours"]["engine"] == "llmserve" and res["ours"]["engine_jit_per_timed_run"] == [0]
    assert res["ratios"]["batch1.ms_per_token"] == pytest.approx(1.5)
    assert res["ratios"]["tput_256.tok_per_s"] == pytest.approx(2.0)
    assert "llmserve speed / nano-vllm" in (out / "peer_compare.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["peer.log", "peer_compare.json", "peer_compare.md"]


def test_a_baseline_tree_runs_on_the_same_work(tmp_path, tiny_model_dir):
    """--baseline runs another llmserve checkout (here this one again) beside ours: its table and ratios."""
    peer = tmp_path / "peer"
    (peer / "harness" / "model").mkdir(parents=True)
    (peer / "nano-vllm").mkdir()
    (peer / "harness" / "common.py").write_text(textwrap.dedent(STAND_IN_COMMON))
    out = tmp_path / "out"
    root = Path(__file__).resolve().parents[1]
    status = peer_compare.main(["--peer", str(peer), "--out", str(out), "--model", tiny_model_dir, "--skip-peer",
                                "--baseline", str(root), "--timeout-s", "240"])
    assert status == 0, (out / "peer.log").read_text()
    res = json.loads((out / "peer_compare.json").read_text())
    assert res["exit_status"] == {"llmserve": 0, "baseline": 0}
    assert res["baseline"]["result"]["engine"] == "llmserve"
    assert res["baseline"]["ratios"]["batch1.ms_per_token"] == pytest.approx(1.0)
    assert res["baseline"]["ratios"]["tput_64.tok_per_s"] == pytest.approx(1.0)
    assert "This tree against llmserve" in (out / "peer_compare.md").read_text()
