"""BertModel split over tensor-parallel ranks (with and without sequence parallelism) and over
pipeline stages (1F1B, alone and with TP=2) against the same model on one rank: same initial weights,
same loss (MLM + sentence order, with padding), same gradients. The vocabulary (300 ids) is padded to
384 rows at t = 1 and 512 at t = 2; the padding rows (word embedding, output weight and bias) get no
gradient. The pipeline's last stage keeps a copy of the tied word embedding, which must carry the
serial embedding's weight and gradient. Each layout runs for the pre-LN model and for the original
post-LN BERT (post_layernorm=True: embedding LayerNorm, PostLNTransformerLayer, no final norm).
"""

import pytest
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import schedules
from megatron.model import BertModel, TransformerConfig, bert_loss
from megatron.model.transformer_layer import get_layer_offset
from tests.parallel.harness import init_parallel
from tests.parallel.test_tensor_parallel_gpt import _gather, _padded, _relative_error, errors_against_serial

VOCAB, SEQ, BATCH, HIDDEN, SEED = 300, 8, 2, 32, 4321
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")


def _build(tp: int, sp: bool, untied: bool, layers: int = 2, pp: int = 1, post_ln: bool = False) -> BertModel:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return BertModel(config, vocab_size=_padded(tp), num_tokens=VOCAB, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=not untied,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), post_layernorm=post_ln)


def _batch(seed: int = 7):
    """tokens, labels, padding_mask (the second row is padded from position 5), types, loss_mask, order."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    padding_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    padding_mask[1, 5:] = 0
    types = (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ)
    loss_mask = padding_mask * (torch.rand(BATCH, SEQ, generator=generator) > 0.4)
    order = torch.randint(0, 2, (BATCH,), generator=generator)
    return tokens, labels, padding_mask, types, loss_mask, order


def _loss_and_grads(model: BertModel):
    tokens, labels, padding_mask, types, loss_mask, order = _batch()
    lm_loss, binary_logits = model(tokens, padding_mask, tokentype_ids=types, lm_labels=labels)
    loss, _ = bert_loss(lm_loss, binary_logits, loss_mask, order)
    loss.backward()
    finalize_model_grads([model])
    named = dict(model.named_parameters())
    return loss.item(), {n: p.grad.detach().clone() for n, p in named.items()}, \
        {n: p.detach().clone() for n, p in named.items()}


def _compare_with_serial(tp: int, sp: bool, untied: bool, post_ln: bool):
    init_parallel(tp=1)
    serial_loss, serial_grads, serial_weights = _loss_and_grads(_build(1, False, untied, post_ln=post_ln))
    parallel_state.destroy_model_parallel()

    init_parallel(tp=tp)
    model = _build(tp, sp, untied, post_ln=post_ln)
    loss, grads, weights = _loss_and_grads(model)
    grad_errors, weight_errors, padding_grad = errors_against_serial(model, grads, weights, serial_grads,
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


def _forward_step(data_iterator, model):
    tokens, labels, padding_mask, types, loss_mask, order = next(data_iterator)
    output = model(tokens, padding_mask, tokentype_ids=types, lm_labels=labels)  # every stage takes the mask
    return output, lambda output: bert_loss(*output, loss_mask, order)


def _run(model, num_microbatches: int, func, finalize):
    batches = [_batch(seed) for seed in range(num_microbatches)]
    losses = func(forward_step_func=_forward_step, data_iterator=iter(batches), model=[model],
                  num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=BATCH,
                  finalize_model_grads_func=finalize)
    return [{k: v.item() for k, v in entry.items()} for entry in losses]


def compare_stages_with_serial(build, tp: int, pp: int, m: int) -> dict:
    """build(tp, pp) on one rank, then split over TP x PP under the pipeline schedule: the serial and
    parallel losses, each parameter's gradient error against the serial one, and whether the initial
    weights are the same (the padded vocabulary rows aside)."""
    init_parallel(tp=1)
    serial = build(1, 1)
    serial_losses = _run(serial, m, schedules.forward_backward_no_pipelining, finalize=None)
    serial_params = dict(serial.named_parameters())
    parallel_state.destroy_model_parallel()

    init_parallel(tp=tp, pp=pp)
    model = build(tp, pp)
    losses = _run(model, m, schedules.get_forward_backward_func(), finalize=finalize_model_grads)
    offset = get_layer_offset(model.config)
    errors, weights_equal = {}, True
    for name, param in model.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["encoder", "layers"]:
            parts[2] = str(int(parts[2]) + offset)
        serial_name = "embedding.word_embeddings.weight" if name == "output_layer.weight" else ".".join(parts)
        expected = serial_params[serial_name]
        grad, weight = _gather(param, param.grad), _gather(param, param.detach())
        rows = slice(0, VOCAB) if name in VOCAB_PARAMS else slice(None)  # the padded vocabularies differ
        weights_equal &= torch.equal(weight[rows], expected.detach()[rows])
        errors[name] = _relative_error(grad[rows], expected.grad[rows])
    return {"serial_losses": serial_losses, "losses": losses, "errors": errors, "weights_equal": weights_equal,
            "last_stage": parallel_state.is_pipeline_last_stage()}


def _pipeline_compare(tp: int, pp: int, post_ln: bool = False, layers: int = 4, m: int = 4):
    return compare_stages_with_serial(
        lambda t, p: _build(t, False, False, layers, p, post_ln=post_ln), tp, pp, m)


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
