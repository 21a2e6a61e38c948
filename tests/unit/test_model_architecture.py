"""megatron/training/config/architecture.py: one frozen description of a model's architecture, read from
a run's validated args or from the args an older checkpoint stored; and the typed config's check of
values that do not come from a command line (YAML, JSON, the converter's)."""

import dataclasses
from argparse import Namespace

import pytest

from megatron.training.config import ConfigError, MegatronConfig
from megatron.training.config.architecture import LABELS, ModelArchitecture
from tests.helpers.args import run_args

LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=96, kv_channels=8,
             max_position_embeddings=64, padded_vocab_size=128, seq_length=32, group_query_attention=True,
             num_query_groups=2, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
             position_embedding_type="rope", untie_embeddings_and_output_weights=True)


def test_it_is_frozen_and_holds_the_effective_values():
    arch = ModelArchitecture.from_args(run_args(**LLAMA))
    with pytest.raises(dataclasses.FrozenInstanceError):
        arch.num_layers = 3
    assert (arch.num_query_groups, arch.rotary_percent, arch.add_qkv_bias, arch.num_experts) == (2, 1.0, False, None)
    # without --group-query-attention one group per head; without RoPE no rotary settings; with linear
    # biases the QKV bias flag shapes nothing; a dense model has no MoE settings
    plain = ModelArchitecture.from_args(run_args(**dict(LLAMA, group_query_attention=False, add_bias_linear=True,
                                                        position_embedding_type="learned_absolute",
                                                        moe_router_topk=4)))
    assert (plain.num_query_groups, plain.rotary_percent, plain.add_qkv_bias, plain.moe_router_topk) == \
        (8, None, None, None)
    moe = ModelArchitecture.from_args(run_args(**dict(LLAMA, num_experts=4, moe_layer_freq=[1, 0])))
    assert (moe.moe_ffn_hidden_size, moe.moe_layers) == (96, [1])


def test_a_run_reads_attributes_a_checkpoint_may_lack():
    with pytest.raises(AttributeError):  # a run's args have every setting: none is guessed
        ModelArchitecture.from_args(Namespace(**LLAMA))
    old = ModelArchitecture.from_checkpoint_args(Namespace(num_layers=2, hidden_size=64, num_attention_heads=8))
    assert old.ffn_hidden_size is None and old.num_query_groups == 8  # unknown; no GQA then: a group per head
    # unknown values are not compared; known ones are, in LABELS' order
    run = ModelArchitecture.from_args(run_args(**LLAMA))
    assert old.differences(run) == [("num_query_groups", 8, 2)]
    assert [name for name, _, _ in ModelArchitecture.from_checkpoint_args(
        Namespace(**dict(LLAMA, hidden_size=32, normalization="LayerNorm"))).differences(run)] == \
        [name for name in LABELS if name in ("hidden_size", "normalization")]
    assert ModelArchitecture.from_checkpoint_args(Namespace(**LLAMA)).differences(run) == []


def test_flops_come_from_the_architecture():
    arch = ModelArchitecture.from_args(run_args(**LLAMA))
    # (the dense count is worked out GEMM by GEMM in test_model_flops) an MoE layer runs top-k experts: two
    # 48-wide experts per token cost what the dense 96-wide MLP costs
    moe = dataclasses.replace(arch, num_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=48, moe_router_topk=2)
    assert moe.num_floating_point_operations(3) == arch.num_floating_point_operations(3)
    shared = dataclasses.replace(moe, moe_shared_expert_intermediate_size=96)
    assert shared.num_floating_point_operations(1) > arch.num_floating_point_operations(1)


@pytest.mark.parametrize("values, message", [
    (dict(model=dict(normalization="FancyNorm")), "run.yaml: --normalization: 'FancyNorm' is not one of "
                                                  "LayerNorm, RMSNorm"),
    (dict(model=dict(num_layers="2")), "run.yaml: --num-layers: '2' is not an int"),
    (dict(model=dict(swiglu=1)), "run.yaml: --swiglu: 1 is not a bool"),
    (dict(training=dict(micro_batch_size=2.0)), "run.yaml: --micro-batch-size: 2.0 is not an int"),
])
def test_a_config_file_value_the_flag_would_refuse_is_one_line(values, message):
    with pytest.raises(ConfigError) as refused:
        MegatronConfig.from_dict(values, where="run.yaml")
    assert str(refused.value) == message


def test_every_default_and_a_parsed_command_line_pass_the_check():
    MegatronConfig().check()
    config = MegatronConfig.from_values(dict(normalization="RMSNorm", lr=1, moe_layer_freq=[1, 0]))
    assert (config.model.normalization, config.learning_rate.lr, config.moe.moe_layer_freq) == ("RMSNorm", 1, [1, 0])
