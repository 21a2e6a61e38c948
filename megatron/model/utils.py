"""Small helpers shared by the model: init methods, GeLU variants, attention masks, counting."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

# Megatron fills masked attention scores with -10000.0 rather than -inf: a fully masked row
# (e.g. padding) then gives a uniform distribution instead of NaN, and the value fits in fp16.
ATTENTION_MASK_FILL_VALUE = -10000.0


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Init function drawing from normal(0, sigma) in place."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Init for the projections that write into the residual stream: normal(0, sigma / sqrt(2L)).

    Each of the 2L residual branches adds its output to the stream, so scaling keeps the
    variance of the stream independent of depth (GPT-2 paper, sec. 2.3).
    """
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


@contextlib.contextmanager
def init_rng(init_seed: int | None, stream: int) -> Iterator[None]:
    """Run a module's initialisation on its own CPU random stream, seeded by (init_seed, stream).

    The model gives each piece a stream number (0 the embedding, L the L-th layer, num_layers + 1
    an untied output layer), so a piece's initial weights depend on the seed and on nothing else:
    not on which pipeline stage or model chunk builds it, nor on what was built before. The
    caller's generator is restored afterwards. init_seed None: draw from the caller's generator.
    """
    if init_seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((init_seed * 1_000_003 + stream) % (2**63))
        yield


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """Tanh approximation of GeLU (OpenAI GPT-2's, HF's "gelu_new")."""
    return F.gelu(x, approximate="tanh")


# Exact GeLU, x * Phi(x) with the error function: Megatron's default activation, and Megatron-Core's
# TransformerConfig.activation_func default (F.gelu itself, so the config's default is this function).
erf_gelu = F.gelu


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (--squared-relu; Primer, So et al. 2021)."""
    return F.relu(x).square()


def attention_mask_func(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fill the positions where mask is True (masked out) with ATTENTION_MASK_FILL_VALUE."""
    return scores.masked_fill(mask, ATTENTION_MASK_FILL_VALUE)


def get_causal_attention_mask(seq_length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool [1, 1, s, s] mask, True above the diagonal (a token may not see later tokens)."""
    mask = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu_(diagonal=1)
    return mask.view(1, 1, seq_length, seq_length)  # [1, 1, s, s]


def get_num_parameters(model: nn.Module | Iterable[nn.Module]) -> int:
    """Number of unique parameters (a tied embedding / output weight counts once)."""
    modules = [model] if isinstance(model, nn.Module) else list(model)
    seen = {}
    for module in modules:
        for param in module.parameters():
            seen[id(param)] = param.numel()
    return sum(seen.values())


def get_num_parameters_across_model_parallel(model: nn.Module | Iterable[nn.Module]) -> int:
    """Parameters of the whole model over its tensor/pipeline ranks, each counted once.

    A tensor-parallel shard counts on every rank (the shards together are the weight); a
    parameter replicated on all TP ranks (layer norms, row-parallel biases, position
    embeddings) counts on TP rank 0 only, replicated K/V rows on their group's first rank; the
    last stage's copy of a tied embedding not at all.
    Equals the serial model's count plus the vocabulary padding rows. Expert parameters
    (expert_parallel: different experts on different EP ranks, split over expert TP) are summed over
    the expert tensor-model-pipeline group instead, those whole on every expert-TP rank (row-parallel
    expert biases) on expert-TP rank 0 only. Collective over the model-parallel group and the
    expert one: every rank must call this.
    """
    from megatron.core import communication, parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    modules = [model] if isinstance(model, nn.Module) else list(model)
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    seen, experts = {}, {}
    for module in modules:
        for param in module.parameters():
            if getattr(param, "expert_parallel", False):
                if getattr(param, "tensor_model_parallel", False) or etp_rank == 0:
                    experts[id(param)] = param.numel()
            elif (param_is_not_tensor_parallel_duplicate(param) and not getattr(param, "shared_embedding", False)
                    and not getattr(param, "pipeline_copy", False)):
                seen[id(param)] = param.numel()
                duplicate = getattr(param, "tensor_parallel_duplicate_rows", None)
                if duplicate is not None:  # rows replicating another TP rank's (MQA K/V): counted there
                    seen[id(param)] -= (duplicate[1] - duplicate[0]) * (param.numel() // param.shape[0])
    total = torch.tensor([sum(seen.values())], dtype=torch.int64)
    expert_total = torch.tensor([sum(experts.values())], dtype=torch.int64)
    for value, group in ((total, parallel_state.get_model_parallel_group()),
                         (expert_total, parallel_state.get_expert_tensor_model_pipeline_parallel_group())):
        if group is not None:
            communication.all_reduce(value, group=group)
    return int(total.item()) + int(expert_total.item())
