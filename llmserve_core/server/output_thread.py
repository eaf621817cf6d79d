"""Output thread: turns the busy loop's results into one encoded message per client and hands the frames to
the socket thread over an inproc PAIR (only the socket thread may touch the ROUTER socket)."""
from __future__ import annotations

import logging
import queue
import threading

import zmq

from llmserve_proto import (EngineError, Logprobs, OutputBatch, PooledBatch, PoolingOutput, RequestError,
                            RequestOutput, StatsReply, encode)
from llmserve_core.server.events import Broadcast, ErrorReply, SocketFailed, StatsResult, StepResult

log = logging.getLogger("llmserve_core.server")

BROADCAST = b""   # routing id meaning "every client"; ZMQ never hands out an empty one


def to_wire_logprobs(lps) -> list[Logprobs] | None:
    if lps is None:
        return None
    return [Logprobs(logprob=float(lp.logprob), top_token_ids=[int(t) for t, _ in lp.top],
                     top_logprobs=[float(v) for _, v in lp.top]) for lp in lps]


def scalar_stats(stats: dict) -> dict:
    """Keep the wire format to plain scalars whatever the engine puts in its stats."""
    out = {}
    for k, v in stats.items():
        if v is None or isinstance(v, (bool, int, float, str)):
            out[str(k)] = v
        elif hasattr(v, "item"):
            out[str(k)] = v.item()
        else:
            out[str(k)] = str(v)
    return out


class OutputThread(threading.Thread):
    def __init__(self, ctx: zmq.Context, pair_addr: str, out_q: queue.SimpleQueue, in_q: queue.SimpleQueue):
        super().__init__(name="llmserve-output", daemon=True)
        self.out_q = out_q
        self.in_q = in_q
        self.pair = ctx.socket(zmq.PAIR)
        self.pair.setsockopt(zmq.SNDHWM, 0)
        self.pair.connect(pair_addr)

    def run(self) -> None:
        try:
            while True:
                item = self.out_q.get()
                if isinstance(item, Broadcast):
                    self.pair.send_multipart([BROADCAST, encode(item.msg)])
                    if item.last:
                        self.pair.send_multipart([BROADCAST, b""])
                        return
                else:
                    for client, payload in self._encode(item):
                        self.pair.send_multipart([client, payload], copy=False)
        except Exception:
            # Without this thread nothing reaches a client again: tell them, and end the core (the socket
            # thread stops at the end marker; the busy loop exits non-zero).
            log.exception("output thread failed")
            reason = "output thread failed; see the core's log"
            self.pair.send_multipart([BROADCAST, encode(EngineError(message=reason, fatal=True))])
            self.pair.send_multipart([BROADCAST, b""])
            self.in_q.put(SocketFailed(reason))
        finally:
            self.pair.close(linger=1000)

    @staticmethod
    def _encode(item):
        if isinstance(item, StepResult):
            per_client: dict[bytes, list[RequestOutput]] = {}
            pooled: dict[bytes, list[PoolingOutput]] = {}
            for client, rid, so, metrics in item.items:
                if so.pooled is not None:       # a pooling request's one output (PooledBatch)
                    pooled.setdefault(client, []).append(PoolingOutput(
                        request_id=rid, embedding=so.pooled.embedding, logits=so.pooled.logits,
                        finish_reason=so.finish_reason, metrics=metrics))
                    continue
                per_client.setdefault(client, []).append(RequestOutput(
                    request_id=rid, token_ids=so.new_token_ids, finish_reason=so.finish_reason,
                    logprobs=to_wire_logprobs(so.logprobs), metrics=metrics,
                    prompt_logprobs=to_wire_logprobs(so.prompt_logprobs)))
            return ([(c, encode(OutputBatch(outputs=outs, step=item.step, time=item.time)))
                     for c, outs in per_client.items()] +
                    [(c, encode(PooledBatch(outputs=outs, step=item.step, time=item.time)))
                     for c, outs in pooled.items()])
        if isinstance(item, ErrorReply):
            return [(item.client, encode(RequestError(request_id=item.request_id, field=item.field,
                                                      message=item.message)))]
        if isinstance(item, StatsResult):
            return [(item.client, encode(StatsReply(nonce=item.nonce, stats=scalar_stats(item.stats))))]
        raise TypeError(f"output thread got {type(item).__name__}")
