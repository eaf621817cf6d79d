"""Data parallelism: one client or HTTP frontend over several real CPU cores of the tiny model.

Routing: shared-prefix requests land on one core (its prefix-cache hits show it), unrelated ones spread;
a SIGKILLed core fails only its own in-flight requests while the other keeps serving, and a core restarted
on its endpoint rejoins; cores of different models are refused; llmserve-serve over two endpoints and
with --data-parallel-size 2. The router's policy and the stats aggregation are also checked without cores.
"""
from __future__ import annotations

import concurrent.futures
import os
import queue
import time

import pytest

pytest.importorskip("httpx")         # the HTTP frontend's; absent on the GPU machine
pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402

from helpers.daemon import start_core, wait_ready  # noqa: E402
from helpers.http import CORE_ARGS, children, sdk, start_serve, stop, wait_healthy  # noqa: E402
from llmserve_client import Client, EngineDeadError, ModelMismatchError  # noqa: E402
from llmserve_client.cores import Cores, aggregate_stats  # noqa: E402
from llmserve_client.http.cli import parse_args  # noqa: E402
from llmserve_client.http.core_procs import device_groups  # noqa: E402
from llmserve_client.router import OVERLOAD_SLACK, Router, prefix_key  # noqa: E402

BLOCK = 16                                  # the cores' --block-size (helpers.daemon.ENGINE_ARGS)
SHARED = list(range(100, 100 + 2 * BLOCK))  # two full blocks every shared-prefix prompt starts with


# ------------------------------------------------------------------------------------------ policy, no cores

def test_router_keeps_a_prefix_on_its_core_and_spreads_the_rest():
    r = Router(["a", "b"], BLOCK)
    home = r.pick(SHARED + [1], [0, 0], [True, True])
    # Same first block, whatever follows: same core, even when it is the busier one (within the slack).
    assert all(r.pick(SHARED[:BLOCK] + [t], [OVERLOAD_SLACK if i == home else 0 for i in range(2)], [True, True])
               == home for t in range(20))
    # Badly overloaded: the prefix moves to the least loaded core, and stays there.
    moved = r.pick(SHARED, [100 if i == home else 0 for i in range(2)], [True, True])
    assert moved != home and r.pick(SHARED, [0, 0], [True, True]) == moved
    # A dead core's prefixes go elsewhere.
    assert r.pick(SHARED, [0, 0], [i != moved for i in range(2)]) == home
    # Unrelated prompts at equal load spread over both cores; short ones take turns.
    firsts = {r.pick([k] * BLOCK, [0, 0], [True, True]) for k in range(40)}
    assert firsts == {0, 1}
    assert [r.pick([1, 2], [0, 0], [True, True]) for _ in range(4)] in ([0, 1, 0, 1], [1, 0, 1, 0])
    # Least loaded wins for a new prefix.
    assert r.pick([999] * BLOCK, [3, 1], [True, True]) == 1
    with pytest.raises(ValueError, match="up"):
        r.pick(SHARED, [0, 0], [False, False])


def test_prefix_key_is_the_first_full_block_only():
    assert prefix_key(SHARED[:BLOCK - 1], BLOCK) is None
    assert prefix_key(SHARED[:BLOCK], BLOCK) == prefix_key(SHARED[:BLOCK] + [5, 6], BLOCK)
    assert prefix_key(SHARED, BLOCK) != prefix_key([SHARED[0] + 1] + SHARED[1:], BLOCK)
    assert prefix_key([2**63 - 1] * BLOCK, BLOCK) is not None     # the largest id a message carries
    assert prefix_key(SHARED, 0) is None


def test_aggregate_stats_sums_and_recomputes_rates():
    a = {"running": 1, "used_kv_blocks": 10, "total_kv_blocks": 100, "prefix_hits": 30, "prefix_queries": 40,
         "kv_usage": 0.1, "prefix_hit_rate": 0.75}
    b = {"running": 2, "used_kv_blocks": 50, "total_kv_blocks": 100, "prefix_hits": 0, "prefix_queries": 60,
         "kv_usage": 0.5, "prefix_hit_rate": 0.0}
    s = aggregate_stats(["x", "y", "z"], [a, b, EngineDeadError("gone")], [1, 2, 0], [5, 6, 7])
    assert s["running"] == 3 and s["kv_usage"] == 0.3 and s["prefix_hit_rate"] == 0.3
    assert (s["num_cores"], s["num_cores_up"]) == (3, 2)
    assert [c["up"] for c in s["cores"]] == [True, True, False] and s["cores"][2]["error"] == "gone"
    assert s["cores"][1]["running"] == 2 and s["cores"][1]["routed"] == 6
    with pytest.raises(EngineDeadError, match="no core answered"):
        aggregate_stats(["x"], [EngineDeadError("gone")], [0], [0])


def test_a_draining_core_gets_no_new_requests_while_another_serves(tmp_path):
    # No core listens: the transports stay in their handshake, which is enough to route requests to them.
    cores = Cores([f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"], connect_timeout=60)
    sink = queue.SimpleQueue()      # where the requests' "dead" notices go when the cores are closed
    try:
        cores.router = Router(cores.endpoints, BLOCK)
        cores._on_load(0, {"running": 0, "waiting": 0, "draining": True}, 0)
        picked = [cores.open(f"r{i}", [1, 2, i], sink).index for i in range(4)]
        assert picked == [1, 1, 1, 1]
        cores._on_load(1, {"running": 0, "waiting": 0, "draining": True}, 0)      # all drain: any may refuse
        assert cores.open("r4", [1, 2, 4], sink).index == 0                       # the least loaded
        cores._on_load(0, {"running": 0, "waiting": 0}, 0)                        # a's stop ended (a new core)
        assert cores.open("r5", [1, 2, 5], sink).index == 0
    finally:
        cores.close()


def test_device_groups():
    assert device_groups(2, ["--device", "cpu"], "0,1") == [None, None]
    assert device_groups(2, ["--device", "cuda"], "3,5") == ["3", "5"]
    assert device_groups(2, ["--device=cuda", "--tensor-parallel-size", "2"], "0,1,2,3") == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="need 4 devices, but only 2"):
        device_groups(2, ["-tp", "2"], "0,1")
    with pytest.raises(ValueError, match="--device"):
        device_groups(2, ["--device", "cuda:1"], "0,1")


@pytest.mark.parametrize("argv,needle", [
    (["--endpoint", "ipc:///a", "--data-parallel-size", "2"], "needs --model"),
    (["--model", ".", "--data-parallel-size", "0"], "--data-parallel-size"),
    (["--model", ".", "--data-parallel-size", str(2**63)], "--data-parallel-size"),
    (["--endpoint", "ipc:///a", "--endpoint", "ipc:///a"], "listed twice"),
    (["--endpoint", "ipc:///a", "--endpoint", "http://b"], "--endpoint"),
    # Every core would host its rendezvous on the one address, and the other hosts' ranks cannot tell the
    # cores apart.
    (["--model", ".", "-dp", "2", "-tp", "2", "--dist-init-addr", "127.0.0.1:29500"], "--dist-init-addr"),
    (["--model", ".", "-dp", "2", "-tp", "2", "--nnodes=2", "--dist-init-addr=h:1"], "--nnodes"),
    # A core of another node rank serves no socket: the frontend would wait for it in vain.
    (["--model", ".", "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "h:1"], "--node-rank"),
])
def test_bad_data_parallel_args(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_client_endpoint_argument_is_checked():
    with pytest.raises(ValueError, match="endpoint"):
        Client([])
    with pytest.raises(ValueError, match="listed twice"):
        Client(["ipc:///x", "ipc:///x"])


# ------------------------------------------------------------------------------------------ real cores

@pytest.fixture(scope="module")
def cluster(tiny_model_dir, make_random_qwen3_dir, tmp_path_factory):
    """Cores a and b (same model) with a Client and an llmserve-serve over both, and core c of another
    model; all started at once. Yields a dict; tests may kill and restart b (and leave it running)."""
    d = tmp_path_factory.mktemp("dp")
    eps = {k: f"ipc://{d}/{k}.sock" for k in "abc"}
    logs = {k: str(d / f"{k}.log") for k in "abc"}
    other_model = make_random_qwen3_dir(seed=3)
    procs = {k: start_core(other_model if k == "c" else tiny_model_dir, eps[k], logs[k]) for k in "abc"}
    serve_log = str(d / "serve.log")
    serve, base = start_serve(serve_log, "--endpoint", eps["a"], "--endpoint", eps["b"], "--served-model-name", "m")
    client = None
    try:
        for k in "abc":
            wait_ready(eps[k], procs[k], logs[k])
        wait_healthy(serve, base, serve_log)
        client = Client([eps["a"], eps["b"]], connect_timeout=180)
        yield dict(eps=eps, logs=logs, procs=procs, client=client, base=base, dir=d, model=tiny_model_dir)
    finally:
        if client is not None:
            client.close()
        code = stop(serve)
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        assert code == 0, open(serve_log).read()[-3000:]


def _per_core(client: Client, key: str) -> list:
    return [c.get(key) for c in client.stats()["cores"]]


def _run_all(client: Client, prompts: list) -> list:
    """Start every request before reading any (so each routing decision sees the others in flight); returns
    the endpoint each ran on."""
    streams = [client.stream(p, max_tokens=4, temperature=0) for p in prompts]
    for s in streams:
        with s:
            for _ in s:
                pass
    return [s.endpoint for s in streams]


def test_shared_prefixes_stay_on_one_core_and_the_rest_spread(cluster):
    client = cluster["client"]
    received0 = _per_core(client, "requests_received")
    hits0 = _per_core(client, "prefix_hits")
    # The first alone, so its blocks are cached before the others are scheduled.
    where = _run_all(client, [SHARED + [0]]) + _run_all(client, [SHARED + [k] for k in range(1, 6)])
    assert len(set(where)) == 1, where
    home = client.endpoints.index(where[0])
    received = [x - y for x, y in zip(_per_core(client, "requests_received"), received0)]
    assert received[home] == 6 and received[1 - home] == 0, received
    hits = [x - y for x, y in zip(_per_core(client, "prefix_hits"), hits0)]
    assert hits[home] >= 5 * 2 * BLOCK and hits[1 - home] == 0, hits   # all but the first reuse both blocks
    # Unrelated first blocks, all in flight at once, spread evenly.
    where = _run_all(client, [[k + 1] * (BLOCK + 2) for k in range(8)])
    assert sorted(where.count(ep) for ep in client.endpoints) == [4, 4], where
    # Text prompts are tokenized before routing: the same text goes to the same core.
    text = "def f(x): return x + 1 " * 8
    assert len(client.tokenizer.encode(text)) >= BLOCK
    assert len(set(_run_all(client, [text] * 4))) == 1


def test_http_frontend_over_two_cores(cluster):
    base, oai = cluster["base"], sdk(cluster["base"])
    h = httpx.get(base + "/health", timeout=30).json()
    assert h["status"] == "ok" and h["cores_up"] == 2
    assert [c["endpoint"] for c in h["cores"]] == [cluster["eps"]["a"], cluster["eps"]["b"]]
    routed0 = [c["routed"] for c in h["cores"]]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda k: oai.completions.create(model="m", prompt=SHARED + [k], max_tokens=2), range(6)))
    routed = [c["routed"] - r0 for c, r0 in zip(httpx.get(base + "/health", timeout=30).json()["cores"], routed0)]
    assert sorted(routed) == [0, 6], routed
    metrics = httpx.get(base + "/metrics", timeout=30).text
    for ep in (cluster["eps"]["a"], cluster["eps"]["b"]):
        assert f'llmserve_core_up{{model_name="m",core="{ep}"}} 1' in metrics
        assert f'core="{ep}"' in metrics.split("llmserve_num_requests_running")[-1]


def test_model_mismatch_is_refused(cluster):
    with pytest.raises(ModelMismatchError, match="another model") as e:
        Client([cluster["eps"]["a"], cluster["eps"]["c"]], connect_timeout=60)
    assert cluster["eps"]["c"] in str(e.value)


def test_aborts_reach_the_core_running_the_request(cluster):
    client, eps = cluster["client"], cluster["eps"]
    streams = [client.stream([3, 4], request_id=f"long-{k}", max_tokens=450, ignore_eos=True) for k in range(2)]
    assert sorted(s.endpoint for s in streams) == sorted([eps["a"], eps["b"]])
    for s in streams:
        next(iter(s))
        client.abort(s.request_id)
    for s in streams:
        for _ in s:
            pass
        assert s.completion.finish_reason == "abort" and len(s.completion.token_ids) < 450
    deadline = time.monotonic() + 60
    while any(c["running"] or c["waiting"] for c in client.stats()["cores"]):
        assert time.monotonic() < deadline, client.stats()["cores"]
        time.sleep(0.05)
    # The ids are free again at once, whichever core takes them now.
    again = [client.generate([3, 4], request_id=f"long-{k}", max_tokens=2, ignore_eos=True) for k in range(2)]
    assert all(len(c.token_ids) == 2 for c in again)


def test_killed_core_fails_its_requests_the_other_serves_and_it_rejoins(cluster):
    client, eps, procs = cluster["client"], cluster["eps"], cluster["procs"]
    oai = sdk(cluster["base"])
    # Two long requests at once: one on each core.
    streams = [client.stream([3, 4], max_tokens=450, ignore_eos=True) for _ in range(2)]
    assert sorted(s.endpoint for s in streams) == sorted([eps["a"], eps["b"]])
    on_b, on_a = sorted(streams, key=lambda s: s.endpoint != eps["b"])
    # Killed before its first token, b cannot have finished its request (a running core can finish a
    # whole stream before a later kill lands on a busy machine).
    procs["b"].kill()
    next(iter(on_a))
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        for _ in on_b:
            pass
    assert time.monotonic() - t0 < 30.0        # normally well under a second (the socket drops at once)
    # The other core's request runs on, and new requests (even those whose prefix lived on b) are served.
    for _ in on_a:
        pass
    assert on_a.completion.finish_reason == "length" and len(on_a.completion.token_ids) == 450
    procs["b"].wait()
    where = _run_all(client, [SHARED + [k] for k in range(3)] + [[k + 1] * BLOCK for k in range(3)])
    assert set(where) == {eps["a"]}
    h = httpx.get(cluster["base"] + "/health", timeout=30)
    deadline = time.monotonic() + 60
    while h.json()["status"] != "degraded":
        assert time.monotonic() < deadline, h.json()
        h = httpx.get(cluster["base"] + "/health", timeout=30)
    assert h.status_code == 200 and [c["up"] for c in h.json()["cores"]] == [True, False]
    assert oai.completions.create(model="m", prompt=SHARED, max_tokens=2,
                                  extra_body={"ignore_eos": True}).usage.completion_tokens == 2

    # Back on its endpoint, b re-enters rotation for the client and the frontend.
    procs["b"] = start_core(cluster["model"], eps["b"], str(cluster["dir"] / "b2.log"))
    deadline = time.monotonic() + 180
    while client.stats()["num_cores_up"] < 2 or httpx.get(cluster["base"] + "/health", timeout=30).json()[
            "status"] != "ok":
        assert procs["b"].poll() is None and time.monotonic() < deadline, "b did not rejoin"
        time.sleep(0.1)
    where = _run_all(client, [[k + 50] * (BLOCK + 1) for k in range(6)])
    assert sorted(where.count(ep) for ep in client.endpoints) == [3, 3], where


def test_serve_with_data_parallel_size_2(tiny_model_dir, tmp_path):
    log = str(tmp_path / "serve.log")
    proc, base = start_serve(log, "--model", tiny_model_dir, "--data-parallel-size", "2", "--served-model-name", "m",
                             *CORE_ARGS)
    try:
        wait_healthy(proc, base, log)
        cores = children(proc.pid)
        assert len(cores) == 2
        h = httpx.get(base + "/health", timeout=30).json()
        assert h["status"] == "ok" and h["cores_up"] == 2
        oai = sdk(base)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda k: oai.completions.create(model="m", prompt=[k + 1] * (BLOCK + 1),
                                                                  max_tokens=3, temperature=0,
                                                                  extra_body={"ignore_eos": True}), range(8)))
        assert all(o.usage.completion_tokens == 3 for o in outs)
        routed = [c["routed"] for c in httpx.get(base + "/health", timeout=30).json()["cores"]]
        assert sum(routed) == 8 and min(routed) >= 1, routed
        # One owned core lost: the frontend serves on with the other and says it is degraded.
        os.kill(cores[1], 9)
        deadline = time.monotonic() + 60
        while httpx.get(base + "/health", timeout=30).json()["status"] != "degraded":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert oai.completions.create(model="m", prompt="hi", max_tokens=2,
                                      extra_body={"ignore_eos": True}).usage.completion_tokens == 2
    finally:
        assert stop(proc) == 0, open(log).read()[-3000:]
    assert not os.path.exists(f"/proc/{cores[0]}") or open(f"/proc/{cores[0]}/stat").read().split()[2] == "Z"
