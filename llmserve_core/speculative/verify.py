"""Chain verification: which draft tokens the target keeps, and the one token it adds.

Layout shared by both rules. Request b proposed num_draft[b] tokens (0 allowed), padded into
draft_token_ids [B, K]. The verify forward ran 1 + num_draft[b] query tokens for it (the last
accepted token, then the drafts), so its target rows are packed: request b owns rows
target_start[b] : target_start[b] + num_draft[b] + 1 of the [sum(n_b + 1), V] tensor, row j
predicting the token after draft j (row 0: after the last accepted token). Draft distributions, when
given, are packed the same way without the extra row: [sum(n_b), V].

Every request emits num_accepted + 1 tokens: the accepted drafts, then the target's correction at
the first rejection or, when all drafts pass, the bonus token from the last row.

With row_stride = K + 1 the rows are not packed but K + 1 apart (request b's at b * (K + 1)), also where
num_draft[b] < K: the rows past its drafts are padding, read by nothing (a verify forward that gave
every request the same row count, so it could be one graph). Draft distributions then sit K apart.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve_core.layers.sampler import SamplingTensors, draw, exponential_noise, race, sampling_probs


@dataclass
class VerifyOutput:
    token_ids: torch.Tensor     # [B, K + 1] int64, emitted tokens, padded with -1
    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens (emitted = num_accepted + 1)

    def packed(self) -> torch.Tensor:
        """[B, 1 + K + 1]: emitted count, then the tokens, so the host reads it in one transfer."""
        return torch.cat([(self.num_accepted + 1)[:, None], self.token_ids], 1)

    @staticmethod
    def unpack(rows: list[list[int]]) -> list[list[int]]:
        """packed().tolist() -> emitted tokens per request."""
        return [r[1:1 + r[0]] for r in rows]

    def token_lists(self) -> list[list[int]]:
        """Emitted tokens per request, read back in one transfer."""
        return self.unpack(self.packed().tolist())


def verify_probs(target_logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The target distribution each verify row is judged against: the plain sampler's own
    `sampling_probs`, with greedy rows made one-hot at the argmax. Rejection sampling against a
    one-hot row is greedy verification, so greedy and sampled requests can share one verify call.

    A seeded sampled row is made one-hot too, at the token the plain sampler draws at that row's position
    (its noise is keyed by seed and position): the request then emits exactly the tokens it would without
    a draft model, each still a draw from p, whatever the load made the engine speculate."""
    probs = sampling_probs(target_logits, st)
    greedy = st.temperature == 0
    choice = target_logits.argmax(dim=-1)
    one_hot_rows = greedy
    if st.any_seeded:
        seeded = torch.tensor([s is not None for s in st.seeds], device=probs.device) & ~greedy
        noise = exponential_noise(probs.shape, st.noise_keys(), probs.device)
        choice = torch.where(seeded, race(target_logits, st, noise, probs), choice)
        one_hot_rows = greedy | seeded
    if bool(one_hot_rows.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, choice[:, None], 1.0)
        probs = torch.where(one_hot_rows[:, None], one_hot, probs)
    return probs


def _offsets(num_draft: torch.Tensor, extra: int) -> torch.Tensor:
    """Start row of each request in a packed tensor where request b owns num_draft[b] + extra rows."""
    sizes = num_draft + extra
    return torch.cumsum(sizes, 0) - sizes


def _starts(num_draft: torch.Tensor, extra: int, stride: int | None) -> torch.Tensor:
    """First row of each request: packed (stride None), or `stride` apart."""
    if stride is None:
        return _offsets(num_draft, extra)
    return torch.arange(num_draft.shape[0], device=num_draft.device) * stride


def _padded_rows(num_draft: torch.Tensor, width: int, extra: int,
                 stride: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index of (b, j) for j < width, and whether that (b, j) exists."""
    starts = _starts(num_draft, extra, stride)
    j = torch.arange(width, device=num_draft.device)
    valid = j[None, :] < (num_draft + extra)[:, None]
    rows = torch.where(valid, starts[:, None] + j[None, :], torch.zeros_like(valid, dtype=torch.long))
    return rows, valid


def _check(draft_token_ids: torch.Tensor, num_draft: torch.Tensor, target_rows: int, stride: int | None) -> None:
    if draft_token_ids.dim() != 2 or num_draft.dim() != 1 or draft_token_ids.shape[0] != num_draft.shape[0]:
        raise ValueError("draft_token_ids: expected [B, K] with num_draft [B]")
    if stride is not None:
        batch, k = draft_token_ids.shape
        if stride != k + 1 or target_rows != batch * stride:
            raise ValueError(f"row_stride: expected K + 1 = {k + 1} with {batch * (k + 1)} target rows, got "
                             f"{stride} and {target_rows}")
    if num_draft.device.type != "cpu":
        # Reading the counts back would stall the host mid-step (the executor builds them in range);
        # host-side counts are checked in full.
        return
    if bool((num_draft < 0).any()) or bool((num_draft > draft_token_ids.shape[1]).any()):
        raise ValueError("num_draft: each entry must be in [0, K]")
    if stride is None and int((num_draft + 1).sum()) != target_rows:
        raise ValueError(f"target rows: expected sum(num_draft + 1) = {int((num_draft + 1).sum())}, got {target_rows}")


def greedy_verify(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft: torch.Tensor,
                  row_stride: int | None = None) -> VerifyOutput:
    """Accept the longest prefix of drafts equal to the target's argmax, then emit the argmax after it."""
    _check(draft_token_ids, num_draft, target_logits.shape[0], row_stride)
    num_draft = num_draft.to(device=target_logits.device, dtype=torch.long)
    draft_token_ids = draft_token_ids.to(target_logits.device)
    k = draft_token_ids.shape[1]
    rows, valid = _padded_rows(num_draft, k + 1, extra=1, stride=row_stride)
    target_ids = target_logits.argmax(dim=-1)[rows]                        # [B, K + 1]
    matches = (draft_token_ids == target_ids[:, :k]) & valid[:, 1:]        # draft j exists iff row j + 1 does
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)
    keep = torch.arange(k + 1, device=rows.device)[None, :] <= num_accepted[:, None]
    # Accepted drafts equal the target's argmax, so the emitted tokens are just the argmax rows.
    return VerifyOutput(torch.where(keep, target_ids, torch.full_like(target_ids, -1)), num_accepted)


def rejection_sample_verify(
    target_probs: torch.Tensor,          # [sum(n_b + 1), V], from verify_probs
    draft_token_ids: torch.Tensor,       # [B, K]
    num_draft: torch.Tensor,             # [B]
    draft_probs: torch.Tensor | None,    # [sum(n_b), V] the distribution each draft was drawn from; None: argmax drafts
    row_stride: int | None = None,       # K + 1: rows (and draft rows, K) at a fixed stride, see the module notes
) -> VerifyOutput:
    """The standard speculative sampling rule (Leviathan et al., Chen et al.): accept draft x with
    probability min(1, p(x) / q(x)); at the first rejection emit a sample from norm(max(0, p - q));
    when every draft passes emit a sample from the last target row. The emitted tokens are then
    distributed exactly as if drawn one by one from p. draft_probs None means the drafts were
    chosen deterministically (q is one-hot at the draft), which the same rule covers. (Seeded rows come
    one-hot from verify_probs, so their outcome depends on no draw made here.)"""
    device = target_probs.device
    _check(draft_token_ids, num_draft, target_probs.shape[0], row_stride)
    num_draft = num_draft.to(device=device, dtype=torch.long)
    draft_token_ids = draft_token_ids.to(device)
    batch, k = draft_token_ids.shape
    q_stride = None if row_stride is None else k
    if draft_probs is not None:
        q_rows = int(num_draft.sum()) if row_stride is None else batch * k
        if draft_probs.shape[0] != q_rows:
            raise ValueError(f"draft_probs: expected {q_rows} rows, got {draft_probs.shape[0]}")
    t_rows, t_valid = _padded_rows(num_draft, k + 1, extra=1, stride=row_stride)
    valid = t_valid[:, 1:]                                                 # [B, K] draft j exists
    safe_ids = torch.where(valid, draft_token_ids, torch.zeros_like(draft_token_ids))
    p_x = target_probs[t_rows[:, :k], safe_ids].float()                    # [B, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        d_rows, _ = _padded_rows(num_draft, k, extra=0, stride=q_stride)
        q_x = draft_probs[d_rows, safe_ids].float()

    uniform = torch.rand(batch, k, device=device)
    # u < p/q written without the division; u < 1 so p == q > 0 always accepts, p == 0 never does.
    accepted = (uniform * q_x < p_x) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)

    # One final draw per request: the residual at the first rejection, or the bonus row.
    final_row = t_rows.gather(1, num_accepted[:, None]).squeeze(1)
    dist = target_probs[final_row].float()
    rejected = num_accepted < num_draft
    if bool(rejected.any()):
        rb = rejected.nonzero().squeeze(1)
        pos = num_accepted[rb]
        if draft_probs is None:
            q = torch.zeros_like(dist[rb])
            q.scatter_(1, draft_token_ids[rb, pos][:, None], 1.0)
        else:
            q = draft_probs[_starts(num_draft, 0, q_stride)[rb] + pos].float()
        residual = (dist[rb] - q).clamp_min(0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        # Rounding can leave no residual mass only where p <= q everywhere, i.e. p == q: then p itself is right.
        dist[rb] = torch.where(mass > 0, residual / mass.clamp_min(1e-30), dist[rb])
    final = draw(dist)

    token_ids = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    keep = torch.arange(k, device=device)[None, :] < num_accepted[:, None]
    token_ids[:, :k] = torch.where(keep, draft_token_ids.long(), token_ids[:, :k])
    token_ids.scatter_(1, num_accepted[:, None], final[:, None])
    return VerifyOutput(token_ids, num_accepted)
