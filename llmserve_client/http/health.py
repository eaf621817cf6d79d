"""Health probes for load balancers and orchestrators, as vLLM names them.

- /health, readiness: may traffic be sent here? 200 while a core serves; 503 (with Retry-After) once none
  answers, and from the moment a drain starts, whether the core's (SIGTERM to llmserve-core: it finishes
  what runs and refuses new requests) or this frontend's own (SIGTERM to llmserve-serve). Over several
  cores, 200 "degraded" while some serve, each core's state listed; a draining core does not serve.
- /live, liveness: should this process be restarted? 200 while the frontend can still serve at all,
  draining included (a restart would kill the requests the drain is finishing); 503 only once it never
  can again (every core gone for good). It asks the cores nothing, so a core busy with a flood never makes
  the frontend look dead.
"""
from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmserve_client.errors import LLMServeError

STATS_TIMEOUT_S = 2.0                 # /health and /metrics give up on a core this slow
RETRY_AFTER_S = 5                     # what a 503 asks clients to wait: a core restarts or drains meanwhile
# What /health says about each core when there are several.
HEALTH_CORE_KEYS = ("endpoint", "up", "draining", "error", "in_flight", "routed", "running", "waiting", "kv_usage",
                    "prefix_hit_rate")


def retry_after(status: int) -> dict | None:
    return {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None


def _unavailable(status: str, **fields) -> Response:
    return JSONResponse({"status": status, **fields}, 503, headers=retry_after(503))


class Health:
    def __init__(self, client):
        self.client = client
        self.draining = False          # set when this frontend is asked to stop

    async def ready(self, request: Request) -> Response:
        if self.draining:
            return _unavailable("draining", error="the server is shutting down")
        try:
            stats = await self.client.stats(timeout=STATS_TIMEOUT_S)
        except (LLMServeError, asyncio.TimeoutError) as e:
            return _unavailable("unavailable", error=str(e) or "the core did not answer")
        if "cores" not in stats:
            if stats.get("draining"):
                return _unavailable("draining", error="the core is shutting down")
            return JSONResponse({"status": "ok"})
        cores = [{k: c[k] for k in HEALTH_CORE_KEYS if k in c} for c in stats["cores"]]
        serving = sum(1 for c in cores if c["up"] and not c.get("draining"))
        if serving == 0:
            return _unavailable("draining", cores_up=0, cores=cores)
        status = "degraded" if serving < stats["num_cores"] else "ok"
        return JSONResponse({"status": status, "cores_up": serving, "cores": cores})

    async def live(self, request: Request) -> Response:
        gone = self.client.gone_for_good
        if gone is not None:
            return _unavailable("dead", error=str(gone))
        return JSONResponse({"status": "draining" if self.draining else "alive"})
