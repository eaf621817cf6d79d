"""llmserve wire protocol: the only contract between llmserve-core and its clients.

Import name `llmserve_proto` (the folder is `proto/`). Nothing here imports torch.
"""
from llmserve_proto.sampling import SamplingParams, ValidationError

__all__ = ["SamplingParams", "ValidationError"]
