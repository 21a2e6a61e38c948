"""T5Model split over two tensor-parallel ranks against the same model on one rank: same initial
weights, same per-token loss (padded encoder inputs), same gradients after finalize_model_grads --
with learned absolute positions (Megatron's T5) and with HF T5's relative position buckets (each
rank adds its heads' bias; the replicated bias table's partial gradients are summed over the ranks).
The vocabulary (300 ids) is padded to 384 rows at t = 1 and 512 at t = 2; the padding rows get no
gradient.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.model import TransformerConfig
from megatron.model.t5_model import T5Model, t5_attention_masks
from tests.parallel.harness import init_parallel
from tests.parallel.test_tensor_parallel_gpt import _padded, _relative_error, errors_against_serial

VOCAB, S_ENC, S_DEC, BATCH, HIDDEN, SEED = 300, 10, 7, 2, 32, 4321
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "lm_head.output_layer.bias")


def _build(tp: int, position_embedding_type: str) -> T5Model:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    relative = position_embedding_type == "relative"
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, kv_channels=12,
                               ffn_hidden_size=48, tensor_model_parallel_size=tp, hidden_dropout=0.0,
                               attention_dropout=0.0, init_method_std=0.1,
                               **(dict(normalization="RMSNorm", add_bias_linear=False, activation_func=F.relu)
                                  if relative else {}))
    return T5Model(config, vocab_size=_padded(tp), num_tokens=VOCAB, max_sequence_length=S_ENC,
                   position_embedding_type=position_embedding_type, relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, attention_scale=1.0 if relative else None,
                   output_hidden_scale=HIDDEN ** -0.5 if relative else 1.0)


def _loss_and_grads(model: T5Model):
    generator = torch.Generator().manual_seed(7)
    enc = torch.randint(0, VOCAB, (BATCH, S_ENC), generator=generator)
    dec = torch.randint(0, VOCAB, (BATCH, S_DEC), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, S_DEC), generator=generator)
    enc_pad = torch.ones(BATCH, S_ENC, dtype=torch.long)
    enc_pad[1, 6:] = 0
    masks = t5_attention_masks(enc_pad, torch.ones(BATCH, S_DEC, dtype=torch.long))
    loss = model(enc, dec, *masks, lm_labels=labels)  # [b, s_dec]
    loss.sum().backward()
    finalize_model_grads([model])
    named = dict(model.named_parameters())
    return loss.detach().clone(), {n: p.grad.detach().clone() for n, p in named.items()}, \
        {n: p.detach().clone() for n, p in named.items()}


def _compare_with_serial(tp: int, position_embedding_type: str):
    init_parallel(tp=1)
    serial_loss, serial_grads, serial_weights = _loss_and_grads(_build(1, position_embedding_type))
    parallel_state.destroy_model_parallel()

    init_parallel(tp=tp)
    model = _build(tp, position_embedding_type)
    loss, grads, weights = _loss_and_grads(model)
    grad_errors, weight_errors, padding_grad = errors_against_serial(model, grads, weights, serial_grads,
                                                                     serial_weights, VOCAB, VOCAB_PARAMS)
    return {"loss_error": _relative_error(loss, serial_loss), "grad_errors": grad_errors,
            "weight_errors": weight_errors, "padding_grad": padding_grad, "names": sorted(grads),
            "serial_names": sorted(serial_grads)}


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "relative"])
def test_tp2_loss_and_gradients_equal_the_serial_model(dist_pool, position_embedding_type):
    for rank, result in enumerate(dist_pool.run(_compare_with_serial, 2, position_embedding_type)):
        assert result["names"] == result["serial_names"], rank
        assert result["loss_error"] < 1e-5, rank
        assert max(result["weight_errors"].values()) == 0.0, (rank, result["weight_errors"])  # same init
        bad = {name: error for name, error in result["grad_errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)
        assert result["padding_grad"] == 0.0, rank
