"""Typed settings (megatron/training/config): the dataclasses generate the flags, and a config goes
to and from a command line's Namespace, dicts, JSON and YAML unchanged. The whole parser's equality
with the flags before the move is tests/unit/test_parser_snapshot.py."""

import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from megatron.training.arguments import args_from_config, build_parser, parse_args
from megatron.training.config import GROUPS, ConfigError, ConfigGroup, MegatronConfig, add_group, setting

ARGV = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--data-path", "1", "a", "2", "b",
        "--moe-layer-freq", "([1]*3+[0])*2", "--no-check-for-nan-in-loss-and-grad", "--disable-bias-linear",
        "--lr", "3e-4", "--norm-epsilon", "1e-6", "--tokenizer-type", "GPT2BPETokenizer", "--dry-run"]


@dataclass
class _Example(ConfigGroup, title="example"):
    """Not a real group: what each kind of field generates."""

    micro_batch_count: int | None = None
    """How many."""
    use_thing: bool = False
    """Switch the thing on."""
    keep_other: bool = setting(True, flags=("--no-other",))
    """Switch the other off."""
    names: list[str] | None = setting(None, nargs="*")
    """Some names."""
    ratio: float = setting(0.5, flags=("--ratio", "--proportion"), choices=(0.25, 0.5))
    """A ratio."""
    undocumented: str = "x"


def test_a_field_generates_its_flag_type_action_default_and_help():
    parser = argparse.ArgumentParser()
    add_group(parser, _Example)
    actions = {a.dest: a for a in parser._actions}
    group = next(g for g in parser._action_groups if g.title == "example")
    assert [a.dest for a in group._group_actions] == [f.name for f in dataclasses.fields(_Example)]
    count = actions["micro_batch_count"]
    assert count.option_strings == ["--micro-batch-count"] and count.type is int and count.default is None
    assert count.help == "How many."
    assert type(actions["use_thing"]).__name__ == "_StoreTrueAction" and actions["use_thing"].default is False
    assert type(actions["keep_other"]).__name__ == "_StoreFalseAction"
    assert actions["keep_other"].option_strings == ["--no-other"] and actions["keep_other"].default is True
    assert actions["names"].nargs == "*" and actions["names"].type is None
    assert actions["ratio"].option_strings == ["--ratio", "--proportion"] and actions["ratio"].choices == (0.25, 0.5)
    assert actions["undocumented"].help is None and actions["undocumented"].type is str
    args = parser.parse_args(["--micro-batch-count", "3", "--use-thing", "--no-other", "--names", "a", "b",
                              "--proportion", "0.25"])
    assert _Example.from_namespace(args) == _Example(3, True, False, ["a", "b"], 0.25, "x")


def test_every_dest_of_the_groups_is_one_field_and_the_defaults_agree():
    defaults = parse_args(argv=[])
    seen = set()
    for group in GROUPS:
        for field in dataclasses.fields(group):
            assert field.name not in seen, f"{field.name} in two groups"
            seen.add(field.name)
        assert group.from_namespace(defaults) == group(), group.__name__


def test_local_rank_defaults_to_the_environment_when_the_parser_is_built(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert parse_args(argv=[]).local_rank == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert parse_args(argv=[]).local_rank == 0


def test_a_command_line_goes_to_a_config_and_back_unchanged():
    args = parse_args(argv=ARGV)
    config = MegatronConfig.from_namespace(args)
    assert config.model.num_layers == 2 and config.model.add_bias_linear is False
    assert config.data.data_path == ["1", "a", "2", "b"]
    assert config.moe.moe_layer_freq == [1, 1, 1, 0, 1, 1, 1, 0]
    assert config.training.check_for_nan_in_loss_and_grad is False
    assert config.learning_rate.lr == 3e-4 and config.model.norm_epsilon == 1e-6
    assert config.extra["dry_run"] is True  # the planner's flag, in no group
    assert vars(args_from_config(config)) == vars(args)


def test_yaml_json_and_dicts_round_trip(tmp_path):
    config = MegatronConfig.from_namespace(parse_args(argv=ARGV))
    assert MegatronConfig.from_yaml(config.to_yaml()) == config
    assert MegatronConfig.from_json(config.to_json()) == config
    assert MegatronConfig.from_dict(config.to_dict()) == config
    for name in ("run.yaml", "run.json"):
        config.save(tmp_path / name)
        assert MegatronConfig.load(tmp_path / name) == config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "run.yaml"]  # no temporaries left


def test_a_partial_file_takes_the_defaults_for_the_rest():
    config = MegatronConfig.from_yaml("model:\n  num_layers: 4\ntraining:\n  micro_batch_size: 2\n")
    assert config.model.num_layers == 4 and config.training.micro_batch_size == 2
    assert config.model.hidden_size is None and config.learning_rate == MegatronConfig().learning_rate
    args = args_from_config(config)
    assert args.num_layers == 4 and args.micro_batch_size == 2 and args.lr == parse_args(argv=[]).lr


@pytest.mark.parametrize("text, message", [
    ("model:\n  num_layer: 4\n", "run.yaml: model.num_layer is not a setting of ModelConfig (its flag would be --num-layer)"),
    ("modle:\n  num_layers: 4\n", "run.yaml: unknown group 'modle'"),
    ("model: 4\n", "run.yaml: group 'model' must be a mapping of settings"),
    ("- 1\n- 2\n", "run.yaml: expected a mapping of groups"),
    ("model:\n  num_layers: [4\n", "run.yaml: not YAML at line"),
    ("!!python/object/apply:os.system ['true']\n", "run.yaml: not YAML"),
])
def test_a_bad_file_is_one_line_naming_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        MegatronConfig.load(path)
    assert str(error.value).startswith(str(tmp_path / message.split(":")[0]) + ":" + message.split(":", 1)[1])
    assert "\n" not in str(error.value)


def test_the_parser_is_generated_from_the_groups():
    titles = [g.title for g in build_parser()._action_groups]
    assert titles[2:2 + len(GROUPS)] == [group.title for group in GROUPS]


# Each MoE rule is written once, in TransformerConfig._check_moe: the command line reports the same
# rule with flags where the config names fields.
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "64", "--train-iters", "1", "--disable-bias-linear"]


@pytest.mark.parametrize("argv, kwargs, fields", [
    (["--num-experts", "4", "--moe-router-topk", "5"], dict(moe_router_topk=5), ["moe_router_topk", "num_moe_experts"]),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0,1]"], dict(moe_layer_freq=[1, 0, 1]),
     ["moe_layer_freq", "num_layers"]),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], dict(moe_pad_expert_input_to_capacity=True),
     ["moe_pad_expert_input_to_capacity", "moe_expert_capacity_factor"]),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "1", "--moe-router-load-balancing-type", "sinkhorn",
      "--moe-aux-loss-coeff", "0"],
     dict(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0),
     ["moe_expert_capacity_factor", "moe_router_load_balancing_type"]),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "30", "--expert-tensor-parallel-size", "4",
      "--tensor-model-parallel-size", "4", "--sequence-parallel"],
     dict(moe_ffn_hidden_size=30, expert_tensor_parallel_size=4, tensor_model_parallel_size=4, sequence_parallel=True),
     ["moe_ffn_hidden_size", "expert_tensor_parallel_size"]),
])
def test_a_moe_rule_is_the_configs_on_the_command_line_too(monkeypatch, argv, kwargs, fields):
    from megatron.model.transformer_config import ConfigRuleError, TransformerConfig
    from megatron.training.arguments import ArgsError, validate_args
    from megatron.training.config_builders import config_flag

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ArgsError) as cli:
        validate_args(parse_args(argv=[*BASE, *argv]))
    with pytest.raises(ConfigRuleError) as config:
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=4, **kwargs)
    assert config.value.fields() == fields
    assert str(cli.value) == config.value.render(config_flag)
    assert all(config_flag(f) in str(cli.value) for f in fields) and all(f in str(config.value) for f in fields)
