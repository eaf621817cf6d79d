"""The clients of a soak (see soak.py), each a loop on its own thread until `stop` is set.

Well-behaved clients send small valid requests and time them: their waits are what the soak bounds.
The others misbehave on purpose: random (sometimes invalid) sampling parameters, aborts, streams dropped
half way, a flood of requests, a client that never reads its socket, and client processes that are
SIGKILLed while they stream. Every outcome is counted in a Tally under a kind, so the report shows what
happened; only outcomes that cannot be right (an error for a valid request, a wait past the bound)
count against the run.
"""
from __future__ import annotations

import asyncio
import collections
import json
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import zmq

from llmserve_client import AsyncClient, Client, EngineDeadError, LLMServeError, RequestError
from llmserve_proto import Generate, GuidedDecoding, Hello, Ping, SamplingParams, encode

TEXTS = ["def add(a, b):", "Return the value of", "The parser returns", "import os\n", "class Stack:",
         "while True:", "Raise ValueError if"]
VOCAB = 1024        # the shipped tiny model's: ids from here on are out of range


class Tally:
    """Thread-safe counters of outcomes by (role, kind), and the well-behaved clients' waits."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.waits: list[float] = []
        self.stats_waits: list[float] = []
        self.slowest: tuple[float, str] = (0.0, "")

    def count(self, role: str, kind: str, n: int = 1) -> None:
        with self._lock:
            self.counts[(role, kind)] += n

    def wait(self, seconds: float, what: str) -> None:
        with self._lock:
            self.waits.append(seconds)
            if seconds > self.slowest[0]:
                self.slowest = (seconds, what)

    def by_kind(self) -> dict[str, int]:
        with self._lock:
            out = collections.Counter()
            for (_, kind), n in self.counts.items():
                out[kind] += n
            return dict(sorted(out.items()))

    def by_role(self) -> dict[str, dict[str, int]]:
        with self._lock:
            out: dict[str, dict[str, int]] = collections.defaultdict(dict)
            for (role, kind), n in sorted(self.counts.items()):
                out[role][kind] = n
            return dict(out)


def _ids(rng: random.Random, lo: int = 4, hi: int = 32) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(rng.randint(lo, hi))]


def random_sampling(rng: random.Random, http: bool = False) -> tuple[dict, bool]:
    """(SamplingParams keywords, valid?) drawn across each field's range, with extremes and, one time in
    eight, a value the core must refuse. For an HTTP body (http=True): no logprobs, grammars or prompt
    logprobs, bad values included (they mean different things on the two endpoints), a seed is bad only
    outside int64, as OpenAI's is, and logit_bias keys are strings."""
    kw = {"max_tokens": rng.randint(1, 48), "temperature": rng.choice([0.0, 1e-6, 0.3, 0.7, 1.0, 1.5, 2.0]),
          "top_p": rng.choice([1.0, 0.95, 0.5, 0.1, 1e-3]), "top_k": rng.choice([-1, 0, 1, 5, 50, 1000]),
          "min_p": rng.choice([0.0, 0.05, 0.5, 1.0]), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        kw["seed"] = rng.randrange(0, 2**63)
    if not http and rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 1, 5, 20])
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(0, 1000) for _ in range(rng.randint(1, 4))]
    _logit_edits(rng, kw, http)
    if not http:
        _guided_and_prompt_logprobs(rng, kw)
    if rng.random() < 0.125:
        bad = rng.choice([("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 2.0), ("top_k", -5),
                          ("max_tokens", 0), ("seed", -2**63 - 1 if http else -1), ("seed", 2**64),
                          ("stop_token_ids", [10**30]), ("presence_penalty", 2.5), ("repetition_penalty", 0.0),
                          ("min_tokens", 10**6), ("logit_bias", {"5": 101.0} if http else {5: float("nan")})]
                         + ([("logprobs", 21), ("prompt_logprobs", 21), ("logit_bias", {VOCAB: 1.0}),
                             ("guided", GuidedDecoding(kind="regex", spec="(unclosed")),
                             ("guided", GuidedDecoding(kind="choice", choices=["a"], start_after=[1] * 17)),
                             ("guided", GuidedDecoding(kind="json_object", start_after=[VOCAB]))]
                            if not http else []))
        kw[bad[0]] = bad[1]
        return kw, False
    return kw, True


def _logit_edits(rng: random.Random, kw: dict, http: bool) -> None:
    """Penalties, biases and min_tokens (each step's logits edited on the core), within their ranges."""
    if rng.random() < 0.15:
        kw[rng.choice(["presence_penalty", "frequency_penalty"])] = rng.choice([-2.0, -0.5, 0.5, 2.0])
    if rng.random() < 0.1:
        kw["repetition_penalty"] = rng.choice([1e-3, 0.8, 1.2, 2.0])
    if rng.random() < 0.1:
        bias = {rng.randrange(3, VOCAB): rng.choice([-100.0, -1.0, 1.0, 100.0]) for _ in range(rng.randint(1, 3))}
        kw["logit_bias"] = {str(t): b for t, b in bias.items()} if http else bias
    if rng.random() < 0.1:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])


def _guided_and_prompt_logprobs(rng: random.Random, kw: dict) -> None:
    """A grammar (sometimes held only after a marker, as after a reasoning model's `</think>`), an opt-out of
    drafting, and the prompt's logprobs."""
    if rng.random() < 0.1:
        kind = rng.choice(["json_object", "regex", "choice", "json"])
        g = {"json_object": dict(), "regex": dict(spec="[a-z]{1,8}( [a-z]{1,8}){0,3}"),
             "choice": dict(choices=["yes", "no", "maybe"]),
             "json": dict(spec=json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                           "required": ["n"]}))}[kind]
        after = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 2))] if rng.random() < 0.5 else []
        kw["guided"] = GuidedDecoding(kind=kind, start_after=after, **g)
    if rng.random() < 0.1:
        kw["speculative"] = False
    if rng.random() < 0.1:
        kw["prompt_logprobs"] = rng.choice([0, 1, 20])


# ------------------------------------------------------------------------------------------ well-behaved

def well_behaved_ipc(endpoint: str, tally: Tally, stop: threading.Event, seed: int) -> None:
    rng, role = random.Random(seed), "well_behaved_ipc"
    with Client(endpoint, connect_timeout=120, client_name="soak-well-behaved") as c:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                c.generate(_ids(rng, 4, 16), max_tokens=rng.randint(1, 8), temperature=0.0)
                tally.count(role, "ok")
            except LLMServeError as e:
                tally.count(role, f"error:{type(e).__name__}")
            tally.wait(time.monotonic() - t0, role)
            stop.wait(rng.uniform(0.05, 0.3))


def well_behaved_http(base: str, tally: Tally, stop: threading.Event, seed: int) -> None:
    rng, role = random.Random(seed), "well_behaved_http"
    with httpx.Client(base_url=base, timeout=600) as h:
        while not stop.is_set():
            body = {"prompt": _ids(rng, 4, 16), "max_tokens": rng.randint(1, 8), "temperature": 0}
            t0 = time.monotonic()
            try:
                r = h.post("/v1/completions", json=body)
                tally.count(role, "ok" if r.status_code == 200 else f"error:http_{r.status_code}")
            except httpx.HTTPError as e:
                tally.count(role, f"error:{type(e).__name__}")
            tally.wait(time.monotonic() - t0, role)
            stop.wait(rng.uniform(0.05, 0.3))


def stats_poller(endpoint: str, tally: Tally, stop: threading.Event) -> None:
    """A client asking only for stats: its answers are bounded like any well-behaved wait."""
    role = "stats"
    with Client(endpoint, connect_timeout=120, client_name="soak-stats") as c:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                c.stats(timeout=600)
                tally.count(role, "ok")
            except (LLMServeError, TimeoutError) as e:
                tally.count(role, f"error:{type(e).__name__}")
            with tally._lock:
                tally.stats_waits.append(time.monotonic() - t0)
            stop.wait(1.0)


# ------------------------------------------------------------------------------------------ misbehaving

def chaos_ipc(endpoint: str, tally: Tally, stop: threading.Event, seed: int) -> None:
    """Random parameters, text prompts with stop strings, aborts and streams closed half way."""
    rng, role = random.Random(seed), "chaos_ipc"
    with Client(endpoint, connect_timeout=120, client_name="soak-chaos") as c:
        while not stop.is_set():
            kw, valid = random_sampling(rng)
            prompt = rng.choice(TEXTS) if rng.random() < 0.3 else _ids(rng)
            if isinstance(prompt, str) and rng.random() < 0.5:
                kw["stop"] = [rng.choice(["\n", "return", "(", "e"])]
            action = rng.choice(["generate", "close_early", "abort"])
            try:
                s = c.stream(prompt, **kw)
                if action == "generate":
                    for _ in s:
                        pass
                    kind = "ok"
                else:
                    with s:
                        for i, _ in enumerate(s):
                            if i >= rng.randint(0, 3):
                                if action == "abort":
                                    c.abort(s.request_id)
                                    for _ in s:
                                        pass
                                break
                    kind = "aborted" if action == "abort" else "closed_early"
                if not valid:
                    kind = "error:invalid_accepted"
            except RequestError:
                kind = "rejected" if not valid else "error:valid_rejected"
            except EngineDeadError as e:
                kind = f"error:{type(e).__name__}"
            tally.count(role, kind)


def chaos_http(base: str, tally: Tally, stop: threading.Event, seed: int) -> None:
    """Random OpenAI bodies (some invalid), streams dropped after a few events, chat and completions."""
    rng, role = random.Random(seed), "chaos_http"
    with httpx.Client(base_url=base, timeout=600) as h:
        while not stop.is_set():
            kw, valid = random_sampling(rng, http=True)
            chat = rng.random() < 0.4
            if chat:
                body = {"messages": [{"role": "user", "content": rng.choice(TEXTS)}], **kw}
                path = "/v1/chat/completions"
            else:
                body = {"prompt": rng.choice(TEXTS) if rng.random() < 0.5 else _ids(rng), **kw}
                path = "/v1/completions"
            if rng.random() < 0.05:
                body["n"] = 2          # two choices (their copies share the prompt's KV)
            drop = rng.random() < 0.4
            body["stream"] = drop or rng.random() < 0.3
            try:
                with h.stream("POST", path, content=json.dumps(body),
                              headers={"Content-Type": "application/json"}) as r:
                    if r.status_code != 200:
                        r.read()
                        kind = ("rejected" if not valid and r.status_code == 400
                                else f"error:http_{r.status_code}")
                    elif drop:
                        for i, _ in enumerate(r.iter_lines()):
                            if i >= rng.randint(1, 4):
                                break
                        kind = "disconnected" if valid else "error:invalid_accepted"
                    else:
                        r.read()
                        kind = "ok" if valid else "error:invalid_accepted"
            except httpx.HTTPError as e:
                kind = f"error:{type(e).__name__}"
            tally.count(role, kind)


def flood(endpoint: str, tally: Tally, stop: threading.Event, inflight: int, seed: int) -> None:
    """One client keeping `inflight` requests queued at all times (refusals from a per-client cap are
    counted, and the flood keeps pushing)."""
    role = "flood"

    async def main():
        rng = random.Random(seed)
        async with AsyncClient(endpoint, connect_timeout=120, client_name="soak-flood") as c:
            sem = asyncio.Semaphore(inflight)

            async def one():
                try:
                    await c.generate(_ids(rng, 8, 32), max_tokens=rng.randint(8, 48), ignore_eos=True,
                                     temperature=0.8)
                    tally.count(role, "ok")
                except RequestError:
                    tally.count(role, "rejected")
                    await asyncio.sleep(0.05)
                except EngineDeadError as e:
                    tally.count(role, f"error:{type(e).__name__}")
                    await asyncio.sleep(0.5)
                finally:
                    sem.release()

            tasks = set()
            while not stop.is_set():
                await sem.acquire()
                t = asyncio.ensure_future(one())
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def never_reader(endpoint: str, tally: Tally, stop: threading.Event, per_second: int) -> None:
    """Speaks the protocol on a raw socket, keeps its session alive with pings and sends long requests,
    but never reads a reply: what the core queues for it must stay bounded."""
    role = "never_reader"
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)      # take nothing off the wire beyond one message
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(encode(Hello(client_name="soak-never-reads")))
        params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=1.0)
        n = 0
        while not stop.wait(1.0):
            sock.send(encode(Ping(time=time.monotonic())))
            for _ in range(per_second):
                n += 1
                sock.send(encode(Generate(request_id=f"unread-{n}", prompt_token_ids=[5, 6, 7, 8, 9, 10],
                                          params=params)))
            tally.count(role, "sent", per_second)
    finally:
        sock.close(0)


VICTIM = """
import sys, threading
from llmserve_client import Client
c = Client(sys.argv[1], connect_timeout=120)
streams = [c.stream([5, 6, 7, 8], max_tokens=400, ignore_eos=True) for _ in range(4)]
next(iter(streams[0]))
print("streaming", flush=True)
threading.Event().wait()
"""


def killer(endpoint: str, tally: Tally, stop: threading.Event, every_s: float, seed: int, env: dict) -> None:
    """Start client processes that stream, and SIGKILL each after a random moment."""
    rng, role = random.Random(seed), "killed_clients"
    while not stop.wait(rng.uniform(0.5, 1.5) * every_s):
        p = subprocess.Popen([sys.executable, "-c", VICTIM, endpoint], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=env)
        try:
            ready = _wait_line(p, 30.0)
            stop.wait(rng.uniform(0.0, 1.0))
            p.send_signal(signal.SIGKILL)
            tally.count(role, "killed_streaming" if ready else "killed_before_streaming")
        finally:
            p.kill()
            p.wait()
            p.stdout.close()


def _wait_line(p: subprocess.Popen, timeout: float) -> bool:
    got = threading.Event()

    def read():
        if p.stdout.readline():
            got.set()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return got.wait(timeout)
