"""BertModel split over tensor-parallel ranks (with and without sequence parallelism) and over
pipeline stages (1F1B, alone and with TP=2) against the same model on one rank: same initial weights,
same loss (MLM + sentence order, with padding), same gradients. The vocabulary (300 ids) is padded to
384 rows at t = 1 and 512 at t = 2; the padding rows (word embedding, output weight and bias) get no
gradient. The pipeline's last stage keeps a copy of the tied word embedding, which must carry the
serial embedding's weight and gradient. Each layout runs for the pre-LN model and for the original
post-LN BERT (post_layernorm=True: embedding LayerNorm, PostLNTransformerLayer, no final norm).
"""

import pytest

from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.model import BertModel, bert_loss
from tests.helpers import tp_gpt, tp_pp_bert
from tests.helpers.tp_pp_bert import VOCAB, VOCAB_PARAMS
from tests.parallel.harness import init_parallel


def _loss_and_grads(model: BertModel):
    tokens, labels, padding_mask, types, loss_mask, order = tp_pp_bert.batch()
    lm_loss, binary_logits = model(tokens, padding_mask, tokentype_ids=types, lm_labels=labels)
    loss, _ = bert_loss(lm_loss, binary_logits, loss_mask, order)
    loss.backward()
    finalize_model_grads([model])
    named = dict(model.named_parameters())
    return loss.item(), {n: p.grad.detach().clone() for n, p in named.items()}, \
        {n: p.detach().clone() for n, p in named.items()}


def _compare_with_serial(tp: int, sp: bool, untied: bool, post_ln: bool):
    init_parallel(tp=1)
    serial_loss, serial_grads, serial_weights = _loss_and_grads(tp_pp_bert.build(1, False, untied, post_ln=post_ln))
    parallel_state.destroy_model_parallel()

    init_parallel(tp=tp)
    model = tp_pp_bert.build(tp, sp, untied, post_ln=post_ln)
    loss, grads, weights = _loss_and_grads(model)
    grad_errors, weight_errors, padding_grad = tp_gpt.errors_against_serial(model, grads, weights, serial_grads,
                                                                            serial_weights, VOCAB, VOCAB_PARAMS)
    return {"serial_loss": serial_loss, "loss": loss, "grad_errors": grad_errors, "weight_errors": weight_errors,
            "padding_grad": padding_grad, "names": sorted(grads), "serial_names": sorted(serial_grads)}


@pytest.mark.parametrize("tp, sp, untied, post_ln",
                         [(2, False, False, False), (2, True, False, False), (2, True, True, False),
                          (2, False, False, True), (2, True, False, True)],
                         ids=["tp2", "tp2-sp", "tp2-sp-untied", "tp2-postln", "tp2-sp-postln"])
def test_loss_and_gradients_equal_the_serial_model(dist_pool, tp, sp, untied, post_ln):
    for rank, result in enumerate(dist_pool.run(_compare_with_serial, tp, sp, untied, post_ln)):
        assert result["names"] == result["serial_names"], rank
        assert result["loss"] == pytest.approx(result["serial_loss"], rel=1e-5), rank
        assert max(result["weight_errors"].values()) == 0.0, (rank, result["weight_errors"])  # same init
        bad = {name: error for name, error in result["grad_errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)
        assert result["padding_grad"] == 0.0, rank


def _pipeline_compare(tp: int, pp: int, post_ln: bool = False, layers: int = 4, m: int = 4):
    return tp_pp_bert.compare_stages_with_serial(
        lambda t, p: tp_pp_bert.build(t, False, False, layers, p, post_ln=post_ln), tp, pp, m)


@pytest.mark.parametrize("tp, pp, post_ln", [(1, 2, False), (2, 2, False), (2, 2, True)],
                         ids=["pp2", "pp2-tp2", "pp2-tp2-postln"])
def test_pipeline_loss_and_gradients_equal_the_serial_model(dist_pool, tp, pp, post_ln):
    for rank, result in enumerate(dist_pool.run(_pipeline_compare, tp, pp, post_ln)):
        assert result["weights_equal"], rank  # incl. the last stage's copy of the tied embedding
        bad = {name: error for name, error in result["errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)
        if result["last_stage"]:
            assert len(result["losses"]) == len(result["serial_losses"]) == 4
            for got, expected in zip(result["losses"], result["serial_losses"]):
                assert set(got) == {"lm loss", "sop loss"}
                assert got == pytest.approx(expected, rel=1e-5), rank
