"""HuggingFace MixtralForCausalLM <-> GPTModel with an MoE MLP in every layer: config and weights
(whole tensors, TP = 1, EP = 1: experts numbered globally 0 .. E-1).

Mixtral is Mistral's decoder (RMSNorm, RoPE, GQA, no biases, untied output) with each MLP a sparse
block of E SwiGLU experts. L. = decoder.layers.{i}. (ours), H. = model.layers.{i}. (HF files), e the
expert:

    H.block_sparse_moe.gate.weight [E, h]              L.mlp.router.weight
    H.block_sparse_moe.experts.{e}.w1.weight [ffn, h]  L.mlp.experts.local_experts.{e}.linear_fc1.weight:
    H.block_sparse_moe.experts.{e}.w3.weight [ffn, h]      rows [w1 (gate); w3 (up)], the dense SwiGLU order
    H.block_sparse_moe.experts.{e}.w2.weight [h, ffn]  L.mlp.experts.local_experts.{e}.linear_fc2.weight
    (attention, norms, embedding, lm_head: the Llama rows of megatron/convert/huggingface.py)

Those are the names of the files (what every released Mixtral holds, and what transformers 5's
save_pretrained still writes by default). transformers 5's modules hold the experts fused:

    H.mlp.gate.weight [E, h]; H.mlp.experts.gate_up_proj [E, 2 ffn, h] (rows [gate; up] per expert);
    H.mlp.experts.down_proj [E, h, ffn]

model.state_dict() and files written with save_original_format=False use these; both are read
(FUSED_VIEWS: one expert's slice of a fused tensor stands for its per-expert tensor), the per-expert
names are written.

The router: HF softmaxes all E logits, takes the top k probabilities and divides them by their sum;
that is a softmax over the top-k logits, Megatron-Core's router with moe_router_pre_softmax False
(top-k of the logits, then softmax). router_aux_loss_coef is the aux-loss coefficient (training only);
router_jitter_noise (training only) has no counterpart and must be 0.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from megatron.convert import hf_rules as hf_map

ARCHITECTURE = "MixtralForCausalLM"
_LEGACY = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(gate\.weight|experts\.(\d+)\.(w1|w2|w3)\.weight)$")
_FUSED = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")


def mixtral_config(c: Any, seq_length: Optional[int] = None) -> Tuple[dict, dict]:
    """(TransformerConfig kwargs, GPTModel kwargs): Mistral's, each MLP an MoE of c.num_local_experts."""
    hf_map._refuse(float(getattr(c, "router_jitter_noise", 0.0) or 0.0) != 0.0,
                   f"Mixtral with router_jitter_noise={c.router_jitter_noise}",
                   "Megatron-Core's router has no input jitter")
    config, model = hf_map._llama_config(c, seq_length)
    config.update(num_moe_experts=int(c.num_local_experts), moe_router_topk=int(c.num_experts_per_tok),
                  moe_ffn_hidden_size=int(c.intermediate_size), moe_router_pre_softmax=False,
                  moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
                  moe_aux_loss_coeff=float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0))
    return config, model


def _expert_fc1(ours: str, w1: str, w3: str) -> hf_map.WeightRule:
    """w1 (gate), w3 (up) [ffn, h] <-> linear_fc1 [2 ffn, h] = [gate; up]."""
    return hf_map.WeightRule(ours, (w1, w3), lambda g, u: torch.cat([g, u]), lambda t: tuple(torch.chunk(t, 2)))


def mixtral_rules(c: Any) -> list:
    """The Llama rules with each layer's dense MLP replaced by its router and experts (model order)."""
    rules = []
    for rule in hf_map._llama_rules(c):
        match = re.match(r"^decoder\.layers\.(\d+)\.mlp\.linear_fc([12])\.weight$", rule.ours)
        if match is None:
            rules.append(rule)
        elif match.group(2) == "1":  # where the dense MLP was: the MoE block
            rules += _moe_rules(int(match.group(1)), int(c.num_local_experts))
    return rules


def _moe_rules(layer: int, experts: int) -> list:
    ours, hf = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.block_sparse_moe."
    rules = [hf_map._same(ours + "router.weight", hf + "gate.weight")]
    for e in range(experts):
        local, theirs = f"{ours}experts.local_experts.{e}.", f"{hf}experts.{e}."
        rules += [_expert_fc1(local + "linear_fc1.weight", theirs + "w1.weight", theirs + "w3.weight"),
                  hf_map._same(local + "linear_fc2.weight", theirs + "w2.weight")]
    return rules


def fused_view(name: str) -> Optional[Tuple[str, Optional[int], Callable[[torch.Tensor], torch.Tensor]]]:
    """For a per-expert file name: (the fused name that holds it, the expert index to read of it or
    None for the whole tensor, what to take of that [2 ffn, h] / [h, ffn] / [E, h] slice); else None."""
    match = _LEGACY.match(name)
    if match is None:
        return None
    prefix, what, expert, which = match.groups()
    if what == "gate.weight":
        return f"{prefix}.mlp.gate.weight", None, lambda t: t
    if which == "w2":
        return f"{prefix}.mlp.experts.down_proj", int(expert), lambda t: t
    half = 0 if which == "w1" else 1
    return f"{prefix}.mlp.experts.gate_up_proj", int(expert), lambda t: torch.chunk(t, 2)[half]


def unfuse(hf_state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A state dict with transformers 5's fused expert tensors under the per-expert file names."""
    out = {}
    for name, tensor in hf_state_dict.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, what = match.groups()
        moe = f"{prefix}.block_sparse_moe."
        if what == "gate.weight":
            out[moe + "gate.weight"] = tensor
        elif what == "experts.down_proj":  # [E, h, ffn]
            out.update({f"{moe}experts.{e}.w2.weight": tensor[e] for e in range(tensor.shape[0])})
        else:  # gate_up_proj [E, 2 ffn, h]
            for e in range(tensor.shape[0]):
                gate, up = torch.chunk(tensor[e], 2)
                out[f"{moe}experts.{e}.w1.weight"], out[f"{moe}experts.{e}.w3.weight"] = gate, up
    return out


def fuse(hf_state_dict: Dict[str, torch.Tensor], experts: int) -> Dict[str, torch.Tensor]:
    """The inverse of unfuse: the names of transformers 5's MixtralForCausalLM.state_dict()."""
    out, layers = {}, set()
    for name, tensor in hf_state_dict.items():
        match = _LEGACY.match(name)
        if match is None:
            out[name] = tensor
        else:
            layers.add(match.group(1))
    for prefix in sorted(layers):
        moe = f"{prefix}.block_sparse_moe."
        out[f"{prefix}.mlp.gate.weight"] = hf_state_dict[moe + "gate.weight"]
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([hf_state_dict[f"{moe}experts.{e}.w1.weight"], hf_state_dict[f"{moe}experts.{e}.w3.weight"]])
             for e in range(experts)])  # [E, 2 ffn, h]
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack(
            [hf_state_dict[f"{moe}experts.{e}.w2.weight"] for e in range(experts)])  # [E, h, ffn]
    return out


def hf_mixtral_config_from_args(args: Any, llama: dict) -> dict:
    """The Mixtral config.json fields of an MoE GPTModel's args, from the Llama fields of its dense part."""
    experts = int(args.num_experts)
    hf_map._refuse(bool(getattr(args, "moe_shared_expert_intermediate_size", None)),
                   "an MoE model with shared experts", "Mixtral has none")
    freq = getattr(args, "moe_layer_freq", 1)
    hf_map._refuse(freq not in (1, None) and not (isinstance(freq, list) and all(f == 1 for f in freq)),
                   f"an MoE model with --moe-layer-freq {freq}", "every Mixtral layer is an MoE layer")
    hf_map._refuse(bool(getattr(args, "moe_router_pre_softmax", False))
                   or getattr(args, "moe_router_score_function", "softmax") != "softmax"
                   or getattr(args, "moe_router_topk_scaling_factor", None) not in (None, 1.0),
                   "an MoE model with --moe-router-pre-softmax, sigmoid scores or a top-k scaling factor",
                   "Mixtral's router is a softmax over the top-k logits")
    hf_map._refuse(bool(args.add_bias_linear) or bool(args.add_qkv_bias), "an MoE model with linear biases")
    ffn = int(getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size)
    config = {k: v for k, v in llama.items() if k not in ("attention_bias", "mlp_bias")}
    config.update(model_type="mixtral", architectures=[ARCHITECTURE], intermediate_size=ffn,
                  num_local_experts=experts, num_experts_per_tok=int(args.moe_router_topk),
                  router_aux_loss_coef=float(getattr(args, "moe_aux_loss_coeff", 0.0) or 0.0),
                  router_jitter_noise=0.0, sliding_window=None)
    return config
