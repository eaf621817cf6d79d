"""The per-step inputs of the logits processors (layers/logits_processors.py), built from the requests.

Only rows that ask for something are touched, so a batch without penalties, biases, min_tokens or grammars
pays nothing. Token histories move to the device as one padded tensor per kind; the counts are made there.
"""
from __future__ import annotations

import torch

from llmserve_core.engine.request import Request
from llmserve_core.layers.logits_processors import LogitsProcessors, Penalties
from llmserve_core.layers.sampler import host_values_to


def build_logits_processors(reqs: list[Request], vocab: int, device: torch.device, masks=None, pin: bool = False
                            ) -> LogitsProcessors | None:
    """For the sampled requests of a step (row i = reqs[i]); None when no row needs any edit. `masks`
    (a grammar.MaskBuilder) fills the grammar rows' bitmask: called after the forward is queued, so on
    a GPU that host work overlaps the forward; pin (the runner's choice) stages the inputs in pinned
    memory, so their copies do not wait for that forward. Grammar and penalty rows need every earlier token's id (no
    placeholder left): the engine reads the previous step back before it samples such rows."""
    if not any(r.processes_logits for r in reqs):
        return None
    out = LogitsProcessors()
    b_rows, b_tok, b_val, k_rows, k_tok = [], [], [], [], []
    pen, grammars = [], []
    for i, r in enumerate(reqs):
        if r.is_finished:
            # Ended by the step read back after this one's forward was launched: the engine discards this
            # row's token, so it gets no edits (its grammar may have terminated and have no next mask).
            continue
        p = r.params
        for tok, bias in p.logit_bias.items():
            b_rows.append(i)
            b_tok.append(tok)
            b_val.append(bias)
        holds = r.grammar is not None and r.grammar.active     # (not while it waits for its start_after)
        if r.num_output_tokens < p.min_tokens and not holds:
            # A grammar decides on its own where the output may end, so min_tokens yields to it once it holds.
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            k_rows.extend([i] * len(stops))
            k_tok.extend(sorted(stops))
        if p.has_penalties:
            pen.append(i)
        if holds:
            grammars.append((i, r.grammar))

    def dev(values, dtype):
        return host_values_to(values, dtype, device, pin)

    if b_rows:
        out.bias = (dev(b_rows, torch.long), dev(b_tok, torch.long), dev(b_val, torch.float32))
    if k_rows:
        out.blocked = (dev(k_rows, torch.long), dev(k_tok, torch.long))
    if pen:
        preqs = [reqs[i] for i in pen]
        need_prompt = any(r.params.repetition_penalty != 1.0 for r in preqs)
        out.penalties = Penalties(
            rows=dev(pen, torch.long),
            presence=dev([r.params.presence_penalty for r in preqs], torch.float32),
            frequency=dev([r.params.frequency_penalty for r in preqs], torch.float32),
            repetition=dev([r.params.repetition_penalty for r in preqs], torch.float32),
            output_ids=_padded([r.output_token_ids for r in preqs], vocab, device, pin),
            prompt_ids=_padded([r.prompt_token_ids for r in preqs], vocab, device, pin) if need_prompt else None)
    if grammars:
        out.mask = masks.build(grammars, len(reqs))
    return out


def _padded(seqs: list[list[int]], pad: int, device, pin: bool) -> torch.Tensor:
    width = max(1, max(len(s) for s in seqs))
    t = torch.full((len(seqs), width), pad, dtype=torch.long, pin_memory=pin)
    for i, s in enumerate(seqs):
        if s:
            t[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return t.to(device, non_blocking=True)
