"""The precision, batch-size and data rules are written once, on their config groups (rules() of
MixedPrecisionConfig, TrainingConfig, DataConfig): a config built in Python, with no command line, is
refused with the very line validate_args gives the same values as flags; --yaml-cfg checks its values
alone and leaves the rules to the whole run (file and command line together)."""

import pytest

from megatron.training.arguments import ArgsError, argv_from_config, parse_and_validate_args
from megatron.training.config import ConfigError, MegatronConfig

# A small valid run; each case adds the flags that break one rule. (No data flag: validate_args takes
# a run without one, as Megatron does.)
BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--max-position-embeddings", "32",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-samples", "64", "--lr", "1e-3",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]

# (id, the settings in Python, the same settings as flags): one row per rule of each family
CASES = [
    # precision: MixedPrecisionConfig
    ("fp16-and-bf16", dict(fp16=True, bf16=True), "--fp16 --bf16"),
    ("fp16-lm-cross-entropy", dict(fp16_lm_cross_entropy=True), "--fp16-lm-cross-entropy"),
    ("fp32-residual", dict(fp32_residual_connection=True), "--fp32-residual-connection"),
    ("loss-scale", dict(loss_scale=0.0), "--loss-scale 0"),
    ("hysteresis", dict(hysteresis=-1), "--hysteresis -1"),
    ("min-over-initial-loss-scale", dict(min_loss_scale=8.0, initial_loss_scale=4.0),
     "--min-loss-scale 8 --initial-loss-scale 4"),
    # batch sizes: TrainingConfig
    ("micro-batch", dict(micro_batch_size=0), "--micro-batch-size 0"),
    ("global-batch", dict(global_batch_size=-4), "--global-batch-size -4"),
    ("rampup-arity", dict(rampup_batch_size=["2", "2"]), "--rampup-batch-size 2 2"),
    ("rampup-integers", dict(rampup_batch_size=["2", "x", "8"]), "--rampup-batch-size 2 x 8"),
    ("rampup-range", dict(rampup_batch_size=["0", "2", "8"]), "--rampup-batch-size 0 2 8"),
    ("rampup-start", dict(global_batch_size=8, rampup_batch_size=["16", "2", "8"]),
     "--global-batch-size 8 --rampup-batch-size 16 2 8"),
    ("rampup-increment", dict(global_batch_size=8, rampup_batch_size=["2", "4", "8"]),
     "--global-batch-size 8 --rampup-batch-size 2 4 8"),
    # data: DataConfig
    ("empty-data-path", dict(data_path=[]), "--data-path"),
    ("bad-blend", dict(data_path=["0.5", "a", "0.5"]), "--data-path 0.5 a 0.5"),
    ("bad-per-split-blend", dict(valid_data_path=["0.5", "a", "0.5"]), "--valid-data-path 0.5 a 0.5"),
    ("data-path-and-per-split", dict(data_path=["a"], train_data_path=["b"]), "--data-path a --train-data-path b"),
    ("mock-and-data-path", dict(mock_data=True, data_path=["a"]), "--mock-data --data-path a"),
    ("split-with-per-split", dict(train_data_path=["a"], split="9,1,0"), "--train-data-path a --split 9,1,0"),
    ("bad-split", dict(data_path=["a"], split="9,x"), "--split 9,x --data-path a"),
    ("sft-prompt-format", dict(sft=True, data_path=["a"], sft_tokenizer_prompt_format="nope"),
     "--sft --data-path a --sft-tokenizer-prompt-format nope"),
    ("sft-mock", dict(sft=True, mock_data=True), "--sft --mock-data"),
    ("sft-eod-mask", dict(sft=True, data_path=["a"], eod_mask_loss=True), "--sft --data-path a --eod-mask-loss"),
    ("num-workers", dict(num_workers=-1), "--num-workers -1"),
]


@pytest.fixture(autouse=True)
def single_process(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # (no dataset file: the rules refuse before any file is looked for)


def _cli_message(flags: list) -> str:
    with pytest.raises(ArgsError) as refused:
        parse_and_validate_args(argv=[*BASE, *flags])
    return str(refused.value)


@pytest.mark.parametrize("values, flags", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_a_config_built_in_python_gets_the_command_lines_line(values, flags):
    message = _cli_message(flags.split())
    assert flags.split()[0] in message  # the line names the flag (the rule's own, not another failure)
    with pytest.raises(ConfigError) as refused:
        MegatronConfig.from_values(values, where="")
    assert str(refused.value) == message
    with pytest.raises(ConfigError) as refused:  # where the values came from, then the same line
        MegatronConfig.from_values(values)
    assert str(refused.value) == f"config: {message}"


def test_a_config_set_field_by_field_is_checked_as_the_flags():
    config = MegatronConfig()
    config.check()  # every default passes every rule
    config.mixed_precision.bf16 = True
    config.mixed_precision.fp32_residual_connection = True
    config.check()
    config.mixed_precision.fp16 = True
    with pytest.raises(ConfigError, match=r"^run\.yaml: --fp16 and --bf16 cannot both be given; choose one$"):
        MegatronConfig.from_yaml(config.to_yaml(), where="run.yaml")
    # the Python API runs the command line of the config: the same line again, before anything is built
    run = MegatronConfig.from_values(dict(num_layers=2, hidden_size=16, num_attention_heads=2,
                                          max_position_embeddings=32, seq_length=32, micro_batch_size=2,
                                          train_samples=64, lr=1e-3, tokenizer_type="NullTokenizer",
                                          vocab_size=100))
    run.data.sft, run.data.mock_data = True, True
    with pytest.raises(ConfigError) as in_python:
        run.check(where="")
    with pytest.raises(ArgsError) as on_the_command_line:
        parse_and_validate_args(argv=argv_from_config(run))
    assert str(in_python.value) == str(on_the_command_line.value) == \
        "--sft cannot be combined with --mock-data: give --data-path with JSON-lines files"


def test_a_derived_global_batch_size_is_held_to_the_same_rule():
    # no --global-batch-size: it is micro-batch x data-parallel = 2, under the ramp-up's start
    assert _cli_message(["--rampup-batch-size", "4", "2", "8"]) == \
        "--rampup-batch-size start (4) must be <= --global-batch-size (2)"


def test_yaml_values_are_checked_alone_and_the_rules_on_the_whole_run(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("fp16_lm_cross_entropy: true\nmicro_batch_size: 2\n")
    args = parse_and_validate_args(argv=[*BASE, "--yaml-cfg", str(path), "--fp16"])  # --fp16 from the flags
    assert args.fp16 and args.fp16_lm_cross_entropy
    assert _cli_message(["--yaml-cfg", str(path)]) == \
        "--fp16-lm-cross-entropy needs --fp16 (lm cross entropy in fp16 is only for fp16 runs)"
    path.write_text("normalization: FancyNorm\n")  # a value alone: still refused naming the file
    with pytest.raises(ArgsError, match=rf"^--yaml-cfg {path}: --normalization: 'FancyNorm' is not one of "):
        parse_and_validate_args(argv=[*BASE, "--yaml-cfg", str(path)])
