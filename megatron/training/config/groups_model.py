"""The model's setting groups: its architecture (ModelConfig), mixture-of-experts layers (MoEConfig),
LoRA adapters (LoRAConfig) and hybrid Mamba layouts (HybridConfig). How a field becomes a flag:
megatron/training/config/fields.py; the table of every group: groups.py."""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from typing import Any

from megatron.training.config.fields import ConfigGroup, setting

# Megatron-core's AttnBackend names (megatron/core/transformer/enums.py).
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
# Megatron's choices plus alibi (Accelerate's Megatron-LM integration); arguments_model refuses
# relative and mrope.
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "alibi", "mrope", "relative", "none")


def moe_freq_type(text: str) -> int | list[int]:
    """--moe-layer-freq: an integer N (an MoE layer every N layers) or a list of 0/1 per layer, written
    as a list expression of integer lists, + and * ("([1]*3+[0])*2"). Parsed, never evaluated as code."""
    def value(node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, (list, int)) and isinstance(right, (list, int)):
                return left * right
        raise ValueError
    try:
        parsed = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a list expression such as "
                                         '"([1]*3+[0]*1)*2"') from None
    if isinstance(parsed, list) and not all(type(v) is int for v in parsed):
        raise argparse.ArgumentTypeError(f"{text!r} must give a flat list of 0/1 values")
    return parsed


@dataclass
class ModelConfig(ConfigGroup, title="network size"):
    """The model's architecture: sizes, attention, positions, normalization, activations (Megatron's
    "network size" flags)."""

    num_layers: int | None = None
    """Number of transformer layers."""
    encoder_num_layers: int | None = None
    """Megatron's other name of --num-layers (give one of the two)."""
    hidden_size: int | None = None
    """Transformer hidden size."""
    ffn_hidden_size: int | None = None
    """Transformer feed-forward hidden size; 4 x hidden-size if not given (with --swiglu: int(4 x
    hidden-size x 2/3 / 64) x 64, as Megatron).
    """
    num_attention_heads: int | None = None
    """Number of attention heads."""
    kv_channels: int | None = None
    """Per-head projection size; hidden-size // num-attention-heads if not given."""
    group_query_attention: bool = False
    """Grouped-query attention: --num-query-groups key/value heads."""
    num_query_groups: int = 1
    """Key/value heads with --group-query-attention (1: multi-query); ignored without it (one per
    attention head), as in Megatron.
    """
    attention_head_type: str | None = setting(None, choices=("multihead", "multiquery"))
    """The older spelling Accelerate's guide uses: multiquery = --group-query-attention
    --num-query-groups 1; multihead = one key/value head per attention head.
    """
    max_position_embeddings: int | None = None
    """Maximum number of position embeddings (size of the learned position table)."""
    position_embedding_type: str = setting("learned_absolute", choices=POSITION_EMBEDDING_TYPES)
    """learned_absolute (a table), rope (rotary), alibi (linear attention biases, as Accelerate's
    Megatron integration), none; relative and mrope are refused.
    """
    use_rotary_position_embeddings: bool = False
    """Legacy alias of --position-embedding-type rope."""
    rotary_base: int = 10000
    """Base of the rotary frequencies."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotate (the rest pass through)."""
    rotary_interleaved: bool = False
    """Rotate adjacent channel pairs (GPT-J style) instead of the two halves."""
    rotary_seq_len_interpolation_factor: int | None = None
    """Divide the rotary positions by this factor (position interpolation)."""
    use_rope_scaling: bool = False
    """Llama-3.1 scaling of the rotary frequencies."""
    rope_scaling_factor: float = 8.0
    """The scaling factor of --use-rope-scaling (Llama-3.1's 8)."""
    add_position_embedding: bool = setting(True, flags=("--no-position-embedding",))
    """Deprecated in Megatron: an error unless with rope; use --position-embedding-type."""
    attention_backend: str = setting("auto", choices=ATTENTION_BACKENDS)
    """Megatron's choice of core attention, mapped onto this framework's: local and unfused = the
    unfused core attention (on CPU with the fused core of --fused-kernels-cpu-impl native), flash
    and fused = the fused-kernel core (--use-flash-attn: flash-attn on CUDA when installed, else
    torch's scaled_dot_product_attention), auto = --use-flash-attn decides.
    """
    normalization: str = setting("LayerNorm", type=None, choices=("LayerNorm", "RMSNorm"))
    """The normalization layers."""
    norm_epsilon: float = setting(1e-05, flags=("--norm-epsilon", "--layernorm-epsilon"))
    """Epsilon of the normalization layers."""
    apply_layernorm_1p: bool = False
    """Norm weights stored zero-centred (the layer multiplies by 1 + weight)."""
    apply_residual_connection_post_layernorm: bool = False
    """Take the residual from after the layernorm (original BERT/GPT-1 style)."""
    bert_post_layernorm: bool = False
    """BERT only (not a Megatron flag): the original BERT's layout, HF BertForPreTraining's: a
    LayerNorm on the embeddings, LayerNorm after each residual add, no final LayerNorm (default:
    Megatron's pre-LN BERT). Kept in the checkpoint's args.
    """
    openai_gelu: bool = False
    """Tanh-approximated GeLU (HF gelu_new), for GPT-2 checkpoints."""
    squared_relu: bool = False
    """MLP activation relu(x)^2 instead of GeLU."""
    swiglu: bool = False
    """Gated MLP: silu(x W_gate) * (x W_up), instead of GeLU."""
    untie_embeddings_and_output_weights: bool = False
    """Separate input embedding and output layer weights."""
    add_bias_linear: bool = setting(True, flags=("--disable-bias-linear",))
    """Disable the bias of the linear layers."""
    add_qkv_bias: bool = False
    """A bias on the QKV projection even with --disable-bias-linear (Qwen2)."""
    qk_layernorm: bool = False
    """Normalize each head's queries and keys (with --normalization's norm)."""
    spec: list[str] | None = setting(None, nargs="*", metavar=("MODULE", "NAME"))
    """The layer spec to build: NAME in the importable module MODULE, a ModuleSpec or a function
    returning one (Megatron's --spec; docs/model.md). Default: the GPT spec the architecture
    flags describe.
    """
    transformer_impl: str = setting("local", type=None, choices=("local", "transformer_engine"))
    """Layer implementation (only local is supported yet)."""

    def rules(self) -> list[str]:
        """The sizes given positive (which ones a run must give is the run's: validate_args); without
        --kv-channels the heads split the hidden size evenly."""
        sizes = self.not_positive(("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
                                   "ffn_hidden_size", "kv_channels", "norm_epsilon"))
        if sizes:
            return sizes
        hidden, heads = self.hidden_size, self.num_attention_heads
        if self.kv_channels is None and hidden is not None and heads is not None and hidden % heads:
            return [f"--hidden-size ({hidden}) must be divisible by --num-attention-heads ({heads}), "
                    "or give --kv-channels"]
        return []


@dataclass
class MoEConfig(ConfigGroup, title="moe"):
    """Mixture-of-experts layers: experts, router, token dispatcher."""

    num_experts: int | None = None
    """Experts per MoE layer (None: a dense model)."""
    expert_model_parallel_size: int = 1
    """Degree of expert parallelism."""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallelism inside each expert (default: --tensor-model-parallel-size)."""
    moe_layer_freq: Any = setting(1, type=moe_freq_type)
    """An MoE layer every N layers, or a 0/1 list per layer such as "([1]*3+[0]*1)*3"."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's ffn hidden size (default: --ffn-hidden-size)."""
    moe_shared_expert_intermediate_size: int | None = None
    """The shared experts' total ffn hidden size (None: no shared expert)."""
    moe_grouped_gemm: bool = False
    """Run a rank's experts as one grouped (or batched) matmul; same parameters and result."""
    moe_router_load_balancing_type: str = setting("aux_loss", choices=("aux_loss", "seq_aux_loss", "sinkhorn", "none"))
    moe_router_dtype: str | None = setting(None, choices=("fp32", "fp64"))
    """The router's logits and scores in this precision."""
    moe_router_score_function: str = setting("softmax", choices=("softmax", "sigmoid"))
    moe_router_topk: int = 2
    """Experts per token (default 2)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (default: over the top-k)."""
    moe_router_topk_scaling_factor: float | None = None
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss coefficient."""
    moe_z_loss_coeff: float | None = None
    """Router z-loss coefficient."""
    moe_per_layer_logging: bool = False
    """Log each MoE layer's balancing losses and tokens per expert."""
    moe_token_dispatcher_type: str = setting("allgather", choices=("allgather", "alltoall", "flex"))
    moe_expert_capacity_factor: float | None = None
    """Each expert takes at most ceil(tokens * topk / experts * factor) of a rank's tokens."""
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = setting("probs", choices=("probs", "position"))
    moe_drop_warning_threshold: float = 0.1
    """Ours: warn when more than this fraction of an MoE layer's routed tokens is dropped in a
    logging interval (an expert with no tokens is always warned about).
    """
    moe_router_num_groups: int | None = None
    """Group-limited routing: the experts split into this many equal groups (with
    --moe-router-group-topk; DeepSeek-V3's node-limited routing)."""
    moe_router_group_topk: int | None = None
    """Group-limited routing: the groups each token may choose its experts from, picked by the sum of
    the top (topk / group-topk) scores of each group."""
    moe_router_enable_expert_bias: bool = False
    """The aux-loss-free expert bias: a per-expert bias added to the scores only to choose the experts,
    updated after each step towards equal token counts (needs --moe-router-score-function sigmoid)."""
    moe_router_bias_update_rate: float = 1e-3
    """Each step the expert bias moves by this rate times sign(mean count - the expert's count)."""

    def rules(self) -> list[str]:
        """With experts (or expert parallelism): the expert-parallel sizes positive, a token dispatcher we
        have. (That the world size divides into them is the run's: validate_args.)"""
        if self.num_experts is None and self.expert_model_parallel_size == 1:
            return []
        sizes = self.not_positive(("expert_model_parallel_size", "expert_tensor_parallel_size"))
        if sizes:
            return sizes
        if self.num_experts is not None and self.moe_token_dispatcher_type == "flex":  # a Megatron choice we lack
            return ["--moe-token-dispatcher-type flex: the DeepEP dispatcher is not supported yet; "
                    "use allgather or alltoall"]
        return []


@dataclass
class LoRAConfig(ConfigGroup, title="lora"):
    """Low-rank adapters (LoRA) on the transformer's linear layers, the base weights frozen (ours;
    Megatron-LM has none: the names are Megatron-Bridge's, the scaling and init PEFT's)."""

    lora_rank: int = 0
    """Rank r of the LoRA adapters (0: no LoRA, every weight trains)."""
    lora_alpha: float = 32.0
    """LoRA alpha: the adapter's output is scaled by alpha / r."""
    lora_dropout: float = 0.0
    """Dropout probability on the adapter's input."""
    lora_target_modules: list[str] = setting(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1",
                                                                         "linear_fc2"],
                                             nargs="+", choices=("linear_qkv", "linear_proj", "linear_fc1",
                                                                 "linear_fc2"))
    """The linear layers of each transformer layer that get an adapter."""

    def rules(self) -> list[str]:
        """A rank >= 0 (0: off); with adapters, alpha > 0, dropout in [0, 1), each target once."""
        if self.lora_rank < 0:
            return [f"--lora-rank must be >= 0 (0: no LoRA), got {self.lora_rank}"]
        if not self.lora_rank:
            return []
        if not self.lora_alpha > 0:  # (NaN too)
            return [f"--lora-alpha must be > 0, got {self.lora_alpha}"]
        dropout = self.not_fraction(("lora_dropout",))
        if dropout:
            return dropout
        targets = self.lora_target_modules
        if not targets or len(set(targets)) != len(targets):
            return [f"--lora-target-modules needs each module once, got {targets}"]
        return []


@dataclass
class HybridConfig(ConfigGroup, title="hybrid models"):
    """Mamba-2 and hybrid Mamba / attention / MLP models (pretrain_mamba.py; docs/model.md)."""

    is_hybrid_model: bool = False
    """The model is a hybrid (Mamba) model: pretrain_mamba.py's MambaModel, and what tools that load a
    checkpoint (conversion, generation) build.
    """
    hybrid_attention_ratio: float = 0.0
    """Ratio of attention layers to total layers, in [0, 1] (spread evenly among the Mamba layers)."""
    hybrid_mlp_ratio: float = 0.0
    """Ratio of MLP layers to total layers, in [0, 1]."""
    hybrid_override_pattern: str | None = None
    """The layer pattern, one symbol per layer: M Mamba, * attention, - MLP, E MoE (with --num-experts)
    (e.g. M-M*M-M-); with a ratio given its layer counts must match the ratio's.
    """
    mamba_state_dim: int = 128
    """State dimension of the Mamba layers."""
    mamba_head_dim: int = 64
    """Head dimension of the Mamba layers."""
    mamba_num_groups: int = 8
    """Number of B/C groups of the Mamba layers."""
    mamba_num_heads: int | None = None
    """Number of heads of the Mamba layers (default: 2 x --hidden-size / --mamba-head-dim)."""
    disable_mamba_mem_eff_path: bool = False
    """Megatron's switch off its fused conv + scan + norm CUDA kernel; the PyTorch scan is the same either way."""

    def is_hybrid(self) -> bool:
        """Whether these settings ask for a hybrid model (any of its flags given)."""
        return bool(self.is_hybrid_model or self.hybrid_override_pattern or self.hybrid_attention_ratio
                    or self.hybrid_mlp_ratio)

    def layer_pattern(self, num_layers: int) -> str | None:
        """The layer pattern of a hybrid model of num_layers layers (--hybrid-override-pattern, or the
        ratios' allocation), None when the model is not one; a pattern or ratio that cannot be is a
        HybridPatternError (a ValueError naming the flag)."""
        if not self.is_hybrid():
            return None
        from megatron.model.mamba.hybrid import allocate_layers

        return allocate_layers(num_layers, self.hybrid_attention_ratio, self.hybrid_mlp_ratio,
                               self.hybrid_override_pattern)
