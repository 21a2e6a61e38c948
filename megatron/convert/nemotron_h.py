"""HF NemotronHForCausalLM <-> our hybrid MambaModel (pattern M / * / - / E), registered in huggingface.py.

NemotronH is the HF port of NVIDIA's Nemotron-H, trained with Megatron-LM's hybrid MambaModel; its
layers_block_type list is Megatron's --hybrid-override-pattern (linear_attention M, full_attention *,
mlp -, moe E). Every HF block is x + mixer(norm(x)) with one RMSNorm; ours names that norm after the
layer's kind. H. = backbone.layers.{i}. (the names in the files: released checkpoints and transformers 5's
save_pretrained; the modules' state_dict() says model. for backbone. and holds the experts fused, both
read), L. = decoder.layers.{i}. (ours), e an expert:

    backbone.embeddings.weight              embedding.word_embeddings.weight
    M  H.norm.weight                        L.norm.weight
       H.mixer.{in_proj.weight, conv1d.weight, conv1d.bias, dt_bias, A_log, D, norm.weight, out_proj.weight}
                                            L.mixer.* as is (the rows and channels of mamba2.py's table)
    *  H.norm.weight                        L.input_layernorm.weight
       H.mixer.{q,k,v}_proj.weight          L.self_attention.linear_qkv.weight: per query group its
                                            np/ng q heads, k, v ([ng, np/ng + 2, hn] rows, as Llama's)
       H.mixer.o_proj.weight                L.self_attention.linear_proj.weight
    -  H.norm.weight                        L.pre_mlp_layernorm.weight
       H.mixer.up_proj.weight               L.mlp.linear_fc1.weight     (not gated: relu2 = --squared-relu)
       H.mixer.down_proj.weight             L.mlp.linear_fc2.weight
    E  H.norm.weight                        L.pre_mlp_layernorm.weight
       H.mixer.gate.weight [E, h]           L.mlp.router.weight
       H.mixer.gate.e_score_correction_bias [E] fp32  L.mlp.router.expert_bias (out: zeros when ours was
                                            trained without --moe-router-enable-expert-bias)
       H.mixer.experts.{e}.up_proj.weight   L.mlp.experts.local_experts.{e}.linear_fc1.weight
       H.mixer.experts.{e}.down_proj.weight L.mlp.experts.local_experts.{e}.linear_fc2.weight
           (modules: H.mixer.experts.up_proj [E, ffn, h], down_proj [E, h, ffn])
       H.mixer.shared_experts.{up,down}_proj.weight  L.mlp.shared_experts.linear_fc{1,2}.weight
    backbone.norm_f.weight                  decoder.final_norm.weight
    lm_head.weight                          output_layer.weight (always: HF's lm_head is never tied)

The attention has no positional embedding (ours: --position-embedding-type none), no biases (HF builds
q/k/v/o without them whatever attention_bias says), scale 1/sqrt(head_dim) and GQA. The E block's
router is a sigmoid with top-k, the k weights divided by their sum (norm_topk_prob) and times
routed_scaling_factor: ours with --moe-router-score-function sigmoid (which divides when k > 1) and
--moe-router-topk-scaling-factor, the router in fp32 as HF's; one shared expert of
moe_shared_expert_intermediate_size, added to the routed ones. HF's e_score_correction_bias is
Megatron's aux-loss-free expert bias (added to the scores only to choose the experts): a converted model
always has --moe-router-enable-expert-bias and the bias (HF's router always holds one). n_group /
topk_group are --moe-router-num-groups / --moe-router-group-topk when topk_group < n_group (HF scores a
group by the sum of its top 2 scores, Megatron by its top k / group-topk: they must agree, k = 2 x
topk_group); with topk_group = n_group every group is kept and ours routes without groups.

Refused (one ValueError naming the setting): biases on the Mamba projections (use_bias), a conv without
bias, a Mamba activation other than silu, a time_step_limit other than (0, inf), MLP biases (mlp_bias:
ours would put them on the attention too), an MLP activation other than relu2 (in - and E layers),
multi-token-prediction layers (num_nextn_predict_layers), and in E layers: a latent projection
(moe_latent_size), group-limited routing with num_experts_per_tok other than 2 x topk_group (or
experts not divisible by n_group), and norm_topk_prob off with k > 1 (or on with k = 1). HF ignores sliding_window and residual_in_fp32 (its blocks keep the
residual in the activations' dtype): in an fp32 run the models are the same; accepted, as are the init
settings (time_step_min / max / floor, rescale_prenorm_residual) and n_shared_experts (HF builds one
shared expert of moe_shared_expert_intermediate_size whatever it says). Out of ours:
a pure-Mamba pattern goes to Mamba2ForCausalLM (mamba2.py), any other hybrid pattern here; tied
embeddings, RoPE, LayerNorm, linear biases, a gated or non-squared-ReLU MLP, an E layer without a
shared expert, group-limited routing with k other than 2 x --moe-router-group-topk, and MoE settings HF's
router lacks are refused.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from megatron.convert.hf_rules import WeightRule, _grouped_qkv, _same
from megatron.convert.mamba2 import MIXER_TENSORS
from megatron.model.mamba.hybrid import allocate_layers
from megatron.model.utils import squared_relu

ARCHITECTURE = "NemotronHForCausalLM"
EMBEDDING = "backbone.embeddings.weight"
_SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_FC_PROJ = ((1, "up_proj"), (2, "down_proj"))  # our linear_fc{n} <-> HF's {proj} (an ungated MLP)
# transformers 5's module names -> the file names the rules use
_MODULE_PREFIX = re.compile(r"^model\.(embeddings\.|layers\.|norm_f\.)")
_FUSED = re.compile(r"^(model|backbone)\.(layers\.\d+\.mixer\.experts)\.(up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^backbone\.(layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


def _refuse(condition: bool, what: str, why: str = "") -> None:
    """HF -> ours: a setting our MambaModel cannot compute."""
    if condition:
        raise ValueError(f"{what} cannot be converted to our MambaModel" + (f": {why}" if why else ""))


def _refuse_out(condition: bool, what: str, why: str = "") -> None:
    """Ours -> HF: a setting NemotronHForCausalLM cannot compute."""
    if condition:
        raise ValueError(f"{what} cannot be converted to HF {ARCHITECTURE}" + (f": {why}" if why else ""))


def pattern(c: Any) -> str:
    """The HF config's layer pattern in Megatron's symbols (M * - E)."""
    kinds = list(c.layers_block_type)
    unknown = sorted(set(kinds) - set(_SYMBOLS))
    _refuse(bool(unknown), f"NemotronH with layer types {unknown}")
    return "".join(_SYMBOLS[kind] for kind in kinds)


def nemotron_h_config(c: Any, seq_length: int | None = None) -> tuple[dict, dict]:
    """(TransformerConfig kwargs, MambaModel kwargs) of the HF config."""
    layers = pattern(c)
    _refuse(bool(c.use_bias), "NemotronH with use_bias=True (Megatron's mixer has no in_proj / out_proj bias)")
    _refuse(not c.use_conv_bias, "NemotronH with use_conv_bias=False (Megatron's conv1d has a bias)")
    _refuse(c.mamba_hidden_act != "silu", f"NemotronH with mamba_hidden_act {c.mamba_hidden_act!r} "
            "(the mixer's activation is silu)")
    low, high = (float(v) for v in c.time_step_limit)
    _refuse(low != 0.0 or not math.isinf(high), f"NemotronH with time_step_limit {tuple(c.time_step_limit)} "
            "(a clamp of dt Megatron does not apply)")
    _refuse(bool(c.mlp_bias), "NemotronH with mlp_bias=True (HF's attention has no biases; our "
            "--add-bias-linear would add them to both)")
    _refuse(("-" in layers or "E" in layers) and c.mlp_hidden_act != "relu2",
            f"NemotronH with mlp_hidden_act {c.mlp_hidden_act!r} (ours is --squared-relu, HF's relu2)")
    _refuse(int(c.num_nextn_predict_layers or 0) > 0, f"NemotronH with num_nextn_predict_layers "
            f"{c.num_nextn_predict_layers} (multi-token prediction layers; our MambaModel has none)")
    config = dict(num_layers=len(layers), hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                  num_query_groups=c.num_key_value_heads, kv_channels=c.head_dim, ffn_hidden_size=c.intermediate_size,
                  normalization="RMSNorm", layernorm_epsilon=c.layer_norm_epsilon, add_bias_linear=False,
                  gated_linear_unit=False, activation_func=squared_relu, hidden_dropout=float(c.hidden_dropout),
                  attention_dropout=float(c.attention_dropout), init_method_std=c.initializer_range,
                  mamba_state_dim=c.ssm_state_size, mamba_head_dim=c.mamba_head_dim, mamba_num_groups=c.n_groups,
                  mamba_num_heads=c.mamba_num_heads, mamba_d_conv=c.conv_kernel, mamba_chunk_size=c.chunk_size)
    if "E" in layers:
        config.update(_moe_config(c))
    model = dict(vocab_size=c.vocab_size, max_sequence_length=seq_length or c.max_position_embeddings,
                 share_embeddings_and_output_weights=False, position_embedding_type="none",
                 hybrid_override_pattern=layers)
    return config, model


def _moe_config(c: Any) -> dict:
    """The TransformerConfig MoE fields of the E layers (HF's NemotronHMoE), refusing what ours lacks."""
    topk = int(c.num_experts_per_tok)
    _refuse(c.moe_latent_size is not None, f"NemotronH with moe_latent_size {c.moe_latent_size} (a latent "
            "projection around the experts; our MoE has none)")
    groups, group_topk, experts = int(c.n_group), int(c.topk_group), int(c.n_routed_experts)
    limited = group_topk < groups
    _refuse(limited and experts % groups != 0, f"NemotronH with n_group {groups} not dividing n_routed_experts "
            f"{experts}")
    _refuse(limited and topk != 2 * group_topk, f"NemotronH with n_group {groups}, topk_group {group_topk} and "
            f"num_experts_per_tok {topk} (HF scores a group by its top 2 experts, Megatron's group-limited "
            "routing by its top num_experts_per_tok / topk_group: they agree when num_experts_per_tok = "
            "2 x topk_group)")
    _refuse(bool(c.norm_topk_prob) != (topk > 1), f"NemotronH with norm_topk_prob {c.norm_topk_prob} and "
            f"num_experts_per_tok {topk} (our sigmoid router divides the top-k weights by their sum exactly "
            "when k > 1)")
    scale = float(c.routed_scaling_factor)
    return dict(num_moe_experts=int(c.n_routed_experts), moe_router_topk=topk,
                moe_ffn_hidden_size=int(c.moe_intermediate_size),
                moe_shared_expert_intermediate_size=int(c.moe_shared_expert_intermediate_size),
                moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                moe_router_topk_scaling_factor=None if scale == 1.0 else scale, moe_router_dtype="fp32",
                moe_router_num_groups=groups if limited else None, moe_router_group_topk=group_topk if limited else None,
                moe_router_enable_expert_bias=True)


def nemotron_h_arg_values(c: Any) -> dict:
    """Our args (dest -> value) of the HF config: pretrain_mamba.py's flags of the hybrid model."""
    _refuse(int(c.conv_kernel) != 4, f"NemotronH with conv_kernel {c.conv_kernel}",
            "Megatron's mixer has a fixed kernel of 4")
    config, model = nemotron_h_config(c)
    heads, groups = config["num_attention_heads"], config["num_query_groups"]
    values = dict(num_layers=config["num_layers"], hidden_size=config["hidden_size"], num_attention_heads=heads,
                  kv_channels=config["kv_channels"], ffn_hidden_size=config["ffn_hidden_size"],
                  group_query_attention=groups != heads, num_query_groups=groups,
                  max_position_embeddings=model["max_sequence_length"], position_embedding_type="none",
                  normalization="RMSNorm", norm_epsilon=float(config["layernorm_epsilon"]), swiglu=False,
                  squared_relu=True, untie_embeddings_and_output_weights=True, add_bias_linear=False,
                  hidden_dropout=config["hidden_dropout"], attention_dropout=config["attention_dropout"],
                  init_method_std=float(config["init_method_std"]), is_hybrid_model=True,
                  hybrid_override_pattern=model["hybrid_override_pattern"], mamba_state_dim=config["mamba_state_dim"],
                  mamba_head_dim=config["mamba_head_dim"], mamba_num_groups=config["mamba_num_groups"],
                  mamba_num_heads=config["mamba_num_heads"])
    if "num_moe_experts" in config:
        values.update(num_experts=config["num_moe_experts"], moe_router_topk=config["moe_router_topk"],
                      moe_ffn_hidden_size=config["moe_ffn_hidden_size"],
                      moe_shared_expert_intermediate_size=config["moe_shared_expert_intermediate_size"],
                      moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                      moe_router_topk_scaling_factor=config["moe_router_topk_scaling_factor"],
                      moe_router_dtype="fp32", moe_router_num_groups=config["moe_router_num_groups"],
                      moe_router_group_topk=config["moe_router_group_topk"], moe_router_enable_expert_bias=True)
    return values


def _expert_bias(ours: str, hf: str, experts: int) -> WeightRule:
    """e_score_correction_bias [E] fp32 <-> router.expert_bias; zeros to HF from a model without one."""
    return WeightRule(ours, (hf,), lambda b: b.float(), lambda b: (b.float(),),
                      absent=lambda: (torch.zeros(experts, dtype=torch.float32),))


def nemotron_h_rules(c: Any) -> list[WeightRule]:
    """One rule per tensor of our (TP = 1) MambaModel, in model order (HF file names)."""
    rules = [_same("embedding.word_embeddings.weight", EMBEDDING)]
    for i, symbol in enumerate(pattern(c)):
        hf, ours = f"backbone.layers.{i}.", f"decoder.layers.{i}."
        if symbol == "M":
            rules.append(_same(ours + "norm.weight", hf + "norm.weight"))
            rules.extend(_same(ours + "mixer." + name, hf + "mixer." + name) for name in MIXER_TENSORS)
        elif symbol == "*":
            rules += [_same(ours + "input_layernorm.weight", hf + "norm.weight"),
                      _grouped_qkv(ours + "self_attention.linear_qkv.weight", *(f"{hf}mixer.{p}_proj.weight"
                                                                                for p in "qkv"),
                                   c.num_attention_heads, c.num_key_value_heads, c.head_dim),
                      _same(ours + "self_attention.linear_proj.weight", hf + "mixer.o_proj.weight")]
        elif symbol == "-":
            rules += [_same(ours + "pre_mlp_layernorm.weight", hf + "norm.weight"),
                      _same(ours + "mlp.linear_fc1.weight", hf + "mixer.up_proj.weight"),
                      _same(ours + "mlp.linear_fc2.weight", hf + "mixer.down_proj.weight")]
        else:
            rules += [_same(ours + "pre_mlp_layernorm.weight", hf + "norm.weight"),
                      _same(ours + "mlp.router.weight", hf + "mixer.gate.weight"),
                      _expert_bias(ours + "mlp.router.expert_bias", hf + "mixer.gate.e_score_correction_bias",
                                   int(c.n_routed_experts))]
            for e in range(int(c.n_routed_experts)):
                rules += [_same(f"{ours}mlp.experts.local_experts.{e}.linear_fc{n}.weight",
                                f"{hf}mixer.experts.{e}.{proj}.weight") for n, proj in _FC_PROJ]
            rules += [_same(f"{ours}mlp.shared_experts.linear_fc{n}.weight", f"{hf}mixer.shared_experts.{proj}.weight")
                      for n, proj in _FC_PROJ]
    rules += [_same("decoder.final_norm.weight", "backbone.norm_f.weight"),
              _same("output_layer.weight", "lm_head.weight")]
    return rules


def file_names(hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict under the file names: transformers 5's module names (model.) renamed backbone., its
    fused experts split into per-expert tensors."""
    out = {}
    for name, tensor in hf_state_dict.items():
        fused = _FUSED.match(name)
        if fused is not None:  # [E, ffn, h] or [E, h, ffn]
            out.update({f"backbone.{fused.group(2)}.{e}.{fused.group(3)}.weight": tensor[e]
                        for e in range(tensor.shape[0])})
        else:
            out[_MODULE_PREFIX.sub(r"backbone.\1", name)] = tensor
    return out


def module_names(hf_state_dict: dict[str, torch.Tensor], experts: int) -> dict[str, torch.Tensor]:
    """The inverse of file_names: the names of transformers 5's NemotronHForCausalLM.state_dict()."""
    out, fused = {}, set()
    for name, tensor in hf_state_dict.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[re.sub(r"^backbone\.", "model.", name)] = tensor
        else:
            fused.add((match.group(1), match.group(3)))
    for where, proj in sorted(fused):
        out[f"model.{where}.{proj}"] = torch.stack([hf_state_dict[f"backbone.{where}.{e}.{proj}.weight"]
                                                   for e in range(experts)])
    return out


def file_view(name: str) -> tuple[str, int | None] | None:
    """For a file name the rules use: the module name that holds it in a file written with transformers 5's
    module names, and the expert to take of it (None: the whole tensor); None for other names."""
    match = _PER_EXPERT.match(name)
    if match is not None:
        return f"model.{match.group(1)}.{match.group(3)}", int(match.group(2))
    if name.startswith("backbone."):
        return "model." + name[len("backbone."):], None
    return None


def args_pattern(args: Any) -> str:
    """The layer pattern of a hybrid model's args (the override, or the ratios' allocation)."""
    return allocate_layers(int(args.num_layers), float(getattr(args, "hybrid_attention_ratio", 0.0) or 0.0),
                           float(getattr(args, "hybrid_mlp_ratio", 0.0) or 0.0),
                           getattr(args, "hybrid_override_pattern", None))


def hf_nemotron_h_config_from_args(args: Any, vocab_size: int) -> dict:
    """config.json of the HF NemotronHForCausalLM computing what a hybrid MambaModel of our args does."""
    layers = args_pattern(args)
    _refuse_out(not getattr(args, "untie_embeddings_and_output_weights", False),
            "a hybrid model with tied embeddings", "HF's NemotronHForCausalLM always has its own lm_head: "
            "train with --untie-embeddings-and-output-weights")
    _refuse_out(args.normalization != "RMSNorm" or args.add_bias_linear or getattr(args, "add_qkv_bias", False),
            "a hybrid model with LayerNorm or linear biases", "NemotronH has RMSNorm and no biases")
    _refuse_out(args.position_embedding_type != "none", f"a hybrid model with --position-embedding-type "
            f"{args.position_embedding_type}", "NemotronH's attention has no positional embedding")
    _refuse_out(getattr(args, "qk_layernorm", False) or getattr(args, "apply_layernorm_1p", False)
            or getattr(args, "apply_residual_connection_post_layernorm", False),
            "a hybrid model with --qk-layernorm, --apply-layernorm-1p or --apply-residual-connection-post-layernorm")
    _refuse_out(("-" in layers or "E" in layers) and (args.swiglu or not getattr(args, "squared_relu", False)),
            "a hybrid model whose MLP is not --squared-relu (ungated)", "NemotronH's MLPs are relu2")
    moe = _hf_moe_config(args) if "E" in layers else {}
    hidden, head_dim = int(args.hidden_size), int(args.mamba_head_dim)
    heads = int(args.num_attention_heads)
    groups = int(args.num_query_groups) if getattr(args, "group_query_attention", False) else heads
    config = dict(model_type="nemotron_h", architectures=[ARCHITECTURE], vocab_size=vocab_size, hidden_size=hidden,
                  layers_block_type=[kind for symbol in layers for kind, s in _SYMBOLS.items() if s == symbol],
                  num_attention_heads=heads, num_key_value_heads=groups,
                  head_dim=int(getattr(args, "kv_channels", None) or hidden // heads),
                  max_position_embeddings=int(args.max_position_embeddings), attention_bias=False,
                  attention_dropout=float(args.attention_dropout), hidden_dropout=float(args.hidden_dropout),
                  intermediate_size=int(args.ffn_hidden_size), mlp_hidden_act="relu2", mlp_bias=False,
                  ssm_state_size=int(args.mamba_state_dim), mamba_num_heads=int(args.mamba_num_heads or 2 * hidden
                                                                                 // head_dim),
                  mamba_head_dim=head_dim, n_groups=int(args.mamba_num_groups), conv_kernel=4, chunk_size=128,
                  use_bias=False, use_conv_bias=True, mamba_hidden_act="silu", time_step_limit=[0.0, float("inf")],
                  layer_norm_epsilon=float(args.norm_epsilon), tie_word_embeddings=False,
                  initializer_range=float(args.init_method_std), num_nextn_predict_layers=0)
    return dict(config, **moe)


def _hf_moe_config(args: Any) -> dict:
    """NemotronH's MoE fields of our MoE args (the E layers)."""
    _refuse_out(args.moe_router_score_function != "sigmoid" or args.moe_router_load_balancing_type == "sinkhorn",
            f"a hybrid MoE model routed by {args.moe_router_score_function} "
            f"({args.moe_router_load_balancing_type})", "NemotronH's router is a sigmoid")
    _refuse_out(not getattr(args, "moe_shared_expert_intermediate_size", None),
            "a hybrid MoE model without a shared expert", "NemotronH's MoE always has one")
    _refuse_out(getattr(args, "moe_expert_capacity_factor", None) is not None,
            "a hybrid MoE model with --moe-expert-capacity-factor (dropped tokens)", "NemotronH drops none")
    topk = int(args.moe_router_topk)
    groups, group_topk = getattr(args, "moe_router_num_groups", None), getattr(args, "moe_router_group_topk", None)
    limited = bool(group_topk) and int(group_topk) < int(groups)
    _refuse_out(limited and topk != 2 * int(group_topk), f"a hybrid MoE model with --moe-router-topk {topk} and "
                f"--moe-router-group-topk {group_topk}", "NemotronH scores a group by its top 2 experts, ours by "
                "its top topk / group-topk: they agree when --moe-router-topk is 2 x --moe-router-group-topk")
    return dict(n_routed_experts=int(args.num_experts), num_experts_per_tok=topk,
                moe_intermediate_size=int(args.moe_ffn_hidden_size or args.ffn_hidden_size),
                moe_shared_expert_intermediate_size=int(args.moe_shared_expert_intermediate_size),
                n_shared_experts=1, moe_latent_size=None, n_group=int(groups) if limited else 1,
                topk_group=int(group_topk) if limited else 1, norm_topk_prob=topk > 1,
                routed_scaling_factor=float(args.moe_router_topk_scaling_factor or 1.0))
