"""BertModel: embedding (+ tokentypes) -> bidirectional transformer block -> LM head and binary head.

State-dict keys (Megatron-Core's BertModel with the local spec), shapes on one of t tensor-parallel
ranks (vocab is the padded vocabulary):
    embedding.word_embeddings.weight              [vocab/t, h]
    embedding.position_embeddings.weight          [max_s, h], only with learned_absolute positions
    embedding.tokentype_embeddings.weight         [num_tokentypes, h], only with num_tokentypes > 0
    encoder.layers.{i}.*                          the GPT layer's keys (gpt_model.py), pre-LN
    encoder.final_layernorm.{weight,bias}
  with post_layernorm (the original BERT, HF's BertForPreTraining) instead:
    embedding.layernorm.{weight,bias}             after the summed embeddings
    encoder.layers.{i}.*                          PostLNTransformerLayer's (post_ln_layer.py); no final layernorm
    lm_head.dense.{weight,bias}                   [h, h], replicated
    lm_head.layer_norm.{weight,bias}
    output_layer.bias                             [vocab/t] (the MLM output's own bias)
    output_layer.weight                           [vocab/t, h], only when not tied to the word embedding
    pooler.dense.{weight,bias}                    [h, h], only with add_binary_head
    binary_head.{weight,bias}                     [2, h], only with add_binary_head

The layer is the GPT layer (Megatron's bert_layer_local_spec is gpt's with a padding mask): pre-LN
blocks and a final layer norm, the layout HF's MegatronBertForPreTraining has. BERT differs from GPT
at the model only: the attention mask comes from the padding mask and is not causal, the embedding
adds token types, and the output goes through the LM head (dense, GeLU, LayerNorm) before the tied
projection, while the pooled first token feeds the sentence-order (binary) head.

post_layernorm=True builds the original BERT (Devlin et al.; HF's BertForPreTraining) instead: a
LayerNorm on the summed embeddings, post-LN layers (x = LN(x + f(x)) after each sublayer) and no
final layer norm; the heads are the same. Training scripts and the converter say it with
--bert-post-layernorm (args.bert_post_layernorm, carried in the checkpoint's args).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.model.embedding import LanguageModelEmbedding
from megatron.model.language_module import LanguageModule
from megatron.model.layer_specs import get_bert_post_ln_layer_spec
from megatron.model.layers import LayerNorm
from megatron.model.module import MegatronModule
from megatron.model.spec import ModuleSpec
from megatron.model.transformer_config import TransformerConfig
from megatron.model.transformer_block import TransformerBlock
from megatron.model.utils import init_rng, openai_gelu


def bert_extended_attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """padding_mask [b, s] (1 = real token) -> bool [b, 1, s, s], True = masked out.

    As Megatron's: position (i, j) is kept when both token i and token j are real, so a padding
    query sees no key at all (its output is whatever the softmax gives a fully masked row).
    """
    real = padding_mask.bool()
    both_real = real.unsqueeze(1) & real.unsqueeze(2)  # [b, 1, s] & [b, s, 1] -> [b, s, s]
    return ~both_real.unsqueeze(1)  # [b, 1, s, s]


def bert_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b, s] positions 0 .. s-1 for every row."""
    positions = torch.arange(input_ids.shape[1], dtype=torch.long, device=input_ids.device)
    return positions.unsqueeze(0).expand_as(input_ids)


def _linear(in_features: int, out_features: int, config: TransformerConfig) -> nn.Linear:
    """A replicated nn.Linear (Megatron's get_linear_layer): weight from init_method, bias zero."""
    linear = nn.Linear(in_features, out_features, dtype=config.params_dtype)
    if config.perform_initialization:
        with torch.no_grad():
            config.init_method(linear.weight)
            linear.bias.zero_()
    return linear


class BertLMHead(MegatronModule):
    """[s, b, h] -> [s, b, h]: dense, GeLU, LayerNorm (before the tied vocabulary projection).

    The GeLU is the exact erf one, as Megatron's BertLMHead (and HF's "gelu"), or the tanh
    approximation with config.openai_gelu (legacy Megatron's --openai-gelu). Under sequence
    parallelism it runs on this rank's s/t tokens: the weights' gradients are partial sums, marked
    sequence_parallel for the tensor-parallel all-reduce (as LayerNorm's are).
    """

    def __init__(self, hidden_size: int, config: TransformerConfig) -> None:
        super().__init__(config)
        self.dense = _linear(hidden_size, hidden_size, config)
        for param in self.dense.parameters():
            param.sequence_parallel = config.sequence_parallel
        self.layer_norm = LayerNorm(hidden_size, config)
        self.gelu = openai_gelu if config.openai_gelu else F.gelu

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(self.gelu(self.dense(hidden_states)))  # [s, b, h]


class Pooler(MegatronModule):
    """[s, b, h] -> [b, h]: tanh(dense(hidden of token `sequence_index`)), for the binary head.

    Under sequence parallelism the sequence is gathered first; every tensor-parallel rank then
    pools the same token with the same replicated weights, so the backward only splits the
    gradient again (tensor_parallel_output_grad=False).
    """

    def __init__(self, hidden_size: int, config: TransformerConfig) -> None:
        super().__init__(config)
        self.dense = _linear(hidden_size, hidden_size, config)

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        if self.config.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(  # [s/t, b, h] -> [s, b, h]
                hidden_states, tensor_parallel_output_grad=False)
        return torch.tanh(self.dense(hidden_states[sequence_index]))  # [b, h]


class BertModel(LanguageModule):
    """Bidirectional transformer with Megatron's BERT heads (masked LM and sentence order).

    forward(input_ids [b, s], attention_mask, tokentype_ids [b, s] or None, lm_labels [b, s] or None)
    returns (lm_logits, binary_logits) without labels -- lm_logits [b, s, vocab/t], this rank's slice,
    with parallel_output (Megatron's default), or [b, s, vocab] gathered -- and (per-token lm loss
    [b, s], binary_logits) with lm_labels, the loss computed as GPTModel's (vocab-parallel, fp32,
    over the num_tokens real ids). binary_logits is [b, 2], or None without add_binary_head.
    attention_mask is the padding mask [b, s], 1 = real token (the dataset's padding_mask); every
    pipeline stage needs it. tokentype_ids None means type 0 everywhere; ids given to a model without
    a tokentype table (num_tokentypes=0) are an error (Megatron's script passes None there).

    num_tokentypes: 2 with the binary head in Megatron's pretrain_bert.py, else 0 (no table).
    transformer_layer_spec: default the GPT layer the config describes (layer_spec_from_config), or
    with post_layernorm the post-LN layer (get_bert_post_ln_layer_spec).
    post_layernorm: the original BERT (module docstring): embedding LayerNorm, no final LayerNorm.
    add_lm_head=False: no LM head, output layer or binary head (the trunk of the task models in
    classification.py / multiple_choice.py; share_embeddings_and_output_weights must be False);
    add_pooler: build the pooler (default: with the binary head). encode() runs the trunk alone.
    Pipeline hooks as GPTModel's: pre_process=False takes its input from set_input_tensor();
    post_process=False returns the hidden states [s, b, h] ([s/t, b, h] under SP) and has no heads.
    The tied output weight, its copy on a last stage without the embedding, the vocabulary padding
    (num_tokens, loss_vocab_size) and the loss are GPTModel's (LanguageModule's).
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        num_tokentypes: int = 2,
        add_binary_head: bool = True,
        share_embeddings_and_output_weights: bool = True,
        position_embedding_type: str = "learned_absolute",
        pre_process: bool = True,
        post_process: bool = True,
        parallel_output: bool = True,
        num_tokens: int | None = None,
        transformer_layer_spec: ModuleSpec | None = None,
        post_layernorm: bool = False,
        add_lm_head: bool = True,
        add_pooler: bool | None = None,
    ) -> None:
        super().__init__(config)
        if not add_lm_head and share_embeddings_and_output_weights:
            raise ValueError("BertModel(add_lm_head=False) has no output layer to tie: pass "
                             "share_embeddings_and_output_weights=False")
        if position_embedding_type not in ("learned_absolute", "none"):
            raise ValueError(f"BertModel takes position_embedding_type 'learned_absolute' or 'none', "
                             f"got {position_embedding_type!r}")
        self._set_vocab_sizes(vocab_size, num_tokens)
        self.max_sequence_length = max_sequence_length
        self.add_binary_head = add_binary_head
        self.add_lm_head = add_lm_head
        self.add_pooler = add_binary_head if add_pooler is None else add_pooler
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.pre_process = pre_process
        self.post_process = post_process
        self.parallel_output = parallel_output
        self.post_layernorm = post_layernorm
        if post_layernorm and transformer_layer_spec is None:
            transformer_layer_spec = get_bert_post_ln_layer_spec(config)

        # Init streams as GPTModel's: 0 the embedding, 1..L the layers, L + 1 the output layer; L + 2
        # the heads (after an untied output layer the stream's position would depend on the padded vocab).
        init_seed = int(torch.randint(0, 2**62, (1,)).item())
        self.init_seed = init_seed  # a task head on top draws from stream L + 3 (classification.py)
        self.embedding = None
        if pre_process:
            with init_rng(init_seed, 0):
                self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length,
                                                        num_tokens=self.num_tokens,
                                                        position_embedding_type=position_embedding_type,
                                                        num_tokentypes=num_tokentypes,
                                                        layernorm=post_layernorm)
        self.encoder = TransformerBlock(config, transformer_layer_spec, pre_process=pre_process,
                                        post_process=post_process, init_seed=init_seed)
        if post_layernorm:  # the last post-LN layer ends in its own norm: the stack has no final one
            self.encoder.final_layernorm = None
        self.lm_head = self.output_layer = self.pooler = self.binary_head = None
        if post_process:
            self._build_heads(init_seed)
        self._sync_tied_embedding()

    def _build_heads(self, init_seed: int) -> None:
        config, h = self.config, self.config.hidden_size
        if not self.add_lm_head:  # a task model's trunk (megatron/model/classification.py): the pooler only
            with init_rng(init_seed, config.num_layers + 2):
                self.pooler = Pooler(h, config) if self.add_pooler else None
            return
        tied_here = self.share_embeddings_and_output_weights and self.pre_process
        with init_rng(init_seed, config.num_layers + 1):
            # The weight is the word embedding's when tied here (no output_layer.weight key); the bias
            # [vocab/t] is the output layer's own (HF's cls.predictions.bias), starting at zero.
            self.output_layer = ColumnParallelLinear(h, self.vocab_size, config=config,
                                                     init_method=config.init_method, bias=True, gather_output=False,
                                                     skip_weight_param_allocation=tied_here)
        if self.share_embeddings_and_output_weights and not tied_here:
            # A last pipeline stage's copy of the tied weight: zero, then the first stage's (GPTModel's rule).
            with torch.no_grad():
                self.output_layer.weight.zero_()
            self.output_layer.weight.shared_embedding = True
            self.output_layer.weight.shared = True
        with init_rng(init_seed, config.num_layers + 2):
            self.lm_head = BertLMHead(h, config)
            if self.add_binary_head:
                self.binary_head = _linear(h, 2, config)
            if self.add_pooler:
                self.pooler = Pooler(h, config)

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """Pipeline hook: activations [s, b, h] from the previous stage (a 1-element list is accepted)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"BertModel takes a single input tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.encoder.set_input_tensor(input_tensor)

    def encode(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor,
               tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The embedding and the encoder: hidden states [s, b, h] ([s/t, b, h] under SP), before any head."""
        if attention_mask is None or attention_mask.dim() != 2:
            raise ValueError("BertModel's attention_mask is the padding mask [b, s] (1 = real token), got "
                             + ("None" if attention_mask is None else f"shape {tuple(attention_mask.shape)}"))
        extended_mask = bert_extended_attention_mask(attention_mask)  # [b, 1, s, s]
        encoder_input = None
        if self.embedding is not None:
            encoder_input = self.embedding(input_ids, bert_position_ids(input_ids), tokentype_ids)  # [s, b, h]
        return self.encoder(encoder_input, extended_mask)  # [s, b, h] ([s/t, b, h] under SP)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor,
        tokentype_ids: torch.Tensor | None = None,
        lm_labels: torch.Tensor | None = None,
    ):
        hidden_states = self.encode(input_ids, attention_mask, tokentype_ids)
        if not self.post_process:
            return hidden_states
        binary_logits = None
        if self.binary_head is not None:
            binary_logits = self.binary_head(self.pooler(hidden_states, 0))  # [b, 2]
        lm_hidden = self.lm_head(hidden_states)  # [s, b, h]
        logits, _ = self.output_layer(lm_hidden, weight=self.shared_embedding_or_output_weight())  # [s, b, vocab/t]
        if lm_labels is None:
            if not self.parallel_output:
                logits = gather_from_tensor_model_parallel_region(logits)  # [s, b, vocab]
            return logits.transpose(0, 1).contiguous(), binary_logits  # [s, b, v] -> [b, s, v]
        # The dataset labels the unmasked positions -1 (Megatron's); their loss is multiplied by a
        # zero loss_mask, so any in-range id stands in for them.
        return self.compute_language_model_loss(lm_labels.clamp(min=0), logits), binary_logits  # [b, s]


def bert_loss(lm_loss: torch.Tensor, binary_logits: torch.Tensor | None, loss_mask: torch.Tensor,
              sentence_order: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's pretrain_bert.py loss: the mean lm loss over the masked tokens, plus the
    sentence-order cross entropy when there is a binary head (sentence_order -1 is ignored).

    lm_loss [b, s] per token, binary_logits [b, 2] or None, loss_mask [b, s] (1 = a masked token
    to predict), sentence_order [b] (the dataset's is_random). Returns (total, {"lm loss", "sop loss"})
    with the reported values detached and not yet averaged over the data-parallel group (the
    training script's job, as is the averaging of total over micro-batches).
    """
    loss_mask = loss_mask.float()
    lm = torch.sum(lm_loss.float().reshape(-1) * loss_mask.reshape(-1)) / loss_mask.sum()
    if binary_logits is None:
        return lm, {"lm loss": lm.detach()}
    sop = F.cross_entropy(binary_logits.reshape(-1, 2).float(), sentence_order.reshape(-1), ignore_index=-1)
    return lm + sop, {"lm loss": lm.detach(), "sop loss": sop.detach()}
