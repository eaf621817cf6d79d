"""Tensor parallelism on the CPU (gloo, 2 and 4 ranks): greedy outputs token-identical to one rank in
float32 on every feature path, start-up errors (shapes, the rendezvous), workers outliving neither their
core nor a failed start-up, a worker killed mid-run failing the core cleanly, and an idle core keeping its
workers."""
from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from pathlib import Path

import pytest
import torch

from llmserve_core import Engine, EngineConfig, start_engine
from llmserve_core.distributed.sharding import ShardSpec
from llmserve_core.models.config import ModelConfig
from llmserve_core.models.tiny_draft import make_tiny_draft
from llmserve_proto import SamplingParams
from helpers.distributed import GREEDY, PROMPTS, graph_path, run, run_with  # noqa: F401  (graph_path: a fixture)
from helpers.fp8 import compressed_tensors_config, qwen_fp8_config, write_fp8_checkpoint

@pytest.fixture(scope="module")
def gqa_dir(make_random_qwen3_dir):
    """4 query heads over 2 KV heads: with 4 ranks each KV head is replicated on two."""
    return make_random_qwen3_dir(seed=3, initializer_range=0.3, vocab_size=1030, tie_word_embeddings=False)


def test_shard_spec_covers_every_head_and_vocab_row():
    cfg = ModelConfig(vocab_size=1030, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    specs = [ShardSpec.of(cfg, r, 4) for r in range(4)]
    assert [s.q_heads for s in specs] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [s.kv_heads for s in specs] == [(0, 1), (0, 1), (1, 1), (1, 1)]    # query heads 0-3 read KV head 0
    assert sum(s.vocab[1] for s in specs) >= 1030 and specs[3].vocab == (774, 258)
    w = torch.arange(1030 * 2.0).view(1030, 2)
    last = specs[3].slice_checkpoint("lm_head.weight", w, cfg)
    assert last.shape == (258, 2) and torch.equal(last[:256], w[774:]) and not last[256:].any()
    for bad, field in ((3, "3 does not divide the model's 8 attention heads"), (16, "attention heads")):
        with pytest.raises(ValueError, match=field):
            ShardSpec.of(cfg, 0, bad)
    for shape, field in (({"num_key_value_heads": 6, "num_attention_heads": 12}, "6 KV heads"),    # 6 over 4
                         ({"num_key_value_heads": 3, "num_attention_heads": 12}, "3 KV heads"),    # 4 over 3
                         ({"intermediate_size": 130}, "intermediate size 130")):
        with pytest.raises(ValueError, match=f"tensor_parallel_size: 4 does not divide the model's {field}"):
            ShardSpec.of(dataclasses.replace(cfg, **shape), 0, 4)


@pytest.mark.slow
def test_tp2_and_tp4_greedy_equal_one_rank(gqa_dir):
    want, stats1 = run(gqa_dir, 1)
    assert stats1["num_preemptions"] > 0 and stats1["prefix_hits"] > 0
    for tp in (2, 4):
        got, stats = run(gqa_dir, tp)
        assert got == want, f"tensor_parallel_size {tp}"
        assert stats["prefix_hits"] > 0


def _features(engine) -> list:
    """Each feature path the sampler takes on rank 0 over the gathered logits: logprobs and prompt
    logprobs, penalties with a logit bias and min_tokens, a grammar, and seeded sampling."""
    from llmserve_proto import GuidedDecoding
    params = [SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=8, temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
                             repetition_penalty=1.3, logit_bias={5: 3.0}, min_tokens=8),
              SamplingParams(max_tokens=12, temperature=0, guided=GuidedDecoding(kind="regex", spec="[a-z]{2,8}")),
              SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True)]
    return [(o.token_ids, o.finish_reason, o.logprobs, o.prompt_logprobs)
            for o in engine.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[2]], params)]


def _close(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if hasattr(a, "logprob"):
        return _close((a.logprob, a.top), (b.logprob, b.top))
    return a == pytest.approx(b, abs=1e-4) if isinstance(a, float) else a == b


@pytest.mark.slow
def test_tp2_sampling_features_equal_one_rank(tiny_model_dir):
    want, got = (run_with(tiny_model_dir, tp, _features) for tp in (1, 2))
    assert [w[:2] for w in want] == [g[:2] for g in got]
    assert _close(want, got)
    assert want[0][2] and want[0][3] and want[2][1] == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("fmt,tp,graphs", [("qwen-block16", 2, False), ("compressed-tensors-channel", 2, True),
                                           ("qwen-block16", 4, False)],
                         ids=["block-tp2", "channel-tp2-graphs", "block-tp4"])
def test_fp8_checkpoint_under_tp_greedy_equals_one_rank(gqa_dir, tmp_path, fmt, tp, graphs, request):
    """An FP8 checkpoint split over ranks: weights and their scales sliced alike (block scales by whole
    blocks, per-channel ones by row where a layer splits its rows and whole where it splits K); at TP 4
    the two KV heads are replicated, each on two ranks, scales included; with the graph path on, decode
    steps replay on every rank."""
    qc = qwen_fp8_config((16, 16)) if fmt == "qwen-block16" else compressed_tensors_config()
    path, _ = write_fp8_checkpoint(gqa_dir, tmp_path / fmt, qc)
    want, _ = run(path, 1)
    replays = request.getfixturevalue("graph_path") if graphs else []
    got, stats = run(path, tp)
    assert got == want and stats["prefix_hits"] > 0
    assert bool(replays) == graphs


def leading_agreement(a: list[list[int]], b: list[list[int]]) -> int:
    """Tokens two runs agree on before their first difference, summed over the sequences."""
    return sum(next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b))


@pytest.mark.slow
def test_online_fp8_under_tp2_tracks_one_rank(gqa_dir):
    """--quantization fp8 under TP quantizes each rank's slice: a row-parallel layer's per-row scales come
    from the rank's part of K, so the weights are not bit-identical to one rank's. The split must move the
    tokens less than FP8 itself does: TP 2 agrees with one rank's FP8 at least as long as one rank's FP8
    agrees with the float model (the random model's near-ties make both short of the whole output)."""
    exact, _ = run(gqa_dir, 1)
    want, _ = run(gqa_dir, 1, quantization="fp8")
    got, _ = run(gqa_dir, 2, quantization="fp8")
    split, fp8 = leading_agreement(got, want), leading_agreement(want, exact)
    print(f"online fp8: TP 2 and one rank agree on {split} leading tokens, one rank and float32 on {fp8}")
    assert split >= fp8 and got[0][0] == want[0][0]


def test_fp8_scales_slice_with_their_weights():
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    rank1 = ShardSpec.of(cfg, 1, 2)
    per_row = torch.arange(64.0)
    assert torch.equal(rank1.slice_weight_scale("model.layers.0.self_attn.q_proj.weight_scale", per_row, cfg, None),
                       per_row[32:])                                           # column-parallel: its rows
    assert torch.equal(rank1.slice_weight_scale("model.layers.0.self_attn.o_proj.weight_scale", per_row, cfg, None),
                       per_row)                                                # row-parallel: every row's scale
    one = torch.tensor(0.5)
    assert rank1.slice_weight_scale("model.layers.0.mlp.down_proj.weight_scale", one, cfg, None) is one
    blocks = torch.arange(8.0 * 8).view(8, 8)                                  # [128 / 16, 128 / 16]
    up = rank1.slice_weight_scale("model.layers.0.mlp.up_proj.weight_scale_inv", blocks, cfg, (16, 16))
    down = rank1.slice_weight_scale("model.layers.0.mlp.down_proj.weight_scale_inv", blocks, cfg, (16, 16))
    assert torch.equal(up, blocks[4:]) and torch.equal(down, blocks[:, 4:])
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 ranks split .*k_proj.*48-wide scale blocks"):
        rank1.slice_weight_scale("model.layers.0.self_attn.k_proj.weight_scale_inv", blocks[:1], cfg, (48, 48))


def eagle3_tp2_equals_plain(tiny_model_dir, tmp_path) -> dict:
    """EAGLE-3 drafting every step under TP 2, greedy, against plain decoding on one rank; its stats."""
    draft = make_tiny_draft(tmp_path / "draft", tiny_model_dir, seed=1)
    want, _ = run(tiny_model_dir, 1)
    got, stats = run(tiny_model_dir, 2, speculative_model=draft, speculative_gamma=2, speculative_policy="always",
                     num_kv_blocks=40)
    assert got == want
    assert stats["spec_num_drafted_steps"] > 0
    return stats


@pytest.mark.slow
def test_tp2_eagle3_greedy_equals_plain(tiny_model_dir, tmp_path):
    eagle3_tp2_equals_plain(tiny_model_dir, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("tree", [dict(speculative_tree="eagle-small"),
                                  dict(speculative_num_steps=4, speculative_eagle_topk=2, speculative_num_draft_tokens=8)],
                         ids=["static", "dynamic"])
def test_tp2_eagle3_trees_move_every_ranks_kv(tree, graphs, request):
    """A tree's accepted path is moved in the KV pool after the verify, and every rank moves its own shard.
    The trained pair accepts deep paths off the first branch, so paths move KV on most steps. With the
    graph path on, the tree's mask reaches each worker's verify graph through the step broadcast (a
    dynamic tree's differs per request and step)."""
    pair = Path(__file__).resolve().parents[1] / "llmserve_core/data/trained_pair"
    target, draft = str(pair / "target"), str(pair / "draft")
    want, _ = run(target, 1)
    replays = request.getfixturevalue("graph_path") if graphs else []
    got, stats = run(target, 2, speculative_model=draft, speculative_policy="always", num_kv_blocks=60,
                     speculative_gamma=None if "speculative_num_steps" in tree else 3, **tree)
    assert got == want
    assert stats["spec_mean_acceptance_length"] > 1.5, stats
    assert any(name == "verify" for name, _, _ in replays) == graphs


@pytest.mark.slow
def test_tp2_decode_graphs_greedy_equal_one_rank(gqa_dir, graph_path, monkeypatch):
    """Rank 0 replays decode steps through its graph and announces each replay naming the graph; the worker
    loads the same inputs into its own copy and replays the same bucket, so their all-reduces (over the
    padded rows) meet. Token-identical to one rank without graphs, with decode batches of 3 padded to
    bucket 4 and prefill chunks beside decoding rows (mixed steps, eager on every rank)."""
    from llmserve_core.engine.model_runner import ModelRunner
    monkeypatch.delenv("LLMSERVE_CPU_STEP_GRAPHS")       # the reference: one rank, every forward eager
    want, _ = run(gqa_dir, 1)
    monkeypatch.setenv("LLMSERVE_CPU_STEP_GRAPHS", "1")
    steps = []
    real = ModelRunner._forward

    def forward(self, prepared):
        steps.append(prepared.batch.query_lens_cpu)
        return real(self, prepared)
    monkeypatch.setattr(ModelRunner, "_forward", forward)
    got, stats = run(gqa_dir, 2)
    assert got == want
    assert stats["num_preemptions"] > 0 and stats["prefix_hits"] > 0
    assert {name for name, _, _ in graph_path} == {"decode"}
    assert any(n < bucket for _, n, bucket in graph_path), graph_path          # padding rows on every rank
    assert any(min(q) == 1 < max(q) for q in steps)                              # decode rows beside a chunk


@pytest.mark.slow
def test_tp2_eagle3_verify_graphs_greedy_equal_plain(tiny_model_dir, tmp_path, graph_path):
    """With the graph path on, EAGLE-3 under TP 2 drafts through rank 0's draft graphs and verifies through
    the verify graph, which every worker replays with the drafts from the step broadcast; the fused step
    (whose verify reads drafts the workers never see) stays off."""
    eagle3_tp2_equals_plain(tiny_model_dir, tmp_path)
    names = {name for name, _, _ in graph_path}
    assert {"verify", "catch-up", "draft step"} <= names and "fused step" not in names, names


@pytest.mark.slow
def test_tp2_ngram_greedy_equals_one_rank(tiny_model_dir, graph_path):
    """Prompt lookup under TP 2: rank 0 proposes from its requests' own tokens (no model, no KV), the drafts
    reach the workers in the step broadcast, and every rank verifies through its verify graph; chunked
    prefill, preemption and prefix hits as in every TP run here."""
    want, _ = run(tiny_model_dir, 1)
    got, stats = run(tiny_model_dir, 2, speculative_method="ngram", speculative_gamma=3, prompt_lookup_min=1,
                     prompt_lookup_max=3, speculative_policy="always", num_kv_blocks=40)
    assert got == want
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_steps"] > 0
    assert "verify" in {name for name, _, _ in graph_path}


def test_the_rendezvous_address_takes_ipv6_hosts_in_brackets(tiny_model_dir, monkeypatch):
    from llmserve_core.config import host_and_port
    from llmserve_core.distributed import launch
    assert host_and_port("[::1]:29500") == ("::1", 29500)
    assert host_and_port("10.0.0.2:80") == ("10.0.0.2", 80)
    for bad in ("[::1]", "[]:80", ":80", "host:0", "host:65536", "host:-1", "host:8o"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            host_and_port(bad)
        with pytest.raises(ValueError, match="dist_init_addr"):
            EngineConfig(model=tiny_model_dir, tensor_parallel_size=2, dist_init_addr=bad).validate()
    EngineConfig(model=tiny_model_dir, tensor_parallel_size=2, dist_init_addr="[::1]:29500").validate()
    seen = []

    class Store:        # what a joining rank hands torch: the host without its brackets
        def __init__(self, host, port, *a, **kw):
            seen.append((host, port))

        def set(self, *a):
            pass
    monkeypatch.setattr(launch.dist, "TCPStore", Store)
    launch.rendezvous(2, 1, "[::1]:29500", None, datetime.timedelta(seconds=5))
    assert seen == [("::1", 29500)]


def test_start_up_errors_name_the_field(tiny_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide"):
        start_engine(EngineConfig(model=tiny_model_dir, device="cpu", tensor_parallel_size=3))
    # The engine starts no processes: its ranks are started first, by start_engine.
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 ranks must be started .*start_engine"):
        Engine(EngineConfig(model=tiny_model_dir, device="cpu", tensor_parallel_size=2))
    for kwargs, field in (({"tensor_parallel_size": 0}, "tensor_parallel_size"),
                          ({"tensor_parallel_size": 2, "nnodes": 2}, "dist_init_addr"),
                          ({"tensor_parallel_size": 2, "dist_init_addr": "nohost"}, "dist_init_addr"),
                          ({"tensor_parallel_size": 2, "node_rank": 1}, "node_rank"),
                          ({"distributed_timeout": float("nan")}, "distributed_timeout")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(model=tiny_model_dir, **kwargs).validate()


@pytest.mark.slow
def test_an_idle_core_keeps_its_workers_past_the_distributed_timeout(tiny_model_dir):
    """A worker waits for the next step as long as the core has nothing to run: only the collectives of a
    step (and of start-up) are bounded by distributed_timeout."""
    timeout = 10.0
    engine = start_engine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", tensor_parallel_size=2,
                                 distributed_timeout=timeout))
    try:
        want = engine.generate([PROMPTS[1]], GREEDY)[0].token_ids
        time.sleep(timeout + 4)              # idle longer than a collective may wait: the case under test
        assert engine.tp.driver.workers.failure() is None
        assert engine.generate([PROMPTS[1]], GREEDY)[0].token_ids == want
    finally:
        engine.close()


def test_a_worker_dead_before_the_rendezvous_fails_start_up_at_once(tiny_model_dir, monkeypatch):
    """Rank 0 waits for the other ranks to join (other hosts are started by hand, so for minutes), but a
    worker of its own that exits first ends the wait with that worker's exit code."""
    from llmserve_core.distributed import launch
    from llmserve_core.distributed.driver import WorkerLost
    spawn = launch.spawn_workers

    def spawn_dead(*args):
        workers = spawn(*args)
        for _, p in workers.procs:
            p.kill()
        return workers
    monkeypatch.setattr(launch, "spawn_workers", spawn_dead)
    started = time.monotonic()
    with pytest.raises(WorkerLost, match=r"rank 1 \(pid \d+\) exited with code -9"):
        start_engine(EngineConfig(model=tiny_model_dir, device="cpu", tensor_parallel_size=2, distributed_timeout=120.0))
    assert time.monotonic() - started < 60


def test_a_taken_rendezvous_port_fails_start_up_naming_the_address(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = "127.0.0.1:%d" % taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"dist_init_addr: cannot host the rendezvous at {addr}: .*in use"):
            start_engine(EngineConfig(model=tiny_model_dir, device="cpu", tensor_parallel_size=2, dist_init_addr=addr))


def test_a_host_that_never_joins_fails_start_up_naming_the_address(tiny_model_dir, monkeypatch):
    from helpers.daemon import free_port
    from llmserve_core.distributed import launch
    monkeypatch.setattr(launch, "START_TIMEOUT", datetime.timedelta(seconds=1))
    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match=rf"dist_init_addr: tensor-parallel ranks \[1\] did not join at {addr}"):
        start_engine(EngineConfig(model=tiny_model_dir, device="cpu", tensor_parallel_size=2, nnodes=2, dist_init_addr=addr))


def test_a_clean_shutdown_is_not_taken_for_a_lost_worker(tiny_model_dir, monkeypatch):
    """Workers exit as soon as they read the stop: the watchdog waking on that must see a core that is
    stopping, however long close() takes to go on after sending it (a core reporting a lost worker exits 1)."""
    engine = start_engine(EngineConfig(model=tiny_model_dir, device="cpu", tensor_parallel_size=2, distributed_timeout=120.0))
    driver = engine.tp.driver
    lost = []
    driver.watch(lost.append)
    watchdog = next(t for t in threading.enumerate() if t.name == "tp-watchdog")
    send_stop = driver.channel.send_stop

    def stop_and_let_the_watchdog_run_first():
        send_stop()
        for _, p in driver.workers.procs:
            p.join(60)
        watchdog.join(60)
    monkeypatch.setattr(driver.channel, "send_stop", stop_and_let_the_watchdog_run_first)
    engine.close()
    assert not watchdog.is_alive() and lost == []


@pytest.mark.parametrize("stop", [False, True], ids=["error", "stop"])
def test_a_failure_on_rank_0_inside_an_announced_call_is_fatal(tiny_model_dir, monkeypatch, stop):
    """The workers run the call too and wait in its collective: rank 0 cannot take a next step with them.
    A signal stopping the daemon there (during the warm-up) stays a stop, so the daemon exits cleanly."""
    from llmserve_core.distributed.driver import WorkerLost
    from llmserve_core.server.daemon import _StopWhileLoading
    engine = start_engine(EngineConfig(model=tiny_model_dir, device="cpu", tensor_parallel_size=2, distributed_timeout=120.0))
    try:
        model = engine.runner.model._model

        def fail(hidden):
            raise _StopWhileLoading("SIGTERM") if stop else ValueError("injected")
        monkeypatch.setattr(model, "compute_logits", fail)
        with pytest.raises(_StopWhileLoading if stop else WorkerLost,
                           match="SIGTERM" if stop else "rank 0 failed a call its tensor-parallel workers run too: injected"):
            engine.generate([PROMPTS[1]], GREEDY)
        with pytest.raises(WorkerLost, match="SIGTERM" if stop else "injected"):    # every step after it, at once
            engine.generate([PROMPTS[1]], GREEDY)
    finally:
        engine.close()


def test_an_engine_failing_late_in_start_up_stops_its_workers(tiny_model_dir, monkeypatch):
    """Start-up can fail after the workers are serving (in the warm-up, or stopped by a signal there): they
    must not outlive it, nor its process group stop the next engine of this process from forming one."""
    import torch.distributed as dist
    from llmserve_core.distributed import launch
    from llmserve_core.engine import engine as engine_module
    spawned = []
    spawn = launch.spawn_workers
    monkeypatch.setattr(launch, "spawn_workers", lambda *args: spawned.append(spawn(*args)) or spawned[-1])

    def fail(engine):
        raise RuntimeError("injected")
    monkeypatch.setattr(engine_module, "warm_up", fail)
    with pytest.raises(RuntimeError, match="injected"):
        start_engine(EngineConfig(model=tiny_model_dir, device="cpu", tensor_parallel_size=2, warmup=True))
    assert not dist.is_initialized()
    for _, p in spawned[0].procs:
        p.join(60)
        assert p.exitcode is not None, "a worker outlived its engine's failed start-up"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


@pytest.mark.slow
def test_killed_worker_fails_clients_and_leaves_no_process(tiny_model_dir, tmp_path):
    from helpers.daemon import start_core, stop_core, wait_ready
    from llmserve_client import Client, EngineDeadError
    endpoint = f"ipc://{tmp_path}/core.sock"
    log = str(tmp_path / "core.log")
    core = start_core(tiny_model_dir, endpoint, log, "--tensor-parallel-size", "2", "--distributed-timeout", "30")
    try:
        wait_ready(endpoint, core, log)
        workers = _children(core.pid)
        assert workers, "the core spawned no worker"
        with Client(endpoint) as c:
            assert c.generate([5, 6, 7], max_tokens=4, temperature=0).token_ids
            stream = c.stream([5, 6, 7], max_tokens=500, temperature=0, ignore_eos=True)
            next(iter(stream))
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(EngineDeadError):
                for _ in stream:
                    pass
            assert time.monotonic() - started < 60
        assert core.wait(timeout=60) != 0
        deadline = time.monotonic() + 60
        while any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in workers)
    finally:
        if core.poll() is None:
            stop_core(core)


@pytest.mark.slow
def test_killed_core_takes_its_workers_with_it(tiny_model_dir, tmp_path):
    from helpers.daemon import start_core, wait_ready
    endpoint = f"ipc://{tmp_path}/core.sock"
    log = str(tmp_path / "core.log")
    core = start_core(tiny_model_dir, endpoint, log, "--tensor-parallel-size", "2")
    workers = []
    try:
        wait_ready(endpoint, core, log)
        workers = _children(core.pid)
        assert workers, "the core spawned no worker"
        core.kill()
        core.wait(timeout=60)
        deadline = time.monotonic() + 60
        while any(_state(p) != "Z" for p in workers):
            assert time.monotonic() < deadline, "a worker outlived its core"
            time.sleep(0.1)
    finally:
        for pid in [core.pid] + workers:
            if _state(pid) != "Z":
                os.kill(pid, signal.SIGKILL)
        core.wait()


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _log_tails(*paths) -> str:
    return "".join(f"\n--- {p} ---\n{Path(p).read_text(errors='replace')[-3000:]}" for p in paths)


@pytest.mark.slow
def test_two_nodes_over_loopback_serve_what_one_rank_does(tiny_model_dir, tmp_path):
    from helpers.daemon import ENV, STOP_TIMEOUT, free_port, start_core, wait_ready
    from llmserve_client import Client
    want = run(tiny_model_dir, 1)[0][1]                 # PROMPTS[1], greedy
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1_log = tmp_path / "node1.log"
    node1 = subprocess.Popen([sys.executable, "-m", "llmserve_core", "--model", tiny_model_dir, "--device", "cpu",
                              "--block-size", "4", "--num-kv-blocks", "24", "--max-num-batched-tokens", "9",
                              "--max-num-seqs", "4", *flags, "--node-rank", "1"], env=ENV,
                             stdout=subprocess.DEVNULL, stderr=open(node1_log, "wb"))
    endpoint = f"ipc://{tmp_path}/core.sock"
    log = str(tmp_path / "core.log")
    core = start_core(tiny_model_dir, endpoint, log, *flags, "--node-rank", "0", "--block-size", "4",
                      "--num-kv-blocks", "24", "--max-num-batched-tokens", "9", "--max-num-seqs", "4")
    worker = None
    try:
        wait_ready(endpoint, core, log)
        with Client(endpoint) as c:
            got = c.generate(PROMPTS[1], max_tokens=10, temperature=0, ignore_eos=True).token_ids
        assert got == want
        # Rank 1 held back (stopped) while the core stops: the core must not tear its group down under a
        # rank that has not exited yet, whatever the order the two processes get to run in.
        worker = next(p for p in _children(node1.pid) if b"resource_tracker" not in _cmdline(p))
        os.kill(worker, signal.SIGSTOP)
        core.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            core.wait(timeout=2)
        os.kill(worker, signal.SIGCONT)
        assert core.wait(timeout=STOP_TIMEOUT) == 0, _log_tails(log, node1_log)
        assert node1.wait(timeout=STOP_TIMEOUT) == 0, _log_tails(log, node1_log)   # told to stop, not killed
        assert "did not report" not in Path(log).read_text()
    finally:
        if worker is not None and _state(worker) == "T":
            os.kill(worker, signal.SIGCONT)
        for p in (core, node1):
            if p.poll() is None:
                p.kill()
                p.wait()


def _cmdline(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


def test_remote_nodes_are_waited_for_until_they_report(tmp_path):
    from helpers.daemon import free_port
    from llmserve_core.distributed.launch import RemoteNodes, report_node_stopped
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=30))
    nodes = RemoteNodes(store, 3)
    assert RemoteNodes(store, 1).wait_stopped(timeout=0) == []
    assert nodes.wait_stopped(timeout=0.2) == [1, 2]
    reporter = threading.Thread(target=lambda: (time.sleep(0.3), report_node_stopped(f"127.0.0.1:{port}", 2),
                                                report_node_stopped(f"127.0.0.1:{port}", 1)))
    reporter.start()
    assert nodes.wait_stopped(timeout=120) == []       # returns as soon as both have reported
    reporter.join()
    del store
    assert report_node_stopped(f"127.0.0.1:{free_port()}", 1, timeout=1.0) is False    # nobody hosts the store
