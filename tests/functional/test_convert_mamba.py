"""tools/checkpoint/convert.py with a Mamba-2 model: HF Mamba2ForCausalLM -> ours at TP = 2, PP = 2 -> HF,
each step verified by convert.py's logits comparison, the result the source bit for bit; and the same
checkpoint through Megatron-LM's megatron-core names (--saver core: Transformer Engine's fused norm names,
decoder.layers.N.mixer.in_proj.layer_norm_weight) and back (--loader core)."""

import json

import pytest
import torch

from megatron.training.checkpoint_safety import load_file
from megatron.training.checkpointing import get_checkpoint_name
from tests.helpers.convert import run_convert, save_hf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _mamba2():
    return transformers.Mamba2Config(vocab_size=200, hidden_size=32, num_heads=8, head_dim=8, expand=2, state_size=8,
                                     n_groups=2, num_hidden_layers=4, chunk_size=8, tie_word_embeddings=False,
                                     bos_token_id=0, eos_token_id=1, pad_token_id=0)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("mamba")
    save_hf(_mamba2(), root / "hf")
    run_convert(root / "hf", root / "tp2pp2", "hf", "megatron", "--target-tensor-parallel-size", "2",
                "--target-pipeline-parallel-size", "2")
    run_convert(root / "tp2pp2", root / "back", "megatron", "hf")
    return root


def _safetensors(path):
    return safetensors_torch.load_file(str(path / "model.safetensors"))


def test_hf_to_tp2pp2_to_hf_is_bit_identical(converted):
    source, back = _safetensors(converted / "hf"), _safetensors(converted / "back")
    assert sorted(source) == sorted(back)
    assert not [k for k in source if not torch.equal(source[k], back[k])]
    with open(converted / "hf" / "config.json") as a, open(converted / "back" / "config.json") as b:
        assert json.load(a) == json.load(b)
    # each TP rank's file holds its heads' slices: rank 1's dt_bias is the second half of HF's
    rank1 = load_file(get_checkpoint_name(str(converted / "tp2pp2"), 0, release=True, pipeline_parallel=True,
                                          tensor_rank=1, pipeline_rank=0))["model"]
    assert torch.equal(rank1["decoder.layers.0.mixer.dt_bias"], source["backbone.layers.0.mixer.dt_bias"][4:])
    assert rank1["decoder.layers.0.mixer.in_proj.weight"].shape == ((2 * 64 + 2 * 2 * 8 + 8) // 2, 32)


def test_megatron_lm_names_round_trip(converted):
    """Ours -> Megatron-LM's megatron-core files (TE names) -> ours -> HF: the source bit for bit."""
    run_convert(converted / "tp2pp2", converted / "core", "megatron", "core")
    names = load_file(get_checkpoint_name(str(converted / "core"), 0, release=True, pipeline_parallel=True,
                                          tensor_rank=0, pipeline_rank=0))["model"]
    assert "decoder.layers.0.mixer.in_proj.layer_norm_weight" in names
    assert "decoder.layers.0.norm.weight" not in names
    run_convert(converted / "core", converted / "core-back", "core", "hf", "--true-vocab-size", "200")
    source, back = _safetensors(converted / "hf"), _safetensors(converted / "core-back")
    assert sorted(source) == sorted(back) and all(torch.equal(source[k], back[k]) for k in source)


def test_pretrain_mamba_load_hf_starts_from_the_hf_weights(converted, tmp_path):
    """pretrain_mamba.py --load-hf: after one step at lr 0 the saved checkpoint holds HF's tensors exactly."""
    import pretrain_mamba
    from megatron.convert.huggingface import state_dict_from_hf
    from megatron.training.initialize import reset_megatron

    ckpt = str(tmp_path / "ckpt")
    try:
        pretrain_mamba.main(["--load-hf", str(converted / "hf"), "--micro-batch-size", "2", "--global-batch-size", "2",
                             "--train-iters", "1", "--lr", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", "199", "--seq-length", "16", "--eval-iters", "0", "--save", ckpt,
                             "--save-interval", "1", "--ckpt-format", "torch"])
    finally:
        reset_megatron()
    saved = load_file(get_checkpoint_name(ckpt, 1))["model"]
    hf = _safetensors(converted / "hf")
    expected = state_dict_from_hf(hf, transformers.AutoConfig.from_pretrained(str(converted / "hf")))
    assert sorted(k for k in saved if not k.endswith("_extra_state")) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(saved[name][:tensor.shape[0]], tensor), name  # (the vocabulary padded to 256 rows)
