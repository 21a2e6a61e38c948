"""megatron/training/arguments.py: Megatron's flag names and defaults, validation errors that name the flag,
derived values, aliases, args_defaults, extra flags and the config builders."""

import copy
import re
import sys

import pytest
import torch

from megatron.training import arguments_validation as validation
from megatron.training.arguments import (
    ArgsError,
    gpt_dataset_config_from_args,
    parse_and_validate_args,
    parse_args,
    print_args,
    validate_args,
)
from megatron.core import device

# A tiny valid run: every test starts from it and adds or drops flags.
BASE = {
    "--num-layers": ["2"], "--hidden-size": ["64"], "--num-attention-heads": ["4"],
    "--max-position-embeddings": ["32"], "--seq-length": ["32"], "--micro-batch-size": ["2"],
    "--train-iters": ["10"], "--lr": ["1e-3"], "--mock-data": [],
    "--tokenizer-type": ["NullTokenizer"], "--vocab-size": ["100"],
}


@pytest.fixture(autouse=True)
def dataset_files(tmp_path, monkeypatch):
    """The dataset prefixes the tests name (a, b, t1, t2, x) exist in the working directory."""
    monkeypatch.chdir(tmp_path)
    for prefix in ("a", "b", "t1", "t2", "x"):
        (tmp_path / f"{prefix}.bin").write_bytes(b"")
        (tmp_path / f"{prefix}.idx").write_bytes(b"")


def test_no_data_flag_validates_but_pretrain_asks_for_one():
    """As in Megatron, validate_args takes args without a data source (Accelerate brings its own data
    loader); pretrain(), whose datasets come from the flags, asks for one before building anything."""
    from megatron.training.arguments_validation import require_training_data

    args = run(drop=["--mock-data"])
    assert args.data_path is None and not args.mock_data
    with pytest.raises(ArgsError, match="no training data: give --data-path"):
        require_training_data(args)
    require_training_data(run())  # --mock-data


def test_missing_dataset_files_are_named_before_anything_is_built():
    with pytest.raises(ArgsError, match=r"--data-path nope: no such dataset, nope.idx and nope.bin not found"):
        run("--data-path nope", drop=["--mock-data"])
    with pytest.raises(ArgsError, match=r"--valid-data-path a.bin: .*give the prefix without .bin/.idx"):
        run("--train-data-path a --valid-data-path a.bin", drop=["--mock-data"])


def argv(*extra, drop=()):
    """BASE without the flags in `drop`, then `extra` (a string split on spaces, or words)."""
    words = []
    for name, values in BASE.items():
        if name not in drop:
            words += [name] + values
    for item in extra:
        words += item.split() if isinstance(item, str) else list(item)
    return words


def run(*extra, drop=(), defaults=None):
    return parse_and_validate_args(argv=argv(*extra, drop=drop), args_defaults=defaults)


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------- bad combinations

# (id, extra flags, dropped flags, environment, the message must contain)
BAD = [
    ("no-num-layers", "", ["--num-layers"], {}, "--num-layers is required"),
    ("no-hidden-size", "", ["--hidden-size"], {}, "--hidden-size is required"),
    ("no-heads", "", ["--num-attention-heads"], {}, "--num-attention-heads is required"),
    ("no-max-pos", "", ["--max-position-embeddings"], {}, "--max-position-embeddings is required"),
    ("no-mbs", "", ["--micro-batch-size"], {}, "--micro-batch-size is required"),
    ("gbs-not-divisible", "--micro-batch-size 4 --global-batch-size 6", ["--micro-batch-size"], {},
     "--global-batch-size (6) must be divisible by --micro-batch-size (4) x data-parallel size (1)"),
    ("iters-and-samples", "--train-samples 100", [], {}, "--train-iters and --train-samples cannot both"),
    ("no-train-length", "", ["--train-iters"], {}, "--train-iters or --train-samples"),
    ("rampup-with-iters", "--global-batch-size 8 --rampup-batch-size 2 2 100", [], {},
     "--rampup-batch-size needs sample-based training"),
    ("rampup-increment", "--train-samples 100 --global-batch-size 8 --rampup-batch-size 2 4 50",
     ["--train-iters"], {}, "--global-batch-size (8) minus the --rampup-batch-size start (2) must be divisible"),
    ("rampup-arity", "--train-samples 100 --rampup-batch-size 2 2", ["--train-iters"], {},
     "--rampup-batch-size needs three values"),
    ("seq-over-max-pos", "--seq-length 64", ["--seq-length"], {},
     "--max-position-embeddings (32) must be >= --seq-length (64)"),
    ("hidden-heads", "--hidden-size 66", ["--hidden-size"], {},
     "--hidden-size (66) must be divisible by --num-attention-heads (4)"),
    ("fp16-bf16", "--fp16 --bf16", [], {}, "--fp16 and --bf16 cannot both be given"),
    ("min-lr-over-lr", "--lr 0.1 --min-lr 1.0", ["--lr"], {}, "--min-lr (1.0) must be <= --lr (0.1)"),
    ("no-lr", "", ["--lr"], {}, "--lr is required"),
    ("save-no-interval", "--save /tmp/ckpt", [], {}, "--save needs --save-interval"),
    ("warmup-fraction-and-iters", "--lr-warmup-fraction 0.1 --lr-warmup-iters 2", [], {},
     "one of --lr-warmup-fraction and --lr-warmup-iters"),
    ("warmup-over-decay", "--lr-warmup-iters 10", [], {}, "--lr-warmup-iters (10) must be < --lr-decay-iters"),
    ("decay-samples-with-iters", "--lr-decay-samples 100", [], {},
     "--lr-decay-samples cannot be used with --train-iters"),
    ("decay-iters-with-samples", "--train-samples 100 --lr-decay-iters 5", ["--train-iters"], {},
     "--lr-decay-iters cannot be used with --train-samples"),
    ("wsd-no-decay", "--lr-decay-style WSD", [], {}, "--lr-decay-style WSD needs"),
    ("start-wd-constant", "--start-weight-decay 0.1", [], {}, "--start-weight-decay needs --weight-decay-incr-style"),
    ("linear-wd-no-end", "--weight-decay-incr-style linear --start-weight-decay 0.0", [], {},
     "--weight-decay-incr-style linear needs --end-weight-decay"),
    ("data-path-and-train-path", "--data-path a --train-data-path b", ["--mock-data"], {},
     "--data-path cannot be combined with --train-data-path"),
    ("mock-and-data-path", "--data-path a", [], {}, "--mock-data cannot be combined with --data-path"),
    ("split-with-per-split", "--train-data-path a --split 9,1,0", ["--mock-data"], {},
     "--split cannot be used with --train-data-path"),
    ("bad-split", "--data-path a --split 9,x", ["--mock-data"], {}, "--split '9,x'"),
    ("bad-blend", "--data-path 0.5 a 0.5", ["--mock-data"], {}, "--data-path"),
    ("no-seq-length", "", ["--seq-length"], {}, "--seq-length is required"),
    ("world-not-divisible", "--tensor-model-parallel-size 2", [], {"WORLD_SIZE": "3"},
     "world size (3) is not divisible by --tensor-model-parallel-size (2)"),
    ("rank-out-of-range", "", [], {"RANK": "1", "WORLD_SIZE": "1"}, "RANK (1) must be in [0, WORLD_SIZE (1))"),
    ("rank-not-int", "", [], {"RANK": "zero"}, "environment variable RANK='zero' must be an integer"),
    ("tp-heads", "--tensor-model-parallel-size 8", [], {"WORLD_SIZE": "8"},
     "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (8)"),
    ("tp-ffn", "--tensor-model-parallel-size 2 --ffn-hidden-size 99", [], {"WORLD_SIZE": "2"},
     "--ffn-hidden-size (99) must be divisible by --tensor-model-parallel-size (2)"),
    ("tp-hidden-heads", "--tensor-model-parallel-size 2 --hidden-size 66 --num-attention-heads 3", [],
     {"WORLD_SIZE": "2"}, "--num-attention-heads (3) must be divisible by --tensor-model-parallel-size (2)"),
    ("sp-seq", "--tensor-model-parallel-size 4 --sequence-parallel --seq-length 30 --max-position-embeddings 30",
     ["--seq-length", "--max-position-embeddings"], {"WORLD_SIZE": "4"},
     "--seq-length (30) must be divisible by --tensor-model-parallel-size (4) with --sequence-parallel"),
    ("pp-layers", "--pipeline-model-parallel-size 2 --num-layers 3", ["--num-layers"], {"WORLD_SIZE": "2"},
     "--num-layers (3) must be divisible by --pipeline-model-parallel-size (2)"),
    ("split-rank-range", "--pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 2", [],
     {"WORLD_SIZE": "2"}, "--pipeline-model-parallel-split-rank (2) must be in [1, "
     "--pipeline-model-parallel-size - 1] = [1, 1]"),
    ("split-rank-layers", "--pipeline-model-parallel-size 3 --pipeline-model-parallel-split-rank 1 --num-layers 3",
     ["--num-layers"], {"WORLD_SIZE": "3"}, "--num-layers (3) must be divisible by the decoder's 2 pipeline stages"),
    ("vpp-both", "--pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 1 "
     "--num-virtual-stages-per-pipeline-rank 2", ["--num-layers"], {"WORLD_SIZE": "2"},
     "give one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank"),
    ("vpp-no-pp", "--num-layers-per-virtual-pipeline-stage 1", [], {},
     "the interleaved schedule (--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank) "
     "needs --pipeline-model-parallel-size > 1"),
    ("vpp-layers", "--pipeline-model-parallel-size 2 --num-layers 6 --num-virtual-stages-per-pipeline-rank 2",
     ["--num-layers"], {"WORLD_SIZE": "2"},
     "--num-virtual-stages-per-pipeline-rank (2) must divide the 3 layers of each pipeline stage"),
    ("vpp-microbatches", "--pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 1 "
     "--global-batch-size 6", ["--num-layers", "--global-batch-size"], {"WORLD_SIZE": "2"},
     "the interleaved schedule needs the number of micro-batches (3 = batch 6 / (--micro-batch-size 2 x "
     "data-parallel size 1)) to be a multiple of --pipeline-model-parallel-size (2)"),
    ("ddp-bucket-size", "--ddp-bucket-size 0", [], {}, "--ddp-bucket-size must be > 0, got 0"),
    ("cp-seq", "--context-parallel-size 2 --seq-length 30", ["--seq-length"], {"WORLD_SIZE": "2"},
     "--seq-length (30) must be divisible by 2 x --context-parallel-size (4)"),
    ("cp-sp-seq", "--context-parallel-size 2 --tensor-model-parallel-size 4 --sequence-parallel --seq-length 36 "
     "--max-position-embeddings 36", ["--seq-length", "--max-position-embeddings"], {"WORLD_SIZE": "8"},
     "--seq-length / --context-parallel-size (18) must be divisible by --tensor-model-parallel-size (4)"),
    ("cp-reset-mask", "--context-parallel-size 2 --reset-attention-mask", [], {"WORLD_SIZE": "2"},
     "--reset-attention-mask (per-document attention, packed sequences) is not supported with "
     "--context-parallel-size > 1"),
    ("cp-alibi", "--context-parallel-size 2 --position-embedding-type alibi", [], {"WORLD_SIZE": "2"},
     "--position-embedding-type alibi is not supported with --context-parallel-size > 1"),
    ("cp-comm-type", "--context-parallel-size 2 --cp-comm-type ring", [], {"WORLD_SIZE": "2"},
     "--cp-comm-type must be one of p2p, a2a, allgather, a2a+p2p, got 'ring'"),
    ("cp-comm-type-layers", "--context-parallel-size 2 --cp-comm-type p2p a2a a2a", [], {"WORLD_SIZE": "2"},
     "--cp-comm-type as a list must hold one type per layer (--num-layers = 2), got 3"),
    ("cp-a2a-heads", "--context-parallel-size 8 --cp-comm-type a2a", [], {"WORLD_SIZE": "8"},
     "--cp-comm-type a2a splits the 4 attention heads of a tensor-parallel rank over 8 ranks"),
    ("cp-hierarchical", "--context-parallel-size 4 --cp-comm-type a2a+p2p", [], {"WORLD_SIZE": "4"},
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
    ("cp-hierarchical-product", "--context-parallel-size 4 --cp-comm-type a2a+p2p "
     "--hierarchical-context-parallel-sizes 2 4", [], {"WORLD_SIZE": "4"},
     "--hierarchical-context-parallel-sizes must be two sizes (a2a, then p2p) whose product is "
     "--context-parallel-size (4)"),
    ("cp-hierarchical-no-cp", "--hierarchical-context-parallel-sizes 1 1", [], {},
     "--hierarchical-context-parallel-sizes needs --context-parallel-size > 1"),
    ("recompute-full-no-method", "--recompute-granularity full --recompute-num-layers 1", [], {},
     '--recompute-granularity full needs --recompute-method "uniform" or "block"'),
    ("recompute-full-no-layers", "--recompute-granularity full --recompute-method uniform", [], {},
     "--recompute-granularity full needs --recompute-num-layers between 1 and the 2 layers of each pipeline stage"),
    ("recompute-too-many-layers", "--recompute-granularity full --recompute-method block --recompute-num-layers 3",
     [], {}, "needs --recompute-num-layers between 1 and the 2 layers of each pipeline stage (model chunk), got 3"),
    ("recompute-layers-per-stage", "--pipeline-model-parallel-size 2 --num-layers 4 --recompute-granularity full "
     "--recompute-method uniform --recompute-num-layers 3", ["--num-layers"], {"WORLD_SIZE": "2"},
     "between 1 and the 2 layers of each pipeline stage (model chunk), got 3"),
    ("recompute-uniform-divides", "--num-layers 3 --recompute-granularity full --recompute-method uniform "
     "--recompute-num-layers 2", ["--num-layers"], {},
     "--recompute-num-layers (2) must divide the 3 layers of each pipeline stage (model chunk) with "
     "--recompute-method uniform"),
    ("recompute-selective-method", "--recompute-activations --recompute-method uniform", [], {},
     "--recompute-method: recompute method is not yet supported for selective recomputing granularity"),
    ("recompute-method-alone", "--recompute-method block", [], {},
     "--recompute-method needs --recompute-granularity full"),
    ("recompute-layers-selective", "--recompute-granularity selective --recompute-num-layers 1", [], {},
     "--recompute-num-layers needs --recompute-granularity full"),
    ("distribute-tp1", "--distribute-saved-activations --recompute-granularity full --recompute-method uniform "
     "--recompute-num-layers 1", [], {}, "--distribute-saved-activations: can distribute recomputed activations "
     "only across tensor model parallel groups"),
    ("distribute-selective", "--distribute-saved-activations --recompute-activations --tensor-model-parallel-size 2",
     [], {"WORLD_SIZE": "2"}, "distributed recompute activations is only applicable to full recompute granularity"),
    ("distribute-sp", "--distribute-saved-activations --recompute-granularity full --recompute-method block "
     "--recompute-num-layers 1 --tensor-model-parallel-size 2 --sequence-parallel", [], {"WORLD_SIZE": "2"},
     "--distribute-saved-activations cannot be combined with --sequence-parallel"),
    ("relative", "--position-embedding-type relative", [], {}, "--position-embedding-type relative: T5-style"),
    ("ckpt-format", "--ckpt-format zarr", [], {}, "--ckpt-format zarr: checkpoint formats other than 'torch' and"),
    ("async-save-torch", "--async-save --ckpt-format torch", [], {}, "--async-save needs --ckpt-format torch_dist"),
    ("moe-ep-without-experts", "--expert-model-parallel-size 2", [], {"WORLD_SIZE": "2"},
     "--expert-model-parallel-size > 1 needs --num-experts"),
    ("moe-ep-divides-experts", "--num-experts 3 --expert-model-parallel-size 2 --disable-bias-linear", [],
     {"WORLD_SIZE": "2"}, "--num-experts (3) must be divisible by --expert-model-parallel-size (2)"),
    ("moe-ep-world", "--num-experts 4 --expert-model-parallel-size 4", [], {"WORLD_SIZE": "2"},
     "world size (2) is not divisible by --expert-tensor-parallel-size (1) x --expert-model-parallel-size (4)"),
    ("moe-topk", "--num-experts 4 --moe-router-topk 5", [], {}, "--moe-router-topk (5) cannot exceed --num-experts (4)"),
    ("moe-tp-needs-sp", "--num-experts 4 --tensor-model-parallel-size 2 --disable-bias-linear", [], {"WORLD_SIZE": "2"},
     "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel"),
    ("moe-sinkhorn-aux", "--num-experts 4 --moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0.01", [], {},
     "--moe-router-load-balancing-type sinkhorn takes no aux loss"),
    ("moe-pad", "--num-experts 4 --moe-pad-expert-input-to-capacity", [], {},
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    ("moe-freq", "--num-experts 4 --moe-layer-freq [1,0,1]", [], {}, "--moe-layer-freq as a list must hold --num-layers"),
    ("moe-flex", "--num-experts 4 --moe-token-dispatcher-type flex", [], {},
     "--moe-token-dispatcher-type flex: the DeepEP dispatcher is not supported yet"),
    ("overlap-param-gather", "--overlap-param-gather --overlap-grad-reduce", [], {},
     "--overlap-param-gather needs --use-distributed-optimizer"),
    ("overlap-param-gather-grad", "--overlap-param-gather --use-distributed-optimizer", [], {},
     "--overlap-param-gather needs --overlap-grad-reduce"),
    ("use-ckpt-args-no-load", "--use-checkpoint-args", [], {}, "--use-checkpoint-args needs --load"),
    ("finetune-no-load", "--finetune", [], {}, "--finetune needs --load"),
    ("exit-interval", "--exit-interval 0", [], {}, "--exit-interval must be > 0, got 0"),
    ("loss-scale", "--loss-scale 0", [], {}, "--loss-scale must be > 0, got 0.0"),
    ("eval-interval", "--eval-interval 0", [], {}, "--eval-interval must be > 0, got 0"),
    ("eval-iters", "--eval-iters -1", [], {}, "--eval-iters must be >= 0, got -1"),
    ("dropout", "--hidden-dropout 1.0", [], {}, "--hidden-dropout must be in [0, 1)"),
    ("fp16-lm-ce", "--fp16-lm-cross-entropy", [], {}, "--fp16-lm-cross-entropy needs --fp16"),
    ("fp32-residual", "--fp32-residual-connection", [], {}, "--fp32-residual-connection needs --fp16 or --bf16"),
    ("old-batch-size", "--batch-size 4", [], {}, "--batch-size argument is no longer valid, use --micro-batch-size"),
    ("old-warmup", "--warmup 4", [], {}, "--warmup argument is no longer valid, use --lr-warmup-fraction"),
    ("old-mp", "--model-parallel-size 2", [], {}, "--model-parallel-size is no longer valid"),
]


@pytest.mark.parametrize("extra, drop, env, message", [row[1:] for row in BAD], ids=[row[0] for row in BAD])
def test_bad_combination_raises_naming_the_flag(monkeypatch, extra, drop, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ArgsError, match=re.escape(message)):
        run(extra, drop=drop)


def test_sequence_parallel_needs_tensor_parallelism(monkeypatch, capsys):
    args = run("--sequence-parallel")
    assert args.sequence_parallel is False
    assert "disabling --sequence-parallel because --tensor-model-parallel-size is 1" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = run("--sequence-parallel", "--tensor-model-parallel-size", "2")
    assert args.sequence_parallel is True and args.data_parallel_size == 1
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    assert config.tensor_model_parallel_size == 2 and config.sequence_parallel is True


def test_biased_experts_are_accepted_at_expert_tensor_parallel_size_2(monkeypatch):
    from megatron.training.arguments import core_transformer_config_from_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    args = run("--num-experts 4 --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2")
    config = core_transformer_config_from_args(args)
    assert config.add_bias_linear and (config.expert_tensor_parallel_size, config.expert_model_parallel_size) == (2, 2)


def test_recompute_and_flash_attention_flags_reach_the_config(monkeypatch):
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(run("--recompute-activations", "--use-flash-attn"))
    assert (config.recompute_granularity, config.recompute_method, config.use_flash_attn) == ("selective", None, True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = run("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 8 "
               "--num-layers-per-virtual-pipeline-stage 2 --global-batch-size 4 --recompute-granularity full "
               "--recompute-method uniform --recompute-num-layers 2 --distribute-saved-activations",
               drop=["--num-layers"])
    config = core_transformer_config_from_args(args)  # 2 layers per model chunk: groups of 2 tile it
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "uniform", 2)
    assert config.distribute_saved_activations and not config.use_flash_attn
    args = run("--tensor-model-parallel-size 2 --sequence-parallel --recompute-activations")  # selective + SP is fine
    assert args.recompute_granularity == "selective" and args.sequence_parallel


def test_nccl_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(device, "accelerator_available", lambda: False)
    with pytest.raises(ArgsError, match="--distributed-backend nccl needs a CUDA device"):
        run("--distributed-backend nccl")


def test_args_error_is_a_value_error():
    assert issubclass(ArgsError, ValueError)


def _unsupported_value(supported):
    if supported is None:
        return 4
    if supported is False:
        return True
    if isinstance(supported, int):
        return supported + 1
    return "something-else"


@pytest.mark.parametrize("row", validation.NOT_YET_SUPPORTED, ids=[r[0] for r in validation.NOT_YET_SUPPORTED])
def test_every_not_yet_supported_row_raises(row):
    dest, shown, supported, _ = row
    args = parse_args(argv=argv())
    validation._validate_not_yet_supported(args)  # the defaults pass
    setattr(args, dest, _unsupported_value(supported))
    with pytest.raises(ArgsError, match=re.escape(shown) + ".*not supported yet"):
        validation._validate_not_yet_supported(args)


# ----------------------------------------------------------------------------- names and defaults


def test_defaults_match_megatron():
    args = parse_args(argv=argv())
    expected = {
        "eval_interval": 1000, "eval_iters": 100, "log_interval": 100, "num_workers": 2, "seed": 1234,
        "init_method_std": 0.02, "clip_grad": 1.0, "weight_decay": 0.01, "hidden_dropout": 0.1,
        "attention_dropout": 0.1, "initial_loss_scale": 2**32, "loss_scale_window": 1000, "hysteresis": 2,
        "min_loss_scale": 1.0, "loss_scale": None, "lr_decay_style": "linear", "tensorboard_log_interval": 1,
        "tensorboard_queue_size": 1000, "distributed_timeout_minutes": 10, "adam_beta1": 0.9,
        "adam_beta2": 0.999, "adam_eps": 1e-8, "sgd_momentum": 0.9, "optimizer": "adam", "norm_epsilon": 1e-5,
        "make_vocab_size_divisible_by": 128, "lr_warmup_iters": 0, "lr_warmup_samples": 0,
        "lr_warmup_init": 0.0, "lr_warmup_fraction": None, "min_lr": 0.0, "lr_wsd_decay_style": "exponential",
        "weight_decay_incr_style": "constant", "position_embedding_type": "learned_absolute",
        "add_bias_linear": True, "mmap_bin_files": True, "create_attention_mask_in_dataloader": True,
        "masked_softmax_fusion": True, "bias_gelu_fusion": True, "bias_dropout_fusion": True,
        "gradient_accumulation_fusion": True, "no_load_optim": None, "no_save_optim": None, "no_load_rng": None, "no_save_rng": None,
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "sequence_parallel": False,
        "global_batch_size": None, "rampup_batch_size": None, "split": None, "dataloader_type": None,
        "timing_log_level": 0, "empty_unused_memory_level": 0, "check_for_nan_in_loss_and_grad": True,
        "wandb_project": "", "local_rank": 0, "use_cpu_initialization": None, "perform_initialization": True,
        "override_opt_param_scheduler": False, "use_checkpoint_opt_param_scheduler": False,
    }
    assert {k: getattr(args, k) for k in expected} == expected


def test_megatron_dests_and_aliases():
    args = parse_args(argv=argv(
        "--disable-bias-linear --no-mmap-bin-files --no-create-attention-mask-in-dataloader "
        "--no-masked-softmax-fusion --no-bias-dropout-fusion --no-load-optim --no-save-rng "
        "--layernorm-epsilon 1e-6 --persistent-save-interval 7 --override-opt_param-scheduler "
        "--use-checkpoint-opt_param-scheduler --rampup-batch-size 4 4 100 --data-path 0.3 a 0.7 b"))
    assert args.add_bias_linear is False and args.mmap_bin_files is False
    assert args.create_attention_mask_in_dataloader is False and args.masked_softmax_fusion is False
    assert args.bias_dropout_fusion is False and args.no_load_optim is True and args.no_save_rng is True
    assert args.norm_epsilon == 1e-6 and args.save_interval == 7
    assert args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler
    assert args.rampup_batch_size == ["4", "4", "100"] and args.data_path == ["0.3", "a", "0.7", "b"]
    assert parse_args(argv=argv("--norm-epsilon 1e-4")).norm_epsilon == 1e-4


def test_abbreviated_flags_are_rejected():
    with pytest.raises(SystemExit):
        parse_args(argv=argv("--num-lay 2", drop=["--num-layers"]))


# ----------------------------------------------------------------------------- derived values


def test_data_parallel_size_arithmetic():
    assert validation.data_parallel_size(8, 2, 2) == 2
    assert validation.data_parallel_size(16, 2, 1, 2) == 4
    with pytest.raises(ArgsError, match=r"world size \(6\) is not divisible"):
        validation.data_parallel_size(6, 4, 1)


def test_derived_values_of_a_plain_run():
    args = run()
    assert (args.rank, args.world_size, args.data_parallel_size) == (0, 1, 1)
    assert args.global_batch_size == 2  # mbs x dp
    assert args.ffn_hidden_size == 256 and args.kv_channels == 16
    assert args.params_dtype == torch.float32 and args.attention_softmax_in_fp32 is False
    assert args.dataloader_type == "single" and args.distributed_backend == device.get_backend()
    assert (args.consumed_train_samples, args.consumed_valid_samples, args.skipped_train_samples) == (0, 0, 0)
    assert args.variable_seq_lengths is False
    assert args.start_weight_decay == args.end_weight_decay == 0.01
    assert not hasattr(args, "checkpoint_activations") and not hasattr(args, "recompute_activations")


def test_validating_twice_gives_the_same_args():
    args = run("--bf16 --data-path a", drop=["--mock-data"])
    again = validate_args(copy.deepcopy(args))
    assert vars(again) == vars(args)


def test_explicit_values_are_kept():
    args = run("--ffn-hidden-size 100 --kv-channels 8 --global-batch-size 8 --hidden-size 66",
               drop=["--hidden-size"])
    assert (args.ffn_hidden_size, args.kv_channels, args.global_batch_size) == (100, 8, 8)


@pytest.mark.parametrize("flag, dtype", [("--fp16", torch.float16), ("--bf16", torch.bfloat16), ("", torch.float32)])
def test_params_dtype(flag, dtype):
    args = run(flag)
    assert args.params_dtype == dtype
    assert args.accumulate_allreduce_grads_in_fp32 is (flag == "--bf16")


def test_query_key_layer_scaling_forces_softmax_in_fp32():
    assert run("--apply-query-key-layer-scaling").attention_softmax_in_fp32 is True
    assert run("--attention-softmax-in-fp32").attention_softmax_in_fp32 is True


def test_split_default_with_data_path_warns(capsys):
    args = run("--data-path 0.3 a 0.7 b", drop=["--mock-data"])
    assert args.split == "969, 30, 1"
    assert 'Using legacy default value of "969, 30, 1"' in capsys.readouterr().out
    assert run("--data-path a --split 9,1,0", drop=["--mock-data"]).split == "9,1,0"
    assert run().split is None  # mock data: no default split is forced


def test_rampup_values_become_ints():
    args = run("--train-samples 1000 --global-batch-size 16 --rampup-batch-size 4 4 200", drop=["--train-iters"])
    assert args.rampup_batch_size == [4, 4, 200]


def test_weight_decay_increment_keeps_start_and_end():
    args = run("--weight-decay-incr-style cosine --start-weight-decay 0.0 --end-weight-decay 0.1")
    assert (args.start_weight_decay, args.end_weight_decay) == (0.0, 0.1)


# ----------------------------------------------------------------------------- aliases, defaults, env, argv


def test_checkpoint_activations_exits_with_megatrons_message(capsys):
    with pytest.raises(SystemExit) as info:
        run("--checkpoint-activations")
    assert info.value.code != 0
    assert ("--checkpoint-activations is no longer valid, use --recompute-activations, or, for more control, "
            "--recompute-granularity and --recompute-method.") in capsys.readouterr().out


def test_extra_args_provider_adds_flags():
    def provider(parser):
        group = parser.add_argument_group(title="my script")
        group.add_argument("--my-flag", type=int, default=3)
        return parser

    assert parse_args(provider, argv=argv("--my-flag 5")).my_flag == 5
    assert run_with(provider).my_flag == 3
    with pytest.raises(SystemExit):
        parse_args(argv=argv("--my-flag 5"))
    # a provider that only adds to the parser (returns None) works too
    assert parse_args(lambda p: p.add_argument("--other", default="x") and None, argv=argv()).other == "x"


def run_with(provider):
    return parse_and_validate_args(provider, argv=argv())


def test_ignore_unknown_args():
    args = parse_args(ignore_unknown_args=True, argv=argv("--not-a-megatron-flag 1"))
    assert args.num_layers == 2 and not hasattr(args, "not_a_megatron_flag")


def test_args_defaults_fill_only_unset_values(capsys):
    defaults = {"micro_batch_size": 4, "tokenizer_type": "GPT2BPETokenizer", "no_load_rng": True, "lr": 5.0}
    args = run(drop=["--micro-batch-size"], defaults=defaults)
    assert args.micro_batch_size == 4 and args.global_batch_size == 4
    assert args.no_load_rng is True
    assert args.tokenizer_type == "NullTokenizer" and args.lr == 1e-3  # given on the command line: kept
    assert "WARNING: overriding default arguments for tokenizer_type:GPT2BPETokenizer" in capsys.readouterr().out


def test_rank_and_world_size_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse_args(argv=argv())
    assert (args.rank, args.world_size) == (3, 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert parse_args(argv=argv()).local_rank == 2


def test_argv_given_ignores_sys_argv_and_none_reads_it(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--definitely-not-a-flag"])
    assert parse_args(argv=argv()).num_layers == 2
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + argv("--num-layers 1", drop=["--num-layers"]))
    assert parse_args().num_layers == 1


def test_validate_args_reads_env_when_namespace_lacks_rank(monkeypatch):
    args = parse_args(argv=argv())
    del args.rank, args.world_size
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert validate_args(args).world_size == 1


# ----------------------------------------------------------------------------- print_args


def test_print_args_block(capsys):
    args = run()
    capsys.readouterr()
    print_args(args)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "------------------------ arguments ------------------------"
    assert lines[-1] == "-------------------- end of arguments ---------------------"
    body = lines[1:-1]
    assert body == sorted(body, key=str.lower) and len(body) == len(vars(args))
    assert "  num_layers " + "." * (48 - len("num_layers")) + " 2" in body
    args.rank = 1
    print_args(args)
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------------------- config builders


class Tok:
    eod = 0
    vocab_size = 101


def test_gpt_dataset_config_from_blend():
    args = run("--data-path 0.3 a 0.7 b --split 90,5,5 --data-cache-path /tmp/c --no-mmap-bin-files "
               "--no-create-attention-mask-in-dataloader --reset-position-ids --eod-mask-loss --seed 7",
               drop=["--mock-data"])
    tok = Tok()
    config = gpt_dataset_config_from_args(args, tok)
    assert config.blend == (["a", "b"], [0.3, 0.7]) and config.blend_per_split is None
    assert config.split == "90,5,5" and config.split_vector == [0.9, 0.05, 0.05]
    assert (config.random_seed, config.sequence_length, config.path_to_cache) == (7, 32, "/tmp/c")
    assert config.mmap_bin_files is False and config.create_attention_mask is False
    assert config.reset_position_ids and config.eod_mask_loss and not config.reset_attention_mask
    assert config.mock is False and config.tokenizer is tok


def test_gpt_dataset_config_per_split_and_mock():
    args = run("--train-data-path t1 t2 --test-data-path 2 x", drop=["--mock-data"])
    config = gpt_dataset_config_from_args(args, Tok())
    assert config.blend is None and config.split is None
    assert config.blend_per_split == [(["t1", "t2"], None), None, (["x"], [2.0])]
    mock = gpt_dataset_config_from_args(run(), Tok())
    assert mock.mock is True and mock.blend is None and mock.create_attention_mask is True


def test_core_transformer_config_from_args():
    pytest.importorskip("megatron.model", reason="megatron.model (TransformerConfig) is not written yet")
    from megatron.training.arguments import core_transformer_config_from_args

    args = run("--bf16 --disable-bias-linear --no-masked-softmax-fusion --no-bias-dropout-fusion "
               "--layernorm-epsilon 1e-6 --apply-query-key-layer-scaling --openai-gelu --hidden-dropout 0.0")
    config = core_transformer_config_from_args(args)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert (config.ffn_hidden_size, config.kv_channels) == (256, 16)
    assert config.layernorm_epsilon == 1e-6 and config.add_bias_linear is False
    assert config.masked_softmax_fusion is False and config.bias_dropout_fusion is False
    assert config.bf16 and config.params_dtype == torch.bfloat16 and config.openai_gelu
    assert config.apply_query_key_layer_scaling and config.attention_softmax_in_fp32
    assert config.hidden_dropout == 0.0 and config.attention_dropout == 0.1


def test_optimizer_config_from_args():
    pytest.importorskip("megatron.core.optimizer", reason="megatron.core.optimizer is not written yet")
    from megatron.training.arguments import optimizer_config_from_args

    args = run("--fp16 --optimizer sgd --sgd-momentum 0.8 --min-lr 1e-4 --clip-grad 0.5 --loss-scale-window 50 "
               "--hysteresis 1 --initial-loss-scale 1024 --weight-decay 0.1 --log-num-zeros-in-grad")
    config = optimizer_config_from_args(args)
    assert (config.optimizer, config.lr, config.min_lr, config.sgd_momentum) == ("sgd", 1e-3, 1e-4, 0.8)
    assert (config.clip_grad, config.loss_scale_window, config.hysteresis) == (0.5, 50, 1)
    assert config.initial_loss_scale == 1024 and config.loss_scale is None and config.weight_decay == 0.1
    assert config.fp16 and config.params_dtype == torch.float16 and config.log_num_zeros_in_grad


def test_context_parallelism_is_refused_for_bert(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ArgsError, match=re.escape("--context-parallel-size > 1 is for causal (GPT-style) models: "
                                                  "BERT's bidirectional attention")):
        run("--context-parallel-size 2", drop=["--mock-data"], defaults={"model_family": "BERT"})
