"""What a step produced, one result per request, the same for plain and speculative steps.

The model runner's plain steps and the EAGLE executor's drafting steps both return a StepHandle; the
engine completes either through one path (Engine._complete): append each result's tokens up to the
first that ends the request, count its extra computed positions (accepted drafts, whose KV the verify
forward already wrote), report its logprobs. A step that ran prompt chunks asking for prompt logprobs
also carries their scores (prompt_logprobs.py), for the engine to hold until each request's first output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve_core.engine.request import Request
from llmserve_core.engine.scheduler import ScheduledBatch
from llmserve_core.layers.sampler import SamplerOutput


@dataclass
class TokenLogprobs:
    logprob: float                                                   # of the sampled token
    top: list[tuple[int, float]] = field(default_factory=list)       # (token id, logprob), most likely first


@dataclass
class RequestResult:
    request: Request
    token_ids: list[int]                       # in order; the engine stops at the first that ends the request
    logprobs: list[TokenLogprobs] | None = None
    extra_computed: int = 0                    # positions past the scheduled ones whose KV is now valid


class StepHandle:
    """A launched step. results() waits for the sampled rows (a no-op on the CPU or once read back).

    sampled: the sampler's output for `sampled_requests` (one token each), host tensors; on CUDA an event
    recorded after their copies says when they are readable. ready: results known already (a drafting
    step's verified requests). num_accepted: drafts accepted per verified request (the policy's input).

    A plain step is launched in two parts (ModelRunner.launch_forward, then launch_sample), so the engine
    can read the previous step back in between: until it is sampled, `to_sample` holds the hidden rows
    of `sampled_requests` whose logits the sampling reads."""

    def __init__(self, sched: ScheduledBatch, sampled: SamplerOutput | None = None,
                 sampled_requests: list[Request] | None = None, ready: list[RequestResult] | None = None,
                 num_accepted: list[int] | None = None, to_sample: torch.Tensor | None = None):
        self.sched = sched
        self.sampled = None
        self.sampled_requests = sampled_requests or []
        self.ready = ready or []
        self.num_accepted = num_accepted or []
        self.to_sample = to_sample
        self.event = None
        self.prompt_spans: list[tuple[Request, int, int]] = []    # (request, first prompt position, count)
        self.prompt_scores: SamplerOutput | None = None           # their rows in order, host tensors
        self.pooled = None                                        # pooling.PooledHost: finished pooling requests
        if sampled is not None:
            self.set_sampled(sampled)

    def set_sampled(self, sampled: SamplerOutput) -> None:
        """The sampler's output for sampled_requests, its copies to the host queued just now."""
        self.sampled = sampled
        self.to_sample = None
        self._record(sampled)

    def set_prompt_scores(self, spans: list[tuple[Request, int, int]], scores: SamplerOutput) -> None:
        """Prompt logprobs of the step's prompt chunks (PromptRows.spans), their copies to the host queued
        just now."""
        self.prompt_spans, self.prompt_scores = spans, scores
        self._record(scores)

    def set_pooled(self, pooled) -> None:
        """The pooled values of the step's finished pooling requests (pooling.PooledHost), their copies to
        the host queued just now."""
        self.pooled = pooled
        if torch.cuda.is_available() and pooled.on_device:
            self.event = torch.cuda.Event()
            self.event.record()

    def pooled_results(self) -> list:
        """(request, PooledOutput) of each pooling request whose prompt the step completed."""
        if self.pooled is None:
            return []
        self._wait()
        return self.pooled.results()

    def _record(self, copied: SamplerOutput) -> None:
        """The event results() waits on follows every copy queued so far."""
        if copied.token_ids.is_pinned():
            self.event = torch.cuda.Event()
            self.event.record()

    def _wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def results(self) -> list[RequestResult]:
        assert self.to_sample is None, "a step is read back only once sampled (ModelRunner.launch_sample)"
        self._wait()
        return sampled_results(self.sampled, self.sampled_requests) + self.ready

    def prompt_results(self) -> list[tuple[Request, int, list[TokenLogprobs]]]:
        """(request, first prompt position, the scores of that position and the ones after it) per chunk."""
        if self.prompt_scores is None:
            return []
        self._wait()
        lp, top_lp, top_ids = _host_lists(self.prompt_scores)
        out, i = [], 0
        for req, first, count in self.prompt_spans:
            k = req.params.prompt_logprobs
            out.append((req, first, [_token_logprobs(lp, top_ids, top_lp, j, k) for j in range(i, i + count)]))
            i += count
        return out


def sampled_results(sampled: SamplerOutput | None, reqs: list[Request]) -> list[RequestResult]:
    """One result per sampled row: its token, and its logprobs if the request asked for them."""
    if sampled is None or not reqs:
        return []
    tokens = sampled.token_ids.tolist()
    if sampled.logprobs is None:
        return [RequestResult(req, [tok]) for req, tok in zip(reqs, tokens)]
    lp, top_lp, top_ids = _host_lists(sampled)
    return [RequestResult(req, [tok], None if req.params.logprobs is None else
                          [_token_logprobs(lp, top_ids, top_lp, i, req.params.logprobs)])
            for i, (req, tok) in enumerate(zip(reqs, tokens))]


def _host_lists(out: SamplerOutput):
    """An output's logprobs, top logprobs and top ids as lists (the top ones None when no row asked)."""
    def listed(t):
        return None if t is None else t.tolist()
    return listed(out.logprobs), listed(out.top_logprobs), listed(out.top_token_ids)


def _token_logprobs(lp, top_ids, top_lp, i: int, n: int) -> TokenLogprobs:
    """Row i's logprob and its n most likely tokens (the rows hold the most any row of the batch asked)."""
    return TokenLogprobs(lp[i], list(zip(top_ids[i][:n], top_lp[i][:n])) if n and top_ids is not None else [])
