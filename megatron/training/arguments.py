"""The command-line parser, grouped and named as in Megatron-LM, and the builders of the configs.

The flags are declared once, as typed settings (megatron/training/config/groups.py, one dataclass
per --help group); Megatron's flags without effect here or refused are tables in
arguments_megatron.py; the planner's device flags are megatron/planner's.

| function | what |
|---|---|
| parse_args(extra_args_provider, ignore_unknown_args, argv) | the Namespace; RANK / WORLD_SIZE from the environment |
| args_from_config(config, extra_args_provider) | the Namespace of a MegatronConfig (megatron/training/config) |
| argv_from_config(config, extra_args_provider) | the command line of a MegatronConfig (what megatron.training.api runs) |
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
from argparse import Namespace
from collections.abc import Callable
from typing import Any

from megatron.training.arguments_validation import (
    ArgsError,
    env_rank_and_world_size,
    print_args,
    validate_args,
)
from megatron.training.argument_utils import flag
from megatron.training.arguments_megatron import add_megatron_flags
from megatron.training.config import (
    GROUPS,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    InitializationConfig,
    LearningRateConfig,
    LoggingConfig,
    MegatronConfig,
    MixedPrecisionConfig,
    ModelConfig,
    MoEConfig,
    RegularizationConfig,
    TrainingConfig,
    ValidationConfig,
    add_group,
)

__all__ = [
    "ArgsError",
    "args_from_config",
    "argv_from_config",
    "core_transformer_config_from_args",
    "gpt_model_kwargs",
    "gpt_dataset_config_from_args",
    "optimizer_config_from_args",
    "parse_and_validate_args",
    "parse_args",
    "print_args",
    "validate_args",
]

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser | None]


def _group_adder(group: type, name: str) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    def add(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        add_group(parser, group)
        return parser

    add.__name__ = add.__qualname__ = name
    add.__doc__ = f"Megatron's helper: adds the {group.title!r} group ({group.__name__}'s flags); returns parser."
    return add


# Megatron-LM's per-group helpers, which Accelerate's integration imports (_add_data_args,
# _add_validation_args) and scripts' extra_args_provider functions call.
_add_network_size_args = _group_adder(ModelConfig, "_add_network_size_args")
_add_regularization_args = _group_adder(RegularizationConfig, "_add_regularization_args")
_add_training_args = _group_adder(TrainingConfig, "_add_training_args")
_add_initialization_args = _group_adder(InitializationConfig, "_add_initialization_args")
_add_learning_rate_args = _group_adder(LearningRateConfig, "_add_learning_rate_args")
_add_checkpointing_args = _group_adder(CheckpointConfig, "_add_checkpointing_args")
_add_mixed_precision_args = _group_adder(MixedPrecisionConfig, "_add_mixed_precision_args")
_add_distributed_args = _group_adder(DistributedConfig, "_add_distributed_args")
_add_validation_args = _group_adder(ValidationConfig, "_add_validation_args")
_add_data_args = _group_adder(DataConfig, "_add_data_args")
_add_logging_args = _group_adder(LoggingConfig, "_add_logging_args")
_add_moe_args = _group_adder(MoEConfig, "_add_moe_args")


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
    for group in GROUPS:  # the typed settings' groups (megatron/training/config), in --help order
        add_group(parser, group)
    add_megatron_flags(parser)
    _add_planner_args(parser)
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


def args_from_config(config: MegatronConfig, extra_args_provider: ExtraArgsProvider | None = None) -> Namespace:
    """The Namespace parse_args returns for a command line giving `config`'s values: the parser's
    defaults (the script's extra flags too), then the config's groups and `extra`."""
    args = config.apply_to(build_parser(extra_args_provider).parse_args([]))
    args.rank, args.world_size = env_rank_and_world_size()
    return args


def argv_from_config(config: MegatronConfig, extra_args_provider: ExtraArgsProvider | None = None) -> list[str]:
    """The command line that parses to `config`: a flag for every value that differs from the parser's
    default (`extra` included; keys that are no flag's dest, such as rank, are skipped), checked by
    parsing it back. A value no flag can give (None where the default is not) is a one-line ArgsError."""
    parser = build_parser(extra_args_provider)
    values = {**{k: v for group in config.groups() for k, v in vars(getattr(config, group)).items()},
              **config.extra}
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        if action.dest != "help":
            by_dest.setdefault(action.dest, []).append(action)
    argv: list[str] = []
    for dest, actions in by_dest.items():
        if dest not in values or values[dest] == actions[0].default:
            continue
        value = values[dest]
        argv += _flag_for(dest, value, actions)
    parsed = vars(parser.parse_args(argv))
    wrong = [dest for dest in by_dest if dest in values and parsed[dest] != values[dest]]
    if wrong:
        raise ArgsError(f"{flag(wrong[0])}: the value {values[wrong[0]]!r} does not survive the command line "
                        f"(it parses back as {parsed[wrong[0]]!r})")
    return argv


def _flag_for(dest: str, value: Any, actions: list[argparse.Action]) -> list[str]:
    for action in actions:
        kind = type(action).__name__
        if kind in ("_StoreTrueAction", "_StoreFalseAction"):
            if value is action.const:
                return [action.option_strings[0]]
            continue
        if value is None:
            continue
        if action.nargs in ("*", "+") or isinstance(action.nargs, int):
            return [action.option_strings[0], *(str(v) for v in value)]
        return [action.option_strings[0], str(value) if not isinstance(value, list) else repr(value)]
    raise ArgsError(f"{flag(dest)}: {value!r} cannot be given on the command line "
                    f"(its default is {actions[0].default!r})")


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
