"""EngineConfig: every knob of the engine, with the defaults a user of a serving engine expects."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
RUNNERS = ("auto", "generate", "pooling")


def host_and_port(address: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port), an IPv6 host in brackets ([::1]:29500) taken out of them. ValueError
    when it is not that."""
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host, int(port)


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None          # tokenizer dir announced to clients and read for grammars (None: the model dir); the core never tokenizes text
    device: str = "auto"                  # auto: cuda when present, else cpu
    dtype: str = "auto"                   # auto: bfloat16 on cuda, float32 on cpu
    load_format: str = "auto"             # auto | safetensors | dummy (random weights from config.json)
    quantization: str | None = None       # fp8: quantize float weights at load (FP8 checkpoints need no flag)
    seed: int = 0
    runner: str = "auto"                  # generate | pooling (prompts only: embed and score requests, KV for prompts alone) | auto: pooling for a Qwen3Model checkpoint, else generate
    # Paged KV cache.
    block_size: int = 16
    kv_cache_dtype: str = "auto"          # auto (the model dtype) | fp8_e4m3 (half the KV bytes per token)
    num_kv_blocks: int | None = None      # fixed pool size; None sizes it from memory
    gpu_memory_utilization: float = 0.90  # share of the card the engine may use (weights + KV + activations)
    cpu_kv_cache_gib: float = 1.0         # KV pool on CPU, where there is no card to profile
    enable_prefix_caching: bool = True
    # Scheduler.
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None      # None: the model's max_position_embeddings (x factor with YaRN)
    enable_chunked_prefill: bool = True
    fairness_preempt_steps: int = 8       # steps a client's next request may wait for a slot while another client runs at least two more requests, before the scheduler preempts that client's newest for it (0: never preempt for fairness)
    max_queued_requests_per_client: int = 1024   # waiting (not yet running) requests one client (a connection, or a user within one) may have; 0: no cap
    max_queued_requests: int = 4096       # waiting requests of all clients together, past which only a client with none waiting may queue one (up to twice this); 0: no cap
    max_queued_tokens: int = 16_777_216   # prompt tokens of the waiting requests of all clients together, with the same rule past it as max_queued_requests; 0: no cap
    # Model runner.
    attention_backend: str = "auto"       # auto | torch | triton | triton-fa4 | flash-attn
    enforce_eager: bool = False           # no CUDA graphs
    async_scheduling: bool | None = None  # launch step N+1 before reading step N back (default: on for cuda)
    warmup: bool | None = None            # run every kind of step once before serving, so no kernel compiles inside a request (default: on for cuda)
    # Tensor parallelism (torch.distributed: NCCL on GPUs, gloo on CPUs).
    tensor_parallel_size: int = 1         # ranks each layer is split over; rank 0 is this process
    enable_expert_parallel: bool = False  # MoE models: each rank holds whole experts (num_experts / tensor_parallel_size of them) instead of a slice of every expert
    nnodes: int = 1                       # hosts the ranks span (tensor_parallel_size / nnodes ranks on each)
    node_rank: int = 0                    # this host's index; 0 runs the core, the others only workers
    dist_init_addr: str | None = None     # HOST:PORT of the TCP rendezvous (needed with nnodes > 1)
    distributed_timeout: float = 60.0     # seconds a collective may wait for another rank before failing
    # Speculative decoding: EAGLE-3 (a draft model) or prompt lookup (ngram: no model).
    speculative_method: str | None = None     # eagle3 (the default when --speculative-model is given) | ngram: propose what followed the latest earlier occurrence of the request's last tokens
    speculative_model: str | None = None      # an EAGLE-3 draft directory (speculators format)
    speculative_gamma: int | None = None      # draft depth (chain: drafts per step; vLLM's num_speculative_tokens); default 3
    speculative_num_steps: int | None = None  # the same, under SGLang's name (set one of the two)
    speculative_eagle_topk: int = 1           # children per expanded draft node; > 1 grows a dynamic tree
    speculative_num_draft_tokens: int | None = None  # tree nodes verified per request, root included (dynamic default: topk * steps + 1)
    speculative_accept_mode: str = "greedy"   # greedy | sample
    speculative_tree: str | None = None       # a static tree's name (chain, eagle-small, binary), or dynamic
    speculative_policy: str = "adaptive"      # adaptive: draft only as deep as pays, from measured acceptance and step costs | always
    speculative_trace: bool = False
    prompt_lookup_min: int | None = None      # ngram: shortest suffix n-gram looked up (default: prompt_lookup_max, or 5 as vLLM)
    prompt_lookup_max: int | None = None      # ngram: longest suffix n-gram looked up, tried first (default: prompt_lookup_min, or 5)
    speculative_config: str | dict | None = None  # vLLM's JSON: {"method": "ngram" | "eagle3", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}, setting the fields above

    def __post_init__(self):
        if self.speculative_config is not None:
            from llmserve_core.speculative.method import merge_vllm_config
            merge_vllm_config(self)

    def draft_shape(self):
        """What each speculative step drafts (chain, static or dynamic tree), checked."""
        from llmserve_core.speculative.shape import draft_shape
        return draft_shape(self.speculative_gamma, self.speculative_num_steps, self.speculative_eagle_topk,
                           self.speculative_num_draft_tokens, self.speculative_tree)

    def resolved_speculative_method(self) -> str | None:
        """eagle3, ngram, or None (no speculation)."""
        from llmserve_core.speculative.method import resolved_method
        return resolved_method(self.speculative_method, self.speculative_model)

    def lookup_bounds(self) -> tuple[int, int]:
        """ngram: (prompt_lookup_min, prompt_lookup_max), defaults applied, checked."""
        from llmserve_core.speculative.method import lookup_bounds
        return lookup_bounds(self.prompt_lookup_min, self.prompt_lookup_max)

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

    def resolved_kv_cache_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8_e4m3" else self.resolved_dtype()

    def validate(self) -> None:
        def need(ok: bool, name: str, msg: str):
            if not ok:
                raise ValueError(f"{name}: {msg}")
        need(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, "block_size", "must be a power of two")
        need(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        need(0 <= self.fairness_preempt_steps <= 2**31 - 1, "fairness_preempt_steps", "must be in [0, 2^31 - 1]")
        need(self.max_queued_requests_per_client >= 0, "max_queued_requests_per_client", "must be >= 0")
        need(self.max_queued_requests >= 0, "max_queued_requests", "must be >= 0")
        need(self.max_queued_tokens >= 0, "max_queued_tokens", "must be >= 0")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        # Room for one prompt token and one generated token.
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2")
        need(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        need(self.load_format in ("auto", "safetensors", "dummy"), "load_format", "must be auto, safetensors or dummy")
        need(self.runner in RUNNERS, "runner", f"must be one of {', '.join(RUNNERS)}")
        need(self.quantization in (None, "fp8"), "quantization", "must be fp8 or unset")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        need(not (self.kv_cache_dtype == "fp8_e4m3" and self.attention_backend == "flash-attn"), "kv_cache_dtype",
             "fp8_e4m3 is read by the triton and torch attention backends, not flash-attn")
        need(self.speculative_accept_mode in ("greedy", "sample"), "speculative_accept_mode", "must be greedy or sample")
        need(self.speculative_policy in ("adaptive", "always"), "speculative_policy", "must be adaptive or always")
        need(1 <= self.tensor_parallel_size <= 1024, "tensor_parallel_size", "must be in [1, 1024]")
        need(1 <= self.nnodes <= self.tensor_parallel_size and self.tensor_parallel_size % self.nnodes == 0, "nnodes",
             "must divide tensor_parallel_size")
        need(0 <= self.node_rank < self.nnodes, "node_rank", "must be in [0, nnodes)")
        need(self.nnodes == 1 or self.dist_init_addr is not None, "dist_init_addr", "HOST:PORT is needed with nnodes > 1")
        if self.dist_init_addr is not None:
            try:
                host_and_port(self.dist_init_addr)
            except ValueError:
                need(False, "dist_init_addr", "must be HOST:PORT ([HOST]:PORT for IPv6)")
        need(0.0 < self.distributed_timeout <= 86400.0, "distributed_timeout", "must be in (0, 86400]")
        self.draft_shape()                # raises naming the speculative_* field at fault
        self._validate_method()
        need(self.runner != "pooling" or self.resolved_speculative_method() is None, "runner",
             "pooling runs prompts only: it has nothing to draft for (drop the speculative flags)")
        self.resolved_dtype()

    def _validate_method(self) -> None:
        method = self.resolved_speculative_method()
        if method == "eagle3" and self.speculative_model is None:
            raise ValueError("speculative_model: the eagle3 method needs a draft model directory")
        if method == "ngram":
            if self.speculative_model is not None:
                raise ValueError("speculative_model: the ngram method uses no draft model")
            if self.draft_shape().kind != "chain":
                name = "speculative_tree" if self.speculative_tree is not None else "speculative_eagle_topk"
                raise ValueError(f"{name}: the ngram method proposes a chain, not a tree")
            self.lookup_bounds()
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            name = "prompt_lookup_min" if self.prompt_lookup_min is not None else "prompt_lookup_max"
            raise ValueError(f"{name}: only the ngram method looks up n-grams (set speculative_method ngram)")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
