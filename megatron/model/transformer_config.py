"""TransformerConfig: the shape, regularisation, init and precision of a transformer.

Field names and defaults are Megatron-Core's (`megatron/core/transformer/transformer_config.py`),
so `megatron/training/arguments.py` maps flags one-to-one (`--hidden-size` -> hidden_size, ...). The model
reads only this object, never the global args.

Derived in __post_init__ (as Megatron does):
    ffn_hidden_size           None -> 4 * hidden_size
    kv_channels               None -> hidden_size // num_attention_heads
    attention_softmax_in_fp32 forced True when apply_query_key_layer_scaling
    init_method               None -> normal(0, init_method_std)
    output_layer_init_method  None -> normal(0, init_method_std / sqrt(2 * num_layers))

The Llama family (docs/model.md): normalization "LayerNorm" | "RMSNorm" and
layernorm_zero_centered_gamma (--apply-layernorm-1p); num_query_groups (grouped-query attention:
None means one group per head, 1 is multi-query; under tensor parallelism the groups split over the
ranks, or with fewer groups than ranks each group's K/V is replicated); qk_layernorm; add_qkv_bias
(a QKV bias even with add_bias_linear False); gated_linear_unit with activation_func (SwiGLU is
F.silu, gated; openai_gelu turns the default F.gelu into the tanh GeLU); rotary_interleaved (the
pairing of rotary channels; the other RoPE settings are GPTModel's, as in Megatron-Core).
bias_swiglu_fusion and apply_rope_fusion pick fused_kernels.bias_swiglu / rotary_pos_emb over the
PyTorch formulas. The model takes its tensor-parallel size from tensor_model_parallel_size and
checks it against the group it is built in.

Activation recompute (docs/memory.md): recompute_granularity "selective" reruns the core
attention in backward; "full" with recompute_method "uniform" (groups of recompute_num_layers
layers) or "block" (the first recompute_num_layers layers of each stage) reruns whole layers.
use_flash_attn: the core attention runs in flash-attn (CUDA) or torch's scaled_dot_product_attention.

Fused ops (megatron.fused_kernels; docs/fused_kernels.md, "Using them in the model"), on by
default as in Megatron's flags: masked_softmax_fusion (the attention softmax), bias_gelu_fusion
(bias + tanh-approximation GeLU), bias_dropout_fusion (bias + dropout + residual). LayerNorm
always runs fused_kernels.layer_norm. fused_kernels_cpu_impl: the implementation used for CPU
tensors, "native" (ATen's own kernels, the GeLU of large tensors compiled; the attention core as
one node, fused_core_attention.py; oneDNN fp32 GEMMs in the linears: the fast CPU path), "reference" (the formulas op by op: the plain path) or "compiled"
(torch.compile); on CUDA the package's automatic choice (Triton) applies. gradient_accumulation_fusion (off here as in Megatron's
ModelParallelConfig; the flags turn it on): the linear layers add their weight gradients straight
into DistributedDataParallel's `main_grad` (megatron/core/tensor_parallel/layers.py).

calculate_per_token_loss (--calculate-per-token-loss): the loss is the sum over the global batch's
loss tokens divided by their count; DistributedDataParallel then sums gradients over the
data-parallel ranks instead of averaging them, and finalize_model_grads divides by the global count.

Not a Megatron-Core field: include_padded_vocab_in_loss (--include-padded-vocab-in-loss). Off, the
ids the vocabulary padding adds start with zero embedding rows and take no part in the softmax, so
the loss is the same at every tensor-parallel size (GPTModel); on, they are drawn like the real rows
and the softmax runs over the whole padded vocabulary, as in Megatron (docs/training.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.model.utils import init_method_normal, openai_gelu, scaled_init_method_normal

InitMethod = Callable[[torch.Tensor], torch.Tensor]
# Implementations of the fused ops the model may force on CPU (megatron.fused_kernels.dispatch).
FUSED_KERNELS_CPU_IMPLS = ("native", "reference", "compiled")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
CP_COMM_TYPES = (None, "p2p", "a2a", "allgather", "a2a+p2p")


def moe_layer_numbers(moe_layer_freq: int | list[int], num_layers: int) -> list[int]:
    """The 1-based numbers of the MoE layers: every moe_layer_freq-th from the first (1, 1 + N, ...),
    or where a 0/1 list has a 1 (Megatron's --moe-layer-freq); the one place this is computed."""
    if isinstance(moe_layer_freq, int):
        return [n for n in range(1, num_layers + 1) if (n - 1) % moe_layer_freq == 0]
    return [n + 1 for n, v in enumerate(moe_layer_freq) if v]


class ConfigRuleError(ValueError):
    """A rule of the config is broken. The message names fields as <<field>>: str() writes them as
    the fields' names (moe_router_topk), render(name_of) as anything else, e.g. the command line's
    flags (--moe-router-topk), so each rule is written once, here, for Python and the CLI alike."""

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self.render(lambda field: field))

    def fields(self) -> list[str]:
        return re.findall(r"<<(\w+)>>", self.template)

    def render(self, name_of: Callable[[str], str]) -> str:
        return re.sub(r"<<(\w+)>>", lambda m: name_of(m.group(1)), self.template)


def _require_positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ConfigRuleError(f"<<{name}>> must be a positive integer, got {value!r}")


def _require_probability(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


@dataclass
class TransformerConfig:
    """Configuration of a GPT-style transformer (Megatron-Core field names and defaults).

    Accepted for compatibility, with no effect: deterministic_mode, use_cpu_initialization
    (parameters are always created and initialised on the CPU, so an initialisation is the same
    on every device; the trainer moves the model to the device).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    # Model-parallel layout (Megatron-Core's ModelParallelConfig fields). The model's layers split
    # heads and features by tensor_model_parallel_size (TransformerBlock checks it is the live group's).
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    # Context parallelism (megatron/model/context_parallel_attention.py, docs/parallelism.md): the
    # sequence split over context_parallel_size ranks; cp_comm_type "p2p" (None), "a2a", "allgather" or
    # "a2a+p2p" (with hierarchical_context_parallel_sizes [a2a size, p2p size]), or one per layer.
    context_parallel_size: int = 1
    cp_comm_type: str | list[str] | None = None
    hierarchical_context_parallel_sizes: list[int] | None = None
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = False
    apply_residual_connection_post_layernorm: bool = False
    layernorm_epsilon: float = 1e-5
    normalization: str = "LayerNorm"
    layernorm_zero_centered_gamma: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    num_query_groups: int | None = None
    qk_layernorm: bool = False
    gated_linear_unit: bool = False
    activation_func: Callable[[torch.Tensor], torch.Tensor] = F.gelu
    openai_gelu: bool = False
    rotary_interleaved: bool = False
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    fp32_residual_connection: bool = False
    perform_initialization: bool = True
    use_cpu_initialization: bool = False
    fp16_lm_cross_entropy: bool = False
    include_padded_vocab_in_loss: bool = False
    masked_softmax_fusion: bool = True
    bias_gelu_fusion: bool = True
    bias_swiglu_fusion: bool = True
    apply_rope_fusion: bool = True
    bias_dropout_fusion: bool = True
    gradient_accumulation_fusion: bool = False
    fused_kernels_cpu_impl: str = "native"
    deterministic_mode: bool = False
    calculate_per_token_loss: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    distribute_saved_activations: bool = False
    use_flash_attn: bool = False
    # Mixture of experts (megatron/model/moe/, docs/moe.md): Megatron-Core's fields. num_moe_experts None
    # is a dense model; moe_layer_freq N puts an MoE MLP in every N-th layer (0, N, 2N...), or a list of
    # 0/1 per layer. expert_tensor_parallel_size None means tensor_model_parallel_size.
    num_moe_experts: int | None = None
    moe_layer_freq: int | list[int] = 1
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_topk: int = 2
    moe_router_load_balancing_type: str = "aux_loss"
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_dtype: str | None = None
    # Group-limited routing (both set): the E experts in num_groups groups, each token's experts chosen
    # from its group_topk best groups. Expert bias: the aux-loss-free balancing buffer of the router.
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_grouped_gemm: bool = False
    moe_token_dispatcher_type: str = "allgather"
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_per_layer_logging: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    # Mamba-2 layers (megatron/model/mamba/, docs/model.md): Megatron-Core's fields; mamba_num_heads None
    # is 2 x hidden_size / mamba_head_dim. mamba_d_conv and mamba_chunk_size are Megatron's fixed 4 and 128
    # (HF's conv_kernel and chunk_size); use_mamba_mem_eff_path is --disable-mamba-mem-eff-path's negation.
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int | None = None
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 128
    use_mamba_mem_eff_path: bool = True
    init_method: InitMethod | None = None
    output_layer_init_method: InitMethod | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels"):
            _require_positive(name, getattr(self, name))
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}) unless kv_channels is given"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        self._check_attention_heads()
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        if self.openai_gelu and self.activation_func is F.gelu:
            self.activation_func = openai_gelu  # Megatron's --openai-gelu: the tanh approximation
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 are mutually exclusive; set at most one of them")
        _require_probability("hidden_dropout", self.hidden_dropout)
        _require_probability("attention_dropout", self.attention_dropout)
        if self.init_method_std < 0:
            raise ValueError(f"init_method_std must be >= 0, got {self.init_method_std!r}")
        if self.layernorm_epsilon <= 0:
            raise ValueError(f"layernorm_epsilon must be > 0, got {self.layernorm_epsilon!r}")
        if self.fused_kernels_cpu_impl not in FUSED_KERNELS_CPU_IMPLS:
            raise ValueError(f"fused_kernels_cpu_impl must be one of {FUSED_KERNELS_CPU_IMPLS}, "
                             f"got {self.fused_kernels_cpu_impl!r}")
        if not self.params_dtype.is_floating_point:
            raise ValueError(f"params_dtype must be a floating-point dtype, got {self.params_dtype}")
        if self.apply_query_key_layer_scaling:
            # The scores are divided by layer_number before the softmax and multiplied back
            # inside it; that only helps if the softmax itself runs in fp32 (Megatron's rule).
            self.attention_softmax_in_fp32 = True
        self._check_recompute()
        self._check_moe()
        self._check_context_parallel()
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)

    def _check_attention_heads(self) -> None:
        """num_query_groups (None: one per head) must divide the heads; under tensor parallelism the
        heads split evenly, and the groups split evenly or (fewer groups than ranks) each group's
        key/value head is replicated on tensor_model_parallel_size / num_query_groups ranks."""
        _require_positive("num_query_groups", self.num_query_groups)
        heads, tp = self.num_attention_heads, self.tensor_model_parallel_size
        if self.num_query_groups is None:
            self.num_query_groups = heads
        groups = self.num_query_groups
        if heads % groups:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_query_groups ({groups})")
        if heads % tp:
            raise ValueError(f"num_attention_heads ({heads}) must be divisible by tensor_model_parallel_size ({tp})")
        if groups % tp and tp % groups:
            raise ValueError(f"num_query_groups ({groups}) must divide, or be a multiple of, "
                             f"tensor_model_parallel_size ({tp})")

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether the 1-based layer `layer_number` has an MoE MLP (moe_layer_freq; Megatron's pattern)."""
        return self.num_moe_experts is not None and layer_number in moe_layer_numbers(self.moe_layer_freq,
                                                                                      self.num_layers)

    def _check_moe(self) -> None:
        """Megatron-Core's rules for the MoE fields, each refused in one line naming the fields
        (ConfigRuleError: the command line names its flags instead; validate_args builds this config)."""
        for name in ("num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                     "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_router_topk"):
            _require_positive(name, getattr(self, name))
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.num_moe_experts is None:
            if self.expert_model_parallel_size > 1:
                raise ConfigRuleError("<<expert_model_parallel_size>> > 1 needs <<num_moe_experts>>")
            return
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        choices = {"moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "sinkhorn", "none"),
                   "moe_router_score_function": ("softmax", "sigmoid"),
                   "moe_token_dispatcher_type": ("allgather", "alltoall"),
                   "moe_token_drop_policy": ("probs", "position"),
                   "moe_router_dtype": (None, "fp32", "fp64")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigRuleError(f"<<{name}>> must be one of {allowed}, got {getattr(self, name)!r}")
        if self.moe_router_topk > self.num_moe_experts:
            raise ConfigRuleError(f"<<moe_router_topk>> ({self.moe_router_topk}) cannot exceed <<num_moe_experts>> "
                                  f"({self.num_moe_experts})")
        if self.num_moe_experts % self.expert_model_parallel_size:
            raise ConfigRuleError(f"<<num_moe_experts>> ({self.num_moe_experts}) must be divisible by "
                                  f"<<expert_model_parallel_size>> ({self.expert_model_parallel_size})")
        if self.moe_ffn_hidden_size % self.expert_tensor_parallel_size:
            raise ConfigRuleError(f"<<moe_ffn_hidden_size>> ({self.moe_ffn_hidden_size}) must be divisible by "
                                  f"<<expert_tensor_parallel_size>> ({self.expert_tensor_parallel_size})")
        self._check_moe_routing()
        if self.moe_router_load_balancing_type == "sinkhorn" and self.moe_aux_loss_coeff:
            raise ConfigRuleError("<<moe_router_load_balancing_type>> sinkhorn takes no aux loss: set "
                                  "<<moe_aux_loss_coeff>> to 0")
        if self.moe_aux_loss_coeff < 0 or (self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0):
            raise ConfigRuleError("<<moe_aux_loss_coeff>> and <<moe_z_loss_coeff>> must be >= 0")
        if self.moe_expert_capacity_factor is not None:
            if self.moe_expert_capacity_factor <= 0:
                raise ConfigRuleError(f"<<moe_expert_capacity_factor>> must be > 0, "
                                      f"got {self.moe_expert_capacity_factor!r}")
            if self.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
                raise ConfigRuleError("<<moe_expert_capacity_factor>> (token dropping) needs aux_loss, seq_aux_loss "
                                      "or none as <<moe_router_load_balancing_type>>")
        elif self.moe_pad_expert_input_to_capacity:
            raise ConfigRuleError("<<moe_pad_expert_input_to_capacity>> needs <<moe_expert_capacity_factor>>")
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            _require_positive("moe_layer_freq", freq)
        elif len(freq) != self.num_layers or any(v not in (0, 1) for v in freq):
            raise ConfigRuleError(f"<<moe_layer_freq>> as a list must hold <<num_layers>> ({self.num_layers}) "
                                  f"values of 0 or 1, got {freq!r}")
        if self.tensor_model_parallel_size > 1 and not self.sequence_parallel:
            raise ConfigRuleError("<<num_moe_experts>> with <<tensor_model_parallel_size>> > 1 needs "
                                  "<<sequence_parallel>>, as in Megatron")

    def _check_moe_routing(self) -> None:
        """Megatron-Core's rules for group-limited routing and the expert bias."""
        experts, topk = self.num_moe_experts, self.moe_router_topk
        for name in ("moe_router_num_groups", "moe_router_group_topk"):
            _require_positive(name, getattr(self, name))
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ConfigRuleError("<<moe_router_enable_expert_bias>> (the aux-loss-free expert bias) needs "
                                  "<<moe_router_score_function>> sigmoid, as in Megatron")
        if self.moe_router_enable_expert_bias and self.moe_router_load_balancing_type == "sinkhorn":
            raise ConfigRuleError("<<moe_router_enable_expert_bias>> is a top-k router's: it cannot be used with "
                                  "<<moe_router_load_balancing_type>> sinkhorn")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if group_topk is None:
            if groups is not None:
                raise ConfigRuleError("<<moe_router_num_groups>> needs <<moe_router_group_topk>> (the groups "
                                      "each token chooses from)")
            return
        if groups is None:
            raise ConfigRuleError("<<moe_router_group_topk>> (group-limited routing) needs <<moe_router_num_groups>>")
        if experts % groups:
            raise ConfigRuleError(f"<<num_moe_experts>> ({experts}) must be divisible by <<moe_router_num_groups>> "
                                  f"({groups})")
        if group_topk > groups:
            raise ConfigRuleError(f"<<moe_router_group_topk>> ({group_topk}) cannot exceed <<moe_router_num_groups>> "
                                  f"({groups})")
        # Each group's score is the sum of its top (topk // group_topk) scores (at least one), and the
        # top-k is taken among the chosen groups' experts (at least k of them).
        if topk < group_topk or topk > group_topk * (experts // groups):
            raise ConfigRuleError(f"<<moe_router_topk>> ({topk}) must be at least <<moe_router_group_topk>> "
                                  f"({group_topk}) and at most the chosen groups' experts ({group_topk} x "
                                  f"{experts // groups})")
        if self.moe_router_load_balancing_type == "sinkhorn":
            raise ConfigRuleError("<<moe_router_group_topk>> (group-limited routing) is a top-k router's: it cannot "
                                  "be used with <<moe_router_load_balancing_type>> sinkhorn")

    def cp_comm_type_of(self, layer_number: int) -> str:
        """The context-parallel exchange of the 1-based layer `layer_number` ("p2p" by default)."""
        kind = self.cp_comm_type
        if isinstance(kind, (list, tuple)):
            kind = kind[layer_number - 1]
        return kind or "p2p"

    def _check_context_parallel(self) -> None:
        """Megatron's rules for the context-parallel fields, one line each naming the fields."""
        cp = self.context_parallel_size
        _require_positive("context_parallel_size", cp)
        kinds = self.cp_comm_type if isinstance(self.cp_comm_type, (list, tuple)) else [self.cp_comm_type]
        if isinstance(self.cp_comm_type, (list, tuple)) and len(kinds) != self.num_layers:
            raise ConfigRuleError(f"<<cp_comm_type>> as a list must hold one type per layer (<<num_layers>> = "
                                  f"{self.num_layers}), got {len(kinds)}")
        bad = [k for k in kinds if k not in CP_COMM_TYPES]
        if bad:
            raise ConfigRuleError(f"<<cp_comm_type>> must be one of {', '.join(t for t in CP_COMM_TYPES if t)}, "
                                  f"got {bad[0]!r}")
        sizes = self.hierarchical_context_parallel_sizes
        if sizes is not None and (len(sizes) != 2 or sizes[0] * sizes[1] != cp or min(sizes) < 1):
            raise ConfigRuleError(f"<<hierarchical_context_parallel_sizes>> must be two sizes (a2a, then p2p) "
                                  f"whose product is <<context_parallel_size>> ({cp}), got {sizes!r}")
        if cp == 1:
            return
        if "a2a+p2p" in kinds and sizes is None:
            raise ConfigRuleError("<<cp_comm_type>> a2a+p2p needs <<hierarchical_context_parallel_sizes>>")
        local_heads = self.num_attention_heads // self.tensor_model_parallel_size
        for kind, ranks in (("a2a", cp), ("a2a+p2p", sizes[0] if sizes else 1)):
            if kind in kinds and local_heads % ranks:
                raise ConfigRuleError(f"<<cp_comm_type>> {kind} splits the {local_heads} attention heads of a "
                                      f"tensor-parallel rank over {ranks} ranks: <<num_attention_heads>> / "
                                      f"<<tensor_model_parallel_size>> must be divisible by it")

    def _check_recompute(self) -> None:
        """Megatron's rules for the recompute fields (ConfigRuleError: the command line names the
        flags). The layer count is checked against num_layers / (pipeline x virtual stages); the
        TransformerBlock of an uneven stage checks its own count again."""
        granularity, method, size = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if granularity not in (None, "full", "selective"):
            raise ConfigRuleError(f'<<recompute_granularity>> must be "full" or "selective", got {granularity!r}')
        if method not in (None, "uniform", "block"):
            raise ConfigRuleError(f'<<recompute_method>> must be "uniform" or "block", got {method!r}')
        _require_positive("recompute_num_layers", size)
        if granularity == "selective" and method is not None:
            raise ConfigRuleError("<<recompute_method>>: recompute method is not yet supported for selective "
                                  "recomputing granularity (<<recompute_granularity>> selective)")
        if granularity != "full":
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(self, name) is not None:
                    raise ConfigRuleError(f"<<{name}>> needs <<recompute_granularity>> full")
        else:
            if method is None:
                raise ConfigRuleError('<<recompute_granularity>> full needs <<recompute_method>> "uniform" or "block"')
            chunks = self.pipeline_model_parallel_size * (self.virtual_pipeline_model_parallel_size or 1)
            per_stage = self.num_layers // chunks
            if size is None or not 1 <= size <= per_stage:
                raise ConfigRuleError(f"<<recompute_granularity>> full needs <<recompute_num_layers>> between 1 and "
                                      f"the {per_stage} layers of each pipeline stage (model chunk), got {size}")
            if method == "uniform" and per_stage % size:
                raise ConfigRuleError(f"<<recompute_num_layers>> ({size}) must divide the {per_stage} layers of each "
                                      "pipeline stage (model chunk) with <<recompute_method>> uniform")
        if self.distribute_saved_activations:
            if self.tensor_model_parallel_size == 1:
                raise ConfigRuleError("<<distribute_saved_activations>>: can distribute recomputed activations only "
                                      "across tensor model parallel groups (needs <<tensor_model_parallel_size>> > 1)")
            if granularity != "full":
                raise ConfigRuleError("<<distribute_saved_activations>>: distributed recompute activations is only "
                                      "applicable to full recompute granularity (<<recompute_granularity>> full)")
            if self.sequence_parallel:
                raise ConfigRuleError("<<distribute_saved_activations>> cannot be combined with <<sequence_parallel>>: "
                                      "the saved layer inputs are already split over the tensor-parallel ranks")
