"""HuggingFace MegatronBertForPreTraining and BertForPreTraining <-> BertModel: config and weights
(whole tensors, TP = 1).

HF's Megatron-BERT has Megatron's layout: pre-LN blocks (attention.ln before attention, ln before
the MLP) and a final encoder.ln, the layout of our BertModel. Notation: np heads, hn head dim,
L. = encoder.layers.{i}. (ours), H. = bert.encoder.layer.{i}. (HF).

    bert.embeddings.word_embeddings.weight        embedding.word_embeddings.weight
    bert.embeddings.position_embeddings.weight    embedding.position_embeddings.weight
    bert.embeddings.token_type_embeddings.weight  embedding.tokentype_embeddings.weight
    H.attention.ln.*                              L.input_layernorm.*
    H.attention.self.{query,key,value}.*          L.self_attention.linear_qkv.*: rows [np, 3, hn] (each
                                                  head's q, k, v together: one query group per head)
    H.attention.output.dense.*                    L.self_attention.linear_proj.*
    H.ln.*                                        L.pre_mlp_layernorm.*
    H.intermediate.dense.*                        L.mlp.linear_fc1.*
    H.output.dense.*                              L.mlp.linear_fc2.*
    bert.encoder.ln.*                             encoder.final_layernorm.*
    cls.predictions.transform.dense.*             lm_head.dense.*
    cls.predictions.transform.LayerNorm.*         lm_head.layer_norm.*
    cls.predictions.bias                          output_layer.bias (the MLM output's own bias)
    bert.pooler.dense.*                           pooler.dense.*
    cls.seq_relationship.*                        binary_head.*

cls.predictions.decoder.{weight,bias} are HF's tied copies of the word embedding and of
cls.predictions.bias (save_pretrained does not write them): accepted on the way in when equal.

HF's BertForPreTraining (model_type "bert", the original BERT: bert-base-uncased and its kin) is
post-LN: x = LN(x + f(x)) after each sublayer, a LayerNorm on the embeddings, no final norm. It maps
onto BertModel(post_layernorm=True) (args.bert_post_layernorm, --bert-post-layernorm), whose layer is
PostLNTransformerLayer; the rows above hold but for the norms:

    bert.embeddings.LayerNorm.*                   embedding.layernorm.*
    H.attention.output.LayerNorm.*                L.post_self_attn_layernorm.*
    H.output.LayerNorm.*                          L.post_mlp_layernorm.*
    (no final norm)

Only the BertForPreTraining architecture converts: a checkpoint of BertForMaskedLM, BertModel or a
task head (architectures in its config.json) is refused by name -- its heads are not ours (no pooler
or binary head, or a classifier), so a BertModel with the binary head would not compute it.
"""

from __future__ import annotations

from typing import Any

from megatron.convert import hf_rules as hf_map

ARCHITECTURE = "MegatronBertForPreTraining"
POST_LN_ARCHITECTURE = "BertForPreTraining"  # HF model_type "bert"
# HF names of the tied copies (weights of the HF model, not in its files) -> the tensor each repeats.
TIED_COPIES = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
               "cls.predictions.decoder.bias": "cls.predictions.bias"}


def bert_config(c: Any, seq_length: int | None = None) -> tuple[dict, dict]:
    """(TransformerConfig kwargs, BertModel kwargs) of an HF MegatronBertConfig or BertConfig (post_layernorm)."""
    post_ln = _is_post_ln(c)

    def refuse(condition: bool, what: str) -> None:
        if condition:
            raise ValueError(f"{'BERT' if post_ln else 'Megatron-BERT'} with {what} cannot be converted to BertModel")

    types = getattr(c, "type_vocab_size", 2)
    refuse(types != 2, f"type_vocab_size {types} (BertModel has 2 tokentypes)")
    positions = getattr(c, "position_embedding_type", "absolute")  # transformers 4 only
    refuse(positions != "absolute", f"position_embedding_type {positions!r}")
    refuse(not getattr(c, "tie_word_embeddings", True), "tie_word_embeddings False")
    refuse(getattr(c, "is_decoder", False) or getattr(c, "add_cross_attention", False), "is_decoder / cross-attention")
    config = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                  ffn_hidden_size=c.intermediate_size, normalization="LayerNorm", layernorm_epsilon=c.layer_norm_eps,
                  add_bias_linear=True, hidden_dropout=float(c.hidden_dropout_prob),
                  attention_dropout=float(c.attention_probs_dropout_prob), init_method_std=c.initializer_range,
                  **hf_map._gelu(c.hidden_act))
    model = dict(vocab_size=c.vocab_size, max_sequence_length=c.max_position_embeddings,
                 share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute",
                 post_layernorm=post_ln)
    return config, model


def _is_post_ln(c: Any) -> bool:
    """Whether the HF config is the original (post-LN) BERT's, model_type "bert"."""
    return getattr(c, "model_type", None) == "bert"



def bert_rules(c: Any) -> list[hf_map.WeightRule]:
    """One rule per tensor of our BertModel (with the binary head), in state-dict (stream) order."""
    np_, hn = c.num_attention_heads, c.hidden_size // c.num_attention_heads
    same = hf_map._same
    rules = [same("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
             same("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
             same("embedding.tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight")]
    post_ln = _is_post_ln(c)
    if post_ln:
        rules += [same(f"embedding.layernorm.{p}", f"bert.embeddings.LayerNorm.{p}") for p in ("weight", "bias")]
        names = (("self_attention.linear_proj", "attention.output.dense"),
                 ("post_self_attn_layernorm", "attention.output.LayerNorm"), ("mlp.linear_fc1", "intermediate.dense"),
                 ("mlp.linear_fc2", "output.dense"), ("post_mlp_layernorm", "output.LayerNorm"))
    else:
        names = (("input_layernorm", "attention.ln"), ("self_attention.linear_proj", "attention.output.dense"),
                 ("pre_mlp_layernorm", "ln"), ("mlp.linear_fc1", "intermediate.dense"),
                 ("mlp.linear_fc2", "output.dense"))
    for i in range(c.num_hidden_layers):
        ours, hf = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        for p in ("weight", "bias"):
            attn = hf + "attention.self."
            # np query groups of one head each: the grouped rows [ng, 1 + 2, hn] are Megatron's [np, 3, hn].
            rules.append(hf_map._grouped_qkv(ours + "self_attention.linear_qkv." + p, attn + "query." + p,
                                             attn + "key." + p, attn + "value." + p, np_, np_, hn))
        rules += [same(f"{ours}{our_name}.{p}", f"{hf}{hf_name}.{p}")
                  for our_name, hf_name in names for p in ("weight", "bias")]
    pairs = () if post_ln else (("encoder.final_layernorm", "bert.encoder.ln"),)
    pairs += (("lm_head.dense", "cls.predictions.transform.dense"),
              ("lm_head.layer_norm", "cls.predictions.transform.LayerNorm"))
    rules += [same(f"{ours}.{p}", f"{hf}.{p}") for ours, hf in pairs for p in ("weight", "bias")]
    rules.append(same("output_layer.bias", "cls.predictions.bias"))
    pairs = (("pooler.dense", "bert.pooler.dense"), ("binary_head", "cls.seq_relationship"))
    return rules + [same(f"{ours}.{p}", f"{hf}.{p}") for ours, hf in pairs for p in ("weight", "bias")]


def hf_bert_config_from_args(args: Any, vocab_size: int) -> dict:
    """config.json fields of the MegatronBertForPreTraining (BertForPreTraining with --bert-post-layernorm)
    computing what a BertModel of these args does."""
    post_ln = bool(getattr(args, "bert_post_layernorm", False))
    architecture = POST_LN_ARCHITECTURE if post_ln else ARCHITECTURE

    def refuse(condition: bool, what: str) -> None:
        if condition:
            raise ValueError(f"a BERT model with {what} has no {architecture} counterpart")

    refuse(not getattr(args, "bert_binary_head", True), "--bert-no-binary-head (HF's model has the binary head)")
    refuse(getattr(args, "untie_embeddings_and_output_weights", False), "--untie-embeddings-and-output-weights")
    refuse(args.swiglu or args.normalization != "LayerNorm" or not args.add_bias_linear
           or getattr(args, "group_query_attention", False) or args.position_embedding_type != "learned_absolute"
           or getattr(args, "apply_residual_connection_post_layernorm", False)
           or getattr(args, "apply_layernorm_1p", False) or getattr(args, "qk_layernorm", False),
           "SwiGLU, RMSNorm, no biases, GQA, non-learned positions or another layer variant")
    hidden, heads = int(args.hidden_size), int(args.num_attention_heads)
    head_dim = int(getattr(args, "kv_channels", None) or hidden // heads)
    refuse(head_dim * heads != hidden, "kv_channels x heads != hidden")
    # HF's one hidden_act serves the MLP and the LM head; ours may differ: the fused bias-GeLU
    # (Megatron's default) is the tanh form, the LM head's GeLU the erf one unless --openai-gelu.
    tanh_mlp, tanh_head = hf_map.computes_tanh_gelu(vars(args)), bool(getattr(args, "openai_gelu", False))
    refuse(tanh_mlp != tanh_head,
           "the tanh GeLU in its MLP (the fused bias-GeLU, Megatron's default) and the erf GeLU in its LM head "
           "(HF's single hidden_act computes one of them; the logits would differ by about 1e-4: train with "
           "--no-bias-gelu-fusion for erf in both, or --openai-gelu for tanh in both)")
    gelu = "gelu_new" if tanh_mlp else "gelu"
    return dict(model_type="bert" if post_ln else "megatron-bert", architectures=[architecture],
                vocab_size=vocab_size, hidden_size=hidden,
                num_hidden_layers=int(args.num_layers), num_attention_heads=heads,
                intermediate_size=int(args.ffn_hidden_size), hidden_act=gelu,
                max_position_embeddings=int(args.max_position_embeddings), type_vocab_size=2,
                layer_norm_eps=float(args.norm_epsilon), initializer_range=float(args.init_method_std),
                hidden_dropout_prob=float(args.hidden_dropout),
                attention_probs_dropout_prob=float(args.attention_dropout), tie_word_embeddings=True)
