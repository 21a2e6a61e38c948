"""Checkpoint conversion (tools/checkpoint/convert.py): tiny models' flags, runs of convert.main, HF models saved.

COMMON / FLAGS / VOCAB / legacy_args: the two tiny GPTs (GPT-2 and Llama style, vocabulary padded to 256)
whose Megatron-LM checkpoints tests/functional/test_convert_legacy*.py write and convert.
"""
from __future__ import annotations

import argparse

import torch

from megatron.training.arguments import parse_and_validate_args
from tools.checkpoint import convert, saver_megatron

COMMON = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--max-position-embeddings", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
          "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
          "--hidden-dropout", "0", "--attention-dropout", "0"]
FLAGS = {
    "gpt2": COMMON,  # LayerNorm, biases, learned positions, tied output, GeLU
    "llama": [*COMMON, "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
              "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
              "--disable-bias-linear", "--ffn-hidden-size", "48"],
}
VOCAB = 256


def legacy_args(name: str) -> argparse.Namespace:
    """Our parsed arguments of the tiny model FLAGS[name], its vocabulary padded to VOCAB."""
    args = parse_and_validate_args(argv=FLAGS[name])
    args.padded_vocab_size = VOCAB
    return args


def assert_same_tensors(whole, save_dir):
    """The checkpoint our saver wrote in save_dir holds exactly the tensors of `whole`."""
    _, tensors = saver_megatron.read_back(str(save_dir))
    tensors = dict(tensors)
    assert tensors.keys() == whole.keys() and all(torch.equal(tensors[k], whole[k]) for k in whole)


def llama31_rope(factor=8.0):
    """Llama 3.1's config.json RoPE (3.2: factor 32): the constants Megatron-Core's --use-rope-scaling fixes."""
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}


def save_hf(config, path, seed=0, query_key_scale=1.0):
    """A random transformers model of `config` saved in path (save_pretrained); returns the model.

    query_key_scale: sharper attention, so that slow RoPE frequencies (those Llama 3.1's scaling
    changes, wavelengths over 2048 positions) move the logits of a dozen tokens visibly."""
    import transformers  # the callers skip without it

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms and biases away from 1 and 0, so that a mix-up shows
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name or ".ln_" in name:
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(query_key_scale)
            elif name.endswith("attention.query_key_value.weight"):  # GPT-NeoX: rows [np, 3, hn]
                param.view(config.num_attention_heads, 3, -1, param.shape[1])[:, :2].mul_(query_key_scale)
    model.save_pretrained(path)
    return model


def run_convert(load_dir, save_dir, loader, saver, *extra):
    """convert.main for a GPT from load_dir (--loader) to save_dir (--saver), with extra flags."""
    convert.main(["--model-type", "GPT", "--loader", loader, "--saver", saver, "--load-dir", str(load_dir),
                  "--save-dir", str(save_dir), *extra])
