"""megatron.legacy.model.BertModel, built with Accelerate's call on every rank (global args as
Accelerate's initialize() leaves them), split over TP = 2 and over PP = 2 stages under the pipeline
schedule (set_input_tensor between the stages), against the same legacy model on one rank: the same
initial weights, the same losses (lm + sop, with padding) and the same gradients. The batches and the
forward step are tests/parallel/test_bert_parallel.py's (tests/helpers/tp_pp_bert.py; Accelerate's
BertTrainStep call)."""


import pytest
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.legacy.model import BertModel
from megatron.model import TransformerConfig
from megatron.training.global_vars import set_args
from tests.helpers.args import run_args
from tests.helpers import tp_gpt, tp_pp_bert
from tests.helpers.tp_pp_bert import HIDDEN, SEED, SEQ, VOCAB

LAYERS, MICROBATCHES = 4, 4


def _legacy_bert(tp: int, pp: int) -> BertModel:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               hidden_dropout=0.0, attention_dropout=0.0)
    set_args(run_args(padded_vocab_size=tp_gpt.padded(tp), orig_vocab_size=VOCAB, max_position_embeddings=SEQ,
                      untie_embeddings_and_output_weights=False))
    try:
        return BertModel(config=config, num_tokentypes=2, add_binary_head=True, parallel_output=True,
                         pre_process=parallel_state.is_pipeline_first_stage(),
                         post_process=parallel_state.is_pipeline_last_stage())
    finally:
        set_args(None)


def _compare_with_serial(tp: int, pp: int):
    return tp_pp_bert.compare_stages_with_serial(_legacy_bert, tp, pp, MICROBATCHES)


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
