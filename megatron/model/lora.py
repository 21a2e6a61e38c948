"""LoRA on a built model: adapters on the targeted linear layers of every transformer layer, the rest frozen.

    apply_lora(model, config, seed)   attach the adapters (megatron/core/tensor_parallel/lora.py) to each
                                      TransformerLayer's linear_qkv / linear_proj / linear_fc1 / linear_fc2
                                      named in config.target_modules; every other parameter gets
                                      requires_grad False (no gradient, no main_grad, no optimizer state)
    is_lora_parameter(name)           whether a state-dict key / parameter name is an adapter's
    lora_state_dict(model)            the adapters' tensors only (this rank's pieces)
    state_dict_view(chunks, view)     state_dict() of the adapters alone, or of the base alone (checkpoints)
    merge_lora_state_dict(sd, s)      whole tensors with W + s B A folded in (tools/checkpoint merge)

Each adapter's A is drawn from its own generator, seeded by the run's seed and the module's global
name (layer number + path in the layer), so the adapters are the same at every TP/PP layout and do
not move any other random stream.
"""

from __future__ import annotations

import contextlib
import zlib

import torch
from torch import nn

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.lora import ColumnParallelLoRA, LoRAConfig, RowParallelLoRA, draw_lora_a
from megatron.model.moe import MoELayer
from megatron.model.transformer_layer import TransformerLayer

ADAPTER_SUFFIXES = (".adapter.linear_in.weight", ".adapter.linear_out.weight")


def is_lora_parameter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def _adapter_generator(seed: int, layer_number: int, path: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed + zlib.crc32(f"{layer_number}.{path}".encode()))


def apply_lora(model: nn.Module, config: LoRAConfig, seed: int) -> int:
    """Attach the adapters and freeze the base; returns how many linear layers got one.

    A model chunk may hold no targeted layer (a pipeline stage without transformer layers)."""
    count = 0
    for layer in model.modules():
        if not isinstance(layer, TransformerLayer):
            continue
        if isinstance(layer.mlp, MoELayer):
            raise ValueError("LoRA on mixture-of-experts layers is not supported")
        for path, module in layer.named_modules():
            target = path.rsplit(".", 1)[-1]
            if (target not in config.target_modules or not isinstance(module, (ColumnParallelLinear, RowParallelLinear))
                    or module.weight is None or module.adapter is not None):
                continue
            full_in = module.input_size
            full_a = draw_lora_a(config.rank, full_in, _adapter_generator(seed, layer.layer_number, path))
            adapter_cls = ColumnParallelLoRA if isinstance(module, ColumnParallelLinear) else RowParallelLoRA
            module.adapter = adapter_cls(module, config, full_a).to(module.weight.device)
            count += 1
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_parameter(name))
    embedding = getattr(model, "embedding", None)
    if count and isinstance(embedding, nn.Module) and model.config.recompute_granularity == "full":
        # Full recompute reruns each layer block from its input; with the embedding frozen that input
        # needs no gradient, and a recompute whose inputs need none is cut off from backward (the
        # adapters inside would get no gradient). The embedding's output is marked as needing one.
        embedding.register_forward_hook(_output_requires_grad)
    return count


def _output_requires_grad(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and not output.requires_grad:
        output = output.detach().requires_grad_(True)
    return output


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor} of the adapters' weights in `model` (this rank's pieces, detached)."""
    return {name: tensor.detach() for name, tensor in model.state_dict(keep_vars=True).items()
            if is_lora_parameter(name)}


def merge_lora_state_dict(state_dict: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A state dict of whole (unsplit) tensors with every adapter folded into its base weight:
    W + scaling B A, in fp32 then cast to W's dtype; the adapter keys are dropped."""
    merged = {name: tensor for name, tensor in state_dict.items() if not is_lora_parameter(name)}
    for name in state_dict:
        if not name.endswith(ADAPTER_SUFFIXES[0]):
            continue
        prefix = name[: -len(ADAPTER_SUFFIXES[0])]
        a, b = state_dict[name].float(), state_dict[prefix + ADAPTER_SUFFIXES[1]].float()  # [r, in], [out, r]
        base = merged[prefix + ".weight"]
        merged[prefix + ".weight"] = (base.float() + scaling * (b @ a)).to(base.dtype)  # [out, in]
    return merged


def has_lora(model: nn.Module) -> bool:
    return any(is_lora_parameter(name) for name, _ in model.named_parameters())


def _view_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    view = getattr(module, "_lora_state_dict_view", None)
    if view is None:
        return
    keep_adapters = view == "adapters"
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if is_lora_parameter(key) != keep_adapters:
            del state_dict[key]


@contextlib.contextmanager
def state_dict_view(chunks, view: str):
    """While open, each chunk's state_dict() (wrappers included) holds only the adapters
    (view "adapters": what a LoRA checkpoint saves and resumes) or only the base ("base": what is
    read from the base checkpoint). Both checkpoint formats build their tensor lists from it."""
    if view not in ("adapters", "base"):
        raise ValueError(f"view must be 'adapters' or 'base', not {view!r}")
    models = [_innermost(chunk) for chunk in chunks]
    handles = []
    for model in models:
        model._lora_state_dict_view = view
        handles.append(model._register_state_dict_hook(_view_hook))
    try:
        yield
    finally:
        for model, handle in zip(models, handles):
            handle.remove()
            model._lora_state_dict_view = None


def _innermost(module: nn.Module) -> nn.Module:
    while isinstance(getattr(module, "module", None), nn.Module):
        module = module.module
    return module
