"""Per-request state the scheduler, block manager and model runner share."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from llmserve_proto import PoolingParams, SamplingParams


# Stands in for a token sampled on the device whose id the host has not read back yet (async scheduling).
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)     # identity: the queues look requests up by object, never by value
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    # All tokens so far (prompt, then outputs); the KV of the first num_computed_tokens is in the cache.
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0                # trailing PLACEHOLDER tokens awaiting their sampled ids
    sample_index: int = -1              # row of this request in the latest launched step's samples
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of this request's full blocks
    finish_reason: str | None = None
    num_preemptions: int = 0
    # With a draft model loaded: the draft's per-request state (every request keeps its draft KV rows, so
    # the blocks it publishes to the prefix cache are whole), and whether it drafts when decoding.
    spec_state: object | None = None
    speculative: bool = False
    client: object = None               # fairness key: the scheduler shares slots and budget fairly across clients
    queued_step: int = 0                # the scheduler's step count when it last joined the waiting queue
    grammar: object | None = None       # engine.grammar.RequestGrammar for guided decoding
    # With params.prompt_logprobs: the scores of prompt positions 1, 2, ... so far (TokenLogprobs), until the
    # request's first output takes them (None from then on: see prompt_logprobs.py).
    prompt_logprobs: list | None = None
    # A pooling request (engine/pooling.py): its prompt only, then its last position's hidden state or logits.
    pooling: PoolingParams | None = None

    @property
    def ready(self) -> bool:
        """May be scheduled: a guided request waits in the queue until its grammar is compiled."""
        return self.grammar is None or self.grammar.ready

    @property
    def needs_sync(self) -> bool:
        """Its next logits depend on the token just sampled (grammar state, penalty counts), so a step may
        launch its forward before the previous step is read back, but must not sample it until then."""
        return self.grammar is not None or self.params.has_penalties

    @property
    def processes_logits(self) -> bool:
        """Its logits get edits this step (a grammar waiting for its start_after masks nothing yet)."""
        return self.params.edits_logits or (self.grammar is not None and self.grammar.active)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """What the penalties count (logits_inputs.py)."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefilling(self) -> bool:
        """More than the last token still lacks KV: a (possibly chunked, possibly recomputed) prefill."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def at_limit(self) -> bool:
        """Counting tokens still in flight, the request may not grow: it only awaits its last results (a
        pooling request once its whole prompt is computed)."""
        if self.pooling is not None:
            return self.num_computed_tokens >= self.num_prompt_tokens
        return self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= self.max_model_len

    def add_prompt_logprobs(self, first: int, scores: list) -> None:
        """Scores of prompt positions first, first + 1, ...; a recomputed prompt scores only positions past
        the ones held, but a step launched before the preemption may still bring some of those."""
        if self.prompt_logprobs is None:
            return
        assert first <= len(self.prompt_logprobs) + 1, (first, len(self.prompt_logprobs))
        self.prompt_logprobs[first - 1:first - 1 + len(scores)] = scores

    def take_prompt_logprobs(self) -> list | None:
        """The prompt's scores, for the request's first output (later ones get None)."""
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken

    def append_placeholder(self) -> None:
        self.token_ids.append(PLACEHOLDER)
        self.num_pending += 1

    def resolve_token(self, token_id: int) -> str | None:
        """Fill the oldest placeholder with its sampled id; return the finish reason it causes, if any.
        A finishing token drops any later placeholders: those steps ran past the end and are discarded."""
        pos = len(self.token_ids) - self.num_pending
        self.token_ids[pos] = token_id
        self.num_pending -= 1
        reason = self._finish_reason(token_id, pos + 1)
        if reason is not None:
            del self.token_ids[pos + 1:]
            self.num_pending = 0
        return reason

    def append_token(self, token_id: int) -> str | None:
        """Add a token whose id is known now; return the finish reason it causes, if any."""
        self.append_placeholder()
        return self.resolve_token(token_id)

    def _finish_reason(self, token_id: int, length: int) -> str | None:
        p = self.params
        if not p.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in p.stop_token_ids:
            return "stop"
        if self.grammar is not None:
            reason = self.grammar.accept(token_id)
            if reason is not None:
                return reason
            if self.grammar.active:
                self.speculative = False     # verify rows would need a mask per draft position
        if length - self.num_prompt_tokens >= p.max_tokens or length >= self.max_model_len:
            return "length"
        return None
