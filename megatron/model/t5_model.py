"""T5Model: shared embedding -> bidirectional encoder -> causal decoder with cross-attention -> tied LM head.

State-dict keys (Megatron-Core's T5Model with the local spec), on one of t tensor-parallel ranks:
    embedding.word_embeddings.weight              [vocab/t, h], shared by the encoder and the decoder
    embedding.position_embeddings.weight          [max_s, h], only with learned_absolute positions
    encoder_relative_pos_emb.relative_attention_bias.weight   [buckets, np], only with relative positions
    decoder_relative_pos_emb.relative_attention_bias.weight   [buckets, np], only with relative positions
    encoder.layers.{i}.*                          the GPT layer's keys (gpt_model.py)
    encoder.final_layernorm.*
    decoder.layers.{i}.*                          the GPT layer's keys, plus
        pre_cross_attn_layernorm.*, cross_attention.linear_q.*  [np/t hn, h],
        cross_attention.linear_kv.*  [np/t 2 hn, h] (per head its key then its value rows),
        cross_attention.linear_proj.*  [h, np/t hn]
    decoder.final_layernorm.*
    lm_head.output_layer.bias                     [vocab/t] (Megatron's T5 output bias)
    lm_head.output_layer.weight                   only when not tied to the word embedding

Positions (position_embedding_type):
    learned_absolute  Megatron's T5: one table of max_sequence_length rows; the encoder's positions
                      and the decoder's both count from 0 (their lengths may differ, each at most
                      max_sequence_length, Megatron's --encoder-seq-length / --decoder-seq-length).
    relative          HF T5's relative position buckets: a bias [np, sq, sk] added to the self-attention
                      scores, bidirectional in the encoder and unidirectional in the decoder, one table
                      per stack computed once per forward and shared by its layers
                      (relative_attention_num_buckets, relative_attention_max_distance). The
                      cross-attention has no position bias.

HF's T5ForConditionalGeneration (feed_forward_proj "relu", tie_word_embeddings) computes the same
function as this model built with (tests/unit/test_t5_model.py):
    config: normalization "RMSNorm" (T5LayerNorm: x / rms(x) * weight, no bias), layernorm_epsilon
            = HF's layer_norm_epsilon, add_bias_linear False, activation_func F.relu, kv_channels = d_kv,
            ffn_hidden_size = d_ff, dropout 0
    model:  position_embedding_type "relative", attention_scale 1.0 (T5 does not scale q k^T: the
            1/sqrt(d) is folded into its init), output_hidden_scale d_model ** -0.5 (HF rescales the
            decoder output before its tied LM head), the output bias zero (HF has none).

Pipeline parallelism (Megatron's --pipeline-model-parallel-split-rank): stages [0, split) hold the
encoder's layers, split evenly, and [split, pp) the decoder's. The first encoder stage and the first
decoder stage each hold the embedding (pre_process; the decoder stage's copy is kept equal to the
first stage's through the embedding group, as is the learned position table through the position
embedding group); the last encoder stage has the encoder's final norm and the last stage the
decoder's and the LM head (post_process). An encoder stage sends its hidden states [s_enc, b, h];
a decoder stage sends [its hidden states [s_dec, b, h], the encoder output [s_enc, b, h]], and the
encoder output's gradient flows back through every decoder stage (boundary_sequence_lengths tells
the schedule the shapes). A relative position table is on every stage of its stack, its gradient
summed over them (the pipeline-stack group).

Sequence parallelism: both stacks run on [s/t, b, h]; the cross-attention gathers the encoder output.

Not supported: virtual pipeline stages, full recompute of the decoder (its layers are run here, with
the encoder output as context), inference caches.
"""

from __future__ import annotations

import torch

from megatron.core import communication, parallel_state
from megatron.core.tensor_parallel import (ColumnParallelLinear, gather_from_tensor_model_parallel_region,
                                           make_viewless_tensor)
from megatron.model.embedding import LanguageModelEmbedding
from megatron.model.language_module import LanguageModule
from megatron.model.layer_specs import get_t5_decoder_layer_spec, get_t5_encoder_layer_spec
from megatron.model.layers import LayerNorm, RMSNorm
from megatron.model.module import MegatronModule
from megatron.model.positions import RelativePositionBias
from megatron.model.spec import ModuleSpec
from megatron.model.transformer_config import TransformerConfig
from megatron.model.transformer_block import TransformerBlock
from megatron.model.utils import get_causal_attention_mask, init_rng


def t5_attention_masks(encoder_padding_mask: torch.Tensor, decoder_padding_mask: torch.Tensor):
    """Padding masks [b, s_enc], [b, s_dec] (1 = real token) -> (encoder_attn_mask [b, 1, s_enc, s_enc],
    decoder_attn_mask [b, 1, s_dec, s_dec], encoder_decoder_attn_mask [b, 1, s_dec, s_enc]), bool,
    True = masked out: Megatron's T5 masks (make_attention_mask: query and key both real; the
    decoder's also causal, make_history_mask), as pretrain_t5.py hands them to the model.
    """
    enc, dec = encoder_padding_mask.bool(), decoder_padding_mask.bool()

    def both_real(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q.unsqueeze(2) & k.unsqueeze(1)  # [b, sq, 1] & [b, 1, sk] -> [b, sq, sk]

    s_dec = dec.shape[1]
    history = torch.tril(torch.ones(s_dec, s_dec, dtype=torch.bool, device=dec.device))
    return (~both_real(enc, enc).unsqueeze(1), ~(both_real(dec, dec) & history).unsqueeze(1),
            ~both_real(dec, enc).unsqueeze(1))


def t5_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b, s] positions 0 .. s-1 for every row (Megatron's t5_position_ids)."""
    positions = torch.arange(input_ids.shape[1], dtype=torch.long, device=input_ids.device)
    return positions.unsqueeze(0).expand_as(input_ids)


def _as_4d(mask: torch.Tensor | None, name: str) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = masked out), got {mask.dtype}")
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)  # [b, sq, sk] -> [b, 1, sq, sk]
    if mask.dim() != 4:
        raise ValueError(f"{name} must be [b, 1, sq, sk] or [b, sq, sk], got shape {tuple(mask.shape)}")
    return mask


class T5LMHead(MegatronModule):
    """[s, b, h] -> logits [s, b, vocab/t]: the tied projection plus its own bias. Key: output_layer.*"""

    def __init__(self, config: TransformerConfig, vocab_size: int, tied: bool) -> None:
        super().__init__(config)
        self.output_layer = ColumnParallelLinear(config.hidden_size, vocab_size, config=config,
                                                 init_method=config.init_method, bias=True, gather_output=False,
                                                 skip_weight_param_allocation=tied)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        logits, _ = self.output_layer(hidden_states, weight=weight)
        return logits


class T5Model(LanguageModule):
    """Encoder-decoder transformer (Megatron-Core's T5Model; see the module docstring).

    forward(encoder_input_ids [b, s_enc], decoder_input_ids [b, s_dec], encoder_attn_mask,
    decoder_attn_mask, encoder_decoder_attn_mask, lm_labels [b, s_dec] or None). The masks are
    Megatron's (pretrain_t5.py after its `< 0.5`): bool, True = masked out, [b, 1, sq, sk] (or
    [b, sq, sk]) -- encoder_attn_mask [b, 1, s_enc, s_enc], decoder_attn_mask [b, 1, s_dec, s_dec]
    (it must include the causal part; None means plain causal), encoder_decoder_attn_mask
    [b, 1, s_dec, s_enc]; t5_attention_masks builds all three from padding masks. Returns the logits
    [b, s_dec, vocab/t] (this rank's slice; [b, s_dec, vocab] without parallel_output), or with
    lm_labels the per-token loss [b, s_dec] (fp32, vocab-parallel, GPTModel's).

    Options beyond Megatron's: attention_scale (the core attention's factor of q k^T; None is
    1/sqrt(kv_channels)), output_hidden_scale (multiplies the decoder output before the LM head;
    HF T5's d_model ** -0.5 with tied embeddings), relative_attention_num_buckets / _max_distance.
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
        share_embeddings_and_output_weights: bool = True,
        parallel_output: bool = True,
        num_tokens: int | None = None,
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        attention_scale: float | None = None,
        output_hidden_scale: float = 1.0,
        encoder_spec: ModuleSpec | None = None,
        decoder_spec: ModuleSpec | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        add_encoder: bool = True,
        add_decoder: bool = True,
    ) -> None:
        super().__init__(config)
        if position_embedding_type not in ("learned_absolute", "relative"):
            raise ValueError(f"T5Model takes position_embedding_type 'learned_absolute' or 'relative', "
                             f"got {position_embedding_type!r}")
        self._set_vocab_sizes(vocab_size, num_tokens)
        self.max_sequence_length = max_sequence_length
        self.position_embedding_type = position_embedding_type
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.parallel_output = parallel_output
        self.output_hidden_scale = output_hidden_scale
        self.pre_process, self.post_process = pre_process, post_process
        self.add_encoder, self.add_decoder = add_encoder, add_decoder
        self.encoder_hidden_state: torch.Tensor | None = None  # from the previous stage (decoder stages)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1 and not share_embeddings_and_output_weights:
            raise ValueError("T5 under pipeline parallelism needs the LM head tied to the word embeddings "
                             "(drop --untie-embeddings-and-output-weights)")
        encoder_range, decoder_range = _stage_layer_ranges(config.num_layers, add_encoder, add_decoder)

        norm = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
        encoder_spec = encoder_spec or get_t5_encoder_layer_spec(norm, attention_scale)
        decoder_spec = decoder_spec or get_t5_decoder_layer_spec(norm, attention_scale)
        # Init streams: 0 the embedding, 1..L the layers of each stack (the decoder from init_seed + 1),
        # L + 1 the output layer, L + 2 the relative position tables -- the same on every stage.
        init_seed = int(torch.randint(0, 2**62, (1,)).item())
        self.embedding = None
        if pre_process:
            with init_rng(init_seed, 0):
                self.embedding = LanguageModelEmbedding(
                    config, vocab_size, max_sequence_length, num_tokens=self.num_tokens,
                    position_embedding_type="learned_absolute" if position_embedding_type == "learned_absolute"
                    else "none")
        self.encoder = self.decoder = None
        if add_encoder:
            self.encoder = TransformerBlock(config, encoder_spec, pre_process=pre_process, post_process=post_process,
                                            init_seed=init_seed, layer_range=encoder_range)
        if add_decoder:
            self.decoder = TransformerBlock(config, decoder_spec, pre_process=pre_process, post_process=post_process,
                                            init_seed=init_seed + 1, layer_range=decoder_range)
        self.lm_head = None
        if post_process and add_decoder:
            tied_here = share_embeddings_and_output_weights and pre_process
            with init_rng(init_seed, config.num_layers + 1):
                self.lm_head = T5LMHead(config, vocab_size, tied_here)
            if share_embeddings_and_output_weights and not tied_here:
                # The last stage's copy of the tied weight (GPTModel's): zero, then the first stage's.
                with torch.no_grad():
                    self.lm_head.output_layer.weight.zero_()
                self.lm_head.output_layer.weight.shared_embedding = True
                self.lm_head.output_layer.weight.shared = True
        if self.embedding is not None and not parallel_state.is_pipeline_first_stage():
            # The first decoder stage's copy of the first stage's embedding (Megatron's embedding
            # group of three): zero here, summed in from the first stage by the syncs below, and
            # its gradient summed with the first stage's by finalize_model_grads.
            with torch.no_grad():
                for param in self.embedding.parameters():
                    param.zero_()
                    param.shared = True  # the gradient norm counts the first stage's copy
            self.embedding.word_embeddings.weight.shared_embedding = True
            if self.embedding.position_embeddings is not None:
                self.embedding.position_embeddings.weight.pipeline_copy = True
        self.encoder_relative_pos_emb = self.decoder_relative_pos_emb = None
        if position_embedding_type == "relative":
            tp = config.tensor_model_parallel_size
            local = config.num_attention_heads // tp
            first = (parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0) * local
            init = config.init_method if config.perform_initialization else None
            kwargs = dict(num_buckets=relative_attention_num_buckets, max_distance=relative_attention_max_distance,
                          first_head=first, local_heads=local, dtype=config.params_dtype, init_method=init,
                          tensor_parallel=tp > 1)
            with init_rng(init_seed, config.num_layers + 2):
                encoder_table = RelativePositionBias(config.num_attention_heads, True, **kwargs)
                decoder_table = RelativePositionBias(config.num_attention_heads, False, **kwargs)
            self.encoder_relative_pos_emb = encoder_table if add_encoder else None
            self.decoder_relative_pos_emb = decoder_table if add_decoder else None
            self._mark_stack_tables()
        self._sync_tied_embedding()
        self._sync_position_embedding()

    def _mark_stack_tables(self) -> None:
        """A stack on several pipeline stages has its relative position table on each of them
        (the same init stream): finalize_model_grads sums their gradients over the stack's stages
        (pipeline_stack_shared), and only the stack's first stage counts it in the gradient norm and
        writes it to a torch_dist checkpoint."""
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return
        first_of_stack = parallel_state.get_pipeline_stack_rank() == 0
        for table in (self.encoder_relative_pos_emb, self.decoder_relative_pos_emb):
            if table is None:
                continue
            for param in table.parameters():
                param.pipeline_stack_shared = True
                if not first_of_stack:
                    param.shared = True
                    param.pipeline_copy = True

    def _sync_position_embedding(self) -> None:
        """Learned positions on the first encoder and the first decoder stage: the first stage's
        table, summed over the position-embedding group into the other's zeroed copy."""
        if (parallel_state.get_pipeline_model_parallel_world_size() == 1 or self.embedding is None
                or self.embedding.position_embeddings is None
                or parallel_state.get_pipeline_model_parallel_split_rank() is None):
            return
        with torch.no_grad():
            communication.all_reduce(self.embedding.position_embeddings.weight.data,
                                     group=parallel_state.get_position_embedding_group())

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline hook. An encoder stage takes the previous stage's hidden states [s_enc, b, h];
        the first decoder stage the encoder output [s_enc, b, h]; the later decoder stages
        [decoder hidden states [s_dec, b, h], encoder output] (what the previous stage returned)."""
        tensors = list(input_tensor) if isinstance(input_tensor, (list, tuple)) else [input_tensor]
        if self.add_encoder:
            if len(tensors) != 1:
                raise ValueError(f"a T5 encoder stage takes one input tensor, got {len(tensors)}")
            self.encoder.set_input_tensor(tensors[0])
            return
        if len(tensors) == 1:
            self.decoder.set_input_tensor(None)
            self.encoder_hidden_state = tensors[0]
        elif len(tensors) == 2:
            self.decoder.set_input_tensor(tensors[0])
            self.encoder_hidden_state = tensors[1]
        else:
            raise ValueError(f"a T5 decoder stage takes one or two input tensors, got {len(tensors)}")

    def boundary_sequence_lengths(self, seq_length: int, decoder_seq_length: int | None
                                  ) -> tuple[list[int], list[int]]:
        """The sequence length of each tensor this stage receives from the previous stage and of
        each it sends to the next (the pipeline schedules allocate [s, b, h] buffers from them):
        encoder stages pass the encoder's hidden states, decoder stages (decoder hidden states,
        encoder output)."""
        if decoder_seq_length is None:
            raise ValueError("a T5 pipeline needs the decoder sequence length (--decoder-seq-length)")
        rank = parallel_state.get_pipeline_model_parallel_rank()
        receives = [seq_length] if parallel_state.is_pipeline_stage_before_split(rank - 1) \
            else [decoder_seq_length, seq_length]
        sends = [seq_length] if self.add_encoder else [decoder_seq_length, seq_length]
        return receives, sends

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The weight [vocab/t, h] of the LM head (the word embedding when tied); on a pipeline
        stage without the head, its embedding's."""
        weight = self.lm_head.output_layer.weight if self.lm_head is not None else None
        if weight is not None:
            return weight
        if self.embedding is None:
            raise ValueError("this T5Model stage has neither an embedding nor an LM head")
        return self.embedding.word_embeddings.weight

    def _full_length(self, hidden: torch.Tensor) -> int:
        """The sequence length of hidden [s (/t under sequence parallelism), b, h]."""
        return hidden.shape[0] * (self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1)

    def encode(self, encoder_input_ids: torch.Tensor, encoder_attn_mask: torch.Tensor) -> torch.Tensor:
        """[b, s_enc] -> this stage's encoder output [s_enc, b, h] (after the final norm on the last
        encoder stage); later encoder stages start from set_input_tensor's hidden states."""
        mask = _as_4d(encoder_attn_mask, "encoder_attn_mask")
        if mask is None:
            raise ValueError("T5Model needs encoder_attn_mask (bool [b, 1, s_enc, s_enc], True = masked out)")
        hidden = None
        if self.pre_process:
            hidden = self.embedding(encoder_input_ids, t5_position_ids(encoder_input_ids))  # [s_enc, b, h]
        bias = None
        if self.encoder_relative_pos_emb is not None:
            s = mask.shape[-1]
            bias = self.encoder_relative_pos_emb(s, s)  # [1, np/t, s, s], shared by the layers
        return self.encoder(hidden, mask, attention_bias=bias)

    def decode(self, decoder_input_ids: torch.Tensor, encoder_output: torch.Tensor,
               decoder_attn_mask: torch.Tensor | None, encoder_decoder_attn_mask: torch.Tensor) -> torch.Tensor:
        """[b, s_dec] and the encoder output [s_enc, b, h] -> this stage's decoder output [s_dec, b, h]."""
        if self.pre_process:
            hidden = self.embedding(decoder_input_ids, t5_position_ids(decoder_input_ids))  # [s_dec, b, h]
        else:
            hidden = self.decoder.input_tensor
        if hidden is None or encoder_output is None:
            raise ValueError("this T5 decoder stage got no input: call set_input_tensor() first")
        s = self._full_length(hidden)
        mask = _as_4d(decoder_attn_mask, "decoder_attn_mask")
        is_causal = mask is None
        if is_causal:
            mask = get_causal_attention_mask(s, hidden.device)  # [1, 1, s, s]
        context_mask = _as_4d(encoder_decoder_attn_mask, "encoder_decoder_attn_mask")
        bias = self.decoder_relative_pos_emb(s, s) if self.decoder_relative_pos_emb is not None else None
        for layer in self.decoder.layers:
            hidden = layer(hidden, mask, is_causal, attention_bias=bias, context=encoder_output,
                           context_mask=context_mask)  # [s_dec, b, h]
        if self.decoder.final_layernorm is not None:
            hidden = self.decoder.final_layernorm(hidden)
        return hidden

    def forward(self, encoder_input_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                encoder_attn_mask: torch.Tensor, decoder_attn_mask: torch.Tensor | None,
                encoder_decoder_attn_mask: torch.Tensor, lm_labels: torch.Tensor | None = None):
        """The whole model: logits or per-token losses. A pipeline stage returns what crosses to the
        next stage: an encoder stage its hidden states [s_enc, b, h]; a decoder stage before the
        last [its hidden states [s_dec, b, h], the encoder output [s_enc, b, h]]."""
        if self.add_encoder:
            encoder_output = self.encode(encoder_input_ids, encoder_attn_mask)  # [s_enc, b, h]
            if not self.add_decoder:
                return make_viewless_tensor(encoder_output)  # released once sent
        else:
            encoder_output = self.encoder_hidden_state
        hidden = self.decode(decoder_input_ids, encoder_output, decoder_attn_mask,
                             encoder_decoder_attn_mask)  # [s_dec, b, h]
        if not self.post_process:
            return [make_viewless_tensor(hidden), encoder_output]  # the first is released once sent
        if self.output_hidden_scale != 1.0:
            hidden = hidden * self.output_hidden_scale
        logits = self.lm_head(hidden, self.shared_embedding_or_output_weight())  # [s_dec, b, vocab/t]
        if lm_labels is None:
            if not self.parallel_output:
                logits = gather_from_tensor_model_parallel_region(logits)  # [s, b, vocab]
            return logits.transpose(0, 1).contiguous()  # [b, s_dec, v]
        return self.compute_language_model_loss(lm_labels, logits)  # [b, s_dec]


def _stage_layer_ranges(num_layers: int, add_encoder: bool, add_decoder: bool
                        ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(offset, count) of this stage's encoder layers and of its decoder layers: each stack is split
    evenly over its stages, the encoder over [0, split), the decoder over [split, pp)."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        if not (add_encoder and add_decoder):
            raise ValueError("without pipeline parallelism a T5Model holds both the encoder and the decoder")
        return (0, num_layers), (0, num_layers)
    split = parallel_state.get_pipeline_model_parallel_split_rank()
    if split is None:
        raise ValueError("T5 under pipeline parallelism needs --pipeline-model-parallel-split-rank (the first "
                         "decoder stage; the stages before it hold the encoder)")
    if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
        raise ValueError("T5 does not take virtual pipeline stages")
    rank = parallel_state.get_pipeline_model_parallel_rank()
    if (add_encoder, add_decoder) != (rank < split, rank >= split):
        raise ValueError(f"pipeline stage {rank} with split rank {split} holds the "
                         f"{'encoder' if rank < split else 'decoder'} only; got add_encoder={add_encoder}, "
                         f"add_decoder={add_decoder}")
    for name, stages in (("encoder", split), ("decoder", pp - split)):
        if num_layers % stages:
            raise ValueError(f"the {name}'s {num_layers} layers do not split evenly over its {stages} pipeline "
                             f"stages (--pipeline-model-parallel-split-rank {split} of {pp})")
    if rank < split:
        per = num_layers // split
        return (rank * per, per), (0, 0)
    per = num_layers // (pp - split)
    return (0, 0), ((rank - split) * per, per)
