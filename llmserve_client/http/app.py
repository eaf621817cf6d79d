"""The OpenAI-compatible HTTP app: one more thin client of llmserve-core, through AsyncClient.

Text lives here as in every client: prompts and chat messages are tokenized here, the core gets token ids,
and streamed ids come back as text through the client library's detokenizer and stop-string logic.
Tokenizing and rendering chat templates run on worker threads (tokenize_pool.py), so a huge prompt never
stalls the event loop (/health and every other request keep flowing) nor another request's tokenizing; a
prompt that cannot fit max_model_len is refused from its characters and message count before it is
tokenized at all (limits.py). Each request reaches the core with its user (identity.py), among whom the
core shares its slots fairly.
A request whose HTTP client goes away is cancelled, and cancelling an AsyncStream aborts it in the core.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import time
import uuid
from collections import Counter
from functools import lru_cache

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmserve_client.async_client import AsyncClient, AsyncStream
from llmserve_client.errors import EngineDeadError, LLMServeError, RequestError
from llmserve_client.http import pooling, responses, schemas
from llmserve_client.http.health import STATS_TIMEOUT_S, Health, retry_after
from llmserve_client.http.identity import Requester
from llmserve_client.http.limits import (COUNT_FIRST_BYTES, DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimit,
                                         chars_per_token, chat_size, fewest_tokens, message_count)
from llmserve_client.http.chat_output import ChoiceShaper, guided_after_reasoning, render_chat
from llmserve_client.http.guided import error_param, guided_from_request
from llmserve_client.http.metrics import CONTENT_TYPE, Metrics
from llmserve_client.http.reasoning import END as THINK_END
from llmserve_client.http.schemas import ApiError
from llmserve_client.http.streams import ClientGone, exhaust, merge, until_disconnect
from llmserve_client.http.tokenize_pool import TokenizePool
from llmserve_client.http.request_fields import HEADER as IGNORED_HEADER, IgnoredFieldLog, check_content_type, \
    check_neutral, decode as decode_request, header_value, thinking_switch
from llmserve_client.http.tool_parsers import detect_parser
from llmserve_client.http.tools import tool_setup
from llmserve_client.inputs import to_token_ids
from llmserve_client.pooling import DEFAULT_MAX_POOLING_INPUTS
from llmserve_client.types import Completion, StreamChunk, Usage

DEFAULT_COMPLETION_MAX_TOKENS = 16    # OpenAI's default for /v1/completions

log = logging.getLogger("llmserve_client.http")


class Frontend:
    def __init__(self, client: AsyncClient, served_model_names: list[str] | None = None,
                 reasoning_parser: str | None = None, tool_call_parser: str | None = None,
                 strict_requests: bool = False, api_key: str | None = None,
                 max_pooling_inputs: int = DEFAULT_MAX_POOLING_INPUTS):
        self.client = client
        self.api_key = api_key                       # the server's own key names no user (identity.py)
        self.max_pooling_inputs = max_pooling_inputs     # texts one embeddings, score or rerank request may carry
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser     # None: chosen from the chat template at start()
        self.strict_requests = strict_requests       # unknown request fields are a 400, not ignored
        self.thinking_switch = False                 # the chat template reads enable_thinking
        self.ignored_log = IgnoredFieldLog()
        self.names = list(served_model_names or [])
        self.tokenizer = None
        self.reasoning_end_ids: list[int] | None = None    # `</think>`'s token ids, with a reasoning parser
        self.max_model_len = 0
        self.chars_per_token = 1      # honest text has at least n / this tokens in n characters (limits.py)
        self.created = int(time.time())
        self.metrics: Metrics | None = None
        self.probes = Health(client)
        self._tokenize_pool = TokenizePool()

    async def start(self) -> None:
        """Wait for the core's handshake and load the tokenizer it names (once: the CLI calls this before
        uvicorn's startup does)."""
        if self.metrics is not None:
            return
        await self.client.connect()
        self.tokenizer = await self.client.get_tokenizer()
        info = self.client.model_info
        self.max_model_len = info.max_model_len
        self._tokenize_pool.start(self.tokenizer)
        self.chars_per_token = chars_per_token(await self._tokenize_pool.run(0, _longest_token_chars))
        if self.reasoning_parser is not None:
            self.reasoning_end_ids = await self._tokenize_pool.run(
                0, lambda tok: list(tok.encode(THINK_END, add_special_tokens=False)))
        template = getattr(self.tokenizer, "chat_template", None)
        if self.tool_call_parser is None:
            self.tool_call_parser = detect_parser(template)
            log.info("tool calls with tool_choice auto: %s", f"parsed as {self.tool_call_parser} (from the chat "
                     f"template)" if self.tool_call_parser else "unavailable (the chat template shows no format)")
        self.thinking_switch = "enable_thinking" in str(template or "")
        if not self.names:
            self.names = [info.name or info.model.rstrip("/").rsplit("/", 1)[-1]]
        self.metrics = Metrics(self.names[0])
        self._token_text = lru_cache(maxsize=65536)(
            lambda tid: self.tokenizer.decode([tid], skip_special_tokens=False))
        self._token_bytes = lru_cache(maxsize=65536)(
            lambda tid: _token_bytes(self.tokenizer, tid, self._token_text(tid)))

    @property
    def max_request_tokens(self) -> int:
        """Prompt + completion the cores can hold (max_model_len, or less on a small pool). Read at each use:
        a core may come back on its endpoint with another pool."""
        return min(self.max_model_len, self.client.max_request_tokens or self.max_model_len)

    # ---------------------------------------------------------------- endpoints
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card(n) for n in self.names]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.names:
            return self._error(_model_not_found(name))
        return JSONResponse(self._model_card(name))

    async def prometheus(self, request: Request) -> Response:
        try:
            stats = await self.client.stats(timeout=STATS_TIMEOUT_S)
        except (LLMServeError, asyncio.TimeoutError):
            stats = None
        return Response(self.metrics.render(stats), media_type=CONTENT_TYPE)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def embeddings(self, request: Request) -> Response:
        return await pooling.embeddings(self, request)

    async def score(self, request: Request) -> Response:
        return await pooling.score(self, request)

    async def rerank(self, request: Request) -> Response:
        return await pooling.rerank(self, request)

    async def responses(self, request: Request) -> Response:
        try:
            return await responses.serve(self, request)
        except Exception:
            log.exception("request failed")
            return self._error(ApiError("internal error", None, status=500, type="server_error"))

    # ---------------------------------------------------------------- generation
    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            return await self._generate_or_raise(request, chat)
        except Exception:
            # A bug must still answer in JSON and keep the connection usable (uvicorn drops a connection
            # whose app raised).
            log.exception("request failed")
            return self._error(ApiError("internal error", None, status=500, type="server_error"))

    async def _generate_or_raise(self, request: Request, chat: bool) -> Response:
        try:
            body = await request.body()
            if chat and len(body) > COUNT_FIRST_BYTES:      # counted before the decode builds every message
                self._check_length_early(0, message_count(body) or 0, "messages")
            req, ignored = self.decode(request, body, schemas.ChatRequest if chat else schemas.CompletionRequest,
                                       "chat" if chat else "completions")
            streams, ctx = await self._start(req, chat, ignored, requester=Requester(request.scope, self.api_key))
        except ApiError as e:
            return self._error(e)
        merged = merge(streams)
        try:
            if not req.stream:
                await until_disconnect(request, exhaust(merged))
                completions = ctx.completions(streams)
                for c in completions:
                    self.metrics.on_finished(c)
                return JSONResponse(self._full_response(ctx, completions), headers=ctx.headers)
            # The first chunk is awaited before answering, so a request the core rejects still gets a 400.
            first = await until_disconnect(request, anext(merged, None))
        except ClientGone:
            for c in ctx.completions(streams):
                self.metrics.on_finished(c)
            return Response(status_code=499)
        except LLMServeError as e:
            return self._error(self._api_error(e, chat, ctx.guided_source, ctx.error_names(e)))
        return StreamingResponse(self._sse(ctx, streams, merged, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **ctx.headers})

    def decode(self, request: Request, body: bytes, kind: type, endpoint: str):
        """(the request Struct, the set fields it ignores) from a body; a 400 for anything wrong with it."""
        check_content_type(request.headers.get("content-type"))
        req, ignored = decode_request(body, kind, endpoint, self.strict_requests)
        check_neutral(req, endpoint)
        return req, ignored

    def note_ignored(self, endpoint: str, ignored: list[str]) -> dict:
        """Log the ignored fields; the response headers that name them."""
        self.ignored_log.note(endpoint, ignored)
        return {IGNORED_HEADER: header_value(ignored)} if ignored else {}

    async def _start(self, req, chat: bool, ignored: list[str], endpoint: str | None = None,
                     max_calls: int | None = None, requester: Requester | None = None):
        """Validate, tokenize and send a decoded request (n engine requests per prompt, choice i of a seeded
        request seeded with seed + i); ApiError for anything wrong with it. ignored: the request's fields
        the server ignores, logged and named in a response header; endpoint: whose they are (default: chat
        or completions); max_calls: tool calls kept per choice; requester: who sent it (whom the core's
        fair shares count it for)."""
        if req.model is not None and req.model not in self.names:
            raise _model_not_found(req.model)
        if "generate" not in (self.client.model_info.tasks or ["generate"]):
            raise ApiError("this model serves embeddings and scores only (the core runs the pooling runner: an "
                           "embedding model, or --runner pooling); use /v1/embeddings, /v1/score or /v1/rerank",
                           "model")
        guided, source = guided_from_request(req)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        ctx = _Ctx(rid, self.names[0] if req.model is None else req.model, chat,
                   req.stream and req.stream_options is not None and req.stream_options.include_usage)
        ignored = list(ignored)
        ctx.continuous_usage = ctx.include_usage and req.stream_options.continuous_usage_stats
        ctx.echo_logprobs = not chat and req.echo and req.logprobs is not None
        ctx.vllm_prompt_logprobs = req.prompt_logprobs is not None
        if chat:
            sampling = schemas.chat_sampling(req)
            setup = tool_setup(req.tools, req.tool_choice, self.tool_call_parser)
            if setup.guided is not None:
                if guided is not None:
                    raise ApiError(f"{source} cannot be combined with tool_choice {req.tool_choice!r}", source)
                guided, source = setup.guided, "tool_choice"
            template_kwargs, effort_ignored = thinking_switch(req.reasoning_effort, req.chat_template_kwargs,
                                                              self.thinking_switch, "reasoning_effort")
            if effort_ignored:
                ignored.append("reasoning_effort")
            chars = self._check_length_early(*chat_size(req), "messages")
            messages = schemas.chat_messages(req)
            ids, prompt_text = await self._tokenize_pool.run(chars, render_chat, messages, setup.tools,
                                                             template_kwargs)
            prompts = [(ids, prompt_text)]
            guided = guided_after_reasoning(guided, prompt_text, self.reasoning_end_ids)
            max_tokens, param = ((req.max_completion_tokens, "max_completion_tokens")
                                 if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens"))
            shaper = lambda: ChoiceShaper(self.reasoning_parser is not None, prompt_text, setup.parser,
                                          req.parallel_tool_calls is not False, setup.tools, max_calls)
        else:
            sampling = schemas.completion_sampling(req)
            prompts = []
            many = schemas.completion_prompts(req)
            for p, prompt in enumerate(many):
                chars = self._check_length_early(len(prompt), 0, schemas.prompt_param(p, len(many))) \
                    if isinstance(prompt, str) else 0      # token ids: counted exactly below
                try:
                    ids = await self._tokenize_pool.run(chars, _prompt_ids, prompt)
                except RequestError as e:
                    raise self._api_error(e, chat, names={"prompt": schemas.prompt_param(p, len(many))}) from None
                prompts.append((ids, prompt if isinstance(prompt, str) else None))
            max_tokens, param = req.max_tokens, "max_tokens"
            shaper = None
        if guided is not None:
            sampling["guided"] = guided
        ctx.guided_source, ctx.n, ctx.num_prompts, ctx.max_tokens_param = source, req.n, len(prompts), param
        # echo with max_tokens 0 (OpenAI's legacy scoring call, which vLLM allows): the prompt alone comes back,
        # of the one token the core must generate nothing.
        ctx.echo_only = not chat and req.echo and max_tokens == 0
        jobs = []
        for p, (ids, prompt_text) in enumerate(prompts):
            where = "messages" if chat else schemas.prompt_param(p, len(prompts))
            n_tokens = self._fit_max_tokens(len(ids), 1 if ctx.echo_only else max_tokens, param, chat, where)
            if not chat and req.echo and prompt_text is None:
                prompt_text = await self._tokenize_pool.run(len(ids), lambda tok, ids: tok.decode(ids), ids)
            for i in range(req.n):
                index = p * req.n + i
                ctx.prompt_ids[index] = ids
                seed = sampling.get("seed")
                jobs.append((index, ids, {**sampling, "max_tokens": n_tokens,
                                          **({"seed": (seed + i) % schemas.SEED_SPAN} if seed is not None else {})}))
                if shaper is not None:
                    ctx.shapers[index] = shaper()
                if not chat and req.echo:
                    ctx.echo[index] = prompt_text
        streams: list[AsyncStream] = []
        user = requester.user(req.user) if requester is not None else ""
        try:
            for index, ids, params in jobs:
                streams.append(await self.client.stream(
                    ids, request_id=rid if len(jobs) == 1 else f"{rid}-{index}",
                    skip_special_tokens=req.skip_special_tokens, user=user, **params))
        except BaseException as e:
            for s in streams:     # choices already sent
                await s.aclose()
            if isinstance(e, LLMServeError):
                e.choice_index = jobs[len(streams)][0]             # the choice whose request was refused
                raise self._api_error(e, chat, source, ctx.error_names(e)) from None
            raise
        ctx.headers = self.note_ignored(endpoint or ("chat" if chat else "completions"), ignored)
        return streams, ctx

    def _check_length_early(self, chars: int, messages: int, where: str) -> int:
        """Refuse, before tokenizing, a text prompt (or chat) whose characters and messages prove it cannot
        fit; returns its characters. where: the request's name for it (messages, prompt, prompt[i])."""
        fewest = fewest_tokens(chars, messages, self.chars_per_token)
        if fewest >= self.max_model_len:
            size = f"{messages} messages and {chars} characters" if messages else f"{chars} characters"
            raise ApiError(f"This model's maximum context length is {self.max_model_len} tokens, but the {where} "
                           f"has {size}, at least {fewest} tokens. Shorten the {where}.",
                           where, code="context_length_exceeded")
        return chars

    def _fit_max_tokens(self, n_prompt: int, max_tokens: int | None, param: str, chat: bool, where: str) -> int:
        limit = self.max_model_len
        if n_prompt >= limit:
            raise ApiError(f"This model's maximum context length is {limit} tokens, but the {where} has "
                           f"{n_prompt} tokens, which leaves no room for a completion. Shorten the {where}.",
                           where, code="context_length_exceeded")
        if max_tokens is None:
            # OpenAI: chat completions run until the context is full (here: until what the KV pool can hold
            # for one request); completions default to 16 tokens.
            room = self.max_request_tokens - n_prompt
            if room < 1:
                raise ApiError(f"The {where} has {n_prompt} tokens; the server can hold at most "
                               f"{self.max_request_tokens} tokens for one request, which leaves no room for a "
                               f"completion. Shorten the {where}.", where, code="context_length_exceeded")
            return room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
        if max_tokens < 1:
            raise ApiError(f"{param} must be at least 1, got {max_tokens}", param)
        if n_prompt + max_tokens > limit:
            raise ApiError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{n_prompt + max_tokens} tokens ({n_prompt} in the {where}, {max_tokens} for the "
                           f"completion). Reduce the length of the {where} or {param}.", param,
                           code="context_length_exceeded")
        return max_tokens

    async def _sse(self, ctx: "_Ctx", streams: list[AsyncStream], merged, first):
        accounted = False
        try:
            if ctx.chat:
                for index in range(len(streams)):
                    yield _sse_data(self._chunk(ctx, index, {"delta": {"role": "assistant", "content": ""},
                                                             "logprobs": None, "finish_reason": None}))
            item = first
            while item is not None:
                index, chunk = item[0], ctx.shown(item[1])
                if ctx.continuous_usage:
                    ctx.generated[index] += len(chunk.token_ids)
                choice = self._stream_choice(ctx, index, chunk)
                if choice is not None:
                    yield _sse_data(self._chunk(ctx, index, choice))
                item = await anext(merged, None)
            completions = ctx.completions(streams)
            for c in completions:
                self.metrics.on_finished(c)
            accounted = True
            if ctx.include_usage:
                yield _sse_data({**self._chunk(ctx, 0, None), "usage": _usage(completions, ctx.n)})
        except LLMServeError as e:
            # Headers are gone already: the error travels as an event, which the openai package raises.
            err = self._api_error(e, ctx.chat, ctx.guided_source, ctx.error_names(e))
            self.metrics.on_error(err.status)
            accounted = True
            yield _sse_data(err.body())
        except Exception:
            # A bug here must still end the stream as a stream (an error event, then [DONE]): uvicorn would
            # cut the connection mid-response, which SSE clients take as a network failure.
            log.exception("stream failed")
            self.metrics.on_error(500)
            accounted = True
            yield _sse_data(ApiError("internal error", None, status=500, type="server_error").body())
        finally:
            # Reached on normal ends and on cancellation (the HTTP client went away): abort what still runs.
            await merged.aclose()
            if not accounted:
                for c in ctx.completions(streams):
                    self.metrics.on_finished(c)
        yield "data: [DONE]\n\n"

    def _stream_choice(self, ctx: "_Ctx", index: int, chunk: StreamChunk) -> dict | None:
        final = chunk.finish_reason is not None
        text = ctx.echo.pop(index, "") + chunk.text       # echo: the prompt leads the first chunk
        if not text and not final and not chunk.logprobs and not chunk.prompt_logprobs:
            return None
        if ctx.chat:
            shaper = ctx.shapers[index]
            delta = shaper.delta(text, final)
            if not delta and not final and not chunk.logprobs:
                return None
            logprobs = self._logprobs(ctx, index, chunk.token_ids, chunk.logprobs)
            return {"delta": delta, "logprobs": logprobs, "finish_reason": shaper.finish_reason(chunk.finish_reason),
                    "stop_reason": chunk.stop_reason}
        logprobs = self._logprobs(ctx, index, chunk.token_ids, chunk.logprobs, chunk.prompt_logprobs)
        return {"text": text, "logprobs": logprobs, "finish_reason": chunk.finish_reason,
                "stop_reason": chunk.stop_reason}

    def _chunk(self, ctx: "_Ctx", index: int, choice: dict | None) -> dict:
        out = {"id": ctx.id, "object": "chat.completion.chunk" if ctx.chat else "text_completion",
               "created": ctx.created, "model": ctx.model,
               "choices": [] if choice is None else [{"index": index, **choice}]}
        if ctx.include_usage:
            out["usage"] = _running_usage(ctx, index) if ctx.continuous_usage and choice is not None else None
        return out

    def _full_response(self, ctx: "_Ctx", completions: list[Completion]) -> dict:
        choices = []
        for i, c in enumerate(completions):
            choice = {"index": i, "logprobs": self._logprobs(ctx, i, c.token_ids, c.logprobs, c.prompt_logprobs),
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if ctx.chat:
                choice["message"], choice["finish_reason"] = ctx.shapers[i].message(c.text, c.finish_reason)
            else:
                choice["text"] = ctx.echo.get(i, "") + c.text
                if ctx.vllm_prompt_logprobs:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(c)
            choices.append(choice)
        out = {"id": ctx.id, "object": "chat.completion" if ctx.chat else "text_completion",
               "created": ctx.created, "model": ctx.model, "choices": choices, "usage": _usage(completions, ctx.n)}
        if ctx.chat and ctx.vllm_prompt_logprobs:
            out["prompt_logprobs"] = self._vllm_prompt_logprobs(completions[0])   # one prompt for every choice
        return out

    def _vllm_prompt_logprobs(self, c: Completion) -> list[dict | None] | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, decoded_token}}
        for the token itself and the top ones."""
        if c.prompt_logprobs is None:
            return None
        text = self._token_text
        return [None if lp is None else
                {str(a): {"logprob": _finite(b), "decoded_token": text(a)}
                 for a, b in [*zip(lp.top_token_ids, lp.top_logprobs), (t, lp.logprob)]}
                for t, lp in zip(c.prompt_token_ids, c.prompt_logprobs)]

    def _logprobs(self, ctx: "_Ctx", index: int, token_ids: list[int], logprobs, prompt_logprobs=None) -> dict | None:
        """OpenAI's chat shape ({"content": [...]}) or the legacy completions shape (parallel lists), where
        with echo the prompt's tokens lead (the first with null logprobs, as OpenAI and vLLM give it)."""
        if logprobs is None:
            return None
        pairs = list(zip(token_ids, logprobs))
        if ctx.echo_logprobs and prompt_logprobs is not None:
            pairs = list(zip(ctx.prompt_ids[index], prompt_logprobs)) + pairs
        text = self._token_text
        if ctx.chat:
            raw = self._token_bytes
            return {"content": [
                {"token": text(t), "logprob": _finite(lp.logprob), "bytes": raw(t),
                 "top_logprobs": [{"token": text(a), "logprob": _finite(b), "bytes": raw(a)}
                                  for a, b in zip(lp.top_token_ids, lp.top_logprobs)]}
                for t, lp in pairs]}
        offsets, at = [], ctx.text_offsets.get(index, 0)
        for t, _ in pairs:
            offsets.append(at)
            at += len(text(t))
        ctx.text_offsets[index] = at
        return {"tokens": [text(t) for t, _ in pairs],
                "token_logprobs": [None if lp is None else _finite(lp.logprob) for _, lp in pairs],
                "top_logprobs": [None if lp is None else {text(a): _finite(b)
                                                          for a, b in zip(lp.top_token_ids, lp.top_logprobs)}
                                 for _, lp in pairs],
                "text_offset": offsets}

    # ---------------------------------------------------------------- helpers
    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "llmserve",
                "root": self.client.model_info.model, "max_model_len": self.max_model_len}

    def _api_error(self, e: LLMServeError, chat: bool, guided_source: str | None = None,
                   names: dict[str, str] | None = None) -> ApiError:
        """names: a param as this request spells it where it differs from the default spelling (chat's
        max_completion_tokens; prompt[i] in a completion with several prompts)."""
        if isinstance(e, RequestError) and not e.field:
            # Not the request's fault (PROTOCOL.md §6): the core is draining, or failed to take it.
            return ApiError(f"the engine cannot take this request now: {e.message}", None, status=503,
                            type="server_error", code="engine_unavailable")
        if isinstance(e, RequestError):
            param = error_param(e.field, guided_source) or schemas.param_name(e.field, chat) or None
            param = (names or {}).get(param, param)
            # The core's message leaves the field to `field`; the openai package's exceptions show only the message.
            return ApiError(f"{param}: {e.message}" if param else e.message, param)
        if isinstance(e, EngineDeadError):
            return ApiError(f"the engine is unavailable: {e}", None, status=503, type="server_error",
                            code="engine_unavailable")
        return ApiError(str(e), None, status=500, type="server_error")

    def _error(self, e: ApiError) -> Response:
        if self.metrics is not None:
            self.metrics.on_error(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=retry_after(e.status))


class _Ctx:
    """What the response builders need to know about one request."""

    def __init__(self, request_id: str, model: str, chat: bool, include_usage: bool):
        self.id, self.model, self.chat, self.include_usage = request_id, model, chat, include_usage
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}   # legacy completions logprobs: choice -> offset of its next token
        self.shapers: dict[int, ChoiceShaper] = {}   # chat: choice -> its reasoning / tool-call parsing
        self.echo: dict[int, str] = {}           # completions with echo: choice -> prompt text to lead with
        self.guided_source: str | None = None    # the request param a grammar came from (for errors)
        self.n = 1                               # choices per prompt
        self.num_prompts = 1
        self.max_tokens_param = "max_tokens"     # or chat's max_completion_tokens, as the request spelled it
        self.continuous_usage = False            # vLLM's continuous_usage_stats: usage in every streamed chunk
        self.prompt_ids: dict[int, list[int]] = {}   # choice -> its prompt's token ids
        self.echo_logprobs = False               # completions with echo and logprobs: the prompt's lead the answer's
        self.echo_only = False                   # echo with max_tokens 0: the answer is the prompt alone
        self.vllm_prompt_logprobs = False        # vLLM's prompt_logprobs field was asked for
        self.generated: Counter[int] = Counter()   # continuous_usage: choice -> tokens streamed so far
        self.headers: dict[str, str] = {}          # extra response headers (the ignored fields)

    def shown(self, c):
        """A Completion or StreamChunk as the answer shows it: with echo_only, without the token the core
        had to generate (the prompt's logprobs stay)."""
        if not self.echo_only:
            return c
        usage = c.usage and Usage(c.usage.prompt_tokens, 0, c.usage.cached_tokens)
        return dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                                   finish_reason="length" if c.finish_reason in ("stop", "length") else c.finish_reason,
                                   stop_reason=None, usage=usage)

    def completions(self, streams: list[AsyncStream]) -> list[Completion]:
        return [self.shown(s.completion) for s in streams]

    def error_names(self, e: Exception) -> dict[str, str]:
        """The request's own names for the params an error from the core names (see App._api_error): the
        prompt of the failed choice (merge's choice_index), the max_tokens field it used."""
        prompt = getattr(e, "choice_index", 0) // self.n
        return {"max_tokens": self.max_tokens_param, "prompt": schemas.prompt_param(prompt, self.num_prompts)}


def _prompt_ids(tokenizer, prompt) -> list[int]:
    return to_token_ids(prompt, lambda: tokenizer)


def _longest_token_chars(tokenizer) -> int:
    """Characters in the longest token's text (a byte-level vocabulary spells one byte per character, so
    this bounds the text one token can stand for)."""
    return max(1, max(map(len, tokenizer.get_vocab()), default=1))


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet (Qwen's tokenizers use it): the character that spells each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_chars()


def _token_bytes(tokenizer, tid: int, text: str) -> list[int]:
    """A token's own UTF-8 bytes, OpenAI's `bytes`: what lets a client rebuild a character split across tokens.
    Such a token's text is U+FFFD, so its bytes come from its byte-level spelling instead (when it has one)."""
    if "\ufffd" in text:
        piece = tokenizer.convert_ids_to_tokens(tid)
        if isinstance(piece, str) and piece and all(c in _BYTE_OF_CHAR for c in piece):
            return [_BYTE_OF_CHAR[c] for c in piece]
    return list(text.encode())


def _model_not_found(name: str) -> ApiError:
    return ApiError(f"The model `{name}` does not exist.", "model", status=404, code="model_not_found")


def _finite(logprob: float) -> float:
    """JSON has no -Infinity; like vLLM, report an impossible token as -9999."""
    return logprob if math.isfinite(logprob) else -9999.0


def _usage(completions: list[Completion], n: int = 1) -> dict:
    """As OpenAI counts: each prompt once however many choices (n) it has; cached tokens likewise."""
    firsts = completions[::n]
    prompt = sum(c.usage.prompt_tokens for c in firsts)
    generated = sum(c.usage.completion_tokens for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": sum(c.usage.cached_tokens for c in firsts)}}


def _running_usage(ctx: _Ctx, index: int) -> dict:
    """One choice's usage so far, as vLLM's continuous_usage_stats gives it in each chunk."""
    prompt, generated = len(ctx.prompt_ids[index]), ctx.generated[index]
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _sse_data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _RequireApiKey:
    """ASGI middleware: /v1/* needs `Authorization: Bearer <key>`; /health and /metrics stay open for probes."""

    def __init__(self, app, key: str):
        self.app = app
        self.expected = b"Bearer " + key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = ApiError("invalid or missing API key (send `Authorization: Bearer <key>`)", None, status=401,
                               type="authentication_error", code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(client: AsyncClient, served_model_names: list[str] | None = None,
              api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, reasoning_parser: str | None = None,
              tool_call_parser: str | None = None, strict_requests: bool = False,
              max_pooling_inputs: int = DEFAULT_MAX_POOLING_INPUTS) -> Starlette:
    """The ASGI app. Its startup waits for the core's handshake (a no-op when the client is connected).
    With api_key, /v1/* requires it as a bearer token. Bodies over max_body_bytes get 413, bodies not in
    within body_timeout_s of their head get 408. reasoning_parser ("qwen3") and tool_call_parser ("hermes",
    "qwen3_coder"; None: the chat template's) shape chat outputs (see reasoning.py, tool_parsers.py);
    strict_requests refuses request fields no schema knows (see request_fields.py); max_pooling_inputs bounds
    the texts of one embeddings, score or rerank request (pooling.py)."""
    if api_key is not None and not api_key:
        raise ValueError("api_key: must not be empty (None serves without a key)")
    fe = Frontend(client, served_model_names, reasoning_parser, tool_call_parser, strict_requests, api_key,
                  max_pooling_inputs)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await fe.start()
        yield

    async def http_error(request: Request, exc: HTTPException) -> Response:
        err = ApiError(exc.detail or "error", None, status=exc.status_code,
                       type="not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)   # 405's Allow

    routes = [
        Route("/v1/completions", fe.completions, methods=["POST"]),
        Route("/v1/chat/completions", fe.chat_completions, methods=["POST"]),
        Route("/v1/responses", fe.responses, methods=["POST"]),
        Route("/v1/embeddings", fe.embeddings, methods=["POST"]),
        Route("/v1/score", fe.score, methods=["POST"]),
        Route("/v1/rerank", fe.rerank, methods=["POST"]),
        Route("/v1/models", fe.models, methods=["GET"]),
        Route("/v1/models/{model:path}", fe.model, methods=["GET"]),
        Route("/health", fe.probes.ready, methods=["GET"]),
        Route("/live", fe.probes.live, methods=["GET"]),
        Route("/metrics", fe.prometheus, methods=["GET"]),
    ]
    middleware = [Middleware(_RequireApiKey, key=api_key)] if api_key else []
    middleware.append(Middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error},
                    middleware=middleware)
    app.state.frontend = fe
    return app
