"""The pieces every HF <-> Megatron mapping is built from, and the decoder families' mappings.

WeightRule (one tensor of ours from HF tensors, and back), the reshaping rules (GPT-2's fused
QKV, Llama's grouped QKV, SwiGLU's [gate; up]), the config readers of GPT-2, Llama / Mistral /
Qwen2 and GPT-NeoX, and the checks that refuse what our configs cannot express. The tables of
names and the refusals are documented in huggingface.py, which registers these families next to
BERT (bert.py), T5 (t5.py) and Mixtral (mixtral.py); those modules build on this one too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

# Llama 3.1's RoPE constants that Megatron-Core's --use-rope-scaling hard-codes (positions.py);
# only rope_scaling_factor is a setting.
MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TANH_GELUS = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")  # HF's names of the tanh approximation
# HF buffers (not weights) that GPTModel has no counterpart for.
IGNORED_HF_KEYS = re.compile(r"\.(attn|attention)\.(bias|masked_bias)$|rotary_emb\.inv_freq$"
                             r"|^bert\.embeddings\.(position_ids|token_type_ids)$"
                             # old T5 files: a cross-attention position table HF never uses
                             r"|^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$")
# Older HF names -> the names of the installed transformers (5.x renames them on load too).
HF_ALIASES = {"embed_out.weight": "lm_head.weight"}  # GPT-NeoX before transformers 5


@dataclass(frozen=True)
class WeightRule:
    """One tensor of ours and the HF tensors it is made of.

    to_ours(*hf_tensors) -> ours; to_hf(ours) -> the HF tensors, in the order of `hf`.
    The two are exact inverses (reorderings, transposes, concatenations). absent() -> the HF tensors
    when our model lacks the tensor (a feature it was built without, whose HF form is a constant, such
    as NemotronH's zero expert bias); None: ours must have it.
    """

    ours: str
    hf: tuple[str, ...]
    to_ours: Callable[..., Tensor]
    to_hf: Callable[[Tensor], tuple[Tensor, ...]]
    absent: Optional[Callable[[], tuple[Tensor, ...]]] = None


def _same(ours: str, hf: str) -> WeightRule:
    return WeightRule(ours, (hf,), lambda t: t, lambda t: (t,))


def _transposed(ours: str, hf: str) -> WeightRule:
    """HF Conv1D weight [in, out] <-> our [out, in]."""
    return WeightRule(ours, (hf,), lambda t: t.t(), lambda t: (t.t(),))


def _gpt2_qkv(ours: str, hf: str, np_: int, hn: int) -> WeightRule:
    """c_attn (weight [h, 3 h] with columns [3, np, hn], or bias [3 h]) <-> linear_qkv rows [np, 3, hn]."""

    def to_ours(t: Tensor) -> Tensor:
        t = t.t() if t.dim() == 2 else t  # [3 np hn, (h)]: all q, all k, all v
        rest = t.shape[1:]
        t = t.reshape(3, np_, hn, *rest).transpose(0, 1)  # [3, np, hn, (h)] -> [np, 3, hn, (h)]
        return t.reshape(np_ * 3 * hn, *rest)

    def to_hf(t: Tensor) -> tuple[Tensor]:
        rest = t.shape[1:]
        t = t.reshape(np_, 3, hn, *rest).transpose(0, 1).reshape(3 * np_ * hn, *rest)  # rows [3, np, hn]
        return (t.t() if t.dim() == 2 else t,)

    return WeightRule(ours, (hf,), to_ours, to_hf)


def _grouped_qkv(ours: str, q: str, k: str, v: str, np_: int, ng: int, hn: int) -> WeightRule:
    """q [np hn, (h)], k and v [ng hn, (h)] <-> linear_qkv rows per group: [ng, np/ng q heads + k + v, hn]."""
    per_group = np_ // ng * hn  # q rows of one group

    def to_ours(q_: Tensor, k_: Tensor, v_: Tensor) -> Tensor:
        rest = q_.shape[1:]
        groups = (q_.reshape(ng, per_group, *rest), k_.reshape(ng, hn, *rest), v_.reshape(ng, hn, *rest))
        return torch.cat(groups, dim=1).reshape(ng * (per_group + 2 * hn), *rest)  # [ng (np/ng + 2) hn, (h)]

    def to_hf(t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rest = t.shape[1:]
        groups = t.reshape(ng, per_group + 2 * hn, *rest)  # [ng, (np/ng + 2) hn, (h)]
        q_, k_, v_ = torch.split(groups, [per_group, hn, hn], dim=1)
        return q_.reshape(np_ * hn, *rest), k_.reshape(ng * hn, *rest), v_.reshape(ng * hn, *rest)

    return WeightRule(ours, (q, k, v), to_ours, to_hf)


def _gate_up(ours: str, gate: str, up: str) -> WeightRule:
    """gate_proj, up_proj [ffn, (h)] <-> linear_fc1 [2 ffn, (h)] = [gate; up] (the SwiGLU order of mlp.py)."""
    return WeightRule(ours, (gate, up), lambda g, u: torch.cat([g, u]), lambda t: tuple(torch.chunk(t, 2)))


# ------------------------------------------------------------------ per-architecture rules


def _gpt2_rules(c: Any) -> list[WeightRule]:
    np_, hn = c.n_head, c.n_embd // c.n_head
    rules = [_same("embedding.word_embeddings.weight", "transformer.wte.weight"),
             _same("embedding.position_embeddings.weight", "transformer.wpe.weight")]
    for i in range(c.n_layer):
        hf, ours = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for p in ("weight", "bias"):
            rules += [_same(ours + "input_layernorm." + p, hf + "ln_1." + p),
                      _gpt2_qkv(ours + "self_attention.linear_qkv." + p, hf + "attn.c_attn." + p, np_, hn),
                      _same(ours + "pre_mlp_layernorm." + p, hf + "ln_2." + p)]
        for our_name, hf_name in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                                  ("mlp.linear_fc2", "mlp.c_proj")):
            rules += [_transposed(ours + our_name + ".weight", hf + hf_name + ".weight"),
                      _same(ours + our_name + ".bias", hf + hf_name + ".bias")]
    rules += [_same("decoder.final_layernorm." + p, "transformer.ln_f." + p) for p in ("weight", "bias")]
    return rules + _output_rules(c)


def _llama_rules(c: Any) -> list[WeightRule]:
    """Llama, Mistral and Qwen2: the same names, their biases as _llama_biases says."""
    np_, ng, hn = c.num_attention_heads, _query_groups(c), _head_dim(c)
    qkv_bias, linear_bias = _llama_biases(c)
    rules = [_same("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(c.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        params = ("weight", "bias") if linear_bias else ("weight",)
        rules.append(_same(ours + "input_layernorm.weight", hf + "input_layernorm.weight"))
        for p in ("weight", "bias") if qkv_bias else ("weight",):
            rules.append(_grouped_qkv(ours + "self_attention.linear_qkv." + p, attn + "q_proj." + p,
                                      attn + "k_proj." + p, attn + "v_proj." + p, np_, ng, hn))
        rules += [_same(ours + "self_attention.linear_proj." + p, attn + "o_proj." + p) for p in params]
        rules.append(_same(ours + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"))
        rules += [_gate_up(ours + "mlp.linear_fc1." + p, mlp + "gate_proj." + p, mlp + "up_proj." + p) for p in params]
        rules += [_same(ours + "mlp.linear_fc2." + p, mlp + "down_proj." + p) for p in params]
    rules.append(_same("decoder.final_layernorm.weight", "model.norm.weight"))
    return rules + _output_rules(c)


def _gpt_neox_rules(c: Any) -> list[WeightRule]:
    rules = [_same("embedding.word_embeddings.weight", "gpt_neox.embed_in.weight")]
    names = (("input_layernorm", "input_layernorm"), ("self_attention.linear_qkv", "attention.query_key_value"),
             ("self_attention.linear_proj", "attention.dense"), ("pre_mlp_layernorm", "post_attention_layernorm"),
             ("mlp.linear_fc1", "mlp.dense_h_to_4h"), ("mlp.linear_fc2", "mlp.dense_4h_to_h"))
    for i in range(c.num_hidden_layers):
        for our_name, hf_name in names:
            rules += [_same(f"decoder.layers.{i}.{our_name}.{p}", f"gpt_neox.layers.{i}.{hf_name}.{p}")
                      for p in ("weight", "bias")]
    rules += [_same("decoder.final_layernorm." + p, "gpt_neox.final_layer_norm." + p) for p in ("weight", "bias")]
    return rules + _output_rules(c)


def _output_rules(c: Any) -> list[WeightRule]:
    """Untied: lm_head is our output layer. Tied: we store no output weight (HF's lm_head repeats the embedding)."""
    return [] if c.tie_word_embeddings else [_same("output_layer.weight", "lm_head.weight")]


# ------------------------------------------------------------------ per-architecture configs


def _gpt2_config(c: Any, seq_length: int | None) -> tuple[dict, dict]:
    _refuse(not c.scale_attn_weights, "GPT-2 with scale_attn_weights=False (no 1/sqrt(hn) scaling)")
    _refuse(c.scale_attn_by_inverse_layer_idx, "GPT-2 with scale_attn_by_inverse_layer_idx=True")
    _refuse(getattr(c, "add_cross_attention", False), "GPT-2 with cross-attention")
    # hidden_dropout is also our embedding dropout (HF's embd_pdrop: the same 0.1 in the released GPT-2s).
    config = dict(num_layers=c.n_layer, hidden_size=c.n_embd, num_attention_heads=c.n_head,
                  ffn_hidden_size=c.n_inner or 4 * c.n_embd, normalization="LayerNorm",
                  layernorm_epsilon=c.layer_norm_epsilon, add_bias_linear=True,
                  hidden_dropout=c.resid_pdrop, attention_dropout=c.attn_pdrop, init_method_std=c.initializer_range,
                  **_gelu(c.activation_function))
    model = dict(vocab_size=c.vocab_size, max_sequence_length=c.n_positions,
                 share_embeddings_and_output_weights=c.tie_word_embeddings,
                 position_embedding_type="learned_absolute")
    return config, model


def _llama_config(c: Any, seq_length: int | None) -> tuple[dict, dict]:
    _refuse(c.hidden_act != "silu", f"{c.model_type} with hidden_act {c.hidden_act!r} (SwiGLU takes silu)")
    window = _sliding_window(c)
    if window is not None and seq_length is not None and seq_length > window:
        raise ValueError(f"{c.model_type}: HF attends to the last sliding_window={window} keys only; our attention "
                         f"is full causal, so the models agree on sequences of at most {window} tokens, "
                         f"not seq_length {seq_length}")
    # transformers' Llama-family attention rotates the whole head: version 5's default RoPE never reads
    # partial_rotary_factor and its llama3 RoPE (like version 4's default) then fails on the shapes.
    fraction = float(rope_parameters(c).get("partial_rotary_factor", 1.0))
    _refuse(fraction != 1.0, f"{c.model_type} with partial_rotary_factor {fraction:g}",
            "transformers' Llama-family models rotate the whole head (drop the factor from config.json)")
    qkv_bias, linear_bias = _llama_biases(c)
    config = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                  num_query_groups=_query_groups(c), kv_channels=_head_dim(c), ffn_hidden_size=c.intermediate_size,
                  normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps, add_bias_linear=linear_bias,
                  add_qkv_bias=qkv_bias, gated_linear_unit=True, activation_func=F.silu, rotary_interleaved=False,
                  hidden_dropout=0.0, attention_dropout=float(c.attention_dropout or 0.0),
                  init_method_std=c.initializer_range)
    model = dict(vocab_size=c.vocab_size, max_sequence_length=c.max_position_embeddings,
                 share_embeddings_and_output_weights=c.tie_word_embeddings, **_rope(c))
    return config, model


def _gpt_neox_config(c: Any, seq_length: int | None) -> tuple[dict, dict]:
    _refuse(c.use_parallel_residual,
            "GPT-NeoX with use_parallel_residual=True (x + attn(ln1(x)) + mlp(ln2(x)), the Pythia / NeoX-20B "
            "default)", "its GPT layer is the sequential block; a parallel block is a user layer spec, "
            "not this mapping")
    _refuse(not getattr(c, "attention_bias", True), "GPT-NeoX with attention_bias=False (its MLP keeps biases)")
    config = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                  ffn_hidden_size=c.intermediate_size, normalization="LayerNorm", layernorm_epsilon=c.layer_norm_eps,
                  add_bias_linear=True, rotary_interleaved=False,
                  hidden_dropout=float(getattr(c, "hidden_dropout", 0.0)),
                  attention_dropout=float(getattr(c, "attention_dropout", 0.0)), init_method_std=c.initializer_range,
                  **_gelu(c.hidden_act))
    model = dict(vocab_size=c.vocab_size, max_sequence_length=c.max_position_embeddings,
                 share_embeddings_and_output_weights=c.tie_word_embeddings, **_rope(c))
    return config, model


def _gelu(name: str) -> dict:
    if name in TANH_GELUS:
        # Megatron's --openai-gelu; the fused bias-GeLU (bias_gelu_fusion) computes the same tanh GeLU.
        return {"openai_gelu": True}
    if name == "gelu":
        # The erf GeLU; Megatron's fused bias-GeLU is the tanh one (up to ~5e-4 apart), so it must be off.
        return {"activation_func": F.gelu, "bias_gelu_fusion": False}
    raise ValueError(f"activation {name!r} is not supported (GeLU: {', '.join(TANH_GELUS)} or gelu)")


def _llama_biases(c: Any) -> tuple[bool, bool]:
    """(add_qkv_bias, add_bias_linear) of a Llama-family config."""
    if c.model_type == "qwen2":
        return True, False  # Qwen2: biases on q, k, v only
    if c.model_type in ("mistral", "mixtral"):
        return False, False
    attention_bias, mlp_bias = bool(getattr(c, "attention_bias", False)), bool(getattr(c, "mlp_bias", False))
    _refuse(attention_bias != mlp_bias,
            f"Llama with attention_bias={attention_bias}, mlp_bias={mlp_bias}",
            "add_bias_linear puts biases on o_proj and the MLP together")
    return attention_bias, attention_bias


def _query_groups(c: Any) -> int:
    return getattr(c, "num_key_value_heads", None) or c.num_attention_heads


def _head_dim(c: Any) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _sliding_window(c: Any) -> int | None:
    """The window HF applies, or None (Qwen2 applies it only on use_sliding_window / its layer_types;
    NemotronH's attention masks causally whatever its sliding_window says)."""
    if c.model_type == "nemotron_h":
        return None
    window = getattr(c, "sliding_window", None)
    if c.model_type == "qwen2":
        layer_types = getattr(c, "layer_types", None)
        if layer_types is not None:
            used = "sliding_attention" in layer_types
        else:  # transformers 4
            used = getattr(c, "use_sliding_window", False) and c.max_window_layers < c.num_hidden_layers
        window = window if used else None
    return window


def rope_parameters(c: Any) -> dict:
    """HF's RoPE settings as one dict: transformers 5's config.rope_parameters, or built from the
    attributes of transformers 4 (rope_theta / rotary_emb_base, rope_scaling, partial_rotary_factor / rotary_pct)."""
    params = dict(getattr(c, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(c, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(c, "rope_theta", None) or getattr(c, "rotary_emb_base", 10000.0))
        fraction = getattr(c, "partial_rotary_factor", None) or getattr(c, "rotary_pct", None)
        if fraction is not None:
            params.setdefault("partial_rotary_factor", fraction)
    if "rope_theta" not in params:
        raise ValueError(f"RoPE parameters per layer type ({sorted(params)}) are not supported")
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _rope(c: Any) -> dict:
    """GPTModel's RoPE kwargs; Llama 3.1 scaling only with Megatron-Core's constants."""
    params = rope_parameters(c)
    kwargs = dict(position_embedding_type="rope", rotary_base=float(params["rope_theta"]),
                  rotary_percent=float(params.get("partial_rotary_factor", 1.0)))
    kind = params["rope_type"]
    if kind == "default":
        return kwargs
    if kind != "llama3":
        raise ValueError(f"RoPE type {kind!r} is not supported: GPTModel has plain RoPE and Llama 3.1's "
                         f"'llama3' scaling (Megatron-Core's --use-rope-scaling)")
    actual = {"low_freq_factor": params.get("low_freq_factor"), "high_freq_factor": params.get("high_freq_factor"),
              "original_max_position_embeddings": params.get("original_max_position_embeddings",
                                                             c.max_position_embeddings)}
    different = {k: v for k, v in actual.items() if v is None or float(v) != MCORE_LLAMA3_ROPE[k]}
    if different:
        raise ValueError(f"llama3 RoPE scaling with {different}: Megatron-Core's scaling fixes "
                         f"{MCORE_LLAMA3_ROPE} (only the factor is a setting)")
    return dict(kwargs, rope_scaling=True, rope_scaling_factor=float(params["factor"]))


def _refuse(condition: bool, what: str, why: str = "") -> None:
    if condition:
        raise ValueError(f"{what} cannot be converted to GPTModel" + (f": {why}" if why else ""))


# ------------------------------------------------------------------ the public functions


def computes_tanh_gelu(values: dict) -> bool:
    """Whether our MLP of these args (dest -> value) computes the tanh GeLU: with --openai-gelu, or
    with the fused bias-GeLU (Megatron's default, which is the tanh one); else the erf GeLU."""
    return bool(values.get("openai_gelu", False)) or values.get("bias_gelu_fusion", True) is not False
