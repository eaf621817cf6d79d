"""`llmserve-bench soak` end to end: a real core and HTTP frontend on the CPU tiny model under a randomized
soak (the CI run is 60 s), and a soak whose bound cannot be met must fail with a report saying why."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def soak(tmp_path, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, "-m", "llmserve_bench", "soak", "--result-json", str(out), *args],
                       env=ENV, capture_output=True, text=True, timeout=timeout)
    return r, json.loads(out.read_text())


@pytest.mark.slow
def test_soak_60s(tmp_path):
    r, res = soak(tmp_path, "--duration", "60")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert res["passed"] and not res["failures"]
    roles = res["by_role"]
    # Every kind of client took part.
    for role in ("well_behaved_ipc", "well_behaved_http", "chaos_ipc", "chaos_http", "flood", "stats"):
        assert roles[role].get("ok", 0) > 0, (role, roles)
    assert roles["never_reader"]["sent"] > 0 and sum(roles["killed_clients"].values()) > 0
    assert res["blocks_end"]["used"] == 0 and res["blocks_end"]["running"] == 0
    assert res["exit_codes"] == {"frontend": 0, "core": 0}
    assert res["well_behaved_waits"]["max_s"] <= res["well_behaved_waits"]["bound_s"]
    for name in ("core", "frontend"):
        rss = res["rss_mb"][name]
        assert rss["end"] - rss["start"] <= rss["bound"]
    assert "PASSED" in r.stdout and "p99" in r.stdout


def test_soak_fails_when_a_bound_is_not_met(tmp_path):
    r, res = soak(tmp_path, "--duration", "5", "--max-wait", "0.001", "--flood-inflight", "0",
                  "--never-reader-rate", "0", "--kill-every", "0", "--chaos", "0", "--well-behaved", "1")
    assert r.returncode == 1 and not res["passed"]
    assert any("well-behaved request waited" in f for f in res["failures"]), res["failures"]
    assert "FAIL: a well-behaved request waited" in r.stdout
    assert res["blocks_end"]["used"] == 0 and res["exit_codes"] == {"frontend": 0, "core": 0}


@pytest.mark.parametrize("args", [["--duration", "0"], ["--model", "/no/such/dir"], ["--max-wait", "-1"]])
def test_soak_bad_arguments_exit_2(args):
    r = subprocess.run([sys.executable, "-m", "llmserve_bench", "soak", *args], env=ENV, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 2, r.stderr
