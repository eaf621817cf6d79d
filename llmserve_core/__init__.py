"""llmserve-core: the GPU worker (scheduler, paged KV cache, Qwen3 runner, speculative decoding)."""
from llmserve_core.config import EngineConfig
from llmserve_core.distributed.launch import start_engine
from llmserve_core.engine.engine import Engine
from llmserve_core.engine.outputs import EngineModelInfo, GenerationResult, StepOutput
from llmserve_core.engine.step_result import TokenLogprobs

__all__ = ["Engine", "EngineConfig", "start_engine", "GenerationResult", "StepOutput", "EngineModelInfo",
           "TokenLogprobs"]
