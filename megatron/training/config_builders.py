"""The builders of the model's, optimizer's and datasets' configs from validated args: the only
flag -> config translations (megatron.training.arguments re-exports them, Megatron's names).

| function | what |
|---|---|
| core_transformer_config_from_args(args) | megatron.model.TransformerConfig |
| gpt_model_kwargs(args) | GPTModel's position-embedding keywords (rope, alibi, none, ...) |
| mamba_model_kwargs(args) | MambaModel's: those and the hybrid layer pattern (hybrid_pattern_from_args) |
| optimizer_config_from_args(args) | megatron.core.optimizer.OptimizerConfig |
| lora_config_from_args(args) | megatron.core.tensor_parallel.lora.LoRAConfig, or None without --lora-rank |
| gpt_dataset_config_from_args(args, tokenizer) | megatron.data.dataset_config.GPTDatasetConfig |
| config_flag(field) | the flag of a TransformerConfig field (num_moe_experts -> --num-experts) |
"""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from typing import Any

from megatron.training.argument_utils import ArgsError, flag

# TransformerConfig fields whose flag is not "--" + the field's name (Megatron-core's names)
_FIELD_FLAGS = {"num_moe_experts": "--num-experts", "layernorm_epsilon": "--norm-epsilon",
                "layernorm_zero_centered_gamma": "--apply-layernorm-1p"}


def config_flag(field: str) -> str:
    """The command-line flag that sets TransformerConfig's `field`."""
    return _FIELD_FLAGS.get(field) or flag(field)


def core_transformer_config_from_args(args: Namespace, config_class: type | None = None) -> Any:
    """The TransformerConfig (or config_class) of validated args; the only flag -> model translation."""
    if config_class is None:
        from megatron.model import TransformerConfig as config_class
    return config_class(**_architecture_kwargs(args),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=_cp_comm_type(args),
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
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
        **_mamba_kwargs(args),
    )


def _cp_comm_type(args: Namespace) -> Any:
    """--cp-comm-type as Megatron hands it on: one value as a string, several as the per-layer list."""
    kinds = args.cp_comm_type
    return kinds[0] if isinstance(kinds, (list, tuple)) and len(kinds) == 1 else kinds


def _mamba_kwargs(args: Namespace) -> dict[str, Any]:
    """The Mamba fields of TransformerConfig (--disable-mamba-mem-eff-path is use_mamba_mem_eff_path=False)."""
    return dict(mamba_state_dim=args.mamba_state_dim, mamba_head_dim=args.mamba_head_dim,
                mamba_num_groups=args.mamba_num_groups, mamba_num_heads=args.mamba_num_heads,
                use_mamba_mem_eff_path=not args.disable_mamba_mem_eff_path)


def hybrid_pattern_from_args(args: Namespace) -> str | None:
    """The layer pattern of a hybrid model (--hybrid-override-pattern or the ratios' allocation), or
    None for a model that is not one (no hybrid flag given)."""
    from megatron.model.mamba.hybrid import HybridPatternError
    from megatron.training.config.groups import HybridConfig

    hybrid = HybridConfig(is_hybrid_model=args.is_hybrid_model, hybrid_attention_ratio=args.hybrid_attention_ratio,
                          hybrid_mlp_ratio=args.hybrid_mlp_ratio, hybrid_override_pattern=args.hybrid_override_pattern)
    try:
        return hybrid.layer_pattern(args.num_layers)
    except HybridPatternError as error:
        raise ArgsError(str(error)) from None


def mamba_model_kwargs(args: Namespace) -> dict[str, Any]:
    """MambaModel's keywords from validated args: gpt_model_kwargs' positions and the hybrid pattern."""
    kwargs = gpt_model_kwargs(args)
    if kwargs.pop("transformer_layer_spec") is not None:
        raise ArgsError("--spec: a hybrid model builds its layers from --hybrid-override-pattern")
    return dict(kwargs, hybrid_override_pattern=hybrid_pattern_from_args(args) or "M" * args.num_layers)


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
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
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


def lora_config_from_args(args: Namespace) -> Any:
    """The LoRAConfig of validated args; None when --lora-rank is 0 (no adapters)."""
    from megatron.core.tensor_parallel.lora import LoRAConfig

    if not args.lora_rank:
        return None
    return LoRAConfig(rank=args.lora_rank, alpha=float(args.lora_alpha), dropout=float(args.lora_dropout),
                      target_modules=tuple(args.lora_target_modules))


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


def sft_dataset_config_from_args(args: Namespace, tokenizer: Any) -> Any:
    """The SFTDatasetConfig of validated args (--sft): the GPT data flags plus the chat template
    of --sft-tokenizer-prompt-format (a named format, or the tokenizer's own for 'default')."""
    from megatron.data.sft_conversation import DEFAULT_FORMAT, PROMPT_FORMATS
    from megatron.data.sft_dataset import SFTDatasetConfig

    name = args.sft_tokenizer_prompt_format
    if name == DEFAULT_FORMAT:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ArgsError("--sft-tokenizer-prompt-format default: the tokenizer has no chat template (a "
                            "HuggingFace tokenizer folder whose tokenizer_config.json has a chat_template); "
                            f"name a format instead ({', '.join(PROMPT_FORMATS)})")
    else:
        template = PROMPT_FORMATS[name]
    base = gpt_dataset_config_from_args(args, tokenizer)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    return SFTDatasetConfig(**{**fields, "create_attention_mask": False}, chat_template=template)
