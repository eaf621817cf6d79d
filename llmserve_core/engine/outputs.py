"""What the engine hands back: each step's outputs per request, generate()'s results, and what it serves.

These are the in-process engine's types; the wire's are proto's (`llmserve_proto.ModelInfo`,
`RequestOutput`) and a client's are llmserve_client's (`Completion`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from llmserve_core.engine.step_result import TokenLogprobs


@dataclass
class PooledOutput:
    """A pooling request's answer (empty when it was aborted before its prompt was computed)."""
    embedding: bytes = b""                    # embed: float32 little-endian values
    logits: list[float] = field(default_factory=list)    # score: the named tokens' logits, in order


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None          # None while running; "stop", "length" or "abort" at the end
    logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None     # prompt positions 1 .., on the first output only
    pooled: PooledOutput | None = None        # set on a pooling request's (final) output, and only there


@dataclass
class GenerationResult:
    """One request run to completion by Engine.generate()."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None     # one per prompt token after the first


@dataclass
class PoolingResult:
    """One pooling request run to completion by Engine.pool()."""
    request_id: str
    prompt_token_ids: list[int]
    output: PooledOutput | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class EngineModelInfo:
    """The model an engine serves, as the daemon announces it (server/daemon.py's model_info_of)."""
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    speculative: bool = False
    runner: str = "generate"
    tasks: tuple[str, ...] = ("generate",)
    hidden_size: int = 0
