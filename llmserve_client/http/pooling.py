"""/v1/embeddings (OpenAI's), /v1/score and /v1/rerank (vLLM's: the Cohere / Jina rerank shape): pooling
requests through the client library, prompts built from Qwen's templates (llmserve_client/pooling.py).

Every input is checked before anything is sent: a wrong type, an empty list, more inputs than
--max-pooling-inputs, an empty text, a text over the context, `dimensions` outside [1, hidden size] or a
request the model cannot serve (an embedding model cannot score; a core started for pooling cannot
generate) is a 400 naming the field; the core checks again, and a refusal from it names the same field.
"""
from __future__ import annotations

import base64
import logging
import time
import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from llmserve_client import pooling
from llmserve_client.errors import EngineDeadError, LLMServeError, RequestError
from llmserve_client.http.identity import Requester
from llmserve_client.http.schemas import ApiError
from llmserve_client.http.streams import ClientGone, until_disconnect

log = logging.getLogger("llmserve_client.http")

ENCODING_FORMATS = ("float", "base64")


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: Any                       # a string, strings, token ids, or lists of token ids
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None          # whom it is for, for the core's fair shares (http/identity.py)
    instruction: str | None = None   # llmserve: each input is a Qwen3-Embedding query with this task
    normalize: bool = True           # vLLM's: L2-normalise (after the truncation to `dimensions`)


class ScoreRequest(msgspec.Struct, kw_only=True):
    text_1: Any                      # the query: a string, or a list (one per text_2, or of one)
    text_2: Any                      # the documents: a string or a list
    model: str | None = None
    instruction: str | None = None   # the reranker's task (default: the model card's web search one)
    use_activation: bool | None = None   # vLLM's: true (default) p(yes), false the log-odds


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: Any                   # strings, or {"text": ...} objects
    model: str | None = None
    top_n: int | None = None         # the best n (0 or null: all)
    return_documents: bool = True
    instruction: str | None = None
    use_activation: bool | None = None


# ---- the endpoints ---------------------------------------------------------------------------------------

async def embeddings(fe, request: Request) -> Response:
    return await _serve(fe, request, EmbeddingRequest, "embeddings", _embed)


async def score(fe, request: Request) -> Response:
    return await _serve(fe, request, ScoreRequest, "score", _score)


async def rerank(fe, request: Request) -> Response:
    return await _serve(fe, request, RerankRequest, "rerank", _rerank)


async def _serve(fe, request: Request, kind: type, endpoint: str, handler) -> Response:
    try:
        req, ignored = fe.decode(request, await request.body(), kind, endpoint)
        if req.model is not None and req.model not in fe.names:
            raise ApiError(f"The model `{req.model}` does not exist.", "model", status=404, code="model_not_found")
        body = await handler(fe, request, req)
    except ApiError as e:
        return fe._error(e)
    except ClientGone:
        return Response(status_code=499)
    except Exception:
        log.exception("request failed")
        return fe._error(ApiError("internal error", None, status=500, type="server_error"))
    return Response(msgspec.json.encode(body), media_type="application/json",
                    headers=fe.note_ignored(endpoint, ignored))


async def _embed(fe, request: Request, req: EmbeddingRequest) -> dict:
    _check_task(fe, "embed")
    if req.encoding_format not in ENCODING_FORMATS:
        raise ApiError(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, got "
                       f"{_short(req.encoding_format)}", "encoding_format")
    hidden = fe.client.model_info.hidden_size
    if req.dimensions is not None and not 1 <= req.dimensions <= hidden:
        raise ApiError(f"dimensions must be in [1, {hidden}] (the model's hidden size), got {req.dimensions}",
                       "dimensions")
    try:
        inputs, are_ids = pooling.embedding_inputs(req.input)
    except RequestError as e:
        raise ApiError(e.message, "input") from None
    _check_count(fe, "input", len(inputs))
    names = [f"input[{i}]" if len(inputs) > 1 else "input" for i in range(len(inputs))]
    if are_ids:
        prompts = inputs
    else:
        for name, text in zip(names, inputs):
            _check_text(fe, name, text)
        prompts = await _tokenize(fe, sum(map(len, inputs)),
                                  lambda tok: [pooling.embedding_prompt(tok, t, req.instruction) for t in inputs])
    _check_lengths(fe, names, prompts)
    params = pooling.embed_params(req.dimensions, req.normalize)
    outputs = await _pool(fe, request, prompts, params, names, req.user)
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(o.embedding).decode() if req.encoding_format == "base64"
             else pooling.floats(o.embedding)} for i, o in enumerate(outputs)]
    tokens = pooling.usage_of(outputs).prompt_tokens
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": _name(fe, req),
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def _score(fe, request: Request, req: ScoreRequest) -> dict:
    queries, docs = _texts("text_1", req.text_1), _texts("text_2", req.text_2)
    if len(queries) == 1:
        queries = queries * len(docs)
    elif len(docs) == 1:
        docs = docs * len(queries)
    elif len(queries) != len(docs):
        raise ApiError(f"text_1 has {len(queries)} texts and text_2 {len(docs)}: give one of them a single text, "
                       "or both the same number", "text_2")
    scores, usage = await _pairs(fe, request, queries, docs, req.instruction, "text_2", req.use_activation)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": _name(fe, req),
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": usage, "total_tokens": usage, "completion_tokens": 0}}


async def _rerank(fe, request: Request, req: RerankRequest) -> dict:
    docs = [d.get("text") if isinstance(d, dict) else d for d in req.documents] \
        if isinstance(req.documents, list) else req.documents
    docs = _texts("documents", docs, single=False)
    if req.top_n is not None and req.top_n < 0:
        raise ApiError(f"top_n must be >= 0 (0: every document), got {req.top_n}", "top_n")
    scores, usage = await _pairs(fe, request, [req.query] * len(docs), docs, req.instruction, "documents",
                                 req.use_activation)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n or len(docs)]
    results = [{"index": i, **({"document": {"text": docs[i]}} if req.return_documents else {}),
                "relevance_score": scores[i]} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": _name(fe, req), "usage": {"total_tokens": usage},
            "results": results}


async def _pairs(fe, request: Request, queries: list[str], docs: list[str], instruction, field: str,
                 use_activation: bool | None) -> tuple[list[float], int]:
    """Scores of (query, document) pairs: p(yes), or the log-odds without the activation; and the tokens."""
    _check_task(fe, "score")
    _check_count(fe, field, len(docs))
    names = [f"{field}[{i}]" for i in range(len(docs))]
    for name, q, d in zip(names, queries, docs):
        _check_text(fe, name, q + d)
    try:
        prompts, labels = await _tokenize(fe, sum(len(q) + len(d) for q, d in zip(queries, docs)), lambda tok: (
            [p for q, d in zip(queries, docs) for p in pooling.rerank_prompts(tok, q, [d], instruction)],
            pooling.yes_no_ids(tok)))
    except RequestError as e:
        raise ApiError(e.message, e.field if e.field != "model" else None) from None
    _check_lengths(fe, names, prompts)
    outputs = await _pool(fe, request, prompts, pooling.score_params(labels), names)
    result = pooling.scores_of(outputs)
    return (result.logits if use_activation is False else result.scores), result.usage.prompt_tokens


# ---- checks and helpers ----------------------------------------------------------------------------------

def _check_task(fe, task: str) -> None:
    info = fe.client.model_info
    tasks = info.tasks or ["generate"]
    if task not in tasks:
        why = {"embed": "this core does not serve embeddings (one older than pooling requests)",
               "score": ("this model has no lm_head (an embedding model): scores need a causal LM such as "
                         "Qwen3-Reranker" if info.runner == "pooling" else "this core does not serve scores")}[task]
        raise ApiError(f"{why}; it serves: {', '.join(tasks)}", "model")


def _check_count(fe, field: str, n: int) -> None:
    if n == 0:
        raise ApiError(f"{field} must not be empty", field)
    if n > fe.max_pooling_inputs:
        raise ApiError(f"{field} has {n} entries, at most {fe.max_pooling_inputs} (--max-pooling-inputs)", field)


def _check_text(fe, name: str, text: str) -> None:
    if not text:
        raise ApiError(f"{name} must not be an empty string", name)
    fe._check_length_early(len(text), 0, name)


def _check_lengths(fe, names: list[str], prompts: list[list[int]]) -> None:
    """Each prompt fits the context, and its token ids the vocabulary."""
    limit, vocab = fe.max_request_tokens, fe.client.model_info.vocab_size
    for name, ids in zip(names, prompts):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(f"{name}: token id {_short(bad)} is outside the vocabulary [0, {vocab})", name)
        if len(ids) > limit:
            raise ApiError(f"This model's maximum context length is {limit} tokens, but {name} has {len(ids)} "
                           f"tokens. Shorten {name}.", name, code="context_length_exceeded")


def _texts(field: str, value, single: bool = True) -> list[str]:
    if single and isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ApiError(f"{field} must be {'a string or ' if single else ''}a list of strings", field)
    if not value:
        raise ApiError(f"{field} must not be empty", field)
    return value


async def _tokenize(fe, chars: int, build):
    """build(tokenizer) on the frontend's tokenizing lane for `chars` characters of text."""
    return await fe._tokenize_pool.run(chars, build)


async def _pool(fe, request: Request, prompts: list[list[int]], params, names: list[str],
                openai_user: str | None = None) -> list:
    """Run the requests for whom the request is from (its key, OpenAI's `user`, its address: identity.py),
    cancelled (and aborted in the core) if the HTTP client goes; errors as 400s naming the input at fault,
    503 when the core cannot take them."""
    user = Requester(request.scope, fe.api_key).user(openai_user)
    try:
        return await until_disconnect(request, fe.client.pool(prompts, params, user=user))
    except RequestError as e:
        if not e.field:
            raise ApiError(f"the engine cannot take this request now: {e.message}", None, status=503,
                           type="server_error", code="engine_unavailable") from None
        name = names[getattr(e, "index", 0)] if e.field == "prompt_token_ids" else e.field
        raise ApiError(f"{name}: {e.message}", name) from None
    except EngineDeadError as e:
        raise ApiError(f"the engine is unavailable: {e}", None, status=503, type="server_error",
                       code="engine_unavailable") from None
    except LLMServeError as e:
        raise ApiError(str(e), None, status=500, type="server_error") from None


def _name(fe, req) -> str:
    return fe.names[0] if req.model is None else req.model


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
