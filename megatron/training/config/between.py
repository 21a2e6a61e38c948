"""The rules between the values of two or more setting groups, each written once, as a function of the
whole MegatronConfig that returns its problem (one line, naming first the flag of the group the rule
belongs to) or None.

MegatronConfig.rules() gives the first broken one for a config built in Python, once every group's own
rules() pass; validate_args refuses a command line with the same line (after the groups' own rules and
the derived global batch size: megatron/training/arguments_validation.py). A rule that needs the run
(the world size, the files) is not here: validate_args keeps it.
"""

from __future__ import annotations

from typing import Any, Callable

# The whole configuration, container.MegatronConfig (not imported: container.py imports this module)
MegatronConfig = Any


def positions_cover_the_sequence(config: MegatronConfig) -> str | None:
    """A learned position table as long as a sequence (ModelConfig, DataConfig)."""
    model, seq = config.model, config.data.seq_length
    positions = model.max_position_embeddings
    if (seq is not None and positions is not None and model.position_embedding_type == "learned_absolute"
            and positions < seq):
        return (f"--max-position-embeddings ({positions}) must be >= --seq-length ({seq}); "
                "raise --max-position-embeddings or shorten --seq-length")
    return None


def hybrid_layers(config: MegatronConfig) -> str | None:
    """A hybrid model's pattern fits --num-layers (HybridConfig.layer_pattern); its E layers are the MoE
    layers (MoEConfig) and its layers come from the pattern, not a --spec (ModelConfig)."""
    hybrid, moe, num_layers = config.hybrid, config.moe, config.model.num_layers
    if not hybrid.is_hybrid() or num_layers is None:  # (--num-layers is required: the run's)
        return None
    from megatron.model.mamba.hybrid import HybridPatternError

    try:
        pattern = hybrid.layer_pattern(num_layers)
    except HybridPatternError as error:
        return str(error)
    if "E" in pattern and moe.num_experts is None:
        return f"--hybrid-override-pattern {pattern}: E (MoE) layers need --num-experts"
    if moe.num_experts is not None and "E" not in pattern:
        return f"--num-experts: the hybrid pattern {pattern} has no E (MoE) layer to give experts"
    if moe.num_experts is not None and moe.moe_layer_freq != 1:
        return "--moe-layer-freq: a hybrid model's MoE layers are the pattern's E layers (--hybrid-override-pattern)"
    if config.model.spec is not None:
        return "--spec: a hybrid model builds its layers from --hybrid-override-pattern, not a layer spec"
    return None


def schedule_in_the_training_unit(config: MegatronConfig) -> str | None:
    """The learning-rate schedule's lengths (LearningRateConfig) in the unit of the training length
    (TrainingConfig): iterations or samples."""
    training, lr = config.training, config.learning_rate
    if (training.train_iters is None) == (training.train_samples is None):
        return None  # no length or both: TrainingConfig's rules and the run's say so
    if training.train_iters is not None:
        mixed = [name for name in ("lr_decay_samples", "lr_wsd_decay_samples") if getattr(lr, name) is not None]
        mixed += ["lr_warmup_samples"] if lr.lr_warmup_samples else []
        unit, other, kind = "iters", "samples", "iteration"
    else:
        mixed = [name for name in ("lr_decay_iters", "lr_wsd_decay_iters") if getattr(lr, name) is not None]
        mixed += ["lr_warmup_iters"] if lr.lr_warmup_iters else []
        unit, other, kind = "samples", "iters", "sample"
    if not mixed:
        return None
    bad = lr.flag(mixed[0])
    return f"{bad} cannot be used with --train-{unit} ({kind}-based training); use {bad.replace(other, unit)}"


def warmup_before_decay(config: MegatronConfig) -> str | None:
    """The warm-up (LearningRateConfig) ends before the decay does, which is --train-iters long
    (TrainingConfig) unless --lr-decay-iters says otherwise."""
    train_iters, lr = config.training.train_iters, config.learning_rate
    if train_iters is None or not lr.lr_warmup_iters:
        return None
    decay = lr.lr_decay_iters or train_iters
    if lr.lr_warmup_iters >= decay:
        return (f"--lr-warmup-iters ({lr.lr_warmup_iters}) must be < --lr-decay-iters ({decay}; "
                "it defaults to --train-iters)")
    return None


# numpy seeds are below 2**32; each pipeline stage adds 100 x its rank (megatron/training/initialize.py).
MAX_SEED = 2**32 - 1


def seed_on_every_stage(config: MegatronConfig) -> str | None:
    """A positive seed (InitializationConfig), as Megatron requires, that stays a valid numpy seed on the
    last pipeline stage (DistributedConfig)."""
    seed, stages = config.initialization.seed, config.distributed.pipeline_model_parallel_size
    highest = MAX_SEED - 100 * (stages - 1)
    if not 1 <= seed <= highest:
        return f"--seed must be an integer in [1, {highest}], got {seed}"
    return None


def data_parallel_options(config: MegatronConfig) -> str | None:
    """Per-token gradients (TrainingConfig) are summed over the replicas, so they cannot be averaged in
    the collective (DistributedConfig); --overlap-param-gather (DistributedConfig) overlaps the
    distributed optimizer's all-gather (TrainingConfig), and needs --overlap-grad-reduce, as in Megatron."""
    training, distributed = config.training, config.distributed
    if training.calculate_per_token_loss and distributed.ddp_average_in_collective:
        return ("--ddp-average-in-collective cannot be used with --calculate-per-token-loss: per-token gradients "
                "are summed over the data-parallel ranks and divided by the global token count")
    if distributed.overlap_param_gather:
        if not training.use_distributed_optimizer:
            return ("--overlap-param-gather needs --use-distributed-optimizer (it overlaps the distributed "
                    "optimizer's parameter all-gather with the next forward)")
        if not distributed.overlap_grad_reduce:
            return "--overlap-param-gather needs --overlap-grad-reduce"
    return None


def lora_without_experts(config: MegatronConfig) -> str | None:
    """LoRA adapters (LoRAConfig) on a dense model only (MoEConfig)."""
    if config.lora.lora_rank and config.moe.num_experts is not None:
        return "--lora-rank with --num-experts: LoRA on mixture-of-experts layers is not supported"
    return None


# In the order validate_args checked them before they were written here.
RULES: tuple[Callable[[MegatronConfig], str | None], ...] = (
    positions_cover_the_sequence,
    data_parallel_options,
    hybrid_layers,
    schedule_in_the_training_unit,
    warmup_before_decay,
    seed_on_every_stage,
    lora_without_experts,
)


def problems(config: MegatronConfig) -> list[str]:
    """The first broken rule between groups, as a one-item list ([] when none is)."""
    for rule in RULES:
        problem = rule(config)
        if problem:
            return [problem]
    return []
