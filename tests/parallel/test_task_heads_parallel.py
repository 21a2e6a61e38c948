"""The fine-tuning heads (Classification, MultipleChoice) split over tensor-parallel ranks (with and
without sequence parallelism) and pipeline stages give the serial model's logits, loss and head
gradients: the trunk is BertModel's (tests/helpers/tp_pp_bert.py), the pooler and heads
are replicated and read the whole sequence."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import schedules
from megatron.model import TransformerConfig
from megatron.model.classification import Classification
from megatron.model.multiple_choice import MultipleChoice
from tests.helpers import tp_gpt
from tests.parallel.harness import init_parallel

VOCAB, SEQ, BATCH, CHOICES, SEED = 300, 8, 2, 4, 4321


def _build(kind: str, tp: int, sp: bool, pp: int):
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, sequence_parallel=sp, hidden_dropout=0.0,
                               attention_dropout=0.0)
    stages = dict(pre_process=parallel_state.is_pipeline_first_stage(),
                  post_process=parallel_state.is_pipeline_last_stage(), num_tokens=VOCAB)
    if kind == "classification":
        return Classification(config, 3, tp_gpt.padded(tp), SEQ, **stages)
    return MultipleChoice(config, tp_gpt.padded(tp), SEQ, **stages)


def _batch(kind: str):
    generator = torch.Generator().manual_seed(7)
    shape = (BATCH, SEQ) if kind == "classification" else (BATCH, CHOICES, SEQ)
    tokens = torch.randint(0, VOCAB, shape, generator=generator)
    mask = torch.ones(shape, dtype=torch.long)
    mask[0, ..., 6:] = 0  # padding in the first row (every choice of the first question)
    types = (torch.arange(SEQ) >= 3).long().expand(shape)
    labels = torch.randint(0, 3 if kind == "classification" else CHOICES, (BATCH,), generator=generator)
    return tokens, mask, types, labels


def _run(kind: str, model):
    tokens, mask, types, labels = _batch(kind)

    def forward_step(data_iterator, model):
        logits = model(tokens, mask, tokentype_ids=types)
        return logits, lambda out: (F.cross_entropy(out.float(), labels), {"loss": out.detach().clone()})

    rows = BATCH if kind == "classification" else BATCH * CHOICES
    reported = schedules.get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=None, model=[model], num_microbatches=1, seq_length=SEQ,
        micro_batch_size=rows, forward_only=False)
    if not parallel_state.is_pipeline_last_stage():
        return None, None
    head = model.classification_head if kind == "classification" else model.multichoice_head
    return reported[0]["loss"], head.weight.grad.clone()


def _compare(kind: str, tp: int, sp: bool, pp: int):
    init_parallel(tp=1)
    serial_logits, serial_grad = _run(kind, _build(kind, 1, False, 1))
    parallel_state.destroy_model_parallel()
    init_parallel(tp=tp, pp=pp)
    logits, grad = _run(kind, _build(kind, tp, sp, pp))
    if logits is None:
        return None
    return {"logits": (logits - serial_logits).abs().max().item(), "grad": (grad - serial_grad).abs().max().item(),
            "shape": tuple(logits.shape)}


@pytest.mark.parametrize("kind", ["classification", "multiple_choice"])
@pytest.mark.parametrize("tp, sp, pp", [(2, False, 1), (2, True, 1), (2, False, 2)], ids=["tp2", "tp2-sp", "tp2-pp2"])
def test_heads_equal_the_serial_model(dist_pool, kind, tp, sp, pp):
    results = [r for r in dist_pool.run(_compare, kind, tp, sp, pp) if r is not None]
    assert len(results) == 4 // pp  # the last stage's ranks (the other data-parallel replica too)
    for result in results:
        assert result["shape"] == ((BATCH, 3) if kind == "classification" else (BATCH, CHOICES))
        assert result["logits"] < 1e-5 and result["grad"] < 1e-5, result
