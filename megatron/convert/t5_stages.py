"""Where a T5Model's tensors live over pipeline stages, for the checkpoint reader and writer.

Megatron's --pipeline-model-parallel-split-rank S of PP stages (megatron/model/t5_model.py): the
encoder's L layers over stages [0, S), L/S each, the decoder's over [S, PP), L/(PP-S) each, layer
keys numbered locally on each stage (E = L/S, D = L/(PP-S)):

    stage        holds
    0            embedding.* (word embeddings; learned positions if any)
    p < S        encoder.layers.{i}, i = global - p E
    p < S        encoder_relative_pos_emb.* (relative positions): stage 0's, copied on the others
    S - 1        encoder.final_layernorm.*
    S            embedding.*: a copy of stage 0's (Megatron's embedding group)
    p >= S       decoder.layers.{i}, i = global - (p - S) D
    p >= S       decoder_relative_pos_emb.*: stage S's, copied on the later stages
    PP - 1       decoder.final_layernorm.*, lm_head.output_layer.bias;
                 lm_head.output_layer.weight, a copy of the word embeddings, when PP - 1 != S

At PP = 1 everything is on stage 0 (S is None). The copies are not in the converter's stream: the
reader checks them against the originals and drops them, the writer adds them.
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Tuple

from megatron.convert.layout_rules import layer_index, renumber

TIED_COPY = "lm_head.output_layer.weight"  # the last stage's copy of embedding.word_embeddings.weight
WORD_EMBEDDING = "embedding.word_embeddings.weight"


def is_t5(args: argparse.Namespace) -> bool:
    return getattr(args, "model_family", None) == "T5"


def split_problems(args: argparse.Namespace, pp: int, split: Optional[int], vp: int = 1) -> List[str]:
    """Why T5 of `args` does not go on pp stages split at `split` ([] when it does)."""
    if pp == 1:
        return [] if split is None else [f"a split rank ({split}) needs a pipeline-parallel size > 1"]
    layers = int(args.num_layers)
    if split is None or not 0 < split < pp:
        return [f"the split rank ({split}) must be in [1, {pp - 1}]: the first decoder stage"]
    problems = [f"the {name}'s {layers} layers do not split over its {stages} pipeline stages"
                for name, stages in (("encoder", split), ("decoder", pp - split)) if layers % stages]
    if vp > 1:
        problems.append("T5 takes no virtual pipeline stages")
    if getattr(args, "untie_embeddings_and_output_weights", False):
        problems.append("T5 under pipeline parallelism needs the LM head tied to the word embeddings")
    return problems


class T5Stages:
    """The stage of each tensor (global names) and its local name there; see the module docstring."""

    def __init__(self, num_layers: int, pp: int, split: Optional[int]) -> None:
        self.num_layers, self.pp = num_layers, pp
        self.split = split if pp > 1 else None
        self.encoder_stages = self.split if pp > 1 else 1
        self.decoder_stages = pp - self.split if pp > 1 else 1

    @classmethod
    def of(cls, args: argparse.Namespace) -> "T5Stages":
        """The layout the checkpoint's args describe (callers check split_problems first)."""
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        return cls(int(args.num_layers), pp, getattr(args, "pipeline_model_parallel_split_rank", None))

    def _per_stage(self, stack: str) -> int:
        return self.num_layers // (self.encoder_stages if stack == "encoder" else self.decoder_stages)

    def _first(self, stack: str) -> int:
        return 0 if stack == "encoder" or self.pp == 1 else self.split

    def offset(self, stage: int, stack: str) -> int:
        """The global index of `stack`'s local layer 0 on `stage`."""
        return (stage - self._first(stack)) * self._per_stage(stack)

    def stack_of_stage(self, stage: int) -> Optional[str]:
        """The one stack on `stage` (None at PP = 1, where both are)."""
        if self.pp == 1:
            return None
        return "encoder" if stage < self.split else "decoder"

    def stage_of(self, name: str) -> int:
        """The stage holding global `name` (for the embedding: stage 0; its copies: see placements)."""
        if self.pp == 1 or name.startswith("embedding."):
            return 0
        stack = name.split(".", 1)[0]
        index = layer_index(name)
        if index is not None:
            return self._first(stack) + index // self._per_stage(stack)
        if _is_table(name):  # on every stage of its stack; the first one's is the original
            return self._first("encoder" if name.startswith("encoder") else "decoder")
        if name.startswith("encoder"):  # encoder.final_layernorm.*
            return self.split - 1
        return self.pp - 1  # the decoder's norm, the LM head

    def placements(self, name: str) -> List[Tuple[int, str]]:
        """(stage, local name) of every copy of global `name` in a checkpoint of this layout."""
        stage = self.stage_of(name)
        index = layer_index(name)
        local = renumber(name, -self.offset(stage, name.split(".", 1)[0])) if index is not None else name
        places = [(stage, local)]
        if self.pp > 1 and _is_table(name):
            stages = self.encoder_stages if name.startswith("encoder") else self.decoder_stages
            places += [(stage + i, name) for i in range(1, stages)]  # the stack's later stages' copies
        if self.pp > 1 and name.startswith("embedding."):
            places.append((self.split, name))  # the first decoder stage's copy
            if name == WORD_EMBEDDING and self.pp - 1 != self.split:
                places.append((self.pp - 1, TIED_COPY))  # the LM head's copy
        return places

    def is_copy(self, stage: int, name: str) -> Optional[str]:
        """The global name of stage 0's tensor that local `name` of `stage` copies, else None."""
        if self.pp == 1:
            return None
        if _is_table(name) and stage != self.stage_of(name):
            return name
        if stage == 0:
            return None
        if stage == self.split and name.startswith("embedding."):
            return name
        if stage == self.pp - 1 and name == TIED_COPY and stage != self.split:
            return WORD_EMBEDDING
        return None

    def is_original(self, stage: int, name: str) -> bool:
        """Whether local `name` of `stage` is a tensor other stages hold copies of."""
        if self.pp == 1:
            return False
        return (stage == 0 and name.startswith("embedding.")) or (_is_table(name) and stage == self.stage_of(name))

    def global_name(self, stage: int, name: str) -> str:
        """Local `name` of `stage` under its global layer number."""
        stack = self.stack_of_stage(stage)
        if stack is None or layer_index(name) is None:
            return name
        return renumber(name, self.offset(stage, stack))


def _is_table(name: str) -> bool:
    """encoder_relative_pos_emb.* / decoder_relative_pos_emb.*: a stack's relative position table."""
    return name.split(".", 1)[0] in ("encoder_relative_pos_emb", "decoder_relative_pos_emb")
