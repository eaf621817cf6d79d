"""The model side of an engine: the runner (weights, KV pool, decode graphs) and, with speculation, the
proposer and the speculative executor (with their graphs).

Under tensor parallelism every rank runs this start-up in lockstep (weight loading, the agreement on a
KV pool size, CUDA-graph capture with the all-reduces inside), so rank 0's Engine and each worker rank
(distributed/worker.py) build through this one function and meet the same collectives in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass

from llmserve_core.config import EngineConfig
from llmserve_core.engine.model_runner import ModelRunner
from llmserve_core.engine.pooling import resolve_runner
from llmserve_core.engine.spec.eagle import EagleProposer, load_draft
from llmserve_core.engine.spec.executor import SpecExecutor
from llmserve_core.engine.spec.ngram import NgramProposer
from llmserve_core.engine.spec.proposer import Proposer
from llmserve_core.models.config import ModelConfig


@dataclass
class Runtime:
    runner: ModelRunner
    spec: SpecExecutor | None
    max_model_len: int
    lookahead: int              # KV slots a drafting request needs beyond its next token
    kind: str = "generate"      # the runner: generate, or pooling (engine/pooling.py)


def max_model_len_of(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest sequence served: config.max_model_len checked against the model's positions, or those."""
    max_len = model_config.max_context_len
    if config.max_model_len is not None and config.max_model_len > max_len:
        raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's {max_len} positions "
                         f"(config.json's max_position_embeddings, or factor x original_max_position_embeddings "
                         f"with YaRN rope_scaling)")
    max_model_len = config.max_model_len or max_len
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens: {config.max_num_batched_tokens} is below max_model_len {max_model_len}; "
            "without chunked prefill a whole prompt must fit one step. Raise it, lower max_model_len, "
            "or enable chunked prefill")
    return max_model_len


def lookahead_tokens(config: EngineConfig) -> int:
    """KV slots a drafting request needs beyond its next token: its drafts (chain) or tree nodes."""
    if config.resolved_speculative_method() is None:
        return 0
    return config.draft_shape().lookahead


def load_proposer(config: EngineConfig, runner: ModelRunner, max_positions: int) -> Proposer | None:
    """The speculation method the config asks for, its weights loaded (None: no speculation)."""
    method = config.resolved_speculative_method()
    if method == "ngram":
        return NgramProposer(config)
    if method == "eagle3":
        return EagleProposer(config, runner, load_draft(config, runner, max_positions))
    return None


def build_runtime(config: EngineConfig, model_config: ModelConfig, tp=None) -> Runtime:
    """tp: this rank's distributed.group.TPGroup under tensor parallelism (the runner holds its shard)."""
    max_model_len = max_model_len_of(config, model_config)
    kind = resolve_runner(config.runner, model_config)
    if kind == "pooling" and config.resolved_speculative_method() is not None:
        raise ValueError("speculative_method: a Qwen3Model checkpoint runs the pooling runner, which has nothing "
                         "to draft for")
    # Drafting requests write their drafts' KV past their next token: block tables and the pool make room.
    lookahead = lookahead_tokens(config)
    runner = ModelRunner(config, model_config, max_model_len, lookahead_tokens=lookahead, tp=tp,
                         pooling=kind == "pooling")
    try:
        # The proposer loads before the KV pool is sized, so its weights count against
        # gpu_memory_utilization; its KV pool shares the target's block ids, so each block's cost includes
        # its rows.
        proposer = load_proposer(config, runner, max_model_len + lookahead)
        runner.allocate_kv_cache(proposer.kv_bytes_per_block(runner) if proposer is not None else 0)
        spec = SpecExecutor(config, runner, proposer, max_model_len) if proposer is not None else None
    except BaseException:
        runner.release_graphs()       # before the caller tears a process group down (see release_graphs)
        raise
    return Runtime(runner, spec, max_model_len, lookahead, kind)
