"""Megatron-LM's (core_v0.13) flags that do not change training here: accepted, or refused.

Megatron's scripts (examples/gpt3, examples/llama, examples/mixtral) pass flags that are about
CUDA kernels, Transformer Engine, NCCL, profiling or features this framework does not have.
Each one parses here, with Megatron's name, dest and default, and is one of:

| table | the flag | when it is given |
|---|---|---|
| NO_EFFECT | a GPU/TE/NCCL performance knob, a tool we lack, or only used with a refused flag | one warning names it |
| REFUSED | would change what is trained or saved | ArgsError "FLAG: FEATURE is not supported yet" |

REFUSED's rows are the last rows of arguments_validation.NOT_YET_SUPPORTED (the refusal table).

A flag given with its default value passes either way (scripts often spell out defaults).
The Megatron flags that work here are in megatron/training/arguments.py; validate_megatron_flags (below)
maps those that are other names of ours (--attention-backend, --encoder-num-layers,
--encoder-seq-length) and refuses the ones only some values of which are supported
(--recompute-modules, --microbatch-group-size-per-virtual-pipeline-stage, --no-position-embedding).
Megatron flags in neither table, nor in megatron/training/arguments.py (its retro, vision, biencoder,
inference, MLA, in-process-restart, straggler, one-logger, fault-tolerance, kitchen, SFT and
multi-storage-client groups), are unknown flags: argparse stops with its usage error.
docs/training.md ("Megatron flags") lists both tables; a test keeps the two in step.
"""

from __future__ import annotations

import argparse
from argparse import Namespace
from typing import Any, NamedTuple

from megatron.training.argument_utils import ArgsError, flag
from megatron.training.utils import print_line


class MegatronFlag(NamedTuple):
    """One Megatron flag: its spellings, the add_argument keywords and why it is here."""

    names: tuple
    kwargs: dict
    why: str  # NO_EFFECT: what happens instead; REFUSED: the feature, as "X is not supported yet"

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.names[0][2:].replace("-", "_")

    @property
    def default(self) -> Any:
        action = self.kwargs.get("action")
        if action == "store_true":
            return self.kwargs.get("default", False)
        if action == "store_false":
            return self.kwargs.get("default", True)
        return self.kwargs.get("default")


def _true(name: str, why: str, **kwargs: Any) -> MegatronFlag:
    return MegatronFlag((name,), {"action": "store_true", **kwargs}, why)


def _false(name: str, dest: str, why: str) -> MegatronFlag:
    return MegatronFlag((name,), {"action": "store_false", "dest": dest}, why)


def _value(name: str, kind: type, default: Any, why: str, **kwargs: Any) -> MegatronFlag:
    return MegatronFlag((name,), {"type": kind, "default": default, **kwargs}, why)


PERF = "a performance setting of Megatron's CUDA/NCCL/Transformer Engine path; the result is the same"
TE = "Transformer Engine only (--transformer-impl local here)"
FP8 = "only used with --fp8-format, which is not supported yet"
MOE_PERF = "a performance setting of Megatron's MoE CUDA path (overlap, DeepEP, fused permute); the result is the same"
FSDP = "only used with --use-custom-fsdp / --use-torch-fsdp2, which are not supported yet"
DIST_CKPT = "a tuning knob of Megatron's torch_dist strategies: every rank saves and loads its own pieces here"
OFFLOAD = "the optimizer's state stays where its parameters are (CPU on a CPU run)"
PROFILE = "no profiler is started; use torch.profiler or bench/ (docs/PERFORMANCE.md)"
OTHER_MODEL = "a BERT / T5 / retrieval flag: no effect on GPT"
CROSS_ENTROPY = "the cross entropy is computed one way here (the vocab-parallel cross entropy)"

NO_EFFECT = (
    # network size
    _value("--decoder-num-layers", int, None, "T5 only: no effect on GPT"),
    _value("--relative-attention-num-buckets", int, 32, "only used with --position-embedding-type relative"),
    _value("--relative-attention-max-distance", int, 128, "only used with --position-embedding-type relative"),
    _value("--mrope-section", int, None, "only used with --position-embedding-type mrope, which is not supported yet",
           nargs="+"),
    _value("--onnx-safe", str, None, "ONNX export only"),
    _false("--bert-no-binary-head", "bert_binary_head", OTHER_MODEL),
    _value("--mtp-loss-scaling-factor", float, 0.1, "only used with --mtp-num-layers, which is not supported yet"),
    # Transformer Engine and FP8
    _value("--fp8-recipe", str, "delayed", FP8, choices=["tensorwise", "delayed", "mxfp8", "blockwise"]),
    _value("--fp8-margin", int, 0, FP8),
    _value("--fp8-interval", int, 1, FP8),
    _value("--fp8-amax-history-len", int, 1, FP8),
    _value("--fp8-amax-compute-algo", str, "most_recent", FP8, choices=["most_recent", "max"]),
    _false("--no-fp8-wgrad", "fp8_wgrad", FP8),
    _true("--fp8-param-gather", FP8),
    _true("--first-last-layers-bf16", FP8),
    _value("--num-layers-at-start-in-bf16", int, 1, FP8),
    _value("--num-layers-at-end-in-bf16", int, 1, FP8),
    _true("--reuse-grad-buf-for-mxfp8-param-ag", FP8),
    _true("--te-rng-tracker", TE),
    _true("--inference-rng-tracker", "inference only"),
    _true("--tp-comm-overlap", TE),
    _value("--tp-comm-overlap-cfg", str, None, TE),
    _false("--disable-tp-comm-overlap-ag", "tp_comm_overlap_ag", TE),
    _false("--disable-tp-comm-overlap-rs", "tp_comm_overlap_rs", TE),
    _true("--tp-comm-overlap-rs-dgrad", TE),
    _false("--disable-tp-comm-bulk-dgrad", "tp_comm_bulk_dgrad", TE),
    _false("--disable-tp-comm-bulk-wgrad", "tp_comm_bulk_wgrad", TE),
    _false("--disable-tp-comm-split-ag", "tp_comm_split_ag", TE),
    _false("--disable-tp-comm-split-rs", "tp_comm_split_rs", TE),
    _value("--tp-comm-bootstrap-backend", str, "nccl", TE, choices=["nccl", "mpi", "gloo"]),
    # training
    _true("--use-mcore-models", "the models here are always megatron-core style", dest="deprecated_use_mcore_models"),
    _true("--decrease-batch-size-if-needed", "the data-parallel size never changes during a run here"),
    _false("--no-clone-scatter-output-in-embedding", "clone_scatter_output_in_embedding", PERF),
    _true("--profile", PROFILE),
    _value("--profile-step-start", int, 10, PROFILE),
    _value("--profile-step-end", int, 12, PROFILE),
    _true("--use-pytorch-profiler", PROFILE, dest="use_pytorch_profiler"),
    _value("--profile-ranks", int, [0], PROFILE, nargs="+"),
    _true("--record-memory-history", "CUDA memory history is not recorded"),
    _value("--memory-snapshot-path", str, "snapshot.pickle", "CUDA memory history is not recorded"),
    _value("--result-rejected-tracker-filename", str, None, "only used with --rerun-mode, which is not supported yet"),
    _false("--disable-gloo-process-groups", "enable_gloo_process_groups",
           "no extra gloo groups are made beside NCCL's (CPU runs use gloo for everything)"),
    _value("--train-sync-interval", int, None, PERF),
    _true("--cross-entropy-loss-fusion", CROSS_ENTROPY, dest="cross_entropy_loss_fusion"),
    _value("--cross-entropy-fusion-impl", str, "native", CROSS_ENTROPY, choices=["native", "te"]),
    _true("--optimizer-cpu-offload", OFFLOAD),
    _value("--optimizer-offload-fraction", float, 1.0, OFFLOAD),
    _true("--use-torch-optimizer-for-cpu-offload", OFFLOAD),
    _true("--overlap-cpu-optimizer-d2h-h2d", OFFLOAD),
    _false("--no-pin-cpu-grads", "pin_cpu_grads", OFFLOAD),
    _false("--no-pin-cpu-params", "pin_cpu_params", OFFLOAD),
    _false("--no-async-tensor-model-parallel-allreduce", "async_tensor_model_parallel_allreduce",
           "deprecated in Megatron too"),
    _true("--manual-gc", "Python's garbage collector runs as usual"),
    _value("--manual-gc-interval", int, 0, "Python's garbage collector runs as usual"),
    _false("--no-manual-gc-eval", "manual_gc_eval", "Python's garbage collector runs as usual"),
    _value("--pipeline-model-parallel-comm-backend", str, None, PERF, choices=["nccl", "ucc"]),
    _value("--high-priority-stream-groups", str, [], PERF, nargs="*"),
    _value("--error-injection-type", str, "transient_error", "only used with --error-injection-rate",
           choices=["correct_result", "transient_error", "persistent_error"]),
    # logging
    _true("--log-progress", "no progress.txt is written"),
    _true("--log-energy", "energy is not measured"),
    _false("--no-barrier-with-level-1-timing", "barrier_with_L1_time", "timers here never add barriers"),
    _false("--no-log-loss-scale-to-tensorboard", "log_loss_scale_to_tensorboard",
           "the loss scale is still written to tensorboard"),
    _true("--log-world-size-to-tensorboard", "the world size is not written to tensorboard"),
    # checkpointing
    _value("--non-persistent-ckpt-type", str, None, "only used with --non-persistent-save-interval",
           choices=["global", "local", "in_memory", None]),
    _value("--non-persistent-global-ckpt-dir", str, None, "only used with --non-persistent-save-interval"),
    _value("--non-persistent-local-ckpt-dir", str, None, "only used with --non-persistent-save-interval"),
    _value("--non-persistent-local-ckpt-algo", str, "fully_parallel", "only used with --non-persistent-save-interval",
           choices=["fully_parallel", "atomic"]),
    _false("--no-use-tokenizer-model-from-checkpoint-args", "use_tokenizer_model_from_checkpoint_args",
           "the tokenizer always comes from the command line"),
    _true("--use-dist-ckpt", "deprecated in Megatron too: --ckpt-format chooses", dest="use_dist_ckpt_deprecated"),
    _value("--dist-ckpt-format", str, None, "deprecated in Megatron too: --ckpt-format chooses",
           dest="dist_ckpt_format_deprecated"),
    _true("--ckpt-fully-parallel-save", "deprecated in Megatron too", dest="ckpt_fully_parallel_save_deprecated"),
    _false("--no-ckpt-fully-parallel-save", "ckpt_fully_parallel_save", DIST_CKPT),
    _true("--ckpt-fully-parallel-load", DIST_CKPT),
    _true("--ckpt-assume-constant-structure", DIST_CKPT),
    _value("--dist-ckpt-strictness", str, "assume_ok_unexpected", DIST_CKPT),
    _true("--use-persistent-ckpt-worker", "--async-save writes from a background thread of each rank"),
    # mixed precision
    _true("--grad-reduce-in-bf16", "gradients are reduced in fp32 (the more accurate choice)"),
    _true("--disable-bf16-reduced-precision-matmul", PERF),
    # distributed
    _false("--no-overlap-p2p-communication", "overlap_p2p_comm", PERF),
    _true("--overlap-p2p-communication-warmup-flush", PERF, dest="overlap_p2p_comm_warmup_flush"),
    _true("--defer-embedding-wgrad-compute", PERF, dest="defer_embedding_wgrad_compute"),
    _value("--wgrad-deferral-limit", int, 0, PERF),
    _true("--delay-wgrad-compute", PERF),
    _false("--no-align-grad-reduce", "align_grad_reduce", PERF),
    _false("--no-align-param-gather", "align_param_gather", PERF),
    _value("--ddp-num-buckets", int, None, PERF + " (the buckets are sized by --ddp-bucket-size)"),
    _true("--ddp-pad-buckets-for-high-nccl-busbw", PERF),
    _true("--overlap-param-gather-with-optimizer-step", PERF),
    _false("--no-scatter-gather-tensors-in-pipeline", "scatter_gather_tensors_in_pipeline", PERF),
    _true("--use-ring-exchange-p2p", PERF),
    _true("--use-nccl-ub", PERF, dest="nccl_ub"),
    _true("--use-sharp", PERF),
    _value("--nccl-communicator-config-path", str, None, PERF),
    _true("--init-model-with-meta-device", FSDP),
    _false("--no-gradient-reduce-div-fusion", "gradient_reduce_div_fusion", FSDP),
    _true("--fsdp-double-buffer", FSDP),
    _value("--suggested-communication-unit-size", int, None, FSDP),
    _true("--keep-fp8-transpose-cache-when-using-custom-fsdp", FSDP),
    _false("--torch-fsdp2-no-reshard-after-forward", "torch_fsdp2_reshard_after_forward", FSDP),
    _value("--replication-jump", int, None, "only used with --replication, which is not supported yet"),
    _value("--replication-factor", int, 2, "only used with --replication, which is not supported yet"),
    # validation, tokenizer, data
    _true("--test-mode", "Megatron's own functional tests only"),
    _value("--tiktoken-pattern", str, None, "only used with --tokenizer-type TikTokenizer"),
    _value("--tiktoken-num-special-tokens", int, 1000, "only used with --tokenizer-type TikTokenizer"),
    _value("--tiktoken-special-tokens", str, None, "only used with --tokenizer-type TikTokenizer", nargs="+"),
    _value("--decoder-seq-length", int, None, "T5 only: no effect on GPT"),
    _value("--retriever-seq-length", int, 256, OTHER_MODEL),
    _value("--sample-rate", float, 1.0, OTHER_MODEL),
    _value("--mask-prob", float, 0.15, OTHER_MODEL),
    _value("--short-seq-prob", float, 0.1, OTHER_MODEL),
    _value("--num-dataset-builder-threads", int, 1, "the dataset index is built by one thread"),
    _value("--object-storage-cache-path", str, None, "object-storage data paths are not supported"),
    # mixture of experts
    _true("--moe-shared-expert-overlap", MOE_PERF),
    _true("--moe-use-legacy-grouped-gemm", "--moe-grouped-gemm has one implementation here (grouped_mm / batched "
          "matmul); the parameters are the same either way"),
    _true("--moe-layer-recompute", "MoE layers are recomputed with their layer (--recompute-granularity full)"),
    _true("--moe-router-padding-for-fp8", FP8),
    _true("--moe-enable-deepep", MOE_PERF),
    _value("--moe-deepep-num-sms", int, 20, MOE_PERF),
    _true("--moe-permute-fusion", MOE_PERF),
    # experimental
    _true("--enable-experimental", "no experimental code paths here"),
)

REFUSED = (
    _true("--moe-extended-tp", "--moe-extended-tp (deprecated in Megatron: use --expert-tensor-parallel-size)"),
    _true("--moe-use-upcycling", "upcycling a dense checkpoint into MoE"),
    _true("--moe-router-force-load-balancing", "random MoE routing for benchmarks"),
    _value("--moe-input-jitter-eps", float, None, "MoE router input jitter"),
    _true("--moe-apply-probs-on-input", "weighting MoE expert inputs instead of outputs"),
    _value("--moe-upcycling-granularity", int, 1, "upcycling a dense checkpoint into MoE"),
    _value("--mtp-num-layers", int, None, "multi-token prediction"),
    _true("--multi-latent-attention", "multi-latent attention"),
    _true("--qk-l2-norm", "L2 norms of the queries and keys"),
    _value("--no-rope-freq", str, None, "skipping the rotary embedding on some layers"),
    _true("--use-legacy-models", "Megatron's legacy models (the models here are megatron-core style)"),
    _true("--check-for-spiky-loss", "the rerun engine's spiky-loss check", dest="check_for_spiky_loss"),
    _true("--check-for-large-grads", "the rerun engine's large-gradient check", dest="check_for_large_grads"),
    _value("--iterations-to-skip", int, [], "skipping iterations", nargs="+"),
    _value("--error-injection-rate", int, 0, "the rerun engine's error injection"),
    _value("--rerun-mode", str, "disabled", "the rerun engine",
           choices=["disabled", "validate_results", "report_stats"]),
    _true("--init-method-xavier-uniform", "Xavier-uniform initialization"),
    _value("--decoupled-lr", float, None, "a separate learning rate for the embedding and output layers"),
    _value("--decoupled-min-lr", float, None, "a separate learning rate for the embedding and output layers"),
    _value("--non-persistent-save-interval", int, None, "non-persistent (local) checkpoints"),
    _value("--ckpt-step", int, None, "loading a chosen iteration (point the tracker file at it)"),
    _true("--use-mp-args-from-checkpoint-args", "taking the parallel sizes from the checkpoint"),
    _value("--ckpt-convert-format", str, None, "converting checkpoints while training (use tools/checkpoint)",
           choices=["torch", "torch_dist", "zarr"]),
    _value("--ckpt-convert-save", str, None, "converting checkpoints while training (use tools/checkpoint)"),
    _true("--ckpt-convert-update-legacy-dist-opt-format", "converting checkpoints while training"),
    _true("--load-model-opt-format", "ModelOpt checkpoints"),
    _value("--encoder-tensor-model-parallel-size", int, 0, "a separate encoder parallel layout"),
    _value("--encoder-pipeline-model-parallel-size", int, 0, "a separate encoder parallel layout"),
    _value("--decoder-first-pipeline-num-layers", int, None, "uneven pipeline stages"),
    _value("--decoder-last-pipeline-num-layers", int, None, "uneven pipeline stages"),
    _value("--pipeline-model-parallel-layout", str, None, "custom pipeline layouts"),
    _true("--account-for-embedding-in-pipeline-split", "uneven pipeline stages"),
    _true("--account-for-loss-in-pipeline-split", "uneven pipeline stages"),
    _value("--lazy-mpu-init", str, None, "lazy model-parallel initialization"),
    _true("--use-custom-fsdp", "FSDP"),
    _true("--use-torch-fsdp2", "FSDP"),
    _value("--data-parallel-sharding-strategy", str, "no_shard", "FSDP sharding",
           choices=["no_shard", "optim", "optim_grads", "optim_grads_params"]),
    _value("--num-distributed-optimizer-instances", int, 1, "several distributed-optimizer instances"),
    _true("--use-tp-pp-dp-mapping", "the tp-pp-dp rank order (ranks are ordered tp-cp-ep-dp-pp)"),
    _true("--replication", "checkpoint replication"),
    _value("--data-args-path", str, None, "reading --data-path from a file"),
    _value("--per-split-data-args-path", str, None, "reading the per-split data paths from a file"),
    _value("--mid-level-dataset-surplus", float, 0.005, "a blend surplus other than 0.005"),
    _true("--use-precision-aware-optimizer", "the precision-aware optimizer"),
    _value("--main-grads-dtype", str, "fp32", "main gradients other than fp32", choices=["fp32", "bf16"]),
    _value("--main-params-dtype", str, "fp32", "main parameters other than fp32", choices=["fp32", "fp16"]),
    _value("--exp-avg-dtype", str, "fp32", "Adam states other than fp32", choices=["fp32", "fp16", "bf16", "fp8"]),
    _value("--exp-avg-sq-dtype", str, "fp32", "Adam states other than fp32", choices=["fp32", "fp16", "bf16", "fp8"]),
)


def add_megatron_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the NO_EFFECT and REFUSED flags, with help saying which they are."""
    group = parser.add_argument_group(title="Megatron-LM flags without effect here, or not supported yet")
    for row in NO_EFFECT:
        group.add_argument(*row.names, **row.kwargs, help=f"No effect here: {row.why}.")
    for row in REFUSED:
        group.add_argument(*row.names, **row.kwargs, help=f"Not supported yet: {row.why}.")
    return parser


def refusal_rows() -> tuple:
    """REFUSED as rows of arguments_validation.NOT_YET_SUPPORTED: (dest, flag, supported value, feature)."""
    return tuple((row.dest, row.names[0], row.default, row.why) for row in REFUSED)


# NO_EFFECT flags that pretrain_t5.py and pretrain_bert.py read (their args_defaults set
# args.model_family "T5" / "BERT"; arguments_model.is_t5).
T5_FLAGS = ("--decoder-seq-length", "--decoder-num-layers", "--relative-attention-num-buckets",
            "--relative-attention-max-distance", "--mask-prob", "--short-seq-prob")
BERT_FLAGS = ("--bert-no-binary-head", "--mask-prob", "--short-seq-prob")
FAMILY_FLAGS = {"T5": T5_FLAGS, "BERT": BERT_FLAGS}


def no_effect_flags_given(args: Namespace) -> list:
    """The NO_EFFECT flags whose value is not the default, as the user spelled them (for T5 and
    BERT, not the flags their scripts read)."""
    used = FAMILY_FLAGS.get(args.model_family, ())
    return [row.names[0] for row in NO_EFFECT
            if getattr(args, row.dest) != row.default and row.names[0] not in used]


# ----------------------------------------------------------------------------- validation


def _take_alias(args: Namespace, alias: str, dest: str) -> None:
    """Megatron's second name of a flag (--encoder-num-layers for --num-layers): give one of the two."""
    value = getattr(args, alias)
    if value is not None:
        if getattr(args, dest) not in (None, value):
            raise ArgsError(f"{flag(dest)} ({getattr(args, dest)}) and {flag(alias)} ({value}) are two names "
                            "of one setting; give one of them")
        setattr(args, dest, value)
    setattr(args, alias, getattr(args, dest))  # as Megatron keeps it


# What each --attention-backend value runs here (the start-up log says it too).
ATTENTION_BACKENDS = {
    "local": "the unfused core attention (DotProductAttention; on CPU its fused core with "
             "--fused-kernels-cpu-impl native)",
    "flash": "the fused-kernel core attention (flash-attn on CUDA when installed, else torch's "
             "scaled_dot_product_attention)",
}
ATTENTION_BACKENDS["unfused"] = ATTENTION_BACKENDS["local"]
ATTENTION_BACKENDS["fused"] = ATTENTION_BACKENDS["flash"]


def _validate_attention_backend(args: Namespace) -> None:
    """--attention-backend onto use_flash_attn: flash/fused set it, local/unfused refuse it, auto keeps it."""
    backend = args.attention_backend
    if backend in ("flash", "fused"):
        args.use_flash_attn = True
    elif backend in ("local", "unfused") and args.use_flash_attn:
        raise ArgsError(f"--attention-backend {backend} (the unfused core attention) conflicts with "
                        "--use-flash-attn; drop one of them")
    chosen = "flash" if args.use_flash_attn else "local"
    because = "" if backend != "auto" else (" (--use-flash-attn)" if args.use_flash_attn else " (the default)")
    _print_rank_0(args, f"> attention backend {backend}: {ATTENTION_BACKENDS[chosen]}{because}")


def validate_megatron_flags(args: Namespace) -> None:
    """Megatron-LM flags that map onto ours, the ones refused only in some combinations, and one
    warning naming the given flags that have no effect here. Raises ArgsError."""
    _take_alias(args, "encoder_num_layers", "num_layers")
    _take_alias(args, "encoder_seq_length", "seq_length")
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise ArgsError("--no-position-embedding is deprecated (as in Megatron-LM): use --position-embedding-type")
    if args.recompute_modules not in (None, ["core_attn"]):
        raise ArgsError(f"--recompute-modules {' '.join(args.recompute_modules)}: recomputing modules other "
                        "than core_attn is not supported yet; remove it (selective recompute is core_attn)")
    group = args.microbatch_group_size_per_vp_stage
    if group not in (None, args.pipeline_model_parallel_size):
        raise ArgsError(f"--microbatch-group-size-per-virtual-pipeline-stage {group}: groups other than "
                        f"--pipeline-model-parallel-size ({args.pipeline_model_parallel_size}) are not "
                        "supported yet; remove it")
    _validate_attention_backend(args)
    ignored = no_effect_flags_given(args)
    if ignored:
        _print_rank_0(args, f"WARNING: these Megatron-LM flags have no effect here (docs/training.md, "
                            f"\"Megatron flags\"): {' '.join(ignored)}")


def _print_rank_0(args: Namespace, message: str) -> None:
    if args.rank == 0:
        print_line(message)
