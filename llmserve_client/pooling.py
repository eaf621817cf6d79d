"""Pooling requests from a client: Qwen's embedding and reranker prompts, and a batch of Pool requests sent
together (one per prompt) whose outputs come back in prompt order. Shared by the sync and async clients and
the HTTP frontend.

Prompts follow the model cards (QwenLM/Qwen3-Embedding's README and evaluation code):
- Qwen3-Embedding: a query carries its task, `Instruct: {task}\\nQuery:{query}`; a document goes as it is;
  either ends with `<|endoftext|>`, which the model's tokenizer appends (its post-processor) and whose
  final hidden state is the embedding (last-token pooling).
- Qwen3-Reranker: a system turn judging the Document against the Query and the Instruct, the user turn
  `<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {doc}`, the assistant turn opened with an
  empty think block; the score is the log-odds logit("yes") - logit("no") at the last position, and
  p(yes) its sigmoid. Prefix, body and suffix are tokenized apart, as the card's code does.
"""
from __future__ import annotations

import array
import math
import sys

from llmserve_proto import Pool, PoolingParams, ValidationError
from llmserve_client.cores import Cores, open_request
from llmserve_client.errors import RequestError
from llmserve_client.types import Embeddings, Scores, Usage

DEFAULT_MAX_POOLING_INPUTS = 2048      # texts one HTTP pooling request may carry: OpenAI's embeddings limit
DEFAULT_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QUERY_TEMPLATE = "Instruct: {instruction}\nQuery:{query}"
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
END_OF_TEXT = "<|endoftext|>"


# ---- prompts ---------------------------------------------------------------------------------------------

def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def end_of_text_id(tokenizer) -> int | None:
    """`<|endoftext|>`'s id, when it is one token of this tokenizer."""
    ids = _encode(tokenizer, END_OF_TEXT)
    return ids[0] if len(ids) == 1 else None


def embedding_prompt(tokenizer, text: str, instruction: str | None = None) -> list[int]:
    """A text's token ids as Qwen3-Embedding reads it: the query template when an instruction is given, then
    `<|endoftext|>`."""
    body = text if instruction is None else QUERY_TEMPLATE.format(instruction=instruction, query=text)
    eos = end_of_text_id(tokenizer)
    return _encode(tokenizer, body) + ([] if eos is None else [eos])


def rerank_prompts(tokenizer, query: str, documents: list[str], instruction: str | None = None) -> list[list[int]]:
    """Each (query, document) pair's token ids as Qwen3-Reranker reads them."""
    if not isinstance(query, str):
        raise RequestError("query", "must be a string")
    if instruction is not None and not isinstance(instruction, str):
        raise RequestError("instruction", "must be a string")
    task = DEFAULT_RERANK_INSTRUCTION if instruction is None else instruction
    prefix, suffix = _encode(tokenizer, RERANK_PREFIX), _encode(tokenizer, RERANK_SUFFIX)
    return [prefix + _encode(tokenizer, RERANK_BODY.format(instruction=task, query=query, doc=d)) + suffix
            for d in documents]


def yes_no_ids(tokenizer) -> list[int]:
    """The ids of the tokens "yes" and "no" (the reranker's labels), as the model card looks them up."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("yes", "no")]
    unk = getattr(tokenizer, "unk_token_id", None)
    for word, i in zip(("yes", "no"), ids):
        if not isinstance(i, int) or i == unk:
            raise RequestError("model", f"the tokenizer has no token {word!r}: a score needs a reranker's vocabulary")
    return ids


def embedding_inputs(texts) -> tuple[list, bool]:
    """(the inputs as a list, whether they are token ids): a string, a list of strings, a list of token ids
    or a list of such lists."""
    if isinstance(texts, str):
        return [texts], False
    if isinstance(texts, (list, tuple)) and texts:
        if all(isinstance(t, str) for t in texts):
            return list(texts), False
        if all(isinstance(t, int) and not isinstance(t, bool) for t in texts):
            return [list(texts)], True
        if all(isinstance(t, (list, tuple)) and t and all(isinstance(i, int) and not isinstance(i, bool) for i in t)
               for t in texts):
            return [list(t) for t in texts], True
    raise RequestError("input", "must be a non-empty string, a non-empty list of strings, a list of token ids "
                                "or a list of non-empty lists of token ids")


def check_task(model_info, task: str) -> None:
    """A core says which request kinds it serves; one older than pooling requests says none (generation)."""
    tasks = model_info.tasks or ["generate"]
    if task not in tasks:
        raise RequestError("task", f"the core does not serve {task!r} requests (it serves {', '.join(tasks)}; "
                                   f"runner {model_info.runner})")


def check_texts(field: str, texts) -> list[str]:
    if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
        raise RequestError(field, "must be a non-empty list of strings")
    return list(texts)


# ---- results ---------------------------------------------------------------------------------------------

def floats(data: bytes) -> list[float]:
    """An embedding's float32 little-endian bytes as floats."""
    values = array.array("f", data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def usage_of(outputs) -> Usage:
    prompt = sum(o.metrics.num_prompt_tokens for o in outputs if o.metrics is not None)
    cached = sum(o.metrics.num_cached_tokens for o in outputs if o.metrics is not None)
    return Usage(prompt_tokens=prompt, cached_tokens=cached)


def embeddings_of(outputs) -> Embeddings:
    return Embeddings([floats(o.embedding) for o in outputs], [o.embedding for o in outputs], usage_of(outputs))


def scores_of(outputs) -> Scores:
    logits = [o.logits[0] - o.logits[1] for o in outputs]      # logit("yes") - logit("no")
    return Scores([sigmoid(x) for x in logits], logits, usage_of(outputs))


def embed_params(dimensions: int | None, normalize: bool) -> PoolingParams:
    return _checked(PoolingParams(task="embed", normalize=normalize, dimensions=dimensions))


def score_params(token_ids: list[int]) -> PoolingParams:
    return _checked(PoolingParams(task="score", token_ids=token_ids))


def _checked(params: PoolingParams) -> PoolingParams:
    try:
        return params.validate()
    except ValidationError as e:
        raise RequestError(e.field, e.message) from None


# ---- a batch of Pool requests ----------------------------------------------------------------------------

class PoolBatch:
    """One Pool request per prompt, sent at once, each to the core the router picks; `outputs` in prompt
    order once `done`. A failed request raises RequestError with `index` (its prompt's position); close()
    aborts what is still running (an error, a cancelled caller)."""

    def __init__(self, cores: Cores, prompts: list[list[int]], params: PoolingParams, sink, request_id: str,
                 user: str = ""):
        self.outputs: list = [None] * len(prompts)
        self.requests = []
        self.index: dict[str, int] = {}
        self.left = len(prompts)
        try:
            for i, ids in enumerate(prompts):
                req = open_request(cores, f"{request_id}-{i}", ids, params, sink, user, message=Pool)
                self.requests.append(req)
                self.index[req.wire_id] = i
        except BaseException:
            self.close()
            raise

    @property
    def done(self) -> bool:
        return self.left == 0

    def handle(self, item) -> None:
        """One item from the sink (see transport.py)."""
        kind = item[0]
        if kind == "pooled":
            out = item[1]
            i = self.index.get(out.request_id)
            if i is None or self.outputs[i] is not None:
                return
            self.requests[i].release(abort=False)
            if out.finish_reason != "stop":
                raise RequestError("", f"the core ended request {i} with {out.finish_reason!r}")
            self.outputs[i] = out
            self.left -= 1
        elif kind == "error":
            err = item[1]
            i = self.index.get(err.request_id, 0)
            self.requests[i].release(abort=False)
            e = RequestError(err.field, err.message)
            e.index = i
            raise e
        elif kind == "dead":
            raise item[1]

    def close(self) -> None:
        for req, out in zip(self.requests, self.outputs):
            if out is None and not req.released:
                req.release(abort=True)
