"""The setting groups around the model and its training: checkpoints, the parallel layout
(DistributedConfig), data, tokenizer, logging and the serving engine. How a field becomes a flag:
megatron/training/config/fields.py; the table of every group: groups.py."""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron.training.config.fields import ConfigGroup, setting

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

    def rules(self) -> list[str]:
        """--save with an interval > 0; a format we write, torch_dist for --async-save; the options that
        read a checkpoint with --load. (That the directories can be read and written is the run's:
        validate_args.)"""
        if self.save is not None and self.save_interval is None:
            return ["--save needs --save-interval (iterations between checkpoints)"]
        if self.ckpt_format not in ("torch", "torch_dist"):
            return [f"--ckpt-format {self.ckpt_format}: checkpoint formats other than 'torch' and 'torch_dist' "
                    "are not supported yet; use --ckpt-format torch_dist or torch"]
        if self.async_save and self.ckpt_format != "torch_dist":
            return [f"--async-save needs --ckpt-format torch_dist (this run has --ckpt-format {self.ckpt_format}), "
                    "as in Megatron"]
        interval = self.not_positive(("save_interval",))
        if interval:
            return interval
        for name in ("use_checkpoint_args", "finetune"):
            if getattr(self, name) and self.load is None:
                return [f"{self.flag(name)} needs --load (the checkpoint directory to read)"]
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

    def rules(self) -> list[str]:
        """The parallel sizes, timeouts and intervals positive; the watchdog reports before the collectives
        time out; hierarchical context parallelism needs context parallelism. (That the world size
        divides into the sizes is the run's: validate_args, which knows it.)"""
        problems = self.not_positive(("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                      "context_parallel_size", "distributed_timeout_minutes", "cpu_threads",
                                      "watchdog_seconds", "ddp_bucket_size",
                                      "check_weight_hash_across_dp_replicas_interval"))
        if problems:
            return problems
        watchdog, timeout = self.watchdog_seconds, self.distributed_timeout_minutes
        if watchdog is not None and watchdog > timeout * 60:
            return [f"--watchdog-seconds ({watchdog:g}) is longer than --distributed-timeout-minutes ({timeout}): "
                    "the collectives would time out before the watchdog reports them; raise "
                    "--distributed-timeout-minutes"]
        if self.context_parallel_size == 1 and self.hierarchical_context_parallel_sizes is not None:
            return ["--hierarchical-context-parallel-sizes needs --context-parallel-size > 1"]
        return []


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
        """A positive sequence length; one data source (--data-path, --train/valid/test-data-path or
        --mock-data), each blend and the split well formed, --sft's prompt format and the options it
        replaces, the worker count. (That the files exist is the run's: validate_args.)"""
        from megatron.data.utils import parse_and_normalize_split, parse_data_path

        length = self.not_positive(("seq_length",))
        if length:
            return length

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

    def rules(self) -> list[str]:
        return self.not_positive(("make_vocab_size_divisible_by",))


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

    def rules(self) -> list[str]:
        return self.not_positive(("tensorboard_log_interval", "tensorboard_queue_size"))


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
