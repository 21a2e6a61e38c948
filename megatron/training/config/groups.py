"""The typed settings of a training run, one dataclass per `--help` group: the one place each
command-line flag is declared (megatron/training/config/fields.py says how a field becomes a flag).

| class | --help group |
|---|---|
| ModelConfig | network size |
| RegularizationConfig | regularization |
| TrainingConfig | training |
| InitializationConfig | initialization |
| LearningRateConfig | learning rate |
| CheckpointConfig | checkpointing |
| MixedPrecisionConfig | mixed precision |
| DistributedConfig | distributed |
| ValidationConfig | validation |
| DataConfig | data and dataloader |
| TokenizerConfig | tokenizer |
| LoggingConfig | logging |
| MoEConfig | moe |
| LoRAConfig | lora |
| HybridConfig | hybrid models |
| InferenceConfig | inference |

To add a setting: add a field to the group it belongs to, with its default and, under it, the help
string; its flag, dest and type follow from the name and annotation (setting(...) for anything
else). The Namespace a command line parses to carries it under the field's name. A rule between a
group's values goes in the group's rules() (one line per problem, naming the flags): validate_args
refuses a command line with it, MegatronConfig.check a config built in Python.
"""

from __future__ import annotations

import argparse
import ast
import os
from dataclasses import dataclass
from typing import Any

from megatron.training.config.fields import ConfigGroup, setting

# Megatron-core's AttnBackend names (megatron/core/transformer/enums.py).
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
# Megatron's choices plus alibi (Accelerate's Megatron-LM integration); arguments_model refuses
# relative and mrope.
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "alibi", "mrope", "relative", "none")
TOKENIZER_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)


def moe_freq_type(text: str) -> int | list[int]:
    """--moe-layer-freq: an integer N (an MoE layer every N layers) or a list of 0/1 per layer, written
    as a list expression of integer lists, + and * ("([1]*3+[0])*2"). Parsed, never evaluated as code."""
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


@dataclass
class ModelConfig(ConfigGroup, title="network size"):
    """The model's architecture: sizes, attention, positions, normalization, activations (Megatron's
    "network size" flags)."""

    num_layers: int | None = None
    """Number of transformer layers."""
    encoder_num_layers: int | None = None
    """Megatron's other name of --num-layers (give one of the two)."""
    hidden_size: int | None = None
    """Transformer hidden size."""
    ffn_hidden_size: int | None = None
    """Transformer feed-forward hidden size; 4 x hidden-size if not given (with --swiglu: int(4 x
    hidden-size x 2/3 / 64) x 64, as Megatron).
    """
    num_attention_heads: int | None = None
    """Number of attention heads."""
    kv_channels: int | None = None
    """Per-head projection size; hidden-size // num-attention-heads if not given."""
    group_query_attention: bool = False
    """Grouped-query attention: --num-query-groups key/value heads."""
    num_query_groups: int = 1
    """Key/value heads with --group-query-attention (1: multi-query); ignored without it (one per
    attention head), as in Megatron.
    """
    attention_head_type: str | None = setting(None, choices=("multihead", "multiquery"))
    """The older spelling Accelerate's guide uses: multiquery = --group-query-attention
    --num-query-groups 1; multihead = one key/value head per attention head.
    """
    max_position_embeddings: int | None = None
    """Maximum number of position embeddings (size of the learned position table)."""
    position_embedding_type: str = setting("learned_absolute", choices=POSITION_EMBEDDING_TYPES)
    """learned_absolute (a table), rope (rotary), alibi (linear attention biases, as Accelerate's
    Megatron integration), none; relative and mrope are refused.
    """
    use_rotary_position_embeddings: bool = False
    """Legacy alias of --position-embedding-type rope."""
    rotary_base: int = 10000
    """Base of the rotary frequencies."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotate (the rest pass through)."""
    rotary_interleaved: bool = False
    """Rotate adjacent channel pairs (GPT-J style) instead of the two halves."""
    rotary_seq_len_interpolation_factor: int | None = None
    """Divide the rotary positions by this factor (position interpolation)."""
    use_rope_scaling: bool = False
    """Llama-3.1 scaling of the rotary frequencies."""
    rope_scaling_factor: float = 8.0
    """The scaling factor of --use-rope-scaling (Llama-3.1's 8)."""
    add_position_embedding: bool = setting(True, flags=("--no-position-embedding",))
    """Deprecated in Megatron: an error unless with rope; use --position-embedding-type."""
    attention_backend: str = setting("auto", choices=ATTENTION_BACKENDS)
    """Megatron's choice of core attention, mapped onto this framework's: local and unfused = the
    unfused core attention (on CPU with the fused core of --fused-kernels-cpu-impl native), flash
    and fused = the fused-kernel core (--use-flash-attn: flash-attn on CUDA when installed, else
    torch's scaled_dot_product_attention), auto = --use-flash-attn decides.
    """
    normalization: str = setting("LayerNorm", type=None, choices=("LayerNorm", "RMSNorm"))
    """The normalization layers."""
    norm_epsilon: float = setting(1e-05, flags=("--norm-epsilon", "--layernorm-epsilon"))
    """Epsilon of the normalization layers."""
    apply_layernorm_1p: bool = False
    """Norm weights stored zero-centred (the layer multiplies by 1 + weight)."""
    apply_residual_connection_post_layernorm: bool = False
    """Take the residual from after the layernorm (original BERT/GPT-1 style)."""
    bert_post_layernorm: bool = False
    """BERT only (not a Megatron flag): the original BERT's layout, HF BertForPreTraining's: a
    LayerNorm on the embeddings, LayerNorm after each residual add, no final LayerNorm (default:
    Megatron's pre-LN BERT). Kept in the checkpoint's args.
    """
    openai_gelu: bool = False
    """Tanh-approximated GeLU (HF gelu_new), for GPT-2 checkpoints."""
    squared_relu: bool = False
    """MLP activation relu(x)^2 instead of GeLU."""
    swiglu: bool = False
    """Gated MLP: silu(x W_gate) * (x W_up), instead of GeLU."""
    untie_embeddings_and_output_weights: bool = False
    """Separate input embedding and output layer weights."""
    add_bias_linear: bool = setting(True, flags=("--disable-bias-linear",))
    """Disable the bias of the linear layers."""
    add_qkv_bias: bool = False
    """A bias on the QKV projection even with --disable-bias-linear (Qwen2)."""
    qk_layernorm: bool = False
    """Normalize each head's queries and keys (with --normalization's norm)."""
    spec: list[str] | None = setting(None, nargs="*", metavar=("MODULE", "NAME"))
    """The layer spec to build: NAME in the importable module MODULE, a ModuleSpec or a function
    returning one (Megatron's --spec; docs/model.md). Default: the GPT spec the architecture
    flags describe.
    """
    transformer_impl: str = setting("local", type=None, choices=("local", "transformer_engine"))
    """Layer implementation (only local is supported yet)."""


@dataclass
class RegularizationConfig(ConfigGroup, title="regularization"):
    """Dropout, weight decay, gradient clipping and Adam's constants."""

    attention_dropout: float = 0.1
    """Post attention dropout probability."""
    hidden_dropout: float = 0.1
    """Dropout probability for hidden state."""
    weight_decay: float = 0.01
    """Weight decay coefficient (L2)."""
    start_weight_decay: float | None = None
    """Initial weight decay of a linear/cosine increment."""
    end_weight_decay: float | None = None
    """End of run weight decay of a linear/cosine increment."""
    weight_decay_incr_style: str = setting("constant", choices=("constant", "linear", "cosine"))
    """Weight decay increment function."""
    clip_grad: float = 1.0
    """Gradient clipping on the global L2 norm."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    sgd_momentum: float = 0.9


@dataclass
class TrainingConfig(ConfigGroup, title="training"):
    """Batch sizes, iterations, recompute, fusions and the optimizer's choice."""

    micro_batch_size: int | None = None
    """Batch size per model instance."""
    batch_size: int | None = None
    """Old batch size parameter, do not use. Use --micro-batch-size instead"""
    global_batch_size: int | None = None
    """Training batch size; micro-batch-size x data-parallel size if not given."""
    rampup_batch_size: list[str] | None = setting(None, nargs="*")
    """<start> <increment> <ramp-samples>: grow the global batch size."""
    recompute_activations: bool = False
    """Selective activation recompute (--recompute-granularity selective)."""
    recompute_granularity: str | None = setting(None, choices=("full", "selective"))
    """Recompute activations in backward: full = whole transformer layers (with --recompute-method),
    selective = the core attention only.
    """
    distribute_saved_activations: bool = False
    """With full recompute and tensor parallelism, keep 1/TP of each saved layer input per rank
    (all-gathered before recomputing).
    """
    recompute_method: str | None = setting(None, choices=("uniform", "block"))
    """Full recompute: uniform = every group of --recompute-num-layers layers keeps only its input;
    block = only the first --recompute-num-layers layers of each pipeline stage are recomputed,
    one by one.
    """
    recompute_num_layers: int | None = None
    """uniform: layers per recomputed group; block: layers recomputed per pipeline stage."""
    recompute_modules: list[str] | None = setting(None, type=str, nargs="*")
    """Submodules of selective recompute: only core_attn (the default) is supported yet."""
    use_flash_attn: bool = False
    """Fused attention: flash-attn on CUDA when installed, else torch's
    scaled_dot_product_attention.
    """
    checkpoint_activations: bool = False
    """No longer valid: use --recompute-activations."""
    train_iters: int | None = None
    """Total iterations to train."""
    train_samples: int | None = None
    """Total samples to train."""
    log_interval: int = 100
    """Report interval in iterations."""
    exit_interval: int | None = None
    """Exit when the iteration is divisible by this value."""
    exit_duration_in_mins: float | None = None
    """Exit after this many minutes (Megatron takes whole minutes; fractions are accepted)."""
    exit_signal_handler: bool = False
    """Save a checkpoint and exit on SIGTERM."""
    tensorboard_dir: str | None = None
    """Write tensorboard logs here."""
    # Fused ops (docs/fused_kernels.md, "Using them in the model"): on unless switched off, as in Megatron.
    masked_softmax_fusion: bool = setting(True, flags=("--no-masked-softmax-fusion",))
    """Attention softmax in plain PyTorch ops, not fused_kernels.scale_mask_softmax."""
    bias_gelu_fusion: bool = setting(True, flags=("--no-bias-gelu-fusion",))
    """Bias add and GeLU unfused; the GeLU is then the erf one (or tanh with --openai-gelu). Fused,
    it is always the tanh approximation, as in Megatron.
    """
    bias_swiglu_fusion: bool = setting(True, flags=("--no-bias-swiglu-fusion",))
    """With --swiglu: bias add and SwiGLU in plain PyTorch ops, not fused_kernels.bias_swiglu."""
    apply_rope_fusion: bool = setting(True, flags=("--no-rope-fusion",))
    """With rope: rotate in plain PyTorch ops, not fused_kernels.rotary_pos_emb."""
    bias_dropout_fusion: bool = setting(True, flags=("--no-bias-dropout-fusion",))
    """Bias + dropout + residual add of each branch in plain PyTorch ops."""
    persist_layer_norm: bool = setting(True, flags=("--no-persist-layer-norm",))
    """No effect: Megatron picks between two apex LayerNorm kernels; here fused_kernels.layer_norm
    always runs.
    """
    gradient_accumulation_fusion: bool = setting(True, flags=("--no-gradient-accumulation-fusion",))
    """Linear layers return their weight gradients through .grad for the DDP hook to add into
    main_grad, instead of adding them into main_grad in backward.
    """
    fused_kernels_cpu_impl: str = setting("native", choices=("native", "reference", "compiled"))
    """Fused ops on CPU tensors: ATen's own kernels and the one-node attention core (native, the
    fast path), the formulas op by op (reference, the plain path), or torch.compile'd formulas
    (compiled: 5-25 s of compile start-up per process). On CUDA: Triton.
    """
    torch_compile: bool = False
    """torch.compile each transformer layer's forward. Off by default: on the CPU benchmark GPT it
    was slower than the eager fast path (docs/PERFORMANCE.md), and it compiles for tens of
    seconds per process.
    """
    optimizer: str = setting("adam", choices=("adam", "sgd"))
    dataloader_type: str | None = setting(None, choices=("single", "cyclic", "external"))
    """Single pass vs multiple pass data loader ('single' if not given)."""
    use_distributed_optimizer: bool = False
    calculate_per_token_loss: bool = False
    """Divide the loss by the number of tokens of the whole global batch."""
    include_padded_vocab_in_loss: bool = False
    """Megatron's loss: the softmax over the whole padded vocabulary, the padding rows of the
    embedding drawn like the others. Default: over the tokenizer's ids only, the same loss at
    every tensor-parallel size (docs/training.md).
    """
    empty_unused_memory_level: int = setting(0, choices=(0, 1, 2))
    """Empty the accelerator's cache: 1 after each iteration, 2 also after eval."""
    deterministic_mode: bool = False
    """Use deterministic algorithms."""
    # On by default, as in Megatron-LM; the positive spelling is kept for explicit scripts.
    check_for_nan_in_loss_and_grad: bool = setting(True, action="store_true", also=(
        {"flags": ("--no-check-for-nan-in-loss-and-grad",), "action": "store_false",
         "help": "Train on through NaN/Inf losses."},))
    """Stop with an error naming the iteration when the loss or the gradient norm is NaN/Inf (the
    default).
    """
    yaml_cfg: str | None = None
    """Megatron-LM's YAML config file (its experimental layout: settings at the top level, the model's
    under language_model:, the layout's under model_parallel:, ${NAME} from the environment); flags
    given on the command line override its values.
    """

    def rules(self) -> list[str]:
        """The batch sizes: micro and global batch positive; the ramp-up's three values (rampup_batch_sizes)
        within the global batch size, which it reaches in whole increments. (Divisibility by the
        data-parallel size is the run's: validate_args, which knows the world size.)"""
        sizes = self.not_positive(("micro_batch_size", "global_batch_size"))
        if sizes or self.rampup_batch_size is None:
            return sizes
        try:
            start, incr, _ = rampup_batch_sizes(self.rampup_batch_size)
        except ValueError as error:
            return [str(error)]
        gbs = self.global_batch_size
        if gbs is not None and start > gbs:
            return [f"--rampup-batch-size start ({start}) must be <= --global-batch-size ({gbs})"]
        if gbs is not None and (gbs - start) % incr:
            return [f"--global-batch-size ({gbs}) minus the --rampup-batch-size start ({start}) must be divisible "
                    f"by its increment ({incr})"]
        return []


def rampup_batch_sizes(values: Any) -> list[int]:
    """--rampup-batch-size's <start> <increment> <ramp-samples> as ints (the flag keeps strings), or a
    ValueError naming the flag."""
    if not isinstance(values, (list, tuple)) or len(values) != 3:
        raise ValueError(f"--rampup-batch-size needs three values <start> <increment> <ramp-samples>, "
                         f"got {values!r}; e.g. --rampup-batch-size 16 8 300000")
    try:
        start, incr, samples = (int(v) for v in values)
    except ValueError:
        raise ValueError(f"--rampup-batch-size values must be integers, got {list(values)}") from None
    if start <= 0 or incr <= 0 or samples < 0:
        raise ValueError(f"--rampup-batch-size start ({start}) and increment ({incr}) must be > 0 and "
                         f"ramp-samples ({samples}) >= 0")
    return [start, incr, samples]


@dataclass
class InitializationConfig(ConfigGroup, title="initialization"):
    """Seeds and weight initialisation."""

    seed: int = 1234
    """Random seed of python, numpy, torch and the device."""
    data_parallel_random_init: bool = False
    """Different initial weights on each data-parallel rank."""
    init_method_std: float = 0.02
    """Standard deviation of the zero-mean normal weight initialization."""


@dataclass
class LearningRateConfig(ConfigGroup, title="learning rate"):
    """The learning-rate schedule."""

    lr: float | None = None
    """Peak learning rate."""
    lr_decay_style: str = setting("linear", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    lr_wsd_decay_style: str = setting("exponential", choices=("exponential", "linear", "cosine", "minus_sqrt"))
    lr_decay_iters: int | None = None
    """Iterations to decay the LR over; --train-iters if not given."""
    lr_decay_samples: int | None = None
    """Samples to decay the LR over; --train-samples if not given."""
    lr_wsd_decay_samples: int | None = None
    lr_wsd_decay_iters: int | None = None
    lr_warmup_fraction: float | None = None
    """Fraction of the LR decay steps used for warmup."""
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0
    """Initial LR of the linear warmup."""
    warmup: int | None = None
    """Old lr warmup argument, do not use. Use one of the --lr-warmup-* arguments."""
    min_lr: float = 0.0
    """Minimum value of the learning rate."""
    override_opt_param_scheduler: bool = setting(False, flags=("--override-opt_param-scheduler",))
    """Use the scheduler values of the command line, not the checkpoint's."""
    use_checkpoint_opt_param_scheduler: bool = setting(False, flags=("--use-checkpoint-opt_param-scheduler",))
    """Use the scheduler values of the checkpoint."""


@dataclass
class CheckpointConfig(ConfigGroup, title="checkpointing"):
    """Saving and loading checkpoints."""

    save: str | None = None
    """Output directory for checkpoints."""
    save_interval: int | None = setting(None, flags=("--save-interval", "--persistent-save-interval"))
    """Iterations between checkpoint saves."""
    no_save_optim: bool | None = None
    """Do not save the optimizer."""
    no_save_rng: bool | None = None
    """Do not save the RNG state."""
    load: str | None = None
    """Directory holding a checkpoint."""
    load_hf: str | None = None
    """A transformers model directory to start from: the model flags come from its config.json, the
    weights are sharded for this TP/PP on load (megatron/training/load_hf.py); a checkpoint under
    --load wins once there is one.
    """
    no_load_optim: bool | None = None
    """Do not load the optimizer."""
    no_load_rng: bool | None = None
    """Do not load the RNG state."""
    finetune: bool = False
    """Load the model only and start from iteration 0."""
    pretrained_checkpoint: str | None = None
    """Directory containing a pretrained model checkpoint for finetuning: loaded (model only, as
    with --finetune) when --load holds no checkpoint yet; tasks/main.py's fine-tuning tasks start
    from it.
    """
    use_checkpoint_args: bool = False
    """Take the model-shape arguments from the checkpoint."""
    exit_on_missing_checkpoint: bool = False
    """Exit if --load is given but no checkpoint is found there."""
    trust_checkpoint_pickles: bool = False
    """Read checkpoint files with full unpickling (they can run code) instead of the allow-list;
    only for files from a trusted source that the allow-list refuses.
    """
    perform_initialization: bool = setting(True, flags=("--no-initialization",))
    """Do not initialize the weights (they come from a checkpoint)."""
    ckpt_format: str = setting("torch_dist", type=None,
                               choices=("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"))
    """Checkpoint format: torch_dist (sharded, written by every rank with PyTorch DCP, loads at any
    TP/PP/DP) or torch (one file per TP/PP rank); the others are not supported yet.
    """
    auto_detect_ckpt_format: bool = False
    """On load, read the checkpoint in the format its files show (torch or torch_dist), whatever
    --ckpt-format says.
    """
    async_save: bool | None = None
    """--ckpt-format torch_dist: write checkpoints in a background thread while training continues;
    a checkpoint becomes the latest once every rank finished writing it.
    """


@dataclass
class MixedPrecisionConfig(ConfigGroup, title="mixed precision"):
    """fp16 / bf16 and loss scaling."""

    fp16: bool = False
    """Run the model in fp16."""
    bf16: bool = False
    """Run the model in bfloat16."""
    loss_scale: float | None = None
    """Static loss scale (a power of 2); dynamic loss scaling if not given."""
    initial_loss_scale: float = 4294967296
    """Initial dynamic loss scale."""
    min_loss_scale: float = 1.0
    """Minimum dynamic loss scale."""
    loss_scale_window: float = 1000
    """Clean steps before the dynamic loss scale grows."""
    hysteresis: int = 2
    """Overflows before the loss scale backs off."""
    fp32_residual_connection: bool = False
    """Keep the residual in fp32."""
    apply_query_key_layer_scaling: bool = False
    """Scale Q x K^T by 1 / layer-number (forces softmax in fp32)."""
    attention_softmax_in_fp32: bool = False
    """Run attention masking and softmax in fp32."""
    accumulate_allreduce_grads_in_fp32: bool = False
    """Gradient accumulation and all-reduce in fp32."""
    fp16_lm_cross_entropy: bool = False
    """Compute the unreduced cross entropy in fp16."""
    fp8: str | None = setting(None, flags=("--fp8-format",), type=None, choices=("e4m3", "hybrid"))

    def rules(self) -> list[str]:
        """One of fp16 and bf16; the options that only mean something under one of them; the loss scales
        positive, the minimum at most the initial one."""
        if self.fp16 and self.bf16:
            return ["--fp16 and --bf16 cannot both be given; choose one"]
        if self.fp16_lm_cross_entropy and not self.fp16:
            return ["--fp16-lm-cross-entropy needs --fp16 (lm cross entropy in fp16 is only for fp16 runs)"]
        if self.fp32_residual_connection and not (self.fp16 or self.bf16):
            return ["--fp32-residual-connection needs --fp16 or --bf16 (the residual is already fp32)"]
        scales = self.not_positive(("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
                                    "hysteresis"))
        if scales:
            return scales
        if self.min_loss_scale > self.initial_loss_scale:
            return [f"--min-loss-scale ({self.min_loss_scale}) must be <= --initial-loss-scale "
                    f"({self.initial_loss_scale})"]
        return []


@dataclass
class DistributedConfig(ConfigGroup, title="distributed"):
    """The parallel layout (TP, PP, VPP, EP, SP) and the data-parallel communication."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    pipeline_model_parallel_split_rank: int | None = None
    """Encoder-decoder models (T5): the first decoder stage; the stages before it hold the encoder.
    """
    model_parallel_size: int | None = None
    """Old model parallel argument, do not use. Use --tensor-model-parallel-size."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual pipeline stage (model chunk): the interleaved 1F1B schedule."""
    num_virtual_stages_per_pipeline_rank: int | None = None
    """Model chunks per pipeline rank (the interleaved schedule); alternative to
    --num-layers-per-virtual-pipeline-stage.
    """
    microbatch_group_size_per_vp_stage: int | None = setting(
        None, flags=("--microbatch-group-size-per-virtual-pipeline-stage",))
    """Interleaved schedule: micro-batches per group; only the default
    (--pipeline-model-parallel-size) is supported yet.
    """
    context_parallel_size: int = 1
    """Degree of context parallelism: the sequence split over this many ranks (load-balanced
    chunks; docs/parallelism.md).
    """
    cp_comm_type: list[str] = setting(default_factory=lambda: ["p2p"], type=str, nargs="+")
    """Inter-GPU communication type for context parallelism: p2p (ring), a2a (Ulysses), allgather
    or a2a+p2p (with --hierarchical-context-parallel-sizes); one value for every layer or one per layer.
    """
    hierarchical_context_parallel_sizes: list[int] | None = setting(None, type=int, nargs="+")
    """Context parallelism as [a2a size, p2p size] (product = --context-parallel-size): the a2a+p2p
    communication type.
    """
    sequence_parallel: bool = False
    distributed_backend: str | None = setting(None, type=None, choices=("nccl", "gloo"))
    """nccl on CUDA, gloo on CPU if not given."""
    distributed_timeout_minutes: int = 10
    """Timeout of the distributed collectives, in minutes."""
    watchdog_seconds: float | None = None  # ours
    """A rank waiting longer than this in a collective or pipeline send/receive prints what it waits
    on (operation, group, peer, micro-batch) and exits non-zero (default:
    --distributed-timeout-minutes).
    """
    overlap_grad_reduce: bool = False
    """Launch each gradient bucket's data-parallel reduction as soon as its last gradient of the
    step is ready, overlapping it with the rest of backward.
    """
    overlap_param_gather: bool = False
    ddp_bucket_size: int | None = None
    """Elements per gradient bucket (default with --overlap-grad-reduce: max(40M, 1M x data-parallel
    size); one bucket otherwise).
    """
    ddp_average_in_collective: bool = False
    """Average gradients in the collective (ReduceOp.AVG) instead of pre-scaling by 1/DP."""
    check_weight_hash_across_dp_replicas_interval: int | None = None
    """Every this many iterations, check that the weights are identical on all data-parallel
    replicas (a hash all-gathered over the DP group).
    """
    local_rank: int = setting(default_factory=lambda: int(os.getenv("LOCAL_RANK", "0")))
    """Local rank, from the LOCAL_RANK environment variable that torchrun sets."""
    use_cpu_initialization: bool | None = None
    """Initialize the weights on the CPU."""
    # CPU runs (megatron/core/cpu_runtime.py): threads per process and the allocator.
    cpu_threads: int | None = None
    """Intra-op threads per process on CPU (default: OMP_NUM_THREADS if set, else the cores this
    process may use divided by the processes on this node).
    """
    cpu_malloc_tuning: bool = setting(True, flags=("--no-cpu-malloc-tuning",))
    """Leave glibc malloc's defaults: freed activations go back to the kernel and are faulted in
    again every step (tuned by default on CPU: memory kept for reuse).
    """


@dataclass
class ValidationConfig(ConfigGroup, title="validation"):
    """Evaluation during training."""

    eval_iters: int = 100
    """Iterations of each evaluation."""
    eval_interval: int = 1000
    """Iterations between evaluations."""
    skip_train: bool = False
    """Only evaluate, do not train."""


# The data flags that give one split's data each (the other source: --data-path and --split).
PER_SPLIT_DATA_PATHS = ("train_data_path", "valid_data_path", "test_data_path")


@dataclass
class DataConfig(ConfigGroup, title="data and dataloader"):
    """Datasets, splits and the data loader."""

    data_path: list[str] | None = setting(None, nargs="*")
    """One prefix, 'w1 p1 w2 p2 ...' (a weighted blend) or 'p1 p2 ...'."""
    split: str | None = None
    """train,valid,test proportions of --data-path, e.g. '949,50,1'."""
    train_data_path: list[str] | None = setting(None, nargs="*")
    valid_data_path: list[str] | None = setting(None, nargs="*")
    test_data_path: list[str] | None = setting(None, nargs="*")
    data_cache_path: str | None = setting(None, type=None)
    """Where to cache the dataset index arrays."""
    mmap_bin_files: bool = setting(True, flags=("--no-mmap-bin-files",))
    """Read the .bin files without memory mapping."""
    mock_data: bool = False
    """Synthetic data instead of --data-path."""
    seq_length: int | None = None
    """Maximum sequence length to process."""
    encoder_seq_length: int | None = None
    """Megatron's other name of --seq-length (give one of the two)."""
    num_workers: int = 2
    """Dataloader worker processes."""
    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""
    reset_attention_mask: bool = False
    """Do not attend across end-of-document tokens."""
    eod_mask_loss: bool = False
    """No loss on end-of-document tokens."""
    create_attention_mask_in_dataloader: bool = setting(True, flags=("--no-create-attention-mask-in-dataloader",))
    """Do not build the [1, s, s] attention mask in the data loader."""
    sft: bool = False
    """Supervised fine-tuning on chat conversations: --data-path names JSON-lines files of
    {"messages": [...]} (docs/sft.md), tokenized on the fly, packed, the loss on assistant tokens only.
    """
    sft_tokenizer_prompt_format: str = "nemotron-h-aligned"
    """SFT prompt format: llama2-chat, chatml, nemotron-h-aligned, or default (the chat_template of
    the HuggingFace tokenizer's tokenizer_config.json).
    """

    def rules(self) -> list[str]:
        """One data source (--data-path, --train/valid/test-data-path or --mock-data), each blend and the
        split well formed, --sft's prompt format and the options it replaces, the worker count. (That
        the files exist is the run's: validate_args.)"""
        from megatron.data.utils import parse_and_normalize_split, parse_data_path

        per_split = [name for name in PER_SPLIT_DATA_PATHS if getattr(self, name) is not None]
        sources = (["data_path"] if self.data_path is not None else []) + per_split
        for name in sources:
            if not getattr(self, name):
                return [f"{self.flag(name)} needs at least one dataset prefix"]
            try:
                parse_data_path(getattr(self, name))
            except ValueError as error:
                return [str(error).replace("--data-path", self.flag(name))]
        given = [self.flag(name) for name in sources]
        if self.data_path is not None and per_split:
            return [f"--data-path cannot be combined with {', '.join(given[1:])}; "
                    "give one blend split by --split, or one path per split"]
        if self.mock_data and given:
            return [f"--mock-data cannot be combined with {', '.join(given)}; drop one of them"]
        if per_split and self.split is not None:
            return ["--split cannot be used with --train-data-path/--valid-data-path/--test-data-path; "
                    "each split already has its own data"]
        if self.split is not None:
            try:
                parse_and_normalize_split(self.split)
            except ValueError as error:
                return [str(error)]
        return self._sft_rules() or self.not_positive(("num_workers",), allow_zero=True)

    def _sft_rules(self) -> list[str]:
        """--sft: JSON-lines data through a known prompt format; the masks and positions are its own."""
        if not self.sft:
            return []
        from megatron.data.sft_conversation import DEFAULT_FORMAT, PROMPT_FORMATS

        formats = (*PROMPT_FORMATS, DEFAULT_FORMAT)
        if self.sft_tokenizer_prompt_format not in formats:
            return [f"--sft-tokenizer-prompt-format {self.sft_tokenizer_prompt_format!r} is not one of "
                    f"{', '.join(formats)}"]
        if self.mock_data:
            return ["--sft cannot be combined with --mock-data: give --data-path with JSON-lines files"]
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name):
                return [f"{self.flag(name)} cannot be combined with --sft: SFT samples restart positions and "
                        "attention at each conversation and train on assistant tokens only"]
        return []


@dataclass
class TokenizerConfig(ConfigGroup, title="tokenizer"):
    """The tokenizer (shared with tools/preprocess_data.py)."""

    tokenizer_type: str | None = setting(None, choices=TOKENIZER_TYPES)
    """What type of tokenizer to use."""
    vocab_file: str | None = None
    """Path to the vocab file (GPT-2 vocab.json, BERT vocab.txt)."""
    merge_file: str | None = None
    """Path to the BPE merge file (GPT-2 merges.txt)."""
    vocab_size: int | None = None
    """Size of vocab before EOD or padding (NullTokenizer)."""
    vocab_extra_ids: int = 0
    """Number of additional vocabulary tokens (T5 sentinels <extra_id_i>)."""
    tokenizer_model: str | None = None
    """SentencePiece model file, or a HuggingFace tokenizer.json / folder."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocab size to be divisible by this value (times the tensor model parallel size), for
    computation efficiency.
    """


@dataclass
class LoggingConfig(ConfigGroup, title="logging"):
    """What the log line, TensorBoard and the timers report."""

    log_params_norm: bool = False
    """Log the norm of the parameters."""
    log_num_zeros_in_grad: bool = False
    """Log the number of zero gradients."""
    log_throughput: bool = False
    """Log TFLOP/s per device."""
    log_communication_stats: bool = False
    """Count the calls and bytes of every collective, per operation and process group, and print
    them with each log line (not a Megatron flag).
    """
    timing_log_level: int = setting(0, choices=range(0, 3))
    """Granularity of the timers: 0 iteration only, 1 coarse, 2 fine."""
    timing_log_option: str = setting("minmax", choices=("max", "minmax", "all"))
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    """Events and summaries queued before a flush to disk."""
    log_timers_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    wandb_project: str = ""
    """The wandb project name; off if empty."""
    wandb_exp_name: str = ""
    """The wandb experiment name."""
    wandb_save_dir: str = ""
    """Where wandb saves its files."""
    logging_level: int | None = None
    """Python logging level."""


@dataclass
class MoEConfig(ConfigGroup, title="moe"):
    """Mixture-of-experts layers: experts, router, token dispatcher."""

    num_experts: int | None = None
    """Experts per MoE layer (None: a dense model)."""
    expert_model_parallel_size: int = 1
    """Degree of expert parallelism."""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallelism inside each expert (default: --tensor-model-parallel-size)."""
    moe_layer_freq: Any = setting(1, type=moe_freq_type)
    """An MoE layer every N layers, or a 0/1 list per layer such as "([1]*3+[0]*1)*3"."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's ffn hidden size (default: --ffn-hidden-size)."""
    moe_shared_expert_intermediate_size: int | None = None
    """The shared experts' total ffn hidden size (None: no shared expert)."""
    moe_grouped_gemm: bool = False
    """Run a rank's experts as one grouped (or batched) matmul; same parameters and result."""
    moe_router_load_balancing_type: str = setting("aux_loss", choices=("aux_loss", "seq_aux_loss", "sinkhorn", "none"))
    moe_router_dtype: str | None = setting(None, choices=("fp32", "fp64"))
    """The router's logits and scores in this precision."""
    moe_router_score_function: str = setting("softmax", choices=("softmax", "sigmoid"))
    moe_router_topk: int = 2
    """Experts per token (default 2)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (default: over the top-k)."""
    moe_router_topk_scaling_factor: float | None = None
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss coefficient."""
    moe_z_loss_coeff: float | None = None
    """Router z-loss coefficient."""
    moe_per_layer_logging: bool = False
    """Log each MoE layer's balancing losses and tokens per expert."""
    moe_token_dispatcher_type: str = setting("allgather", choices=("allgather", "alltoall", "flex"))
    moe_expert_capacity_factor: float | None = None
    """Each expert takes at most ceil(tokens * topk / experts * factor) of a rank's tokens."""
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = setting("probs", choices=("probs", "position"))
    moe_drop_warning_threshold: float = 0.1
    """Ours: warn when more than this fraction of an MoE layer's routed tokens is dropped in a
    logging interval (an expert with no tokens is always warned about).
    """
    moe_router_num_groups: int | None = None
    """Group-limited routing: the experts split into this many equal groups (with
    --moe-router-group-topk; DeepSeek-V3's node-limited routing)."""
    moe_router_group_topk: int | None = None
    """Group-limited routing: the groups each token may choose its experts from, picked by the sum of
    the top (topk / group-topk) scores of each group."""
    moe_router_enable_expert_bias: bool = False
    """The aux-loss-free expert bias: a per-expert bias added to the scores only to choose the experts,
    updated after each step towards equal token counts (needs --moe-router-score-function sigmoid)."""
    moe_router_bias_update_rate: float = 1e-3
    """Each step the expert bias moves by this rate times sign(mean count - the expert's count)."""


@dataclass
class LoRAConfig(ConfigGroup, title="lora"):
    """Low-rank adapters (LoRA) on the transformer's linear layers, the base weights frozen (ours;
    Megatron-LM has none: the names are Megatron-Bridge's, the scaling and init PEFT's)."""

    lora_rank: int = 0
    """Rank r of the LoRA adapters (0: no LoRA, every weight trains)."""
    lora_alpha: float = 32.0
    """LoRA alpha: the adapter's output is scaled by alpha / r."""
    lora_dropout: float = 0.0
    """Dropout probability on the adapter's input."""
    lora_target_modules: list[str] = setting(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1",
                                                                         "linear_fc2"],
                                             nargs="+", choices=("linear_qkv", "linear_proj", "linear_fc1",
                                                                 "linear_fc2"))
    """The linear layers of each transformer layer that get an adapter."""


@dataclass
class HybridConfig(ConfigGroup, title="hybrid models"):
    """Mamba-2 and hybrid Mamba / attention / MLP models (pretrain_mamba.py; docs/model.md)."""

    is_hybrid_model: bool = False
    """The model is a hybrid (Mamba) model: pretrain_mamba.py's MambaModel, and what tools that load a
    checkpoint (conversion, generation) build.
    """
    hybrid_attention_ratio: float = 0.0
    """Ratio of attention layers to total layers, in [0, 1] (spread evenly among the Mamba layers)."""
    hybrid_mlp_ratio: float = 0.0
    """Ratio of MLP layers to total layers, in [0, 1]."""
    hybrid_override_pattern: str | None = None
    """The layer pattern, one symbol per layer: M Mamba, * attention, - MLP, E MoE (with --num-experts)
    (e.g. M-M*M-M-); with a ratio given its layer counts must match the ratio's.
    """
    mamba_state_dim: int = 128
    """State dimension of the Mamba layers."""
    mamba_head_dim: int = 64
    """Head dimension of the Mamba layers."""
    mamba_num_groups: int = 8
    """Number of B/C groups of the Mamba layers."""
    mamba_num_heads: int | None = None
    """Number of heads of the Mamba layers (default: 2 x --hidden-size / --mamba-head-dim)."""
    disable_mamba_mem_eff_path: bool = False
    """Megatron's switch off its fused conv + scan + norm CUDA kernel; the PyTorch scan is the same either way."""


@dataclass
class InferenceConfig(ConfigGroup, title="inference"):
    """The serving engine's settings (megatron/inference/engine.py; Megatron-LM's names and defaults)."""

    inference_max_requests: int = 8
    """Maximum number of requests for inference (running at once in the engine)."""
    inference_max_seq_length: int = 2560
    """Maximum sequence length expected for inference (prefill + decode); at most the model's positions."""
    inference_dynamic_batching_buffer_size_gb: float = 40.0
    """Memory of the KV cache block pool, GB (never more blocks than inference_max_requests requests
    of inference_max_seq_length tokens can use)."""
    inference_dynamic_batching_block_size: int = 256
    """KV cache block size, in tokens."""
    inference_dynamic_batching_max_requests: int | None = None
    """Override --inference-max-requests (the engine's running requests)."""
    inference_dynamic_batching_max_tokens: int | None = None
    """Tokens per engine step (default: max(512, max requests))."""
    enable_chunked_prefill: bool = False
    """Split a long prompt's prefill over steps within the step's token budget."""
    inference_dynamic_batching_enable_prefix_caching: bool = setting(
        False, flags=("--inference-dynamic-batching-prefix-caching",), action="store_true", also=(
            {"flags": ("--no-inference-dynamic-batching-prefix-caching",), "action": "store_false",
             "help": "Disable prefix caching."},))
    """Share the KV blocks of identical prompt prefixes between requests."""
    inference_dynamic_batching_prefix_caching_eviction_policy: str = setting("ref_zero", choices=("ref_zero", "lru"))
    """ref_zero: a cached block is freed when its last user ends; lru: kept until the space is needed."""
