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

Not supported: pipeline parallelism, sequence parallelism (CrossAttention refuses it), full
recompute of the decoder (its layers are run here, with the encoder output as context), inference caches.
"""

from __future__ import annotations

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, gather_from_tensor_model_parallel_region
from megatron.model.embedding import LanguageModelEmbedding
from megatron.model.language_module import LanguageModule
from megatron.model.layer_specs import get_t5_decoder_layer_spec, get_t5_encoder_layer_spec
from megatron.model.layers import LayerNorm, RMSNorm
from megatron.model.module import MegatronModule
from megatron.model.positions import RelativePositionBias
from megatron.model.spec import ModuleSpec
from megatron.model.transformer_config import TransformerConfig
from megatron.model.transformer_layer import TransformerBlock
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
        if parallel_state.get_pipeline_model_parallel_world_size() > 1 or not (
                pre_process and post_process and add_encoder and add_decoder):
            raise ValueError("T5Model does not support pipeline parallelism yet")
        self._set_vocab_sizes(vocab_size, num_tokens)
        self.max_sequence_length = max_sequence_length
        self.position_embedding_type = position_embedding_type
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.parallel_output = parallel_output
        self.output_hidden_scale = output_hidden_scale
        self.pre_process = self.post_process = True

        norm = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
        encoder_spec = encoder_spec or get_t5_encoder_layer_spec(norm, attention_scale)
        decoder_spec = decoder_spec or get_t5_decoder_layer_spec(norm, attention_scale)
        # Init streams: 0 the embedding, 1..L the layers of each stack (the decoder from init_seed + 1),
        # L + 1 the output layer, L + 2 the relative position tables.
        init_seed = int(torch.randint(0, 2**62, (1,)).item())
        with init_rng(init_seed, 0):
            self.embedding = LanguageModelEmbedding(
                config, vocab_size, max_sequence_length, num_tokens=self.num_tokens,
                position_embedding_type="learned_absolute" if position_embedding_type == "learned_absolute" else "none")
        self.encoder = TransformerBlock(config, encoder_spec, init_seed=init_seed)
        self.decoder = TransformerBlock(config, decoder_spec, init_seed=init_seed + 1)
        tied = share_embeddings_and_output_weights
        with init_rng(init_seed, config.num_layers + 1):
            self.lm_head = T5LMHead(config, vocab_size, tied)
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
                self.encoder_relative_pos_emb = RelativePositionBias(config.num_attention_heads, True, **kwargs)
                self.decoder_relative_pos_emb = RelativePositionBias(config.num_attention_heads, False, **kwargs)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The weight [vocab/t, h] of the LM head (the word embedding when tied)."""
        weight = self.lm_head.output_layer.weight
        return self.embedding.word_embeddings.weight if weight is None else weight

    def encode(self, encoder_input_ids: torch.Tensor, encoder_attn_mask: torch.Tensor) -> torch.Tensor:
        """[b, s_enc] -> the encoder output [s_enc, b, h] (after its final norm)."""
        mask = _as_4d(encoder_attn_mask, "encoder_attn_mask")
        if mask is None:
            raise ValueError("T5Model needs encoder_attn_mask (bool [b, 1, s_enc, s_enc], True = masked out)")
        hidden = self.embedding(encoder_input_ids, t5_position_ids(encoder_input_ids))  # [s_enc, b, h]
        bias = None
        if self.encoder_relative_pos_emb is not None:
            s = hidden.shape[0]
            bias = self.encoder_relative_pos_emb(s, s)  # [1, np/t, s, s], shared by the layers
        return self.encoder(hidden, mask, attention_bias=bias)

    def decode(self, decoder_input_ids: torch.Tensor, encoder_output: torch.Tensor,
               decoder_attn_mask: torch.Tensor | None, encoder_decoder_attn_mask: torch.Tensor) -> torch.Tensor:
        """[b, s_dec] and the encoder output [s_enc, b, h] -> the decoder output [s_dec, b, h]."""
        hidden = self.embedding(decoder_input_ids, t5_position_ids(decoder_input_ids))  # [s_dec, b, h]
        s = hidden.shape[0]
        mask = _as_4d(decoder_attn_mask, "decoder_attn_mask")
        is_causal = mask is None
        if is_causal:
            mask = get_causal_attention_mask(s, hidden.device)  # [1, 1, s, s]
        context_mask = _as_4d(encoder_decoder_attn_mask, "encoder_decoder_attn_mask")
        bias = self.decoder_relative_pos_emb(s, s) if self.decoder_relative_pos_emb is not None else None
        for layer in self.decoder.layers:
            hidden = layer(hidden, mask, is_causal, attention_bias=bias, context=encoder_output,
                           context_mask=context_mask)  # [s_dec, b, h]
        return self.decoder.final_layernorm(hidden)

    def forward(self, encoder_input_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                encoder_attn_mask: torch.Tensor, decoder_attn_mask: torch.Tensor | None,
                encoder_decoder_attn_mask: torch.Tensor, lm_labels: torch.Tensor | None = None) -> torch.Tensor:
        encoder_output = self.encode(encoder_input_ids, encoder_attn_mask)  # [s_enc, b, h]
        hidden = self.decode(decoder_input_ids, encoder_output, decoder_attn_mask,
                             encoder_decoder_attn_mask)  # [s_dec, b, h]
        if self.output_hidden_scale != 1.0:
            hidden = hidden * self.output_hidden_scale
        logits = self.lm_head(hidden, self.shared_embedding_or_output_weight())  # [s_dec, b, vocab/t]
        if lm_labels is None:
            if not self.parallel_output:
                logits = gather_from_tensor_model_parallel_region(logits)  # [s, b, vocab]
            return logits.transpose(0, 1).contiguous()  # [b, s_dec, v]
        return self.compute_language_model_loss(lm_labels, logits)  # [b, s_dec]
