"""Pipeline-parallel schedules and their point-to-point communication."""

from megatron.core.pipeline_parallel.schedules import get_forward_backward_func  # noqa: F401  (Megatron-core's name)
