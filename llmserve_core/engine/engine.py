"""The in-process engine: validation, the step loop's bookkeeping, and results.

`Engine.step()` schedules one batch, runs one forward, appends sampled tokens and reports what changed.
The daemon drives the same object from its busy loop; tests and embedders call it directly.
"""
from __future__ import annotations

import logging
import threading
import time

from llmserve_core.config import EngineConfig
from llmserve_core.engine.block_manager import BlockManager
from llmserve_core.engine.grammar import GrammarService, grammars_available
from llmserve_core.engine import pooling
from llmserve_core.engine.outputs import EngineModelInfo, GenerationResult, PooledOutput, PoolingResult, StepOutput
from llmserve_core.engine.request import Request
from llmserve_core.engine.runtime import build_runtime
from llmserve_core.engine.scheduler import Scheduler
from llmserve_core.engine.step_result import StepHandle
from llmserve_core.engine.warmup import warm_up
from llmserve_core.kernels.jit_count import jit_compilations
from llmserve_core.models.config import ModelConfig
from llmserve_core.speculative.policy import Decision, MeasuredCosts, SpecPolicy, batch_bucket
from llmserve_proto import PoolingParams, SamplingParams, ValidationError

log = logging.getLogger("llmserve.engine")


class QueueFull(ValidationError):
    """The client already has as many waiting requests as the engine lets it queue. Not a fault of any field
    (field ""): retrying once some of its requests have started succeeds."""

    def __init__(self, why: str):
        super().__init__("", f"queue full: {why}; retry when some have started")


class Engine:
    def __init__(self, config: EngineConfig, tp=None):
        """tp: rank 0's tensor-parallel group, its other ranks started (distributed.launch.start_engine does
        both); the engine stops them in close(), also when its start-up fails."""
        self.tp = tp
        self.runner = None
        try:
            self._start(config)
        except BaseException:
            self.close()     # the tensor-parallel workers serve by now: they must not outlive this engine
            raise

    def _start(self, config: EngineConfig) -> None:
        config.validate()
        if self.tp is None and config.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size: {config.tensor_parallel_size} ranks must be started before "
                             "the engine: build it with llmserve_core.start_engine(config)")
        self.config = config
        self.model_config = ModelConfig.from_hf_dir(config.model)
        self.grammars = GrammarService(config.tokenizer or config.model, self.model_config.vocab_size,
                                       list(self.model_config.eos_token_ids))
        if config.resolved_warmup() and grammars_available(self.grammars.tokenizer_dir):
            self.grammars.prepare_async()        # beside the weights' load; the warm-up's grammar rounds wait for it
        runtime = build_runtime(config, self.model_config, self.tp)
        self.runner, self.spec = runtime.runner, runtime.spec
        self.max_model_len, self.lookahead = runtime.max_model_len, runtime.lookahead
        self.runner_kind = runtime.kind
        if self.tp is not None and self.tp.driver is not None:
            self.tp.driver.live = True        # start-up ran in lockstep on every rank; from here rank 0 leads
        # A proposer reading the target's hidden states needs them at the tokens before new ones.
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          recompute_last_hit_block=bool(self.spec and self.spec.proposer.aux_layer_ids))
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, lookahead_tokens=self.lookahead,
                                   fairness_preempt_steps=config.fairness_preempt_steps)
        tasks = pooling.served_tasks(self.runner_kind, self.model_config, config.tensor_parallel_size > 1)
        self.model_info = EngineModelInfo(config.model, self.model_config.vocab_size, self.max_model_len,
                                          tuple(self.model_config.eos_token_ids), self.spec is not None,
                                          self.runner_kind, tasks, self.model_config.hidden_size)
        self.requests: dict[str, Request] = {}
        self.runner.index_limits.requests = self.requests     # an index check names the request at fault
        for graphs in (self.spec.graphs.values() if self.spec is not None else ()):
            graphs.index_limits = self.runner.index_limits     # the draft's graphs index the same pool
        # What the next step() returns: abort notices, and each step's outputs as it completes (kept here at
        # once, so a failure later in the same step() cannot lose the end of a request it finished).
        self._pending: list[StepOutput] = []
        self._in_flight = None                   # the launched step whose results are not read yet
        self._step_requests: list[Request] | None = None   # requests the step being run holds
        # Plain steps launch ahead where the plain engine would (also with grammar or penalty rows: only
        # their sampling waits for the previous step); a drafting step needs the previous step's tokens,
        # so it first completes the plain step in flight (speculative steps are synchronous).
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        self.reset_counters()
        self.warmup_report = warm_up(self) if config.resolved_warmup() else None

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op on one device); the engine cannot step afterwards."""
        if self.tp is not None and self.tp.driver is not None:
            if self.runner is not None:
                self.runner.release_graphs()
            self.tp.driver.shutdown()

    def reset_counters(self) -> None:
        """Zero every counter stats() reports (after the warm-up, which must not show in them)."""
        self.num_steps = 0
        self.num_tokens_scheduled = 0            # in the last step
        self.total_prompt_tokens = 0
        self.total_generated_tokens = 0
        self.block_manager.prefix_queries = self.block_manager.prefix_hits = 0
        self.scheduler.num_preemptions = self.scheduler.num_fairness_preemptions = 0
        if self.spec is not None:
            self.spec.reset_metrics()
        # What the policy learned (acceptance, step costs with compiles in them) came from the warm-up's
        # random prompts and pinned depths: serving starts from its priors.
        self.policy = (SpecPolicy(self.spec.policy_widths(), self.config.speculative_policy,
                                  prior_cost_per_draft=self.spec.proposer.prior_cost_per_draft) if self.spec else None)
        self.step_costs = MeasuredCosts()
        self._last_step: tuple[int, int, bool] | None = None   # (draft depth, batch bucket, pure decode) of the last step
        self.grammars.reset_counters()

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    client=None) -> None:
        """Queue a request. Raises ValidationError naming the bad field (QueueFull when `client` already has
        as many waiting as it may: see _check_queue_caps); the engine is unchanged then. `client` is the
        fairness key: running slots and each step's prefill budget are shared max-min fairly across clients
        (scheduler.py)."""
        params = SamplingParams() if params is None else params
        pooling.refuse_generation(self.runner_kind)
        self._validate(request_id, prompt_token_ids, params)
        if client is not None:
            self._check_queue_caps(client, len(prompt_token_ids))
        req = Request(request_id, list(prompt_token_ids), params, frozenset(self.model_info.eos_token_ids),
                      self.max_model_len, client=client)
        if params.guided is not None:
            req.grammar = self.grammars.submit(params.guided)    # raises ValidationError
        req.speculative = self._drafts(params)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams | None = None,
                            client=None) -> None:
        """Queue a pooling request (engine/pooling.py), answered by one StepOutput whose `pooled` holds the
        embedding or the named logits. Raises ValidationError as add_request does."""
        params = PoolingParams() if params is None else params
        self._check_id(request_id)
        if not isinstance(params, PoolingParams):
            raise ValidationError("params", f"must be PoolingParams, got {type(params).__name__}")
        params.validate()
        self._check_prompt(prompt_token_ids)
        pooling.check_request(self.model_info, params, len(prompt_token_ids), self.block_manager)
        if client is not None:
            self._check_queue_caps(client, len(prompt_token_ids))
        req = Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=1), frozenset(),
                      self.max_model_len, client=client, pooling=params)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _drafts(self, params: SamplingParams) -> bool:
        """Whether a request drafts when it decodes. Logprobs come from the plain sampler, so requests
        asking for them decode without drafts. So do requests whose logits are edited (grammar masks,
        penalties, biases, min_tokens): verification would need every draft position's edits (a grammar
        mask per draft, penalty counts including the drafts before it, rollback on rejection) to stay
        exact; plain decoding is exact already. A grammar waiting for its start_after masks nothing yet:
        its request drafts until then (Request.accept stops it when the grammar starts)."""
        return (self.spec is not None and params.speculative and params.logprobs is None
                and not params.edits_logits and (params.guided is None or bool(params.guided.start_after)))

    def _check_queue_caps(self, client, prompt_tokens: int) -> None:
        """Each client may have max_queued_requests_per_client waiting. The per-client cap alone lets many
        connections grow the core without bound, so all clients together may have max_queued_requests;
        past that, a client with nothing waiting may still queue one (so a flood of requests cannot lock
        out a client sending one at a time), up to twice the cap. The waiting prompts' tokens are capped
        the same way (max_queued_tokens): requests of max_model_len tokens would otherwise hold gigabytes
        under the request caps alone."""
        waiting, mine = self.scheduler.waiting, self.scheduler.waiting.count(client)
        cap = self.config.max_queued_requests_per_client
        if cap and mine >= cap:
            raise QueueFull(f"this client already has {cap} requests waiting (max_queued_requests_per_client)")
        total = self.config.max_queued_requests
        if total and len(waiting) >= total and (mine > 0 or len(waiting) >= 2 * total):
            raise QueueFull(f"{len(waiting)} requests of all clients are waiting (max_queued_requests {total}) "
                            f"and this client has {mine}")
        queued, token_cap = waiting.num_tokens(), self.config.max_queued_tokens
        tokens = queued + prompt_tokens
        # queued > 0: a lone request queues whatever its length (max_model_len bounds it).
        if token_cap and tokens > token_cap and queued and (mine > 0 or tokens > 2 * token_cap):
            raise QueueFull(f"{queued} prompt tokens of all clients are waiting (max_queued_tokens {token_cap}) "
                            f"and this client has {waiting.num_tokens(client)}")

    def _check_id(self, request_id) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValidationError("request_id", "must be a non-empty string")
        if request_id in self.requests:
            raise ValidationError("request_id", f"{request_id!r} is already in use")

    def _check_prompt(self, prompt) -> None:
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            raise ValidationError("prompt_token_ids", "must be a non-empty list of token ids")
        vocab = self.model_info.vocab_size
        for i, t in enumerate(prompt):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValidationError("prompt_token_ids", f"token {t!r} at index {i} is outside the vocabulary [0, {vocab})")

    def _validate(self, request_id, prompt, params) -> None:
        self._check_id(request_id)
        if not isinstance(params, SamplingParams):
            raise ValidationError("params", f"must be SamplingParams, got {type(params).__name__}")
        params.validate()
        self._check_prompt(prompt)
        if len(prompt) >= self.max_model_len:
            raise ValidationError("prompt_token_ids",
                                  f"prompt of {len(prompt)} tokens leaves no room under max_model_len {self.max_model_len}")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValidationError("max_tokens", f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds "
                                                f"max_model_len {self.max_model_len}")
        # A drafting request also needs room for its drafts' KV (the scheduler reserves it when it decodes).
        lookahead = self.lookahead if self._drafts(params) else 0
        need = self.block_manager.blocks_needed(len(prompt) + params.max_tokens + lookahead)
        if need > self.block_manager.num_blocks:
            raise ValidationError("max_tokens", f"needs {need} KV blocks, the whole pool has {self.block_manager.num_blocks}")
        vocab = self.model_info.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValidationError("stop_token_ids", f"must be below the vocabulary size {vocab}")
        if any(t >= vocab for t in params.logit_bias):
            raise ValidationError("logit_bias", f"token ids must be below the vocabulary size {vocab}")
        if params.guided is not None and any(t >= vocab for t in params.guided.start_after):
            raise ValidationError("guided.start_after", f"token ids must be below the vocabulary size {vocab}")

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.finish(req)
        req.finish_reason = "abort"
        self._pending.append(StepOutput(request_id, [], "abort", None, req.num_prompt_tokens, req.num_cached_tokens,
                                        pooled=PooledOutput() if req.pooling is not None else None))

    def fail_step(self) -> list[str]:
        """After step() raised: drop the requests that step held (and the one still in flight), whose state
        the failure left unknown, and free their blocks; return their ids. Every other request goes on."""
        held = self._step_requests if self._step_requests is not None else list(self.scheduler.running)
        self._in_flight = None
        self._step_requests = None
        failed = []
        for req in held:
            if self.requests.get(req.request_id) is req:
                del self.requests[req.request_id]
                self.scheduler.finish(req)
                req.finish_reason = "error"
                failed.append(req.request_id)
        # Their results of a step completed before the failure: an errored request reports nothing more.
        self._pending = [o for o in self._pending if o.request_id not in failed]
        return failed

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending) or self._in_flight is not None

    @property
    def stalled(self) -> bool:
        """Nothing can happen until a grammar compiles (or a request comes or goes): every unfinished request
        waits for its grammar, and no outputs or step are pending. A step now would do nothing."""
        if self._pending or self._in_flight is not None or self.scheduler.running:
            return False
        return all(r.grammar is not None and not r.grammar.future.done()
                   for r in self.scheduler.waiting.admission_order())

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule and launch one batch; return what the steps completed since the last call produced.

        With async scheduling the step launched here runs on the device while the host reads back the
        previous one: requests it sampled hold a PLACEHOLDER token, which the next launch reads on the
        device, so the host never waits for the GPU between steps. Rows with a grammar or penalties need
        the previous token on the host before they sample, so such a step launches its forward, reads the
        previous step back while that forward runs, then samples. Without async scheduling the step
        completes here. If it raises, fail_step() drops the requests it held and the engine can step on.
        """
        in_flight = self._in_flight.sched.requests if self._in_flight is not None else []
        self._step_requests = list(self.scheduler.running) + in_flight      # what fail_step() drops
        self._step()
        self._step_requests = None
        outputs, self._pending = self._pending, []
        return outputs

    def _step(self) -> None:
        self._drop_failed_grammars()
        started = time.perf_counter()
        has_work = self.scheduler.running or self.scheduler.waiting
        # Pooling rows are the plain step's (the verify forward samples every prompt it completes): while any
        # pooling request is live, steps do not draft.
        plain = self.spec is None or not has_work or any(r.pooling is not None for r in self.requests.values())
        decision = None if plain else self._decide()
        drafting = decision is not None and decision.gamma > 0
        if drafting:         # the executor reads the previous step's tokens on the host
            self._complete_in_flight()
        sched = self.scheduler.schedule()
        in_flight = self._in_flight.sched.requests if self._in_flight is not None else []
        self._step_requests = list(sched.requests) + in_flight
        self.num_tokens_scheduled = sched.total_tokens
        launched = None
        if self.spec is not None:
            self.spec.on_scheduled(sched, self.block_manager)
        if sched.requests:
            self.num_steps += 1
            if drafting:     # synchronous: the executor's result is known when it returns
                launched = self.spec.execute(sched, decision.gamma)
                self.policy.observe(decision, launched.num_accepted)
            else:
                launched = self.runner.launch_forward(sched)
                # A grammar mask follows every earlier token of its row, penalties count them: read the step
                # in flight back now, while this forward runs on the device, and sample once its tokens are
                # accepted. Rows it finished are still sampled; _complete discards their tokens.
                if any(r.needs_sync for r in launched.sampled_requests):
                    self._complete_in_flight()
                    self._step_requests = list(sched.requests)     # the step read back is settled
                self.runner.launch_sample(launched)
            for req, n in zip(sched.requests, sched.num_new_tokens):
                if req.num_computed_tokens < req.num_prompt_tokens:
                    self.total_prompt_tokens += min(n, req.num_prompt_tokens - req.num_computed_tokens)
                req.num_computed_tokens += n
            for req in launched.sampled_requests:
                if not req.is_finished:      # finished by the step read back above: no token to wait for
                    req.append_placeholder()
        if self.async_scheduling and not drafting:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        if done is not None:
            self._complete(done)
        if decision is not None:
            self._record_step_cost(sched, decision, started)

    def _complete_in_flight(self) -> None:
        done, self._in_flight = self._in_flight, None
        if done is not None:
            self._complete(done)

    # ---- the speculation policy ------------------------------------------------------------------
    def _decide(self) -> Decision:
        """Draft depth for the coming step (0: plain), from the requests that will run."""
        running = self.scheduler.running
        batch = min(self.config.max_num_seqs, len(running) + len(self.scheduler.waiting))
        speculative = sum(r.speculative for r in running) + sum(r.speculative for r in self.scheduler.waiting)
        return self.policy.decide(max(batch, 1), min(speculative, batch), self.step_costs)

    def _record_step_cost(self, sched, decision: Decision, started: float) -> None:
        """Time steady decode steps only: all-decode batches whose previous step ran the same way (so an
        async plain step is timed by the wait for its predecessor, i.e. the device's step period)."""
        if not sched.requests:
            self._last_step = None
            return
        # The previous step must have been a pure decode of the same kind too: an async plain step's wall
        # time is mostly the wait for its predecessor, so one after a prefill-carrying step would charge
        # that prefill to plain decoding (and make drafting look cheap next to it).
        key = (decision.gamma, batch_bucket(len(sched.requests)), sched.total_tokens == len(sched.requests))
        steady = self._last_step == key and key[2]
        self._last_step = key
        if steady:
            width = self.policy.widths[decision.gamma] if decision.gamma else 1
            self.step_costs.record(key[1], width, time.perf_counter() - started)

    def _drop_failed_grammars(self) -> None:
        """A grammar that parsed but failed to compile (rare: e.g. too large) ends its request (its abort
        notice goes out with this step's outputs)."""
        failed = [r for r in self.scheduler.waiting if r.grammar is not None and r.grammar.failed is not None]
        for req in failed:
            log.error("request %s: grammar compilation failed: %r", req.request_id, req.grammar.failed)
            self.abort(req.request_id)

    def _complete(self, handle: StepHandle) -> None:
        """Append a finished step's results (a plain or a drafting step: one path for both) and queue
        its outputs for step() to return."""
        finished: list[Request] = []
        for req, first, scores in handle.prompt_results():    # before the results: one may be the first output
            req.add_prompt_logprobs(first, scores)
        for res in handle.results():
            req = res.request
            if req.is_finished:          # aborted, or ended by the previous step while this one ran
                continue
            req.num_computed_tokens += res.extra_computed
            new: list[int] = []
            finish = None
            for tok in res.token_ids:    # stop at the first token that ends the request
                new.append(tok)
                # A sampled row fills the placeholder its launch appended; verified drafts are new tokens.
                finish = req.resolve_token(tok) if req.num_pending else req.append_token(tok)
                if finish is not None:
                    break
            self.total_generated_tokens += len(new)
            self._pending.append(StepOutput(req.request_id, new, finish, res.logprobs, req.num_prompt_tokens,
                                            req.num_cached_tokens, req.take_prompt_logprobs()))
            if finish is not None:
                req.finish_reason = finish
                finished.append(req)
        for req, out in handle.pooled_results():
            if not req.is_finished:      # else aborted while its step ran
                self._pending.append(StepOutput(req.request_id, [], "stop", None, req.num_prompt_tokens,
                                                req.num_cached_tokens, pooled=out))
                req.finish_reason = "stop"
                finished.append(req)
        self._retire(handle.sched.requests, finished)

    def _retire(self, scheduled: list[Request], finished: list[Request]) -> None:
        """After a step: publish the newly full blocks of the step's live requests (with speculation, as
        the proposer says: EAGLE flags whether their draft rows are valid), then free the finished."""
        for req in scheduled:
            if req.is_finished:
                continue
            if self.spec is None:
                self.block_manager.cache_full_blocks(req)
            else:
                self.spec.publish(req, self.block_manager)
        for req in finished:
            self.scheduler.finish(req)
            del self.requests[req.request_id]

    # ---- conveniences ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[GenerationResult]:
        """Run prompts to completion; results in input order. Requests queued through add_request() step
        along: their outputs meanwhile come from the next step()."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValidationError("params", f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = [f"generate-{self.num_steps}-{i}-{id(prompts)}" for i in range(len(prompts))]
        results = {rid: GenerationResult(rid, list(p)) for rid, p in zip(ids, prompts)}
        added, others = [], []
        compiled = threading.Event()         # a grammar compiled: what a stalled loop waits for
        try:
            for rid, p, sp in zip(ids, prompts, params_list):
                self.add_request(rid, p, sp)
                added.append(rid)
            pending = set(ids)
            self.grammars.listeners.append(compiled.set)
            while pending:
                compiled.clear()
                if self.stalled:
                    compiled.wait(1.0)
                for out in self.step():
                    res = results.get(out.request_id)
                    if res is None:
                        others.append(out)
                        continue
                    res.token_ids.extend(out.new_token_ids)
                    res.num_cached_tokens = out.num_cached_tokens
                    if out.logprobs is not None:
                        res.logprobs = (res.logprobs or []) + out.logprobs
                    if out.prompt_logprobs is not None:
                        res.prompt_logprobs = out.prompt_logprobs
                    if out.finish_reason is not None:
                        res.finish_reason = out.finish_reason
                        pending.discard(out.request_id)
        finally:
            if compiled.set in self.grammars.listeners:
                self.grammars.listeners.remove(compiled.set)
            for rid in added:
                self.abort(rid)   # no-op for the finished ones; frees the rest if we were interrupted
            self._pending = others + [o for o in self._pending if o.request_id not in results]
        return [results[rid] for rid in ids]

    def pool(self, prompts: list[list[int]], params: PoolingParams | list[PoolingParams] | None = None,
             ) -> list[PoolingResult]:
        """Run pooling requests to completion; results in input order (others step along, as in generate())."""
        return pooling.run_to_completion(self, prompts, params)

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            # free + cached + used == total; cached blocks are as good as free for new requests (evicted LRU).
            "free_kv_blocks": bm.num_free_blocks,
            "cached_kv_blocks": bm.num_cached_blocks,
            "used_kv_blocks": bm.num_used_blocks,
            "total_kv_blocks": bm.num_blocks,
            "kv_usage": bm.num_used_blocks / bm.num_blocks,
            "prefix_hit_rate": bm.prefix_hit_rate,
            "prefix_queries": bm.prefix_queries,
            "prefix_hits": bm.prefix_hits,
            "num_tokens_scheduled": self.num_tokens_scheduled,
            "num_steps": self.num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_fairness_preemptions": self.scheduler.num_fairness_preemptions,   # of num_preemptions
            "num_scheduled_clients": self.scheduler.waiting.num_clients,           # with requests waiting or running
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_generated_tokens": self.total_generated_tokens,
            "jit_compilations": jit_compilations(),
            **self.grammars.stats(),
            **(self.spec.stats() if self.spec is not None else {}),
            **(self._policy_stats() if self.policy is not None else {}),
        }

    def _policy_stats(self) -> dict:
        p = self.policy
        return {
            "spec_policy_gamma": p.last.gamma,                      # the latest step's draft depth (0: plain)
            "spec_policy_expected_length": p.acceptance.expected_emitted(p.deepest),
            "spec_policy_cost_ratio": p.cost_ratio(self.step_costs),  # full-depth step / plain step, measured
            "spec_num_drafted_steps": p.num_drafted_steps,          # engine steps through the executor
            "spec_num_plain_steps": p.num_plain_steps,              # engine steps on the plain path
            "spec_num_probe_steps": p.num_probe_steps,              # drafted only to re-measure acceptance
        }
