"""Model runner: owns the weights and the paged KV cache, turns a scheduled batch into one forward.

Input preparation happens on the host in plain lists, then moves to the device in one pinned,
non-blocking copy per tensor, so the GPU is never waiting on many tiny transfers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from llmserve_core.config import EngineConfig
from llmserve_core.layers.batch import ForwardBatch
from llmserve_core.engine.cuda_graphs import DecodeGraphs
from llmserve_core.engine.grammar import MaskBuilder
from llmserve_core.engine.logits_inputs import build_logits_processors
from llmserve_core.engine.request import PLACEHOLDER, Request
from llmserve_core.engine.scheduler import ScheduledBatch
from llmserve_core.layers.attention import get_backend
from llmserve_core.layers.fast_path import use_cuda_graphs
from llmserve_core.layers.sampler import SamplerOutput, SamplingTensors, sample
from llmserve_core.models.config import ModelConfig
from llmserve_core.models.loader import load_model
from llmserve_proto import SamplingParams

log = logging.getLogger("llmserve.runner")


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    batch: ForwardBatch
    sample_rows: torch.Tensor        # [S] rows of the packed tokens whose logits are sampled
    sample_requests: list[Request]   # the requests those rows belong to


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 lookahead_tokens: int = 0, extra_kv_bytes_per_block: int = 0, tp=None):
        """tp: a distributed.group.TPGroup: hold this rank's shard, and a KV pool of the size every rank fits."""
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.kv_dtype = config.resolved_kv_cache_dtype()
        self.block_size = config.block_size
        self.pin = self.device.type == "cuda"
        self.attn_backend = get_backend(config.attention_backend, str(self.device))
        self.model = load_model(model_config, config.model, config.load_format, self.dtype, self.device,
                                self.attn_backend, config.seed, quantization=config.quantization, tp=tp)
        if tp is not None:
            self.model = tp.wrap(self.model)
            self.model_config = tp.shard.local_config(model_config)   # this rank's KV heads
        # lookahead: KV slots past the last token that speculative verification writes.
        self.max_blocks_per_seq = -(-(max_model_len + lookahead_tokens) // self.block_size)
        self.extra_kv_bytes_per_block = extra_kv_bytes_per_block   # the draft's KV pool shares the block ids
        self.staging = [Staging(config.max_num_batched_tokens, config.max_num_seqs, self.max_blocks_per_seq, self.pin)
                        for _ in range(2)]
        self.num_launched = 0
        self.last_sampled: torch.Tensor | None = None   # the latest step's sampled ids, on the device
        self.num_blocks = config.num_kv_blocks or self._kv_blocks_that_fit()
        if tp is not None:           # one block table serves every rank
            self.num_blocks = tp.agree_min(self.num_blocks)
        self.kv_caches = self._allocate_kv(self.num_blocks)
        self.graphs = self._capture_graphs()
        # Grammar bitmasks: one pinned buffer is enough, since steps with grammar rows run synchronously.
        self.masks = MaskBuilder(config.max_num_seqs, model_config.vocab_size, self.device, self.pin)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        torch.manual_seed(config.seed)

    # ---- KV cache --------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        m = self.model_config
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return (2 * m.num_hidden_layers * self.block_size * m.num_key_value_heads * m.head_dim * elem
                + self.extra_kv_bytes_per_block)

    def _kv_blocks_that_fit(self) -> int:
        # Never more than every sequence slot at full length could use.
        ceiling = self.config.max_num_seqs * self.max_blocks_per_seq + 1
        if self.device.type != "cuda":
            return max(1, min(ceiling, int(self.config.cpu_kv_cache_gib * 2**30) // self.kv_bytes_per_block()))
        free_for_kv = self._profile_free_memory()
        blocks = int(free_for_kv // self.kv_bytes_per_block())
        if blocks < self.max_blocks_per_seq:
            raise RuntimeError(
                f"gpu_memory_utilization: only {blocks} KV blocks fit after weights and activations, "
                f"one max_model_len sequence needs {self.max_blocks_per_seq}; raise --gpu-memory-utilization "
                "or lower --max-model-len / --max-num-batched-tokens")
        return min(blocks, ceiling)

    def _profile_free_memory(self) -> int:
        """Run the worst-case forward (a full token budget of prefill, then max_num_seqs rows of sampling)
        and return the bytes left for KV under gpu_memory_utilization."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = min(self.config.max_num_batched_tokens, self.config.max_num_seqs * self.max_model_len)
        seq_len = min(num_tokens, self.max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        scratch_blocks = sum(-(-n // self.block_size) for n in lens) + 1
        kv = self._allocate_kv(scratch_blocks)
        reqs = []
        next_block = 0
        for n in lens:
            nb = -(-n // self.block_size)
            r = Request("profile", [0] * n, _PROFILE_PARAMS, frozenset(), self.max_model_len)
            r.block_ids = list(range(next_block, next_block + nb))
            next_block += nb
            reqs.append(r)
        prepared = self.prepare(ScheduledBatch(reqs, lens))
        hidden = self.model(prepared.input_ids, prepared.batch, kv)
        rows = min(self.config.max_num_seqs, 1024)
        logits = self.model.compute_logits(hidden[:1].expand(rows, -1))
        st = SamplingTensors.from_params([_PROFILE_PARAMS] * rows, [None] * rows, self.device)
        sample(logits, st)
        torch.cuda.synchronize()
        del kv, hidden, logits
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        others = (total - free) - torch.cuda.memory_reserved()   # other processes and the CUDA context
        torch.cuda.empty_cache()
        budget = total * self.config.gpu_memory_utilization - peak - others
        log.info("memory profile: peak %.2f GiB, others %.2f GiB, %.2f GiB left for KV",
                 peak / 2**30, others / 2**30, budget / 2**30)
        return max(0, int(budget))

    def _capture_graphs(self) -> DecodeGraphs | None:
        if not use_cuda_graphs(self.device, self.attn_backend, self.config.enforce_eager):
            return None
        return DecodeGraphs(self.model, self.kv_caches, self.config.max_num_seqs, self.max_blocks_per_seq,
                            self.max_model_len, self.device)

    def _allocate_kv(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        m = self.model_config
        shape = (num_blocks, self.block_size, m.num_key_value_heads, m.head_dim)
        return [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                 torch.zeros(shape, dtype=self.kv_dtype, device=self.device)) for _ in range(m.num_hidden_layers)]

    # ---- one step --------------------------------------------------------------------------------
    def _dev(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host.clone()

    def prepare(self, sched: ScheduledBatch) -> PreparedBatch:
        """Pack the scheduled chunks into device tensors. A PLACEHOLDER input (a token the previous,
        still running step sampled) is filled on the device from that step's output tensor."""
        stage = self.staging[self.num_launched % 2]
        bs = self.block_size
        ids, pos, slots = stage.input_ids, stage.positions, stage.slots
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        fill_rows: list[int] = []
        fill_from: list[int] = []
        t = 0
        max_blocks = 0
        stage.query_start[0] = 0
        for i, (req, n) in enumerate(zip(sched.requests, sched.num_new_tokens)):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            blocks = req.block_ids
            if n == 1:                                   # decode: plain ints beat numpy for one token
                ids[t] = req.token_ids[start]
                pos[t] = start
                slots[t] = blocks[start // bs] * bs + start % bs
            else:
                ids[t:t + n] = req.token_ids[start:end]
                p = np.arange(start, end)
                pos[t:t + n] = p
                slots[t:t + n] = np.asarray(blocks)[p // bs] * bs + p % bs
            if req.token_ids[end - 1] == PLACEHOLDER:    # only ever the last token of a chunk
                fill_rows.append(t + n - 1)
                fill_from.append(req.sample_index)
            t += n
            stage.query_start[i + 1] = t
            stage.seq_lens[i] = end
            stage.block_tables[i, :len(blocks)] = blocks
            max_blocks = max(max_blocks, len(blocks))
            query_lens.append(n)
            seq_lens.append(end)
            if end == req.num_tokens:                    # the chunk reaches the last token: sample the next one
                req.sample_index = len(sample_rows)
                sample_rows.append(t - 1)
                sample_requests.append(req)
        b = len(sched.requests)
        stage.sample_rows[:len(sample_rows)] = sample_rows
        h = stage.tensors
        batch = ForwardBatch(
            positions=self._dev(h.positions[:t]),
            slot_mapping=self._dev(h.slots[:t]),
            query_start_loc=self._dev(h.query_start[:b + 1]),
            seq_lens=self._dev(h.seq_lens[:b]),
            block_tables=self._dev(h.block_tables[:b, :max_blocks]),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        input_ids = self._dev(h.input_ids[:t])
        if fill_rows:
            k = len(fill_rows)
            stage.fill_rows[:k] = fill_rows
            stage.fill_from[:k] = fill_from
            src = self.last_sampled[self._dev(h.fill_from[:k])]
            input_ids.index_copy_(0, self._dev(h.fill_rows[:k]), src)
        return PreparedBatch(input_ids, batch, self._dev(h.sample_rows[:len(sample_rows)]), sample_requests)

    def _forward(self, prepared: PreparedBatch) -> torch.Tensor:
        batch = prepared.batch
        if self.graphs is not None and batch.is_decode and self.graphs.bucket_for(batch.num_seqs) is not None:
            return self.graphs.run(prepared.input_ids, batch)
        return self.model(prepared.input_ids, batch, self.kv_caches)

    @torch.inference_mode()
    def launch(self, sched: ScheduledBatch) -> StepHandle:
        """Queue one forward over the scheduled tokens and sampling for the requests whose chunk ends
        their sequence; the sampled ids come back asynchronously through the returned handle."""
        prepared = self.prepare(sched)
        self.num_launched += 1
        hidden = self._forward(prepared)
        reqs = prepared.sample_requests
        if not reqs:
            return StepHandle(sched, [], None)
        logits = self.model.compute_logits(hidden[prepared.sample_rows])
        st = SamplingTensors.from_params([r.params for r in reqs], [r.generator for r in reqs], self.device,
                                         pin=self.pin)
        # Built after the forward is queued: on a GPU the host fills grammar masks while it runs.
        processors = build_logits_processors(reqs, self.model_config.vocab_size, self.device, self.masks)
        out = sample(logits, st, processors)
        self.last_sampled = out.token_ids
        return StepHandle(sched, reqs, out.to_host(self.pin))

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


@dataclass
class StepHandle:
    """A launched step. `result()` waits for its sampled tokens (a no-op on CPU)."""
    sched: ScheduledBatch
    sample_requests: list[Request]
    sampled: SamplerOutput | None
    event: torch.cuda.Event | None = None

    def __post_init__(self):
        if self.sampled is not None and self.sampled.token_ids.is_pinned():
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> SamplerOutput | None:
        if self.event is not None:
            self.event.synchronize()
        return self.sampled


class Staging:
    """Pinned host buffers the step inputs are written into. Two alternate, so a step's inputs are never
    overwritten while the device may still be copying them (at most one step is in flight)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, pin: bool):
        def buf(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)
        i32, i64 = torch.int32, torch.int64
        self.tensors = SimpleNamespace(
            input_ids=buf(max_tokens, dtype=i64), positions=buf(max_tokens, dtype=i64),
            slots=buf(max_tokens, dtype=i64), query_start=buf(max_seqs + 1, dtype=i32),
            seq_lens=buf(max_seqs, dtype=i32), block_tables=buf(max_seqs, max_blocks_per_seq, dtype=i32),
            sample_rows=buf(max_seqs, dtype=i64), fill_rows=buf(max_seqs, dtype=i64),
            fill_from=buf(max_seqs, dtype=i64))
        for name, t in vars(self.tensors).items():   # numpy views: fast element writes from Python
            setattr(self, name, t.numpy())


# Sampling settings that exercise the most expensive sampler path during memory profiling.
_PROFILE_PARAMS = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=50)
