"""megatron.legacy.model.BertModel, built with Accelerate's call on every rank (global args as
Accelerate's initialize() leaves them), split over TP = 2 and over PP = 2 stages under the pipeline
schedule (set_input_tensor between the stages), against the same legacy model on one rank: the same
initial weights, the same losses (lm + sop, with padding) and the same gradients. The batches and the
forward step are tests/parallel/test_bert_parallel.py's (Accelerate's BertTrainStep call)."""

from argparse import Namespace

import pytest
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import schedules
from megatron.legacy.model import BertModel
from megatron.model import TransformerConfig
from megatron.model.transformer_layer import get_layer_offset
from megatron.training.global_vars import set_args
from tests.parallel.harness import init_parallel
from tests.parallel.test_bert_parallel import HIDDEN, SEED, SEQ, VOCAB, VOCAB_PARAMS, _run
from tests.parallel.test_tensor_parallel_gpt import _gather, _padded, _relative_error

LAYERS, MICROBATCHES = 4, 4


def _legacy_bert(tp: int, pp: int) -> BertModel:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               hidden_dropout=0.0, attention_dropout=0.0)
    set_args(Namespace(padded_vocab_size=_padded(tp), orig_vocab_size=VOCAB, max_position_embeddings=SEQ,
                       untie_embeddings_and_output_weights=False))
    try:
        return BertModel(config=config, num_tokentypes=2, add_binary_head=True, parallel_output=True,
                         pre_process=parallel_state.is_pipeline_first_stage(),
                         post_process=parallel_state.is_pipeline_last_stage())
    finally:
        set_args(None)


def _compare_with_serial(tp: int, pp: int):
    init_parallel(tp=1)
    serial = _legacy_bert(1, 1)
    serial_losses = _run(serial, MICROBATCHES, schedules.forward_backward_no_pipelining, finalize=None)
    serial_params = dict(serial.named_parameters())
    parallel_state.destroy_model_parallel()

    init_parallel(tp=tp, pp=pp)
    model = _legacy_bert(tp, pp)
    losses = _run(model, MICROBATCHES, schedules.get_forward_backward_func(), finalize=finalize_model_grads)
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


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_legacy_bert_equals_the_serial_model(dist_pool, tp, pp):
    for rank, result in enumerate(dist_pool.run(_compare_with_serial, tp, pp)):
        assert result["weights_equal"], rank  # the same init, incl. the last stage's copy of the tied embedding
        bad = {name: error for name, error in result["errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)
        if result["last_stage"]:
            assert len(result["losses"]) == len(result["serial_losses"]) == MICROBATCHES
            for got, expected in zip(result["losses"], result["serial_losses"]):
                assert set(got) == {"lm loss", "sop loss"}
                assert got == pytest.approx(expected, rel=1e-5), rank
