"""MambaMixer: the Mamba-2 mixer (Megatron-Core's MambaMixer; mamba_ssm's Mamba2), [s, b, h] -> [s, b, h].

    zxBCdt = in_proj(u)                                [s, b, 2 d_in + 2 ng n + nh]
    z, xBC, dt = split                                 d_in, d_in + 2 ng n, nh
    xBC = silu(causal depthwise conv1d(xBC))           kernel mamba_d_conv over the sequence
    x, B, C = split(xBC)                               d_in = nh hd, ng n, ng n
    y = SSD scan(x, softplus(dt + dt_bias), A = -exp(A_log), B, C) + D x     (fused_kernels/fused_ssd.py, fp32)
    y = RMSNorm over each of the ng groups of (y * silu(z)), times norm.weight   (gated, norm after gate)
    out = out_proj(y)

Sizes (TransformerConfig): n = mamba_state_dim, hd = mamba_head_dim, ng = mamba_num_groups, nh =
mamba_num_heads or 2 h / hd (d_in = nh hd; Megatron's expand is 2). in_proj and out_proj have no
bias, conv1d has one (Megatron asserts both).

State-dict keys (Megatron-Core's; shapes on one of t tensor-parallel ranks):
    in_proj.weight     [(2 d_in + 2 ng n + nh)/t, h]   rows [z_r, x_r, B_r, C_r, dt_r] of rank r
    conv1d.weight      [(d_in + 2 ng n)/t, 1, k]        rows [x_r, B_r, C_r]
    conv1d.bias        [(d_in + 2 ng n)/t]
    dt_bias, A_log, D  [nh/t]                           fp32 math (A_log and D are kept in fp32 by Megatron)
    norm.weight        [d_in/t]
    out_proj.weight    [h, d_in/t]                      row parallel
Tensor parallelism splits the heads and the groups (nh and ng divisible by t, as Megatron's): rank r
owns heads r nh/t .. and the groups they read; its slice of each packed tensor is given by explicit
rows (partition_rows), so a checkpoint's whole tensors are the t = 1 layout and converters and the
torch_dist layout reshard them. Every parameter is drawn whole, from the layer's own init stream,
and sliced, so the model is the same at every t.

Initialisation (Megatron-Core / mamba_ssm): in_proj init_method, out_proj output_layer_init_method,
conv1d kaiming-uniform(a = sqrt 5) with a uniform(+-1/sqrt k) bias, dt_bias = softplus^-1(dt) for dt
log-uniform in [1e-3, 1e-1] floored at 1e-4, A = uniform(1, 16) (A_log = log A), D = 1, norm.weight = 1.

Context parallelism (context_parallel_size N > 1; context_parallel.py): in_proj's x, B, C and dt of this
CP rank's s/N tokens go through an all-to-all to every token of 1/N of the TP rank's heads and groups (nh/t
and ng/t divisible by N), the conv and scan run on the whole sequence in position order with this CP rank's
slices of conv1d, dt_bias, A_log and D, and the scan's output comes back by the inverse all-to-all;
z, the gated norm and out_proj stay on the rank's tokens. Generation (an inference context) is refused.

The scan and the convolution are megatron.fused_kernels.fused_ssd's chunk_scan and conv1d_silu: on
CUDA, when importable (never required), mamba_ssm's and causal_conv1d's kernels; otherwise, and
always on CPU, PyTorch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.fused_kernels.fused_ssd import chunk_scan, conv1d_silu, ssd_step
from megatron.model.mamba.context_parallel import MambaContextParallel
from megatron.model.module import MegatronModule
from megatron.model.spec import ModuleSpec, build_module
from megatron.model.transformer_config import ConfigRuleError, TransformerConfig

DT_MIN, DT_MAX, DT_FLOOR, A_INIT_RANGE = 1e-3, 1e-1, 1e-4, (1.0, 16.0)


@dataclass(frozen=True)
class MambaDims:
    """The mixer's sizes: whole (d_inner, nheads, ngroups) and this TP rank's (the *_local ones); under
    context parallelism (cp > 1) the scan's share of a CP rank is 1/cp of the TP rank's."""

    hidden: int
    d_inner: int
    nheads: int
    head_dim: int
    ngroups: int
    d_state: int
    d_conv: int
    tp: int
    cp: int = 1

    @property
    def d_inner_local(self) -> int:
        return self.d_inner // self.tp

    @property
    def nheads_local(self) -> int:
        return self.nheads // self.tp

    @property
    def ngroups_local(self) -> int:
        return self.ngroups // self.tp

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def conv_dim_local(self) -> int:
        return self.conv_dim // self.tp

    @property
    def in_proj_dim(self) -> int:
        return 2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads

    def in_proj_rows(self, rank: int) -> list[int]:
        """Rank `rank`'s rows of the whole in_proj weight: its z, x, B, C and dt slices."""
        sizes = (self.d_inner, self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state, self.nheads)
        return _packed_rows(sizes, self.tp, rank)

    def conv_rows(self, rank: int) -> list[int]:
        """Rank `rank`'s channels of the whole conv1d: its x, B and C slices."""
        return _packed_rows((self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state), self.tp, rank)


def _packed_rows(sizes: tuple[int, ...], tp: int, rank: int) -> list[int]:
    """Rows of rank `rank` in a tensor packing several parts of `sizes` rows, each split evenly over tp."""
    rows, start = [], 0
    for size in sizes:
        part = size // tp
        rows.extend(range(start + rank * part, start + (rank + 1) * part))
        start += size
    return rows


def mamba_dims(config: TransformerConfig) -> MambaDims:
    """The mixer's sizes from the config, checked as Megatron-Core does (ConfigRuleError names the fields)."""
    hd, ng, n, tp = config.mamba_head_dim, config.mamba_num_groups, config.mamba_state_dim, \
        config.tensor_model_parallel_size
    for name in ("mamba_head_dim", "mamba_num_groups", "mamba_state_dim", "mamba_num_heads", "mamba_d_conv",
                 "mamba_chunk_size"):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigRuleError(f"<<{name}>> must be a positive integer, got {value!r}")
    if config.mamba_num_heads is not None:
        nh = config.mamba_num_heads
    else:
        if (2 * config.hidden_size) % hd:
            raise ConfigRuleError(f"2 x <<hidden_size>> ({2 * config.hidden_size}) must be divisible by "
                                  f"<<mamba_head_dim>> ({hd}) unless <<mamba_num_heads>> is given")
        nh = 2 * config.hidden_size // hd
    if nh % ng:
        raise ConfigRuleError(f"the Mamba heads ({nh}, <<mamba_num_heads>> or 2 x hidden / head dim) must be "
                              f"divisible by <<mamba_num_groups>> ({ng})")
    if nh % tp or ng % tp:
        raise ConfigRuleError(f"the Mamba heads ({nh}) and <<mamba_num_groups>> ({ng}) must be divisible by "
                              f"<<tensor_model_parallel_size>> ({tp})")
    cp = config.context_parallel_size
    if cp > 1 and ((nh // tp) % cp or (ng // tp) % cp):
        raise ConfigRuleError(f"Mamba context parallelism splits each tensor-parallel rank's Mamba heads ({nh // tp}) "
                              f"and <<mamba_num_groups>> ({ng // tp}) over the <<context_parallel_size>> ({cp}) "
                              f"ranks: both must be divisible by it (heads {nh} and groups {ng} over "
                              f"<<tensor_model_parallel_size>> {tp})")
    return MambaDims(config.hidden_size, nh * hd, nh, hd, ng, n, config.mamba_d_conv, tp, cp)


@dataclass
class MambaMixerSubmodules:
    in_proj: ModuleSpec | type = ColumnParallelLinear
    out_proj: ModuleSpec | type = RowParallelLinear


def _partitioned(param: nn.Parameter, rows: list[int] | None) -> nn.Parameter:
    """Mark a parameter split over TP along dim 0 (contiguously, or by explicit rows)."""
    set_tensor_model_parallel_attributes(param, True, 0, 1)
    if rows is not None:
        param.partition_rows = torch.as_tensor(rows, dtype=torch.long)
    return param


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over each group of `group_size` channels (mamba_ssm's RMSNormGated with
    norm_before_gate=False), in fp32; the result times weight, in y's dtype. Key: weight [d_in/t]."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = z.dtype
        gated = y.float() * F.silu(z.float())  # [..., d_in/t]
        groups = gated.unflatten(-1, (-1, self.group_size))  # [..., ng/t, d_in/ng]
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.flatten(-2).to(dtype)


class MambaMixer(MegatronModule):
    """[s, b, h] -> (out [s, b, h], None); [s/t, b, h] in and out under sequence parallelism (in_proj
    gathers the sequence, out_proj reduce-scatters it). With an inference_context the layer's conv and
    SSM states are read from and written to it (InferenceContext.mamba_states): a step of one token
    runs the recurrence once, a longer one the chunked scan from the cached state."""

    def __init__(self, config: TransformerConfig, submodules: MambaMixerSubmodules | None = None,
                 layer_number: int = 1) -> None:
        super().__init__(config)
        submodules = submodules or MambaMixerSubmodules()
        self.layer_number = layer_number
        self.dims = dims = mamba_dims(config)
        tp = dims.tp
        rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
        self.in_proj = build_module(submodules.in_proj, dims.hidden, dims.in_proj_dim, config=config,
                                    init_method=config.init_method, bias=False, gather_output=False,
                                    **({"partition_rows": dims.in_proj_rows(rank)} if tp > 1 else {}))
        conv_rows = dims.conv_rows(rank)
        dtype = config.params_dtype
        self.conv1d = nn.Module()  # holds conv1d.weight [ch/t, 1, k] and conv1d.bias [ch/t]: Megatron's keys
        weight = torch.empty(dims.conv_dim, 1, dims.d_conv)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        bound = 1 / math.sqrt(dims.d_conv)
        bias = torch.empty(dims.conv_dim).uniform_(-bound, bound)
        self.conv1d.weight = _partitioned(nn.Parameter(weight[conv_rows].to(dtype)), conv_rows if tp > 1 else None)
        self.conv1d.bias = _partitioned(nn.Parameter(bias[conv_rows].to(dtype)), conv_rows if tp > 1 else None)
        heads = slice(rank * dims.nheads_local, (rank + 1) * dims.nheads_local)
        dt = torch.exp(torch.rand(dims.nheads) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
        dt = dt.clamp(min=DT_FLOOR)
        inverse_softplus = dt + torch.log(-torch.expm1(-dt))
        self.dt_bias = _partitioned(nn.Parameter(inverse_softplus[heads].to(dtype)), None)
        A = torch.empty(dims.nheads).uniform_(*A_INIT_RANGE)
        self.A_log = _partitioned(nn.Parameter(torch.log(A)[heads]), None)  # fp32, as Megatron keeps it
        self.D = _partitioned(nn.Parameter(torch.ones(dims.nheads_local)), None)  # fp32
        self.norm = GatedRMSNorm(dims.d_inner_local, dims.d_inner // dims.ngroups, config.layernorm_epsilon, dtype)
        _partitioned(self.norm.weight, None)
        self.out_proj = build_module(submodules.out_proj, dims.d_inner, dims.hidden, config=config,
                                     init_method=config.output_layer_init_method, bias=False,
                                     input_is_parallel=True, skip_bias_add=True)
        self.cp = None  # not a module: no parameters, nothing in the state dict
        if dims.cp > 1:
            bc = dims.ngroups_local * dims.d_state
            self.cp = MambaContextParallel(parallel_state.get_context_parallel_group(), dims.cp,
                                           parallel_state.get_context_parallel_rank(),
                                           (dims.d_inner_local, bc, bc, dims.nheads_local))

    def forward(self, hidden_states: torch.Tensor, inference_context=None) -> tuple[torch.Tensor, None]:
        d = self.dims
        zxbcdt, _ = self.in_proj(hidden_states)  # [s, b, proj/t] (the whole sequence under SP; s/N under CP)
        zxbcdt = zxbcdt.transpose(0, 1)  # [b, s, proj/t]
        z, xbc, dt = torch.split(zxbcdt, [d.d_inner_local, d.conv_dim_local, d.nheads_local], dim=-1)
        conv_weight, conv_bias, dt_bias, A_log, D = (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log,
                                                     self.D)
        if self.cp is not None:  # the CP ranks split the heads for the conv and scan (context_parallel.py)
            if inference_context is not None:
                raise ValueError("generation with --context-parallel-size > 1 is not supported")
            xbc, dt = self.cp.to_heads(xbc.transpose(0, 1), dt.transpose(0, 1))  # [s, b, ch/(t N)], [s, b, nh/(t N)]
            xbc, dt = xbc.transpose(0, 1), dt.transpose(0, 1)  # [b, s, ...], s the whole sequence
            conv_weight, conv_bias = self.cp.conv_slice(conv_weight), self.cp.conv_slice(conv_bias)
            dt_bias, A_log, D = self.cp.head_slice(dt_bias), self.cp.head_slice(A_log), self.cp.head_slice(D)
        b, s = xbc.shape[:2]
        heads, groups = d.nheads_local // d.cp, d.ngroups_local // d.cp  # the scan's heads and groups
        bc = groups * d.d_state
        conv_state = ssm_state = None
        if inference_context is not None:
            conv_state, ssm_state = inference_context.mamba_states(
                self.layer_number, b, (xbc.shape[-1], d.d_conv - 1), (heads, d.head_dim, d.d_state),
                xbc.dtype, xbc.device)
        xbc, new_conv_state = conv1d_silu(xbc.transpose(1, 2), conv_weight, conv_bias, conv_state)  # [b, ch, s]
        xbc = xbc.transpose(1, 2)  # [b, s, ch]
        x, B, C = torch.split(xbc, [heads * d.head_dim, bc, bc], dim=-1)
        x = x.unflatten(-1, (heads, d.head_dim))  # [b, s, nh/t, hd] (nh/(t N) under CP)
        B = B.unflatten(-1, (groups, d.d_state))  # [b, s, ng/t, n]
        C = C.unflatten(-1, (groups, d.d_state))
        dt = F.softplus(dt.float() + dt_bias.float())  # [b, s, nh/t], fp32
        A = -torch.exp(A_log.float())  # [nh/t]
        if ssm_state is not None and s == 1 and inference_context.sequence_len_offset > 0:
            y, final_state = ssd_step(ssm_state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
            y = y[:, None]  # [b, 1, nh/t, hd]
        else:
            y, final_state = chunk_scan(x, dt, A, B, C, self.config.mamba_chunk_size, D, ssm_state)
        if inference_context is not None:
            conv_state.copy_(new_conv_state)
            ssm_state.copy_(final_state)
        y = y.reshape(b, s, heads * d.head_dim)  # [b, s, d_in/t]
        if self.cp is not None:  # back to this CP rank's tokens, every head of the TP rank
            y = self.cp.to_sequence(y.transpose(0, 1)).transpose(0, 1)  # [s, b, d_in/(t N)] -> [b, s/N, d_in/t]
        y = self.norm(y, z)  # [b, s, d_in/t], z's dtype
        return self.out_proj(y.transpose(0, 1))  # ([s, b, h] or [s/t, b, h] under SP, None)
