"""HuggingFace transformers <-> GPTModel: configs and weights (the whole model, tensor-parallel size 1).

    config_from_hf(hf_config, seq_length=None) -> (TransformerConfig kwargs, GPTModel kwargs)
    state_dict_from_hf(hf_state_dict, hf_config) -> our state dict
    state_dict_to_hf(our_state_dict, hf_config)  -> HF state dict (the names of model.state_dict())
    weight_rules(hf_config)                      -> the mapping itself: one WeightRule per key of ours

Both state dicts hold full tensors, i.e. our TP = 1, PP = 1 state dict, with HF's vocabulary (no
padding rows). Splitting for tensor parallelism (linear_qkv by query group, fc1's [gate; up] per
rank, the vocabulary padded to a multiple of 128 x TP) is the checkpoint converter's job. The
round trip state_dict_to_hf(state_dict_from_hf(sd, c), c) gives sd back bit for bit.

Notation: np heads, ng query groups (HF num_key_value_heads), hn head dim, h hidden size,
L. = decoder.layers.{i}. (ours); {i} the layer. MegatronBertForPreTraining <-> BertModel is in
megatron/convert/bert.py (registered in ARCHITECTURES below, family "BERT"), T5ForConditionalGeneration
<-> T5Model in megatron/convert/t5.py (family "T5"), Mamba2ForCausalLM <-> MambaModel in
megatron/convert/mamba2.py (family "MAMBA"), NemotronHForCausalLM <-> a hybrid MambaModel (M, *, -, E
layers) in megatron/convert/nemotron_h.py (family "MAMBA").

GPT2LMHeadModel. HF's Conv1D stores a weight as [in, out]: transposed to our [out, in].
    transformer.wte.weight               embedding.word_embeddings.weight
    transformer.wpe.weight               embedding.position_embeddings.weight
    transformer.h.{i}.ln_1.{weight,bias} L.input_layernorm.{weight,bias}
    transformer.h.{i}.attn.c_attn.weight L.self_attention.linear_qkv.weight  transposed; rows [3, np, hn] -> [np, 3, hn]
    transformer.h.{i}.attn.c_attn.bias   L.self_attention.linear_qkv.bias     [3, np, hn] -> [np, 3, hn]
    transformer.h.{i}.attn.c_proj.*      L.self_attention.linear_proj.*       weight transposed
    transformer.h.{i}.ln_2.*             L.pre_mlp_layernorm.*
    transformer.h.{i}.mlp.c_fc.*         L.mlp.linear_fc1.*                   weight transposed
    transformer.h.{i}.mlp.c_proj.*       L.mlp.linear_fc2.*                   weight transposed
    transformer.ln_f.*                   decoder.final_layernorm.*
    lm_head.weight                       output_layer.weight (untied only; tied it repeats wte)

LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (and MixtralForCausalLM's dense part: its MoE
MLPs are in megatron/convert/mixtral.py).
    model.embed_tokens.weight                 embedding.word_embeddings.weight
    model.layers.{i}.input_layernorm.weight   L.input_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v}_proj.weight  L.self_attention.linear_qkv.weight: per query group g
                                              its np/ng q heads, k head g, v head g ([ng, np/ng + 2, hn] rows)
    model.layers.{i}.self_attn.{q,k,v}_proj.bias  L.self_attention.linear_qkv.bias, grouped the same way
                                              (Qwen2 always; Llama with attention_bias)
    model.layers.{i}.self_attn.o_proj.*       L.self_attention.linear_proj.*  (bias: Llama attention_bias)
    model.layers.{i}.post_attention_layernorm.weight  L.pre_mlp_layernorm.weight
    model.layers.{i}.mlp.{gate,up}_proj.*     L.mlp.linear_fc1.*: rows [gate; up] (bias: Llama mlp_bias)
    model.layers.{i}.mlp.down_proj.*          L.mlp.linear_fc2.*
    model.norm.weight                         decoder.final_layernorm.weight
    lm_head.weight                            output_layer.weight (untied only; tied it repeats embed_tokens)

GPTNeoXForCausalLM (use_parallel_residual=False only).
    gpt_neox.embed_in.weight                        embedding.word_embeddings.weight
    gpt_neox.layers.{i}.input_layernorm.*           L.input_layernorm.*
    gpt_neox.layers.{i}.attention.query_key_value.* L.self_attention.linear_qkv.*  as is: HF's rows are
                                                    already [np, 3, hn] (it views them per head)
    gpt_neox.layers.{i}.attention.dense.*           L.self_attention.linear_proj.*
    gpt_neox.layers.{i}.post_attention_layernorm.*  L.pre_mlp_layernorm.*
    gpt_neox.layers.{i}.mlp.dense_h_to_4h.*         L.mlp.linear_fc1.*
    gpt_neox.layers.{i}.mlp.dense_4h_to_h.*         L.mlp.linear_fc2.*
    gpt_neox.final_layer_norm.*                     decoder.final_layernorm.*
    lm_head.weight                                  output_layer.weight (named embed_out.weight before
                                                    transformers 5: accepted on the way in)

HF buffers with no counterpart (GPT-2's attn.bias / attn.masked_bias causal masks, rotary_emb.inv_freq
of older checkpoints) are ignored on the way in and not written on the way out.

What the configs cannot express is refused with a ValueError rather than converted into a
different model: RoPE types other than "default" and Llama 3.1's "llama3" with Megatron-Core's
constants, a partial_rotary_factor on a Llama-family model, GPT-NeoX's parallel residual,
activations other than (tanh or erf) GeLU and SiLU-GLU, an attention-output bias without MLP
biases (or the reverse). A sliding window (Mistral, Qwen2)
is not implemented by our attention: the models agree on sequences of at most sliding_window tokens,
which config_from_hf checks when given seq_length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron.convert.hf_rules import (  # noqa: F401 (the mapping's pieces, re-exported)
    Tensor,
    MCORE_LLAMA3_ROPE,
    TANH_GELUS,
    IGNORED_HF_KEYS,
    HF_ALIASES,
    WeightRule,
    _same,
    _transposed,
    _gpt2_qkv,
    _grouped_qkv,
    _gate_up,
    _gpt2_rules,
    _llama_rules,
    _gpt_neox_rules,
    _output_rules,
    _gpt2_config,
    _llama_config,
    _gpt_neox_config,
    _gelu,
    _llama_biases,
    _query_groups,
    _head_dim,
    _sliding_window,
    rope_parameters,
    _rope,
    _refuse,
    computes_tanh_gelu,
)
from megatron.convert import bert as _bert
from megatron.convert import mamba2 as _mamba2
from megatron.convert import mixtral as _mixtral
from megatron.convert import nemotron_h as _nemotron_h
from megatron.convert import t5 as _t5


@dataclass(frozen=True)
class _Architecture:
    name: str  # HF's model class
    config: Callable[[Any, int | None], tuple[dict, dict]]
    rules: Callable[[Any], list[WeightRule]]
    embedding: str  # HF name of the word embedding (what a tied lm_head repeats)
    family: str = "GPT"  # our model: GPTModel, BertModel (megatron/convert/bert.py) or T5Model (t5.py)
    tied_head: bool = True  # tie_word_embeddings ties lm_head (NemotronH's lm_head is never tied)

    def tied_copies(self, hf_config: Any) -> dict[str, str]:
        """HF names of tensors that repeat another (not written by save_pretrained) -> the one repeated."""
        if self.family == "BERT":
            return dict(_bert.TIED_COPIES)
        if self.family == "T5":
            return dict(_t5.TIED_COPIES)
        return {"lm_head.weight": self.embedding} if self.tied_head and hf_config.tie_word_embeddings else {}


ARCHITECTURES = {  # by HF model_type
    "gpt2": _Architecture("GPT2LMHeadModel", _gpt2_config, _gpt2_rules, "transformer.wte.weight"),
    "llama": _Architecture("LlamaForCausalLM", _llama_config, _llama_rules, "model.embed_tokens.weight"),
    "mistral": _Architecture("MistralForCausalLM", _llama_config, _llama_rules, "model.embed_tokens.weight"),
    "qwen2": _Architecture("Qwen2ForCausalLM", _llama_config, _llama_rules, "model.embed_tokens.weight"),
    "gpt_neox": _Architecture("GPTNeoXForCausalLM", _gpt_neox_config, _gpt_neox_rules, "gpt_neox.embed_in.weight"),
}
ARCHITECTURES.update({
    "megatron-bert": _Architecture(_bert.ARCHITECTURE, _bert.bert_config, _bert.bert_rules,
                                   "bert.embeddings.word_embeddings.weight", family="BERT"),
    "bert": _Architecture(_bert.POST_LN_ARCHITECTURE, _bert.bert_config, _bert.bert_rules,
                          "bert.embeddings.word_embeddings.weight", family="BERT"),
    "t5": _Architecture(_t5.ARCHITECTURE, _t5.t5_config, _t5.t5_rules, _t5.EMBEDDING, family="T5"),
    "mixtral": _Architecture(_mixtral.ARCHITECTURE, _mixtral.mixtral_config, _mixtral.mixtral_rules,
                             "model.embed_tokens.weight"),
    "mamba2": _Architecture(_mamba2.ARCHITECTURE, _mamba2.mamba2_config, _mamba2.mamba2_rules, _mamba2.EMBEDDING,
                            family="MAMBA"),
    "nemotron_h": _Architecture(_nemotron_h.ARCHITECTURE, _nemotron_h.nemotron_h_config, _nemotron_h.nemotron_h_rules,
                                _nemotron_h.EMBEDDING, family="MAMBA", tied_head=False),
})
MODEL_CLASSES = {"GPT": "GPTModel", "BERT": "BertModel", "T5": "T5Model",
                 "MAMBA": "MambaModel"}  # our model of each family


def _architecture(hf_config: Any) -> _Architecture:
    arch = ARCHITECTURES.get(getattr(hf_config, "model_type", None))
    if arch is None:
        raise ValueError(f"HF model_type {getattr(hf_config, 'model_type', None)!r} is not supported "
                         f"(one of {', '.join(ARCHITECTURES)})")
    named = getattr(hf_config, "architectures", None) or [arch.name]
    if arch.name not in named:
        raise ValueError(f"HF architectures {named}: only {arch.name} maps onto our {MODEL_CLASSES[arch.family]}")
    return arch


def config_from_hf(hf_config: Any, seq_length: int | None = None) -> tuple[dict, dict]:
    """(TransformerConfig kwargs, GPTModel kwargs) of the model that computes what the HF model does.

    The TransformerConfig kwargs hold the shape, norms, biases, activation, dropout and init std
    (and bias_gelu_fusion=False for the erf GeLU); add the parallel sizes, precision and fusion
    flags yourself. GPTModel's vocab_size is HF's (unpadded). seq_length (optional): the length
    the model will run at, checked against a sliding window.
    """
    return _architecture(hf_config).config(hf_config, seq_length)


def weight_rules(hf_config: Any) -> list[WeightRule]:
    """The mapping, one rule per tensor of our (TP = 1) state dict, layer by layer in model order."""
    return _architecture(hf_config).rules(hf_config)


def state_dict_from_hf(hf_state_dict: dict[str, Tensor], hf_config: Any) -> dict[str, Tensor]:
    """Our full (TP = 1) state dict from an HF model's state dict (tensors that need no change are shared)."""
    arch = _architecture(hf_config)
    hf = {HF_ALIASES.get(k, k): t for k, t in hf_state_dict.items()}
    if hf_config.model_type == "mixtral":  # transformers 5's fused experts -> the per-expert names
        hf = _mixtral.unfuse(hf)
    if hf_config.model_type == "nemotron_h":  # the module's names (model., fused experts) -> the files'
        hf = _nemotron_h.file_names(hf)
    ours, used = {}, set()
    for rule in arch.rules(hf_config):
        missing = [k for k in rule.hf if k not in hf]
        if missing:
            raise KeyError(f"HF state dict lacks {missing} (needed for {rule.ours})")
        ours[rule.ours] = rule.to_ours(*(hf[k] for k in rule.hf))
        used.update(rule.hf)
    for copy_, repeated in arch.tied_copies(hf_config).items():
        if copy_ in hf:
            if not torch.equal(hf[copy_], hf[repeated]):
                raise ValueError(f"{copy_} is tied to {repeated} but differs from it")
            used.add(copy_)
    left = sorted(k for k in hf if k not in used and not IGNORED_HF_KEYS.search(k))
    if left:
        raise ValueError(f"HF tensors with no counterpart in {MODEL_CLASSES[arch.family]} ({len(left)}): {left[:6]}")
    return ours


def state_dict_to_hf(our_state_dict: dict[str, Tensor], hf_config: Any) -> dict[str, Tensor]:
    """The HF model's state dict from our full (TP = 1) one, in contiguous tensors.

    Tied, lm_head.weight is the word-embedding tensor itself, as in HF's model.state_dict():
    save through save_pretrained (which drops the tied copy), or drop it before safetensors.save_file.
    """
    arch = _architecture(hf_config)
    rules = arch.rules(hf_config)
    unknown = sorted(set(our_state_dict) - {rule.ours for rule in rules})
    if unknown:
        raise ValueError(f"tensors of ours with no HF counterpart ({len(unknown)}): {unknown[:6]}")
    rows = our_state_dict["embedding.word_embeddings.weight"].shape[0]
    if rows != hf_config.vocab_size:
        raise ValueError(f"our word embedding has {rows} rows, the HF config's vocab_size is {hf_config.vocab_size}: "
                         "drop the vocabulary padding first")
    hf = {}
    for rule in rules:
        if rule.ours not in our_state_dict and rule.absent is not None:  # a feature ours was built without
            hf.update(zip(rule.hf, rule.absent()))
            continue
        hf.update(zip(rule.hf, (t.contiguous() for t in rule.to_hf(our_state_dict[rule.ours]))))
    for copy_, repeated in arch.tied_copies(hf_config).items():
        hf[copy_] = hf[repeated]
    if hf_config.model_type == "mixtral":  # the module's names: its experts fused
        hf = _mixtral.fuse(hf, int(hf_config.num_local_experts))
    if hf_config.model_type == "nemotron_h":
        hf = _nemotron_h.module_names(hf, int(hf_config.n_routed_experts))
    return hf


# ------------------------------------------------------------------ the inverse: our args -> an HF config


def _hf_rope_parameters(args: Any) -> dict:
    """transformers 5's rope_parameters of our RoPE args: plain, or Llama 3.1's scaling (--use-rope-scaling)."""
    params = {"rope_type": "default", "rope_theta": float(args.rotary_base)}
    if getattr(args, "use_rope_scaling", False):
        params.update(MCORE_LLAMA3_ROPE, rope_type="llama3", factor=float(args.rope_scaling_factor))
    return params


def hf_config_from_args(args: Any, vocab_size: int) -> dict:
    """The config.json fields (a dict with model_type and architectures) of the HF model that computes
    what a GPTModel of our training args does; vocab_size is the true (unpadded) vocabulary.

    Llama (RMSNorm, SwiGLU, RoPE; Qwen2 when only q, k, v have biases), GPT-2 (LayerNorm, GeLU,
    biases, learned positions) and GPT-NeoX (the same with RoPE); other models raise ValueError.
    config_from_hf of the result gives args back (the saver checks it).
    """
    if getattr(args, "model_family", "GPT") == "BERT":
        return _bert.hf_bert_config_from_args(args, vocab_size)
    if getattr(args, "model_family", "GPT") == "T5":
        return _t5.hf_t5_config_from_args(args, vocab_size)
    if getattr(args, "is_hybrid_model", False):  # all Mamba: Mamba2; with other layers: NemotronH
        if set(_nemotron_h.args_pattern(args)) == {"M"}:
            return _mamba2.hf_mamba2_config_from_args(args, vocab_size)
        return _nemotron_h.hf_nemotron_h_config_from_args(args, vocab_size)
    heads, hidden = int(args.num_attention_heads), int(args.hidden_size)
    groups = int(args.num_query_groups) if getattr(args, "group_query_attention", False) else heads
    head_dim = int(getattr(args, "kv_channels", None) or hidden // heads)
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    rope = args.position_embedding_type == "rope"
    _refuse(getattr(args, "apply_layernorm_1p", False) or getattr(args, "qk_layernorm", False)
            or getattr(args, "squared_relu", False) or getattr(args, "rotary_interleaved", False)
            or getattr(args, "apply_residual_connection_post_layernorm", False),
            "a model with --apply-layernorm-1p, --qk-layernorm, --squared-relu, --rotary-interleaved or "
            "--apply-residual-connection-post-layernorm", "no HF causal LM of this mapping has it")
    common = dict(vocab_size=vocab_size, tie_word_embeddings=tied, initializer_range=float(args.init_method_std))
    gelu = "gelu_new" if computes_tanh_gelu(vars(args)) else "gelu"
    if args.swiglu and args.normalization == "RMSNorm" and rope:
        qwen2 = bool(args.add_qkv_bias) and not args.add_bias_linear
        _refuse(bool(args.add_qkv_bias) != bool(args.add_bias_linear) and not qwen2,
                "a Llama-style model with linear biases but none on QKV")
        _refuse(float(args.rotary_percent) != 1.0, "a Llama-style model with --rotary-percent below 1")
        config = dict(common, model_type="qwen2" if qwen2 else "llama",
                      architectures=["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
                      hidden_size=hidden, intermediate_size=int(args.ffn_hidden_size),
                      num_hidden_layers=int(args.num_layers), num_attention_heads=heads, num_key_value_heads=groups,
                      head_dim=head_dim, max_position_embeddings=int(args.max_position_embeddings),
                      rms_norm_eps=float(args.norm_epsilon), hidden_act="silu",
                      attention_dropout=float(args.attention_dropout), rope_parameters=_hf_rope_parameters(args))
        if not qwen2:
            config.update(attention_bias=bool(args.add_bias_linear), mlp_bias=bool(args.add_bias_linear))
        if getattr(args, "num_experts", None):
            return _mixtral.hf_mixtral_config_from_args(args, config)
        return config
    _refuse(args.swiglu or args.normalization != "LayerNorm" or not args.add_bias_linear or groups != heads
            or head_dim * heads != hidden,
            "this model (SwiGLU, norm, biases and heads as given)",
            "the HF mappings are Llama/Mistral/Qwen2 (RMSNorm, SwiGLU, RoPE), GPT-2 and GPT-NeoX "
            "(LayerNorm, GeLU, biases, multi-head attention)")
    if rope:
        return dict(common, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=hidden,
                    intermediate_size=int(args.ffn_hidden_size), num_hidden_layers=int(args.num_layers),
                    num_attention_heads=heads, max_position_embeddings=int(args.max_position_embeddings),
                    layer_norm_eps=float(args.norm_epsilon), hidden_act=gelu, use_parallel_residual=False,
                    rope_parameters=dict(_hf_rope_parameters(args), partial_rotary_factor=float(args.rotary_percent)),
                    hidden_dropout=float(args.hidden_dropout), attention_dropout=float(args.attention_dropout))
    _refuse(args.position_embedding_type != "learned_absolute",
            f"a GPT-2-style model with --position-embedding-type {args.position_embedding_type}")
    return dict(common, model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=hidden,
                n_inner=int(args.ffn_hidden_size), n_layer=int(args.num_layers), n_head=heads,
                n_positions=int(args.max_position_embeddings), layer_norm_epsilon=float(args.norm_epsilon),
                activation_function=gelu, resid_pdrop=float(args.hidden_dropout), embd_pdrop=float(args.hidden_dropout),
                attn_pdrop=float(args.attention_dropout))
