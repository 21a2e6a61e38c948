"""GPTModel: embedding -> transformer block (layers built from a layer spec) -> output layer -> loss.

State-dict keys (Megatron-Core GPT, local spec; FORMATS.md sec. 3), shapes on one of t
tensor-parallel ranks (vocab is the padded vocabulary; np heads, ng query groups, hn head dim):
    embedding.word_embeddings.weight              [vocab/t, h]
    embedding.position_embeddings.weight          [max_s, h], only with learned_absolute positions
    decoder.layers.{i}.input_layernorm.{weight,bias}             (RMSNorm: weight only)
    decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}   [(np + 2 ng) hn / t, h], rows per query
                                                                 group [np/ng q heads, k, v] (attention.py)
    decoder.layers.{i}.self_attention.{q,k}_layernorm.weight     [hn], only with qk_layernorm
    decoder.layers.{i}.self_attention.linear_proj.{weight,bias}  [h, np hn/t], bias [h]
    decoder.layers.{i}.pre_mlp_layernorm.{weight,bias}
    decoder.layers.{i}.mlp.linear_fc1.{weight,bias}              [ffn/t, h]; gated (SwiGLU) [2 ffn/t, h] = [gate; up]
    decoder.layers.{i}.mlp.linear_fc2.{weight,bias}              [h, ffn/t], bias [h]
    decoder.final_layernorm.{weight,bias}
    output_layer.weight                           [vocab/t, h], only when the output layer is not tied
Biases exist with add_bias_linear (linear_qkv also with add_qkv_bias). RoPE (position_embedding_type
"rope") and ALiBi ("alibi") have no parameters: the model computes their angles / bias once per
forward and hands them to every layer.
"""

from __future__ import annotations

import torch

from megatron.core import parallel_state
from megatron.core.context_parallel import split_for_cp_rank
from megatron.core.tensor_parallel import ColumnParallelLinear, gather_from_tensor_model_parallel_region
from megatron.inference.context import InferenceContext
from megatron.model.embedding import LanguageModelEmbedding
from megatron.model.language_module import LanguageModule
from megatron.model.packed_seq import PackedSeqParams
from megatron.model.positions import ALiBi, RotaryEmbedding
from megatron.model.spec import ModuleSpec
from megatron.model.transformer_config import TransformerConfig
from megatron.model.transformer_block import TransformerBlock
from megatron.model.utils import init_rng


POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "alibi", "none")


class GPTModel(LanguageModule):
    """Decoder-only transformer language model.

    forward(input_ids [b, s], position_ids [b, s], attention_mask, labels) returns logits when
    labels is None -- [b, s, vocab/t], this rank's slice, with parallel_output (Megatron's
    default), or [b, s, vocab] gathered -- else per-token cross-entropy losses [b, s] (fp32 unless
    config.fp16_lm_cross_entropy), computed without gathering the vocabulary. attention_mask:
    bool [b or 1, 1, s, s], True = masked out; None means causal. With pre_process=False the input
    comes from set_input_tensor(); with post_process=False forward returns the hidden states
    [s, b, h] (pipeline stages; [s/t, b, h] under sequence parallelism).

    transformer_layer_spec: the layer's ModuleSpec (megatron/model/layer_specs.py; default the
    GPT spec the config describes). position_embedding_type "learned_absolute" (a table),
    "rope" (rotary_percent, rotary_base, rope_scaling / rope_scaling_factor for Llama 3.1,
    seq_len_interpolation_factor; config.rotary_interleaved), "alibi" or "none".

    vocab_size is the padded vocabulary (a multiple of --make-vocab-size-divisible-by x t);
    num_tokens is the tokenizer's (default: vocab_size). Ids from num_tokens up are padding:
    their rows start at zero and their logits take no part in the loss, so the loss and the
    gradients do not depend on how much padding the tensor-parallel size asked for (nor differ
    from a HuggingFace model's). config.include_padded_vocab_in_loss gives Megatron's loss
    instead: the padding rows are drawn like the others and the softmax runs over all
    vocab_size ids, so the loss depends on t. loss_vocab_size says which of the two is in use.
    """

    decoder_class = TransformerBlock  # the stack of layers (MambaModel's: the hybrid MambaStack)

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        share_embeddings_and_output_weights: bool = True,
        position_embedding_type: str = "learned_absolute",
        pre_process: bool = True,
        post_process: bool = True,
        parallel_output: bool = True,
        num_tokens: int | None = None,
        transformer_layer_spec: ModuleSpec | None = None,
        rotary_percent: float = 1.0,
        rotary_base: float = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        seq_len_interpolation_factor: float | None = None,
    ) -> None:
        super().__init__(config)
        if position_embedding_type == "alibi" and config.context_parallel_size > 1:
            raise ValueError("--position-embedding-type alibi is not supported with --context-parallel-size > 1")
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type {position_embedding_type!r} is not supported "
                             f"(one of {', '.join(POSITION_EMBEDDING_TYPES)})")
        self._set_vocab_sizes(vocab_size, num_tokens)
        self.parallel_output = parallel_output
        # With labels, forward also returns the logits gathered over TP (Accelerate's return_logits;
        # gpt_builder sets it from args.return_logits).
        self.return_logits = False
        self.max_sequence_length = max_sequence_length
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.pre_process = pre_process
        self.post_process = post_process

        # One draw from the caller's generator seeds every piece's own init stream (init_rng), so
        # the model is the same whatever pipeline stage or chunk builds which layers.
        init_seed = int(torch.randint(0, 2**62, (1,)).item())
        self.embedding = None
        if pre_process:
            with init_rng(init_seed, 0):
                self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length,
                                                        num_tokens=self.num_tokens,
                                                        position_embedding_type=position_embedding_type)
        self.rotary_pos_emb = None
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, rotary_percent, config.rotary_interleaved,
                                                  seq_len_interpolation_factor, rotary_base, rope_scaling,
                                                  rope_scaling_factor)
        self.alibi = None
        if position_embedding_type == "alibi":
            heads = config.num_attention_heads // config.tensor_model_parallel_size
            rank = parallel_state.get_tensor_model_parallel_rank() if config.tensor_model_parallel_size > 1 else 0
            self.alibi = ALiBi(config.num_attention_heads, first_head=rank * heads, local_heads=heads)
        self.decoder = self.decoder_class(config, transformer_layer_spec, pre_process=pre_process,
                                        post_process=post_process, init_seed=init_seed)
        self.output_layer: ColumnParallelLinear | None = None
        if post_process:
            # Tied on a stage that has the embedding: the layer multiplies by the embedding's
            # weight and owns none (no output_layer.* key in the state dict).
            tied_here = share_embeddings_and_output_weights and pre_process
            # Untied, it draws the whole padded [vocab, h] matrix and keeps its rows, as Megatron
            # does; the padding rows matter only with include_padded_vocab_in_loss.
            with init_rng(init_seed, config.num_layers + 1):
                self.output_layer = ColumnParallelLinear(config.hidden_size, vocab_size, config=config,
                                                         init_method=config.init_method, bias=False,
                                                         gather_output=False, skip_weight_param_allocation=tied_here)
            if share_embeddings_and_output_weights and not tied_here:
                # A last pipeline stage without the embedding keeps its own copy of the tied
                # weight; as in Megatron it starts at zero and is overwritten from the first
                # stage's embedding (the `shared_embedding` mark tells the sync step which).
                with torch.no_grad():
                    self.output_layer.weight.zero_()
                self.output_layer.weight.shared_embedding = True
                self.output_layer.weight.shared = True  # its gradient norm is counted on the first stage
        self._sync_tied_embedding()

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """Pipeline hook: activations [s, b, h] from the previous stage (a 1-element list is accepted)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel takes a single input tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context: InferenceContext | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        paged = getattr(inference_context, "paged", False)  # the engine's packed step [1, T] (kv_cache.py)
        decoder_input = (self.embedding(input_ids, position_ids, **({"packed": True} if paged else {}))
                         if self.embedding is not None else None)  # [s, b, h]
        if packed_seq_params is not None:
            return self._forward_packed(decoder_input, attention_mask, labels, packed_seq_params, inference_context)
        rotary_pos_emb = attention_bias = None
        # With an inference context the s tokens sit at positions offset .. offset + s - 1 (position_ids
        # say so to the learned table) and attend over the offset + s cached ones.
        offset = inference_context.sequence_len_offset if inference_context is not None and not paged else 0
        if paged and self.alibi is not None:  # the paged context biases each request's own positions
            inference_context.alibi_slopes = self.alibi.slopes  # [np/t]
        if paged and self.rotary_pos_emb is not None:
            rotary_pos_emb = inference_context.rotary_freqs(self.rotary_pos_emb,
                                                            self._device(decoder_input))  # [T, 1, 1, rot]
        elif not paged and (self.rotary_pos_emb is not None or self.alibi is not None):
            seq_length = self._sequence_length(decoder_input)
            if self.rotary_pos_emb is not None:
                rotary_pos_emb = self._rotary_angles(seq_length, offset).to(self._device(decoder_input))  # [s, 1, 1, rot]
            else:
                attention_bias = self.alibi(seq_length, offset + seq_length).to(
                    self._device(decoder_input))  # [1, np/t, s, offset + s]
                if inference_context is not None:  # the keys the cache hands the attention
                    attention_bias = inference_context.pad_to_key_length(attention_bias, seq_length, 0.0)
        hidden_states = self.decoder(decoder_input, attention_mask, rotary_pos_emb=rotary_pos_emb,
                                     attention_bias=attention_bias, inference_context=inference_context)  # [s, b, h]
        return self._output(hidden_states, labels, inference_context)

    def _forward_packed(self, decoder_input: torch.Tensor | None, attention_mask: torch.Tensor | None,
                        labels: torch.Tensor | None, packed: PackedSeqParams,
                        inference_context: InferenceContext | None) -> torch.Tensor:
        """Several documents per row (megatron/model/packed_seq.py): a per-document causal mask,
        RoPE at each token's position in its document (the learned table reads position_ids,
        which the SFT data restarts itself; ALiBi's relative distances need nothing).

        Under context parallelism the input is this rank's s/N tokens (load-balanced chunks) and
        packed.cu_seqlens the uncut row's boundaries: the mask is the whole row's [b, 1, s, s] (the
        CP attention cuts it by the real positions of its queries and keys) and the RoPE positions
        in the documents are cut as the tokens are."""
        if inference_context is not None:
            raise ValueError("packed sequences (packed_seq_params) are for training; generation takes no packing")
        cp = self.config.context_parallel_size
        seq_length = self._sequence_length(decoder_input) * cp  # the whole row
        device = self._device(decoder_input)
        if attention_mask is None:
            attention_mask = packed.attention_mask(seq_length, device)  # [b, 1, s, s]
        rotary_pos_emb = attention_bias = None
        if self.rotary_pos_emb is not None:
            positions = packed.positions(seq_length)  # [b, s]
            if cp > 1:
                positions = split_for_cp_rank(positions, 1, cp, parallel_state.get_context_parallel_rank())  # [b, s/N]
            rotary_pos_emb = self.rotary_pos_emb.at(positions).to(device)  # [s(/N), b, 1, rot]
        elif self.alibi is not None:
            attention_bias = self.alibi(seq_length, seq_length).to(device)  # [1, np/t, s, s]
        hidden_states = self.decoder(decoder_input, attention_mask, rotary_pos_emb=rotary_pos_emb,
                                     attention_bias=attention_bias)  # [s, b, h]
        return self._output(hidden_states, labels, None)

    def _output(self, hidden_states: torch.Tensor, labels: torch.Tensor | None,
                inference_context: InferenceContext | None) -> torch.Tensor:
        """The last stage's logits [b, s, vocab(/t)] or per-token losses [b, s]; other stages' hidden states."""
        if not self.post_process:
            return hidden_states
        if (inference_context is not None and inference_context.materialize_only_last_token_logits
                and labels is None and not self.config.sequence_parallel):  # SP: the output layer gathers s
            # [1, b, h]: the last position's logits only; a packed step's last token of each request
            paged = getattr(inference_context, "paged", False)  # the engine's packed step (kv_cache.py)
            hidden_states = inference_context.last_token_hidden(hidden_states) if paged else hidden_states[-1:]
        logits, _ = self.output_layer(hidden_states, weight=self.shared_embedding_or_output_weight())  # [s, b, vocab/t]
        if labels is None:
            if not self.parallel_output:
                logits = gather_from_tensor_model_parallel_region(logits)  # [s, b, vocab]
            return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v]
        loss = self.compute_language_model_loss(labels, logits)
        if self.return_logits:  # Accelerate's return_logits: (loss [b, s], logits [b, s, vocab])
            return loss, gather_from_tensor_model_parallel_region(logits).transpose(0, 1).contiguous()
        return loss

    def _rotary_angles(self, seq_length: int, offset: int) -> torch.Tensor:
        """RoPE's angles of this rank's tokens: under context parallelism the local s/N tokens sit at
        the load-balanced chunks' real positions, so the angles of the whole sequence are cut the same way."""
        cp = self.config.context_parallel_size
        if cp == 1:
            return self.rotary_pos_emb(seq_length, offset)  # [s, 1, 1, rot]
        angles = self.rotary_pos_emb(seq_length * cp, offset)  # [N s, 1, 1, rot]
        return split_for_cp_rank(angles, 0, cp, parallel_state.get_context_parallel_rank())  # [s, 1, 1, rot]

    def _sequence_length(self, decoder_input: torch.Tensor | None) -> int:
        """s of this forward: from the embedding's output, or on later pipeline stages from the
        received activations ([s/t, b, h] under sequence parallelism)."""
        hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
        if hidden is None:
            raise ValueError("GPTModel got no input: pass input_ids or call set_input_tensor()")
        return hidden.shape[0] * (self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1)

    def _device(self, decoder_input: torch.Tensor | None) -> torch.device:
        hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
        return hidden.device
