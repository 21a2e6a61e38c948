"""Megatron-LM core_v0.13's GPT scripts against our parser: every flag parses, and each one either
works, has no effect (said in one warning line) or is refused naming itself (megatron/training/arguments_megatron.py).

The flag sets are those of examples/gpt3/train_gpt3_175b_distributed.sh,
examples/llama/train_llama3_8b_h100_fp8.sh (its mock-data branch) and
examples/mixtral/train_mixtral_8x7b_distributed.sh at tag core_v0.13.0, in their order, with the
sizes shrunk (layers, hidden, heads, lengths, batch and parallel sizes) and paths made local.
"""

import re
from pathlib import Path

import pytest

from megatron.training import arguments_megatron
from megatron.training.arguments import ArgsError, core_transformer_config_from_args, parse_args, validate_args

ROOT = Path(__file__).resolve().parents[2]

GPT3_175B = [
    # GPT_MODEL_ARGS
    ("--num-layers", "4"), ("--hidden-size", "64"), ("--num-attention-heads", "4"), ("--seq-length", "32"),
    ("--max-position-embeddings", "32"), ("--attention-backend", "auto"),
    # TRAINING_ARGS
    ("--micro-batch-size", "1"), ("--global-batch-size", "16"), ("--rampup-batch-size", "4", "4", "64"),
    ("--train-iters", "50"), ("--weight-decay", "0.1"), ("--adam-beta1", "0.9"), ("--adam-beta2", "0.95"),
    ("--init-method-std", "0.006"), ("--clip-grad", "1.0"), ("--fp16",), ("--lr", "6.0e-5"),
    ("--lr-decay-style", "cosine"), ("--min-lr", "6.0e-6"), ("--lr-warmup-fraction", ".001"),
    ("--lr-decay-iters", "43"),
    # MODEL_PARALLEL_ARGS (8 x 16 there)
    ("--tensor-model-parallel-size", "2"), ("--pipeline-model-parallel-size", "2"),
    # DATA_ARGS
    ("--data-path", "{data}"), ("--vocab-file", "{vocab}"), ("--merge-file", "{merges}"), ("--split", "949,50,1"),
    # EVAL_AND_LOGGING_ARGS
    ("--log-interval", "100"), ("--save-interval", "10000"), ("--eval-interval", "1000"), ("--save", "{ckpt}"),
    ("--load", "{ckpt}"), ("--eval-iters", "10"), ("--tensorboard-dir", "{tb}"),
]

LLAMA3_8B_FP8 = [
    # MODEL_ARGS
    ("--use-mcore-models",), ("--num-layers", "2"), ("--hidden-size", "64"), ("--ffn-hidden-size", "224"),
    ("--num-attention-heads", "4"), ("--group-query-attention",), ("--num-query-groups", "2"),
    ("--kv-channels", "16"), ("--seq-length", "32"), ("--max-position-embeddings", "32"),
    ("--position-embedding-type", "rope"), ("--rotary-base", "1000000"), ("--rotary-percent", "1.0"),
    ("--attention-dropout", "0.0"), ("--hidden-dropout", "0.0"), ("--swiglu",), ("--init-method-std", "0.0134"),
    ("--attention-backend", "fused"), ("--apply-layernorm-1p",), ("--untie-embeddings-and-output-weights",),
    ("--disable-bias-linear",),
    # TRAINING_ARGS
    ("--micro-batch-size", "1"), ("--global-batch-size", "8"), ("--train-samples", "800"),
    ("--lr-decay-samples", "780"), ("--lr-warmup-samples", "16"), ("--lr", "0.00015"), ("--min-lr", "0.00001"),
    ("--decoupled-lr", "5.0e-4"), ("--decoupled-min-lr", "4.5e-5"), ("--lr-decay-style", "cosine"),
    ("--clip-grad", "1.0"), ("--weight-decay", "0.1"), ("--adam-beta1", "0.9"), ("--adam-beta2", "0.95"),
    ("--bf16",), ("--grad-reduce-in-bf16",), ("--cross-entropy-loss-fusion",), ("--calculate-per-token-loss",),
    ("--manual-gc",), ("--empty-unused-memory-level", "1"), ("--exit-duration-in-mins", "235"),
    # DDP_ARGS (appended to TRAINING_ARGS)
    ("--use-distributed-optimizer",), ("--overlap-grad-reduce",), ("--overlap-param-gather",),
    # DTYPE_ARGS
    ("--fp8-format", "hybrid"), ("--fp8-amax-history-len", "1024"), ("--fp8-amax-compute-algo", "max"),
    ("--fp8-param-gather",),
    # MODEL_PARALLEL_ARGS
    ("--tensor-model-parallel-size", "1"), ("--context-parallel-size", "1"), ("--sequence-parallel",),
    # DATA_ARGS_LIST, mock branch; the script's "--split '99,1,0'" reaches Python with the quotes
    # (an array element word-split unquoted), which Megatron cannot parse either: given without them.
    ("--mock-data",), ("--tokenizer-type", "NullTokenizer"), ("--vocab-size", "1000"),
    ("--data-cache-path", "{cache}"), ("--tiktoken-pattern", "v2"), ("--split", "99,1,0"),
    ("--no-create-attention-mask-in-dataloader",), ("--no-mmap-bin-files",), ("--num-workers", "1"),
    # EVAL_AND_LOGGING_ARGS
    ("--log-interval", "1"), ("--eval-iters", "1"), ("--eval-interval", "100"), ("--save-interval", "1000"),
    ("--log-throughput",), ("--profile",), ("--profile-step-start", "4"), ("--profile-step-end", "6"),
    ("--ckpt-format", "torch_dist"), ("--distributed-timeout-minutes", "60"), ("--save", "{ckpt}"),
    ("--load", "{ckpt}"), ("--tensorboard-dir", "{tb}"),
]

MIXTRAL_8X7B = [
    # MODEL_ARGS
    ("--use-mcore-models",), ("--disable-bias-linear",), ("--seq-length", "32"), ("--max-position-embeddings", "64"),
    ("--num-layers", "2"), ("--hidden-size", "64"), ("--ffn-hidden-size", "224"), ("--num-attention-heads", "4"),
    ("--init-method-std", "0.01"), ("--attention-dropout", "0.0"), ("--hidden-dropout", "0.0"),
    ("--normalization", "RMSNorm"), ("--position-embedding-type", "rope"), ("--swiglu",),
    ("--untie-embeddings-and-output-weights",), ("--group-query-attention",), ("--num-query-groups", "2"),
    ("--no-masked-softmax-fusion",), ("--no-position-embedding",), ("--rotary-base", "1000000"),
    # MOE_ARGS
    ("--num-experts", "4"), ("--moe-router-topk", "2"), ("--moe-router-load-balancing-type", "aux_loss"),
    ("--moe-aux-loss-coeff", "1e-2"), ("--moe-grouped-gemm",), ("--moe-token-dispatcher-type", "alltoall"),
    ("--overlap-param-gather",), ("--overlap-grad-reduce",),
    # DATA_ARGS
    ("--tokenizer-type", "Llama2Tokenizer"), ("--tokenizer-model", "{model}"), ("--data-path", "{data}"),
    ("--split", "99990,8,2"),
    # TRAINING_ARGS
    ("--micro-batch-size", "1"), ("--global-batch-size", "8"), ("--lr", "1e-4"), ("--train-iters", "50"),
    ("--lr-decay-iters", "32"), ("--lr-decay-style", "cosine"), ("--min-lr", "1.0e-5"), ("--weight-decay", "0.1"),
    ("--lr-warmup-iters", "5"), ("--clip-grad", "1.0"), ("--bf16",),
    # MODEL_PARALLEL_ARGS (PP 4, EP 8 there)
    ("--tensor-model-parallel-size", "1"), ("--pipeline-model-parallel-size", "2"),
    ("--expert-model-parallel-size", "2"), ("--use-distributed-optimizer",), ("--sequence-parallel",),
    # LOGGING_ARGS
    ("--log-interval", "1"), ("--save-interval", "10000"), ("--eval-interval", "1000"), ("--eval-iters", "10"),
    ("--save", "{ckpt}"), ("--load", "{ckpt}"), ("--tensorboard-dir", "{tb}"), ("--no-load-optim",),
    ("--no-load-rng",), ("--wandb-project", "Mixtral"), ("--wandb-exp-name", "Mixtral_8x7B"),
]


@pytest.fixture
def paths(tmp_path, monkeypatch):
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for ext in (".bin", ".idx"):
        (tmp_path / f"data_text_document{ext}").write_bytes(b"")
    return {"data": str(tmp_path / "data_text_document"), "vocab": str(tmp_path / "vocab.json"),
            "merges": str(tmp_path / "merges.txt"), "model": str(tmp_path / "tokenizer.model"),
            "ckpt": str(tmp_path / "ckpt"), "tb": str(tmp_path / "tb"), "cache": str(tmp_path / "cache")}


def _argv(script, paths, drop=()):
    return [word.format(**paths) for flag in script if flag[0] not in drop for word in flag]


def _validate(script, paths, drop=()):
    # pretrain_gpt.py's args_defaults
    return validate_args(parse_args(argv=_argv(script, paths, drop)), {"tokenizer_type": "GPT2BPETokenizer"})


def _refusals(script, paths):
    """Validate, drop the flag each error names, again until it validates: {flag: message}."""
    refused = {}
    while True:
        try:
            _validate(script, paths, drop=list(refused))
            return refused
        except ArgsError as error:
            flag = re.match(r"(--[\w-]+)", str(error))[1]
            assert flag in {f[0] for f in script} and flag not in refused, str(error)
            refused[flag] = str(error)


def _warned(out):
    """The flags named by validate_args's warning about flags without effect."""
    lines = [line for line in out.splitlines() if "Megatron-LM flags have no effect here" in line]
    assert len(lines) <= 1, lines
    return lines[0].split(": ")[-1].split() if lines else []


def test_gpt3_175b_script_validates_but_for_megatrons_own_rampup_refusal(paths, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    # Megatron-LM core_v0.13 itself refuses this script: its validate_args asserts
    # 'expected no batch-size rampup for iteration-based training'. So do we, saying what to do.
    with pytest.raises(ArgsError, match=r"^--rampup-batch-size needs sample-based training .*Megatron-LM"):
        _validate(GPT3_175B, paths)
    capsys.readouterr()
    args = _validate(GPT3_175B, paths, drop=["--rampup-batch-size"])
    out = capsys.readouterr().out
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (2, 2, 1)
    assert args.attention_backend == "auto" and args.use_flash_attn is False
    assert "> attention backend auto: the unfused core attention" in out
    assert _warned(out) == []  # every other flag of this script works here


LLAMA3_REFUSED = {"--fp8-format", "--decoupled-lr", "--decoupled-min-lr"}  # --ckpt-format torch_dist works
LLAMA3_NO_EFFECT = ["--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather",
                    "--use-mcore-models", "--profile", "--profile-step-start", "--profile-step-end",
                    "--cross-entropy-loss-fusion", "--manual-gc", "--grad-reduce-in-bf16", "--tiktoken-pattern"]


def test_llama3_8b_script_refuses_fp8_and_names_what_has_no_effect(paths, capsys):
    refused = _refusals(LLAMA3_8B_FP8, paths)
    assert set(refused) == LLAMA3_REFUSED
    for flag, message in refused.items():
        assert message.startswith(flag) and "is not supported yet" in message, message
    capsys.readouterr()
    args = _validate(LLAMA3_8B_FP8, paths, drop=refused)
    assert sorted(_warned(capsys.readouterr().out)) == sorted(LLAMA3_NO_EFFECT)
    assert args.use_flash_attn is True  # --attention-backend fused: the fused-kernel core attention
    assert args.train_samples == 800 and args.lr_decay_samples == 780
    # the Llama architecture flags work (megatron/training/arguments_model.py)
    assert (args.position_embedding_type, args.rotary_base, args.ffn_hidden_size) == ("rope", 1000000, 224)
    config = core_transformer_config_from_args(args)
    assert config.gated_linear_unit and config.num_query_groups == 2 and config.layernorm_zero_centered_gamma
    assert config.add_bias_linear is False and config.kv_channels == 16


MIXTRAL_NO_EFFECT = ["--use-mcore-models"]


def test_mixtral_script_validates_with_its_moe_flags(paths, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")  # PP 2 x EP 2
    assert _refusals(MIXTRAL_8X7B, paths) == {}
    capsys.readouterr()
    args = _validate(MIXTRAL_8X7B, paths)
    assert sorted(_warned(capsys.readouterr().out)) == sorted(MIXTRAL_NO_EFFECT)
    assert (args.num_experts, args.moe_router_topk, args.expert_model_parallel_size) == (4, 2, 2)
    assert args.moe_grouped_gemm and args.moe_token_dispatcher_type == "alltoall" and args.moe_aux_loss_coeff == 1e-2
    assert args.pipeline_model_parallel_size == 2 and args.no_load_optim and args.wandb_project == "Mixtral"
    assert (args.normalization, args.position_embedding_type, args.add_position_embedding) == ("RMSNorm", "rope", False)


# ----------------------------------------------------------------------------- one test per refused group

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--max-position-embeddings", "32",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]

# (group, flags, the message starts with)
REFUSED_GROUPS = [
    ("model", "--multi-latent-attention", "--multi-latent-attention: multi-latent attention is not supported yet"),
    ("rope-freq", "--position-embedding-type rope --no-rope-freq 4",
     "--no-rope-freq 4: skipping the rotary embedding on some layers is not supported yet"),
    ("mtp", "--mtp-num-layers 1", "--mtp-num-layers 1: multi-token prediction is not supported yet"),
    ("legacy", "--use-legacy-models", "--use-legacy-models: Megatron's legacy models"),
    ("init", "--init-method-xavier-uniform", "--init-method-xavier-uniform: Xavier-uniform initialization"),
    ("rerun", "--rerun-mode validate_results",
     "--rerun-mode validate_results: the rerun engine is not supported yet; use --rerun-mode disabled"),
    ("rerun-checks", "--check-for-spiky-loss", "--check-for-spiky-loss: the rerun engine's spiky-loss check"),
    ("skip", "--iterations-to-skip 3 4", "--iterations-to-skip 3 4: skipping iterations is not supported yet"),
    ("decoupled-lr", "--decoupled-lr 1e-3", "--decoupled-lr 0.001: a separate learning rate"),
    ("checkpoints", "--ckpt-step 5", "--ckpt-step 5: loading a chosen iteration"),
    ("non-persistent", "--non-persistent-save-interval 10", "--non-persistent-save-interval 10: non-persistent"),
    ("convert", "--ckpt-convert-format torch", "--ckpt-convert-format torch: converting checkpoints while training"),
    ("uneven-pipeline", "--decoder-first-pipeline-num-layers 1", "--decoder-first-pipeline-num-layers 1: uneven"),
    ("encoder-layout", "--encoder-tensor-model-parallel-size 2", "--encoder-tensor-model-parallel-size 2: a separate"),
    ("fsdp", "--use-custom-fsdp", "--use-custom-fsdp: FSDP is not supported yet; remove it"),
    ("fsdp-strategy", "--data-parallel-sharding-strategy optim", "--data-parallel-sharding-strategy optim: FSDP"),
    ("rank-order", "--use-tp-pp-dp-mapping", "--use-tp-pp-dp-mapping: the tp-pp-dp rank order"),
    ("dist-opt", "--num-distributed-optimizer-instances 2", "--num-distributed-optimizer-instances 2: several"),
    ("data-file", "--data-args-path paths.txt", "--data-args-path paths.txt: reading --data-path from a file"),
    ("blend-surplus", "--mid-level-dataset-surplus 0.01",
     "--mid-level-dataset-surplus 0.01: a blend surplus other than 0.005"),
    ("hybrid-groups", "--is-hybrid-model", "the Mamba heads (2, --mamba-num-heads or 2 x hidden / head dim) must "
     "be divisible by --mamba-num-groups (8)"),
    ("hybrid-pattern", "--hybrid-override-pattern M*M", "--hybrid-override-pattern has 3 layers, --num-layers is 2"),
    ("hybrid-moe", "--hybrid-override-pattern ME", "--hybrid-override-pattern ME: E (MoE) layers need --num-experts"),
    ("hybrid-experts", "--hybrid-override-pattern M- --num-experts 2",
     "--num-experts: the hybrid pattern M- has no E (MoE) layer"),
    ("hybrid-moe-freq", "--hybrid-override-pattern ME --num-experts 2 --moe-layer-freq 2",
     "--moe-layer-freq: a hybrid model's MoE layers are the pattern's E layers"),
    ("spec", "--spec local", "--spec takes two values, MODULE NAME"),
    ("spec-import", "--spec no_such_module_here spec", "--spec no_such_module_here spec: cannot import"),
    ("spec-name", "--spec megatron.model.layer_specs no_such_spec",
     "--spec megatron.model.layer_specs no_such_spec: megatron.model.layer_specs has no attribute no_such_spec"),
    ("spec-type", "--spec megatron.model.layer_specs RMSNorm", "--spec megatron.model.layer_specs RMSNorm: expected"),
    ("optimizer-dtypes", "--exp-avg-dtype bf16", "--exp-avg-dtype bf16: Adam states other than fp32"),
    ("precision-aware", "--use-precision-aware-optimizer", "--use-precision-aware-optimizer: the precision-aware"),
    ("recompute-modules", "--recompute-activations --recompute-modules core_attn mlp",
     "--recompute-modules core_attn mlp: recomputing modules other than core_attn is not supported yet"),
    ("microbatch-groups", "--microbatch-group-size-per-virtual-pipeline-stage 3",
     "--microbatch-group-size-per-virtual-pipeline-stage 3: groups other than --pipeline-model-parallel-size (1)"),
    ("no-position-embedding", "--no-position-embedding", "--no-position-embedding is deprecated"),
    ("two-names", "--encoder-num-layers 3", "--num-layers (2) and --encoder-num-layers (3) are two names"),
]


@pytest.mark.parametrize("flags, message", [g[1:] for g in REFUSED_GROUPS], ids=[g[0] for g in REFUSED_GROUPS])
def test_refused_flag_group_names_the_flag(flags, message):
    with pytest.raises(ArgsError) as error:
        validate_args(parse_args(argv=[*BASE, *flags.split()]))
    assert str(error.value).startswith(message), str(error.value)


def test_megatron_names_and_default_values_pass_without_a_warning(capsys):
    flags = ("--rerun-mode disabled --profile-step-start 10 --recompute-modules core_attn --recompute-activations "
             "--num-distributed-optimizer-instances 1 --moe-router-topk 2 --add-qkv-bias "
             "--microbatch-group-size-per-virtual-pipeline-stage 1")
    base = BASE[2:8] + BASE[10:]  # without --num-layers and --seq-length: given by Megatron's other names
    args = validate_args(parse_args(argv=[*base, "--encoder-num-layers", "2", "--encoder-seq-length", "32",
                                          *flags.split()]))
    assert (args.num_layers, args.seq_length, args.encoder_num_layers, args.encoder_seq_length) == (2, 32, 2, 32)
    assert _warned(capsys.readouterr().out) == []


def test_unknown_flags_still_fail_as_argparse_does(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv=[*BASE, "--retro-add-retriever"])  # Megatron's, of a group we do not take
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --retro-add-retriever" in capsys.readouterr().err


@pytest.mark.parametrize("backend, flash", [("auto", False), ("local", False), ("unfused", False),
                                            ("flash", True), ("fused", True)])
def test_attention_backend_maps_onto_our_core_attention(capsys, backend, flash):
    args = validate_args(parse_args(argv=[*BASE, "--attention-backend", backend]))
    assert core_transformer_config_from_args(args).use_flash_attn is flash
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("> attention backend"))
    assert line.startswith(f"> attention backend {backend}: the {'fused-kernel' if flash else 'unfused'} core")
    if backend == "auto":  # auto keeps --use-flash-attn's choice
        args = validate_args(parse_args(argv=[*BASE, "--attention-backend", "auto", "--use-flash-attn"]))
        assert args.use_flash_attn is True


def test_docs_list_every_megatron_flag_that_is_accepted_without_effect_or_refused():
    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("\n## Megatron flags\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(--[\w-]+)", section))
    for row in arguments_megatron.NO_EFFECT + arguments_megatron.REFUSED:
        assert row.names[0] in documented, row.names[0]
