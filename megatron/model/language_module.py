"""LanguageModule: what GPTModel, BertModel and T5Model share (Megatron-Core's LanguageModule).

The word embedding tied to the output layer -- the weight the output layer multiplies by, and its
copy on the last pipeline stage kept equal to the first stage's -- and the per-token loss through
the vocab-parallel cross entropy. A subclass has `embedding` (or None off the first stage),
`output_layer` (or None off the last), `share_embeddings_and_output_weights`, `pre_process`,
`post_process` and `loss_vocab_size`.
"""

from __future__ import annotations

import torch

from megatron.core import communication, parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.model.layers import fused_impl
from megatron.model.module import MegatronModule


class LanguageModule(MegatronModule):
    """Base of the language models: the vocabulary sizes, the tied embedding and the language-model loss."""

    def _set_vocab_sizes(self, vocab_size: int, num_tokens: int | None) -> None:
        """vocab_size: the embedding's rows (padded for TP); num_tokens: the tokenizer's ids (None: all);
        loss_vocab_size: the ids the loss's softmax runs over, [0, loss_vocab_size) -- the tokenizer's,
        or all rows with --include-padded-vocab-in-loss (Megatron's loss)."""
        if num_tokens is not None and not 0 < num_tokens <= vocab_size:
            raise ValueError(f"num_tokens ({num_tokens}) must be in [1, vocab_size ({vocab_size})]")
        self.vocab_size = vocab_size
        self.num_tokens = num_tokens if num_tokens is not None else vocab_size
        self.loss_vocab_size = vocab_size if self.config.include_padded_vocab_in_loss else self.num_tokens

    def _sync_tied_embedding(self) -> None:
        """With pipeline stages, copy the first stage's word embedding into the last stage's zeroed
        output weight: a sum over the embedding group (first + last stage of each pipeline).

        Collective: every rank of the embedding group builds its model at the same time (get_model).
        finalize_model_grads keeps the two copies equal by summing their gradients the same way.
        """
        if (not self.share_embeddings_and_output_weights
                or parallel_state.get_pipeline_model_parallel_world_size() == 1
                or not (self.pre_process or self.post_process)
                or not parallel_state.is_rank_in_embedding_group()):
            return
        weight = self.shared_embedding_or_output_weight()
        with torch.no_grad():
            communication.all_reduce(weight.data, group=parallel_state.get_embedding_group())

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The weight [vocab/t, h] the output layer multiplies by (the word embedding when tied)."""
        if self.output_layer is not None and self.output_layer.weight is not None:
            return self.output_layer.weight
        if self.embedding is None:
            raise ValueError(f"this {type(self).__name__} stage has neither an embedding nor an output layer")
        return self.embedding.word_embeddings.weight

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy: labels [b, s], logits [s, b, vocab/t] -> losses [b, s]."""
        # fp32 softmax unless --fp16-lm-cross-entropy; the cast happens inside (no fp32 copy of the logits here).
        compute_dtype = logits.dtype if self.config.fp16_lm_cross_entropy else torch.float32
        labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b]
        fast = fused_impl(self.config, logits) != "reference"  # the plain path keeps the general CE
        losses = vocab_parallel_cross_entropy(logits, labels, unpadded_vocab_size=self.loss_vocab_size,
                                              compute_dtype=compute_dtype, one_rank_fast_path=fast)  # [s, b]
        return losses.transpose(0, 1).contiguous()  # [s, b] -> [b, s]
