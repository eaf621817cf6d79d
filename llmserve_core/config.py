"""EngineConfig: every knob of the engine, with the defaults a user of a serving engine expects."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None          # clients only; the core never tokenizes
    device: str = "auto"                  # auto: cuda when present, else cpu
    dtype: str = "auto"                   # auto: bfloat16 on cuda, float32 on cpu
    load_format: str = "auto"             # auto | safetensors | dummy (random weights from config.json)
    seed: int = 0
    # Paged KV cache.
    block_size: int = 16
    num_kv_blocks: int | None = None      # fixed pool size; None sizes it from memory
    gpu_memory_utilization: float = 0.90  # share of the card the engine may use (weights + KV + activations)
    cpu_kv_cache_gib: float = 1.0         # KV pool on CPU, where there is no card to profile
    enable_prefix_caching: bool = True
    # Scheduler.
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None      # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    # Model runner.
    attention_backend: str = "auto"       # auto | torch | triton | triton-fa4 | flash-attn
    enforce_eager: bool = False           # no CUDA graphs
    async_scheduling: bool | None = None  # launch step N+1 before reading step N back (default: on for cuda)
    warmup: bool | None = None            # run every kind of step once before serving, so no kernel compiles
                                          # inside a request (default: on for cuda)
    # EAGLE-3 speculative decoding.
    speculative_model: str | None = None
    speculative_gamma: int = 3
    speculative_accept_mode: str = "greedy"   # greedy | sample
    speculative_tree: str | None = None
    speculative_trace: bool = False

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_warmup(self) -> bool:
        return self.warmup if self.warmup is not None else self.resolved_device().type == "cuda"

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: unknown dtype {self.dtype!r}, choose from auto, {', '.join(DTYPES)}")
        return DTYPES[self.dtype]

    def validate(self) -> None:
        def need(ok: bool, name: str, msg: str):
            if not ok:
                raise ValueError(f"{name}: {msg}")
        need(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, "block_size", "must be a power of two")
        need(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        need(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        need(self.load_format in ("auto", "safetensors", "dummy"), "load_format", "must be auto, safetensors or dummy")
        need(self.speculative_gamma >= 1, "speculative_gamma", "must be >= 1")
        need(self.speculative_accept_mode in ("greedy", "sample"), "speculative_accept_mode", "must be greedy or sample")
        if self.speculative_tree is not None:
            from llmserve_core.speculative.tree import get_tree
            get_tree(self.speculative_tree, self.speculative_gamma)    # raises naming speculative_tree
        self.resolved_dtype()

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
