"""Megatron optimizer wrappers around a torch optimizer.

    FP32Optimizer                      fp32 model; grads on the params; loss scale 1.0
    Float16OptimizerWithFloat16Params  fp16/bf16 model; the torch optimizer steps fp32 "main"
                                       copies of the half-precision params, then copies back

Both return (update_successful, grad_norm, num_zeros_in_grad) from step(). With fp16 the
mixed-precision step unscales the main grads, skips the update when any is inf/nan (found_inf
is all-reduced over the model-parallel group when there is one) and lets the loss scaler react.
A param with a `main_grad` attribute (the future DDP's fp32 grad buffer) is read from there
instead of `.grad`.

Expert params (`allreduce = False`: MoE experts, different on every expert-parallel rank) count
towards the grad norm, the zero count and found_inf over the expert tensor-model-pipeline group
(`expert_tensor_model_pipeline_group`), the dense ones over the model-parallel group; the two
parts are then added, so every rank sees the norm over all distinct parameters.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import communication, device, parallel_state
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_tensor_fp32,
    grad_norm_of_parts,
)
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.tensor_parallel.layout import without_duplicate_rows

StepResult = tuple[bool, float | None, int | None]

# Attributes that describe how a param is split or shared; main copies inherit them so the
# grad-norm filters below treat a main param exactly like its model param.
# tensor_parallel_duplicate_rows = (start, end): rows that are a copy of another TP rank's (the
# replicated K/V rows of multi-query attention under TP, marked on all but the first replica).
_PARAM_ATTRIBUTES = ("shared", "tensor_model_parallel", "partition_dim", "partition_stride", "allreduce",
                     "tensor_parallel_duplicate_rows")


def _zero_grad_group_helper(group: list[torch.Tensor], set_to_none: bool) -> None:
    for param in group:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            if param.grad.grad_fn is not None:
                param.grad.detach_()
            else:
                param.grad.requires_grad_(False)
            param.grad.zero_()


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for the extra copies of shared params (e.g. tied embeddings across pipeline stages)."""
    return not getattr(param, "shared", False)


def param_is_expert(param: torch.Tensor) -> bool:
    """An expert param (Megatron's `allreduce = False`): reduced over the expert-data-parallel group."""
    return not getattr(param, "allreduce", True)


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True for tensor-parallel shards, and for replicated params on tensor-parallel rank 0 (expert
    params: on expert-tensor-parallel rank 0, since experts are split over their own TP group)."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if param_is_expert(param):
        return parallel_state.get_expert_tensor_parallel_rank() == 0
    return parallel_state.get_tensor_model_parallel_rank() == 0


def expert_params_on_any_stage(local: bool) -> bool:
    """Whether any pipeline stage holds expert params (collective over the pipeline group when PP > 1).

    The expert part of a norm is reduced over the expert tensor-model-pipeline group, which spans
    the pipeline stages: a stage without MoE layers must still take part, so all stages decide alike.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return local
    flag = torch.tensor([float(local)], device=device.get_device())
    communication.all_reduce(flag, group=parallel_state.get_pipeline_model_parallel_group(), op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def _reduce_sum(value: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        communication.all_reduce(value, group=group)


def params_norm(model_chunks, use_main_params: bool = False) -> float:
    """L2 norm of the whole model's parameters (collective): dense squares summed over the
    model-parallel group, expert ones over the expert tensor-model-pipeline group; tied copies,
    tensor-parallel replicas and replicated K/V rows (tensor_parallel_duplicate_rows) counted
    once. The weights of --overlap-param-gather are waited for first.

    use_main_params: take each parameter's fp32 main copy (`main_param`, which the fp16/bf16
    optimizer keeps) instead of its own low-precision value, where it has one."""
    dense = torch.zeros((), dtype=torch.float64, device=device.get_device())
    expert = torch.zeros((), dtype=torch.float64, device=device.get_device())
    has_experts = False
    for chunk in model_chunks:
        finish = getattr(chunk, "finish_param_sync", None)
        if finish is not None:
            finish()  # --overlap-param-gather: the weights may still be arriving
        for p in chunk.parameters():
            has_experts = has_experts or param_is_expert(p)
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                main = getattr(p, "main_param", None) if use_main_params else None
                value = (main if main is not None else p).detach()
                (expert if param_is_expert(p) else dense).add_(
                    without_duplicate_rows(p, value).double().pow(2).sum())
    _reduce_sum(dense, parallel_state.get_model_parallel_group())
    if expert_params_on_any_stage(has_experts):
        _reduce_sum(expert, parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    return math.sqrt(dense.item() + expert.item())


class MegatronOptimizer(ABC):
    """Common interface: loss scaling, grad-norm clipping, the inner torch optimizer's groups."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 model_parallel_group: dist.ProcessGroup | None = None,
                 expert_tensor_model_pipeline_group: dist.ProcessGroup | None = None,
                 has_expert_params: bool | None = None) -> None:
        """`model_parallel_group` (TP x PP) reduces the dense params' norm, found_inf and zero
        count; `expert_tensor_model_pipeline_group` the expert params' (`allreduce = False`).
        `has_expert_params`: whether any pipeline stage holds expert params (None: whether this
        rank's optimizer does; get_megatron_optimizer agrees on it over the pipeline)."""
        self.optimizer = optimizer
        self.config = config
        self.model_parallel_group = model_parallel_group
        self.expert_tensor_model_pipeline_group = expert_tensor_model_pipeline_group
        if has_expert_params is None:
            has_expert_params = any(param_is_expert(p) for g in optimizer.param_groups for p in g["params"])
        self.has_expert_params = has_expert_params

    def get_parameters(self) -> list[torch.Tensor]:
        """The params the inner optimizer updates (main params for mixed precision)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def get_main_grads_for_grad_norm(self, expert: bool | None = None) -> list[torch.Tensor]:
        """Grads that count towards the norm (and count_zeros): no shared copies, no tensor-parallel
        replicas, and of a split param not the rows that replicate another rank's (replicated K/V).
        `expert`: only the expert params' (True) or the dense ones' (False); None: all."""
        return [without_duplicate_rows(p, p.grad.detach()) for p in self.get_parameters()
                if p.grad is not None and param_is_not_shared(p)
                and param_is_not_tensor_parallel_duplicate(p) and expert in (None, param_is_expert(p))]

    def get_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.model_parallel_group

    def _norm_parts(self) -> list[tuple[list[torch.Tensor], list[dist.ProcessGroup | None]]]:
        """(grads, groups to reduce over) of the dense and, when there are any, the expert params."""
        if not self.has_expert_params:
            return [(self.get_main_grads_for_grad_norm(), [self.get_model_parallel_group()])]
        return [(self.get_main_grads_for_grad_norm(expert=False), [self.get_model_parallel_group()]),
                (self.get_main_grads_for_grad_norm(expert=True), [self.expert_tensor_model_pipeline_group])]

    def get_grad_norm(self) -> float:
        """The L2 norm of all distinct gradients (collective over the groups of _norm_parts)."""
        return grad_norm_of_parts(self._norm_parts(), 2)

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip all grads on their global L2 norm; returns the norm before clipping."""
        grad_norm = self.get_grad_norm()
        grads = [p.grad for p in self.get_parameters() if p.grad is not None]
        clip_grad_by_total_norm_fp32(grads, clip_grad, grad_norm)
        return grad_norm

    def count_zeros(self) -> int:
        return int(sum(count_zeros_tensor_fp32(grads, groups).item() for grads, groups in self._norm_parts()))

    @abstractmethod
    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale as a 1-element fp32 tensor."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * loss_scale, keeping the loss's shape (the scale is a 1-element tensor)."""
        return loss * self.get_loss_scale().to(loss.device).squeeze(0)

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        ...

    @abstractmethod
    def reload_model_params(self) -> None:
        """Refresh any copies of the model params (after the model's weights were loaded)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ...

    @abstractmethod
    def step(self) -> StepResult:
        """One update: (update_successful, grad_norm or None, num_zeros_in_grad or None)."""

    # The scheduler reads and writes 'lr' / 'weight_decay' through these.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> dict[Any, Any]:
        return self.optimizer.state

    @state.setter
    def state(self, value: dict[Any, Any]) -> None:
        self.optimizer.state = value

    def _clip_count_and_step(self) -> StepResult:
        grad_norm = None
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros_in_grad = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        success = self.step_with_ready_grads()
        return success, grad_norm, num_zeros_in_grad

    @abstractmethod
    def step_with_ready_grads(self) -> bool:
        ...


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Base for optimizers that unscale grads and may skip a step on overflow."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 grad_scaler: MegatronGradScaler | None,
                 model_parallel_group: dist.ProcessGroup | None = None,
                 expert_tensor_model_pipeline_group: dist.ProcessGroup | None = None,
                 has_expert_params: bool | None = None) -> None:
        super().__init__(optimizer, config, model_parallel_group, expert_tensor_model_pipeline_group,
                         has_expert_params)
        if grad_scaler is None and config.fp16:
            raise ValueError("fp16 training needs a grad scaler (constant or dynamic)")
        self.grad_scaler = grad_scaler
        self._scale_one = torch.tensor([1.0], dtype=torch.float32)

    def get_loss_scale(self) -> torch.Tensor:
        if self.grad_scaler is None:
            return self._scale_one
        return self.grad_scaler.scale

    @abstractmethod
    def _collect_main_grad_data_for_unscaling(self) -> list[torch.Tensor]:
        ...

    @abstractmethod
    def _copy_model_grads_to_main_grads(self) -> None:
        ...

    @abstractmethod
    def _copy_main_params_to_model_params(self) -> None:
        ...

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        """Multiply the main grads by 1/scale in place; True when any entry is inf or nan."""
        main_grads = self._collect_main_grad_data_for_unscaling()
        device = main_grads[0].device if main_grads else torch.device("cpu")
        inv_scale = self.grad_scaler.inv_scale.to(device)
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        for grad in main_grads:
            grad.mul_(inv_scale)
            found_inf = torch.maximum(found_inf, (~torch.isfinite(grad)).any().float().reshape(1))
        # Every rank must agree on skipping, or their params diverge: dense grads are equal over
        # data-parallel replicas and expert grads over expert-data-parallel ones, so the
        # model-parallel group then (with experts) the expert tensor-model-pipeline group reach all.
        groups = [self.get_model_parallel_group()]
        if self.has_expert_params:
            groups.append(self.expert_tensor_model_pipeline_group)
        for group in groups:
            if group is not None:
                communication.all_reduce(found_inf, group=group, op=dist.ReduceOp.MAX)
        return bool(found_inf.item() > 0)

    def _load_grad_scaler(self, state_dict: dict[str, Any]) -> None:
        """Restore the loss scaler from a checkpoint's optimizer state (Megatron's warnings when absent)."""
        if "grad_scaler" not in state_dict:
            if self.config.fp16:
                print("***WARNING*** found an old checkpoint, will not load grad scaler ...", flush=True)
        elif self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        else:
            print("***WARNING*** found the grad scaler in the checkpoint but it is None in the "
                  "class. Skipping loading grad scaler ...", flush=True)

    def prepare_grads(self) -> bool:
        """Copy grads to the main grads and unscale them; True when the step must be skipped."""
        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is None:
            return False
        found_inf = self._unscale_main_grads_and_check_for_nan()
        self.grad_scaler.update(found_inf)
        return found_inf

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True

    @torch.no_grad()
    def step(self) -> StepResult:
        if self.prepare_grads():
            return False, None, None
        return self._clip_count_and_step()


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """fp16/bf16 model params with fp32 main copies held by the inner optimizer.

    The inner optimizer is built on the model params; this class swaps each half-precision
    param in its groups for an fp32 copy (`model_param.main_param`). fp32 model params (if
    any) are stepped directly.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 grad_scaler: MegatronGradScaler | None,
                 model_parallel_group: dist.ProcessGroup | None = None,
                 expert_tensor_model_pipeline_group: dist.ProcessGroup | None = None,
                 has_expert_params: bool | None = None) -> None:
        super().__init__(optimizer, config, grad_scaler, model_parallel_group, expert_tensor_model_pipeline_group,
                         has_expert_params)
        self.float16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_float16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        for param_group in self.optimizer.param_groups:
            float16_params, main_params, fp32_params = [], [], []
            for i, param in enumerate(param_group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in (torch.float16, torch.bfloat16):
                    main_param = self._make_main_param(param)
                    param_group["params"][i] = main_param
                    if param in self.optimizer.state:
                        self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                    float16_params.append(param)
                    main_params.append(main_param)
                elif param.dtype == torch.float32:
                    fp32_params.append(param)
                else:
                    raise TypeError(f"wrapped parameters must be float32, float16 or bfloat16, got {param.dtype}")
            self.float16_groups.append(float16_params)
            self.fp32_from_float16_groups.append(main_params)
            self.fp32_from_fp32_groups.append(fp32_params)

    @staticmethod
    def _make_main_param(param: torch.Tensor) -> torch.nn.Parameter:
        main_param = torch.nn.Parameter(param.detach().clone().float())
        for name in _PARAM_ATTRIBUTES:
            if hasattr(param, name):
                setattr(main_param, name, getattr(param, name))
        param.main_param = main_param
        return main_param

    def zero_grad(self, set_to_none: bool = True) -> None:
        for groups in (self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for group in groups:
                _zero_grad_group_helper(group, set_to_none)

    def _collect_main_grad_data_for_unscaling(self) -> list[torch.Tensor]:
        return [p.grad.detach() for groups in (self.fp32_from_float16_groups, self.fp32_from_fp32_groups)
                for group in groups for p in group if p.grad is not None]

    def _copy_model_grads_to_main_grads(self) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                if hasattr(model_param, "main_grad"):
                    main_param.grad = model_param.main_grad.float()
                elif model_param.grad is not None:
                    main_param.grad = model_param.grad.float()
                # The half-precision grad is no longer needed once copied.
                model_param.grad = None
        for model_group in self.fp32_from_fp32_groups:
            for model_param in model_group:
                if hasattr(model_param, "main_grad"):
                    model_param.grad = model_param.main_grad

    def _copy_main_params_to_model_params(self) -> None:
        # One for-each copy (cast to the model's dtype) over all params rather than a copy_ per param.
        model = [p.data for group in self.float16_groups for p in group]
        main = [p.data for group in self.fp32_from_float16_groups for p in group]
        if model:
            torch._foreach_copy_(model, main)

    def _copy_model_params_to_main_params(self) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                main_param.data.copy_(model_param.data)

    def reload_model_params(self) -> None:
        self._copy_model_params_to_main_params()

    def state_dict(self) -> dict[str, Any]:
        state_dict: dict[str, Any] = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        state_dict["fp32_from_fp16_params"] = self.fp32_from_float16_groups
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Older Megatron checkpoints used 'optimizer_state_dict' and 'fp32_from_fp16'.
        optimizer_key = "optimizer" if "optimizer" in state_dict else "optimizer_state_dict"
        self.optimizer.load_state_dict(state_dict[optimizer_key])
        self._load_grad_scaler(state_dict)
        main_key = "fp32_from_fp16_params" if "fp32_from_fp16_params" in state_dict else "fp32_from_fp16"
        saved_groups = state_dict[main_key]
        if [len(g) for g in saved_groups] != [len(g) for g in self.fp32_from_float16_groups]:
            raise ValueError("optimizer checkpoint holds a different number of fp32 main params "
                             "per group than this model")
        for current_group, saved_group in zip(self.fp32_from_float16_groups, saved_groups):
            for current_param, saved_param in zip(current_group, saved_group):
                current_param.data.copy_(saved_param.data)


class FP32Optimizer(MegatronOptimizer):
    """Plain fp32 training: no loss scaling (scale 1.0), grads clipped on their global norm."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 model_parallel_group: dist.ProcessGroup | None = None,
                 expert_tensor_model_pipeline_group: dist.ProcessGroup | None = None,
                 has_expert_params: bool | None = None) -> None:
        super().__init__(optimizer, config, model_parallel_group, expert_tensor_model_pipeline_group,
                         has_expert_params)
        self._scale = torch.tensor([1.0], dtype=torch.float32)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.optimizer.param_groups:
            _zero_grad_group_helper(group["params"], set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale

    def prepare_grads(self) -> bool:
        """Point `.grad` at `main_grad` where a grad buffer holds it; never skips."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if hasattr(param, "main_grad"):
                    param.grad = param.main_grad
        return False

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        return True

    @torch.no_grad()
    def step(self) -> StepResult:
        self.prepare_grads()
        return self._clip_count_and_step()

    def reload_model_params(self) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
