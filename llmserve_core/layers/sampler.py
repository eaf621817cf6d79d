"""Batched sampling with per-row parameters.

Greedy rows take the argmax of the raw logits. Other rows go through temperature, top-k, top-p and min-p
(`sampling_probs`, which speculative verification reuses so both see the same distribution), then
draw with the exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.
Rows with a seed draw E from their own generator, so their tokens do not depend on batch company. (A
speculating request's verification draws from the same generator in another pattern, so with a draft
model its tokens also depend on which of its steps drafted: see the README's EAGLE-3 section.)

Degenerate parameters stay safe: a temperature under GREEDY_EPSILON is greedy (dividing by it would
overflow), top-p always keeps the most likely token (1e-300 rounds to 0 in float32), and a row whose
distribution still comes out without finite mass takes the greedy token rather than a NaN argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve_proto.sampling import GREEDY_EPSILON


def host_values_to(values, dtype: torch.dtype, device, pin: bool) -> torch.Tensor:
    """A list of host values as a device tensor. Pinned + non_blocking: a pageable copy would make the host
    wait for the device to drain (the forward it queued just before)."""
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, built once per step by the model runner."""
    temperature: torch.Tensor          # [N] float32; 0 = greedy
    top_k: torch.Tensor                # [N] int64; <= 0 = disabled
    top_p: torch.Tensor                # [N] float32
    min_p: torch.Tensor                # [N] float32
    generators: list[torch.Generator | None]
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_num_logprobs: int | None       # None: no row asked for logprobs

    @classmethod
    def from_params(cls, params_list, generators, device, pin: bool = False) -> "SamplingTensors":
        # Exactly 0 from here on for every greedy row: the sampler, verification and proposals test `== 0`.
        temps = [0.0 if p.temperature < GREEDY_EPSILON else p.temperature for p in params_list]
        top_ks = [p.top_k for p in params_list]
        top_ps = [p.top_p for p in params_list]
        min_ps = [p.min_p for p in params_list]
        logprobs = [p.logprobs for p in params_list if p.logprobs is not None]
        def dev(values, dtype):
            return host_values_to(values, dtype, device, pin)
        return cls(
            temperature=dev(temps, torch.float32),
            top_k=dev(top_ks, torch.int64),
            top_p=dev(top_ps, torch.float32),
            min_p=dev(min_ps, torch.float32),
            generators=list(generators),
            all_greedy=all(t == 0.0 for t in temps),
            need_top_k=any(k > 0 for k in top_ks),
            need_top_p=any(p < 1.0 for p in top_ps),
            need_min_p=any(m > 0.0 for m in min_ps),
            max_num_logprobs=max(logprobs) if logprobs else None,
        )

    def repeat_rows(self, times: int) -> "SamplingTensors":
        """Each row's parameters `times` times in a row, e.g. once per verified position of a request;
        on the device alone, so the host never waits for it."""
        return SamplingTensors(self.temperature.repeat_interleave(times), self.top_k.repeat_interleave(times),
                               self.top_p.repeat_interleave(times), self.min_p.repeat_interleave(times),
                               [g for g in self.generators for _ in range(times)], self.all_greedy, self.need_top_k,
                               self.need_top_p, self.need_min_p, self.max_num_logprobs)


def only_argmax(params) -> bool:
    """Whether a request's token is the argmax of its raw logits and nothing else is asked of them: greedy,
    no logprobs, no logits processors (penalties, biases, min_tokens, grammars)."""
    return params.greedy and params.logprobs is None and not params.processes_logits


def sampling_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution each row samples from: float32 [N, V] after temperature, top-k, top-p, min-p.
    Greedy rows get a temperature of 1 here; callers take their argmax instead."""
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    logits = logits.float() / temp[:, None]
    if st.need_top_k or st.need_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        if st.need_top_k:
            k = torch.where(st.top_k > 0, st.top_k.clamp(max=vocab), torch.full_like(st.top_k, vocab))
            kth = sorted_logits.gather(1, (k - 1)[:, None])
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if st.need_top_p:
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Drop a token once the mass before it already reaches top_p; the first token always stays, also
            # when top_p rounds to 0 or cumsum's rounding error makes its "mass before" positive.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = mass_before >= st.top_p[:, None]
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if st.need_min_p:
        floor = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def exponential_noise(shape, generators, device) -> torch.Tensor:
    """Exp(1) noise; rows with their own generator draw from it so they are independent of the batch."""
    noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise


def draw(probs: torch.Tensor, generators) -> torch.Tensor:
    """One token per row from probs [N, V] (the exponential race)."""
    noise = exponential_noise(probs.shape, generators, probs.device)
    return (probs / noise).argmax(dim=-1)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                    # [N] int64
    logprobs: torch.Tensor | None = None       # [N] float32, of the sampled token
    top_logprobs: torch.Tensor | None = None   # [N, k] float32
    top_token_ids: torch.Tensor | None = None  # [N, k] int64

    def to_host(self, pin: bool) -> "SamplerOutput":
        """Start copying every field to host memory; with pin, the copies are asynchronous and the caller
        must wait on an event recorded after this call before reading them."""
        def host(t):
            if t is None or t.device.type == "cpu":
                return t
            return t.to("cpu", non_blocking=pin) if not pin else \
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        return SamplerOutput(host(self.token_ids), host(self.logprobs), host(self.top_logprobs),
                             host(self.top_token_ids))


def sample(logits: torch.Tensor, st: SamplingTensors, processors=None) -> SamplerOutput:
    """One token per row. `processors` (layers/logits_processors.LogitsProcessors) edit the logits first:
    biases, min_tokens, penalties, grammar masks; reported logprobs stay the model's own."""
    raw = logits
    if processors is not None:
        logits = processors.apply(logits)
    greedy_tokens = logits.argmax(dim=-1)
    if st.all_greedy:
        tokens = greedy_tokens
    else:
        probs = sampling_probs(logits, st)
        # A row without finite positive mass (NaN or inf logits from upstream) has no distribution to draw
        # from: it takes the greedy token instead of whatever argmax makes of NaN.
        valid = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
        tokens = torch.where((st.temperature == 0) | ~valid, greedy_tokens, draw(probs, st.generators))
    out = SamplerOutput(tokens)
    if st.max_num_logprobs is not None:
        # Log-probabilities of the model's own distribution (before temperature and filters), as vLLM reports.
        logp = raw.float().log_softmax(dim=-1)
        out.logprobs = logp.gather(1, tokens[:, None]).squeeze(1)
        if st.max_num_logprobs > 0:
            out.top_logprobs, out.top_token_ids = logp.topk(st.max_num_logprobs, dim=-1)
    return out
