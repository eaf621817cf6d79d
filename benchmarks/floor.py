"""The floor every speed number is held against: the least time a step can take on this card.

A step must read every weight it multiplies by once (the 36 layers, the final norm and the lm_head), plus
one embedding row per token (not the whole table: a lookup reads only its rows), the K/V of every context
position attended to, and write the K/V of its new tokens. It must also do its multiply-adds. So

    floor = max(bytes / measured copy bandwidth, FLOPs / measured bf16 matmul peak)

with both rates measured on the card in the same run. At batch 1 the bytes decide; at large batches and in
steps that carry prefill chunks the FLOPs can. Activations are left out (a few MB per step), so the floor
is a little generous, never too strict. One helper for every benchmark, so their ratios mean the same.

With FP8 weights (`linear_bytes=1`) the decoder's projections read one byte a weight plus a float32 scale
per output row (norms, embeddings and the lm_head stay in the model dtype); with an FP8 KV cache
(`kv_dtype_bytes=1`) the K/V read and written is one byte an element.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


def linear_params_per_layer(cfg: dict) -> int:
    """Weights one decoder layer multiplies by: qkv, o, gate/up, down."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return h * (q + 2 * kv) + q * h + 3 * h * i


def norm_params_per_layer(cfg: dict) -> int:
    """The two RMSNorm weights and Qwen3's per-head q/k norms."""
    return 2 * cfg["hidden_size"] + 2 * cfg["head_dim"]


def linear_rows_per_layer(cfg: dict) -> int:
    """Output rows of a layer's projections: one float32 scale each in a per-channel FP8 layer."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return (q + 2 * kv) + h + 2 * i + h


def step_weight_bytes(cfg: dict, dtype_bytes: int = 2, linear_bytes: int | None = None) -> int:
    """What any step reads whatever its batch: the layers, the final norm and the lm_head (the embedding
    table is read a row per token, counted in step_bytes). linear_bytes: the projections' element size
    when it differs from the model's (1: FP8, with a float32 scale per output row)."""
    h, L, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    if linear_bytes is None or linear_bytes == dtype_bytes:
        linears = dtype_bytes * linear_params_per_layer(cfg)
    else:
        linears = linear_bytes * linear_params_per_layer(cfg) + 4 * linear_rows_per_layer(cfg)
    return L * (linears + dtype_bytes * norm_params_per_layer(cfg)) + dtype_bytes * (h + v * h)


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * dtype_bytes


@dataclass(frozen=True)
class StepShape:
    """One engine step: decode rows (their context lengths after the step, the new token included) and
    prefill/extend chunks as (tokens already cached, new tokens). Every decode row samples; a chunk samples
    only when it ends its prompt (sampled_chunks of them, the last ones)."""
    decode_contexts: tuple[int, ...] = ()
    prefill_chunks: tuple[tuple[int, int], ...] = ()
    sampled_chunks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.decode_contexts) + sum(new for _, new in self.prefill_chunks)

    @property
    def num_sampled(self) -> int:
        return len(self.decode_contexts) + self.sampled_chunks


def step_bytes(cfg: dict, shape: StepShape, dtype_bytes: int = 2, linear_bytes: int | None = None,
               kv_dtype_bytes: int | None = None) -> int:
    kv = kv_bytes_per_token(cfg, kv_dtype_bytes or dtype_bytes)
    # A decode row attends over its context, including the token it writes.
    kv_read = sum(shape.decode_contexts) + sum(cached + new for cached, new in shape.prefill_chunks)
    embedding_rows = shape.num_tokens * cfg["hidden_size"] * dtype_bytes
    return step_weight_bytes(cfg, dtype_bytes, linear_bytes) + embedding_rows + kv * (kv_read + shape.num_tokens)


def attention_flops(cfg: dict, keys_seen: int) -> int:
    """QK^T and PV over every layer, for query rows that together see keys_seen (query, key) pairs."""
    per_pair = 4 * cfg["num_attention_heads"] * cfg["head_dim"]
    return cfg["num_hidden_layers"] * per_pair * keys_seen


def step_flops(cfg: dict, shape: StepShape) -> int:
    linear = 2 * cfg["num_hidden_layers"] * linear_params_per_layer(cfg) * shape.num_tokens
    lm_head = 2 * cfg["vocab_size"] * cfg["hidden_size"] * shape.num_sampled
    keys = sum(shape.decode_contexts)
    for cached, new in shape.prefill_chunks:
        # Causal: query j of the chunk sees the cached prefix and the chunk's first j + 1 tokens.
        keys += new * cached + new * (new + 1) // 2
    return linear + lm_head + attention_flops(cfg, keys)


@dataclass(frozen=True)
class Floor:
    bytes: int
    flops: int
    memory_ms: float
    compute_ms: float

    @property
    def ms(self) -> float:
        return max(self.memory_ms, self.compute_ms)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_ms >= self.compute_ms else "compute"

    def as_dict(self) -> dict:
        return {**asdict(self), "floor_ms": self.ms, "bound": self.bound}


def step_floor(cfg: dict, shape: StepShape, bandwidth: float, peak_flops: float, dtype_bytes: int = 2,
               linear_bytes: int | None = None, kv_dtype_bytes: int | None = None) -> Floor:
    """bandwidth in bytes/s (the measured copy rate, read + write), peak_flops in FLOP/s (measured). The
    FLOPs are held against the bf16 peak whatever the weights' dtype (FP8 products could run faster: at the
    batches where FLOPs decide, that makes an FP8 floor generous, never strict)."""
    if bandwidth <= 0 or peak_flops <= 0:
        raise ValueError(f"bandwidth and peak_flops must be positive, got {bandwidth}, {peak_flops}")
    b, f = step_bytes(cfg, shape, dtype_bytes, linear_bytes, kv_dtype_bytes), step_flops(cfg, shape)
    return Floor(bytes=b, flops=f, memory_ms=b / bandwidth * 1e3, compute_ms=f / peak_flops * 1e3)


def decode_floor(cfg: dict, contexts, bandwidth: float, peak_flops: float, dtype_bytes: int = 2,
                 linear_bytes: int | None = None, kv_dtype_bytes: int | None = None) -> Floor:
    """A pure decode step over rows with these context lengths."""
    return step_floor(cfg, StepShape(decode_contexts=tuple(contexts)), bandwidth, peak_flops, dtype_bytes,
                      linear_bytes, kv_dtype_bytes)


def prompts_floor(cfg: dict, lengths, budget: int, bandwidth: float, peak_flops: float, head_rows: int = 0,
                  lm_head: bool = True, dtype_bytes: int = 2) -> Floor:
    """Prompts that end after their prefill (pooling requests), run in steps of at most `budget` tokens:
    every step reads every weight once (the lm_head only where the model has one: an embedding model does
    not), every prompt token goes through the layers and causal attention over its prompt, and each prompt
    reads `head_rows` rows of the lm_head (a score's named tokens; an embedding none)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    lengths = list(lengths)
    tokens = sum(lengths)
    steps = -(-tokens // budget)
    weights = step_weight_bytes(cfg, dtype_bytes) - (0 if lm_head else dtype_bytes * v * h)
    kv = kv_bytes_per_token(cfg, dtype_bytes)
    nbytes = steps * weights + sum(n * h * dtype_bytes + 2 * n * kv + head_rows * h * dtype_bytes for n in lengths)
    flops = sum(step_flops(cfg, StepShape(prefill_chunks=((0, n),))) for n in lengths) + 2 * h * head_rows * len(lengths)
    return Floor(bytes=nbytes, flops=flops, memory_ms=nbytes / bandwidth * 1e3, compute_ms=flops / peak_flops * 1e3)


# ---- Qwen3-MoE: what a step reads is the experts its routing selected ----------------------------------

def moe_layer_params(cfg: dict) -> dict:
    """One sparse layer's weights: attention's projections (and their output rows), the router, one expert."""
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return {"attention": h * (q + 2 * kv) + q * h, "attention_rows": q + 2 * kv + h,
            "router": cfg["num_experts"] * h, "expert": 3 * h * i, "expert_rows": 2 * i + h}


def moe_step_bytes(cfg: dict, shape: StepShape, experts_read: float, dtype_bytes: int = 2,
                   linear_bytes: int | None = None, kv_dtype_bytes: int | None = None) -> float:
    """A Qwen3-MoE step (every layer sparse): attention's projections, the router and the norms of every
    layer, each (layer, expert) pair the step's routing selected once (experts_read: their count, summed over
    layers), the final norm, the lm_head, an embedding row a token, and the K/V read and written.
    linear_bytes 1: projections and experts in FP8 with a float32 scale per output row (the router, norms,
    embeddings and lm_head stay in the model dtype)."""
    p, L = moe_layer_params(cfg), cfg["num_hidden_layers"]
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    if linear_bytes is None or linear_bytes == dtype_bytes:
        attention, expert = dtype_bytes * p["attention"], dtype_bytes * p["expert"]
    else:
        attention = linear_bytes * p["attention"] + 4 * p["attention_rows"]
        expert = linear_bytes * p["expert"] + 4 * p["expert_rows"]
    per_layer = attention + dtype_bytes * (p["router"] + norm_params_per_layer(cfg))
    kv = kv_bytes_per_token(cfg, kv_dtype_bytes or dtype_bytes)
    kv_read = sum(shape.decode_contexts) + sum(cached + new for cached, new in shape.prefill_chunks)
    return (L * per_layer + experts_read * expert + dtype_bytes * (h + v * h)
            + shape.num_tokens * h * dtype_bytes + kv * (kv_read + shape.num_tokens))


def moe_step_flops(cfg: dict, shape: StepShape) -> tuple[int, int]:
    """(the projections', router's, experts' and lm_head's FLOPs, attention's): 2 per active weight per
    token (each token's top-k experts), the lm_head's per sampled row, and QK^T and PV."""
    p, L = moe_layer_params(cfg), cfg["num_hidden_layers"]
    active = p["attention"] + p["router"] + cfg["num_experts_per_tok"] * p["expert"]
    linear = 2 * L * active * shape.num_tokens + 2 * cfg["vocab_size"] * cfg["hidden_size"] * shape.num_sampled
    keys = sum(shape.decode_contexts)
    for cached, new in shape.prefill_chunks:
        keys += new * cached + new * (new + 1) // 2
    return linear, attention_flops(cfg, keys)


def moe_step_floor(cfg: dict, shape: StepShape, experts_read: float, bandwidth: float, peak_flops: float,
                   dtype_bytes: int = 2, linear_bytes: int | None = None, kv_dtype_bytes: int | None = None,
                   linear_peak: float | None = None) -> Floor:
    """max(moe_step_bytes / bandwidth, FLOPs / peak), the projections' and experts' FLOPs over linear_peak
    where given (FP8 products on FP8 tensor cores), attention's over the bf16 peak."""
    if bandwidth <= 0 or peak_flops <= 0:
        raise ValueError(f"bandwidth and peak_flops must be positive, got {bandwidth}, {peak_flops}")
    b = moe_step_bytes(cfg, shape, experts_read, dtype_bytes, linear_bytes, kv_dtype_bytes)
    linear, attention = moe_step_flops(cfg, shape)
    compute_s = linear / (linear_peak or peak_flops) + attention / peak_flops
    return Floor(bytes=int(b), flops=linear + attention, memory_ms=b / bandwidth * 1e3, compute_ms=compute_s * 1e3)


# ---- the two rates, measured on the card (CUDA), as medians of many timed repeats -----------------

def measure_copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting the read and the write."""
    import torch
    from triton.testing import do_bench
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * nbytes / (do_bench(lambda: y.copy_(x), warmup=50, rep=200, return_mode="median") / 1e3)


def measure_bf16_peak(n: int = 8192) -> float:
    """Dense bf16 matmul rate in FLOP/s at a square shape large enough to saturate the card."""
    import torch
    from triton.testing import do_bench
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n ** 3 / (do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median") / 1e3)
