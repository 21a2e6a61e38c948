"""Our (legacy `torch`) checkpoints as a stream of whole tensors, and back, for tools/checkpoint.

The converter's exchange: a `Metadata` (the saved args, iteration, the tokenizer's true vocabulary
size when known) and then (name, tensor) pairs, one at a time, in the order of a TP = 1, PP = 1
GPTModel state dict (embedding, decoder.layers.0 ... L-1, final norm, output layer; a BertModel's:
embedding, encoder.layers.0 ... L-1, final norm, heads; a T5Model's: embedding, encoder.layers.0 ...
L-1, its norm, decoder.layers.0 ... L-1, its norm, lm_head.output_layer.bias, the two relative
position tables). Names are that
model's keys, layers numbered globally; tensors are whole (TP = 1) and the vocabulary rows keep the
source's padding (args.padded_vocab_size rows). With tied embeddings the last stage's copy of the
word embeddings (output_layer.weight at PP > 1) is not sent: it must equal the embedding. T5's
stages (encoder stages, then decoder stages, at args.pipeline_model_parallel_split_rank; their
copies of the embedding) are in megatron/convert/t5_stages.py.

Megatron-LM's own files share this layout and differ inside each file: a `Dialect` translates one
file's args, version check and model entry (megatron/convert/legacy.py: `--loader legacy`,
`--loader mcore`, `--saver mcore`); the reading and writing here is the same for all.

Memory: the reader holds one pipeline stage's TP files at a time (with virtual stages it reads them
once per model chunk, so the stream stays in layer order) and frees their shards as it merges them;
the writer holds one target stage's tensors until that stage is written.
"""

from __future__ import annotations

import argparse
import copy
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.training.checkpoint_manifest import manifest_path, verify_file, write_manifest
from megatron.training.checkpoint_safety import CheckpointError, load_file
from megatron.training.checkpointing import (
    find_checkpoint_rank_0, get_checkpoint_name, get_checkpoint_tracker_filename, read_metadata,
)
from megatron.convert.layout_rules import (
    is_vocab_tensor, layer_index, padded_vocab_size, query_groups, renumber, tensor_layout,
)
from megatron.convert.expert_files import ExpertGrid, is_expert
from megatron.convert.t5_stages import T5Stages, is_t5, split_problems
from megatron.convert.vocab_size import true_vocab_size_of  # noqa: F401  (re-exported for the loaders)
from megatron.core.atomic_io import Checksum, atomic_write
from megatron.convert.streaming_save import StreamingFile
from megatron.core.tensor_parallel.layout import merge_shards, shard_for_rank

CHECKPOINT_VERSION = 3.0  # fused QKV rows [np, 3, hn] (grouped by query group), as checkpointing.py writes
TIED_COPY = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


@dataclass
class Metadata:
    """What the loader tells the saver before the tensors."""

    args: argparse.Namespace  # the source checkpoint's args
    iteration: int
    release: bool
    true_vocab_size: Optional[int]  # the tokenizer's vocabulary, None when unknown
    # LoRA loaders (tools/checkpoint/loader_lora.py, loader_peft.py): the adapters beside the merged tensors,
    # a megatron.convert.lora.Adapters (savers other than peft / lora ignore it)
    lora: Any = None


# ----------------------------------------------------------------------------- dialects


class Dialect:
    """How one family of checkpoints in this directory layout differs from ours.

    The reader and writer below handle the layout (tracker, iter_*/mp_rank_* files, TP merge and
    split, layer renumbering, virtual stages); a dialect only translates one file's content to
    our terms and back: its args (to ours), its version check, and its model entry (to our key
    names, each TP shard in our row order) when reading; our model entry and args to its own
    when writing. This class is our own format (megatron/convert/legacy.py has Megatron-LM's).
    """

    def args(self, state: Dict[str, Any], path: str) -> argparse.Namespace:
        args = state.get("args")
        if args is None:
            raise CheckpointError(f"{path} has no saved args: the converter needs them for the tensor layouts")
        return args

    def check_version(self, state: Dict[str, Any], path: str) -> None:
        version = state.get("checkpoint_version", 0)
        if version < 2.0:
            raise CheckpointError(f"{path} has checkpoint_version {version}: its QKV rows are not in the "
                                  "[np, 3, hn] order; convert it with --loader legacy")

    def model(self, state: Dict[str, Any], key: str, path: str, source: "Source") -> Dict[str, Any]:
        """The model entry `key` of one file, under our names (local layer numbers), in our row order."""
        model = model_entry(state, key, path)
        if "language_model" in model:
            raise CheckpointError(f"{path} is in Megatron-LM's classic naming (model.language_model.*): "
                                  "use --loader legacy")
        fused = next((name for name in model if name.endswith(".layer_norm_weight")), None)
        if fused is not None:
            raise CheckpointError(f"{path} is in megatron-core's Transformer Engine naming ({fused}): "
                                  "use --loader mcore")
        return model

    def to_file(self, model: Dict[str, Any], add: Callable[[torch.Tensor], Any]) -> Dict[str, Any]:
        """Our model entry of one target file (its tensors already written: placeholders) in this
        dialect's names; a tensor the dialect adds must be written with `add` (it returns the placeholder)."""
        return model

    def file_args(self, args: argparse.Namespace) -> argparse.Namespace:
        """Our target args as this dialect's files store them."""
        return args


OURS = Dialect()


def model_entry(state: Dict[str, Any], key: str, path: str) -> Dict[str, Any]:
    if key not in state:
        raise CheckpointError(f"{path} has no '{key}' entry (its keys: {', '.join(sorted(map(str, state)))})")
    model = state[key]
    if not isinstance(model, dict):
        raise CheckpointError(f"{path}: its '{key}' entry is a {type(model).__name__}, not a state dict")
    return model


# ----------------------------------------------------------------------------- reading


@dataclass
class Source:
    load_dir: str
    args: argparse.Namespace
    iteration: int
    release: bool
    dialect: Dialect = field(default=OURS)
    sharded: bool = False  # a torch_dist checkpoint: its tensors are global already

    @property
    def tp(self) -> int:
        return int(getattr(self.args, "tensor_model_parallel_size", 1) or 1)

    @property
    def pp(self) -> int:
        return int(getattr(self.args, "pipeline_model_parallel_size", 1) or 1)

    @property
    def vp(self) -> int:
        return int(getattr(self.args, "virtual_pipeline_model_parallel_size", None) or 1)

    @property
    def experts(self) -> ExpertGrid:
        return ExpertGrid.of(self.args)


def open_source(load_dir: str, dialect: Dialect = OURS) -> Source:
    """The checkpoint the tracker of load_dir names, and its args (from the rank-0 file, in our terms)."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load-dir {load_dir} is not a directory")
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"--load-dir {load_dir} holds no checkpoint (no {os.path.basename(tracker)})")
    iteration, release = read_metadata(tracker)
    first = find_checkpoint_rank_0(load_dir, iteration, release)
    base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    if first is None and os.path.isfile(os.path.join(base_dir, "metadata.json")):
        if dialect is not OURS:
            raise CheckpointError(f"{base_dir} is a torch_dist checkpoint (metadata.json): read it with --loader "
                                  "megatron")
        from megatron.dist_checkpointing import open_whole

        args, _ = open_whole(base_dir)  # the global tensors are read by read_tensors
        return Source(load_dir, args, iteration, release, dialect, sharded=True)
    if first is None:
        raise CheckpointError(f"{load_dir}: the tracker names {'release' if release else f'iteration {iteration}'} "
                              "but no mp_rank_00* file of it exists")
    args = dialect.args(_read(first, load_dir, iteration, release, dialect), first)
    return Source(load_dir, args, iteration, release, dialect)


def _read(path: str, load_dir: str, iteration: int, release: bool, dialect: Dialect) -> Dict[str, Any]:
    base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    verify_file(path, base_dir)
    try:
        state = load_file(path, mmap=True)  # tensors read as they are merged, not the whole file up front
    except RuntimeError as error:
        if "mmap" not in str(error):  # a pre-1.6 (not zip) file cannot be mapped: it is read whole
            raise
        state = load_file(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {path} does not hold a dict")
    dialect.check_version(state, path)
    return state


def _file_path(source: Source, pp_rank: int, tp_rank: int, ep_rank: int) -> str:
    return get_checkpoint_name(source.load_dir, source.iteration, source.release, pipeline_parallel=source.pp > 1,
                               tensor_rank=tp_rank, pipeline_rank=pp_rank, expert_parallel=source.experts.ep > 1,
                               expert_rank=ep_rank)


def _stage_models(source: Source, pp_rank: int,
                  chunk: int) -> Tuple[List[Dict[str, Any]], List[List[Dict[str, Any]]]]:
    """The model state dicts (chunk `chunk`) of stage pp_rank (the rest, optimizer, is dropped): one
    per TP rank for the dense tensors, and per EP rank one per expert-TP rank for its experts.

    Without expert parallelism these are the TP files. With it, the files are named by (TP rank,
    EP rank), and which pairs exist is the ranks' layout: every pair when ETP = TP (ours, and
    Megatron-LM's), else those some rank has (Megatron-LM: EP rank (r // ETP) % EP of the TP rank
    r % TP). Dense shard t comes from the first file of TP rank t; EP rank e's expert shard s from
    the first file (t, e) with t % ETP = s (TP ranks with one expert-TP rank hold copies)."""
    key = "model" if source.vp == 1 else f"model{chunk}"
    grid = source.experts
    pairs = [(t, e) for e in range(grid.ep) for t in range(source.tp)]
    present = [(t, e) for t, e in pairs if grid.ep == 1 or os.path.isfile(_file_path(source, pp_rank, t, e))]
    expert_ranks = range(grid.ep if grid.experts else 0)
    dense_from, experts_from = {}, {}
    for t in range(source.tp):
        dense_from[t] = next(((t, e) for tt, e in present if tt == t), (t, 0))  # absent: _read names the file
    for e in expert_ranks:
        for shard in range(grid.etp):
            pair = next(((t, ee) for t, ee in present if ee == e and t % grid.etp == shard), None)
            if pair is None:
                raise CheckpointError(f"stage {pp_rank}: no file holds EP rank {e}'s experts (expert-TP rank "
                                      f"{shard}): {_file_path(source, pp_rank, shard, e)} is missing")
            experts_from[e, shard] = pair
    models: Dict[Tuple[int, int], Dict[str, Any]] = {}
    for pair in [*dense_from.values(), *experts_from.values()]:
        if pair not in models:
            path = _file_path(source, pp_rank, *pair)
            state = _read(path, source.load_dir, source.iteration, source.release, source.dialect)
            models[pair] = source.dialect.model(state, key, path, source)

    def which(pair: Tuple[int, int]) -> str:
        return f"TP rank {pair[0]}" + (f", EP rank {pair[1]}" if grid.ep > 1 else "")

    first_pair, first = next(iter(models.items()))
    for pair, model in models.items():
        if set(model) != set(first):
            raise CheckpointError(f"stage {pp_rank}: the file of {which(pair)} has keys "
                                  f"{sorted(set(model) ^ set(first))[:4]} that the file of {which(first_pair)} "
                                  "does not (or the reverse)")
    dense = [models[dense_from[t]] for t in range(source.tp)]
    experts = [[models[experts_from[e, shard]] for shard in range(grid.etp)] for e in expert_ranks]
    return dense, experts


def _carries_data(value: Any) -> bool:
    return torch.is_tensor(value) and value.numel() > 0


def read_tensors(source: Source) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every whole tensor of the source, in canonical order (see the module docstring)."""
    if source.sharded:
        from megatron.dist_checkpointing import DCP_METADATA, read_dcp_metadata, whole_model_tensors

        base_dir = get_checkpoint_name(source.load_dir, source.iteration, source.release, return_base_dir=True)
        # open_source checked every file against the manifest
        yield from whole_model_tensors(base_dir, read_dcp_metadata(os.path.join(base_dir, DCP_METADATA)))
        return
    split = getattr(source.args, "pipeline_model_parallel_split_rank", None)
    if source.pp > 1 and (is_t5(source.args) or split is not None):  # a split rank: encoder-decoder stages
        yield from _t5_stage_tensors(source)
        return
    args = source.args
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    per_chunk = int(args.num_layers) // (source.pp * source.vp)
    embedding = None  # kept when tied, to check the last stage's copy against it
    for chunk in range(source.vp):  # chunk v of stage p is model chunk v * pp + p
        for pp_rank in range(source.pp):
            offset = (chunk * source.pp + pp_rank) * per_chunk
            for name, whole in _stage_tensors(source, pp_rank, chunk):
                if tied and name == TIED_COPY:  # the last stage's copy of the tied embedding: not sent
                    _check_tied_copy(embedding, whole)
                    continue
                if tied and name == EMBEDDING:
                    embedding = whole
                yield renumber(name, offset), whole


def _stage_tensors(source: Source, pp_rank: int, chunk: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """(local layer name, whole tensor) of model chunk `chunk` of stage pp_rank, its TP shards merged;
    experts numbered globally, each run of expert keys sent for EP rank 0, 1, ... in turn."""
    grid = source.experts
    models, expert_models = _stage_models(source, pp_rank, chunk)  # [tp], [ep][etp]
    held: List[str] = []  # a run of expert keys (local names), sent when it ends

    def experts() -> Iterator[Tuple[str, torch.Tensor]]:
        for e in range(grid.ep):
            for name in held:
                shards = [m.pop(name) for m in expert_models[e]]
                yield grid.global_name(name, e), _merged(name, shards, source.args, grid.etp, pp_rank)
        held.clear()

    for name in list(models[0]):
        if is_expert(name):
            held.append(name)
            continue
        yield from experts()
        shards = [m.pop(name) for m in models]  # freed once merged: the stage's memory shrinks
        for other in expert_models:  # the dense tensors repeat in every EP rank's files
            for m in other:
                m.pop(name, None)
        if name.endswith("_extra_state"):
            if any(_carries_data(shard) for shard in shards):
                raise CheckpointError(f"{name} carries data (FP8 state?) the converter cannot place")
            continue
        whole = _merged(name, shards, source.args, source.tp, pp_rank)
        del shards
        yield name, whole
    yield from experts()
    del models, expert_models


def _t5_stage_tensors(source: Source) -> Iterator[Tuple[str, torch.Tensor]]:
    """A T5 checkpoint's stages (megatron/convert/t5_stages.py) as the stream of a PP = 1 T5Model:
    layers renumbered per stack, the copies (stage 0's embedding, a stack's table) checked and dropped, the small
    relative position tables held back to the end (where a PP = 1 state dict has them)."""
    split = getattr(source.args, "pipeline_model_parallel_split_rank", None)
    problems = split_problems(source.args, source.pp, split, source.vp)
    if problems:
        raise CheckpointError(f"{source.load_dir}: a T5 checkpoint at pipeline-parallel size {source.pp} with "
                              f"pipeline_model_parallel_split_rank {split}: " + "; ".join(problems))
    stages = T5Stages.of(source.args)
    firsts: Dict[str, torch.Tensor] = {}  # stage 0's embedding.*, a stack's first table: what copies equal
    tables = []
    for pp_rank in range(source.pp):
        for name, whole in _stage_tensors(source, pp_rank, 0):
            original = stages.is_copy(pp_rank, name)
            if original is not None:
                _check_tied_copy(firsts.get(original), whole, f"stage {pp_rank}'s copy of {original}")
                continue
            if stages.is_original(pp_rank, name):
                firsts[name] = whole
            name = stages.global_name(pp_rank, name)
            if "_relative_pos_emb." in name:
                tables.append((name, whole))
            else:
                yield name, whole
    yield from tables


def _merged(name: str, shards: List[torch.Tensor], args: argparse.Namespace, tp: int, stage: int) -> torch.Tensor:
    layouts = [tensor_layout(name, args, tp, r) for r in range(tp)]
    try:
        return merge_shards(shards, layouts)
    except ValueError as error:
        raise CheckpointError(f"cannot merge the TP shards of {name} (stage {stage}): {error}") from error


def _check_tied_copy(embedding: Optional[torch.Tensor], copy_: torch.Tensor,
                     what: str = "the last stage's copy of the tied word embeddings") -> None:
    # Training keeps the two equal (their gradients are summed over the embedding group); a
    # difference means the source was not a consistent tied model, and the embedding wins.
    if embedding is not None and not torch.equal(embedding, copy_):
        difference = (embedding - copy_).abs().max().item() if embedding.shape == copy_.shape else float("inf")
        print(f"WARNING: {what} differs from the first stage's "
              f"(max difference {difference:.3g}); the first stage's is converted", flush=True)


# ----------------------------------------------------------------------------- writing


def check_target(args: argparse.Namespace, tp: int, pp: int, vp: int = 1, split: Optional[int] = None,
                 ep: int = 1, etp: Optional[int] = None) -> None:
    """Refuse target sizes the model's shape does not split into (CheckpointError naming the flag);
    `split`: T5's split rank (megatron/convert/t5_stages.py), where each stack splits over its stages;
    ep, etp: the expert-parallel sizes (megatron/convert/expert_files.py; etp None: tp)."""
    heads, groups = int(args.num_attention_heads), query_groups(args)
    ffn = int(getattr(args, "ffn_hidden_size", None) or 4 * args.hidden_size)
    problems = []
    if tp < 1 or pp < 1 or vp < 1:
        problems.append("sizes must be >= 1")
    else:
        if heads % tp:
            problems.append(f"{heads} attention heads do not split over {tp} TP ranks")
        elif groups % tp and tp % groups:
            problems.append(f"{groups} query groups neither split over nor divide {tp} TP ranks")
        if ffn % tp:
            problems.append(f"ffn hidden size {ffn} does not split over {tp} TP ranks")
        if getattr(args, "is_hybrid_model", False):
            from megatron.convert.layout_rules import mamba_dims

            dims = mamba_dims(args, 1)
            if dims.nheads % tp or dims.ngroups % tp:
                problems.append(f"{dims.nheads} Mamba heads and {dims.ngroups} groups do not split over {tp} TP ranks")
        if is_t5(args):
            problems += split_problems(args, pp, split, vp)
        elif split is not None:
            problems.append("a pipeline split rank is for T5 (encoder stages, then decoder stages)")
        elif int(args.num_layers) % (pp * vp):
            problems.append(f"{args.num_layers} layers do not split over {pp} pipeline stages"
                            + (f" x {vp} virtual stages" if vp > 1 else ""))
        if vp > 1 and pp == 1:
            problems.append("virtual stages need a pipeline-parallel size > 1")
        moe_ffn = int(getattr(args, "moe_ffn_hidden_size", None) or ffn)
        problems += ExpertGrid(int(getattr(args, "num_experts", None) or 0), ep, etp or tp, tp).problems(moe_ffn)
    if problems:
        raise CheckpointError(f"--target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp}"
                              + (f" --target-expert-parallel-size {ep}" if ep != 1 else "")
                              + (f" --target-expert-tensor-parallel-size {etp}" if etp not in (None, tp) else "")
                              + (f" --target-pipeline-model-parallel-split-rank {split}" if split is not None else "")
                              + (f" ({vp} virtual stages)" if vp > 1 else "") + ": " + "; ".join(problems))


def target_args(meta: Metadata, tp: int, pp: int, vp: int = 1, split: Optional[int] = None,
                ep: int = 1, etp: Optional[int] = None) -> argparse.Namespace:
    """The source args at the target sizes (vp model chunks per stage; T5: split rank `split`, which
    training then reads as --pipeline-model-parallel-split-rank; ep, etp the expert-parallel sizes),
    with the target's padded vocabulary."""
    args = copy.deepcopy(meta.args)
    if is_t5(args):
        args.pipeline_model_parallel_split_rank = split if pp > 1 else None
    args.padded_vocab_size = target_vocab_size(meta, tp)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
    args.num_layers_per_virtual_pipeline_stage = int(args.num_layers) // (pp * vp) if vp > 1 else None
    args.num_virtual_stages_per_pipeline_rank = None
    if tp == 1:
        args.sequence_parallel = False
    data_parallel = int(getattr(args, "data_parallel_size", 1) or 1)
    if getattr(args, "num_experts", None):
        etp = etp or tp
        args.expert_model_parallel_size, args.expert_tensor_parallel_size = ep, etp
        if tp > 1:
            args.sequence_parallel = True  # Megatron: MoE with TP > 1 requires sequence parallelism
        while (tp * data_parallel) % (etp * ep):  # the expert grid (ETP x EP x expert-DP) fills the ranks
            data_parallel += 1
        args.data_parallel_size = data_parallel
    args.world_size = tp * pp * data_parallel
    return args


def target_vocab_size(meta: Metadata, tp: int) -> int:
    """Megatron's padding of the true vocabulary for the target TP; without the true size, the
    source's padded size when it splits evenly (else CheckpointError)."""
    divisible_by = int(getattr(meta.args, "make_vocab_size_divisible_by", 128))
    source = int(meta.args.padded_vocab_size)
    if meta.true_vocab_size is not None:
        if meta.true_vocab_size > source:
            raise CheckpointError(f"--true-vocab-size {meta.true_vocab_size} exceeds the checkpoint's "
                                  f"padded vocabulary of {source} rows")
        return padded_vocab_size(meta.true_vocab_size, divisible_by, tp)
    if source % (divisible_by * tp):
        raise CheckpointError(f"the checkpoint's padded vocabulary ({source}) does not split over "
                              f"{tp} TP ranks in multiples of --make-vocab-size-divisible-by {divisible_by}; "
                              "pass --true-vocab-size (the tokenizer's size) to pad it again")
    return source


def resize_vocab(tensor: torch.Tensor, meta: Metadata, rows: int) -> torch.Tensor:
    """Vocabulary rows from the source padding to `rows`: the true rows kept, padding rows zero."""
    if tensor.shape[0] == rows:
        return tensor
    keep = meta.true_vocab_size if meta.true_vocab_size is not None else min(rows, tensor.shape[0])
    if rows < tensor.shape[0] and not tensor[keep:rows].any():  # fewer rows, the kept padding zero already:
        return tensor[:rows]  # a view (no copy of the largest tensor)
    out = tensor.new_zeros((rows, *tensor.shape[1:]))
    out[:keep] = tensor[:keep]
    return out


class StageWriter:
    """Writes the target checkpoint's TP files as the whole tensors arrive, one tensor at a time.

    Model chunk c (of pp * vp) holds layers [c * per_chunk, (c + 1) * per_chunk) and lives on stage
    c % pp as its virtual chunk c // pp (the interleaved schedule's assignment). Each tensor is cut
    into its TP shards and each shard written at once into its rank's file (streaming_save); a file
    is finished (its pickle written, then renamed into place) when the stream has moved past its
    stage's last chunk. So the writer holds one tensor's shards, whatever the target layout.
    A T5Model (split rank `split`) goes by megatron/convert/t5_stages.py instead: `t5`.
    """

    def __init__(self, save_dir: str, meta: Metadata, tp: int, pp: int, vp: int = 1,
                 dialect: Dialect = OURS, split: Optional[int] = None, ep: int = 1, etp: Optional[int] = None) -> None:
        self.save_dir, self.meta, self.tp, self.pp, self.vp, self.dialect = save_dir, meta, tp, pp, vp, dialect
        self.args = target_args(meta, tp, pp, vp, split, ep, etp)
        self.experts = ExpertGrid.of(self.args)
        self.ep = self.experts.ep
        self.t5 = T5Stages.of(self.args) if is_t5(self.args) else None
        self.file_args = dialect.file_args(self.args)
        self.per_chunk = int(self.args.num_layers) // (pp * vp)
        self.files: Dict[str, Checksum] = {}
        self.base_dir = get_checkpoint_name(save_dir, meta.iteration, meta.release, return_base_dir=True)
        self._open: Dict[Tuple[int, int, int], StreamingFile] = {}  # (stage, rank, ep rank) -> its file
        self._models: Dict[Tuple[int, int, int], List[Dict[str, Any]]] = {}  # -> per chunk: name -> placeholder
        self.finished = 0  # stages 0 .. finished-1 are on disk

    def chunk_of(self, name: str) -> int:
        """The global model chunk (0 .. pp * vp - 1) holding `name`."""
        index = layer_index(name)
        if index is not None:
            return index // self.per_chunk
        return 0 if name.startswith("embedding.") else self.pp * self.vp - 1

    def local_name(self, name: str, chunk: int) -> str:
        return renumber(name, -chunk * self.per_chunk) if layer_index(name) is not None else name

    def last_chunk(self, stage: int) -> int:
        return (self.vp - 1) * self.pp + stage

    def path(self, stage: int, rank: int, ep_rank: int = 0) -> str:
        return get_checkpoint_name(self.save_dir, self.meta.iteration, self.meta.release,
                                   pipeline_parallel=self.pp > 1, tensor_rank=rank, pipeline_rank=stage,
                                   expert_parallel=self.ep > 1, expert_rank=ep_rank)

    def add(self, chunk: int, name: str, tensor: torch.Tensor) -> None:
        """Write the TP shards of whole tensor `name` (its local layer name in model chunk `chunk`;
        an expert's global name) into every file that holds it (megatron/convert/expert_files.py)."""
        stage, virtual = chunk % self.pp, chunk // self.pp
        if is_expert(name):
            ep_rank, name = self.experts.place(name)
            etp = self.experts.etp
            targets = [(rank, ep_rank, etp, rank % etp) for rank in range(self.tp)]
        else:
            targets = [(rank, e, self.tp, rank) for rank in range(self.tp) for e in range(self.ep)]
        for rank, ep_rank, size, shard_rank in targets:
            key = (stage, rank, ep_rank)
            if key not in self._open:
                path = self.path(*key)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self._open[key] = StreamingFile(path)
                self._models[key] = [{} for _ in range(self.vp)]
            shard = shard_for_rank(tensor, tensor_layout(name, self.args, size, shard_rank), size, shard_rank)
            self._models[key][virtual][name] = self._open[key].add(shard)

    def finish_stage(self, stage: int) -> None:
        """The pickles of `stage`'s TP (x EP) files: each is complete and in place after this."""
        for key in [(stage, rank, e) for rank in range(self.tp) for e in range(self.ep)]:
            if key not in self._open:
                raise CheckpointError(f"the stream held nothing for target stage {stage}")
            state = {"args": self.file_args, "checkpoint_version": CHECKPOINT_VERSION,
                     "iteration": self.meta.iteration, "num_floating_point_operations_so_far": 0.0}
            chunks = self._models.pop(key)
            for v, model in enumerate(chunks):
                state["model" if self.vp == 1 else f"model{v}"] = self.dialect.to_file(model, self._open[key].add)
            self.files[os.path.relpath(self.path(*key), self.base_dir).replace(os.sep, "/")] = \
                self._open.pop(key).finish(state)
        self.finished = stage + 1

    def abandon(self) -> None:
        for f in self._open.values():
            f.abandon()
        self._open.clear()

    def finish(self) -> None:
        """The manifest, then the tracker (as checkpointing.save_checkpoint orders them)."""
        write_manifest(self.base_dir, self.meta.iteration, self.files)
        text = "release" if self.meta.release else str(self.meta.iteration)
        atomic_write(get_checkpoint_tracker_filename(self.save_dir), lambda f: f.write(text.encode("ascii")))


def write_tensors(save_dir: str, meta: Metadata, tensors: Iterator[Tuple[str, torch.Tensor]],
                  tp: int, pp: int, vp: int = 1, dialect: Dialect = OURS, split: Optional[int] = None,
                  ep: int = 1, etp: Optional[int] = None) -> None:
    """Write the stream as a checkpoint at TP=tp, PP=pp (vp virtual stages; T5: split rank `split`;
    an MoE model at EP=ep, ETP=etp, None: tp) under save_dir (new).

    The stream must come in canonical order (a stage's files are finished once the stream moves
    past its last chunk) and hold every layer with the same keys; CheckpointError otherwise.
    """
    writer = StageWriter(save_dir, meta, tp, pp, vp, dialect, split, ep, etp)
    try:
        (_write_t5_stream if writer.t5 is not None else _write_stream)(writer, meta, tensors)
    except BaseException:
        writer.abandon()
        raise
    writer.finish()


def _write_stream(writer: StageWriter, meta: Metadata, tensors: Iterator[Tuple[str, torch.Tensor]]) -> None:
    pp, vp = writer.pp, writer.vp
    rows = writer.args.padded_vocab_size
    tied_copy = pp > 1 and not getattr(meta.args, "untie_embeddings_and_output_weights", False)
    chunk, embedding_sent = 0, False
    seen = _StreamCheck(int(meta.args.num_layers), _layer_kinds(meta.args))
    for name, tensor in tensors:
        seen.add(name)
        if is_vocab_tensor(name):
            tensor = resize_vocab(tensor, meta, rows)
        target = writer.chunk_of(name)
        if target < chunk or target % pp < writer.finished:
            where = (f"stage {target % pp} was written" if target % pp < writer.finished
                     else f"chunk {chunk}'s tensors")
            raise CheckpointError(f"{name} arrived after target {where}: the loader must send tensors in layer order")
        chunk = target
        while writer.finished < pp and writer.last_chunk(writer.finished) < chunk:  # the stream went past it
            writer.finish_stage(writer.finished)
        writer.add(target, writer.local_name(name, target), tensor)
        if tied_copy and name == EMBEDDING:  # the last chunk keeps its own copy of the tied weight
            writer.add(pp * vp - 1, TIED_COPY, tensor)
            embedding_sent = True
        del tensor
    seen.check()
    if tied_copy and not embedding_sent:
        raise CheckpointError("the source sent no word embeddings")
    for stage in range(writer.finished, pp):
        writer.finish_stage(stage)


def _write_t5_stream(writer: StageWriter, meta: Metadata, tensors: Iterator[Tuple[str, torch.Tensor]]) -> None:
    """The stream of a T5Model on the stages of writer.t5, each tensor with its copies (the first
    decoder stage's embedding, the last stage's LM head weight). The relative position tables come
    after the decoder (a PP = 1 state dict's order), so every stage's file is finished at the end:
    it holds only placeholders till then, its shards are on disk already."""
    rows = writer.args.padded_vocab_size
    seen = _StreamCheck(int(meta.args.num_layers))
    for name, tensor in tensors:
        seen.add(name)
        if is_vocab_tensor(name):
            tensor = resize_vocab(tensor, meta, rows)
        for stage, local in writer.t5.placements(name):
            writer.add(stage, local, tensor)
        del tensor
    seen.check()
    if EMBEDDING not in seen.names:
        raise CheckpointError("the source sent no word embeddings")
    for stage in range(writer.pp):
        writer.finish_stage(stage)


def _layer_kinds(args: argparse.Namespace) -> Optional[List[Any]]:
    """Each layer's kind (0-based): a hybrid model's pattern symbol (M, *, -, E: the MoE layers), else
    whether it is an MoE layer (--moe-layer-freq, Megatron's pattern); None: a dense GPT."""
    if getattr(args, "is_hybrid_model", False):
        from megatron.model.mamba.hybrid import allocate_layers

        return list(allocate_layers(int(args.num_layers), getattr(args, "hybrid_attention_ratio", 0.0) or 0.0,
                                    getattr(args, "hybrid_mlp_ratio", 0.0) or 0.0,
                                    getattr(args, "hybrid_override_pattern", None)))
    if not getattr(args, "num_experts", None):
        return None
    freq = getattr(args, "moe_layer_freq", 1) or 1
    layers = int(args.num_layers)
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(layers)]
    return [bool(v) for v in freq]


class _StreamCheck:
    """Every layer 0..L-1 arrives with layer 0's keys, and no name twice; with layers of several
    kinds (`kinds`: per layer, from the args: MoE or dense, a hybrid model's pattern symbols) each
    layer has its kind's keys (an MoE layer a router, a dense one none), the same as the first
    layer of that kind."""

    def __init__(self, num_layers: int, kinds: Optional[List[Any]] = None) -> None:
        self.num_layers, self.names, self.layers, self.kinds = num_layers, set(), {}, kinds

    def add(self, name: str) -> None:
        if name in self.names:
            raise CheckpointError(f"the loader sent {name} twice")
        self.names.add(name)
        index = layer_index(name)
        if index is not None:
            self.layers.setdefault(index, set()).add(renumber(name, -index))

    def check(self) -> None:
        if sorted(self.layers) != list(range(self.num_layers)):
            raise CheckpointError(f"the loader sent layers {sorted(self.layers)}, not 0..{self.num_layers - 1}")
        firsts: Dict[Any, Tuple[int, set]] = {}
        hybrid = self.kinds is not None and any(isinstance(k, str) for k in self.kinds)
        for index, keys in sorted(self.layers.items()):
            kind: Any = False
            if self.kinds is not None:
                kind = self.kinds[index] if index < len(self.kinds) else False
                moe = kind is True or kind == "E"
                routed = any(".mlp.router." in key for key in keys)
                if routed != moe:
                    source = f"the hybrid pattern's {kind!r}" if hybrid else "the args' moe_layer_freq"
                    raise CheckpointError(f"layer {index} is {'an MoE' if routed else 'a dense'} layer, but "
                                          f"{source} makes it {'an MoE' if moe else 'a dense'} one")
            first_index, first = firsts.setdefault(kind, (index, keys))
            if keys != first:
                raise CheckpointError(f"layer {index} has keys {sorted(keys ^ first)} that layer {first_index} "
                                      "does not (or the reverse)")
