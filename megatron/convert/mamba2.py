"""HF Mamba2ForCausalLM <-> our MambaModel (all-Mamba pattern "M" x L), registered in huggingface.py.

    backbone.embeddings.weight                 embedding.word_embeddings.weight
    backbone.layers.{i}.norm.weight            L.norm.weight
    backbone.layers.{i}.mixer.in_proj.weight   L.mixer.in_proj.weight     as is: rows [z, x, B, C, dt] in both
    backbone.layers.{i}.mixer.conv1d.weight    L.mixer.conv1d.weight      [x, B, C] channels, [ch, 1, k]
    backbone.layers.{i}.mixer.conv1d.bias      L.mixer.conv1d.bias
    backbone.layers.{i}.mixer.{dt_bias,A_log,D}  L.mixer.{dt_bias,A_log,D}
    backbone.layers.{i}.mixer.norm.weight      L.mixer.norm.weight        the gated RMSNorm
    backbone.layers.{i}.mixer.out_proj.weight  L.mixer.out_proj.weight
    backbone.norm_f.weight                     decoder.final_norm.weight
    lm_head.weight                             output_layer.weight (untied only)

Refused: linear biases (use_bias; Megatron's mixer has none), a conv without bias, activations other
than silu, a time_step_limit other than (0, inf) (HF would clamp dt; Megatron does not), and
rescale_prenorm_residual (an init setting HF applies when it initialises, not a model difference: accepted).
HF's residual_in_fp32 keeps the residual stream in fp32: the same model in an fp32 run (in half
precision, --fp32-residual-connection is ours). Of the hybrid HF families, NemotronH (Megatron's hybrid
stack itself) is mapped in nemotron_h.py; Bamba, FalconH1, Zamba2 and GraniteMoeHybrid are not: their
layers differ from Megatron's hybrid stack in norms, attention or MLP details.
"""

from __future__ import annotations

import math
from typing import Any

from megatron.convert.hf_rules import WeightRule, _refuse, _same

ARCHITECTURE = "Mamba2ForCausalLM"
EMBEDDING = "backbone.embeddings.weight"
MIXER_TENSORS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                 "out_proj.weight")


def mamba2_config(c: Any, seq_length: int | None = None) -> tuple[dict, dict]:
    """(TransformerConfig kwargs, MambaModel kwargs) of the HF config."""
    _refuse(bool(c.use_bias), "Mamba2 with use_bias=True (Megatron's mixer has no in_proj / out_proj bias)")
    _refuse(not c.use_conv_bias, "Mamba2 with use_conv_bias=False (Megatron's conv1d has a bias)")
    _refuse(c.hidden_act != "silu", f"Mamba2 with hidden_act {c.hidden_act!r} (the mixer's activation is silu)")
    low, high = (float(v) for v in c.time_step_limit)
    _refuse(low != 0.0 or not math.isinf(high), f"Mamba2 with time_step_limit {tuple(c.time_step_limit)} "
            "(a clamp of dt Megatron does not apply)")
    config = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_heads,
                  kv_channels=c.head_dim, normalization="RMSNorm", layernorm_epsilon=c.layer_norm_epsilon,
                  add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                  init_method_std=c.initializer_range, mamba_state_dim=c.state_size, mamba_head_dim=c.head_dim,
                  mamba_num_groups=c.n_groups, mamba_num_heads=c.num_heads, mamba_d_conv=c.conv_kernel,
                  mamba_chunk_size=c.chunk_size)
    model = dict(vocab_size=c.vocab_size, max_sequence_length=seq_length or 4096,
                 share_embeddings_and_output_weights=bool(c.tie_word_embeddings), position_embedding_type="none",
                 hybrid_override_pattern="M" * c.num_hidden_layers)
    return config, model


def mamba2_arg_values(c: Any) -> dict:
    """Our args (dest -> value) of the HF config: a pure-Mamba hybrid model (pretrain_mamba.py's flags)."""
    _refuse(int(c.conv_kernel) != 4, f"Mamba2 with conv_kernel {c.conv_kernel}",
            "Megatron's mixer has a fixed kernel of 4")
    config, model = mamba2_config(c)
    return dict(num_layers=config["num_layers"], hidden_size=config["hidden_size"],
                num_attention_heads=config["num_attention_heads"], kv_channels=config["kv_channels"],
                ffn_hidden_size=4 * config["hidden_size"], group_query_attention=False,
                num_query_groups=config["num_attention_heads"], max_position_embeddings=model["max_sequence_length"],
                position_embedding_type="none", normalization="RMSNorm",
                norm_epsilon=float(config["layernorm_epsilon"]),
                swiglu=False, untie_embeddings_and_output_weights=not model["share_embeddings_and_output_weights"],
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                init_method_std=float(config["init_method_std"]), is_hybrid_model=True,
                hybrid_override_pattern=model["hybrid_override_pattern"], mamba_state_dim=config["mamba_state_dim"],
                mamba_head_dim=config["mamba_head_dim"], mamba_num_groups=config["mamba_num_groups"],
                mamba_num_heads=config["mamba_num_heads"])


def mamba2_rules(c: Any) -> list[WeightRule]:
    """One rule per tensor of our (TP = 1) MambaModel, in model order."""
    rules = [_same("embedding.word_embeddings.weight", EMBEDDING)]
    for i in range(c.num_hidden_layers):
        rules.append(_same(f"decoder.layers.{i}.norm.weight", f"backbone.layers.{i}.norm.weight"))
        rules.extend(_same(f"decoder.layers.{i}.mixer.{name}", f"backbone.layers.{i}.mixer.{name}")
                     for name in MIXER_TENSORS)
    rules.append(_same("decoder.final_norm.weight", "backbone.norm_f.weight"))
    if not c.tie_word_embeddings:
        rules.append(_same("output_layer.weight", "lm_head.weight"))
    return rules


def hf_mamba2_config_from_args(args: Any, vocab_size: int) -> dict:
    """config.json of the HF Mamba2ForCausalLM computing what a pure-Mamba MambaModel of our args does."""
    pattern = getattr(args, "hybrid_override_pattern", None) or ""
    _refuse(set(pattern) != {"M"}, f"a hybrid model (pattern {pattern})",
            "HF's Mamba2ForCausalLM has Mamba layers only")
    _refuse(args.normalization != "RMSNorm" or args.add_bias_linear, "a Mamba model with LayerNorm or linear biases")
    hidden, head_dim = int(args.hidden_size), int(args.mamba_head_dim)
    heads = int(args.mamba_num_heads or 2 * hidden // head_dim)
    _refuse(heads * head_dim % hidden != 0, f"a Mamba model whose inner size {heads * head_dim} is not a multiple "
            f"of the hidden size {hidden}", "HF's Mamba2 has d_inner = expand x hidden")
    return dict(model_type="mamba2", architectures=[ARCHITECTURE], vocab_size=vocab_size, hidden_size=hidden,
                num_hidden_layers=int(args.num_layers), num_heads=heads, head_dim=head_dim,
                expand=heads * head_dim // hidden, state_size=int(args.mamba_state_dim),
                n_groups=int(args.mamba_num_groups), conv_kernel=4, chunk_size=128,
                layer_norm_epsilon=float(args.norm_epsilon),
                use_bias=False, use_conv_bias=True, hidden_act="silu", residual_in_fp32=True,
                tie_word_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
                initializer_range=float(args.init_method_std), time_step_limit=[0.0, float("inf")])
