"""One description of a model's architecture: what its weights mean, independent of how a run cuts,
trains or stores them.

    arch = ModelArchitecture.from_args(args)                 # a validated run (or the converter's args)
    saved = ModelArchitecture.from_checkpoint_args(ckpt_ns)  # the args a checkpoint stored
    saved.differences(arch)                                  # [(field, saved value, this value)]
    theirs.differences(arch, names=...)                      # the same over other fields (--load-hf)
    arch.num_floating_point_operations(batch_size)           # the FLOPs of the log line

It is frozen, and its values are the effective ones: the key/value groups are one per head without
--group-query-attention, the experts' width is --ffn-hidden-size without --moe-ffn-hidden-size, and a
value that shapes nothing in this model is None (the rotary settings without RoPE, the rope scaling
factor without --use-rope-scaling, the MoE settings of a dense model, the QKV bias flag where every
linear layer has a bias, the Mamba settings of a model that is no hybrid), so two descriptions of the
same weights compare equal whatever the unused flags say.

LABELS' fields are what a checkpoint's weights must match (checkpoint fitting compares them). The
other fields say what the same weights compute (rotary base and scaling, norm epsilon, the GeLU
approximation, the router's softmax order) or describe a hybrid model's layers; --load-hf compares
every field an HF config gives (megatron/training/load_hf.py).

`from_args` reads attributes a validated Namespace always has. `from_checkpoint_args` is the one reader
of args saved by another release (Megatron-LM's, ours from before a flag existed): a missing arg is
None there, "unknown", and is not compared.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from megatron.model.transformer_config import moe_layer_numbers

# (field, how an error message names it): the fields that say what a checkpoint's weights mean, in the
# order check_checkpoint_args reports them
LABELS: dict[str, str] = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "ffn_hidden_size": "--ffn-hidden-size",
    "kv_channels": "--kv-channels",
    "max_position_embeddings": "--max-position-embeddings",
    "padded_vocab_size": "padded vocab size (tokenizer vocab and --make-vocab-size-divisible-by)",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "add_bias_linear": "--disable-bias-linear",
    "add_qkv_bias": "--add-qkv-bias",
    "num_query_groups": "key/value groups (--group-query-attention --num-query-groups)",
    "normalization": "--normalization",
    "apply_layernorm_1p": "--apply-layernorm-1p",
    "qk_layernorm": "--qk-layernorm",
    "swiglu": "--swiglu",
    "squared_relu": "--squared-relu",
    "position_embedding_type": "--position-embedding-type",
    "rotary_percent": "--rotary-percent",
    "rotary_interleaved": "--rotary-interleaved",
    "bert_post_layernorm": "--bert-post-layernorm",
    "num_experts": "--num-experts",
    "moe_layer_freq": "--moe-layer-freq",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
}
_ROTARY = ("rotary_percent", "rotary_interleaved", "rotary_base", "use_rope_scaling", "rope_scaling_factor")
_MOE = ("moe_layer_freq", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_topk",
        "moe_router_pre_softmax", "moe_router_score_function", "moe_router_topk_scaling_factor",
        "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias")
_HYBRID = ("hybrid_override_pattern", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")


@dataclass(frozen=True)
class ModelArchitecture:
    """The shape and kind of a transformer's layers (None: unknown, or shapes nothing here)."""

    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    padded_vocab_size: Optional[int] = None
    untie_embeddings_and_output_weights: Optional[bool] = None
    add_bias_linear: Optional[bool] = None
    add_qkv_bias: Optional[bool] = None
    num_query_groups: Optional[int] = None
    normalization: Optional[str] = None
    apply_layernorm_1p: Optional[bool] = None
    qk_layernorm: Optional[bool] = None
    swiglu: Optional[bool] = None
    squared_relu: Optional[bool] = None
    position_embedding_type: Optional[str] = None
    rotary_percent: Optional[float] = None
    rotary_interleaved: Optional[bool] = None
    bert_post_layernorm: Optional[bool] = None
    num_experts: Optional[int] = None
    moe_layer_freq: Any = None  # an int, or a 0/1 list per layer
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_router_topk: Optional[int] = None
    seq_length: Optional[int] = None  # the training sequence (FLOPs); not part of the weights
    # what the weights compute, not in LABELS (see the module docstring)
    rotary_base: Optional[int] = None
    use_rope_scaling: Optional[bool] = None
    rope_scaling_factor: Optional[float] = None
    norm_epsilon: Optional[float] = None
    openai_gelu: Optional[bool] = None
    moe_router_pre_softmax: Optional[bool] = None
    moe_router_score_function: Optional[str] = None
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_num_groups: Optional[int] = None  # group-limited routing (with the group top-k)
    moe_router_group_topk: Optional[int] = None
    moe_router_enable_expert_bias: Optional[bool] = None  # the router holds an expert_bias buffer
    is_hybrid_model: Optional[bool] = None
    hybrid_override_pattern: Optional[str] = None
    mamba_state_dim: Optional[int] = None
    mamba_head_dim: Optional[int] = None
    mamba_num_groups: Optional[int] = None
    mamba_num_heads: Optional[int] = None  # None: 2 x hidden size / head dim

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ModelArchitecture":
        """The architecture validated args describe (every field read as an attribute)."""
        return cls._effective({f.name: getattr(args, f.name) for f in dataclasses.fields(cls)},
                              group_query_attention=args.group_query_attention)

    @classmethod
    def from_checkpoint_args(cls, saved: Any) -> "ModelArchitecture":
        """The architecture of a checkpoint's stored args, whatever release wrote them: an arg the
        writer did not have is None (not compared)."""
        values = {f.name: getattr(saved, f.name, None) for f in dataclasses.fields(cls)}
        return cls._effective(values, group_query_attention=getattr(saved, "group_query_attention", False))

    @classmethod
    def _effective(cls, values: dict, group_query_attention: bool) -> "ModelArchitecture":
        if not group_query_attention:
            values["num_query_groups"] = values["num_attention_heads"]  # Megatron: one group per head
        if values["add_bias_linear"] is not False:
            values["add_qkv_bias"] = None  # the QKV projection has its bias either way
        if values["position_embedding_type"] != "rope":
            values.update(dict.fromkeys(_ROTARY))
        elif not values["use_rope_scaling"]:
            values["rope_scaling_factor"] = None
        if values["num_experts"] is None:
            values.update(dict.fromkeys(_MOE))  # a dense model: the MoE settings shape nothing
        elif values["moe_ffn_hidden_size"] is None:
            values["moe_ffn_hidden_size"] = values["ffn_hidden_size"]  # the experts' default width
        if not values["is_hybrid_model"]:
            values.update(dict.fromkeys(_HYBRID))
        return cls(**values)

    def differences(self, other: "ModelArchitecture", names: Iterable[str] = tuple(LABELS)
                    ) -> list[tuple[str, Any, Any]]:
        """(field, self's value, other's value) for each of `names` (default: the weight-shaping fields,
        LABELS) where both are known and differ, in the order of `names`."""
        return [(name, getattr(self, name), getattr(other, name)) for name in names
                if getattr(self, name) is not None and getattr(other, name) is not None
                and getattr(self, name) != getattr(other, name)]

    @property
    def moe_layers(self) -> list[int]:
        """The 1-based numbers of the MoE layers (none for a dense model)."""
        return [] if self.num_experts is None else moe_layer_numbers(self.moe_layer_freq, self.num_layers)

    def num_floating_point_operations(self, batch_size: int) -> float:
        """Model FLOPs of one training iteration (forward + backward) on batch_size sequences.

        Megatron-LM core_v0.13's count for a dense transformer (training.py, after Narayanan et al.,
        2021): every GEMM costs 2 FLOPs per multiply-add and runs 3 times (forward, data and weight
        gradients); recomputation is not counted. Per sequence of s tokens, L layers, hidden h:

            attention  12 s L h^2 (1 + g/a + s/2h) (d a / h)   Q and output projections, K and V
                                                              (g/a of them), scores and values over
                                                              the causal half of the s x s matrix
            MLP        12 s L h f m                            two h x f GEMMs; m = 3/2 with --swiglu
                                                              (the gate is a third)
            logits      6 s h V                                once, tied or untied output layer

        with a heads, g query groups (= a without --group-query-attention), d = kv channels,
        f = ffn hidden size, V = padded vocab. For a GPT (d a = h, g = a, f = 4h, m = 1) it is
        72 s L h^2 (1 + s/12h + V/12Lh). The paper's full-matrix count (bench/compare_peers.py) has
        s/6h for s/12h: core_v0.13 halved the score terms for causal attention.

        An MoE layer (--num-experts, --moe-layer-freq) counts the experts a token runs, as Megatron
        does: f becomes moe_ffn_hidden_size x topk + moe_shared_expert_intermediate_size (the router's
        small h x E GEMM is left out, as there).
        """
        s, layers, h, heads = self.seq_length, self.num_layers, self.hidden_size, self.num_attention_heads
        gated = 1.5 if self.swiglu else 1.0
        q_ratio = self.kv_channels * heads / h
        attention = 12 * layers * h * h * (1 + self.num_query_groups / heads + s / (2 * h)) * q_ratio
        moe_layers = len(self.moe_layers)
        moe_ffn = 0 if not moe_layers else \
            self.moe_ffn_hidden_size * self.moe_router_topk + (self.moe_shared_expert_intermediate_size or 0)
        mlp = 12 * h * gated * ((layers - moe_layers) * self.ffn_hidden_size + moe_layers * moe_ffn)
        logits = 6 * h * self.padded_vocab_size
        return batch_size * s * (attention + mlp + logits)
