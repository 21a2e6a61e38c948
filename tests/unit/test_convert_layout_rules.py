"""The converter's name-based layout rules (megatron/convert/layout_rules.py) against the layers' own
partition attributes, for every key of models built at each TP rank (parallel_state patched); the
vocabulary padding, the target sizes and the saver's checks of the tensor stream."""

import argparse
import json
import unittest.mock

import pytest
import torch
import torch.nn.functional as F

from megatron.training.checkpoint_safety import CheckpointError
from megatron.convert.layout_rules import UnknownTensorError, padded_vocab_size, tensor_layout
from megatron.convert.megatron_format import (
    Metadata, check_target, target_vocab_size, true_vocab_size_of, write_tensors,
)
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layout import is_tensor_parallel, partition_indices
from megatron.model import GPTModel, TransformerConfig

HEADS, HIDDEN = 8, 32


def _args(groups, swiglu, bias, qk_norm) -> argparse.Namespace:
    return argparse.Namespace(num_attention_heads=HEADS, hidden_size=HIDDEN, kv_channels=None, swiglu=swiglu,
                              group_query_attention=groups is not None, num_query_groups=groups,
                              add_bias_linear=bias, qk_layernorm=qk_norm)


def _rank_model(args, tp, rank):
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=64,
                               num_query_groups=args.num_query_groups, tensor_model_parallel_size=tp,
                               add_bias_linear=args.add_bias_linear, gated_linear_unit=args.swiglu,
                               activation_func=F.silu if args.swiglu else F.gelu, qk_layernorm=args.qk_layernorm,
                               perform_initialization=False)
    with unittest.mock.patch.multiple(parallel_state, get_tensor_model_parallel_world_size=lambda: tp,
                                      get_tensor_model_parallel_rank=lambda: rank):
        return GPTModel(config, vocab_size=128 * tp, max_sequence_length=16, share_embeddings_and_output_weights=False)


def _same(rule: dict, param, tp: int, rank: int) -> bool:
    """Same split: both replicated, or the same global indices along the same dim (the rule may list
    whole groups' rows explicitly where the layer uses the contiguous layout)."""
    if is_tensor_parallel(rule) != is_tensor_parallel(param):
        return False
    if not is_tensor_parallel(param):
        return True
    dim = param.partition_dim
    return rule["partition_dim"] == dim and (partition_indices(rule, param.shape[dim], tp, rank)
                                             == partition_indices(param, param.shape[dim], tp, rank))


@pytest.mark.parametrize("groups, tp", [(None, 2), (2, 2), (2, 4), (1, 4), (1, 8), (4, 8)],
                         ids=["mha-t2", "gqa2-t2", "gqa2-t4-replicated", "mqa-t4", "mqa-t8", "gqa4-t8"])
@pytest.mark.parametrize("swiglu, bias, qk_norm", [(True, False, False), (False, True, True)],
                         ids=["llama", "gpt-biases-qknorm"])
def test_rules_are_the_layers_layouts(groups, tp, swiglu, bias, qk_norm):
    args = _args(groups, swiglu, bias, qk_norm)
    for rank in range(tp):
        model = _rank_model(args, tp, rank)
        for name, param in model.state_dict(keep_vars=True).items():
            assert _same(tensor_layout(name, args, tp, rank), param, tp, rank), (name, rank)


def test_unknown_names_are_refused():
    with pytest.raises(UnknownTensorError, match="decoder.layers.0.mlp.adapter.weight"):
        tensor_layout("decoder.layers.0.mlp.adapter.weight", _args(None, False, True, False), 2, 0)
    # the MoE router is known (replicated): megatron/convert/expert_files.py
    assert tensor_layout("decoder.layers.0.mlp.router.weight", _args(None, False, True, False), 2, 0) == \
        {"tensor_model_parallel": False}


def test_vocabulary_padding_for_the_target():
    args = argparse.Namespace(make_vocab_size_divisible_by=128, padded_vocab_size=50432)  # GPT-2 at TP=2
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert target_vocab_size(Metadata(args, 1, False, 50257), 1) == 50304  # re-padded: Megatron's TP=1 size
    assert target_vocab_size(Metadata(args, 1, False, None), 1) == 50432  # unknown: kept, it splits
    with pytest.raises(CheckpointError, match="pass --true-vocab-size"):
        target_vocab_size(Metadata(args, 1, False, None), 8)  # 50432 is no multiple of 128 x 8


def test_true_vocabulary_size_from_the_flags_the_vocab_file_or_the_args(tmp_path):
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({f"t{i}": i for i in range(300)}))
    gpt2 = argparse.Namespace(tokenizer_type="GPT2BPETokenizer")
    assert true_vocab_size_of(gpt2, None) is None
    assert true_vocab_size_of(gpt2, 290) == 290
    assert true_vocab_size_of(gpt2, None, str(vocab)) == true_vocab_size_of(gpt2, 300, str(vocab)) == 300
    with pytest.raises(CheckpointError, match="--true-vocab-size 290 but --vocab-file .* has 300 entries"):
        true_vocab_size_of(gpt2, 290, str(vocab))
    assert true_vocab_size_of(argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=255), None) == 256
    from_hf = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", hf_config={"vocab_size": 301})
    assert true_vocab_size_of(from_hf, None) == 301 and true_vocab_size_of(from_hf, 290) == 290


def test_target_sizes_that_do_not_split_are_refused():
    args = argparse.Namespace(num_attention_heads=8, hidden_size=32, ffn_hidden_size=48, num_layers=3,
                              group_query_attention=True, num_query_groups=4)
    check_target(args, 4, 3)
    with pytest.raises(CheckpointError, match="3 layers do not split over 2 pipeline stages"):
        check_target(args, 1, 2)
    with pytest.raises(CheckpointError, match="ffn hidden size 48 does not split over 32"):
        check_target(argparse.Namespace(**{**vars(args), "num_attention_heads": 32}), 32, 1)


def test_t5_stages_place_each_stack_on_its_own_stages():
    from megatron.convert.t5_stages import T5Stages

    t5 = argparse.Namespace(num_attention_heads=8, hidden_size=32, ffn_hidden_size=48, num_layers=4,
                            model_family="T5", position_embedding_type="learned_absolute")
    with pytest.raises(CheckpointError, match="the decoder's 4 layers do not split over its 3 pipeline stages"):
        check_target(t5, 1, 5, split=2)
    check_target(t5, 2, 6, split=2)  # encoder 2 x 2 layers, decoder 4 x 1
    stages = T5Stages(num_layers=4, pp=6, split=2)
    fc1 = "layers.{}.mlp.linear_fc1.weight"
    assert stages.placements("encoder." + fc1.format(3)) == [(1, "encoder." + fc1.format(1))]
    assert stages.placements("decoder." + fc1.format(3)) == [(5, "decoder." + fc1.format(0))]
    assert stages.placements("embedding.word_embeddings.weight") == [
        (0, "embedding.word_embeddings.weight"), (2, "embedding.word_embeddings.weight"),
        (5, "lm_head.output_layer.weight")]
    assert stages.placements("embedding.position_embeddings.weight") == [
        (0, "embedding.position_embeddings.weight"), (2, "embedding.position_embeddings.weight")]
    assert [stages.stage_of(n) for n in ("encoder.final_layernorm.weight", "decoder.final_layernorm.weight",
                                         "lm_head.output_layer.bias")] == [1, 5, 5]
    assert stages.global_name(4, "decoder." + fc1.format(0)) == "decoder." + fc1.format(2)
    assert stages.is_copy(2, "embedding.word_embeddings.weight") == "embedding.word_embeddings.weight"
    assert stages.is_copy(5, "lm_head.output_layer.weight") == "embedding.word_embeddings.weight"
    assert T5Stages(num_layers=4, pp=2, split=1).placements("embedding.word_embeddings.weight") == [
        (0, "embedding.word_embeddings.weight"), (1, "embedding.word_embeddings.weight")]  # the head is stage 1's
    relative = argparse.Namespace(**{**vars(t5), "position_embedding_type": "relative"})
    check_target(relative, 1, 2, split=1)
    check_target(relative, 1, 4, split=2)  # each stack's table on each of its stages
    table = "decoder_relative_pos_emb.relative_attention_bias.weight"
    stages = T5Stages(num_layers=4, pp=4, split=2)
    assert stages.placements(table) == [(2, table), (3, table)]
    assert (stages.is_copy(3, table), stages.is_copy(2, table), stages.is_original(2, table)) == (table, None, True)
    with pytest.raises(CheckpointError, match="a pipeline split rank is for T5"):
        check_target(argparse.Namespace(**{**vars(t5), "model_family": None}), 1, 2, split=1)


def _meta(num_layers=2):
    args = argparse.Namespace(num_layers=num_layers, padded_vocab_size=128, make_vocab_size_divisible_by=128,
                              untie_embeddings_and_output_weights=True, num_attention_heads=2, hidden_size=4,
                              swiglu=False)
    return Metadata(args, 1, False, None)


@pytest.mark.parametrize("names, message", [
    (["decoder.layers.0.input_layernorm.weight", "decoder.layers.1.input_layernorm.weight",
      "decoder.layers.0.pre_mlp_layernorm.weight"], "arrived after target stage 0 was written"),
    (["decoder.layers.0.input_layernorm.weight"], r"sent layers \[0\], not 0..1"),
    (["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.input_layernorm.weight"], "twice"),
    (["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
      "decoder.layers.1.input_layernorm.weight"], "layer 1 has keys"),
], ids=["out-of-order", "missing-layer", "twice", "missing-key"])
def test_the_saver_refuses_a_stream_out_of_order_or_incomplete(tmp_path, names, message):
    stream = ((name, torch.ones(4)) for name in names)
    with pytest.raises(CheckpointError, match=message):
        write_tensors(str(tmp_path / "out"), _meta(), stream, tp=1, pp=2)


def test_true_vocabulary_size_from_a_tokenizer_model_as_training_counts_it(sentencepiece_model, bert_vocab_file,
                                                                          tmp_path):
    """SentencePiece: Llama2Tokenizer counts the pieces, SentencePieceTokenizer adds Megatron's special
    tokens; WordPiece: the vocab.txt lines; a HuggingFace tokenizer.json: its size with added tokens."""
    from tokenizers import Tokenizer, models

    from megatron.training.tokenizer.tokenizer import build_tokenizer

    def built(**kwargs):
        return build_tokenizer(argparse.Namespace(padded_vocab_size=0, rank=1, vocab_extra_ids=0, **kwargs)).vocab_size

    llama = argparse.Namespace(tokenizer_type="Llama2Tokenizer")
    assert true_vocab_size_of(llama, None, tokenizer_model=str(sentencepiece_model)) == 32000
    sp = argparse.Namespace(tokenizer_type="SentencePieceTokenizer", vocab_extra_ids=0)
    expected = built(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(sentencepiece_model))
    assert expected > 32000  # <CLS>, <SEP>, <EOD>, <MASK> ... beyond the pieces
    assert true_vocab_size_of(sp, None, tokenizer_model=str(sentencepiece_model)) == expected
    with pytest.raises(CheckpointError, match="--true-vocab-size 32000 but --tokenizer-model .* has"):
        true_vocab_size_of(sp, 32000, tokenizer_model=str(sentencepiece_model))
    bert = argparse.Namespace(tokenizer_type="BertWordPieceLowerCase")
    assert true_vocab_size_of(bert, None, str(bert_vocab_file)) == 30524  # 30522 lines + [BOS], [EOS] as Megatron adds
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(90)}, unk_token="w0"))
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    hf = argparse.Namespace(tokenizer_type="GPT2BPETokenizer")  # no model tokenizer in the args: go by the file
    assert true_vocab_size_of(hf, None, tokenizer_model=str(hf_dir / "tokenizer.json")) == 92
    assert true_vocab_size_of(hf, None, tokenizer_model=str(hf_dir)) == 92
    with pytest.raises(CheckpointError, match="--tokenizer-model .*nosuch.model does not exist"):
        true_vocab_size_of(llama, None, tokenizer_model=str(tmp_path / "nosuch.model"))
    (tmp_path / "bad.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(CheckpointError, match="cannot be read as a Llama2Tokenizer"):
        true_vocab_size_of(llama, None, tokenizer_model=str(tmp_path / "bad.model"))
