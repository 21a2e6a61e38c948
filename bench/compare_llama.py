"""The Llama-style model of bench/compare_peers.py --model llama, built in each framework from one set of weights.

    ours            GPTModel(get_llama_layer_spec(), position_embedding_type "rope", untied)
    transformers    LlamaForCausalLM
    megatron-core   its GPTModel, get_gpt_layer_local_spec(normalization="RMSNorm"), rope, untied

All three load initial_weights(shape): the same numbers under HF's names, mapped to the
Megatron-Core names ours and megatron-core share (megatron_state_dict), so their first losses
agree to rounding (the benchmark prints them). Loaded by path in the workers (megatron-core's
package is also called `megatron`): nothing here imports this project at module level.

The mapping: linear_qkv holds, per query group, its np/ng query heads, then its key head, then
its value head (Megatron-Core's rows); linear_fc1 is [gate ; up] (Megatron's SwiGLU: silu of
the first half times the second).
"""

from __future__ import annotations

INIT_STD = 0.02
SEED = 1234
RMS_EPS = 1e-5
ROPE_BASE = 10000.0


def initial_weights(shape) -> dict:
    """HF LlamaForCausalLM's state dict (fp32): matrices N(0, INIT_STD) from one seeded generator
    in a fixed order, RMSNorm weights 1."""
    import torch

    h, hn, ng, ffn = shape.hidden, shape.hidden // shape.heads, shape.query_groups, shape.ffn
    gen = torch.Generator().manual_seed(SEED)

    def normal(*size):
        return torch.randn(*size, generator=gen) * INIT_STD

    sd = {"model.embed_tokens.weight": normal(shape.vocab, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.ones(h)
        sd[p + "self_attn.q_proj.weight"] = normal(shape.heads * hn, h)
        sd[p + "self_attn.k_proj.weight"] = normal(ng * hn, h)
        sd[p + "self_attn.v_proj.weight"] = normal(ng * hn, h)
        sd[p + "self_attn.o_proj.weight"] = normal(h, shape.heads * hn)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h)
        sd[p + "mlp.gate_proj.weight"] = normal(ffn, h)
        sd[p + "mlp.up_proj.weight"] = normal(ffn, h)
        sd[p + "mlp.down_proj.weight"] = normal(h, ffn)
    sd["model.norm.weight"] = torch.ones(h)
    sd["lm_head.weight"] = normal(shape.vocab, h)
    return sd


def megatron_state_dict(hf: dict, shape) -> dict:
    """HF names -> Megatron-Core's local-spec names (ours are the same)."""
    import torch

    h, hn, ng = shape.hidden, shape.hidden // shape.heads, shape.query_groups
    sd = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
          "decoder.final_layernorm.weight": hf["model.norm.weight"],
          "output_layer.weight": hf["lm_head.weight"]}
    for i in range(shape.layers):
        p, d = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[p + "self_attn.q_proj.weight"].view(ng, shape.heads // ng * hn, h)  # [ng, np/ng * hn, h]
        k = hf[p + "self_attn.k_proj.weight"].view(ng, hn, h)  # [ng, hn, h]
        v = hf[p + "self_attn.v_proj.weight"].view(ng, hn, h)
        sd[d + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        sd[d + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, h)  # [ng (np/ng + 2) hn, h]
        sd[d + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        sd[d + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        sd[d + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        sd[d + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    return sd


def load_exactly(model, sd: dict) -> None:
    """load_state_dict(sd), refusing any parameter left out (extra states such as TE's may be absent)."""
    result = model.load_state_dict(sd, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"weights do not map: missing {missing}, unexpected {result.unexpected_keys}")


def megatron_flags(shape) -> list[str]:
    """pretrain_gpt.py's flags for the model (Megatron-LM's names), beside the GPT ones."""
    return ["--ffn-hidden-size", str(shape.ffn), "--swiglu", "--normalization", "RMSNorm",
            "--norm-epsilon", str(RMS_EPS), "--position-embedding-type", "rope", "--rotary-base", str(int(ROPE_BASE)),
            "--group-query-attention", "--num-query-groups", str(shape.query_groups),
            "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def build_ours(config, shape, vocab_size: int, num_tokens: int):
    """Our GPTModel with the Llama layer spec and RoPE, loaded with initial_weights."""
    from megatron.model import GPTModel
    from megatron.model.layer_specs import get_llama_layer_spec

    model = GPTModel(config, vocab_size=vocab_size, num_tokens=num_tokens, max_sequence_length=shape.seq,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=ROPE_BASE, transformer_layer_spec=get_llama_layer_spec())
    load_exactly(model, megatron_state_dict(initial_weights(shape), shape))
    return model


def build_hf(shape, dev):
    """LlamaForCausalLM (its default attention implementation), fp32, loaded with initial_weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.query_groups, max_position_embeddings=shape.seq,
                         rms_norm_eps=RMS_EPS, rope_theta=ROPE_BASE, tie_word_embeddings=False,
                         attention_bias=False, mlp_bias=False, attention_dropout=0.0,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config)
    load_exactly(model, initial_weights(shape))
    return model.to(dev).train(), config


def build_mcore(shape, precision: str, dev):
    """megatron-core's GPTModel, local spec with RMSNorm, SwiGLU, GQA, RoPE, untied, no biases."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = precision == "bf16"
    config = TransformerConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                               num_query_groups=shape.query_groups, ffn_hidden_size=shape.ffn,
                               normalization="RMSNorm", layernorm_epsilon=RMS_EPS, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False,
                               hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16,
                               params_dtype=torch.bfloat16 if bf16 else torch.float32,
                               use_cpu_initialization=True)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=shape.vocab,
                     max_sequence_length=shape.seq, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_base=int(ROPE_BASE))
    load_exactly(model, megatron_state_dict(initial_weights(shape), shape))
    model = model.to(dev)
    return (Float16Module(config, model) if bf16 else model).train()
