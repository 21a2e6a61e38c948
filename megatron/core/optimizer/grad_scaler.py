"""Loss scalers for fp16 training, with Megatron's semantics.

A scaler holds the current loss scale as a 1-element fp32 tensor. `ConstantGradScaler` never
changes it (`--loss-scale S`); `DynamicGradScaler` (the fp16 default) backs off after overflows
and grows again after a window of clean steps:

    overflow: growth tracker := 0; hysteresis tracker -= 1;
              when the hysteresis tracker reaches 0: scale := max(scale * backoff, min_scale)
    clean:    growth tracker += 1; after growth_interval clean steps in a row:
              scale := scale * growth; growth tracker := 0; hysteresis tracker := hysteresis

Note the hysteresis tracker is only restored by a growth, not by a single clean step, so
with hysteresis 2 two overflows anywhere inside one growth window halve the scale (Megatron).
The tensors live on the CPU; the optimizer moves them next to the gradients when applying them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class MegatronGradScaler(ABC):
    """Base class: a loss scale (`scale`) and its reciprocal (`inv_scale`)."""

    def __init__(self, initial_scale: float) -> None:
        if not initial_scale > 0.0:
            raise ValueError(f"initial loss scale must be positive, got {initial_scale}")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        # Reciprocal in double precision so that 1 / 2**k is exact before rounding to fp32.
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step that did (or did not) overflow."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ...


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (`--loss-scale`); overflowing steps are still skipped."""

    def update(self, found_inf: bool) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic loss scaler (see the module docstring for the update rule)."""

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2) -> None:
        super().__init__(initial_scale)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"min loss scale ({min_scale}) must be in (0, initial loss scale "
                             f"({initial_scale})]")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval <= 0:
            raise ValueError(f"growth_interval (--loss-scale-window) must be positive, got {growth_interval}")
        if hysteresis <= 0:
            raise ValueError(f"hysteresis must be positive, got {hysteresis}")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float32)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float32)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scale = torch.as_tensor(state_dict["scale"], dtype=torch.float32).detach().cpu().clone().reshape(1)
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
