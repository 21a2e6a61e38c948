"""`--ckpt-format torch_dist`: sharded checkpoints that every rank writes in parallel with PyTorch
Distributed Checkpoint (DCP) and that load at any TP / PP / DP / virtual-stage layout.

    <save>/
      latest_checkpointed_iteration.txt   the same tracker as the torch format (written last)
      iter_0000010/
        metadata.json                     {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                           "common_backend": "torch", "common_backend_version": 1}
                                          (Megatron-LM's file, exactly its four keys)
        common.pt                         torch.save'd dict of what is not sharded (below), rank 0
        .metadata                         DCP's index: every tensor's global shape, dtype, and the
                                          boxes (offsets, sizes) it was written in, with the file
                                          and byte range of each
        __R_0.distcp                      rank R's pieces (DCP's FileSystemWriter, one file per rank)
        checksums.json                    size and sha256 of every file above (checkpoint_manifest)

What is saved, as GLOBAL tensors named as a TP = 1, PP = 1 GPTModel's state dict (layers numbered
globally, so the pipeline stage and the virtual chunk that held a layer do not matter):

    key                                           content
    <model key>                                   the weight (its dtype), e.g. decoder.layers.3.mlp.linear_fc1.weight
    optimizer.state.<state>.<model key>           Adam's exp_avg / exp_avg_sq (SGD: momentum_buffer), fp32
    optimizer.state.fp32_param.<model key>        the fp32 main copy, with --fp16 / --bf16 only
    rng_state.tp{t}_pp{p}_dp{d}                   this rank's RNG states (checkpoint_rng's entry), bytes

How a rank's piece is described. A rank's local tensor is the rows (or columns) of the global one
that megatron/core/tensor_parallel/layout.partition_indices names; they are cut into maximal runs
of consecutive global indices along the partition dim and each run is one box (DCP chunk):

    layout                      boxes per rank
    replicated                  one box, the whole tensor (every replica describes the same box)
    contiguous (stride 1)       one box
    SwiGLU fc1 (stride 2)       two boxes: its gate rows and its up rows, at their global rows
    QKV rows, t | ng            one box (ng / t whole groups)
    QKV rows, t = r ng          two boxes: its query heads, and its group's K and V rows (the same
                                box on the r ranks that replicate them)

Experts (MoE layers) are named globally: local expert i of expert-parallel rank r (E/EP experts
per rank) is saved as decoder.layers.N.mlp.experts.local_experts.{r E/EP + i}.*, and its slice
over the expert tensor-parallel group is described as above with ETP's size and rank (never
TP's), so the experts' global tensors are the EP = 1, ETP = 1 ones and load at any EP / ETP.

So the global tensors keep exactly the TP = 1 shapes (no [2, ffn, h] view is needed) and a
box that several ranks hold (DP replicas, replicated K/V rows, norms) is written once: DCP
deduplicates write items with the same key and offsets. The distributed optimizer's state is
described where it lives: a data-parallel rank owns a flat range [a, b) of each parameter's
local tensor; that range is cut into row-major boxes (a partial first row, whole rows, a partial
last row, recursively) and each is mapped to the global tensor as above. Nothing is gathered
over DP; a plain optimizer reads the same keys whole. The last pipeline stage's copy of tied
word embeddings is not written (the first stage's is the same tensor) and is read from
embedding.word_embeddings.weight.

common.pt: args, checkpoint_version 3.0, iteration, opt_param_scheduler, optimizer (kind,
step, grad_scaler, param_groups of rank 0 for information), num_floating_point_operations_so_far,
and `content` (who wrote it: layout version, the TP / PP / DP / VPP / EP / ETP sizes, distributed
optimizer, what was saved). It is read with checkpoint_safety.load_file; DCP's .metadata is a pickle that
torch reads with plain pickle.load, so it is read here with an unpickler that builds only DCP's
metadata classes, torch dtypes / sizes and paths (anything else is refused by name); the
.distcp pieces are read by DCP with torch.load(weights_only=True); the RNG bytes with the
allow-list of checkpoint_safety.

Loading reads, at the CURRENT layout, the boxes of this rank's tensors with DCP (its
FileSystemReader and a load planner that intersects them with the saved boxes): no conversion
step. The RNG states load only when the TP / PP / DP / EP / ETP sizes equal the saved ones (else a
warning and the fresh RNG, as Megatron's rng ShardedObjects). The padded vocabulary must match.

Saving: every rank plans (DCP's planner: the collective that dedups and validates the boxes),
then writes its file into <save>/.iter_XXXXXXX.partial/; once every rank reported its files
(a collective), rank 0 writes .metadata, metadata.json, common.pt and the manifest there, renames
the folder to iter_XXXXXXX and then writes the tracker. With --async-save the pieces are first
copied (staged) and the writes run in a background thread while training continues; the
collective that checks that every rank finished, and the finalisation, run at a later iteration
(maybe_finalize_async_save) or at exit (finalize_async_save(blocking=True)). A killed save leaves
only the .partial folder, which the next save removes; the tracker still names the previous
checkpoint.

Modules: common (names, constants, rank helpers), layout (each rank's boxes of the model's and the
optimizer's tensors), dcp_io (DCP planners, the safe .metadata reader, format detection), save
(synchronous and --async-save, finalisation), load (at the current layout; whole tensors for the
converter; the bench helper).
"""

from megatron.dist_checkpointing.common import (  # noqa: F401
    FORMAT,
    HOLD_ENV,
    DCP_METADATA,
    METADATA_JSON,
    COMMON_FILE,
    iteration_dir,
    partial_dir,
)
from megatron.dist_checkpointing.layout import (  # noqa: F401
    GlobalTensor,
    TensorLayout,
    flat_boxes,
    index_runs,
    model_layouts,
    optimizer_entries,
    split_runs,
)
from megatron.dist_checkpointing.dcp_io import (  # noqa: F401
    is_dist_checkpoint,
    read_dcp_metadata,
    sharded_backend,
)
from megatron.dist_checkpointing.save import (  # noqa: F401
    async_save_pending,
    finalize_async_save,
    abandon_async_saves,
    maybe_finalize_async_save,
    save_checkpoint,
)
from megatron.dist_checkpointing.load import (  # noqa: F401
    open_whole,
    whole_model_tensors,
    load_args,
    load_checkpoint,
    read_common,
)

__all__ = [
    "COMMON_FILE",
    "DCP_METADATA",
    "FORMAT",
    "GlobalTensor",
    "HOLD_ENV",
    "METADATA_JSON",
    "TensorLayout",
    "abandon_async_saves",
    "async_save_pending",
    "finalize_async_save",
    "flat_boxes",
    "index_runs",
    "is_dist_checkpoint",
    "iteration_dir",
    "load_args",
    "load_checkpoint",
    "maybe_finalize_async_save",
    "model_layouts",
    "open_whole",
    "optimizer_entries",
    "partial_dir",
    "read_common",
    "read_dcp_metadata",
    "save_checkpoint",
    "sharded_backend",
    "split_runs",
    "whole_model_tensors",
]
