"""`llmserve-serve`: the OpenAI-compatible HTTP frontend.

    llmserve-serve --endpoint ipc:///run/llmserve/core.sock          # a core that is already running
    llmserve-serve --endpoint tcp://a:5555 --endpoint tcp://b:5555   # several cores of one model
    llmserve-serve --model DIR [core flags ...]                      # start (and later stop) its own core
    llmserve-serve --model DIR --data-parallel-size 2 [core flags]   # ... or several, one per GPU

With --model, every flag this parser does not know is handed to llmserve-core (e.g. --max-model-len 4096
--enable-prefix-caching); the core checks them and a bad one ends both with exit status 2. The core
listens on a socket in a fresh private directory unless a --listen is among those flags.

Over several cores each request goes to the least loaded one, preferring the core that already holds its
prompt's first KV block (llmserve_client/router.py).

When a core dies its in-flight requests fail (503, or an error event in a stream) and the others keep
serving; /health says "degraded" while some are down and answers 503 once none is up. With --endpoint the
frontend reconnects as soon as a core serving the same model answers on the endpoint again (a core back
with another model is left out for good; when that has happened to all, the frontend exits with status 1).
With --model the cores are the frontend's own: one that exits stays out, and the frontend exits with
status 1 once all have, leaving restarts to its supervisor (systemd Restart=on-failure, a Kubernetes
restart policy): restarting a core here would hide a crash loop from the one place that can see it.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys

from llmserve_client.core_flags import flag_value
from llmserve_client.http.core_procs import CORE_STOP_TIMEOUT_S, OwnedCore, start_cores, stop_cores
from llmserve_client.http.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEAD_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from llmserve_client.pooling import DEFAULT_MAX_POOLING_INPUTS
from llmserve_client.http.reasoning import PARSERS as REASONING_PARSERS
from llmserve_client.http.tool_parsers import PARSERS as TOOL_PARSERS

log = logging.getLogger("llmserve_client.http")

MAX_DATA_PARALLEL = 1024


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmserve-serve", allow_abbrev=False,   # a core flag must never be taken for a prefix of ours
        description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/responses, "
                    "/v1/embeddings, /v1/score, /v1/rerank, /v1/models, /health, /live, /metrics) in front of "
                    "llmserve-core. Flags not listed here are passed to "
                    "llmserve-core when --model is given.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--endpoint", action="append",
                     help="ipc://PATH or tcp://HOST:PORT of a running llmserve-core; repeat it to serve over "
                          "several cores of one model (default, without --model: the core's default socket)")
    src.add_argument("--model", help="model directory: start llmserve-core on it as a child process")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="M",
                   help="with --model: start M cores (each its own process, on CUDA each on its own GPU(s) "
                        "through CUDA_VISIBLE_DEVICES) and route requests over them (default: 1)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="name(s) clients may use in `model`, all listed by /v1/models; the first is the default "
                        "(default: the model dir's name)")
    p.add_argument("--api-key", default=os.environ.get("LLMSERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $LLMSERVE_API_KEY; unset: open)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model directory the core serves)")
    p.add_argument("--connect-timeout", type=float, default=None,
                   help="seconds to wait for the core's handshake (default: 60 with --endpoint, 900 with --model)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body accepted, in bytes; larger ones get 413 unread "
                        f"(default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help=f"seconds a request body may take to arrive after its head; then 408 and the connection "
                        f"is closed (default: {DEFAULT_BODY_TIMEOUT_S:g})")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEAD_TIMEOUT_S,
                   help=f"seconds a connection may take to send a complete request head, from its opening or the "
                        f"previous response; then it is closed (default: {DEFAULT_HEAD_TIMEOUT_S:g})")
    p.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                   help="split thinking (<think>...</think>) into message.reasoning_content (qwen3)")
    p.add_argument("--tool-call-parser", choices=list(TOOL_PARSERS), default=None,
                   help="the format of tool calls that tool_choice auto returns as message.tool_calls: hermes "
                        "(Qwen3's <tool_call> JSON) or qwen3_coder (Qwen3-Coder's XML) (default: the one the "
                        "model's chat template shows; required and named tool choices need no parser)")
    p.add_argument("--strict-requests", action="store_true",
                   help="refuse (400) request fields that no OpenAI or vLLM schema defines, instead of ignoring "
                        "them (fields OpenAI defines but this server does not implement are ignored either way, "
                        "and named in the llmserve-ignored-fields response header)")
    p.add_argument("--max-pooling-inputs", type=int, default=DEFAULT_MAX_POOLING_INPUTS, metavar="N",
                   help=f"texts one /v1/embeddings input, /v1/score or /v1/rerank request may carry; more are a 400 "
                        f"(default: {DEFAULT_MAX_POOLING_INPUTS}, OpenAI's)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def parse_args(argv: list[str]):
    """(args, core_flags); exits 2 with a message on bad input."""
    parser = build_parser()
    args, core_flags = parser.parse_known_args(argv)
    if core_flags and args.model is None:
        parser.error(f"unrecognized arguments: {' '.join(core_flags)} (engine flags need --model)")
    if args.model is not None and not os.path.isdir(args.model):
        parser.error(f"--model: {args.model!r} is not a directory")
    for endpoint in args.endpoint or []:
        if not endpoint.startswith(("ipc://", "tcp://")):
            parser.error(f"--endpoint: expected ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")
    if args.endpoint is not None and len(set(args.endpoint)) != len(args.endpoint):
        parser.error("--endpoint: an endpoint is listed twice")
    if not 1 <= args.data_parallel_size <= MAX_DATA_PARALLEL:
        parser.error(f"--data-parallel-size: must be in [1, {MAX_DATA_PARALLEL}], got {args.data_parallel_size}")
    if args.data_parallel_size > 1 and args.model is None:
        parser.error("--data-parallel-size: needs --model (over running cores, repeat --endpoint instead)")
    _check_tensor_parallel_flags(parser, args, core_flags)
    if not 0 <= args.port < 65536:
        parser.error(f"--port: {args.port} is not a port number")
    if args.connect_timeout is not None and not args.connect_timeout > 0:
        parser.error("--connect-timeout: must be > 0")
    if args.api_key is not None and not args.api_key.strip():
        parser.error("--api-key: must not be empty (leave the flag and $LLMSERVE_API_KEY unset to serve without a key)")
    if not 1 <= args.max_pooling_inputs <= 1 << 20:
        parser.error(f"--max-pooling-inputs: must be in [1, {1 << 20}], got {args.max_pooling_inputs}")
    if not 0 < args.max_body_bytes < 2**40:
        parser.error(f"--max-body-bytes: must be a positive number of bytes, got {args.max_body_bytes}")
    for flag in ("body_timeout", "header_timeout"):
        if not 0 < getattr(args, flag) < 86400:
            parser.error(f"--{flag.replace('_', '-')}: must be > 0 and under a day, got {getattr(args, flag)}")
    if args.served_model_name is None and args.model is not None:
        args.served_model_name = [os.path.basename(os.path.abspath(args.model))]
    return args, core_flags


async def _serve(args, endpoints: list[str], cores: list[OwnedCore], stopping: list[int]) -> int:
    import uvicorn

    from llmserve_client.async_client import AsyncClient
    from llmserve_client.errors import LLMServeError
    from llmserve_client.http.app import build_app
    from llmserve_client.http.limits import head_timeout_protocol

    timeout = args.connect_timeout or (900.0 if cores else 60.0)
    client = AsyncClient(endpoints, tokenizer=args.tokenizer, connect_timeout=timeout, client_name="llmserve-serve")
    try:
        app = build_app(client, args.served_model_name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                        body_timeout_s=args.body_timeout, reasoning_parser=args.reasoning_parser,
                        tool_call_parser=args.tool_call_parser, strict_requests=args.strict_requests,
                        max_pooling_inputs=args.max_pooling_inputs)
        starting = asyncio.ensure_future(app.state.frontend.start())
        while not starting.done():
            await asyncio.wait({starting}, timeout=0.2)
            exited = next((c for c in cores if c.proc.poll() is not None), None)
            if exited is not None:
                starting.cancel()
                log.error("llmserve-core at %s exited with status %d before it was ready", exited.endpoint,
                          exited.proc.returncode)
                return exited.proc.returncode or 1
            if stopping:
                starting.cancel()
                return 0
        try:
            starting.result()
        except LLMServeError as e:
            log.error("cannot reach llmserve-core at %s: %s", " ".join(endpoints), e)
            return 1
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=CORE_STOP_TIMEOUT_S,
                                http=head_timeout_protocol(args.header_timeout))
        server = uvicorn.Server(config)
        _drain_visibly(server, app.state.frontend)
        failed: list[str] = []
        watcher = asyncio.ensure_future(_watch_cores(cores, client, server, failed))
        await server.serve()
        watcher.cancel()
        if not server.started:
            return 1
        return 1 if failed else 0
    finally:
        await client.close()


def _drain_visibly(server, frontend) -> None:
    """From the signal that starts uvicorn's graceful shutdown, /health answers 503 (draining) on the
    connections still served, while the requests in flight finish."""
    stop = server.handle_exit

    def handle_exit(sig, frame):
        frontend.probes.draining = True
        stop(sig, frame)
    server.handle_exit = handle_exit


async def _watch_cores(cores: list[OwnedCore], client, server, failed: list[str]) -> None:
    """End the frontend when it can never serve again: all its own cores exited (a supervisor restarts it),
    or every core on the endpoints came back with another model. A core lost while others serve is logged."""
    told: set[str] = set()
    while True:
        for c in cores:
            if c.proc.poll() is not None and c.endpoint not in told:
                told.add(c.endpoint)
                log.error("llmserve-core at %s exited with status %d", c.endpoint, c.proc.returncode)
        for endpoint, why in client.cores_gone_for_good:
            if endpoint not in told:
                told.add(endpoint)
                log.error("left out for good: %s", why)
        if cores and all(c.proc.poll() is not None for c in cores):
            failed.append("every llmserve-core of this frontend exited" if len(cores) > 1
                          else f"llmserve-core exited with status {cores[0].proc.returncode}")
            break
        if client.gone_for_good is not None:
            failed.append(str(client.gone_for_good))
            break
        await asyncio.sleep(0.2)
    log.error("%s; shutting down", failed[0])
    server.should_exit = True


def _check_tensor_parallel_flags(parser, args, core_flags: list[str]) -> None:
    """The frontend's cores run tensor parallelism on this host, or as node 0 of several hosts (one core)."""
    node_rank = flag_value(core_flags, "--node-rank")
    if node_rank not in (None, "0"):
        parser.error(f"--node-rank: the frontend's core is node 0 and serves the requests; run node {node_rank} "
                     f"as llmserve-core on its own host")
    if args.data_parallel_size > 1:
        for flag, allowed in (("--nnodes", (None, "1")), ("--dist-init-addr", (None,))):
            if flag_value(core_flags, flag) not in allowed:
                parser.error(f"{flag}: each core of --data-parallel-size runs its ranks on this host, with a "
                             f"rendezvous of its own; leave {flag} out")


def main(argv: list[str] | None = None) -> int:
    args, core_flags = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from llmserve_client import run
    from llmserve_proto import default_endpoint

    # Until uvicorn takes over the signals (and after it hands them back), a signal only asks us to stop.
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    cores, tmpdir = [], None
    endpoints = args.endpoint or [default_endpoint()]
    if args.model is not None:
        try:
            cores, tmpdir = start_cores(args.model, [*core_flags, "--log-level", args.log_level.upper()],
                                        args.data_parallel_size)
        except ValueError as e:
            build_parser().error(str(e))
        endpoints = [c.endpoint for c in cores]
    try:
        return run(_serve(args, endpoints, cores, stopping))
    finally:
        for c, code in zip(cores, stop_cores(cores)):
            log.info("llmserve-core at %s exited with status %d", c.endpoint, code)
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
