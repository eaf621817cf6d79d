"""Tensor parallelism over torch.distributed: the shard layout, the process group, the step broadcast
from the core (rank 0) to its workers, and the worker processes themselves."""
