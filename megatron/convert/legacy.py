"""Megatron-LM's own `--ckpt-format torch` checkpoints in our terms, and ours in theirs.

The directory layout is ours (megatron/training/checkpointing.py); what differs is inside each file, and
megatron_format's reader and writer take that difference as a `Dialect`:

    dialect  model entry of one (TP, PP) file                              fused QKV rows of a TP shard
    legacy   nested: language_model.{embedding.{word,position}_embeddings,  version 0:   [3, np, hn]
             encoder | transformer (before 2021): layers.{i}.*, final norm, version 1.0: [np, hn, 3]
             output_layer (untied)}; word_embeddings_for_head (the last     version >= 2: [np, 3, hn] (GQA,
             stage's copy of tied embeddings at PP > 1)                                  3.0 only: per group
                                                                                         [np/ng q, k, v])
    core     flat megatron-core names: the local spec's are ours; the      [ng, np/ng + 2, hn] (3.0)
             Transformer Engine spec fuses the norms into the next linear
             (linear_qkv.layer_norm_*, mlp.linear_fc1.layer_norm_*) and
             adds `_extra_state` entries (FP8 metadata, or empty)

BERT (--model-type BERT: the loaders pass the family to the dialect) has the same layers under
encoder.layers.* (classic language_model.encoder.layers.*) and these heads:

    classic (Megatron-LM's legacy BertModel)                   ours = megatron-core's BertModel
    language_model.embedding.tokentype_embeddings.weight       embedding.tokentype_embeddings.weight
    language_model.encoder.final_layernorm | final_norm        encoder.final_layernorm
    language_model.pooler.dense                                pooler.dense
    lm_head.dense                                              lm_head.dense
    lm_head.layernorm | lm_head.norm (core_v0.5+)              lm_head.layer_norm
    lm_head.bias                                               output_layer.bias
    binary_head                                                binary_head
    word_embeddings_for_head.weight                            output_layer.weight (the last stage's copy)

T5 (--model-type T5; checkpoint_version 2.0 / 3.0, one layer count for both stacks, learned
positions): megatron-core's T5Model names are ours, less two aliases it saves twice (CORE_ALIASES);
Megatron-LM's legacy T5Model has language_model.{encoder, decoder}.layers.{i}.* (a decoder layer:
post_attention_norm -> pre_cross_attn_layernorm, inter_attention.{query, key_value, dense} ->
cross_attention.linear_{q, kv, proj}, post_inter_attention_norm -> pre_mlp_layernorm),
{encoder, decoder}.final_norm and lm_head.bias -> lm_head.output_layer.bias.

(np heads and ng groups of the shard: np/tp and ng/tp.) Layers are numbered per stage (and per
virtual chunk) in both, as in ours. A classic layer is

    classic (v1.0 / 23.x / core_v0.4+)                         ours (megatron-core local spec)
    input_layernorm | input_norm                               input_layernorm
    attention | self_attention .query_key_value                self_attention.linear_qkv
    attention | self_attention .dense                          self_attention.linear_proj
    post_attention_layernorm | post_attention_norm             pre_mlp_layernorm
    mlp.dense_h_to_4h (with --swiglu [gate_r ; up_r] per shard) mlp.linear_fc1
    mlp.dense_4h_to_h                                          mlp.linear_fc2
    final_layernorm | final_norm                               decoder.final_layernorm

Megatron-LM's args are its argparse Namespace (read through checkpoint_safety's placeholders);
`megatron_lm_args` turns them into ours by running our own flag validation on the model's shape,
with the older names (model_parallel_size, layernorm_epsilon, disable_bias_linear,
use_rotary_position_embeddings) and Megatron's defaults filled in explicitly; what cannot be
inferred, or what we cannot convert (MLA, uneven pipeline splits, MoE features our MoE layer lacks...),
is one CheckpointError.

MoE: megatron-core's three expert implementations are read (core_expert_tensors: SequentialMLP's names
are ours, TEGroupedMLP's weight{i} and GroupedMLP's weight1 / weight2 become them) and the TE spec's MoE
layers keep their own pre_mlp_layernorm; Megatron-LM's legacy SwitchMLP (classic names) is read as
top-1 sinkhorn routing (switch_mlp_args). Which file holds which expert shard: megatron_format._stage_models.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from typing import Any, Callable, Dict, List, Optional

import torch

from megatron.training.checkpoint_safety import CheckpointError
from megatron.convert.layout_rules import expert_key, head_dim, query_groups
from megatron.convert.megatron_format import EMBEDDING, Dialect, Source, model_entry

POSITIONS = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"

# ----------------------------------------------------------------------------- args

# Megatron-LM args that describe something these converters cannot represent (truthy -> refused).
_UNSUPPORTED = ("multi_latent_attention", "mtp_num_layers", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers",
                "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                "pipeline_model_parallel_layout", "heterogeneous_layers_config_path",
                "heterogeneous_layers_config_encoded_json", "retro_add_retriever", "spec")
_BOOLEANS = (  # Megatron-LM's fields (default False when absent), our flags' dests too
    "swiglu", "squared_relu", "openai_gelu", "untie_embeddings_and_output_weights", "add_qkv_bias",
    "qk_layernorm", "apply_layernorm_1p", "rotary_interleaved", "apply_residual_connection_post_layernorm",
    "fp32_residual_connection", "use_rope_scaling",
)
# MoE fields of Megatron-LM our MoE layer does not have (truthy -> refused, with what it is)
_MOE_UNSUPPORTED = {
    "moe_shared_expert_gate": "the shared experts' gate (mlp.shared_experts.gate_weight)",
    "moe_extended_tp": "--moe-extended-tp (experts split over TP x EP)",
    "moe_router_topk_limited_devices": "the deprecated device-limited routing (--moe-router-num-groups now)",
    "moe_apply_probs_on_input": "expert inputs weighted by the router (--moe-apply-probs-on-input)",
    "moe_latent_size": "a latent MoE projection",
    "moe_router_force_load_balancing": "random routing for benchmarks",
    "moe_use_upcycling": "upcycling (the checkpoint is then a dense one)",
}
# Megatron-LM's MoE values taken as they are (absent: our default, which is Megatron's)
_MOE_VALUES = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
               "moe_router_score_function", "moe_router_topk_scaling_factor", "moe_router_dtype", "moe_z_loss_coeff",
               "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_router_num_groups", "moe_router_group_topk",
               "moe_router_bias_update_rate")
_MOE_BOOLEANS = ("moe_router_pre_softmax", "moe_grouped_gemm", "moe_pad_expert_input_to_capacity",
                 "moe_router_enable_expert_bias")
# Megatron-LM's fields that are True by default (absent: True); our flags turn each off (--no-bias-gelu-fusion)
_DEFAULT_TRUE = ("bias_gelu_fusion",)
# copied as they are after validation (tokenizer, counters); absent ones keep our defaults
_CARRIED = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size", "vocab_extra_ids",
            "consumed_train_samples", "consumed_valid_samples", "skipped_train_samples", "fp16", "bf16",
            "params_dtype", "iteration")


def _get(raw: argparse.Namespace, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(raw, name, None)
        if value is not None:
            return value
    return default


def _required(raw: argparse.Namespace, path: str, *names: str) -> Any:
    value = _get(raw, *names)
    if value is None:
        raise CheckpointError(f"{path}: the saved args have no {' / '.join(names)}, which the converter "
                              "cannot infer from the weights")
    return value


def position_embedding_type(raw: argparse.Namespace, path: str) -> str:
    """Megatron-LM's positions: position_embedding_type, else (before 2023) the rotary flag."""
    if getattr(raw, "position_embedding_type", None) is not None:
        return str(raw.position_embedding_type)
    rotary = bool(getattr(raw, "use_rotary_position_embeddings", False))
    learned = getattr(raw, "add_position_embedding", True) is not False
    if rotary and learned:
        raise CheckpointError(f"{path}: learned position embeddings together with rotary ones "
                              "(--use-rotary-position-embeddings without --no-position-embedding) "
                              "are not supported")
    return "rope" if rotary else "learned_absolute" if learned else "none"


def megatron_lm_args(raw: argparse.Namespace, path: str, family: str = "GPT") -> argparse.Namespace:
    """Our validated args of a Megatron-LM checkpoint's args (see the module docstring); family
    "BERT" also carries bert_binary_head (pretrain_bert.py's num_tokentypes 2 with it, else 0)."""
    if not isinstance(raw, argparse.Namespace):
        raise CheckpointError(f"{path}: the saved args are a {type(raw).__name__}, not an argparse Namespace")
    for name in _UNSUPPORTED:
        if getattr(raw, name, None):
            raise CheckpointError(f"{path}: the checkpoint uses {name}={getattr(raw, name)!r}, "
                                  "which the converter does not support")
    if getattr(raw, "num_experts", None):
        for name, what in _MOE_UNSUPPORTED.items():
            if getattr(raw, name, None):
                raise CheckpointError(f"{path}: the MoE checkpoint uses {name}={getattr(raw, name)!r} ({what}), "
                                      "which our MoE layer does not have")
    hidden = int(_required(raw, path, "hidden_size"))
    heads = int(_required(raw, path, "num_attention_heads"))
    swiglu = bool(getattr(raw, "swiglu", False))
    ffn = _get(raw, "ffn_hidden_size")
    if ffn is None and swiglu:
        raise CheckpointError(f"{path}: the saved args have no ffn_hidden_size (needed with --swiglu)")
    positions = int(_required(raw, path, "max_position_embeddings"))
    values = dict(num_layers=int(_required(raw, path, "num_layers", "encoder_num_layers")),
                  hidden_size=hidden, num_attention_heads=heads,
                  ffn_hidden_size=int(ffn) if ffn is not None else 4 * hidden,  # Megatron's default 4h
                  kv_channels=int(_get(raw, "kv_channels", default=hidden // heads)),
                  max_position_embeddings=positions,
                  seq_length=min(int(_get(raw, "seq_length", default=positions)), positions),
                  position_embedding_type=position_embedding_type(raw, path),
                  normalization=_get(raw, "normalization", default="LayerNorm"),
                  norm_epsilon=float(_get(raw, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
                  rotary_base=_get(raw, "rotary_base", default=10000),
                  rotary_percent=float(_get(raw, "rotary_percent", default=1.0)),
                  rope_scaling_factor=float(_get(raw, "rope_scaling_factor", default=8.0)))
    if getattr(raw, "rotary_seq_len_interpolation_factor", None) is not None:
        values["rotary_seq_len_interpolation_factor"] = raw.rotary_seq_len_interpolation_factor
    if getattr(raw, "group_query_attention", False):
        values.update(group_query_attention=True, num_query_groups=_required(raw, path, "num_query_groups"))
    values.update({name: True for name in _BOOLEANS if getattr(raw, name, False)})
    # bias_gelu_fusion False: the MLP's GeLU is then the erf one, not the fused tanh form
    values.update({name: False for name in _DEFAULT_TRUE if getattr(raw, name, True) is False})
    # add_bias_linear since 2023; before, biases were always on; foundation models say disable_bias_linear
    bias = getattr(raw, "add_bias_linear", None)
    if bias is None:
        bias = not getattr(raw, "disable_bias_linear", False)
    values["add_bias_linear"] = bool(bias)
    if getattr(raw, "num_experts", None):
        values.update(_moe_values(raw, path))
    values.update(_hybrid_values(raw, path))
    args = _validated(values, path)

    # before version 3.0 (Megatron-LM v2.0) tensor parallelism was called model_parallel_size
    args.tensor_model_parallel_size = int(_get(raw, "tensor_model_parallel_size", "model_parallel_size", default=1))
    args.pipeline_model_parallel_size = int(_get(raw, "pipeline_model_parallel_size", default=1))
    args.virtual_pipeline_model_parallel_size = _virtual_stages(raw, args, path)
    args.num_layers_per_virtual_pipeline_stage = (
        None if args.virtual_pipeline_model_parallel_size is None
        else args.num_layers // (args.pipeline_model_parallel_size * args.virtual_pipeline_model_parallel_size))
    args.padded_vocab_size = int(_required(raw, path, "padded_vocab_size"))
    args.make_vocab_size_divisible_by = int(_get(raw, "make_vocab_size_divisible_by", default=128))
    args.data_parallel_size = int(_get(raw, "data_parallel_size", default=1))
    args.sequence_parallel = bool(getattr(raw, "sequence_parallel", False)) and args.tensor_model_parallel_size > 1
    args.world_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.data_parallel_size
    if args.num_experts:
        _expert_sizes(raw, args, path)
    args.tokenizer_type = args.vocab_size = None  # the placeholders `fixed` gave the validation
    for name in _CARRIED:
        if getattr(raw, name, None) is not None:
            setattr(args, name, getattr(raw, name))
    if not isinstance(args.params_dtype, torch.dtype):
        args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    if family == "T5":
        _t5_args(raw, args, path)
    if family == "BERT":
        args.model_family = "BERT"  # what verify and pretrain_bert.py build
        if getattr(raw, "bert_post_layernorm", False):
            raise CheckpointError(f"{path}: a post-LN Megatron-LM BERT is not one BertModel computes")
        args.bert_binary_head = getattr(raw, "bert_binary_head", True) is not False
    return args


def _single(raw: argparse.Namespace, name: str, path: str) -> Any:
    """A field newer Megatron-LM may save as a list (one value per load-balancing type): one value."""
    value = getattr(raw, name, None)
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise CheckpointError(f"{path}: the checkpoint has {name}={list(value)!r}; our router has one "
                                  "load-balancing type")
        value = value[0]
    return value


def _moe_values(raw: argparse.Namespace, path: str) -> Dict[str, Any]:
    """Our MoE settings of Megatron-LM's MoE args (--num-experts and the router's, the layer pattern,
    the expert sizes); the token dispatcher is not carried (it does not change the model: ours is
    allgather unless the checkpoint says alltoall)."""
    from megatron.training.config.groups import moe_freq_type

    values: Dict[str, Any] = {"num_experts": int(raw.num_experts)}
    freq = getattr(raw, "moe_layer_freq", None)
    if freq is not None:  # an int, a 0/1 list, or a pattern string as the flag takes it
        values["moe_layer_freq"] = moe_freq_type(freq) if isinstance(freq, str) else \
            list(freq) if isinstance(freq, (list, tuple)) else int(freq)
    values.update({name: getattr(raw, name) for name in _MOE_VALUES if getattr(raw, name, None) is not None})
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = _single(raw, name, path)
        if value is not None:
            values[name] = value
    values.update({name: True for name in _MOE_BOOLEANS if getattr(raw, name, False)})
    if getattr(raw, "moe_token_dispatcher_type", None) == "alltoall":
        values["moe_token_dispatcher_type"] = "alltoall"
    return values


def _expert_sizes(raw: argparse.Namespace, args: argparse.Namespace, path: str) -> None:
    """EP and ETP of the files (ETP absent: the TP size, Megatron's default); the classic per-rank
    files hold experts split over an ETP that divides the TP size (megatron/convert/expert_files.py)."""
    tp = args.tensor_model_parallel_size
    args.expert_model_parallel_size = int(_get(raw, "expert_model_parallel_size", default=1))
    args.expert_tensor_parallel_size = int(_get(raw, "expert_tensor_parallel_size", default=tp))
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if args.num_experts % ep:
        raise CheckpointError(f"{path}: {args.num_experts} experts do not split over expert_model_parallel_size {ep}")
    if tp % etp:
        raise CheckpointError(f"{path}: expert_tensor_parallel_size {etp} does not divide tensor_model_parallel_size "
                              f"{tp}, so which file holds which expert shard is not known; the converter reads "
                              "classic MoE files only where it does")


def _t5_args(raw: argparse.Namespace, args: argparse.Namespace, path: str) -> None:
    """Megatron-LM's T5 (pretrain_t5.py, megatron-core T5Model): one layer count for both stacks here,
    learned positions (our T5's other kind is HF's relative buckets), the GeLU MLP of our flags."""
    encoder = int(_get(raw, "encoder_num_layers", "num_layers", default=args.num_layers))
    decoder = int(_get(raw, "decoder_num_layers", default=encoder))
    if encoder != decoder:
        raise CheckpointError(f"{path}: a T5 with {encoder} encoder and {decoder} decoder layers; our T5Model "
                              "has one layer count for both")
    if args.position_embedding_type != "learned_absolute":
        raise CheckpointError(f"{path}: a Megatron-LM T5 with {args.position_embedding_type} positions; only "
                              "learned_absolute (Megatron's T5) converts")
    args.model_family = "T5"
    if getattr(raw, "decoder_seq_length", None) is not None:
        args.decoder_seq_length = int(raw.decoder_seq_length)


def _virtual_stages(raw: argparse.Namespace, args: argparse.Namespace, path: str) -> Optional[int]:
    vp = _get(raw, "virtual_pipeline_model_parallel_size")
    per_stage = _get(raw, "num_layers_per_virtual_pipeline_stage")
    if vp is None and per_stage is not None:
        vp = args.num_layers // (args.pipeline_model_parallel_size * int(per_stage))
    if vp is None or int(vp) <= 1:
        return None
    if args.num_layers % (args.pipeline_model_parallel_size * int(vp)):
        raise CheckpointError(f"{path}: {args.num_layers} layers do not split into "
                              f"{args.pipeline_model_parallel_size} x {vp} virtual stages")
    return int(vp)


def _hybrid_values(raw: argparse.Namespace, path: str) -> Dict[str, Any]:
    """A Mamba / hybrid model's settings (pretrain_mamba.py's MambaModel): the pattern (Megatron's newer
    hybrid_layer_pattern, or hybrid_override_pattern, or the ratios) and the Mamba sizes."""
    pattern = _get(raw, "hybrid_layer_pattern", "hybrid_override_pattern")
    ratios = [float(_get(raw, "hybrid_attention_ratio", default=0.0)), float(_get(raw, "hybrid_mlp_ratio", default=0.0))]
    if not (getattr(raw, "is_hybrid_model", False) or pattern or any(ratios)):
        return {}
    if pattern is not None and any(symbol in pattern for symbol in "|/"):
        raise CheckpointError(f"{path}: the hybrid pattern {pattern!r} has pipeline ('|') or MTP ('/') sections, "
                              "which the converter does not support")
    values: Dict[str, Any] = dict(is_hybrid_model=True, hybrid_attention_ratio=ratios[0], hybrid_mlp_ratio=ratios[1])
    if pattern is not None:
        values["hybrid_override_pattern"] = str(pattern)
    for name, default in (("mamba_state_dim", 128), ("mamba_head_dim", 64), ("mamba_num_groups", 8)):
        values[name] = int(_get(raw, name, default=default))
    if _get(raw, "mamba_num_heads") is not None:
        values["mamba_num_heads"] = int(raw.mamba_num_heads)
    return values


def _validated(values: Dict[str, Any], path: str) -> argparse.Namespace:
    """Our full Namespace of these model settings (the parser's defaults for the rest), checked as the
    flags would check them and validated as pretrain_gpt.py validates them."""
    from megatron.training.arguments import ArgsError, args_from_config, validate_args
    from megatron.training.config import ConfigError, MegatronConfig

    fixed = dict(micro_batch_size=1, train_iters=1, lr=1e-4, mock_data=True,
                 tokenizer_type="NullTokenizer", vocab_size=1)  # replaced by the checkpoint's
    printed = io.StringIO()
    try:
        args = args_from_config(MegatronConfig.from_values({**values, **fixed}, where=""))
        with contextlib.redirect_stdout(printed):  # not the argument block; its warnings are passed on
            validate_args(args)
    except ArgsError as error:
        raise CheckpointError(f"{path}: the saved args describe a model this framework cannot build ({error})") \
            from None
    except ConfigError as error:  # a value our flags do not take (e.g. an unknown normalization)
        raise CheckpointError(f"{path}: the saved args hold a value our flags do not accept ({error})") from None
    finally:
        for line in printed.getvalue().splitlines():
            if line.startswith("WARNING"):
                print(line, flush=True)
    return args


# ----------------------------------------------------------------------------- classic (legacy) names

_CLASSIC_PARTS = (  # (classic prefix inside a layer, ours); older names second
    ("input_layernorm.", "input_layernorm."), ("input_norm.", "input_layernorm."),
    ("self_attention.query_key_value.", "self_attention.linear_qkv."),
    ("attention.query_key_value.", "self_attention.linear_qkv."),
    ("self_attention.dense.", "self_attention.linear_proj."), ("attention.dense.", "self_attention.linear_proj."),
    ("post_attention_layernorm.", "pre_mlp_layernorm."), ("post_attention_norm.", "pre_mlp_layernorm."),
    ("mlp.dense_h_to_4h.", "mlp.linear_fc1."), ("mlp.dense_4h_to_h.", "mlp.linear_fc2."),
)
_CLASSIC_EXPERT = re.compile(r"^mlp\.local_experts\.(\d+)\.dense_(h_to_4h|4h_to_h)\.(weight|bias)$")
_CLASSIC_LAYER = re.compile(r"^language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(.+)$")
_CLASSIC_FINAL = re.compile(r"^language_model\.(?:encoder|transformer)\.final_(?:layer)?norm\.(weight|bias)$")
_CLASSIC_TOP = {
    "language_model.embedding.word_embeddings.weight": EMBEDDING,
    "language_model.word_embeddings.weight": EMBEDDING,  # before the embedding had its own entry
    "language_model.embedding.position_embeddings.weight": POSITIONS,
    "language_model.position_embeddings.weight": POSITIONS,
    "language_model.output_layer.weight": OUTPUT,
    "word_embeddings_for_head.weight": OUTPUT,  # the last stage's copy of tied embeddings
}


def flatten(entry: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Classic nested state dicts as dotted keys (a flat one stays as it is)."""
    flat: Dict[str, Any] = {}
    for key, value in entry.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


_CLASSIC_BERT_TOP = {  # the heads of Megatron-LM's legacy BertModel (bert_model.py, language_model.py)
    "language_model.embedding.tokentype_embeddings.weight": "embedding.tokentype_embeddings.weight",
    "language_model.pooler.dense.weight": "pooler.dense.weight",
    "language_model.pooler.dense.bias": "pooler.dense.bias",
    "lm_head.dense.weight": "lm_head.dense.weight", "lm_head.dense.bias": "lm_head.dense.bias",
    "lm_head.layernorm.weight": "lm_head.layer_norm.weight", "lm_head.layernorm.bias": "lm_head.layer_norm.bias",
    "lm_head.norm.weight": "lm_head.layer_norm.weight", "lm_head.norm.bias": "lm_head.layer_norm.bias",
    "lm_head.bias": "output_layer.bias",  # the MLM output's own bias [vocab/t]
    "binary_head.weight": "binary_head.weight", "binary_head.bias": "binary_head.bias",
}


# Megatron-LM's legacy T5Model (t5_model.py; its decoder layers' inter_attention in transformer.py)
_CLASSIC_T5_LAYER = re.compile(r"^language_model\.(encoder|decoder)\.layers\.(\d+)\.(.+)$")
_CLASSIC_T5_FINAL = re.compile(r"^language_model\.(encoder|decoder)\.final_(?:layer)?norm\.(weight|bias)$")
_CLASSIC_T5_PARTS = (  # before _CLASSIC_PARTS: in a decoder layer the post-attention norm precedes the cross-attention
    ("post_inter_attention_layernorm.", "pre_mlp_layernorm."), ("post_inter_attention_norm.", "pre_mlp_layernorm."),
    ("inter_attention.query.", "cross_attention.linear_q."),
    ("inter_attention.key_value.", "cross_attention.linear_kv."),  # per head [k hn ; v hn], as ours
    ("inter_attention.dense.", "cross_attention.linear_proj."),
)
_CLASSIC_T5_TOP = {"lm_head.bias": "lm_head.output_layer.bias",
                   "word_embeddings_for_head.weight": "lm_head.output_layer.weight"}


def _classic_t5_name(name: str) -> Optional[str]:
    if name in _CLASSIC_T5_TOP:
        return _CLASSIC_T5_TOP[name]
    match = _CLASSIC_T5_FINAL.match(name)
    if match:
        return f"{match.group(1)}.final_layernorm.{match.group(2)}"
    match = _CLASSIC_T5_LAYER.match(name)
    if match is None:
        return None
    stack, index, rest = match.groups()
    parts = _CLASSIC_T5_PARTS + _CLASSIC_PARTS
    if stack == "decoder":
        parts = (("post_attention_layernorm.", "pre_cross_attn_layernorm."),
                 ("post_attention_norm.", "pre_cross_attn_layernorm.")) + parts
    for old, new in parts:
        if rest.startswith(old):
            return f"{stack}.layers.{index}.{new}{rest[len(old):]}"
    return None


def classic_name(name: str, family: str = "GPT") -> str:
    """Our name of a flattened classic key of `family` (GPT: decoder.*; BERT: encoder.* and its
    heads; T5: encoder.*, decoder.* with the cross-attention, lm_head.output_layer.bias);
    CheckpointError for one that model does not have."""
    if family == "T5" and name not in _CLASSIC_TOP:
        ours = _classic_t5_name(name)
        if ours is None:
            raise CheckpointError(f"model.{name}: a key of Megatron-LM's classic T5 the converter has no name for")
        return ours
    stack = "encoder" if family == "BERT" else "decoder"
    if name in _CLASSIC_TOP:
        return _CLASSIC_TOP[name]
    if family == "BERT" and name in _CLASSIC_BERT_TOP:
        return _CLASSIC_BERT_TOP[name]
    match = _CLASSIC_FINAL.match(name)
    if match:
        return f"{stack}.final_layernorm.{match.group(1)}"
    match = _CLASSIC_LAYER.match(name)
    if match:
        index, rest = match.groups()
        expert = _CLASSIC_EXPERT.match(rest) if family == "GPT" else None
        if expert:  # legacy SwitchMLP's experts (ParallelMLPs) and router (switch_mlp_args)
            j, which, leaf = expert.groups()
            fc = "linear_fc1" if which == "h_to_4h" else "linear_fc2"
            return f"{stack}.layers.{index}.mlp.experts.local_experts.{j}.{fc}.{leaf}"
        if family == "GPT" and rest == "mlp.router.weight":
            return f"{stack}.layers.{index}.mlp.router.weight"
        for old, new in _CLASSIC_PARTS:
            if rest.startswith(old):
                return f"{stack}.layers.{index}.{new}{rest[len(old):]}"
    raise CheckpointError(f"model.{name}: a key of Megatron-LM's classic {family} the converter has no name for")


def qkv_to_current_order(shard: torch.Tensor, version: float, heads: int, hn: int) -> torch.Tensor:
    """One TP shard's fused QKV rows (weight [3 np hn, h] or bias [3 np hn]) from a version-0 or
    -1.0 file's order to [np, 3, hn] (np = this shard's heads)."""
    if shard.shape[0] != 3 * heads * hn:
        raise CheckpointError(f"a fused QKV shard has {shard.shape[0]} rows, not 3 x {heads} heads x {hn}")
    rest = tuple(shard.shape[1:])
    if version == 0:  # [3, np, hn, ...] -> [np, 3, hn, ...]
        ordered = shard.reshape(3, heads, hn, *rest).transpose(0, 1)
    elif version == 1.0:  # [np, hn, 3, ...] -> [np, 3, hn, ...]
        ordered = shard.reshape(heads, hn, 3, *rest).transpose(1, 2)
    else:
        raise CheckpointError(f"checkpoint_version {version}: not a QKV order Megatron-LM wrote (0, 1.0, >= 2.0)")
    return ordered.reshape(shard.shape).contiguous()


def _version(state: Dict[str, Any], path: str) -> float:
    version = state.get("checkpoint_version", 0)  # absent before Megatron-LM v2.0: 0
    if not isinstance(version, (int, float)) or version not in (0, 1.0) and version < 2.0:
        raise CheckpointError(f"{path}: checkpoint_version {version!r} is not one Megatron-LM wrote "
                              "(0, 1.0, 2.0, 3.0)")
    return float(version)


FAMILIES = ("GPT", "BERT", "T5")  # the --model-type values both dialects read


def _family(family: str, supported: tuple = FAMILIES) -> str:
    if family not in supported:
        raise CheckpointError(f"--model-type {family}: Megatron-LM's own {family} checkpoints are not supported "
                              f"by the converter ({', '.join(supported)} are)")
    return family


def _file_family(raw: argparse.Namespace, family: str, supported: tuple = FAMILIES) -> str:
    """The family of a file: Megatron-LM's args do not say it (the loader's --model-type does);
    files our --saver mcore wrote carry model_family (read back by the verification)."""
    saved = getattr(raw, "model_family", None)
    return _family(saved, supported) if isinstance(saved, str) else family


def switch_mlp_args(raw: argparse.Namespace, path: str) -> argparse.Namespace:
    """Megatron-LM's legacy MoE (megatron/legacy/model/transformer.py's SwitchMLP, every layer when
    num_experts is set) in megatron-core's router terms: top-1 with sigmoid weights, chosen by the
    Sinkhorn-balanced logits while training and by the largest weight otherwise, the expert's output
    times its weight; that is megatron-core's (and our) "sinkhorn" load balancing at top-k 1. Its
    experts are ParallelMLPs of ffn_hidden_size, split over TP (ETP = TP); the router has no bias. The
    MoE fields a later Megatron-LM saved with it (moe_router_topk 2 by default...) were not read by
    it and are replaced. With linear biases it is refused: SwitchMLP weights each expert's output bias
    by the router weight, which the converter has not checked against our experts'."""
    bias = getattr(raw, "add_bias_linear", None)
    if bias is None:
        bias = not getattr(raw, "disable_bias_linear", False)
    if bias:
        raise CheckpointError(f"{path}: the checkpoint uses num_experts={raw.num_experts!r}, which the converter does "
                              "not support with linear biases (Megatron-LM's legacy SwitchMLP converts only with "
                              "--disable-bias-linear)")
    out = argparse.Namespace(**vars(raw))
    for name in (*_MOE_UNSUPPORTED, *_MOE_VALUES, *_MOE_BOOLEANS, "moe_layer_freq",
                 "moe_z_loss_coeff", "expert_tensor_parallel_size"):
        setattr(out, name, None)
    out.moe_router_topk, out.moe_router_load_balancing_type, out.moe_aux_loss_coeff = 1, "sinkhorn", 0.0
    out.moe_ffn_hidden_size = getattr(raw, "ffn_hidden_size", None)
    out.moe_token_dispatcher_type = None
    return out


class LegacyDialect(Dialect):
    """Megatron-LM's classic GPT, BERT or T5 (`model.language_model.*`), checkpoint_version 0 to 3
    (T5: 2.0 and 3.0)."""

    def __init__(self, family: str = "GPT") -> None:
        self.family = _family(family, FAMILIES)

    def args(self, state: Dict[str, Any], path: str) -> argparse.Namespace:
        raw = super().args(state, path)
        version = _version(state, path)
        family = _file_family(raw, self.family, FAMILIES)
        if getattr(raw, "num_experts", None):
            raw = switch_mlp_args(raw, path)
        if family == "T5" and version < 2.0:
            raise CheckpointError(f"{path}: a T5 with checkpoint_version {version}: its attention rows are in an "
                                  "older order the converter does not reorder for the cross-attention")
        args = megatron_lm_args(raw, path, family)
        if args.num_experts and family != "GPT":
            raise CheckpointError(f"{path}: an MoE {family}: Megatron-LM's legacy SwitchMLP converts for GPT only")
        if version < 2.0 and query_groups(args) != args.num_attention_heads:
            raise CheckpointError(f"{path}: checkpoint_version {version} with grouped-query attention: "
                                  "Megatron-LM never wrote that (GQA came with version 3.0)")
        return args

    def check_version(self, state: Dict[str, Any], path: str) -> None:
        _version(state, path)

    def model(self, state: Dict[str, Any], key: str, path: str, source: Source) -> Dict[str, Any]:
        entry = model_entry(state, key, path)
        if "language_model" not in entry:
            raise CheckpointError(f"{path}: its model entry has no language_model (keys: "
                                  f"{', '.join(sorted(map(str, entry))[:4])}); for megatron-core names "
                                  "use --loader mcore")
        version = _version(state, path)
        heads = int(source.args.num_attention_heads) // source.tp
        model: Dict[str, Any] = {}
        for classic, value in flatten(entry).items():
            if classic.endswith("_extra_state"):
                check_extra_state(value, f"model.{classic}", path)
                continue
            name = classic_name(classic, self.family)
            if name in model:
                raise CheckpointError(f"{path}: model.{classic} and another key both name {name}")
            if version < 2.0 and ".linear_qkv." in name:
                value = qkv_to_current_order(value, version, heads, head_dim(source.args))
            model[name] = value
        return model


# ----------------------------------------------------------------------------- megatron-core names

# Transformer Engine's spec fuses each layer norm into the linear that follows it
_TE_NORMS = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
             ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
             ("mixer.in_proj.layer_norm_", "norm."))  # a Mamba layer's norm, fused into its in_proj
_LAYER_PART = re.compile(r"^((?:decoder|encoder)\.layers\.\d+\.)(.+)$")  # encoder: BERT's
# modules whose `_extra_state` megatron-core saves: its own linears (None) and, with TE, TE's modules
# (every linear of a layer, the experts' and shared experts' included: megatron-core's own or TE's;
# TE's attention core_attention too; TEGroupedMLP: one per GroupedLinear, experts.linear_fc1 / fc2)
_LINEAR = re.compile(r"^(.*(?:linear_(?:qkv|proj|fc1|fc2|q|kv)|mixer\.(?:in|out)_proj))\.")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")


def check_extra_state(value: Any, name: str, path: str) -> None:
    """Accept an `_extra_state` that carries nothing (None, an empty tensor, Transformer Engine's
    serialized None); refuse one with FP8 scaling data, which the converter cannot place."""
    if value is None or torch.is_tensor(value) and value.numel() == 0:
        return
    if isinstance(value, io.BytesIO):  # Transformer Engine before 1.6: torch.save of the state, None without FP8
        data = value.getvalue()
        if not data:
            return
        try:
            if torch.load(io.BytesIO(data), map_location="cpu", weights_only=True) is None:
                return
        except Exception:  # noqa: BLE001 -- unreadable means it is not the empty state: refused below
            pass
    raise CheckpointError(f"{path}: {name} carries data (Transformer Engine FP8 state?) the converter "
                          "cannot convert; save the checkpoint without FP8 or drop its extra state")


# megatron-core's T5Model holds two modules under a second name as well (position_embeddings for
# finalize_model_grads' position-embedding all-reduce, output_layer = lm_head.output_layer), so its
# state dict has their tensors twice: alias prefix -> the prefix of the one copy we keep
CORE_ALIASES = (("position_embeddings.", "embedding.position_embeddings."),
                ("output_layer.", "lm_head.output_layer."))


def drop_core_aliases(entry: Dict[str, Any], path: str = "") -> Dict[str, Any]:
    """`entry` without megatron-core's second names of one tensor (CORE_ALIASES): a key is an alias
    only when the key it aliases is there too (BERT's and GPT's output_layer.* are their own), and
    the two must hold the same values."""
    out = dict(entry)
    for alias, original in CORE_ALIASES:
        for key in [k for k in entry if k.startswith(alias)]:
            twin = original + key[len(alias):]
            if twin not in entry:
                continue
            if torch.is_tensor(entry[key]) and not torch.equal(entry[key], entry[twin]):
                raise CheckpointError(f"{path}: {key} and {twin} are one tensor in megatron-core's T5Model "
                                      "but hold different values")
            del out[key]
    return out


def core_name(name: str) -> str:
    """Our name of a megatron-core key (the TE spec's fused norm names become the local spec's)."""
    match = _LAYER_PART.match(name)
    if match:
        prefix, rest = match.groups()
        for fused, local in _TE_NORMS:
            if rest.startswith(fused):
                return prefix + local + rest[len(fused):]
    return name


# megatron-core's three expert implementations (E_local = E / EP experts in each EP rank's file,
# F = the expert ffn size / ETP, doubled with SwiGLU: each shard's rows [gate_s ; up_s]):
#   SequentialMLP  experts.local_experts.{i}.linear_fc1 / linear_fc2.*   ours already
#   TEGroupedMLP   experts.linear_fc1.weight{i} / bias{i}, linear_fc2.*   -> local_experts.{i}.linear_fc*.*
#   GroupedMLP     experts.weight1 [h, E_local F]: its memory read as [E_local, h, F] (the forward's
#                  view), expert i's x @ w1[i]; experts.weight2 [E_local F/(2), h] as [E_local, F/(2), h]
#                  -> local_experts.{i}.linear_fc1.weight = w1[i].T, linear_fc2.weight = w2[i].T
_TE_GROUPED = re.compile(r"^(.+\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
_GROUPED = re.compile(r"^(.+\.mlp\.experts\.)weight([12])$")


def core_expert_tensors(name: str, value: Any, args: argparse.Namespace, path: str) -> List[tuple]:
    """(our local name, tensor) pairs of one megatron-core key: an expert tensor of TEGroupedMLP or
    GroupedMLP in SequentialMLP's names (the table above), any other key as it is."""
    match = _TE_GROUPED.match(name)
    if match:
        prefix, module, kind, index = match.groups()
        return [(f"{prefix}local_experts.{index}.{module}.{kind}", value)]
    match = _GROUPED.match(name)
    if match is None:
        return [(name, value)]
    prefix, which = match.groups()
    hidden = int(args.hidden_size)
    local = int(args.num_experts) // int(getattr(args, "expert_model_parallel_size", 1) or 1)
    rows, columns = (hidden, None) if which == "1" else (None, hidden)
    shape = tuple(value.shape) if torch.is_tensor(value) else ()
    if (len(shape) != 2 or (rows is not None and shape[0] != rows) or (columns is not None and shape[1] != columns)
            or shape[1 if which == "1" else 0] % local):
        expected = f"[{hidden}, {local} experts x ffn]" if which == "1" else f"[{local} experts x ffn, {hidden}]"
        raise CheckpointError(f"{path}: {name} has shape {list(shape)}, not GroupedMLP's {expected}")
    if which == "1":  # [h, E_local F] whose memory is [E_local, h, F]
        experts = value.contiguous().view(local, hidden, shape[1] // local).transpose(1, 2)
    else:  # [E_local F, h] = [E_local, F, h]
        experts = value.contiguous().view(local, shape[0] // local, hidden).transpose(1, 2)
    return [(f"{prefix}local_experts.{i}.linear_fc{which}.weight", experts[i].contiguous()) for i in range(local)]


def expert_order(model: Dict[str, Any]) -> Dict[str, Any]:
    """`model` with each run of expert keys in SequentialMLP's order (expert by expert: fc1, then fc2),
    as our state dict has them (GroupedMLP's and TEGroupedMLP's files hold one module's experts together)."""
    out: Dict[str, Any] = {}
    run: List[str] = []

    def flush() -> None:
        position = {key: n for n, key in enumerate(run)}  # weight before bias, as they came
        for key in sorted(run, key=lambda k: (expert_key(k)[1], expert_key(k)[2].split(".")[0], position[k])):
            out[key] = model[key]
        run.clear()

    for key in model:
        if expert_key(key) is not None:
            run.append(key)
            continue
        flush()
        out[key] = model[key]
    flush()
    return out


class CoreDialect(Dialect):
    """Megatron-LM checkpoints in megatron-core naming (TE or local spec); writes `transformer_impl`'s."""

    def __init__(self, transformer_impl: str = "transformer_engine", family: str = "GPT",
                 grouped_gemm: bool = False) -> None:
        if transformer_impl not in ("transformer_engine", "local"):
            raise CheckpointError(f"--saver-transformer-impl {transformer_impl}: one of transformer_engine, local")
        self.transformer_impl = transformer_impl
        self.family = _family(family, FAMILIES)
        self.grouped_gemm = grouped_gemm  # writing TE names: the experts as TEGroupedMLP's

    def args(self, state: Dict[str, Any], path: str) -> argparse.Namespace:
        raw = super().args(state, path)
        return megatron_lm_args(raw, path, _file_family(raw, self.family, FAMILIES))

    def model(self, state: Dict[str, Any], key: str, path: str, source: Source) -> Dict[str, Any]:
        entry = model_entry(state, key, path)
        if "language_model" in entry:
            raise CheckpointError(f"{path} is in Megatron-LM's classic naming (model.language_model.*): "
                                  "use --loader legacy")
        model: Dict[str, Any] = {}
        for key_, value in drop_core_aliases(entry, path).items():
            if key_.endswith("_extra_state"):
                check_extra_state(value, key_, path)
                continue
            for name, tensor in core_expert_tensors(key_, value, source.args, path):
                name = core_name(name)
                if name in model:
                    raise CheckpointError(f"{path}: {key_} and another key both name {name} "
                                          "(TE's fused norm and a separate one?)")
                model[name] = tensor
        return expert_order(model)

    def to_file(self, model: Dict[str, Any], add: Callable[[torch.Tensor], Any]) -> Dict[str, Any]:
        te = self.transformer_impl == "transformer_engine"
        out: Dict[str, Any] = {}
        layers: Dict[str, bool] = {}  # layer prefix -> it has a cross-attention (T5's decoder)
        moe = {m.group(1) for m in map(_LAYER_PART.match, model) if m and m.group(2).startswith("mlp.router.")}
        linears: Dict[str, None] = {}  # the linear modules (in order): each has an `_extra_state`
        for name, tensor in model.items():
            match = _LAYER_PART.match(name)
            if match is not None:
                prefix, rest = match.groups()
                layers[prefix] = layers.get(prefix, False) or rest.startswith("cross_attention.")
                for fused, local in _TE_NORMS if te else ():
                    # TE's MoE layers keep pre_mlp_layernorm as its own TENorm (there is no mlp.linear_fc1)
                    if rest.startswith(local) and not (prefix in moe and local == "pre_mlp_layernorm."):
                        rest = fused + rest[len(local):]
                grouped = _LOCAL_EXPERT.match(rest) if te and self.grouped_gemm else None
                if grouped:  # TEGroupedMLP: one GroupedLinear per fc, weight{i} / bias{i}
                    index, module, kind = grouped.groups()
                    rest = f"mlp.experts.{module}.{kind}{index}"
                linear = _LINEAR.match(rest)
                if linear:
                    linears[prefix + linear.group(1)] = None
                name = prefix + rest
            out[name] = tensor
        empty = (lambda: add(torch.empty(0, dtype=torch.uint8))) if te else (lambda: None)
        # what Transformer Engine writes without FP8; megatron-core's linears: None
        for module in linears:
            out[f"{module}._extra_state"] = empty()
        for prefix, cross in layers.items():
            if te:  # TE's attention modules
                for attention in ("self_attention",) + (("cross_attention",) if cross else ()):
                    out[f"{prefix}{attention}.core_attention._extra_state"] = empty()
        if any(k in model for k in ("decoder.final_layernorm.weight", "decoder.final_norm.weight",
                                    "lm_head.dense.weight")):
            out["output_layer._extra_state"] = None  # the last stage has the output layer (its weight may be tied)
        t5 = any(value for value in layers.values()) or any(k.startswith("lm_head.output_layer.") for k in model)
        if t5:  # megatron-core's T5Model: the aliases its state dict has (CORE_ALIASES), the LM head's extra state
            for alias, original in CORE_ALIASES:
                for name in [k for k in out if k.startswith(original)]:
                    out[alias + name[len(original):]] = out[name]
            if "lm_head.output_layer.bias" in model:
                out["lm_head.output_layer._extra_state"] = None
        return out

    def file_args(self, args: argparse.Namespace) -> argparse.Namespace:
        return megatron_lm_namespace(args, self.transformer_impl)


def megatron_lm_namespace(args: argparse.Namespace, transformer_impl: str) -> argparse.Namespace:
    """Our args as Megatron-LM's own: our flags have Megatron's names already; only plain values are
    kept (a class of ours would not unpickle there), with the fields its loader reads set."""
    plain = (type(None), bool, int, float, str, torch.dtype)

    def is_plain(value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return all(is_plain(v) for v in value)
        if isinstance(value, dict):
            return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
        return isinstance(value, plain)

    out = argparse.Namespace(**{k: v for k, v in vars(args).items() if is_plain(v)})
    out.transformer_impl = transformer_impl
    out.use_legacy_models = False
    out.ckpt_format = "torch"
    out.spec = None
    if getattr(args, "num_experts", None):
        out.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size  # Megatron's validate_args sets it
        out.moe_use_legacy_grouped_gemm = False
        if transformer_impl == "local":  # its SequentialMLP names: the local spec builds GroupedMLP with grouped GEMM
            out.moe_grouped_gemm = False
    return out

