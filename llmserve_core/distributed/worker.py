"""A worker rank: build the model side the core builds (engine/runtime.py: the runner and, with
speculation, the speculative executor; start-up runs in lockstep with the core, CUDA-graph capture
included), then run each forward, logits call and tree KV move the core announces on this rank's shard,
until told to stop. A forward the core replayed through a step graph is replayed here through this rank's
copy of that graph, over the same inputs. A worker schedules nothing: it has no Engine."""
from __future__ import annotations

import os

import torch

from llmserve_core.config import EngineConfig
from llmserve_core.distributed.group import TPGroup
from llmserve_core.distributed.step_channel import COMPACT, FORWARD, LOGITS, STOP, StepChannel
from llmserve_core.engine.runtime import build_runtime
from llmserve_core.models.config import ModelConfig


@torch.inference_mode()
def serve_worker(config: EngineConfig, model_config: ModelConfig, tp: TPGroup) -> None:
    runner = build_runtime(config, model_config, tp).runner
    model = runner.model
    channel = StepChannel(tp, config.max_num_seqs)
    hidden_size = runner.model_config.hidden_size
    try:
        while True:
            op, args = channel.recv(hidden_size, runner.dtype)
            if op == FORWARD:
                ids, batch, aux, graph = args
                if graph is None:
                    model(ids, batch, runner.kv_caches, aux_layer_ids=aux)
                else:
                    runner.run_announced(graph, ids, batch)
            elif op == LOGITS:
                model.compute_logits(args[0])
            elif op == COMPACT:
                runner.move_kv(*args)
            elif op == STOP:
                break
    except RuntimeError:
        os._exit(1)          # the core is gone or failed a collective: nothing left to serve
