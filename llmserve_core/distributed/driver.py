"""Rank 0's side of tensor parallelism: the model it steps wraps its own shard and announces each
forward and logits call to the workers, which run the same call on theirs.

Start-up (weight loading, the memory profile, CUDA-graph capture with its warm-up calls) runs the same
code on every rank in lockstep, so nothing is announced until `live` is set: every rank captures the same
graphs, in the same order, with the model's all-reduces inside. Graphs are only ever captured then.

A forward rank 0 runs through one of its step graphs is announced once, naming the graph (run_graph):
each worker replays its own copy over the same inputs. On the GPU the replay makes no Python call; on
the CPU the graphs run their forward eagerly (capture off), and those model calls are part of the
announced step, not announced again.
"""
from __future__ import annotations

import contextlib
import logging
import threading

import torch.distributed as dist

from llmserve_core.distributed.step_channel import StepChannel

log = logging.getLogger("llmserve.tp")


class WorkerLost(RuntimeError):
    """A tensor-parallel worker died or a collective with the workers failed: the engine cannot go on."""
    fatal = True


class DrivenModel:
    """Rank 0's model: its shard, with every call mirrored on the workers."""

    def __init__(self, model, driver: "Driver"):
        self._model, self._driver = model, driver
        self._in_graph_step = False

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _announce(self) -> bool:
        self._driver.check()
        return self._driver.live and not self._in_graph_step

    def run_graph(self, index: int, graphs, input_ids, batch):
        """graphs.run(input_ids, None, batch), announced as a replay of the runner's mirrored graph `index`,
        which each worker then replays over the same inputs (the same bucket, the same padding)."""
        announce = self._announce()
        try:
            with self._mirrored(announce):
                if announce:
                    self._driver.channel.send_forward(input_ids, batch, graph=index)
                self._in_graph_step = True
                return graphs.run(input_ids, None, batch)
        finally:
            self._in_graph_step = False

    def __call__(self, input_ids, batch, kv_caches, aux_layer_ids=()):
        announce = self._announce()
        with self._mirrored(announce):
            if announce:
                self._driver.channel.send_forward(input_ids, batch, tuple(aux_layer_ids))
            return self._model(input_ids, batch, kv_caches, aux_layer_ids=aux_layer_ids)

    def compute_logits(self, hidden):
        announce = self._announce()
        with self._mirrored(announce):
            if announce:
                self._driver.channel.send_logits(hidden)
            return self._model.compute_logits(hidden)

    @contextlib.contextmanager
    def _mirrored(self, announced: bool):
        """A failed collective ends the engine, and so does any failure of a call the workers run too:
        they wait in a collective of it that rank 0 will never join, and would take its next step's for it.
        A stop (KeyboardInterrupt, a signal during the warm-up) stays what it is."""
        try:
            yield
        except RuntimeError as e:
            raise self._driver.lost(e) from e
        except BaseException as e:
            if not announced:
                raise
            lost = self._driver.lost(e)
            if isinstance(e, Exception):
                raise lost from e
            raise


class Driver:
    """Owns rank 0's group, the step channel, the worker processes on this host and the wait for the other
    hosts' ranks."""

    def __init__(self, tp, channel: StepChannel, workers, remote_nodes):
        self.tp, self.channel, self.workers, self.remote_nodes = tp, channel, workers, remote_nodes
        self.live = False
        self.failure: str | None = None

    def check(self) -> None:
        if self.failure is None:
            self.failure = self.workers.failure()
        if self.failure is not None:
            raise WorkerLost(self.failure)

    def compact_kv(self, src_slots, dst_slots) -> None:
        """Announce a tree's KV moves, so every worker moves its own shard as rank 0 moves its."""
        self.check()
        if not self.live:
            return
        try:
            self.channel.send_compact(src_slots, dst_slots)
        except RuntimeError as e:
            raise self.lost(e) from e

    def lost(self, error: Exception) -> WorkerLost:
        what = ("tensor-parallel collective failed" if isinstance(error, RuntimeError)
                else "rank 0 failed a call its tensor-parallel workers run too")
        self.failure = self.failure or self.workers.failure() or f"{what}: {error}"
        return WorkerLost(self.failure)

    def watch(self, on_lost) -> None:
        """Call on_lost(reason) from a thread as soon as a worker on this host exits while serving: the
        core may be blocked in a collective with it, so the caller must not wait for the main thread."""
        from multiprocessing.connection import wait

        def run():
            sentinels = [p.sentinel for _, p in self.workers.procs]
            while sentinels:
                wait(sentinels)
                if not self.live:
                    return                   # stopped on purpose
                reason = self.workers.failure()
                if reason is not None:
                    self.failure = reason
                    on_lost(reason)
                    return
        threading.Thread(target=run, daemon=True, name="tp-watchdog").start()

    def shutdown(self) -> None:
        # Not live before the stop goes out: the workers exit as soon as they read it, and the watchdog
        # must not take that for a lost worker.
        was_live, self.live = self.live, False
        told = False
        if self.failure is None and was_live:
            try:
                self.channel.send_stop()
                told = True
            except RuntimeError:
                pass
        self.workers.stop(timeout=0 if self.failure else 10.0)   # after a failure they may wait in a collective
        # The group is torn down only once every rank has exited, on the other hosts as on this one (whose
        # workers were always joined first): a core that tore its side down while another host's rank was
        # still alive now and then aborted on a clean stop ("terminate called without an active exception",
        # exit -6).
        missing = self.remote_nodes.wait_stopped(timeout=10.0 if told else 0)
        if missing and told:
            log.warning("tensor-parallel node(s) %s did not report their ranks stopped within 10 s", missing)
        if dist.is_initialized():
            dist.destroy_process_group()     # so a later engine in this process can form its own group
