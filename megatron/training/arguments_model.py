"""validate_args' rules for the model's architecture flags (the Llama family): position
embeddings and the rotary settings, grouped-query attention, the MLP activation and its width.

| function | refuses | derives |
|---|---|---|
| default_ffn_hidden_size | --swiglu at a width that rounds to 0 | 4h, or int(4h x 2/3 / 64) x 64 with --swiglu |
| _validate_position_embedding | relative (but for T5) / mrope; bad --rotary-*; --use-rope-scaling without rope | apply_rope_fusion off without rope |
| _validate_t5 | (T5 only) no --decoder-seq-length or --vocab-extra-ids, fewer sentinels than spans, a decoder too short for the masked tokens, positions neither learned_absolute nor relative, a position table shorter than the decoder, bad relative buckets, --decoder-num-layers other than --num-layers | |
| _validate_query_groups | groups that do not divide the heads, or fit neither way with TP | |
| _validate_activation | two activations at once | |
| layer_spec_from_flag | --spec that is not MODULE NAME, does not import, or names no spec | the ModuleSpec |

The model family comes from the entry script's args_defaults: pretrain_t5.py gives
{"model_family": "T5"} (T5_ARGS_DEFAULTS; the converter marks T5 checkpoints' args alike), which allows relative positions and turns on T5's
rules; without it (GPT, BERT) args.model_family is None.

Megatron-LM silently ignores --rotary-* (and --num-query-groups without --group-query-attention);
so do we, with one WARNING line naming them. Errors are ArgsError naming the flags.
"""

from __future__ import annotations

from argparse import Namespace

from megatron.training.argument_utils import ArgsError, flag
from megatron.training.utils import print_line

# The flags only rope reads, with their defaults (given with another value: the warning names them).
ROPE_ONLY_FLAGS = (("rotary_base", 10000), ("rotary_percent", 1.0), ("rotary_interleaved", False),
                   ("rotary_seq_len_interpolation_factor", None), ("rope_scaling_factor", 8.0))
REFUSED_POSITION_EMBEDDINGS = {
    "relative": "T5-style relative attention biases (only pretrain_t5.py takes them)",
    "mrope": "multimodal rotary embeddings",
}


T5_FAMILY = "T5"  # the converter's mark as well (megatron/convert/t5.py)
T5_POSITION_EMBEDDINGS = ("learned_absolute", "relative")


def is_t5(args: Namespace) -> bool:
    """Whether the entry script is pretrain_t5.py (its args_defaults set model_family "T5")."""
    return args.model_family == T5_FAMILY


def _warn(args: Namespace, message: str) -> None:
    if args.rank == 0:
        print_line(f"WARNING: {message}")


def default_ffn_hidden_size(args: Namespace) -> int:
    """Megatron's default MLP width: 4h, or with --swiglu 2/3 of it rounded down to a multiple of
    64 (two input projections: about the parameters of the 4h GeLU MLP)."""
    if not args.swiglu:
        return 4 * args.hidden_size
    size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
    if size == 0:
        raise ArgsError(f"--swiglu with --hidden-size {args.hidden_size}: Megatron's default --ffn-hidden-size "
                        "int(4h x 2/3 / 64) x 64 is 0; give --ffn-hidden-size")
    return size


def _validate_position_embedding(args: Namespace) -> None:
    kind = args.position_embedding_type
    if kind in REFUSED_POSITION_EMBEDDINGS and not (kind == "relative" and is_t5(args)):
        raise ArgsError(f"--position-embedding-type {kind}: {REFUSED_POSITION_EMBEDDINGS[kind]} are not "
                        "supported; use learned_absolute, rope, alibi or none")
    if kind != "rope":
        if args.use_rope_scaling:
            raise ArgsError(f"--use-rope-scaling needs --position-embedding-type rope (got {kind})")
        ignored = [flag(dest) for dest, default in ROPE_ONLY_FLAGS if getattr(args, dest) != default]
        if ignored:
            _warn(args, f"{', '.join(ignored)} have no effect with --position-embedding-type {kind} "
                        "(only rope reads them); ignored, as in Megatron-LM")
        args.apply_rope_fusion = False  # as Megatron: no rope, nothing to fuse
        return
    percent = args.rotary_percent
    if not 0.0 < percent <= 1.0:  # also refuses NaN
        raise ArgsError(f"--rotary-percent must be in (0, 1], got {percent}")
    rot_dim = int(args.kv_channels * percent)
    if rot_dim == 0 or rot_dim % 2:
        raise ArgsError(f"--rotary-percent {percent} of --kv-channels {args.kv_channels} rotates "
                        f"int({args.kv_channels} x {percent}) = {rot_dim} channels per head; rotary "
                        "embeddings rotate channel pairs, so that must be even and > 0")
    for dest in ("rotary_base", "rotary_seq_len_interpolation_factor", "rope_scaling_factor"):
        value = getattr(args, dest)
        if value is not None and not value > 0:
            raise ArgsError(f"{flag(dest)} must be > 0, got {value}")
    if args.rope_scaling_factor != 8.0 and not args.use_rope_scaling:
        _warn(args, "--rope-scaling-factor has no effect without --use-rope-scaling; ignored, as in Megatron-LM")


def _validate_query_groups(args: Namespace) -> None:
    """With --group-query-attention, the groups split the heads evenly, and either each TP rank
    holds whole groups or (fewer groups than ranks) each group's K/V is replicated on TP / groups ranks."""
    heads, groups, tp = args.num_attention_heads, args.num_query_groups, args.tensor_model_parallel_size
    if not args.group_query_attention:
        if groups != 1:
            _warn(args, f"--num-query-groups {groups} has no effect without --group-query-attention (one "
                        "key/value head per attention head); ignored, as in Megatron-LM")
        return
    if groups is None or groups < 1:
        raise ArgsError(f"--num-query-groups must be >= 1, got {groups}")
    if heads % groups:
        raise ArgsError(f"--num-attention-heads ({heads}) must be divisible by --num-query-groups ({groups}) "
                        "with --group-query-attention: each group serves the same number of heads")
    if groups % tp and tp % groups:
        raise ArgsError(f"--num-query-groups ({groups}) and --tensor-model-parallel-size ({tp}): one must divide "
                        "the other (each rank holds whole key/value groups, or a group is replicated on "
                        "tensor-parallel-size / groups ranks)")


def _validate_activation(args: Namespace) -> None:
    chosen = [name for name, on in (("--swiglu", args.swiglu), ("--squared-relu", args.squared_relu),
                                    ("--openai-gelu", args.openai_gelu)) if on]
    if len(chosen) > 1:
        raise ArgsError(f"{' and '.join(chosen)} each choose the MLP activation; give one of them")


def _validate_t5(args: Namespace) -> None:
    """T5's lengths, sentinels and positions (Megatron's pretrain_t5.py needs both lengths; the
    learned position table serves the encoder and the decoder, each counting from 0)."""
    kind = args.position_embedding_type
    if kind not in T5_POSITION_EMBEDDINGS:
        raise ArgsError(f"--position-embedding-type {kind}: T5 takes learned_absolute (Megatron's default) or "
                        "relative (T5's relative attention buckets)")
    decoder = args.decoder_seq_length
    if decoder is None or decoder < 2:
        raise ArgsError(f"T5 needs --decoder-seq-length >= 2 (the decoder input and labels; Megatron uses 128 "
                        f"with --encoder-seq-length 512), got {decoder}")
    if kind == "learned_absolute" and args.max_position_embeddings < decoder:
        raise ArgsError(f"--max-position-embeddings ({args.max_position_embeddings}) must be >= "
                        f"--decoder-seq-length ({decoder}): the learned positions serve both stacks")
    from megatron.data.t5_dataset import t5_max_spans, t5_min_decoder_length

    if args.seq_length is None or args.seq_length < 3:
        raise ArgsError(f"T5 needs --encoder-seq-length (or --seq-length) >= 3 (its text, BOS and EOS), "
                        f"got {args.seq_length}")
    if not 0.0 < args.mask_prob < 1.0:
        raise ArgsError(f"--mask-prob must be in (0, 1), got {args.mask_prob}")
    sentinels, spans = args.vocab_extra_ids, t5_max_spans(args.mask_prob, args.seq_length)
    if not sentinels:
        raise ArgsError("T5 needs sentinel tokens for its masked spans: give --vocab-extra-ids (e.g. 100, "
                        "the <extra_id_i> tokens)")
    if sentinels < spans:
        raise ArgsError(f"--vocab-extra-ids {sentinels}: a T5 sample of --encoder-seq-length {args.seq_length} "
                        f"can have {spans} masked spans (--mask-prob {args.mask_prob}), one sentinel each; "
                        f"give --vocab-extra-ids >= {spans}")
    needed = t5_min_decoder_length(args.mask_prob, args.seq_length)
    if decoder < needed:
        raise ArgsError(f"--decoder-seq-length {decoder} is too short: a full sample of --encoder-seq-length "
                        f"{args.seq_length} masks about {needed - 2} tokens (--mask-prob {args.mask_prob}), and the "
                        f"decoder holds BOS, a sentinel per span and those tokens; give >= {needed} (1 + 2 x "
                        f"{spans} = {1 + 2 * spans} always fits; Megatron uses 128 with 512)")
    span = args.mean_noise_span_length
    if span is not None and span < 1:
        raise ArgsError(f"--mean-noise-span-length must be >= 1 (a span has at least one word), got {span}")
    for dest in ("relative_attention_num_buckets", "relative_attention_max_distance"):
        if getattr(args, dest) < 1:
            raise ArgsError(f"--{dest.replace('_', '-')} must be >= 1, got {getattr(args, dest)}")
    if args.pipeline_model_parallel_size > 1 and args.pipeline_model_parallel_split_rank is None:
        raise ArgsError(f"T5 with --pipeline-model-parallel-size {args.pipeline_model_parallel_size} needs "
                        "--pipeline-model-parallel-split-rank S (stages [0, S) run the encoder, the rest the decoder)")
    if args.decoder_num_layers not in (None, args.num_layers):
        raise ArgsError(f"--decoder-num-layers {args.decoder_num_layers} with --num-layers {args.num_layers}: "
                        "a decoder deeper or shallower than the encoder is not supported yet; remove it")


def _validate_bert(args: Namespace) -> None:
    """BERT's masking flags and its data (the masked-WordPiece dataset reads real sentence data)."""
    if not 0.0 < args.mask_prob < 1.0:
        raise ArgsError(f"--mask-prob must be in (0, 1), got {args.mask_prob}")
    if not 0.0 <= args.short_seq_prob <= 1.0:
        raise ArgsError(f"--short-seq-prob must be in [0, 1], got {args.short_seq_prob}")
    if args.mock_data:
        raise ArgsError("--mock-data: the BERT dataset has no mock data; give --data-path (a --split-sentences "
                        "dataset, PREFIX_text_sentence)")


def validate_model_architecture(args: Namespace) -> None:
    """The architecture rules above, after kv_channels and ffn_hidden_size are derived."""
    if is_t5(args):
        _validate_t5(args)
    if args.model_family == "BERT":
        _validate_bert(args)
    _validate_position_embedding(args)
    _validate_query_groups(args)
    _validate_activation(args)
    layer_spec_from_flag(args.spec)  # imported now: a bad --spec fails before any process group or data


def layer_spec_from_flag(spec: list[str] | None):
    """--spec MODULE NAME: getattr(import_module(MODULE), NAME), a ModuleSpec or a function of no
    arguments returning one (Megatron's --spec takes the object itself); None without the flag.
    MODULE is the user's own code, imported as Python imports any module they name."""
    if spec is None:
        return None
    import importlib

    from megatron.model.spec import ModuleSpec

    if len(spec) != 2:
        raise ArgsError(f"--spec takes two values, MODULE NAME (e.g. --spec my_specs parallel_block_spec), "
                        f"got {len(spec)}: {' '.join(spec) or '(none)'}")
    module_name, name = spec
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ArgsError(f"--spec {module_name} {name}: cannot import {module_name} ({error})") from None
    if not hasattr(module, name):
        raise ArgsError(f"--spec {module_name} {name}: {module_name} has no attribute {name}")
    value = getattr(module, name)
    if callable(value) and not isinstance(value, (ModuleSpec, type)):
        value = value()
    if not isinstance(value, ModuleSpec):
        raise ArgsError(f"--spec {module_name} {name}: expected a ModuleSpec (or a function returning one), "
                        f"got {type(value).__name__}")
    return value
