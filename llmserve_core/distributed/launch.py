"""Start an engine, and with it tensor parallelism: check the request, spawn this host's worker ranks, join
the process group, hand the engine rank 0's side.

Rank 0 is the core process. Ranks 1 .. N-1 are spawned processes (on other hosts, `llmserve-core
--node-rank K` spawns that host's ranks) that die with their parent (PR_SET_PDEATHSIG, and a watchdog on
the parent pid where prctl is unavailable). Every collective has the group's timeout, so a hung rank
fails the others instead of blocking them forever.
"""
from __future__ import annotations

import ctypes
import datetime
import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from llmserve_core.config import EngineConfig, host_and_port
from llmserve_core.distributed.driver import Driver, WorkerLost
from llmserve_core.distributed.group import TPGroup
from llmserve_core.distributed.sharding import ShardSpec, check_divisible
from llmserve_core.distributed.step_channel import StepChannel
from llmserve_core.distributed.worker import serve_worker
from llmserve_core.engine.engine import Engine
from llmserve_core.engine.runtime import max_model_len_of
from llmserve_core.models.config import ModelConfig

log = logging.getLogger("llmserve.tp")

# How long a worker waits for the core's next step: as long as the core is idle (days are fine; gloo
# counts in nanoseconds, so centuries would overflow).
IDLE_TIMEOUT = datetime.timedelta(days=3650)
# How long the ranks wait for each other to start: the ranks of other hosts are started by hand.
START_TIMEOUT = datetime.timedelta(minutes=10)


def check_tensor_parallel(config: EngineConfig, model_config: ModelConfig) -> None:
    """One-line ValueErrors for a tensor-parallel size this model or machine cannot take."""
    size = config.tensor_parallel_size
    check_divisible(model_config, size, config.enable_expert_parallel)
    per_node = size // config.nnodes
    if config.resolved_device().type == "cuda" and per_node > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size: {size} ranks over {config.nnodes} node(s) need {per_node} GPUs "
                         f"per node, {torch.cuda.device_count()} are visible")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_address(config: EngineConfig) -> str:
    return config.dist_init_addr or f"127.0.0.1:{_free_port()}"


def rendezvous(size: int, rank: int, address: str, workers: "Workers | None",
               timeout: datetime.timedelta) -> dist.TCPStore:
    """The TCP store every rank joins, hosted by rank 0, which waits until all have joined: for up to
    START_TIMEOUT (other hosts' ranks are started by hand, before or after it), but no longer than one of its
    own workers lives. Store operations themselves (rank 0 reaching its own address) take `timeout`."""
    host, port = host_and_port(address)
    if rank:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=START_TIMEOUT)
        store.set(f"llmserve/joined/{rank}", "1")
        return store
    try:
        store = dist.TCPStore(host, port, size, is_master=True, timeout=timeout, wait_for_workers=False)
    except dist.DistError as e:          # the port is taken, or the address is not this host's
        raise ValueError(f"dist_init_addr: cannot host the rendezvous at {address}: {e}") from None

    def no_worker_lost() -> None:
        failure = workers.failure() if workers is not None else None
        if failure is not None:
            raise WorkerLost(f"{failure} before it joined the others")
    missing = wait_for_keys(store, {r: f"llmserve/joined/{r}" for r in range(1, size)},
                            START_TIMEOUT.total_seconds(), each_round=no_worker_lost)
    if missing:
        raise TimeoutError(f"dist_init_addr: tensor-parallel ranks {missing} did not join at {address} within "
                           f"{START_TIMEOUT.total_seconds():.0f} s")
    return store


def wait_for_keys(store, keys: dict, timeout: float, each_round=lambda: None) -> list:
    """Poll the store until every key of `keys` ({name: key}) is set or `timeout` s have passed; -> the names
    whose keys are still missing. each_round() runs after every look at the store (it may raise)."""
    deadline = time.monotonic() + timeout
    missing = list(keys)
    while True:
        missing = [name for name in missing if not store.check([keys[name]])]
        each_round()
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.05)


def join_group(config: EngineConfig, model_config: ModelConfig, rank: int, address: str,
               workers: "Workers | None" = None) -> TPGroup:
    """Rank `rank`'s group; rank 0 passes the workers it spawned, so that one dying ends its wait for them."""
    size = config.tensor_parallel_size
    device = config.resolved_device()
    if device.type == "cuda":
        local = rank % (size // config.nnodes)
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    timeout = datetime.timedelta(seconds=config.distributed_timeout)
    store = rendezvous(size, rank, address, workers, timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                            timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if device.type == "cuda" else dist.group.WORLD
    # Formed within the timeout like the others (a rank dying meanwhile fails it), then made to wait as long
    # as the core is idle.
    step_group = dist.new_group(backend="gloo", timeout=timeout)
    _set_pg_timeout(IDLE_TIMEOUT, step_group)
    shard = ShardSpec.of(model_config, rank, size, config.enable_expert_parallel)
    return TPGroup(shard, dist.group.WORLD, cpu_group, step_group, device, store)


class Workers:
    """This host's spawned ranks."""

    def __init__(self, procs: list):
        self.procs = procs

    def failure(self) -> str | None:
        for rank, p in self.procs:
            if p.exitcode is not None:
                return f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def stop(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for _, p in self.procs:
            p.join(None if timeout == float("inf") else max(0.0, deadline - time.monotonic()))
        for _, p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)


def _node_done_key(node_rank: int) -> str:
    return f"llmserve/node-done/{node_rank}"


class RemoteNodes:
    """The other hosts' ranks, seen from rank 0, which cannot join their processes: each host's launcher
    (serve_node) says in the rendezvous store when all its ranks have exited."""

    def __init__(self, store, nnodes: int):
        self.store, self.nodes = store, range(1, nnodes)

    def wait_stopped(self, timeout: float) -> list[int]:
        """Wait up to `timeout` s for every other host's ranks to exit; -> the nodes that did not say so."""
        return wait_for_keys(self.store, {n: _node_done_key(n) for n in self.nodes}, timeout)


def report_node_stopped(address: str, node_rank: int, timeout: float = 5.0) -> bool:
    """On another host, once its ranks have exited: tell rank 0 (False if its store is gone: nobody waits)."""
    host, port = host_and_port(address)
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
        store.set(_node_done_key(node_rank), "1")
        return True
    except RuntimeError:                 # DistError: the core has gone (connection refused, timed out)
        return False


def spawn_workers(config: EngineConfig, ranks: range, address: str) -> Workers:
    ctx = mp.get_context("spawn")
    procs = []
    for rank in ranks:
        p = ctx.Process(target=worker_main, args=(config, rank, address, os.getpid()), daemon=True,
                        name=f"llmserve-tp{rank}")
        p.start()
        procs.append((rank, p))
    return Workers(procs)


def start_engine(config: EngineConfig) -> Engine:
    """The engine `config` asks for. With tensor_parallel_size > 1 this host's other ranks are spawned and
    joined first (a bad configuration fails before any starts), and the engine gets rank 0's group; its
    close() stops them."""
    if config.tensor_parallel_size == 1:
        return Engine(config)
    config.validate()
    model_config = ModelConfig.from_hf_dir(config.model)
    max_model_len_of(config, model_config)
    return Engine(config, tp=start_rank0(config, model_config))


def start_rank0(config: EngineConfig, model_config: ModelConfig) -> TPGroup:
    """In the core process: spawn this host's other ranks and join them as rank 0."""
    check_tensor_parallel(config, model_config)
    address = init_address(config)
    workers = spawn_workers(config, range(1, config.tensor_parallel_size // config.nnodes), address)
    try:
        tp = join_group(config, model_config, 0, address, workers)
    except Exception:
        workers.stop(timeout=0)
        raise
    tp.driver = Driver(tp, StepChannel(tp, config.max_num_seqs), workers, RemoteNodes(tp.store, config.nnodes))
    return tp


def die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)        # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch():                             # also covers a parent that died before prctl took effect
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def worker_main(config: EngineConfig, rank: int, address: str, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    faulthandler.enable()                    # a native crash leaves the Python stacks in the log
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    model_config = ModelConfig.from_hf_dir(config.model)
    tp = join_group(config, model_config, rank, address)
    serve_worker(config, model_config, tp)
    # Told to stop: leave at once, without tearing the process group down. The core waits for this
    # process to exit before it tears its side down (Driver.shutdown); a teardown here, with the core's side
    # still open, could abort in gloo ("terminate called without an active exception", exit -6) in
    # destroy_process_group or in the interpreter's finalization.
    logging.shutdown()
    os._exit(0)


def serve_node(config: EngineConfig) -> int:
    """`llmserve-core --node-rank K` (K > 0): run this host's ranks as workers of the core on node 0, until
    it stops them; exits non-zero if any of them fails."""
    model_config = ModelConfig.from_hf_dir(config.model)
    check_tensor_parallel(config, model_config)
    per_node = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * per_node
    workers = spawn_workers(config, range(first, first + per_node), config.dist_init_addr)
    log.info("node %d: ranks %d-%d started, rendezvous at %s", config.node_rank, first, first + per_node - 1,
             config.dist_init_addr)
    workers.stop(timeout=float("inf"))
    if all(p.exitcode == 0 for _, p in workers.procs):     # stopped by the core, which waits to hear it
        report_node_stopped(config.dist_init_addr, config.node_rank)
        return 0
    return 1
