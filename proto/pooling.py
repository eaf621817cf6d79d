"""Pooling parameters: a request that runs its prompt only and returns the last position's hidden state (an
embedding) or a few of its logits (a score), instead of generating. Shared by the core and the clients."""
from __future__ import annotations

import msgspec

from llmserve_proto.bounds import INT32_MAX, INT64_MAX, Bool, Int, IntList, Str, ValidationError, check_fields

__all__ = ["PoolingParams", "POOLING_TASKS", "MAX_SCORE_TOKENS"]

POOLING_TASKS = ("embed", "score")
MAX_SCORE_TOKENS = 16        # a classifier's labels ("yes" / "no"), not a slice of the vocabulary


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """task "embed": the final (normed) hidden state of the prompt's last position, its first `dimensions`
    values (Matryoshka truncation; None: all hidden_size), L2-normalised after the truncation when
    `normalize` (as Qwen3-Embedding's own code does). task "score": the last position's logit of each of
    `token_ids`, in order (a reranker's "yes" and "no"); only those rows of the lm_head are computed."""
    task: str = "embed"
    normalize: bool = True
    dimensions: int | None = None
    token_ids: list[int] = []

    def validate(self) -> "PoolingParams":
        """Raise ValidationError naming the first bad field; return self. The model's limits (hidden_size,
        the vocabulary) are the core's to check."""
        check_fields(self, POOLING_BOUNDS)
        if self.task not in POOLING_TASKS:
            raise ValidationError("task", f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.task == "score" and not self.token_ids:
            raise ValidationError("token_ids", "a score request names 1 to 16 token ids")
        if self.task == "embed" and self.token_ids:
            raise ValidationError("token_ids", "only a score request names token ids")
        if self.task == "score" and self.dimensions is not None:
            raise ValidationError("dimensions", "only an embed request has dimensions")
        return self


# One entry per field, in field order.
POOLING_BOUNDS = {
    "task": Str(16, min_chars=1),
    "normalize": Bool(),
    "dimensions": Int(1, INT32_MAX, optional=True),
    "token_ids": IntList(0, INT64_MAX, max_len=MAX_SCORE_TOKENS),
}
