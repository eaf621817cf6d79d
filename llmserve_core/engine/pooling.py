"""Pooling requests: prompts that end after their prefill and return what the last position holds.

They are ordinary requests to the scheduler (one token budget, chunked prefill, the prefix cache, their
blocks published when they end) that never decode: the chunk reaching a pooling request's last prompt token
is not sampled; instead that one row of the step's hidden states is gathered ("embed": the final normed
hidden state, its first `dimensions` values, L2-normalised after the truncation when asked; "score": the
logits of the named token ids, from just those rows of the lm_head), and only the gathered rows go to the
host, in one copy queued behind the step. The request then ends, its KV released at once.

Runners: "generate" serves generation and both pooling tasks (a reranker is a causal LM); "pooling" serves
pooling requests only, captures no decode graphs and sizes its KV pool for prompts in flight alone. A
Qwen3Model checkpoint (no lm_head) runs "pooling" and cannot score.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmserve_core.engine.outputs import PooledOutput, PoolingResult, StepOutput
from llmserve_core.engine.request import Request
from llmserve_proto import PoolingParams, ValidationError


# ---- which runner and tasks a model serves --------------------------------------------------------------

def resolve_runner(runner: str, model_config) -> str:
    """The runner an engine runs: `runner` as configured ("auto": pooling for a Qwen3Model checkpoint)."""
    if runner == "auto":
        return "pooling" if model_config.pooling_only else "generate"
    if runner == "generate" and model_config.pooling_only:
        raise ValueError("runner: a Qwen3Model checkpoint (an embedding model) has no lm_head to generate with: "
                         "serve it with --runner pooling (the default for it)")
    return runner


def served_tasks(runner: str, model_config, tensor_parallel: bool) -> tuple[str, ...]:
    """Request kinds the engine takes. Scores need the lm_head's rows on this rank (all of it without tensor
    parallelism), which a Qwen3Model checkpoint does not have."""
    tasks = ("generate",) if runner == "generate" else ()
    tasks += ("embed",)
    if not model_config.pooling_only and not tensor_parallel:
        tasks += ("score",)
    return tasks


def check_request(info, params: PoolingParams, prompt_len: int, blocks) -> None:
    """What only the engine knows about a pooling request (PoolingParams.validate() checked the rest): info
    its EngineModelInfo, blocks its BlockManager. A prompt may fill the whole context (nothing follows it)."""
    if params.task not in info.tasks:
        why = ("this model has no lm_head (a Qwen3Model checkpoint: an embedding model); a score needs a "
               "causal LM such as Qwen3-Reranker" if info.runner == "pooling" else
               "scores are not served under tensor parallelism (the lm_head is split over the ranks)")
        raise ValidationError("task", f"{params.task!r} requests are not served here: {why}")
    if params.dimensions is not None and params.dimensions > info.hidden_size:
        raise ValidationError("dimensions", f"must be in [1, {info.hidden_size}] (the model's hidden size), "
                                            f"got {params.dimensions}")
    if any(t >= info.vocab_size for t in params.token_ids):
        raise ValidationError("token_ids", f"must be below the vocabulary size {info.vocab_size}")
    if prompt_len > info.max_model_len:
        raise ValidationError("prompt_token_ids", f"prompt of {prompt_len} tokens exceeds max_model_len "
                                                  f"{info.max_model_len}")
    need = blocks.blocks_needed(prompt_len)
    if need > blocks.num_blocks:
        raise ValidationError("prompt_token_ids", f"needs {need} KV blocks, the whole pool has {blocks.num_blocks}")


def refuse_generation(runner: str) -> None:
    if runner == "pooling":
        raise ValidationError("task", "this core runs the pooling runner (an embedding model, or --runner pooling): "
                                      "it serves embed and score requests, not generation")


def run_to_completion(engine, prompts: list[list[int]], params) -> list[PoolingResult]:
    """Engine.pool(): add the requests, step until each has its answer; the outputs of requests added
    elsewhere are kept for the engine's next step() (as Engine.generate() keeps them)."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValidationError("params", f"got {len(params_list)} PoolingParams for {len(prompts)} prompts")
    ids = [f"pool-{engine.num_steps}-{i}-{id(prompts)}" for i in range(len(prompts))]
    results = {rid: PoolingResult(rid, list(p)) for rid, p in zip(ids, prompts)}
    others: list[StepOutput] = []
    try:
        for rid, p, pp in zip(ids, prompts, params_list):
            engine.add_pooling_request(rid, p, pp)
        while any(r.finish_reason is None for r in results.values()):
            for out in engine.step():
                res = results.get(out.request_id)
                if res is None:
                    others.append(out)
                else:
                    res.output, res.finish_reason = out.pooled, out.finish_reason
                    res.num_cached_tokens = out.num_cached_tokens
    finally:
        for rid in ids:
            engine.abort(rid)     # no-op for the finished ones; frees the rest if we were interrupted
        engine._pending = others + [o for o in engine._pending if o.request_id not in results]
    return [results[rid] for rid in ids]


# ---- a step's pooled rows ----------------------------------------------------------------------------------

@dataclass
class PoolRows:
    """Built while a batch is packed: the rows of pooling requests whose chunk reaches their last prompt
    token. finish() orders them so that every device op below takes a slice (never an index list built
    on the host): embeddings grouped by (dimensions, normalize), then scores."""
    entries: list[tuple[Request, int]] = field(default_factory=list)    # (request, packed row)
    requests: list[Request] = field(default_factory=list)              # in finish() order
    rows: list[int] = field(default_factory=list)
    groups: list[tuple[int, int, int | None, bool]] = field(default_factory=list)   # embed: (start, end, dims, norm)
    score_rows: list[int] = field(default_factory=list)     # per named token: its request's index in `rows`
    score_tokens: list[int] = field(default_factory=list)
    device: list[torch.Tensor] = field(default_factory=list)   # rows (and score rows, tokens) on the device

    def add(self, req: Request, row: int) -> None:
        self.entries.append((req, row))

    def extras(self) -> tuple:
        """The index arrays for BatchBuilder.finish to move with the batch (none on a step without pooling)."""
        if not self.entries:
            return ()
        self.groups, self.score_rows, self.score_tokens = [], [], []

        def key(entry):
            p = entry[0].pooling
            return (p.task != "embed", -1 if p.dimensions is None else p.dimensions, p.normalize)
        ordered = sorted(self.entries, key=key)
        self.requests = [req for req, _ in ordered]
        self.rows = [row for _, row in ordered]
        for i, req in enumerate(self.requests):
            p = req.pooling
            if p.task == "embed":
                if self.groups and self.groups[-1][2:] == (p.dimensions, p.normalize):
                    start, _, dims, norm = self.groups[-1]
                    self.groups[-1] = (start, i + 1, dims, norm)
                else:
                    self.groups.append((i, i + 1, p.dimensions, p.normalize))
            else:
                self.score_rows += [i] * len(p.token_ids)
                self.score_tokens += p.token_ids
        return (self.rows, self.score_rows, self.score_tokens) if self.score_rows else (self.rows,)

    def placed(self, device_extras: list[torch.Tensor]) -> None:
        self.device = list(device_extras)


def pool(hidden: torch.Tensor, head_weight, rows: PoolRows, pin: bool) -> "PooledHost":
    """Queue the pooled values of `rows` (of `hidden`, the step's final normed hidden states) and their copy
    to the host. head_weight: a callable giving the lm_head's weight [vocab, H] (read only for scores)."""
    h = hidden[rows.device[0]]                    # [P, H]: the pooled rows only
    embeds = [embed(h[a:b], dims, norm) for a, b, dims, norm in rows.groups]
    logits = None
    if rows.score_rows:
        score_rows, score_tokens = rows.device[1], rows.device[2]
        logits = score(h[score_rows], head_weight()[score_tokens])
    return PooledHost(rows, [_to_host(e, pin) for e in embeds], None if logits is None else _to_host(logits, pin),
                      on_device=hidden.device.type == "cuda")


def embed(h: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Rows' embeddings in float32: the first `dimensions` values, then L2-normalised (Qwen3-Embedding's
    order: truncate, then normalize)."""
    x = h.float()
    if dimensions is not None:
        x = x[:, :dimensions]
    return F.normalize(x, p=2, dim=-1) if normalize else x


def score(h: torch.Tensor, weight_rows: torch.Tensor) -> torch.Tensor:
    """Each hidden row's logit against its own lm_head row, in float32: [M, H] x [M, H] -> [M], the M named
    (row, token) pairs alone instead of [rows, vocab] logits."""
    return (h.float() * weight_rows.float()).sum(-1)


def _to_host(x: torch.Tensor, pin: bool) -> torch.Tensor:
    if x.device.type == "cpu":
        return x
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)
    out.copy_(x, non_blocking=True)
    return out


@dataclass
class PooledHost:
    """A step's pooled values on their way to the host (StepHandle waits for the copy before results())."""
    rows: PoolRows
    embeds: list[torch.Tensor]          # one [n, dims] float32 tensor per embed group
    logits: torch.Tensor | None         # [M] float32, the score requests' named tokens in order
    on_device: bool = False             # copied from a GPU: readable once the step's event has passed

    def results(self) -> list[tuple[Request, PooledOutput]]:
        out = []
        for (a, b, _, _), e in zip(self.rows.groups, self.embeds):
            values = e.numpy().astype("<f4", copy=False)
            out += [(req, PooledOutput(embedding=values[i].tobytes())) for i, req in enumerate(self.rows.requests[a:b])]
        if self.logits is not None:
            logits, i = self.logits.tolist(), 0
            for req in self.rows.requests:
                if req.pooling.task == "score":
                    k = len(req.pooling.token_ids)
                    out.append((req, PooledOutput(logits=logits[i:i + k])))
                    i += k
        return out

