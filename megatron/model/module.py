"""MegatronModule (base class holding the config), Float16Module (half-precision wrapper), unwrap_model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from megatron.core import parallel_state
from megatron.core.utils import unwrap_model  # noqa: F401 (re-exported: megatron.model.unwrap_model)
from megatron.model.transformer_config import TransformerConfig


class MegatronModule(nn.Module):
    """Base class of the model's modules: holds `.config` and Megatron's checkpoint hook."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The state dict written to checkpoints (the plain state dict: no extra entries)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)


def _conversion_helper(value: Any, conversion: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply `conversion` to every tensor inside nested tuples/lists/dicts."""
    if isinstance(value, torch.Tensor):
        return conversion(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_conversion_helper(v, conversion) for v in value)
    if isinstance(value, dict):
        return {k: _conversion_helper(v, conversion) for k, v in value.items()}
    return value


def fp32_to_float16(value: Any, dtype: torch.dtype) -> Any:
    """Cast fp32 tensors (only those: token ids and bool masks pass unchanged) to `dtype`."""
    return _conversion_helper(value, lambda t: t.to(dtype) if t.dtype == torch.float32 else t)


def float16_to_fp32(value: Any) -> Any:
    """Cast fp16/bf16 tensors to fp32; others pass unchanged."""
    return _conversion_helper(value, lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t)


class Float16Module(MegatronModule):
    """Runs `module` in fp16 or bf16 (config.fp16 / config.bf16) and hands back fp32 outputs.

    The wrapped module's parameters are cast in place. fp32 inputs are cast to the half dtype
    on the first pipeline stage; half outputs (logits, losses) are cast to fp32 on the last.
    The state dict is the inner module's: keys carry no "module." prefix, so a checkpoint
    loads the same into a wrapped or an unwrapped model.
    """

    def __init__(self, config: TransformerConfig, module: nn.Module) -> None:
        super().__init__(config)
        if config.fp16:
            self.float16_dtype = torch.float16
        elif config.bf16:
            self.float16_dtype = torch.bfloat16
        else:
            raise ValueError("Float16Module needs config.fp16 or config.bf16 to be set")
        self.add_module("module", module.to(self.float16_dtype))

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Pipeline hook: forwarded to the inner module."""
        self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if parallel_state.is_pipeline_first_stage():
            inputs = fp32_to_float16(inputs, self.float16_dtype)
            kwargs = fp32_to_float16(kwargs, self.float16_dtype)
        outputs = self.module(*inputs, **kwargs)
        if parallel_state.is_pipeline_last_stage():
            outputs = float16_to_fp32(outputs)
        return outputs

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The inner module's state dict (no "module." prefix)."""
        if args:  # torch's deprecated positional form state_dict(destination, prefix, keep_vars)
            return self.module.state_dict(*args)
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        inner = self.module
        if isinstance(inner, MegatronModule):
            return inner.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        return inner.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load into the inner module (keys without a "module." prefix); values are cast to its dtype."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
