"""The loss and the padded vocabulary at TP=2 against TP=1 (300 ids: 384 rows at TP=1, 512 at TP=2).

Default: the padding ids take no part in the loss, so TP=1 and TP=2 give the same loss.
--include-padded-vocab-in-loss: Megatron's loss, over all 512 ids at TP=2 -- equal to a plain
cross entropy over the 512 logits of the same model on one rank, and unlike the TP=1 model's over
384 (Megatron's losses depend on the TP size); the TP=2 padding rows are megatron-core's draw.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.model import GPTModel, TransformerConfig
from megatron.model.embedding import LanguageModelEmbedding
from tests.helpers.padded_vocab_reference import HEADS, HIDDEN, SEED, SEQ, SMALL_VOCAB, megatron_core_reference
from tests.parallel.harness import init_parallel

BATCH = 2


def _padded(tp: int) -> int:
    multiple = 128 * tp  # --make-vocab-size-divisible-by 128 x TP, as Megatron pads
    return -(-SMALL_VOCAB // multiple) * multiple


def _config(tp: int, include_padding: bool) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, tensor_model_parallel_size=tp,
                             hidden_dropout=0.0, attention_dropout=0.0, include_padded_vocab_in_loss=include_padding)


def _batch():
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, SMALL_VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, SMALL_VOCAB, (BATCH, SEQ), generator=generator)
    labels[0, 0] = SMALL_VOCAB - 1  # the last real id sits next to the padding rows
    return tokens, labels, torch.arange(SEQ).expand(BATCH, SEQ)


def _model(tp: int, vocab: int, include_padding: bool, untied: bool) -> GPTModel:
    torch.manual_seed(SEED)
    return GPTModel(_config(tp, include_padding), vocab_size=vocab, num_tokens=SMALL_VOCAB, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=not untied)


def _whole_vocab_weights(model: GPTModel) -> list:
    """The vocabulary-split weights gathered over the TP group: [vocab, h] each."""
    weights = [model.embedding.word_embeddings.weight]
    if not model.share_embeddings_and_output_weights:
        weights.append(model.output_layer.weight)
    whole = []
    for weight in weights:
        shards = [torch.empty_like(weight) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
        dist.all_gather(shards, weight.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        whole.append(torch.cat(shards))  # [v/t, h] x t -> [v, h]
    return whole


def _losses_at_tp1_and_tp2(untied: bool):
    tokens, labels, position_ids = _batch()
    init_parallel(tp=1)
    one_rank = {}
    for include in (False, True):
        model = _model(1, _padded(1), include, untied)
        one_rank[include] = model(tokens, position_ids, None, labels=labels).mean().item()
    # The megatron-core-style computation on one rank: the TP=2 model's whole padded vocabulary
    # (512 ids), a plain cross entropy over all of it.
    model = _model(1, _padded(2), True, untied)
    with torch.no_grad():
        logits = model(tokens, position_ids, None)  # [b, s, 512]
    over_all_512 = F.cross_entropy(logits.transpose(1, 2), labels).item()
    one_rank_weights = [model.embedding.word_embeddings.weight.detach()]
    if untied:
        one_rank_weights.append(model.output_layer.weight.detach())
    parallel_state.destroy_model_parallel()

    init_parallel(tp=2)
    two_ranks = {}
    for include in (False, True):
        model = _model(2, _padded(2), include, untied)
        two_ranks[include] = model(tokens, position_ids, None, labels=labels).mean().item()
    same_weights = all(torch.equal(a, b) for a, b in zip(_whole_vocab_weights(model), one_rank_weights))
    return {"one_rank": one_rank, "two_ranks": two_ranks, "over_all_512": over_all_512, "same_weights": same_weights}


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_default_loss_is_the_same_at_tp1_and_tp2_and_the_flag_gives_megatrons(dist_pool, untied):
    for rank, result in enumerate(dist_pool.run(_losses_at_tp1_and_tp2, untied)):
        one_rank, two_ranks = result["one_rank"], result["two_ranks"]
        # default: 384 or 512 rows, the same loss
        assert two_ranks[False] == pytest.approx(one_rank[False], rel=1e-6, abs=0), rank
        # the flag: the TP=2 loss is the cross entropy over all 512 ids, of bit-identical weights
        assert result["same_weights"], rank
        assert two_ranks[True] == pytest.approx(result["over_all_512"], rel=1e-6, abs=0), rank
        # ... so Megatron's loss depends on the TP size (384 vs 512 ids), and each exceeds ours
        assert two_ranks[True] - one_rank[True] > 0.05, rank
        assert one_rank[True] - one_rank[False] > 0.05, rank


def _tp2_draws():
    init_parallel(tp=2)
    config = _config(2, True)
    torch.manual_seed(SEED)
    embedding = LanguageModelEmbedding(config, _padded(2), SEQ, num_tokens=SMALL_VOCAB)
    torch.manual_seed(SEED)
    output_layer = ColumnParallelLinear(HIDDEN, _padded(2), config=config, init_method=config.init_method, bias=False)
    return {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "embedding": embedding.word_embeddings.weight.detach(), "output_layer": output_layer.weight.detach()}


def test_tp2_padding_rows_are_megatron_cores_draw(dist_pool):
    reference = megatron_core_reference()  # skips when megatron-core is missing
    for result in dist_pool.run(_tp2_draws):
        expected = reference[f"tp2_embedding_rank{result['tp_rank']}"]  # [256, h], rank 1's holds the padding
        assert torch.equal(result["embedding"], expected), result["tp_rank"]
        assert torch.equal(result["output_layer"], expected), result["tp_rank"]
