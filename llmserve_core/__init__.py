"""llmserve-core: the GPU worker (scheduler, paged KV cache, Qwen3 runner, EAGLE-3 executor)."""
from llmserve_core.config import EngineConfig
from llmserve_core.engine.engine import Completion, Engine, ModelInfo, StepOutput, TokenLogprobs

__all__ = ["Engine", "EngineConfig", "Completion", "StepOutput", "ModelInfo", "TokenLogprobs"]
