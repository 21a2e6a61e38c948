"""The training run's setting groups: batches and length (TrainingConfig), regularization and the
optimizer's constants, initialization, the learning-rate schedule, mixed precision, evaluation. How a
field becomes a flag: megatron/training/config/fields.py; the table of every group: groups.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.training.config.fields import ConfigGroup, setting


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

    def rules(self) -> list[str]:
        """Dropout probabilities in [0, 1); weight decay >= 0 and its schedule's values for its style; the
        optimizer's constants in the ranges torch accepts (torch would only say so once the model is
        built): betas and momentum in [0, 1), eps > 0, clipping >= 0 (0: none)."""
        return (self.not_fraction(("hidden_dropout", "attention_dropout"))
                or self.not_positive(("weight_decay",), allow_zero=True) or self._weight_decay_rules()
                or self.not_fraction(("adam_beta1", "adam_beta2", "sgd_momentum"))
                or self.not_positive(("adam_eps",)) or self.not_positive(("clip_grad",), allow_zero=True))

    def _weight_decay_rules(self) -> list[str]:
        """The constant style is --weight-decay alone; linear and cosine need a start and an end >= 0."""
        ends = ("start_weight_decay", "end_weight_decay")
        if self.weight_decay_incr_style == "constant":
            for name in ends:
                # equal to --weight-decay: a Namespace validated before (validate_args sets both to it)
                if getattr(self, name) not in (None, self.weight_decay):
                    return [f"{self.flag(name)} needs --weight-decay-incr-style linear or cosine; "
                            "with the constant style use --weight-decay"]
            return []
        for name in ends:
            if getattr(self, name) is None:
                return [f"--weight-decay-incr-style {self.weight_decay_incr_style} needs {self.flag(name)}"]
        return self.not_positive(ends, allow_zero=True)


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
        """The batch sizes, then the training length, then the logging and exit intervals positive. (That a
        length is given, and divisibility by the data-parallel size, are the run's: validate_args, which
        knows the world size.)"""
        return (self._batch_rules() or self._length_rules()
                or self.not_positive(("log_interval", "exit_interval", "exit_duration_in_mins")))

    def _batch_rules(self) -> list[str]:
        """Micro and global batch positive; the ramp-up's three values (rampup_batch_sizes) within the
        global batch size, which it reaches in whole increments."""
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

    def _length_rules(self) -> list[str]:
        """By iterations or by samples, not both, and positive; a ramp-up counts samples."""
        if self.train_iters is not None and self.train_samples is not None:
            return ["--train-iters and --train-samples cannot both be given; train by iterations or by samples"]
        length = self.not_positive(("train_iters", "train_samples"))
        if length:
            return length
        if self.train_iters is not None and self.rampup_batch_size is not None:
            return ["--rampup-batch-size needs sample-based training (Megatron-LM refuses it with --train-iters "
                    "too): use --train-samples instead of --train-iters"]
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

    def rules(self) -> list[str]:
        """A positive standard deviation. (The seed's range depends on the pipeline size: validate_args.)"""
        return self.not_positive(("init_method_std",))


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

    def rules(self) -> list[str]:
        """Rates and warm-up lengths >= 0, decay lengths > 0; --min-lr at most --lr; one way to give the
        warm-up; WSD's decay phase given. (That --lr is given is the run's: validate_args.)"""
        problems = (self.not_positive(("lr", "min_lr", "lr_warmup_init", "lr_warmup_iters", "lr_warmup_samples"),
                                      allow_zero=True)
                    or self.not_positive(("lr_decay_iters", "lr_decay_samples", "lr_wsd_decay_iters",
                                          "lr_wsd_decay_samples")))
        if problems:
            return problems
        if self.lr is not None and self.min_lr > self.lr:
            return [f"--min-lr ({self.min_lr}) must be <= --lr ({self.lr})"]
        fraction = self.lr_warmup_fraction
        if fraction is not None:
            if not 0.0 <= fraction <= 1.0:
                return [f"--lr-warmup-fraction must be in [0, 1], got {fraction}"]
            for name in ("lr_warmup_iters", "lr_warmup_samples"):
                if getattr(self, name):
                    return [f"can only specify one of --lr-warmup-fraction and {self.flag(name)}"]
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_iters is None and self.lr_wsd_decay_samples is None:
            return ["--lr-decay-style WSD needs the length of its decay phase: "
                    "--lr-wsd-decay-iters or --lr-wsd-decay-samples"]
        return []


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
class ValidationConfig(ConfigGroup, title="validation"):
    """Evaluation during training."""

    eval_iters: int = 100
    """Iterations of each evaluation."""
    eval_interval: int = 1000
    """Iterations between evaluations."""
    skip_train: bool = False
    """Only evaluate, do not train."""

    def rules(self) -> list[str]:
        return self.not_positive(("eval_interval",)) or self.not_positive(("eval_iters",), allow_zero=True)
