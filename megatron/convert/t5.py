"""HuggingFace T5ForConditionalGeneration <-> T5Model: config, args and weights (whole tensors, TP = 1).

Notation: np heads, hn = d_kv, h = d_model; E. = encoder.layers.{i}., D. = decoder.layers.{i}. (ours),
HE. = encoder.block.{i}.layer., HD. = decoder.block.{i}.layer. (HF).

    shared.weight                                  embedding.word_embeddings.weight (also the tied LM head)
    HE.0.layer_norm.weight                         E.input_layernorm.weight
    HE.0.SelfAttention.{q,k,v}.weight              E.self_attention.linear_qkv.weight: rows [np, 3, hn]
                                                   (each head's q, k, v together, Megatron's order)
    HE.0.SelfAttention.o.weight                    E.self_attention.linear_proj.weight
    HE.1.layer_norm.weight                         E.pre_mlp_layernorm.weight
    HE.1.DenseReluDense.wi.weight                  E.mlp.linear_fc1.weight
    HE.1.DenseReluDense.{wi_0,wi_1}.weight         E.mlp.linear_fc1.weight = [wi_0 (gate); wi_1 (up)] ("gated-")
    HE.1.DenseReluDense.wo.weight                  E.mlp.linear_fc2.weight
    encoder.final_layer_norm.weight                encoder.final_layernorm.weight
    HD.0.*                                         D.input_layernorm / D.self_attention.* as in the encoder
    HD.1.layer_norm.weight                         D.pre_cross_attn_layernorm.weight
    HD.1.EncDecAttention.q.weight                  D.cross_attention.linear_q.weight
    HD.1.EncDecAttention.{k,v}.weight              D.cross_attention.linear_kv.weight: rows [np, 2, hn]
    HD.1.EncDecAttention.o.weight                  D.cross_attention.linear_proj.weight
    HD.2.*                                         D.pre_mlp_layernorm / D.mlp.* as HE.1.* in the encoder
    decoder.final_layer_norm.weight                decoder.final_layernorm.weight
    (none: HF's LM head has no bias)               lm_head.output_layer.bias: zeros in, must be zero out
    encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight
                                                   encoder_relative_pos_emb.relative_attention_bias.weight
    decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight
                                                   decoder_relative_pos_emb.relative_attention_bias.weight

encoder.embed_tokens.weight, decoder.embed_tokens.weight and lm_head.weight are HF's tied copies of
shared.weight (save_pretrained does not write them): accepted on the way in when equal. The unused
decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight of old checkpoints is ignored.

The function. T5Model computes what HF computes when built with (t5_config, t5_model_kwargs):
RMSNorm (T5LayerNorm has no bias and no mean), no linear biases, kv_channels d_kv, the activation
of feed_forward_proj (relu; gelu_new and its aliases = the tanh GeLU; gelu = the erf GeLU;
"gated-" = a gated linear unit, act(wi_0 x) * wi_1 x, our [gate; up]), attention_scale 1.0 (T5
folds 1/sqrt(d) into its init), relative positions with HF's buckets, the LM head tied to the
embedding, the decoder output times d_model ** -0.5 when scale_decoder_outputs (transformers 5's
name; transformers 4 scaled exactly when tie_word_embeddings), the output bias zero.

These choices travel in our args (Megatron's flags where Megatron has one), so that a checkpoint
builds the same model again (megatron/convert/verify.py and the training scripts call
t5_transformer_config_kwargs / t5_model_kwargs):

    args.model_family                     "T5"
    args.position_embedding_type          "relative" (validate_args refuses it for GPT runs)
    args.relative_attention_num_buckets   Megatron's flags
    args.relative_attention_max_distance
    args.t5_activation                    "relu" | "gelu" (erf) | "openai_gelu" (tanh); absent: our flags'
                                          GeLU (Megatron's T5)
    args.t5_gated_linear_unit             bool (absent: False)
    args.t5_attention_scale               1.0 (absent: None, 1/sqrt(kv_channels))
    args.t5_output_hidden_scale           d_model ** -0.5 or 1.0 (absent: 1.0)

Refused (ValueError, one line): encoder and decoder layer counts that differ (T5Model has one
num_layers), feed_forward_proj activations other than the above, "gated-" with the erf GeLU (HF
cannot express it: its "gated-gelu" is gelu_new), is_decoder / a decoder-only config, and an untied
head: files holding an lm_head.weight that differs from shared.weight (T5 v1.1 / flan-t5 written by
transformers 4; transformers 5 then keeps the two apart), or transformers 4's tie_word_embeddings
False. A T5Model whose output bias is not zero has no HF counterpart (refused by the saver).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from megatron.convert import hf_rules as hf_map
from megatron.training.checkpoint_safety import CheckpointError

ARCHITECTURE = "T5ForConditionalGeneration"
EMBEDDING = "shared.weight"
TIED_COPIES = {name: EMBEDDING for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                                            "lm_head.weight")}
OUTPUT_BIAS = "lm_head.output_layer.bias"
# T5-only args: set after validate_args (which knows GPT's flags), compared by the HF saver.
T5_ARGS = ("position_embedding_type", "relative_attention_num_buckets", "relative_attention_max_distance",
           "t5_activation", "t5_gated_linear_unit", "t5_attention_scale", "t5_output_hidden_scale")
DEFAULT_MAX_POSITIONS = 512  # T5's training length (transformers 4's n_positions); relative positions have no table
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}  # "openai_gelu": TransformerConfig's openai_gelu flag


def _refuse(condition: bool, what: str) -> None:
    if condition:
        raise ValueError(f"T5 with {what} cannot be converted to T5Model")


def scales_decoder_output(c: Any) -> bool:
    """Whether HF multiplies the decoder output by d_model ** -0.5 before the LM head."""
    return bool(getattr(c, "scale_decoder_outputs", c.tie_word_embeddings))


def _activation(c: Any) -> tuple[str, bool]:
    """(our t5_activation name, gated) of an HF T5Config."""
    gated = bool(getattr(c, "is_gated_act", False))
    name = getattr(c, "dense_act_fn", c.feed_forward_proj.split("-")[-1])
    if name in hf_map.TANH_GELUS:
        return "openai_gelu", gated
    _refuse(name not in ACTIVATIONS, f"feed_forward_proj {c.feed_forward_proj!r} (activation {name!r}; "
                                     f"supported: relu, gelu, {', '.join(hf_map.TANH_GELUS)}, gated or not)")
    return name, gated


def t5_config(c: Any, seq_length: int | None = None) -> tuple[dict, dict]:
    """(TransformerConfig kwargs, T5Model kwargs) of an HF T5Config."""
    decoder_layers = getattr(c, "num_decoder_layers", None) or c.num_layers
    _refuse(decoder_layers != c.num_layers, f"num_decoder_layers {decoder_layers} != num_layers {c.num_layers} "
                                           "(T5Model's encoder and decoder have the same num_layers)")
    _refuse(getattr(c, "is_decoder", False), "is_decoder True (T5ForConditionalGeneration is the encoder-decoder)")
    _refuse(not c.tie_word_embeddings, "tie_word_embeddings False (transformers 4's untied lm_head: not supported "
                                       "yet)")
    activation, gated = _activation(c)
    config = dict(num_layers=c.num_layers, hidden_size=c.d_model, num_attention_heads=c.num_heads,
                  kv_channels=c.d_kv, ffn_hidden_size=c.d_ff, normalization="RMSNorm",
                  layernorm_epsilon=c.layer_norm_epsilon, add_bias_linear=False,
                  hidden_dropout=float(c.dropout_rate), attention_dropout=float(c.dropout_rate),
                  **activation_kwargs(activation, gated))
    model = dict(vocab_size=c.vocab_size, max_sequence_length=_max_positions(c),
                 share_embeddings_and_output_weights=True, position_embedding_type="relative",
                 relative_attention_num_buckets=c.relative_attention_num_buckets,
                 relative_attention_max_distance=c.relative_attention_max_distance, attention_scale=1.0,
                 output_hidden_scale=c.d_model ** -0.5 if scales_decoder_output(c) else 1.0)
    return config, model


def _max_positions(c: Any) -> int:
    return int(getattr(c, "n_positions", None) or DEFAULT_MAX_POSITIONS)


def activation_kwargs(activation: str, gated: bool) -> dict:
    """TransformerConfig's activation fields for t5_activation / t5_gated_linear_unit."""
    if activation == "openai_gelu":
        return dict(openai_gelu=True, gated_linear_unit=gated)  # the fused bias-GeLU is this tanh GeLU too
    # The erf GeLU must not take the fused (tanh) bias-GeLU; relu has no fused path.
    return dict(activation_func=ACTIVATIONS[activation], gated_linear_unit=gated, bias_gelu_fusion=False)


def t5_rules(c: Any) -> list[hf_map.WeightRule]:
    """One rule per tensor of our T5Model, in its state-dict order."""
    np_, hn = c.num_heads, c.d_kv
    same = hf_map._same
    _, gated = _activation(c)
    rules = [same("embedding.word_embeddings.weight", EMBEDDING)]
    for stack in ("encoder", "decoder"):
        mlp = 1 if stack == "encoder" else 2  # HF's sublayer index of the MLP
        for i in range(c.num_layers):
            hf, ours = f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."
            attn = hf + "0.SelfAttention."
            rules += [same(ours + "input_layernorm.weight", hf + "0.layer_norm.weight"),
                      hf_map._grouped_qkv(ours + "self_attention.linear_qkv.weight", attn + "q.weight",
                                          attn + "k.weight", attn + "v.weight", np_, np_, hn),
                      same(ours + "self_attention.linear_proj.weight", attn + "o.weight")]
            if stack == "decoder":
                cross = hf + "1.EncDecAttention."
                rules += [same(ours + "pre_cross_attn_layernorm.weight", hf + "1.layer_norm.weight"),
                          same(ours + "cross_attention.linear_q.weight", cross + "q.weight"),
                          _kv(ours + "cross_attention.linear_kv.weight", cross + "k.weight", cross + "v.weight",
                              np_, hn),
                          same(ours + "cross_attention.linear_proj.weight", cross + "o.weight")]
            dense = f"{hf}{mlp}.DenseReluDense."
            rules.append(same(ours + "pre_mlp_layernorm.weight", f"{hf}{mlp}.layer_norm.weight"))
            rules.append(hf_map._gate_up(ours + "mlp.linear_fc1.weight", dense + "wi_0.weight", dense + "wi_1.weight")
                         if gated else same(ours + "mlp.linear_fc1.weight", dense + "wi.weight"))
            rules.append(same(ours + "mlp.linear_fc2.weight", dense + "wo.weight"))
        rules.append(same(f"{stack}.final_layernorm.weight", f"{stack}.final_layer_norm.weight"))
    rules.append(_output_bias(c))
    bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    return rules + [same(f"{stack}_relative_pos_emb.relative_attention_bias.weight", f"{stack}.{bias}")
                    for stack in ("encoder", "decoder")]


def _kv(ours: str, k: str, v: str, np_: int, hn: int) -> hf_map.WeightRule:
    """k, v [np hn, h] <-> linear_kv [np 2 hn, h]: per head its key rows, then its value rows."""

    def to_ours(k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        h = k_.shape[1]
        return torch.stack([k_.reshape(np_, hn, h), v_.reshape(np_, hn, h)], dim=1).reshape(np_ * 2 * hn, h)

    def to_hf(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_, v_ = t.reshape(np_, 2, hn, t.shape[1]).unbind(1)  # [np, hn, h] each
        return k_.reshape(np_ * hn, -1), v_.reshape(np_ * hn, -1)

    return hf_map.WeightRule(ours, (k, v), to_ours, to_hf)


def _output_bias(c: Any) -> hf_map.WeightRule:
    """Our LM head's own bias (Megatron's T5 has one, HF's none): zeros in; only zeros go back out."""
    dtype = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype

    def to_hf(t: torch.Tensor) -> tuple:
        if torch.any(t != 0):
            raise CheckpointError(f"{OUTPUT_BIAS} is not zero (max |b| {t.abs().max().item():.3g}): HF's T5 LM "
                                  "head has no bias, so this model has no T5ForConditionalGeneration counterpart")
        return ()

    return hf_map.WeightRule(OUTPUT_BIAS, (), lambda: torch.zeros(c.vocab_size, dtype=dtype), to_hf)


# check_tied_head's refusal when the files hold an untied head.
UNTIED_HEAD = ("lm_head.weight differs from shared.weight: an untied T5 head (T5 v1.1 / flan-t5 written by "
               "transformers 4) is not supported yet (T5Model would need share_embeddings_and_output_weights False "
               "and the HF saver an lm_head.weight)")


# ----------------------------------------------------------------------------- our args


def t5_arg_values(c: Any) -> dict:
    """Our args (dest -> value) of the T5Model an HF T5Config describes (hf_files.hf_arg_values' T5 part)."""
    config, model = t5_config(c)
    activation, gated = _activation(c)
    values = dict(
        num_layers=config["num_layers"], hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"], ffn_hidden_size=config["ffn_hidden_size"],
        kv_channels=config["kv_channels"], group_query_attention=False, num_query_groups=config["num_attention_heads"],
        max_position_embeddings=model["max_sequence_length"], rotary_base=10000, rotary_percent=1.0,
        rotary_interleaved=False, use_rope_scaling=False, rope_scaling_factor=8.0, normalization="RMSNorm",
        norm_epsilon=float(config["layernorm_epsilon"]), openai_gelu=False, swiglu=False, squared_relu=False,
        apply_layernorm_1p=False, qk_layernorm=False, untie_embeddings_and_output_weights=False,
        add_bias_linear=False, add_qkv_bias=False, hidden_dropout=float(config["hidden_dropout"]),
        attention_dropout=float(config["attention_dropout"]),
        position_embedding_type="relative", relative_attention_num_buckets=model["relative_attention_num_buckets"],
        relative_attention_max_distance=model["relative_attention_max_distance"], t5_activation=activation,
        t5_gated_linear_unit=gated, t5_attention_scale=1.0, t5_output_hidden_scale=model["output_hidden_scale"])
    if activation == "gelu":
        values["bias_gelu_fusion"] = False
    return values


def t5_transformer_config_kwargs(args: Any) -> dict:
    """The TransformerConfig fields a T5 checkpoint's args set beyond core_transformer_config_from_args
    (the activation); {} for a Megatron T5 (GeLU from our flags)."""
    activation = getattr(args, "t5_activation", None)
    if activation is None:
        return {}
    return activation_kwargs(activation, bool(getattr(args, "t5_gated_linear_unit", False)))


def t5_model_kwargs(args: Any) -> dict:
    """T5Model's keywords beyond the config of a T5 checkpoint's args (Megatron's T5 where absent)."""
    return dict(max_sequence_length=int(args.max_position_embeddings),
                position_embedding_type=getattr(args, "position_embedding_type", "learned_absolute"),
                share_embeddings_and_output_weights=not getattr(args, "untie_embeddings_and_output_weights", False),
                relative_attention_num_buckets=int(getattr(args, "relative_attention_num_buckets", 32)),
                relative_attention_max_distance=int(getattr(args, "relative_attention_max_distance", 128)),
                attention_scale=getattr(args, "t5_attention_scale", None),
                output_hidden_scale=float(getattr(args, "t5_output_hidden_scale", 1.0)))


def hf_t5_config_from_args(args: Any, vocab_size: int) -> dict:
    """config.json fields of the T5ForConditionalGeneration computing what a T5Model of these args does."""
    def refuse(condition: bool, what: str) -> None:
        if condition:
            raise ValueError(f"a T5 model with {what} has no T5ForConditionalGeneration counterpart")

    hidden, heads = int(args.hidden_size), int(args.num_attention_heads)
    activation, gated = getattr(args, "t5_activation", None), bool(getattr(args, "t5_gated_linear_unit", False))
    refuse(args.position_embedding_type != "relative", f"--position-embedding-type {args.position_embedding_type}")
    refuse(activation is None, "Megatron's T5 MLP (no t5_activation in its args)")
    refuse(args.normalization != "RMSNorm" or args.add_bias_linear or getattr(args, "swiglu", False)
           or getattr(args, "group_query_attention", False) or getattr(args, "qk_layernorm", False)
           or getattr(args, "apply_layernorm_1p", False)
           or getattr(args, "apply_residual_connection_post_layernorm", False),
           "LayerNorm, linear biases, SwiGLU, GQA or another layer variant")
    refuse(getattr(args, "untie_embeddings_and_output_weights", False), "--untie-embeddings-and-output-weights")
    refuse(getattr(args, "t5_attention_scale", None) != 1.0, "an attention scale other than 1.0")
    scale = float(getattr(args, "t5_output_hidden_scale", 1.0))
    scaled = math.isclose(scale, hidden ** -0.5, rel_tol=1e-12)
    refuse(not scaled and scale != 1.0, f"an output hidden scale {scale} (HF: d_model ** -0.5 or 1)")
    names = {"relu": "relu", "gelu": "gelu", "openai_gelu": "gelu_new"}
    refuse(gated and activation == "gelu", "a gated erf GeLU (HF's gated-gelu is the tanh gelu_new)")
    feed_forward = ("gated-gelu" if activation == "openai_gelu" else f"gated-{names[activation]}") if gated \
        else names[activation]
    return dict(model_type="t5", architectures=[ARCHITECTURE], vocab_size=vocab_size, d_model=hidden,
                d_kv=int(getattr(args, "kv_channels", None) or hidden // heads), d_ff=int(args.ffn_hidden_size),
                num_layers=int(args.num_layers), num_decoder_layers=int(args.num_layers), num_heads=heads,
                relative_attention_num_buckets=int(args.relative_attention_num_buckets),
                relative_attention_max_distance=int(args.relative_attention_max_distance),
                dropout_rate=float(args.hidden_dropout), layer_norm_epsilon=float(args.norm_epsilon),
                feed_forward_proj=feed_forward, tie_word_embeddings=scaled, is_encoder_decoder=True,
                pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
