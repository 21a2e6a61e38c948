"""megatron/training/checkpoint_fit.py: the architecture args compared when a checkpoint is loaded, and the
ones --use-checkpoint-args takes from it."""

from argparse import Namespace

import pytest

from megatron.training.checkpoint_fit import apply_checkpoint_args, check_checkpoint_args
from megatron.training.checkpoint_safety import CheckpointError
from tests.helpers.args import run_args

LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128, kv_channels=8,
             max_position_embeddings=32, padded_vocab_size=128, untie_embeddings_and_output_weights=True,
             add_bias_linear=False, add_qkv_bias=False, group_query_attention=True, num_query_groups=2,
             normalization="RMSNorm", apply_layernorm_1p=False, qk_layernorm=False, swiglu=True,
             squared_relu=False, position_embedding_type="rope", rotary_percent=1.0, rotary_interleaved=False,
             rotary_base=10000, use_rope_scaling=False, rope_scaling_factor=8.0,
             rotary_seq_len_interpolation_factor=None)


def check(saved, **run):
    check_checkpoint_args(Namespace(**saved), run_args(**dict(saved, **run)), "ckpt/iter_0000010")


@pytest.mark.parametrize("change, words", [
    (dict(normalization="LayerNorm"), "saved with --normalization RMSNorm but this run has --normalization LayerNorm"),
    (dict(swiglu=False), "saved with --swiglu but this run has no --swiglu"),
    (dict(swiglu=False, squared_relu=True), "saved with no --squared-relu but this run has --squared-relu"),
    (dict(num_query_groups=4), "saved with 2 key/value groups (--group-query-attention --num-query-groups) but "
                               "this run has 4 key/value groups"),
    (dict(group_query_attention=False), "saved with 2 key/value groups (--group-query-attention "
                                        "--num-query-groups) but this run has 8 key/value groups"),
    (dict(position_embedding_type="alibi"), "--position-embedding-type rope but this run has "
                                            "--position-embedding-type alibi"),
    (dict(rotary_percent=0.5), "saved with --rotary-percent 1.0 but this run has --rotary-percent 0.5"),
    (dict(rotary_interleaved=True), "saved with no --rotary-interleaved but this run has --rotary-interleaved"),
    (dict(qk_layernorm=True), "saved with no --qk-layernorm but this run has --qk-layernorm"),
    (dict(add_qkv_bias=True), "saved with no --add-qkv-bias but this run has --add-qkv-bias"),
    (dict(apply_layernorm_1p=True), "saved with no --apply-layernorm-1p but this run has --apply-layernorm-1p"),
    (dict(kv_channels=16), "saved with --kv-channels 8 but this run has --kv-channels 16"),
])
def test_an_architecture_mismatch_names_the_flag(change, words):
    with pytest.raises(CheckpointError) as error:
        check(LLAMA, **change)
    assert words in str(error.value) and "--use-checkpoint-args" in str(error.value)


@pytest.mark.parametrize("change", [
    dict(rotary_base=500000), dict(use_rope_scaling=True, rope_scaling_factor=16.0),
    dict(rotary_seq_len_interpolation_factor=4),  # a long-context fine-tune changes these on purpose
])
def test_what_may_differ_on_load(change):
    check(LLAMA, **change)
    # --group-query-attention with one group per head is plain multi-head attention
    check(dict(LLAMA, num_query_groups=8), group_query_attention=False, num_query_groups=1)


def test_what_is_not_compared_where_it_changes_nothing():
    gpt = dict(LLAMA, position_embedding_type="learned_absolute", group_query_attention=False, add_bias_linear=True)
    check(gpt, rotary_percent=0.5, rotary_interleaved=True)  # rotary settings without rope
    check(gpt, add_qkv_bias=True)  # the QKV projection has its bias anyway
    check(gpt, num_query_groups=4)  # ignored without --group-query-attention: 8 groups both ways
    old = {key: value for key, value in LLAMA.items() if key not in ("qk_layernorm", "rotary_interleaved")}
    check(old, qk_layernorm=True, rotary_interleaved=True)  # a checkpoint without those args


def test_use_checkpoint_args_takes_the_architecture():
    args = run_args(num_layers=None, hidden_size=None, swiglu=False, normalization="LayerNorm",
                    position_embedding_type="learned_absolute", rotary_base=10000, group_query_attention=False,
                    num_query_groups=1)
    lines = []
    apply_checkpoint_args(args, Namespace(**dict(LLAMA, rotary_base=500000)), "ckpt", log=lines.append)
    assert (args.swiglu, args.normalization, args.position_embedding_type) == (True, "RMSNorm", "rope")
    assert (args.group_query_attention, args.num_query_groups, args.rotary_base) == (True, 2, 500000)
    assert "  overriding rotary_base = 10000 with 500000 from the checkpoint ckpt" in lines
