"""Every command-line flag, grouped and named as in Megatron-LM, and the builders of the configs.

| function | what |
|---|---|
| parse_args(extra_args_provider, ignore_unknown_args, argv) | the Namespace; RANK / WORLD_SIZE from the environment |
| validate_args(args, defaults) | checks and derived values (megatron/training/arguments_validation.py) |
| parse_and_validate_args(...) | both |
| print_args(args) | Megatron's "---- arguments ----" block on rank 0 |
| core_transformer_config_from_args(args) | megatron.model.TransformerConfig |
| gpt_model_kwargs(args) | GPTModel's position-embedding keywords (rope, alibi, none, ...) |
| optimizer_config_from_args(args) | megatron.core.optimizer.OptimizerConfig |
| gpt_dataset_config_from_args(args, tokenizer) | megatron.data.dataset_config.GPTDatasetConfig |

Flag names, dests and defaults are Megatron's (v0.13), quirks included: the underscore in
--override-opt_param-scheduler, dest add_bias_linear for --disable-bias-linear, None (not False)
as the default of --no-save-optim / --no-load-optim / --no-save-rng / --no-load-rng.
Deviations: --distributed-backend defaults to
None (chosen by megatron.core.device), --transformer-impl to 'local' (Transformer Engine is optional).
"""

from __future__ import annotations

import argparse
import os
from argparse import Namespace
from collections.abc import Callable
from typing import Any

from megatron.training.arguments_validation import (
    ArgsError,
    env_rank_and_world_size,
    print_args,
    validate_args,
)
from megatron.training.arguments_megatron import add_megatron_flags
from megatron.training.tokenizer.arguments import add_tokenizer_args

__all__ = [
    "ArgsError",
    "core_transformer_config_from_args",
    "gpt_model_kwargs",
    "gpt_dataset_config_from_args",
    "optimizer_config_from_args",
    "parse_and_validate_args",
    "parse_args",
    "print_args",
    "validate_args",
]

# Megatron-core's AttnBackend names (megatron/core/transformer/enums.py).
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
# Megatron's choices plus alibi (Accelerate's Megatron-LM integration); arguments_model refuses
# relative and mrope.
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "alibi", "mrope", "relative", "none")

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser | None]


def _add_network_size_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="network size")
    group.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    group.add_argument("--encoder-num-layers", type=int, default=None,
                       help="Megatron's other name of --num-layers (give one of the two).")
    group.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="Transformer feed-forward hidden size; 4 x hidden-size if not given "
                            "(with --swiglu: int(4 x hidden-size x 2/3 / 64) x 64, as Megatron).")
    group.add_argument("--num-attention-heads", type=int, default=None, help="Number of attention heads.")
    group.add_argument("--kv-channels", type=int, default=None,
                       help="Per-head projection size; hidden-size // num-attention-heads if not given.")
    group.add_argument("--group-query-attention", action="store_true",
                       help="Grouped-query attention: --num-query-groups key/value heads.")
    group.add_argument("--num-query-groups", type=int, default=1,
                       help="Key/value heads with --group-query-attention (1: multi-query); ignored "
                            "without it (one per attention head), as in Megatron.")
    group.add_argument("--attention-head-type", type=str, default=None, choices=("multihead", "multiquery"),
                       help="The older spelling Accelerate's guide uses: multiquery = --group-query-attention "
                            "--num-query-groups 1; multihead = one key/value head per attention head.")
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="Maximum number of position embeddings (size of the learned position table).")
    group.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                       choices=POSITION_EMBEDDING_TYPES,
                       help="learned_absolute (a table), rope (rotary), alibi (linear attention biases, as "
                            "Accelerate's Megatron integration), none; relative and mrope are refused.")
    group.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="Legacy alias of --position-embedding-type rope.")
    group.add_argument("--rotary-base", type=int, default=10000, help="Base of the rotary frequencies.")
    group.add_argument("--rotary-percent", type=float, default=1.0,
                       help="Fraction of each head's channels that rotate (the rest pass through).")
    group.add_argument("--rotary-interleaved", action="store_true",
                       help="Rotate adjacent channel pairs (GPT-J style) instead of the two halves.")
    group.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                       help="Divide the rotary positions by this factor (position interpolation).")
    group.add_argument("--use-rope-scaling", action="store_true",
                       help="Llama-3.1 scaling of the rotary frequencies.")
    group.add_argument("--rope-scaling-factor", type=float, default=8.0,
                       help="The scaling factor of --use-rope-scaling (Llama-3.1's 8).")
    group.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                       help="Deprecated in Megatron: an error unless with rope; use --position-embedding-type.")
    group.add_argument("--attention-backend", type=str, default="auto", choices=ATTENTION_BACKENDS,
                       help="Megatron's choice of core attention, mapped onto this framework's: local and "
                            "unfused = the unfused core attention (on CPU with the fused core of "
                            "--fused-kernels-cpu-impl native), flash and fused = the fused-kernel core "
                            "(--use-flash-attn: flash-attn on CUDA when installed, else torch's "
                            "scaled_dot_product_attention), auto = --use-flash-attn decides.")
    group.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
                       help="The normalization layers.")
    group.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5,
                       help="Epsilon of the normalization layers.")
    group.add_argument("--apply-layernorm-1p", action="store_true",
                       help="Norm weights stored zero-centred (the layer multiplies by 1 + weight).")
    group.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                       help="Take the residual from after the layernorm (original BERT/GPT-1 style).")
    group.add_argument("--bert-post-layernorm", action="store_true",
                       help="BERT only (not a Megatron flag): the original BERT's layout, HF BertForPreTraining's: "
                            "a LayerNorm on the embeddings, LayerNorm after each residual add, no final LayerNorm "
                            "(default: Megatron's pre-LN BERT). Kept in the checkpoint's args.")
    group.add_argument("--openai-gelu", action="store_true",
                       help="Tanh-approximated GeLU (HF gelu_new), for GPT-2 checkpoints.")
    group.add_argument("--squared-relu", action="store_true", help="MLP activation relu(x)^2 instead of GeLU.")
    group.add_argument("--swiglu", action="store_true",
                       help="Gated MLP: silu(x W_gate) * (x W_up), instead of GeLU.")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="Separate input embedding and output layer weights.")
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                       help="Disable the bias of the linear layers.")
    group.add_argument("--add-qkv-bias", action="store_true", dest="add_qkv_bias",
                       help="A bias on the QKV projection even with --disable-bias-linear (Qwen2).")
    group.add_argument("--qk-layernorm", action="store_true",
                       help="Normalize each head's queries and keys (with --normalization's norm).")
    group.add_argument("--spec", nargs="*", default=None, metavar=("MODULE", "NAME"),
                       help="The layer spec to build: NAME in the importable module MODULE, a ModuleSpec or a "
                            "function returning one (Megatron's --spec; docs/model.md). Default: the GPT spec "
                            "the architecture flags describe.")
    group.add_argument("--transformer-impl", default="local", choices=["local", "transformer_engine"],
                       help="Layer implementation (only local is supported yet).")
    return parser


def _add_regularization_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="regularization")
    group.add_argument("--attention-dropout", type=float, default=0.1, help="Post attention dropout probability.")
    group.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout probability for hidden state.")
    group.add_argument("--weight-decay", type=float, default=0.01, help="Weight decay coefficient (L2).")
    group.add_argument("--start-weight-decay", type=float, default=None,
                       help="Initial weight decay of a linear/cosine increment.")
    group.add_argument("--end-weight-decay", type=float, default=None,
                       help="End of run weight decay of a linear/cosine increment.")
    group.add_argument("--weight-decay-incr-style", type=str, default="constant",
                       choices=["constant", "linear", "cosine"], help="Weight decay increment function.")
    group.add_argument("--clip-grad", type=float, default=1.0, help="Gradient clipping on the global L2 norm.")
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-08)
    group.add_argument("--sgd-momentum", type=float, default=0.9)
    return parser


def _add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, default=None, help="Batch size per model instance.")
    group.add_argument("--batch-size", type=int, default=None, help="Old batch size parameter, do not use. "
                       "Use --micro-batch-size instead")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="Training batch size; micro-batch-size x data-parallel size if not given.")
    group.add_argument("--rampup-batch-size", nargs="*", default=None,
                       help="<start> <increment> <ramp-samples>: grow the global batch size.")
    group.add_argument("--recompute-activations", action="store_true",
                       help="Selective activation recompute (--recompute-granularity selective).")
    group.add_argument("--recompute-granularity", type=str, default=None, choices=["full", "selective"],
                       help="Recompute activations in backward: full = whole transformer layers "
                       "(with --recompute-method), selective = the core attention only.")
    group.add_argument("--distribute-saved-activations", action="store_true",
                       help="With full recompute and tensor parallelism, keep 1/TP of each saved layer "
                       "input per rank (all-gathered before recomputing).")
    group.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"],
                       help="Full recompute: uniform = every group of --recompute-num-layers layers keeps "
                       "only its input; block = only the first --recompute-num-layers layers of each "
                       "pipeline stage are recomputed, one by one.")
    group.add_argument("--recompute-num-layers", type=int, default=None,
                       help="uniform: layers per recomputed group; block: layers recomputed per pipeline stage.")
    group.add_argument("--recompute-modules", nargs="*", type=str, default=None,
                       help="Submodules of selective recompute: only core_attn (the default) is supported yet.")
    group.add_argument("--use-flash-attn", action="store_true",
                       help="Fused attention: flash-attn on CUDA when installed, else torch's "
                       "scaled_dot_product_attention.")
    group.add_argument("--checkpoint-activations", action="store_true",
                       help="No longer valid: use --recompute-activations.")
    group.add_argument("--train-iters", type=int, default=None, help="Total iterations to train.")
    group.add_argument("--train-samples", type=int, default=None, help="Total samples to train.")
    group.add_argument("--log-interval", type=int, default=100, help="Report interval in iterations.")
    group.add_argument("--exit-interval", type=int, default=None,
                       help="Exit when the iteration is divisible by this value.")
    group.add_argument("--exit-duration-in-mins", type=float, default=None,
                       help="Exit after this many minutes (Megatron takes whole minutes; fractions are accepted).")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="Save a checkpoint and exit on SIGTERM.")
    group.add_argument("--tensorboard-dir", type=str, default=None, help="Write tensorboard logs here.")
    # Fused ops (docs/fused_kernels.md, "Using them in the model"): on unless switched off, as in Megatron.
    group.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                       help="Attention softmax in plain PyTorch ops, not fused_kernels.scale_mask_softmax.")
    group.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
                       help="Bias add and GeLU unfused; the GeLU is then the erf one (or tanh with "
                       "--openai-gelu). Fused, it is always the tanh approximation, as in Megatron.")
    group.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
                       help="With --swiglu: bias add and SwiGLU in plain PyTorch ops, not fused_kernels.bias_swiglu.")
    group.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
                       help="With rope: rotate in plain PyTorch ops, not fused_kernels.rotary_pos_emb.")
    group.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
                       help="Bias + dropout + residual add of each branch in plain PyTorch ops.")
    group.add_argument("--no-persist-layer-norm", action="store_false", dest="persist_layer_norm",
                       help="No effect: Megatron picks between two apex LayerNorm kernels; here "
                       "fused_kernels.layer_norm always runs.")
    group.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                       help="Linear layers return their weight gradients through .grad for the DDP hook to "
                       "add into main_grad, instead of adding them into main_grad in backward.")
    group.add_argument("--fused-kernels-cpu-impl", type=str, default="native", choices=["native", "reference", "compiled"],
                       help="Fused ops on CPU tensors: ATen's own kernels and the one-node attention core "
                       "(native, the fast path), the formulas op by op (reference, the plain path), or "
                       "torch.compile'd formulas (compiled: 5-25 s of compile start-up per process). On CUDA: Triton.")
    group.add_argument("--torch-compile", action="store_true",
                       help="torch.compile each transformer layer's forward. Off by default: on the CPU "
                       "benchmark GPT it was slower than the eager fast path (docs/PERFORMANCE.md), and it "
                       "compiles for tens of seconds per process.")
    group.add_argument("--optimizer", type=str, default="adam", choices=["adam", "sgd"])
    group.add_argument("--dataloader-type", type=str, default=None, choices=["single", "cyclic", "external"],
                       help="Single pass vs multiple pass data loader ('single' if not given).")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--calculate-per-token-loss", action="store_true",
                       help="Divide the loss by the number of tokens of the whole global batch.")
    group.add_argument("--include-padded-vocab-in-loss", action="store_true",
                       help="Megatron's loss: the softmax over the whole padded vocabulary, the padding "
                       "rows of the embedding drawn like the others. Default: over the tokenizer's ids "
                       "only, the same loss at every tensor-parallel size (docs/training.md).")
    group.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                       help="Empty the accelerator's cache: 1 after each iteration, 2 also after eval.")
    group.add_argument("--deterministic-mode", action="store_true", help="Use deterministic algorithms.")
    # On by default, as in Megatron-LM; the positive spelling is kept for explicit scripts.
    group.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                       help="Stop with an error naming the iteration when the loss or the gradient "
                            "norm is NaN/Inf (the default).")
    group.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                       dest="check_for_nan_in_loss_and_grad", help="Train on through NaN/Inf losses.")
    return parser


def _add_initialization_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="initialization")
    group.add_argument("--seed", type=int, default=1234, help="Random seed of python, numpy, torch and the device.")
    group.add_argument("--data-parallel-random-init", action="store_true",
                       help="Different initial weights on each data-parallel rank.")
    group.add_argument("--init-method-std", type=float, default=0.02,
                       help="Standard deviation of the zero-mean normal weight initialization.")
    return parser


def _add_learning_rate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="learning rate")
    group.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    group.add_argument("--lr-decay-style", type=str, default="linear",
                       choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    group.add_argument("--lr-wsd-decay-style", type=str, default="exponential",
                       choices=["exponential", "linear", "cosine", "minus_sqrt"])
    group.add_argument("--lr-decay-iters", type=int, default=None,
                       help="Iterations to decay the LR over; --train-iters if not given.")
    group.add_argument("--lr-decay-samples", type=int, default=None,
                       help="Samples to decay the LR over; --train-samples if not given.")
    group.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    group.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    group.add_argument("--lr-warmup-fraction", type=float, default=None,
                       help="Fraction of the LR decay steps used for warmup.")
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--lr-warmup-samples", type=int, default=0)
    group.add_argument("--lr-warmup-init", type=float, default=0.0, help="Initial LR of the linear warmup.")
    group.add_argument("--warmup", type=int, default=None,
                       help="Old lr warmup argument, do not use. Use one of the --lr-warmup-* arguments.")
    group.add_argument("--min-lr", type=float, default=0.0, help="Minimum value of the learning rate.")
    group.add_argument("--override-opt_param-scheduler", action="store_true",
                       help="Use the scheduler values of the command line, not the checkpoint's.")
    group.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                       help="Use the scheduler values of the checkpoint.")
    return parser


def _add_checkpointing_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", type=str, default=None, help="Output directory for checkpoints.")
    group.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None,
                       help="Iterations between checkpoint saves.")
    group.add_argument("--no-save-optim", action="store_true", default=None, help="Do not save the optimizer.")
    group.add_argument("--no-save-rng", action="store_true", default=None, help="Do not save the RNG state.")
    group.add_argument("--load", type=str, default=None, help="Directory holding a checkpoint.")
    group.add_argument("--load-hf", type=str, default=None,
                       help="A transformers model directory to start from: the model flags come from its "
                            "config.json, the weights are sharded for this TP/PP on load (megatron/training/load_hf.py); "
                            "a checkpoint under --load wins once there is one.")
    group.add_argument("--no-load-optim", action="store_true", default=None, help="Do not load the optimizer.")
    group.add_argument("--no-load-rng", action="store_true", default=None, help="Do not load the RNG state.")
    group.add_argument("--finetune", action="store_true",
                       help="Load the model only and start from iteration 0.")
    group.add_argument("--pretrained-checkpoint", type=str, default=None,
                       help="Directory containing a pretrained model checkpoint for finetuning: loaded (model "
                            "only, as with --finetune) when --load holds no checkpoint yet; tasks/main.py's "
                            "fine-tuning tasks start from it.")
    group.add_argument("--use-checkpoint-args", action="store_true",
                       help="Take the model-shape arguments from the checkpoint.")
    group.add_argument("--exit-on-missing-checkpoint", action="store_true",
                       help="Exit if --load is given but no checkpoint is found there.")
    group.add_argument("--trust-checkpoint-pickles", action="store_true",
                       help="Read checkpoint files with full unpickling (they can run code) instead of "
                            "the allow-list; only for files from a trusted source that the allow-list refuses.")
    group.add_argument("--no-initialization", action="store_false", dest="perform_initialization",
                       help="Do not initialize the weights (they come from a checkpoint).")
    group.add_argument("--ckpt-format", default="torch_dist",
                       choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"],
                       help="Checkpoint format: torch_dist (sharded, written by every rank with PyTorch DCP, "
                            "loads at any TP/PP/DP) or torch (one file per TP/PP rank); the others are not "
                            "supported yet.")
    group.add_argument("--auto-detect-ckpt-format", action="store_true",
                       help="On load, read the checkpoint in the format its files show (torch or torch_dist), "
                            "whatever --ckpt-format says.")
    group.add_argument("--async-save", action="store_true", default=None,
                       help="--ckpt-format torch_dist: write checkpoints in a background thread while training "
                            "continues; a checkpoint becomes the latest once every rank finished writing it.")
    return parser


def _add_mixed_precision_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument("--fp16", action="store_true", help="Run the model in fp16.")
    group.add_argument("--bf16", action="store_true", help="Run the model in bfloat16.")
    group.add_argument("--loss-scale", type=float, default=None,
                       help="Static loss scale (a power of 2); dynamic loss scaling if not given.")
    group.add_argument("--initial-loss-scale", type=float, default=2**32, help="Initial dynamic loss scale.")
    group.add_argument("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic loss scale.")
    group.add_argument("--loss-scale-window", type=float, default=1000,
                       help="Clean steps before the dynamic loss scale grows.")
    group.add_argument("--hysteresis", type=int, default=2, help="Overflows before the loss scale backs off.")
    group.add_argument("--fp32-residual-connection", action="store_true", help="Keep the residual in fp32.")
    group.add_argument("--apply-query-key-layer-scaling", action="store_true",
                       help="Scale Q x K^T by 1 / layer-number (forces softmax in fp32).")
    group.add_argument("--attention-softmax-in-fp32", action="store_true",
                       help="Run attention masking and softmax in fp32.")
    group.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                       help="Gradient accumulation and all-reduce in fp32.")
    group.add_argument("--fp16-lm-cross-entropy", action="store_true",
                       help="Compute the unreduced cross entropy in fp16.")
    group.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"], dest="fp8")
    return parser


def _add_distributed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="distributed")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-split-rank", type=int, default=None,
                       help="Encoder-decoder models (T5): the first decoder stage; the stages before it hold "
                            "the encoder.")
    group.add_argument("--model-parallel-size", type=int, default=None,
                       help="Old model parallel argument, do not use. Use --tensor-model-parallel-size.")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Layers per virtual pipeline stage (model chunk): the interleaved 1F1B schedule.")
    group.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                       help="Model chunks per pipeline rank (the interleaved schedule); alternative to "
                            "--num-layers-per-virtual-pipeline-stage.")
    group.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                       dest="microbatch_group_size_per_vp_stage",
                       help="Interleaved schedule: micro-batches per group; only the default "
                            "(--pipeline-model-parallel-size) is supported yet.")
    group.add_argument("--context-parallel-size", type=int, default=1)
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                       help="nccl on CUDA, gloo on CPU if not given.")
    group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="Timeout of the distributed collectives, in minutes.")
    group.add_argument("--watchdog-seconds", type=float, default=None,  # ours
                       help="A rank waiting longer than this in a collective or pipeline send/receive prints "
                            "what it waits on (operation, group, peer, micro-batch) and exits non-zero "
                            "(default: --distributed-timeout-minutes).")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="Launch each gradient bucket's data-parallel reduction as soon as its last "
                            "gradient of the step is ready, overlapping it with the rest of backward.")
    group.add_argument("--overlap-param-gather", action="store_true")
    group.add_argument("--ddp-bucket-size", type=int, default=None,
                       help="Elements per gradient bucket (default with --overlap-grad-reduce: "
                            "max(40M, 1M x data-parallel size); one bucket otherwise).")
    group.add_argument("--ddp-average-in-collective", action="store_true",
                       help="Average gradients in the collective (ReduceOp.AVG) instead of pre-scaling by 1/DP.")
    group.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                       help="Every this many iterations, check that the weights are identical on all "
                            "data-parallel replicas (a hash all-gathered over the DP group).")
    group.add_argument("--local-rank", type=int, default=int(os.getenv("LOCAL_RANK", "0")),
                       help="Local rank, from the LOCAL_RANK environment variable that torchrun sets.")
    group.add_argument("--use-cpu-initialization", action="store_true", default=None,
                       help="Initialize the weights on the CPU.")
    # CPU runs (megatron/core/cpu_runtime.py): threads per process and the allocator.
    group.add_argument("--cpu-threads", type=int, default=None,
                       help="Intra-op threads per process on CPU (default: OMP_NUM_THREADS if set, else the "
                            "cores this process may use divided by the processes on this node).")
    group.add_argument("--no-cpu-malloc-tuning", action="store_false", dest="cpu_malloc_tuning",
                       help="Leave glibc malloc's defaults: freed activations go back to the kernel and are "
                            "faulted in again every step (tuned by default on CPU: memory kept for reuse).")
    return parser


def _add_validation_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="validation")
    group.add_argument("--eval-iters", type=int, default=100, help="Iterations of each evaluation.")
    group.add_argument("--eval-interval", type=int, default=1000, help="Iterations between evaluations.")
    group.add_argument("--skip-train", action="store_true", help="Only evaluate, do not train.")
    return parser


def _add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="data and dataloader")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="One prefix, 'w1 p1 w2 p2 ...' (a weighted blend) or 'p1 p2 ...'.")
    group.add_argument("--split", type=str, default=None,
                       help="train,valid,test proportions of --data-path, e.g. '949,50,1'.")
    group.add_argument("--train-data-path", nargs="*", default=None)
    group.add_argument("--valid-data-path", nargs="*", default=None)
    group.add_argument("--test-data-path", nargs="*", default=None)
    group.add_argument("--data-cache-path", default=None, help="Where to cache the dataset index arrays.")
    group.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                       help="Read the .bin files without memory mapping.")
    group.add_argument("--mock-data", action="store_true", help="Synthetic data instead of --data-path.")
    group.add_argument("--seq-length", type=int, default=None, help="Maximum sequence length to process.")
    group.add_argument("--encoder-seq-length", type=int, default=None,
                       help="Megatron's other name of --seq-length (give one of the two).")
    group.add_argument("--num-workers", type=int, default=2, help="Dataloader worker processes.")
    group.add_argument("--reset-position-ids", action="store_true",
                       help="Restart position ids after each end-of-document token.")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="Do not attend across end-of-document tokens.")
    group.add_argument("--eod-mask-loss", action="store_true", help="No loss on end-of-document tokens.")
    group.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                       dest="create_attention_mask_in_dataloader",
                       help="Do not build the [1, s, s] attention mask in the data loader.")
    return parser


def _add_logging_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="logging")
    group.add_argument("--log-params-norm", action="store_true", help="Log the norm of the parameters.")
    group.add_argument("--log-num-zeros-in-grad", action="store_true", help="Log the number of zero gradients.")
    group.add_argument("--log-throughput", action="store_true", help="Log TFLOP/s per device.")
    group.add_argument("--log-communication-stats", action="store_true",
                       help="Count the calls and bytes of every collective, per operation and process group, "
                            "and print them with each log line (not a Megatron flag).")
    group.add_argument("--timing-log-level", type=int, default=0, choices=range(3),
                       help="Granularity of the timers: 0 iteration only, 1 coarse, 2 fine.")
    group.add_argument("--timing-log-option", type=str, default="minmax", choices=["max", "minmax", "all"])
    group.add_argument("--tensorboard-log-interval", type=int, default=1)
    group.add_argument("--tensorboard-queue-size", type=int, default=1000,
                       help="Events and summaries queued before a flush to disk.")
    group.add_argument("--log-timers-to-tensorboard", action="store_true")
    group.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    group.add_argument("--log-memory-to-tensorboard", action="store_true")
    group.add_argument("--wandb-project", type=str, default="", help="The wandb project name; off if empty.")
    group.add_argument("--wandb-exp-name", type=str, default="", help="The wandb experiment name.")
    group.add_argument("--wandb-save-dir", type=str, default="", help="Where wandb saves its files.")
    group.add_argument("--logging-level", type=int, default=None, help="Python logging level.")
    return parser


def moe_freq_type(text: str) -> int | list[int]:
    """--moe-layer-freq: an integer N (an MoE layer every N layers) or a list of 0/1 per layer, written
    as a list expression of integer lists, + and * ("([1]*3+[0])*2"). Parsed, never evaluated as code."""
    import ast

    def value(node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, (list, int)) and isinstance(right, (list, int)):
                return left * right
        raise ValueError
    try:
        parsed = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a list expression such as "
                                         '"([1]*3+[0]*1)*2"') from None
    if isinstance(parsed, list) and not all(type(v) is int for v in parsed):
        raise argparse.ArgumentTypeError(f"{text!r} must give a flat list of 0/1 values")
    return parsed


def _add_moe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's mixture-of-experts flags (docs/moe.md); the ones with no effect or not supported are in
    arguments_megatron.py."""
    group = parser.add_argument_group(title="moe")
    group.add_argument("--num-experts", type=int, default=None, help="Experts per MoE layer (None: a dense model).")
    group.add_argument("--expert-model-parallel-size", type=int, default=1, help="Degree of expert parallelism.")
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                       help="Tensor parallelism inside each expert (default: --tensor-model-parallel-size).")
    group.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                       help='An MoE layer every N layers, or a 0/1 list per layer such as "([1]*3+[0]*1)*3".')
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                       help="Each expert's ffn hidden size (default: --ffn-hidden-size).")
    group.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                       help="The shared experts' total ffn hidden size (None: no shared expert).")
    group.add_argument("--moe-grouped-gemm", action="store_true",
                       help="Run a rank's experts as one grouped (or batched) matmul; same parameters and result.")
    group.add_argument("--moe-router-load-balancing-type", type=str, default="aux_loss",
                       choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"])
    group.add_argument("--moe-router-dtype", type=str, default=None, choices=["fp32", "fp64"],
                       help="The router's logits and scores in this precision.")
    group.add_argument("--moe-router-score-function", type=str, default="softmax", choices=["softmax", "sigmoid"])
    group.add_argument("--moe-router-topk", type=int, default=2, help="Experts per token (default 2).")
    group.add_argument("--moe-router-pre-softmax", action="store_true",
                       help="Softmax over all experts before the top-k (default: over the top-k).")
    group.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    group.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="Load-balancing loss coefficient.")
    group.add_argument("--moe-z-loss-coeff", type=float, default=None, help="Router z-loss coefficient.")
    group.add_argument("--moe-per-layer-logging", action="store_true",
                       help="Log each MoE layer's balancing losses and tokens per expert.")
    group.add_argument("--moe-token-dispatcher-type", type=str, default="allgather",
                       choices=["allgather", "alltoall", "flex"])
    group.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                       help="Each expert takes at most ceil(tokens * topk / experts * factor) of a rank's tokens.")
    group.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    group.add_argument("--moe-token-drop-policy", type=str, default="probs", choices=["probs", "position"])
    group.add_argument("--moe-drop-warning-threshold", type=float, default=0.1,
                       help="Ours: warn when more than this fraction of an MoE layer's routed tokens is dropped "
                            "in a logging interval (an expert with no tokens is always warned about).")
    return parser


def _add_planner_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Ours: pretrain_gpt.py --dry-run prints the pre-flight plan (megatron/planner) and exits."""
    from megatron.planner.plan import add_device_args

    parser.add_argument("--dry-run", action="store_true",
                        help="Validate the flags, print the plan per rank (memory, communication, step time, "
                             "MFU on the --device-* description) and exit 0 before building the model.")
    add_device_args(parser)
    return parser


def build_parser(extra_args_provider: ExtraArgsProvider | None = None) -> argparse.ArgumentParser:
    """The parser with every group, then the script's own flags from extra_args_provider."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    for add_group in (_add_network_size_args, _add_regularization_args, _add_training_args,
                      _add_initialization_args, _add_learning_rate_args, _add_checkpointing_args,
                      _add_mixed_precision_args, _add_distributed_args, _add_validation_args,
                      _add_data_args, add_tokenizer_args, _add_logging_args, _add_moe_args,
                      add_megatron_flags, _add_planner_args):
        add_group(parser)
    if extra_args_provider is not None:
        # Megatron's providers return the parser; accept one that only adds to it, too.
        parser = extra_args_provider(parser) or parser
    return parser


def parse_args(extra_args_provider: ExtraArgsProvider | None = None, ignore_unknown_args: bool = False,
               argv: list[str] | None = None) -> Namespace:
    """Parse argv (sys.argv[1:] when None); rank and world_size come from RANK / WORLD_SIZE."""
    parser = build_parser(extra_args_provider)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    args.rank, args.world_size = env_rank_and_world_size()
    return args


def parse_and_validate_args(extra_args_provider: ExtraArgsProvider | None = None,
                            args_defaults: dict[str, Any] | None = None,
                            argv: list[str] | None = None, ignore_unknown_args: bool = False) -> Namespace:
    """parse_args then validate_args(args, args_defaults)."""
    args = parse_args(extra_args_provider, ignore_unknown_args, argv)
    return validate_args(args, args_defaults)


# ----------------------------------------------------------------------------- config builders


def core_transformer_config_from_args(args: Namespace, config_class: type | None = None) -> Any:
    """The TransformerConfig (or config_class) of validated args; the only flag -> model translation."""
    if config_class is None:
        from megatron.model import TransformerConfig as config_class
    return config_class(**_architecture_kwargs(args),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        apply_residual_connection_post_layernorm=args.apply_residual_connection_post_layernorm,
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=args.add_bias_linear,
        openai_gelu=args.openai_gelu,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=args.params_dtype,
        fp32_residual_connection=args.fp32_residual_connection,
        perform_initialization=args.perform_initialization,
        use_cpu_initialization=bool(args.use_cpu_initialization),
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        include_padded_vocab_in_loss=args.include_padded_vocab_in_loss,
        masked_softmax_fusion=args.masked_softmax_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        fused_kernels_cpu_impl=args.fused_kernels_cpu_impl,
        deterministic_mode=args.deterministic_mode,
        calculate_per_token_loss=args.calculate_per_token_loss,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        distribute_saved_activations=args.distribute_saved_activations,
        use_flash_attn=args.use_flash_attn,
        **_moe_kwargs(args),
    )


def _moe_kwargs(args: Namespace) -> dict[str, Any]:
    """The MoE fields of TransformerConfig (Megatron's names: --num-experts is num_moe_experts)."""
    return dict(
        num_moe_experts=args.num_experts,
        moe_layer_freq=args.moe_layer_freq,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_dtype=args.moe_router_dtype,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_per_layer_logging=args.moe_per_layer_logging,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )


def _architecture_kwargs(args: Namespace) -> dict[str, Any]:
    """The Llama-family fields of TransformerConfig, as Megatron's core_transformer_config_from_args
    sets them: --swiglu is F.silu with a gated linear unit; without --group-query-attention
    num_query_groups is None (one group per head) whatever --num-query-groups says."""
    import torch.nn.functional as F

    from megatron.model.utils import squared_relu

    activation = F.silu if args.swiglu else squared_relu if args.squared_relu else F.gelu
    return dict(
        normalization=args.normalization,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        add_qkv_bias=args.add_qkv_bias,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        qk_layernorm=args.qk_layernorm,
        gated_linear_unit=args.swiglu,
        activation_func=activation,
        rotary_interleaved=args.rotary_interleaved,
        # The bias + GeLU fusion only applies to a GeLU MLP (Megatron refuses it with squared ReLU).
        bias_gelu_fusion=args.bias_gelu_fusion and activation is F.gelu,
        bias_swiglu_fusion=args.bias_swiglu_fusion,
        apply_rope_fusion=args.apply_rope_fusion,
    )


def gpt_model_kwargs(args: Namespace) -> dict[str, Any]:
    """GPTModel's position-embedding keywords (Megatron-Core's names) and --spec's layer spec from validated args."""
    from megatron.training.arguments_model import layer_spec_from_flag

    return dict(
        transformer_layer_spec=layer_spec_from_flag(args.spec),
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
    )


def optimizer_config_from_args(args: Namespace) -> Any:
    """The OptimizerConfig of validated args."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=args.params_dtype,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        clip_grad=args.clip_grad,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
    )


def gpt_dataset_config_from_args(args: Namespace, tokenizer: Any) -> Any:
    """The GPTDatasetConfig of validated args: --data-path blend + --split, or one blend per split."""
    from megatron.data.dataset_config import GPTDatasetConfig
    from megatron.data.utils import parse_data_path

    per_split = [parse_data_path(getattr(args, f"{name}_data_path")) for name in ("train", "valid", "test")]
    if args.seq_length is None:
        raise ArgsError("--seq-length is required to build the GPT datasets")
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=parse_data_path(args.data_path),
        blend_per_split=per_split if any(b is not None for b in per_split) else None,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        mock=args.mock_data,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
