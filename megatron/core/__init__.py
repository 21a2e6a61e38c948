"""Parallel infrastructure: process groups, communication, tensor/pipeline parallelism, DDP and
the optimizer. Takes typed configs only, never argv or global args."""

from megatron.core import parallel_state, tensor_parallel  # noqa: F401  (Megatron's attributes of megatron.core)

# Megatron keeps parallel_state under its old name as well: `from megatron.core import mpu`.
mpu = parallel_state
