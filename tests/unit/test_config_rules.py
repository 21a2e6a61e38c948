"""The rules between settings are written once, on their config groups (rules() of ModelConfig,
RegularizationConfig, TrainingConfig, LearningRateConfig, CheckpointConfig, MixedPrecisionConfig, DataConfig,
MoEConfig, LoRAConfig, ...) or, between groups, in megatron/training/config/between.py: a config built in
Python, with no command line, is refused with the very line validate_args gives the same values as flags;
--yaml-cfg checks its values alone and leaves the rules to the whole run (file and command line together)."""

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
    ("seq-length", dict(seq_length=0), "--seq-length 0"),
    # model: ModelConfig, and its positions against the sequence (between groups)
    ("num-layers", dict(num_layers=0), "--num-layers 0"),
    ("ffn-hidden-size", dict(ffn_hidden_size=-1), "--ffn-hidden-size -1"),
    ("kv-channels", dict(kv_channels=0), "--kv-channels 0"),
    ("norm-epsilon", dict(norm_epsilon=0.0), "--norm-epsilon 0"),
    ("heads-split-hidden", dict(hidden_size=18, num_attention_heads=4), "--hidden-size 18 --num-attention-heads 4"),
    ("positions-cover-sequence", dict(max_position_embeddings=16, seq_length=32), "--max-position-embeddings 16"),
    ("init-method-std", dict(init_method_std=0.0), "--init-method-std 0"),
    ("vocab-divisible-by", dict(make_vocab_size_divisible_by=0), "--make-vocab-size-divisible-by 0"),
    # dropout, weight decay and the optimizer's constants: RegularizationConfig
    ("hidden-dropout", dict(hidden_dropout=1.0), "--hidden-dropout 1"),
    ("attention-dropout", dict(attention_dropout=-0.1), "--attention-dropout -0.1"),
    ("weight-decay", dict(weight_decay=-0.1), "--weight-decay -0.1"),
    ("constant-style-start", dict(start_weight_decay=0.1), "--start-weight-decay 0.1"),
    ("linear-style-needs-end", dict(weight_decay_incr_style="linear", start_weight_decay=0.0),
     "--weight-decay-incr-style linear --start-weight-decay 0"),
    ("cosine-style-start", dict(weight_decay_incr_style="cosine", start_weight_decay=-1.0, end_weight_decay=0.1),
     "--start-weight-decay -1 --end-weight-decay 0.1 --weight-decay-incr-style cosine"),
    ("adam-beta2", dict(adam_beta2=1.0), "--adam-beta2 1"),
    ("sgd-momentum-nan", dict(sgd_momentum=float("nan")), "--sgd-momentum nan"),
    ("adam-eps", dict(adam_eps=0.0), "--adam-eps 0"),
    ("clip-grad", dict(clip_grad=-1.0), "--clip-grad -1"),
    # learning rate: LearningRateConfig, its lengths against the training length's unit (between groups)
    ("lr", dict(lr=-0.001), "--lr -0.001"),
    ("lr-decay-iters", dict(lr_decay_iters=0), "--lr-decay-iters 0"),
    ("min-lr-over-lr", dict(lr=1e-3, min_lr=1e-2), "--min-lr 1e-2"),
    ("warmup-fraction-range", dict(lr_warmup_fraction=1.5), "--lr-warmup-fraction 1.5"),
    ("warmup-fraction-and-samples", dict(lr_warmup_fraction=0.1, lr_warmup_samples=8),
     "--lr-warmup-fraction 0.1 --lr-warmup-samples 8"),
    ("wsd-decay-length", dict(lr_decay_style="WSD"), "--lr-decay-style WSD"),
    ("iteration-schedule-by-samples", dict(train_samples=64, lr_warmup_iters=4), "--lr-warmup-iters 4"),
    # training length: TrainingConfig
    ("iters-and-samples", dict(train_iters=10, train_samples=64), "--train-iters 10"),
    ("train-samples", dict(train_samples=0), "--train-samples 0"),
    # checkpointing: CheckpointConfig
    ("save-needs-interval", dict(save="ckpt"), "--save ckpt"),
    ("save-interval", dict(save_interval=0), "--save-interval 0"),
    ("ckpt-format", dict(ckpt_format="zarr"), "--ckpt-format zarr"),
    ("async-save-format", dict(async_save=True, ckpt_format="torch"), "--async-save --ckpt-format torch"),
    ("finetune-needs-load", dict(finetune=True), "--finetune"),
    ("use-checkpoint-args-needs-load", dict(use_checkpoint_args=True), "--use-checkpoint-args"),
    # LoRA: LoRAConfig, and no experts (between groups)
    ("lora-rank", dict(lora_rank=-1), "--lora-rank -1"),
    ("lora-alpha", dict(lora_rank=4, lora_alpha=0.0), "--lora-alpha 0 --lora-rank 4"),
    ("lora-dropout", dict(lora_rank=4, lora_dropout=1.0), "--lora-dropout 1 --lora-rank 4"),
    ("lora-targets", dict(lora_rank=4, lora_target_modules=["linear_qkv", "linear_qkv"]),
     "--lora-target-modules linear_qkv linear_qkv --lora-rank 4"),
    ("lora-with-experts", dict(lora_rank=4, num_experts=2), "--lora-rank 4 --num-experts 2"),
    # mixture of experts: MoEConfig
    ("expert-parallel-size", dict(expert_model_parallel_size=0), "--expert-model-parallel-size 0"),
    ("expert-tensor-parallel-size", dict(num_experts=2, expert_tensor_parallel_size=0),
     "--expert-tensor-parallel-size 0 --num-experts 2"),
    ("flex-dispatcher", dict(num_experts=2, moe_token_dispatcher_type="flex"),
     "--moe-token-dispatcher-type flex --num-experts 2"),
    # hybrid models: the pattern against --num-layers, the experts and --spec (between groups)
    ("hybrid-ratio", dict(num_layers=2, hybrid_attention_ratio=1.5), "--hybrid-attention-ratio 1.5"),
    ("hybrid-pattern-length", dict(num_layers=2, hybrid_override_pattern="MMM"), "--hybrid-override-pattern MMM"),
    ("hybrid-moe-needs-experts", dict(num_layers=2, hybrid_override_pattern="ME"), "--hybrid-override-pattern ME"),
    ("hybrid-experts-need-moe", dict(num_layers=2, hybrid_override_pattern="M*", num_experts=2),
     "--num-experts 2 --hybrid-override-pattern M*"),
    ("hybrid-moe-layer-freq", dict(num_layers=2, hybrid_override_pattern="ME", num_experts=2, moe_layer_freq=2),
     "--moe-layer-freq 2 --hybrid-override-pattern ME --num-experts 2"),
    ("hybrid-spec", dict(num_layers=2, hybrid_override_pattern="M*",
                         spec=["megatron.model.layer_specs", "get_gpt_layer_spec"]),
     "--spec megatron.model.layer_specs get_gpt_layer_spec --hybrid-override-pattern M*"),
    # the parallel sizes and timeouts: DistributedConfig; the data-parallel options and the seed (between groups)
    ("tensor-parallel-size", dict(tensor_model_parallel_size=0), "--tensor-model-parallel-size 0"),
    ("cpu-threads", dict(cpu_threads=0), "--cpu-threads 0"),
    ("watchdog-over-timeout", dict(watchdog_seconds=700.0), "--watchdog-seconds 700"),
    ("hierarchical-cp", dict(hierarchical_context_parallel_sizes=[1, 1]), "--hierarchical-context-parallel-sizes 1 1"),
    ("ddp-bucket-size", dict(ddp_bucket_size=0), "--ddp-bucket-size 0"),
    ("per-token-loss-averaged", dict(calculate_per_token_loss=True, ddp_average_in_collective=True),
     "--ddp-average-in-collective --calculate-per-token-loss"),
    ("overlap-param-gather", dict(overlap_param_gather=True), "--overlap-param-gather"),
    ("overlap-param-gather-grad-reduce", dict(overlap_param_gather=True, use_distributed_optimizer=True),
     "--overlap-param-gather --use-distributed-optimizer"),
    ("seed", dict(seed=0), "--seed 0"),
    # intervals: TrainingConfig, ValidationConfig, LoggingConfig
    ("log-interval", dict(log_interval=0), "--log-interval 0"),
    ("exit-duration", dict(exit_duration_in_mins=-1.0), "--exit-duration-in-mins -1"),
    ("eval-iters", dict(eval_iters=-1), "--eval-iters -1"),
    ("tensorboard-queue-size", dict(tensorboard_queue_size=0), "--tensorboard-queue-size 0"),
]

# Rules of a run trained by iterations: BASE with --train-iters for --train-samples.
BASE_BY_ITERATIONS = [*BASE[:BASE.index("--train-samples")], "--train-iters", "10",
                      *BASE[BASE.index("--train-samples") + 2:]]
CASES_BY_ITERATIONS = [
    ("rampup-by-iterations", dict(train_iters=10, rampup_batch_size=["2", "2", "8"]), "--rampup-batch-size 2 2 8"),
    ("sample-schedule-by-iterations", dict(train_iters=10, lr_decay_samples=64), "--lr-decay-samples 64"),
    ("warmup-past-decay", dict(train_iters=10, lr_warmup_iters=10), "--lr-warmup-iters 10"),
    ("warmup-past-lr-decay-iters", dict(train_iters=10, lr_warmup_iters=4, lr_decay_iters=3),
     "--lr-warmup-iters 4 --lr-decay-iters 3"),
]


@pytest.fixture(autouse=True)
def single_process(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # (no dataset file: the rules refuse before any file is looked for)


def _cli_message(flags: list, base: list = BASE) -> str:
    with pytest.raises(ArgsError) as refused:
        parse_and_validate_args(argv=[*base, *flags])
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


@pytest.mark.parametrize("values, flags", [case[1:] for case in CASES_BY_ITERATIONS],
                         ids=[case[0] for case in CASES_BY_ITERATIONS])
def test_a_config_trained_by_iterations_gets_the_command_lines_line(values, flags):
    message = _cli_message(flags.split(), base=BASE_BY_ITERATIONS)
    assert flags.split()[0] in message
    with pytest.raises(ConfigError) as refused:
        MegatronConfig.from_values(values, where="")
    assert str(refused.value) == message


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
