"""pretrain(): build the model, optimizer, scheduler and data; train, evaluate, checkpoint.

    initialize_megatron           args, globals, distributed, seeds
    setup_model_and_optimizer     model (Float16Module under --fp16/--bf16), optimizer, LR/WD
                                  scheduler, --load
    build data iterators          datasets sized for train_iters x global batch, loaders that
                                  resume at the consumed samples of the checkpoint
    train                         train_step per iteration; log, evaluate, save, exit checks
    final validation and test

The loop reads top to bottom; every feature is a named helper call.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch

from megatron.core import communication, device, parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.training.global_vars import (
    get_args,
    get_num_microbatches,
    get_signal_handler,
    get_tensorboard_writer,
    get_tokenizer,
    get_timers,
    get_wandb_writer,
    update_num_microbatches,
)
from megatron.training.arguments_validation import require_training_data
from megatron.training.initialize import initialize_megatron
from megatron.training.training_log import (  # noqa: F401  (training_log: Megatron's name, imported from here)
    IntervalStats,
    Progress,
    format_communication_stats,
    format_log_line,
    MoEInterval,
    log_timers_and_memory,
    moe_layer_numbers,
    moe_log_lines,
    moe_loss_names,
    log_validation,
    num_floating_point_operations,
    training_log,
    write_scalars,
)
from megatron.training.utils import print_datetime, print_line, print_rank_0, print_rank_last

_TRAIN_START_TIME: float = time.time()


class NaNLossError(RuntimeError):
    """--check-for-nan-in-loss-and-grad found a NaN/Inf loss or gradient norm."""


@dataclass(frozen=True)
class IterationRecord:
    """One training iteration, exactly as computed (no log-line rounding)."""

    iteration: int
    losses: Dict[str, float]
    skipped: bool
    grad_norm: Optional[float]
    learning_rate: float
    loss_scale: float
    global_batch_size: int


@dataclass
class TrainingResult:
    """What pretrain() did. history holds every iteration when record_history=True."""

    iteration: int = 0
    exit_reason: str = "completed"
    history: List[IterationRecord] = field(default_factory=list)
    validation: List[Tuple[str, Dict[str, float]]] = field(default_factory=list)
    num_floating_point_operations_so_far: float = 0.0


def pretrain(train_valid_test_dataset_provider: Callable, model_provider: Callable, model_type: ModelType,
             forward_step_func: Callable, process_non_loss_data_func: Optional[Callable] = None,
             extra_args_provider: Optional[Callable] = None, args_defaults: Optional[Dict] = None,
             argv: Optional[List[str]] = None, record_history: bool = False) -> TrainingResult:
    """Train a model as Megatron's pretrain(); argv None reads sys.argv."""
    if process_non_loss_data_func is not None:
        raise ValueError("pretrain(process_non_loss_data_func=...) is not supported yet: evaluation "
                         "collects losses only")
    global _TRAIN_START_TIME
    _TRAIN_START_TIME = time.time()
    from megatron.planner.report import dry_run

    dry_run(extra_args_provider, args_defaults, argv)  # --dry-run: the plan, then exit 0 (returns otherwise)
    initialize_megatron(extra_args_provider, args_defaults, argv=argv)
    args = get_args()
    require_training_data(args)  # the datasets below come from the flags
    print_rank_0("time to initialize megatron (seconds): {:.3f}".format(time.time() - _TRAIN_START_TIME))
    print_datetime("after megatron is initialized")

    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type)
    print_datetime("after model, optimizer, and learning rate scheduler are built")
    train_iter, valid_iter, test_iter = build_train_valid_test_data_iterators(train_valid_test_dataset_provider)
    print_datetime("after dataloaders are built")

    result = TrainingResult(iteration=args.iteration,
                            num_floating_point_operations_so_far=args.num_floating_point_operations_so_far)
    loop = _Loop(forward_step_func, model, optimizer, opt_param_scheduler, result, record_history)
    if not args.skip_train and args.do_train and args.train_iters > 0:
        print_datetime("before the start of training step")
        print_rank_0("training ...")
        try:
            loop.train(train_iter, valid_iter)
            print_datetime("after training is done")
            if result.exit_reason == "completed":
                trained = result.iteration != args.iteration  # a resumed run may have nothing left to train
                if args.save and trained and result.iteration != loop.last_saved_iteration:
                    loop.save()
        except BaseException:
            _abandon_saves()  # no collective: the other ranks may be gone; the save never becomes the latest
            raise
        _finalize_saves(blocking=True)  # exit waits for the --async-save in flight
        if result.exit_reason != "completed":
            return _finish(result)
    if args.do_valid:
        loop.evaluate_and_print(f"iteration {result.iteration} on validation set", valid_iter)
    if args.do_test:
        loop.evaluate_and_print(f"iteration {result.iteration} on test set", test_iter)
    return _finish(result)


def _finalize_saves(blocking: bool) -> None:
    """Finalize a background (--async-save) checkpoint: collective, called at the same points on
    every rank; nothing to do (and no collective) when no save is in flight."""
    from megatron import dist_checkpointing

    if dist_checkpointing.async_save_pending():
        with _not_training_time():
            dist_checkpointing.maybe_finalize_async_save(blocking=blocking)


def _abandon_saves() -> None:
    from megatron import dist_checkpointing

    dist_checkpointing.abandon_async_saves()


def _finish(result: TrainingResult) -> TrainingResult:
    writer = get_tensorboard_writer()
    if writer is not None:
        writer.flush()
    return result


# ------------------------------------------------------------------------ model and optimizer

def _compile_transformer_layers(model: List[torch.nn.Module]) -> None:
    """--torch-compile: each TransformerLayer's forward through torch.compile (Inductor; compiled
    on its first call, once per input shape). The linears' custom autograd functions, the RNG
    tracker and the fused ops stay inside the graph or break it where Dynamo cannot trace."""
    from megatron.model.transformer_layer import TransformerLayer

    layers = [module for chunk in model for module in chunk.modules() if isinstance(module, TransformerLayer)]
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
    print_rank_0(f"> torch.compile: {len(layers)} transformer layers (compiled on their first call)")


def _stage_roles(model_type: ModelType) -> Dict[str, bool]:
    """What this pipeline stage builds (Megatron's get_model): pre_process (the embedding) and
    post_process (the final norm and the output layer); an encoder-decoder model also add_encoder
    and add_decoder, with the encoder on the stages before --pipeline-model-parallel-split-rank and
    the decoder from it on, each stack with its own first (embedding) and last (final norm) stage."""
    split = parallel_state.get_pipeline_model_parallel_split_rank()
    if model_type != ModelType.encoder_and_decoder:
        if split is not None:
            raise ValueError("--pipeline-model-parallel-split-rank is for encoder-decoder models (T5); this model "
                             "is one stack")
        return dict(pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return dict(pre_process=True, post_process=True, add_encoder=True, add_decoder=True)
    if split is None:
        raise ValueError("an encoder-decoder model under pipeline parallelism needs "
                         "--pipeline-model-parallel-split-rank (the first decoder stage)")
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return dict(pre_process=rank in (0, split), post_process=rank in (split - 1, pp - 1),
                add_encoder=parallel_state.is_pipeline_stage_before_split(),
                add_decoder=parallel_state.is_pipeline_stage_after_split())


def get_model(model_provider: Callable, model_type: ModelType = ModelType.encoder_or_decoder) -> List[torch.nn.Module]:
    """The model chunks of this rank, on the device, wrapped in Float16Module under --fp16/--bf16.

    One chunk per virtual pipeline stage (one without interleaving). Every chunk is built from the
    same generator state (--seed), and each layer draws its weights from its own stream (see
    GPTModel): the model is the same, weight for weight, whatever the TP/PP layout.
    """
    from megatron.model import Float16Module, get_num_parameters
    from megatron.model.utils import get_num_parameters_across_model_parallel

    args = get_args()
    virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    model = []
    for chunk_id in range(virtual or 1):
        if virtual is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            chunk = model_provider(**_stage_roles(model_type))
        chunk.model_type = model_type
        model.append(chunk)
    _apply_lora(model, args)
    if virtual is not None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    if args.torch_compile:
        _compile_transformer_layers(model)
    if parallel_state.get_data_parallel_rank() == 0:
        print_line(" > number of parameters on (tensor, pipeline) model parallel rank ({}, {}): {}".format(
            parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
            get_num_parameters(model)))
    total = get_num_parameters_across_model_parallel(model)
    print_rank_0(f" > number of parameters in the model (every rank, replicated ones once): {total}")
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,  # always on with --bf16, as in Megatron
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # Megatron's default with overlap: buckets of max(40M, 1M x DP) elements.
        # Without overlap one bucket per buffer (Megatron ignores --ddp-bucket-size then).
        bucket_size=(None if not args.overlap_grad_reduce else args.ddp_bucket_size if args.ddp_bucket_size is not None
                     else max(40_000_000, 1_000_000 * args.data_parallel_size)),
        # NaN checks stay in the loop (_check_for_nan names the iteration); an fp16 overflow's inf
        # gradients are expected there and skip the step.
        average_in_collective=args.ddp_average_in_collective)
    wrapped = []
    for chunk in model:
        chunk.to(device.get_device())
        config = chunk.config
        if args.fp16 or args.bf16:
            chunk = Float16Module(config, chunk)
        # Every data-parallel size goes through the wrapper (at DP = 1 nothing is communicated):
        # param.main_grad views into one contiguous buffer, reduced in buckets.
        chunk = DistributedDataParallel(config, ddp_config, chunk)
        if not args.data_parallel_random_init:
            chunk.broadcast_params()  # every replica starts from data-parallel rank 0's weights
        wrapped.append(chunk)
    if args.check_weight_hash_across_dp_replicas_interval and not args.data_parallel_random_init:
        check_weights_equal_across_data_parallel_replicas(wrapped, 0)  # the debug check, at start-up too
    return wrapped


def _apply_lora(model: List[torch.nn.Module], args: argparse.Namespace) -> None:
    """--lora-rank: adapters on the targeted layers of every chunk, every other weight frozen."""
    from megatron.model.lora import apply_lora
    from megatron.training.config_builders import lora_config_from_args

    lora = lora_config_from_args(args)
    if lora is None:
        return
    count = sum(apply_lora(chunk, lora, args.seed) for chunk in model)
    trainable = sum(p.numel() for chunk in model for p in chunk.parameters() if p.requires_grad)
    print_rank_0(f" > LoRA rank {lora.rank}, alpha {lora.alpha} on {count} linear layers of this rank "
                 f"({', '.join(lora.target_modules)}): {trainable} trainable parameters here, the rest frozen")


def get_optimizer_param_scheduler(optimizer: Any) -> Any:
    """The LR/WD scheduler, with every length converted to samples as Megatron does."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    args = get_args()
    if args.train_samples is None:  # iteration-based training (train_iters is derived otherwise)
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        gbs = args.global_batch_size
        lr_decay_steps = args.lr_decay_iters * gbs
        wd_incr_steps = args.train_iters * gbs
        wsd_decay_steps = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters else None
        warmup = (args.lr_warmup_fraction * lr_decay_steps if args.lr_warmup_fraction is not None
                  else args.lr_warmup_iters * gbs)
    else:
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
        lr_decay_steps = args.lr_decay_samples
        wd_incr_steps = args.train_samples
        wsd_decay_steps = args.lr_wsd_decay_samples
        warmup = (args.lr_warmup_fraction * lr_decay_steps if args.lr_warmup_fraction is not None
                  else args.lr_warmup_samples)
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=lr_decay_steps, lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=wd_incr_steps, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=args.lr_wsd_decay_style,
        samples_per_iteration=args.global_batch_size if args.train_samples is None else None)


def setup_model_and_optimizer(model_provider: Callable, model_type: ModelType) -> Tuple[List[torch.nn.Module], Any, Any]:
    """Model, optimizer and scheduler; loads --load when given (sets args.iteration)."""
    from megatron.training.arguments import optimizer_config_from_args
    from megatron.core.optimizer import get_megatron_optimizer

    args = get_args()
    _set_train_iters(args)
    model = get_model(model_provider, model_type)
    optimizer = get_megatron_optimizer(optimizer_config_from_args(args), model)
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
    args.iteration, args.num_floating_point_operations_so_far = 0, 0.0
    from megatron.training.load_hf import load_hf_instead, load_hf_weights

    from megatron.training import checkpoint_lora
    from megatron.training.lora_pointer import lora_run

    if lora_run(model):  # adapter-only checkpoints over a base (checkpoint_lora.py)
        args.iteration, args.num_floating_point_operations_so_far = checkpoint_lora.load_lora_run(
            model, optimizer, opt_param_scheduler, args)
        if args.iteration == 0:
            optimizer.reload_model_params()  # the fp32 main copies follow the loaded weights
    elif load_hf_instead(args):  # --load-hf, and no checkpoint of this run under --load yet
        load_hf_weights(model, args, get_tokenizer().vocab_size)
        optimizer.reload_model_params()  # the fp32 main copies follow the loaded weights
    elif args.load is not None or args.pretrained_checkpoint is not None:
        from megatron.training.checkpointing import load_checkpoint

        timers = get_timers()
        timers("load-checkpoint").start()
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(
            model, optimizer, opt_param_scheduler, args=args)
        timers("load-checkpoint").stop()
        if args.finetune or args.no_load_optim or args.iteration == 0:
            optimizer.reload_model_params()  # the fp32 main copies follow the loaded weights
    return model, optimizer, opt_param_scheduler


def _set_train_iters(args: argparse.Namespace) -> None:
    """--train-samples: the iterations they take, with the batch-size ramp-up (Megatron's update_train_iters)."""
    if args.train_samples is None:
        return
    from megatron.core.num_microbatches_calculator import get_train_iters_for_samples

    args.train_iters = get_train_iters_for_samples(args.train_samples, args.rampup_batch_size,
                                                   args.global_batch_size)
    print_rank_0(f"setting training iterations to {args.train_iters}")


# ------------------------------------------------------------------------------------ data

def build_train_valid_test_data_iterators(provider: Callable) -> Tuple[Optional[Iterator], ...]:
    """Datasets sized as Megatron sizes them, and iterators resumed at the consumed samples."""
    from megatron.data.data_samplers import build_pretraining_data_loader

    args = get_args()
    gbs = args.global_batch_size
    if args.iteration > 0 and args.consumed_train_samples == 0 and args.rampup_batch_size is None:
        args.consumed_train_samples = args.iteration * gbs  # a checkpoint from before the counters
    eval_iters = (args.train_iters // args.eval_interval + 1) * args.eval_iters if args.eval_interval else args.eval_iters
    sizes = [args.train_iters * gbs if args.train_samples is None else args.train_samples,
             eval_iters * gbs, args.eval_iters * gbs]
    print_rank_0(" > datasets target sizes (minimum size):")
    for name, size in zip(("train", "validation", "test"), sizes):
        print_rank_0(f"    {name + ':':<12}{size}")
    datasets = provider(sizes)
    loaders = [build_pretraining_data_loader(
        dataset, consumed, micro_batch_size=args.micro_batch_size,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        dataloader_type=args.dataloader_type, num_workers=args.num_workers, seed=args.seed,
        workers_ignore_sigterm=args.exit_signal_handler)
        for dataset, consumed in zip(datasets, (args.consumed_train_samples, args.consumed_valid_samples, 0))]
    # Only the ranks that read data (tensor-parallel rank 0) have loaders; the others take
    # their batches by broadcast, and learn from here which splits exist.
    flags = torch.tensor([loaders[0] is not None, loaders[1] is not None, loaders[2] is not None], dtype=torch.int64)
    if torch.distributed.is_initialized():
        communication.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    args.do_train = bool(flags[0]) and args.train_iters > 0
    args.do_valid = bool(flags[1]) and args.eval_iters > 0
    args.do_test = bool(flags[2]) and args.eval_iters > 0
    print_rank_0(" > finished creating data iterators: train {}, valid {}, test {}".format(
        args.do_train, args.do_valid, args.do_test))
    virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if virtual is None:
        return tuple(_iterate(loader, args.dataloader_type) for loader in loaders)
    # The interleaved schedule takes one iterator per model chunk; only the chunk holding the
    # first (last) stage reads from its iterator, each advancing once per micro-batch.
    return tuple([_iterate(loader, args.dataloader_type) for _ in range(virtual)] for loader in loaders)


def _iterate(loader: Any, dataloader_type: str) -> Optional[Iterator]:
    if loader is None:
        return None
    if dataloader_type == "cyclic":
        def forever() -> Iterator:
            while True:
                yield from loader
        return forever()
    return iter(loader)


# ------------------------------------------------------------------------------ one step

def _reduce_losses(losses: List[Dict[str, torch.Tensor]]) -> Dict[str, float]:
    """Per-token mean over the global batch for [sum, count] values; mean over micro-batches otherwise.

    Only the last pipeline stage computes losses. Its data-parallel replicas add up their sums
    and counts (a micro-batch mean counts as a sum over 1), and it hands the result to the other
    stages, so every rank reports (and checks for NaN) the same numbers.
    """
    reduced: Dict[str, float] = {}
    if losses:
        keys = list(losses[0])
        totals = []  # per key: [sum, count]
        for key in keys:
            values = torch.stack([torch.as_tensor(x[key]).detach().float().cpu().view(-1) for x in losses])
            if values.shape[1] == 2:
                totals.append(values.sum(dim=0))
            else:
                totals.append(torch.stack([values.sum(), torch.tensor(float(len(losses)))]))
        totals = torch.stack(totals).to(device.get_device())  # [keys, 2]; on the device: NCCL reduces only those
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        if group is not None and torch.distributed.get_world_size(group) > 1:
            communication.all_reduce(totals, group=group)  # the group's ranks are all last-stage ranks
        reduced = {key: (total[0] / total[1].clamp(min=1)).item() for key, total in zip(keys, totals)}
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        shared = [reduced]
        communication.broadcast_object_list(shared, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                            group=parallel_state.get_pipeline_model_parallel_group())
        reduced = shared[0]
    return reduced


class StepReport(NamedTuple):
    """One global batch as this project's loops read it: the reduced losses as floats, the same on
    every rank (the last pipeline stage shares them), whether the update was skipped (fp16 overflow),
    the gradient norm and the number of zeros in the gradients (--log-num-zeros-in-grad)."""

    losses: Dict[str, float]
    skipped: bool
    grad_norm: Optional[float]
    num_zeros: Optional[int]


def _split_outputs(losses: List[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], Dict[str, torch.Tensor]]:
    """The loss functions' values that are not losses: tensors of more than two elements (a loss is
    a scalar or a [sum, count] pair), such as the logits Accelerate's GPT loss function returns with
    return_logits; each is concatenated over the micro-batches, as Accelerate's eval step does."""
    keys = [key for key in (losses[0] if losses else {}) if torch.as_tensor(losses[0][key]).numel() > 2]
    outputs = {key: torch.cat([x[key].detach() for x in losses]) for key in keys}
    return [{k: v for k, v in x.items() if k not in outputs} for x in losses], outputs


def train_step_report(forward_step_func: Callable, data_iterator: Optional[Iterator], model: List[torch.nn.Module],
                      optimizer: Any, opt_param_scheduler: Any, config: Any = None,
                      forward_backward_func: Optional[Callable] = None) -> StepReport:
    """One global batch: forward/backward over its micro-batches, optimizer and scheduler step.

    An fp16 overflow skips the update and the scheduler step, as in Megatron. forward_backward_func
    defaults to get_forward_backward_func(); config (the model's, Megatron's get_model_config) may
    carry grad_scale_func and finalize_model_grads_func (Accelerate sets them), else the optimizer's
    loss scale and finalize_model_grads are used. train_step is Megatron's interface over this.
    """
    from megatron.core.distributed import finalize_model_grads

    args = get_args()
    timers = get_timers()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward = forward_backward_func or get_forward_backward_func()
    timers("forward-backward", log_level=1).start()
    losses = forward_backward(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
        decoder_seq_length=args.decoder_seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False,
        grad_scale_func=getattr(config, "grad_scale_func", None) or optimizer.scale_loss,
        calculate_per_token_loss=args.calculate_per_token_loss,
        finalize_model_grads_func=getattr(config, "finalize_model_grads_func", None) or finalize_model_grads)
    timers("forward-backward", log_level=1).stop()
    if args.empty_unused_memory_level >= 1:
        device.empty_cache()
    timers("optimizer", log_level=1).start()
    update_successful, grad_norm, num_zeros = optimizer.step()
    timers("optimizer", log_level=1).stop()
    if args.empty_unused_memory_level >= 2:
        device.empty_cache()
    if update_successful:
        opt_param_scheduler.step(increment=get_num_microbatches() * args.micro_batch_size * args.data_parallel_size)
    losses, outputs = _split_outputs(losses)
    reduced = _reduce_losses(losses)
    if args.num_experts:
        reduced.update(_collect_moe_stats(args))
    _LAST_STEP_OUTPUTS.clear()
    _LAST_STEP_OUTPUTS.update(outputs)
    return StepReport(reduced, not update_successful, grad_norm, num_zeros)


# What the last train_step_report's loss functions returned besides losses (_split_outputs): train_step
# hands them back in its loss_dict.
_LAST_STEP_OUTPUTS: Dict[str, torch.Tensor] = {}


def train_step(forward_step_func: Callable, data_iterator: Optional[Iterator], model: List[torch.nn.Module],
               optimizer: Any, opt_param_scheduler: Any, config: Any = None,
               forward_backward_func: Optional[Callable] = None) -> Tuple[Dict[str, torch.Tensor], int, bool, bool, int,
                                                                          Optional[float], Optional[int]]:
    """Megatron's train_step (core_v0.14-0.15, the form Accelerate 1.16 calls and unpacks):

        (loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, num_zeros_in_grad)

    loss_dict: {name: 0-d float tensor on the device}, the mean over the global batch, on the last
    pipeline stage; {} on the other stages. Values of the loss function that are not losses (the
    logits of Accelerate's return_logits) come back concatenated over the micro-batches. skipped_iter: 1 when the update was skipped, else 0.
    should_checkpoint / should_exit / exit_code come from Megatron's rerun state machine, which this
    framework does not have (the loop handles signals and exits): always False, False, 0.
    """
    report = train_step_report(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                               forward_backward_func)
    loss_dict = {}
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        loss_dict = {key: torch.tensor(value, dtype=torch.float32, device=device.get_device())
                     for key, value in report.losses.items()}
        loss_dict.update(_LAST_STEP_OUTPUTS)
    _LAST_STEP_OUTPUTS.clear()
    return loss_dict, int(report.skipped), False, False, 0, report.grad_norm, report.num_zeros


# The MoE layers' per-layer values since the last log line (training_log.MoEInterval).
_MOE_INTERVAL = MoEInterval()


def _collect_moe_stats(args: Any) -> Dict[str, float]:
    """This iteration's balancing losses, summed over every rank (a collective all ranks make), as the
    log line's means over the MoE layers (Megatron's load_balancing_loss / z_loss); the per-layer values
    and token counts are kept for the log interval."""
    from megatron.core import aux_losses

    stats = aux_losses.collect(moe_loss_names(args), args.num_layers, args.num_experts,
                               parallel_state.get_data_parallel_world_size(with_context_parallel=True),
                               get_num_microbatches(), device=device.get_device())
    _MOE_INTERVAL.add(stats)
    layers = moe_layer_numbers(args)
    return {name: float(values.sum()) / len(layers) for name, values in stats.losses.items()}


def check_weights_equal_across_data_parallel_replicas(model: List[torch.nn.Module], iteration: int) -> None:
    """Raise if any data-parallel replica's weights differ from the others' (a hash per replica): the
    dense parameters over the data-parallel group, the expert ones over the expert-data-parallel group
    (the ranks holding the same experts)."""
    import hashlib

    for chunk in model:
        chunk.finish_param_sync()  # --overlap-param-gather: the weights may still be arriving
    for kind, group in (("data-parallel", parallel_state.get_data_parallel_group(with_context_parallel=True)),
                        ("expert-data-parallel", parallel_state.get_expert_data_parallel_group())):
        if group is None or torch.distributed.get_world_size(group) == 1:
            continue
        digest = hashlib.sha256()
        for chunk in model:
            for name, param in chunk.named_parameters():
                if getattr(param, "expert_parallel", False) == (kind == "expert-data-parallel"):
                    digest.update(name.encode())
                    digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        hashes = [None] * torch.distributed.get_world_size(group)
        communication.all_gather_object(hashes, digest.hexdigest(), group=group)
        if len(set(hashes)) > 1:
            ranks = torch.distributed.get_process_group_ranks(group)
            raise RuntimeError(f"iteration {iteration}: the weights differ across {kind} replicas "
                               f"(global ranks {ranks}: {[h[:12] for h in hashes]}) "
                               "(--check-weight-hash-across-dp-replicas-interval)")


def _check_for_nan(iteration: int, losses: Dict[str, float], grad_norm: Optional[float], skipped: bool) -> None:
    bad = [name for name, value in losses.items() if not math.isfinite(value)]
    if bad:
        raise NaNLossError(f"iteration {iteration}: {', '.join(bad)} is {losses[bad[0]]} "
                           "(--check-for-nan-in-loss-and-grad)")
    if not skipped and grad_norm is not None and not math.isfinite(grad_norm):
        raise NaNLossError(f"iteration {iteration}: the gradient norm is {grad_norm} "
                           "(--check-for-nan-in-loss-and-grad)")


# ------------------------------------------------------------------------------ the loop

@contextlib.contextmanager
def _not_training_time():
    """Pause the iteration timer (if it runs) around evaluation and checkpointing."""
    timer = get_timers()("interval-time")
    running = timer.running
    if running:
        timer.stop()
    try:
        yield
    finally:
        if running:
            timer.start()


class _Loop:
    """The training loop's state: model, optimizer, scheduler, log accumulators, last save."""

    def __init__(self, forward_step_func: Callable, model: List[torch.nn.Module], optimizer: Any,
                 opt_param_scheduler: Any, result: TrainingResult, record_history: bool) -> None:
        self.forward_step_func = forward_step_func
        self.model = model
        self.optimizer = optimizer
        self.opt_param_scheduler = opt_param_scheduler
        self.result = result
        self.record_history = record_history
        self.last_saved_iteration: Optional[int] = None
        self.stats = IntervalStats()
        global _MOE_INTERVAL  # a new run's interval: a run that stopped between log lines left its values
        _MOE_INTERVAL = MoEInterval()
        from megatron.core import aux_losses

        # and a new run's record: forward passes outside a training step (an evaluation, generation, another
        # run in this process) leave values that the first iteration's log line would otherwise add
        aux_losses.clear()

    # -------------------------------------------------------------- train
    def train(self, train_iter: Iterator, valid_iter: Optional[Iterator]) -> None:
        args = get_args()
        timers = get_timers()
        for chunk in self.model:
            chunk.train()
        progress = Progress(self.result.iteration, args.train_iters)
        timers("interval-time").start()
        while self.result.iteration < args.train_iters:
            update_num_microbatches(args.consumed_train_samples, consistency_check=True)
            losses, skipped, grad_norm, num_zeros = train_step_report(
                self.forward_step_func, train_iter, self.model, self.optimizer, self.opt_param_scheduler)
            self.result.iteration += 1
            iteration = self.result.iteration
            batch_size = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
            args.consumed_train_samples += batch_size
            self.result.num_floating_point_operations_so_far += num_floating_point_operations(args, batch_size)
            if args.check_for_nan_in_loss_and_grad:
                _check_for_nan(iteration, losses, grad_norm, skipped)
            interval = args.check_weight_hash_across_dp_replicas_interval
            if interval and iteration % interval == 0:
                check_weights_equal_across_data_parallel_replicas(self.model, iteration)
            if self.record_history:
                self.result.history.append(IterationRecord(
                    iteration, dict(losses), skipped, grad_norm, self.optimizer.param_groups[0]["lr"],
                    float(self.optimizer.get_loss_scale()), batch_size))
            self._log(iteration, losses, skipped, grad_norm, num_zeros, batch_size, progress)
            _finalize_saves(blocking=False)  # an --async-save whose writes every rank finished
            if args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid:
                self.evaluate_and_print(f"iteration {iteration}", valid_iter)
            if self._should_exit(iteration):
                return

    def _log(self, iteration: int, losses: Dict[str, float], skipped: bool, grad_norm: Optional[float],
             num_zeros: Optional[int], batch_size: int, progress: Progress) -> None:
        args = get_args()
        self.stats.add(losses, skipped)
        learning_rate = self.optimizer.param_groups[0]["lr"]
        loss_scale = float(self.optimizer.get_loss_scale())
        writer, wandb = get_tensorboard_writer(), get_wandb_writer()
        if (writer is not None or wandb is not None) and iteration % args.tensorboard_log_interval == 0:
            scalars = {"learning-rate": learning_rate, "batch-size": float(batch_size), "loss-scale": loss_scale}
            scalars.update({key: value for key, value in losses.items() if math.isfinite(value)})
            if grad_norm is not None:
                scalars["grad-norm"] = grad_norm
            write_scalars(writer, wandb, scalars, iteration, args.consumed_train_samples)
        if iteration % args.log_interval != 0:
            return
        seconds = get_timers()("interval-time").elapsed(reset=True) / max(self.stats.iterations, 1)
        tflops = num_floating_point_operations(args, batch_size) / (seconds * 1e12 * args.world_size) if seconds > 0 else 0.0
        print_rank_last(format_log_line(
            iteration=iteration, train_iters=args.train_iters, consumed_samples=args.consumed_train_samples,
            ms_per_iteration=seconds * 1000.0, tflops_per_gpu=tflops, learning_rate=learning_rate,
            global_batch_size=batch_size, losses=self.stats.averages(), loss_scale=loss_scale,
            grad_norm=grad_norm, num_zeros_in_grad=num_zeros, params_norm=self._params_norm(),
            skipped=self.stats.skipped, nan=self.stats.nan))
        progress.report(iteration)  # the same (last) rank, right after its log line
        self._log_moe(iteration)
        log_timers_and_memory(iteration, max(self.stats.iterations, 1))
        if args.log_communication_stats:
            counter = communication.get_global_counter()
            print_rank_last(format_communication_stats(counter.summary(), max(self.stats.iterations, 1)))
            counter.reset()
        if writer is not None or wandb is not None:
            write_scalars(writer, wandb, {"iteration-time": seconds, "throughput": tflops}, iteration,
                          args.consumed_train_samples)
        self.stats = IntervalStats()

    def _log_moe(self, iteration: int) -> None:
        """The MoE layers' lines for the interval: per layer with --moe-per-layer-logging (and to
        tensorboard), and the starved-expert / dropped-token warnings always."""
        global _MOE_INTERVAL
        args = get_args()
        if not args.num_experts:
            return
        interval, _MOE_INTERVAL = _MOE_INTERVAL, MoEInterval()
        layers = moe_layer_numbers(args)
        for line in moe_log_lines(interval, layers, args.moe_per_layer_logging, args.moe_drop_warning_threshold):
            print_rank_last(line)
        writer, wandb = get_tensorboard_writer(), get_wandb_writer()
        if args.moe_per_layer_logging and (writer is not None or wandb is not None):
            n = max(interval.iterations, 1)
            write_scalars(writer, wandb, {f"moe/{name}_layer_{layer}": float(values[layer - 1]) / n
                                          for name, values in interval.losses.items() for layer in layers},
                          iteration, args.consumed_train_samples)

    def _params_norm(self) -> Optional[float]:
        """L2 norm of the whole model's parameters: each counted once over the TP/PP ranks."""
        if not get_args().log_params_norm:
            return None
        from megatron.core.optimizer.optimizer import params_norm

        return params_norm(self.model)

    # -------------------------------------------------------------- evaluation
    def evaluate(self, data_iterator: Iterator) -> Dict[str, float]:
        """Mean losses over --eval-iters global batches, without dropout or gradients."""
        args = get_args()
        eval_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
        forward_backward = get_forward_backward_func()
        for chunk in self.model:
            chunk.eval()
        losses: List[Dict[str, torch.Tensor]] = []
        with torch.no_grad():
            for _ in range(args.eval_iters):
                losses += forward_backward(
                    forward_step_func=self.forward_step_func, data_iterator=data_iterator, model=self.model,
                    num_microbatches=eval_microbatches, seq_length=args.seq_length,
                    decoder_seq_length=args.decoder_seq_length,
                    micro_batch_size=args.micro_batch_size, forward_only=True,
                    calculate_per_token_loss=args.calculate_per_token_loss)
                args.consumed_valid_samples += args.global_batch_size
        for chunk in self.model:
            chunk.train()
        return _reduce_losses(losses)

    def evaluate_and_print(self, prefix: str, data_iterator: Iterator) -> Dict[str, float]:
        args = get_args()
        with _not_training_time():
            losses = self.evaluate(data_iterator)
        log_validation(prefix, losses, self.result.iteration, args.consumed_train_samples,
                       get_tensorboard_writer(), get_wandb_writer())
        self.result.validation.append((prefix, losses))
        return losses

    # -------------------------------------------------------------- checkpoints and exits
    def save(self) -> None:
        from megatron.training.checkpointing import save_checkpoint

        with _not_training_time():
            save_checkpoint(self.result.iteration, self.model, self.optimizer, self.opt_param_scheduler,
                            self.result.num_floating_point_operations_so_far, args=get_args())
        self.last_saved_iteration = self.result.iteration

    def _exit(self, reason: str, message: str) -> bool:
        args = get_args()
        if args.save and self.last_saved_iteration != self.result.iteration:
            self.save()
        print_datetime(message)
        print_rank_0(message)
        self.result.exit_reason = reason
        return True

    def _should_exit(self, iteration: int) -> bool:
        """Save/exit checks after an iteration, in Megatron's order."""
        args = get_args()
        handler = get_signal_handler()
        if handler is not None and handler.signals_received():
            return self._exit("signal", "exiting program after receiving SIGTERM.")
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            self.save()
        if args.exit_duration_in_mins:
            minutes = (time.time() - _TRAIN_START_TIME) / 60.0
            if minutes > args.exit_duration_in_mins:
                return self._exit("duration", f"exiting program after {minutes:.2f} minutes")
        if args.exit_interval and iteration % args.exit_interval == 0:
            return self._exit("interval", f"exiting program at iteration {iteration}")
        return False


__all__ = ["pretrain", "train_step", "train_step_report", "StepReport", "training_log", "get_model",
           "setup_model_and_optimizer", "TrainingResult", "NaNLossError", "IterationRecord",
           "build_train_valid_test_data_iterators", "get_optimizer_param_scheduler", "num_floating_point_operations"]
