"""Model runner: owns the weights and the paged KV cache, turns a scheduled batch into one forward.

Input preparation happens on the host (engine/batch_builder.py), then moves to the device in one pinned,
non-blocking copy, so the GPU is never waiting on many tiny transfers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from llmserve_core.config import EngineConfig
from llmserve_core.engine.batch_builder import BatchBuilder, HostToDevice
from llmserve_core.engine.grammar import MaskBuilder
from llmserve_core.engine.logits_inputs import build_logits_processors
from llmserve_core.engine.pooling import PoolRows, pool
from llmserve_core.engine.prompt_logprobs import PromptRows, score
from llmserve_core.engine.request import PLACEHOLDER, Request
from llmserve_core.engine.scheduler import ScheduledBatch
from llmserve_core.engine.step_graphs import StepGraphs
from llmserve_core.engine.step_result import StepHandle
from llmserve_core.layers import index_checks
from llmserve_core.layers.attention import get_backend
from llmserve_core.layers.batch import ForwardBatch
from llmserve_core.layers.fast_path import use_cuda_graphs
from llmserve_core.layers.sampler import SamplerOutput, SamplingTensors, only_argmax, sample
from llmserve_core.models.config import ModelConfig
from llmserve_core.models.loader import load_model
from llmserve_core.speculative.tree import compact_kv
from llmserve_proto import SamplingParams

log = logging.getLogger("llmserve.runner")


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    batch: ForwardBatch | None       # None where the step went straight into the decode graph's inputs
    sample_rows: torch.Tensor | None  # [S] rows of the packed tokens whose logits are sampled
    sample_requests: list[Request]   # the requests those rows belong to
    samples_every_row: bool          # a decode: sample_rows is 0..S-1, so hidden[:S] needs no gather
    prompt: PromptRows               # rows scoring prompt tokens (prompt logprobs)
    graph_seqs: int | None = None    # sequences loaded into the decode graph (StepGraphs.load), to replay
    pool: PoolRows | None = None     # rows of pooling requests whose prompt this step completes


class ModelRunner:
    """Built in two stages: the constructor loads the weights; allocate_kv_cache() then sizes the KV pool
    from the memory left (after anything else loaded in between, e.g. a draft model) and captures the
    decode graphs."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 lookahead_tokens: int = 0, tp=None, pooling: bool = False):
        """tp: a distributed.group.TPGroup: hold this rank's shard, and a KV pool of the size every rank fits.
        pooling: the pooling runner (engine/pooling.py): prompts only, so no decode graphs, and a KV pool
        for the prompts in flight."""
        self.config = config
        self.pooling = pooling
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.kv_dtype = config.resolved_kv_cache_dtype()
        self.block_size = config.block_size
        self.pin = self.device.type == "cuda"
        self.attn_backend = get_backend(config.attention_backend, str(self.device))
        # The one switch for CUDA graphs, the runner's and the speculative executor's.
        self.use_graphs = use_cuda_graphs(self.device, self.attn_backend, config.enforce_eager)
        self.model = load_model(model_config, config.model, config.load_format, self.dtype, self.device,
                                self.attn_backend, config.seed, quantization=config.quantization, tp=tp)
        if tp is not None:
            self.model = tp.wrap(self.model)
            self.model_config = tp.shard.local_config(model_config)   # this rank's KV heads
        # lookahead: KV slots past the last token that speculative verification writes.
        self.max_blocks_per_seq = -(-(max_model_len + lookahead_tokens) // self.block_size)
        self.staging = HostToDevice(self.device, self.pin)
        # What every forward's indices must stay inside (layers/index_checks.py), once the KV pool exists.
        self.index_limits: index_checks.IndexLimits | None = None
        # Rows of float32 logits one sampling call may hold: the memory profile's, so scoring a long prompt
        # chunk a slice of this many rows at a time stays within the profiled peak.
        self.logits_rows = min(config.max_num_seqs, 1024)
        self.builder = self.batch_builder(config.max_num_batched_tokens, config.max_num_seqs)
        self.last_sampled: torch.Tensor | None = None   # the latest step's sampled ids, on the device
        self.tp = tp
        self.extra_kv_bytes_per_block = 0
        self.num_blocks = 0
        self.kv_pool: torch.Tensor | None = None          # [layers, 2, blocks, block_size, kv_heads, head_dim]
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []     # per layer: views of kv_pool
        self.graphs: StepGraphs | None = None
        # Every StepGraphs over a forward of this model (the decode's, the speculative verify's), in the
        # order they were built: the same on every tensor-parallel rank, so an index names one to the workers.
        self.mirrored: list[StepGraphs] = []
        # Grammar bitmasks: one pinned buffer is enough. A step fills it only once the step before is read
        # back (the engine completes it before sampling grammar rows), and that readback waited for an
        # event recorded after every earlier copy out of the buffer.
        self.masks = MaskBuilder(config.max_num_seqs, model_config.vocab_size, self.device, self.pin)
        torch.manual_seed(config.seed)

    def batch_builder(self, rows: int, seqs: int) -> BatchBuilder:
        """A builder over this runner's staging (the executor keeps its own, so its batches never clobber
        the scratch of one being built here)."""
        builder = BatchBuilder(self.block_size, self.max_model_len, self.staging, rows, seqs, self.max_blocks_per_seq)
        builder.limits = self.index_limits
        return builder

    def allocate_kv_cache(self, extra_kv_bytes_per_block: int = 0) -> None:
        """Size the KV pool (extra_kv_bytes_per_block: the draft's KV pool shares the block ids), allocate
        it, and capture the decode graphs."""
        self.extra_kv_bytes_per_block = extra_kv_bytes_per_block
        self.num_blocks = self.config.num_kv_blocks or self._kv_blocks_that_fit()
        if self.tp is not None:      # one block table serves every rank
            self.num_blocks = self.tp.agree_min(self.num_blocks)
        self.kv_pool = self._allocate_kv(self.num_blocks)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_pool]
        self.index_limits = index_checks.IndexLimits(self.num_blocks, self.block_size, self.max_model_len,
                                                     self.model_config.vocab_size)
        self.builder.limits = self.index_limits
        self.graphs = self._capture_graphs()

    # ---- KV cache --------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        m = self.model_config
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return (2 * m.num_hidden_layers * self.block_size * m.num_key_value_heads * m.head_dim * elem
                + self.extra_kv_bytes_per_block)

    def _kv_blocks_that_fit(self) -> int:
        # Never more than every sequence slot at full length could use; prompts alone hold no more than the
        # longest prompt and two steps of chunks (one computing, one being read back), each request's last
        # block partly filled.
        ceiling = self.config.max_num_seqs * self.max_blocks_per_seq + 1
        if self.pooling:
            step = -(-self.config.max_num_batched_tokens // self.block_size) + self.config.max_num_seqs
            ceiling = min(ceiling, self.max_blocks_per_seq + 2 * step)
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
        kv = [(layer[0], layer[1]) for layer in self._allocate_kv(scratch_blocks)]
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
        if not self.pooling:         # the pooling runner never samples
            rows = self.logits_rows
            logits = self.model.compute_logits(hidden[:1].expand(rows, -1))
            sample(logits, SamplingTensors.from_params([_PROFILE_PARAMS] * rows, self.device))
            del logits
        torch.cuda.synchronize()
        del kv, hidden
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        others = (total - free) - torch.cuda.memory_reserved()   # other processes and the CUDA context
        torch.cuda.empty_cache()
        budget = total * self.config.gpu_memory_utilization - peak - others
        log.info("memory profile: peak %.2f GiB, others %.2f GiB, %.2f GiB left for KV",
                 peak / 2**30, others / 2**30, budget / 2**30)
        return max(0, int(budget))

    def _capture_graphs(self) -> StepGraphs | None:
        if not self.use_graphs or self.pooling:       # nothing decodes
            return None
        return self.model_graphs("decode", self._decode_forward, 1, self.config.max_num_seqs, self.max_blocks_per_seq,
                                 self.max_model_len, self.device)

    def _decode_forward(self, input_ids, _hidden, batch):
        return (self.model(input_ids, batch, self.kv_caches),)

    # ---- graphs over this model's forward: under tensor parallelism, every rank replays them ---------
    def model_graphs(self, name: str, fn, rows: int, *args, **kwargs) -> StepGraphs:
        """StepGraphs over a forward that calls this model (no hidden input), captured where the device can
        (elsewhere the same bookkeeping runs eagerly). Under tensor parallelism every rank builds the same
        ones in the same order, at start-up and in lockstep: each capture's warm-up calls and the
        all-reduces captured inside are collectives that the other ranks' identical captures meet."""
        graphs = StepGraphs(name, fn, rows, *args, capture=self.device.type == "cuda", **kwargs)
        graphs.index_limits = self.index_limits
        self.mirrored.append(graphs)
        return graphs

    def run_graphs(self, graphs: StepGraphs, input_ids: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """graphs.run over this batch. On rank 0 of tensor parallelism the step is announced naming the graph,
        so every worker loads the same inputs into its own copy and replays the same bucket (run_announced)."""
        if self.tp is None or self.tp.driver is None:
            return graphs.run(input_ids, None, batch)
        return self.model.run_graph(self.mirrored.index(graphs), graphs, input_ids, batch)

    def run_announced(self, index: int, input_ids: torch.Tensor, batch: ForwardBatch) -> None:
        """A worker's side of run_graphs: the same graph, the inputs rank 0 broadcast (its outputs are
        rank 0's to use)."""
        self.mirrored[index].run(input_ids, None, batch)

    def release_graphs(self) -> None:
        """Free every captured graph of this model. Before tearing a process group down: graphs holding
        captured NCCL collectives can hang destroy_process_group (pytorch/pytorch#115388)."""
        for graphs in self.mirrored:
            graphs.release()
        self.graphs = None

    def move_kv(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy every layer's K and V from src to dst slots (a tree's accepted path moving into place). Under
        tensor parallelism rank 0 announces the move first, and each worker makes it on its own shard."""
        if self.tp is not None and self.tp.driver is not None:
            self.tp.driver.compact_kv(src_slots, dst_slots)
        compact_kv(self.kv_pool, src_slots, dst_slots)

    def _allocate_kv(self, num_blocks: int) -> torch.Tensor:
        """One tensor for every layer's K and V, so a tree's KV compaction moves all of them in one op."""
        m = self.model_config
        shape = (m.num_hidden_layers, 2, num_blocks, self.block_size, m.num_key_value_heads, m.head_dim)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    # ---- one step --------------------------------------------------------------------------------
    def prepare(self, sched: ScheduledBatch, into_graph: bool = False) -> PreparedBatch:
        """Pack the scheduled chunks into device tensors. A PLACEHOLDER input (a token the previous,
        still running step sampled) is filled on the device from that step's output tensor. into_graph:
        a batch the decode graph can run goes straight into its inputs (no ForwardBatch; _forward replays)."""
        self.staging.new_step()
        b = self.builder
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        fill_rows: list[int] = []
        fill_from: list[int] = []
        prompt, pooled = PromptRows(), PoolRows()
        for req, n in zip(sched.requests, sched.num_new_tokens):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            row = b.add(req.block_ids, start, n, req.token_ids[start] if n == 1 else req.token_ids[start:end])
            prompt.add(req, row, start, n)
            if req.token_ids[end - 1] == PLACEHOLDER:    # only ever the last token of a chunk
                fill_rows.append(row + n - 1)
                fill_from.append(req.sample_index)
            if end == req.num_tokens and req.pooling is not None:    # its prompt is done: pool its last row
                pooled.add(req, row + n - 1)
            elif end == req.num_tokens:                  # the chunk reaches the last token: sample the next one
                req.sample_index = len(sample_rows)
                sample_rows.append(row + n - 1)
                sample_requests.append(req)
        if into_graph and self._loads_graph(sched, len(sample_rows), prompt):
            # Straight into the decode graph's inputs: one copy from the host, where building a ForwardBatch
            # on the device and copying it into the graph's buffers took five more launches, each a gap on
            # the GPU between two steps.
            graphs, k = self.graphs, len(fill_rows)
            n = graphs.load(b.finish_host(), np.asarray(fill_rows + fill_from, dtype=np.int64))
            prepared = PreparedBatch(graphs.input_ids[:n], None, None, sample_requests, samples_every_row=True,
                                     prompt=prompt, graph_seqs=n)
            fill_at, fill_src = graphs.extra[:k], graphs.extra[k:2 * k]
        else:
            prompt_extras = prompt.extras()
            built = b.finish((sample_rows, fill_rows, fill_from) + prompt_extras + pooled.extras())
            rows, fill_at, fill_src = built.extras[:3]
            prompt.placed(built.extras[3:3 + len(prompt_extras)])
            pooled.placed(built.extras[3 + len(prompt_extras):])
            prepared = PreparedBatch(built.input_ids, built.batch, rows, sample_requests,
                                     samples_every_row=len(sample_rows) == built.batch.num_tokens, prompt=prompt,
                                     pool=pooled if pooled.entries else None)
        if fill_rows:
            if index_checks.ENABLED:
                self._check_fills(sched, fill_from)
            prepared.input_ids.index_copy_(0, fill_at, self.last_sampled[fill_src])
        return prepared

    def _check_fills(self, sched: ScheduledBatch, fill_from: list[int]) -> None:
        """A placeholder is filled from a row of the latest step's sampled tokens: one that step has."""
        have = 0 if self.last_sampled is None else self.last_sampled.shape[0]
        placeholders = [r for r, n in zip(sched.requests, sched.num_new_tokens)
                        if r.token_ids[r.num_computed_tokens + n - 1] == PLACEHOLDER]     # as prepare() finds them
        for req, src in zip(placeholders, fill_from):
            if not 0 <= src < have:
                raise index_checks.IndexCheckError(
                    f"index check, a step's placeholder fill: request {req.request_id!r}: sample_index {src} is "
                    f"outside the {have} tokens the step before sampled")

    def _loads_graph(self, sched: ScheduledBatch, sampled: int, prompt: PromptRows) -> bool:
        """Whether prepare() loads this step straight into the decode graph: one row a sequence, each sampled
        and none scoring a prompt token, within the largest bucket. Under tensor parallelism rank 0 hands
        the workers the ForwardBatch itself (run_graphs), so there the step keeps building one."""
        return (self.graphs is not None and self.tp is None and not prompt.rows and sampled == len(sched.requests)
                and all(n == 1 for n in sched.num_new_tokens) and self.graphs.bucket_for(sampled) is not None)

    def _forward(self, prepared: PreparedBatch) -> torch.Tensor:
        if prepared.graph_seqs is not None:
            return self.graphs.replay(prepared.graph_seqs)[0]
        batch = prepared.batch
        if self.graphs is not None and batch.is_decode and self.graphs.fits(batch):
            return self.run_graphs(self.graphs, prepared.input_ids, batch)[0]
        return self.model(prepared.input_ids, batch, self.kv_caches)

    def sample(self, hidden: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """Sample one token per row of `hidden` (the rows of `reqs`, in order), with each request's
        sampling parameters (a seeded row's noise keyed by its seed and the position it samples, the
        request's num_tokens) and logits processors; device tensors."""
        if all(only_argmax(r.params) for r in reqs):
            # A greedy batch that asks for nothing else: the lm_head's kernel takes the argmax itself.
            tokens = self.model.greedy_tokens(hidden)
            if tokens is not None:
                return SamplerOutput(tokens)
        logits = self.model.compute_logits(hidden)
        st = SamplingTensors.from_params([r.params for r in reqs], self.device, pin=self.pin,
                                         positions=[r.num_tokens for r in reqs])
        # Built after the forward is queued: on a GPU the host fills grammar masks while it runs.
        processors = build_logits_processors(reqs, self.model_config.vocab_size, self.device, self.masks,
                                             pin=self.pin)
        return sample(logits, st, processors)

    @torch.inference_mode()
    def launch(self, sched: ScheduledBatch) -> StepHandle:
        """Queue one forward over the scheduled tokens and sampling for the requests whose chunk ends
        their sequence; the sampled ids come back asynchronously through the returned handle."""
        handle = self.launch_forward(sched)
        self.launch_sample(handle)
        return handle

    @torch.inference_mode()
    def launch_forward(self, sched: ScheduledBatch) -> StepHandle:
        """launch() in two parts: queue the forward here, the sampling in launch_sample(). In between the
        engine may read the previous step back (its grammar matchers and penalty counts must see that
        step's tokens before this one samples) while this forward runs on the device."""
        prepared = self.prepare(sched, into_graph=True)
        hidden = self._forward(prepared)
        reqs = prepared.sample_requests
        # A view of a captured graph's output is safe: the engine queues this step's sampling before the
        # next forward (whose replay overwrites it); only a prefill's scattered rows need the gather.
        to_sample = None
        if reqs:
            to_sample = hidden[:len(reqs)] if prepared.samples_every_row else hidden[prepared.sample_rows]
        handle = StepHandle(sched, sampled_requests=reqs, to_sample=to_sample)
        scores = self.score_prompts(hidden, prepared.prompt)
        if scores is not None:
            handle.set_prompt_scores(prepared.prompt.spans, scores)
        if prepared.pool is not None:
            handle.set_pooled(pool(hidden, lambda: self.model.lm_head_weight, prepared.pool, self.pin))
        return handle

    def score_prompts(self, hidden: torch.Tensor, prompt: PromptRows) -> SamplerOutput | None:
        """Queue the prompt logprobs of a step's prompt rows (of `hidden`) and their copy to the host; None
        when no row scores a prompt token."""
        if not prompt.spans:
            return None
        return score(self.model.compute_logits, hidden, prompt, self.logits_rows).to_host(self.pin)

    @torch.inference_mode()
    def launch_sample(self, handle: StepHandle) -> None:
        """Queue the sampling of a launch_forward() step and the copy of its ids to the host."""
        if handle.to_sample is None:
            return
        out = self.sample(handle.to_sample, handle.sampled_requests)
        if index_checks.ENABLED:
            index_checks.check_tokens("sampled tokens", out.token_ids, self.model_config.vocab_size,
                                      [r.request_id for r in handle.sampled_requests])
        self.last_sampled = out.token_ids
        handle.set_sampled(out.to_host(self.pin))


# Sampling settings that exercise the most expensive sampler path during memory profiling.
_PROFILE_PARAMS = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=50)
