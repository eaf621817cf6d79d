"""Batched sampling with per-row parameters.

Greedy rows take the argmax of the raw logits. Other rows go through temperature, top-k, top-p and min-p
(`sampling_probs`, which speculative verification reuses so both see the same distribution), then
draw with the exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.

A row with a seed draws E from a generator seeded with (seed, position of the token it draws) alone, so a
seeded request's tokens depend on nothing else: not on its batch company, preemption, or whether a draft
model speculated. Speculative verification keeps that: it judges a seeded row against the one-hot token
the plain sampler would draw at that position (speculative/verify.py's verify_probs), and the draft
proposes with the same noise, so the two agree as often as the distributions let them.

Rows without top-k / top-p / min-p (most sampled traffic) race their logits directly, argmax(logits / T -
log E), the same draw without the softmax, in one pass (`race`, kernels/sampling.py on CUDA).

Degenerate parameters stay safe: a temperature under GREEDY_EPSILON is greedy (dividing by it would
overflow), top-p always keeps the most likely token (1e-300 rounds to 0 in float32), and a row whose
distribution still comes out without finite mass takes the greedy token rather than a NaN argmax.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

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
    seeds: list[int | None]            # per row; a seeded row's noise is keyed by (seed, position)
    positions: list[int]               # per row: the sequence index of the token it draws
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_num_logprobs: int | None       # None: no row asked for logprobs

    @classmethod
    def from_params(cls, params_list, device, pin: bool = False, positions=None) -> "SamplingTensors":
        """positions: the sequence index each row's token will take (a request's num_tokens when it
        samples its next token); it keys a seeded row's noise. Default 0 for every row."""
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
            seeds=[p.seed for p in params_list],
            positions=list(positions) if positions is not None else [0] * len(params_list),
            all_greedy=all(t == 0.0 for t in temps),
            need_top_k=any(k > 0 for k in top_ks),
            need_top_p=any(p < 1.0 for p in top_ps),
            need_min_p=any(m > 0.0 for m in min_ps),
            max_num_logprobs=max(logprobs) if logprobs else None,
        )

    def repeat_rows(self, times: int, offsets=None) -> "SamplingTensors":
        """Each row's parameters `times` times in a row, e.g. once per verified position of a request, the
        copies' positions advanced by offsets[b][j] (default j: a chain's rows draw consecutive tokens);
        the tensors on the device alone, so the host never waits for them."""
        offsets = offsets if offsets is not None else [range(times)] * len(self.positions)
        return replace(self, temperature=self.temperature.repeat_interleave(times),
                       top_k=self.top_k.repeat_interleave(times), top_p=self.top_p.repeat_interleave(times),
                       min_p=self.min_p.repeat_interleave(times), seeds=[s for s in self.seeds for _ in range(times)],
                       positions=[p + o for p, offs in zip(self.positions, offsets) for o in offs])

    def advanced(self, offset: int) -> "SamplingTensors":
        """The same rows drawing the tokens `offset` places later (a chain draft's next proposal)."""
        return replace(self, positions=[p + offset for p in self.positions])

    @property
    def any_seeded(self) -> bool:
        return any(s is not None for s in self.seeds)

    def noise_keys(self) -> list[int | None]:
        """Each row's noise key: None for an unseeded row, else a function of (seed, position) alone."""
        return [None if s is None else noise_key(s, p) for s, p in zip(self.seeds, self.positions)]


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int) -> int:
    """A generator seed for the token at `position` of a request seeded with `seed`: well mixed, so nearby
    (seed, position) pairs draw unrelated noise, and under 2^63 (what torch's manual_seed takes)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 1


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
            # when top_p rounds to 0 or cumsum's rounding error makes its "mass before" positive. A row
            # without top-p (1.0) drops nothing: rounding can bring the mass before its tail tokens to 1.0,
            # and the row's distribution must not depend on a batch-mate having turned top-p on.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = (mass_before >= st.top_p[:, None]) & (st.top_p[:, None] < 1.0)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if st.need_min_p:
        floor = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def exponential_noise(shape, keys, device) -> torch.Tensor:
    """Exp(1) noise [N, V]; a row with a key (SamplingTensors.noise_keys) draws it from a generator seeded
    with that key alone, the others from the global generator."""
    noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_()
    seeded = [(i, k) for i, k in enumerate(keys or ()) if k is not None]
    if seeded:
        g = torch.Generator(device=device)
        for i, k in seeded:
            noise[i].exponential_(generator=g.manual_seed(k))
    return noise


def race(logits: torch.Tensor, st: SamplingTensors, noise: torch.Tensor, probs: torch.Tensor | None = None):
    """Each row's token given its Exp(1) noise: the plain sampler's rule, which verification applies to a
    seeded row too. A row without top-k / top-p / min-p races its logits directly (kernels/sampling.py:
    argmax(logits / T - log E), one pass, on CUDA); a row with them races its filtered probabilities (probs:
    sampling_probs(logits, st), when the caller has it), falling back to the argmax where no finite mass
    is left."""
    if logits.is_cuda:
        from llmserve_core.kernels.sampling import race_argmax
        tokens = race_argmax(logits, st.temperature, noise)
    else:
        from llmserve_core.kernels.sampling_reference import race_argmax_reference
        tokens = race_argmax_reference(logits, st.temperature, noise)
    if st.need_top_k or st.need_top_p or st.need_min_p:
        probs = probs if probs is not None else sampling_probs(logits, st)
        valid = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
        drawn = torch.where(valid, (probs / noise).argmax(dim=-1), logits.argmax(dim=-1))
        filtered = ((st.top_k > 0) | (st.top_p < 1) | (st.min_p > 0)) & (st.temperature > 0)
        tokens = torch.where(filtered, drawn, tokens)
    return tokens


def draw(probs: torch.Tensor, keys=None) -> torch.Tensor:
    """One token per row from probs [N, V] (the exponential race); keys: per-row noise keys or None."""
    return (probs / exponential_noise(probs.shape, keys, probs.device)).argmax(dim=-1)


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
    if st.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = race(logits, st, exponential_noise(logits.shape, st.noise_keys(), logits.device))
    if st.max_num_logprobs is None:
        return SamplerOutput(tokens)
    return model_logprobs(raw, tokens, st.max_num_logprobs)


def model_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> SamplerOutput:
    """`tokens` [N] with their log-probabilities under the model's own distribution (float32 log-softmax of
    the raw logits: before temperature, filters and logits processors, as vLLM reports them), and the k
    most likely tokens of each row (none for k 0)."""
    logp = logits.float().log_softmax(dim=-1)
    out = SamplerOutput(tokens, logp.gather(1, tokens[:, None]).squeeze(1))
    if k > 0:
        out.top_logprobs, out.top_token_ids = logp.topk(k, dim=-1)
    return out
