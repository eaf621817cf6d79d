"""Model runner: owns the weights and the paged KV cache, turns a scheduled batch into one forward.

Input preparation happens on the host in plain lists, then moves to the device in one pinned,
non-blocking copy per tensor, so the GPU is never waiting on many tiny transfers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmserve_core.config import EngineConfig
from llmserve_core.engine.batch import ForwardBatch
from llmserve_core.engine.request import Request
from llmserve_core.engine.scheduler import ScheduledBatch
from llmserve_core.layers.attention import get_backend
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
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.block_size = config.block_size
        self.pin = self.device.type == "cuda"
        self.attn_backend = get_backend(config.attention_backend, str(self.device))
        self.model = load_model(model_config, config.model, config.load_format, self.dtype, self.device,
                                self.attn_backend, config.seed)
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.num_blocks = config.num_kv_blocks or self._kv_blocks_that_fit()
        self.kv_caches = self._allocate_kv(self.num_blocks)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        torch.manual_seed(config.seed)

    # ---- KV cache --------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        m = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * m.num_hidden_layers * self.block_size * m.num_key_value_heads * m.head_dim * elem

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

    def _allocate_kv(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        m = self.model_config
        shape = (num_blocks, self.block_size, m.num_key_value_heads, m.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(m.num_hidden_layers)]

    # ---- one step --------------------------------------------------------------------------------
    def _to_device(self, data, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.pin)
        return t.to(self.device, non_blocking=True)

    def prepare(self, sched: ScheduledBatch) -> PreparedBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        max_blocks = 0
        for req, n in zip(sched.requests, sched.num_new_tokens):
            start = req.num_computed_tokens
            end = start + n
            input_ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            max_blocks = max(max_blocks, len(blocks))
            if end == req.num_tokens:          # the chunk reaches the last token: sample the next one
                sample_rows.append(query_start[-1] - 1)
                sample_requests.append(req)
        table = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in sched.requests]
        batch = ForwardBatch(
            positions=self._to_device(positions, torch.int64),
            slot_mapping=self._to_device(slots, torch.int64),
            query_start_loc=self._to_device(query_start, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            block_tables=self._to_device(table, torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return PreparedBatch(self._to_device(input_ids, torch.int64), batch,
                             self._to_device(sample_rows, torch.int64), sample_requests)

    @torch.inference_mode()
    def execute(self, sched: ScheduledBatch) -> tuple[list[Request], SamplerOutput | None]:
        """Run one forward over the scheduled tokens; sample for requests whose chunk ends their sequence."""
        prepared = self.prepare(sched)
        hidden = self.model(prepared.input_ids, prepared.batch, self.kv_caches)
        if not prepared.sample_requests:
            return [], None
        logits = self.model.compute_logits(hidden[prepared.sample_rows])
        params = [r.params for r in prepared.sample_requests]
        gens = [r.generator for r in prepared.sample_requests]
        return prepared.sample_requests, sample(logits, SamplingTensors.from_params(params, gens, self.device))

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


# Sampling settings that exercise the most expensive sampler path during memory profiling.
_PROFILE_PARAMS = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=50)
