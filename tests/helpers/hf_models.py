"""Tiny random HuggingFace transformers models and our GPTModel built from them (megatron.convert.huggingface).

2 layers, h 64, vocab 128, s 32, init std 0.1; norm weights and biases perturbed so that a mix-up
shows (tests/unit/test_hf_equivalence.py). Importing this module skips the importing test module
when transformers is not installed.
"""

from __future__ import annotations

import pytest
import torch

from megatron.convert.huggingface import config_from_hf, state_dict_from_hf
from megatron.model import GPTModel, TransformerConfig

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, HEADS, FFN, LAYERS, SEQ, BATCH = 128, 64, 4, 96, 2, 32, 2
STD = 0.1

FUSED = {}  # TransformerConfig's defaults: every fusion on (RoPE, SwiGLU, softmax, bias-GeLU, bias-dropout-add)
UNFUSED = dict(apply_rope_fusion=False, bias_swiglu_fusion=False, masked_softmax_fusion=False,
               bias_gelu_fusion=False, bias_dropout_fusion=False, fused_kernels_cpu_impl="reference")


def llama_family(model_type: str, **overrides):
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config}[model_type]
    kwargs = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                  initializer_range=STD, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return config_class(**{**kwargs, **overrides})


def gpt2(**overrides):
    kwargs = dict(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                  activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  initializer_range=STD, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return transformers.GPT2Config(**{**kwargs, **overrides})


def make_hf(hf_config, seed: int = 0):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name or ".ln_" in name:
                param.add_(0.1 * torch.randn_like(param))
    return hf


def make_ours(hf, flags: dict) -> GPTModel:
    config_kwargs, model_kwargs = config_from_hf(hf.config, seq_length=SEQ)
    # The mapping's own settings (bias_gelu_fusion=False for the erf GeLU) win over the test's flags.
    ours = GPTModel(TransformerConfig(**{**flags, **config_kwargs}), **model_kwargs).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), hf.config))  # strict: the same keys
    return ours


def gpt2_folder(directory, gpt2_vocab_dir, n_positions: int):
    """A tiny random GPT-2 (the real 50257-id vocabulary, h 32, 2 layers) saved with its fast
    tokenizer in `directory` (an HF folder as --load-hf and load() read it); (model, tokenizer, directory)."""
    eot = 50256
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=n_positions, n_embd=32, n_layer=2, n_head=4,
                                     activation_function="gelu_new", bos_token_id=eot, eos_token_id=eot)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(directory)
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(str(gpt2_vocab_dir))
    tokenizer.save_pretrained(directory)
    return model, tokenizer, directory


def make_sharded(hf, tp: int, pp: int = 1, seq_length: int = SEQ) -> GPTModel:
    """Our model of this rank's pipeline stage and tensor-parallel shard, its parameters cut from the
    whole mapped state dict of `hf` (parallel_state initialized by the caller)."""
    import re

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layout import shard_for_rank
    from megatron.model.transformer_layer import get_layer_offset

    config_kwargs, model_kwargs = config_from_hf(hf.config, seq_length=seq_length)
    config = TransformerConfig(**config_kwargs, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = GPTModel(config, **model_kwargs, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage()).eval()
    full = state_dict_from_hf(hf.state_dict(), hf.config)
    offset, rank = get_layer_offset(config), parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + offset}.", name)
            if key == "output_layer.weight" and key not in full:  # tied: the last stage's copy of the embedding
                key = "embedding.word_embeddings.weight"
            param.copy_(shard_for_rank(full[key], param, tp, rank))
    return model
