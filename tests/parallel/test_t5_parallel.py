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
from tests.helpers import tp_gpt, tp_pp_bert
from tests.parallel.harness import init_parallel

VOCAB, S_ENC, S_DEC, BATCH, HIDDEN, SEED = 300, 10, 8, 2, 32, 4321
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
    return T5Model(config, vocab_size=tp_gpt.padded(tp), num_tokens=VOCAB, max_sequence_length=S_ENC,
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
    grad_errors, weight_errors, padding_grad = tp_gpt.errors_against_serial(model, grads, weights, serial_grads,
                                                                            serial_weights, VOCAB, VOCAB_PARAMS)
    return {"loss_error": tp_gpt.relative_error(loss, serial_loss), "grad_errors": grad_errors,
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


# ------------------------------------------------------------------------------ pipeline parallelism
# Encoder stages [0, split), decoder stages [split, pp): the first decoder stage embeds the decoder's
# input with its copy of the embedding and receives the encoder output; later decoder stages receive
# two tensors (their hidden states [s_dec, b, h] and the encoder output [s_enc, b, h]) and send both on.

def _stage_model(tp: int, position_embedding_type: str, layers: int, sp: bool = False) -> T5Model:
    from megatron.core.enums import ModelType
    from megatron.training.training import _stage_roles

    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    relative = position_embedding_type == "relative"
    config = TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4, kv_channels=12,
                               ffn_hidden_size=48, tensor_model_parallel_size=tp, sequence_parallel=sp,
                               pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
                               hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1,
                               **(dict(normalization="RMSNorm", add_bias_linear=False, activation_func=F.relu)
                                  if relative else {}))
    return T5Model(config, vocab_size=tp_gpt.padded(tp), num_tokens=VOCAB, max_sequence_length=S_ENC,
                   position_embedding_type=position_embedding_type, relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, **_stage_roles(ModelType.encoder_and_decoder))


def _t5_batch(seed: int):
    generator = torch.Generator().manual_seed(100 + seed)
    enc = torch.randint(0, VOCAB, (BATCH, S_ENC), generator=generator)
    dec = torch.randint(0, VOCAB, (BATCH, S_DEC), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, S_DEC), generator=generator)
    enc_pad = torch.ones(BATCH, S_ENC, dtype=torch.long)
    enc_pad[seed % BATCH, 4 + seed:] = 0
    dec_pad = torch.ones(BATCH, S_DEC, dtype=torch.long)
    dec_pad[(seed + 1) % BATCH, 5:] = 0
    return enc, dec, labels, t5_attention_masks(enc_pad, dec_pad), dec_pad.float()


def _t5_forward_step(data_iterator, model):
    enc, dec, labels, masks, loss_mask = next(data_iterator)
    output = model(enc, dec, *masks, lm_labels=labels)  # every stage takes the masks

    def loss_func(losses):
        loss = (losses.float() * loss_mask).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _t5_run(model, m: int, func, finalize):
    from megatron.core.pipeline_parallel import schedules  # noqa: F401

    losses = func(forward_step_func=_t5_forward_step, data_iterator=iter([_t5_batch(i) for i in range(m)]),
                  model=[model], num_microbatches=m, seq_length=S_ENC, decoder_seq_length=S_DEC,
                  micro_batch_size=BATCH, finalize_model_grads_func=finalize)
    return [entry["lm loss"].item() for entry in losses]


def _serial_name(name: str, model: T5Model) -> str:
    """This stage's parameter name -> the serial model's (stack layers renumbered, the copies of the
    tied embedding named as the embedding)."""
    if name == "lm_head.output_layer.weight":
        return "embedding.word_embeddings.weight"
    parts = name.split(".")
    if parts[1:2] == ["layers"] and parts[0] in ("encoder", "decoder"):
        block = getattr(model, parts[0])
        parts[2] = str(int(parts[2]) + block.layers[0].layer_number - 1)
    return ".".join(parts)


def _pipeline_compare(tp: int, pp: int, split: int, position_embedding_type: str, layers: int, sp: bool = False,
                      m: int = 3):
    from megatron.core.pipeline_parallel import schedules
    init_parallel(tp=1)
    serial = _stage_model(1, position_embedding_type, layers)
    serial_losses = _t5_run(serial, m, schedules.forward_backward_no_pipelining, finalize=None)
    serial_params = dict(serial.named_parameters())
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             pipeline_model_parallel_split_rank=split)
    model = _stage_model(tp, position_embedding_type, layers, sp)
    losses = _t5_run(model, m, schedules.get_forward_backward_func(), finalize=finalize_model_grads)
    grad_errors, weights_equal, padding_grad = {}, {}, 0.0
    for name, param in model.named_parameters():
        expected = serial_params[_serial_name(name, model)]
        grad, weight = tp_gpt.gather(param, param.grad), tp_gpt.gather(param, param.detach())
        if name in VOCAB_PARAMS + ("lm_head.output_layer.weight",):
            padding_grad = max(padding_grad, grad[VOCAB:].abs().max().item())
            grad, weight = grad[:VOCAB], weight[:VOCAB]
            rows = slice(0, VOCAB)
        else:
            rows = slice(None)
        weights_equal[name] = torch.equal(weight, expected.detach()[rows])
        grad_errors[name] = tp_gpt.relative_error(grad, expected.grad[rows])
    return {"serial_losses": serial_losses, "losses": losses, "grad_errors": grad_errors,
            "weights_equal": weights_equal, "padding_grad": padding_grad,
            "last_stage": parallel_state.is_pipeline_last_stage(),
            "names": sorted(name for name, _ in model.named_parameters())}


@pytest.mark.parametrize("tp, pp, split, position_embedding_type, layers, sp", [
    (1, 2, 1, "learned_absolute", 2, False),
    (1, 2, 1, "relative", 2, False),
    (2, 2, 1, "learned_absolute", 2, False),
    (2, 2, 1, "learned_absolute", 2, True),
    (1, 4, 2, "learned_absolute", 2, False),
    (1, 4, 1, "learned_absolute", 3, False),
    (2, 1, None, "relative", 2, True),
    (1, 4, 2, "relative", 2, False),
    (1, 4, 1, "relative", 3, False),
], ids=["pp2", "pp2-relative", "tp2-pp2", "tp2-pp2-sp", "pp4-split2", "pp4-split1", "tp2-sp-relative",
        "pp4-split2-relative", "pp4-split1-relative"])
def test_pipeline_loss_and_gradients_equal_the_serial_model(dist_pool, tp, pp, split, position_embedding_type,
                                                            layers, sp):
    results = dist_pool.run(_pipeline_compare, tp, pp, split, position_embedding_type, layers, sp)
    for rank, result in enumerate(results):
        not_equal = [name for name, equal in result["weights_equal"].items() if not equal]
        assert not not_equal, (rank, not_equal)  # incl. the decoder stage's and the last stage's copies
        bad = {name: error for name, error in result["grad_errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)
        assert result["padding_grad"] == 0.0, rank
        if result["last_stage"]:
            assert len(result["losses"]) == len(result["serial_losses"]) == 3
            assert result["losses"] == pytest.approx(result["serial_losses"], rel=1e-5), rank
        else:
            assert result["losses"] == [], rank
    # Every serial parameter lives on some stage.
    held = {name for result in results for name in result["names"]}
    assert any(name.startswith("encoder.layers.") for name in held)
    assert any(name.startswith("decoder.layers.") for name in held)


def _refusals():
    from megatron.core.enums import ModelType
    from megatron.training.training import _stage_roles

    messages = []
    for pp, split, kind in ((4, 2, "learned_absolute"), (2, None, "learned_absolute")):
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                                 pipeline_model_parallel_split_rank=split)
        try:
            _stage_model(1, kind, 3)
        except ValueError as error:
            messages.append(str(error))
        try:
            _stage_roles(ModelType.encoder_or_decoder if split is not None else ModelType.encoder_and_decoder)
        except ValueError as error:
            messages.append(str(error))
        parallel_state.destroy_model_parallel()
    return messages


def test_pipeline_layouts_t5_cannot_take_are_refused_by_name(dist_pool):
    for messages in dist_pool.run(_refusals):
        assert len(messages) == 4, messages
        assert "the encoder's 3 layers do not split evenly over its 2 pipeline stages" in messages[0]
        assert "--pipeline-model-parallel-split-rank is for encoder-decoder models" in messages[1]
        assert "needs --pipeline-model-parallel-split-rank" in messages[2]
        assert "needs --pipeline-model-parallel-split-rank" in messages[3]


# ------------------------------------------------------------------------------ torch_dist names
# --ckpt-format torch_dist names every tensor as the serial model's state dict does (layers numbered
# globally per stack); a pipeline copy (the decoder stage's embedding, the last stage's tied head, a
# relative position table on a stack's later stages) is not written by the stage holding the copy.

def _saved_layouts(family: str, pp: int, split):
    from megatron.dist_checkpointing.layout import model_layouts

    def build():
        if family.startswith("t5"):
            return _stage_model(1, "relative" if family == "t5-relative" else "learned_absolute", 2)
        return tp_pp_bert.build(1, False, False, layers=4, pp=parallel_state.get_pipeline_model_parallel_world_size())

    init_parallel(tp=1)
    serial = {key: tuple(value.shape) for key, value in build().state_dict().items()}
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, pipeline_model_parallel_split_rank=split)
    saved = [(layout.name, layout.global_shape) for layout, _ in model_layouts([build()]) if layout.save]
    return serial, saved, parallel_state.get_data_parallel_rank()


@pytest.mark.parametrize("family, pp, split", [("t5", 4, 2), ("t5", 2, 1), ("t5-relative", 4, 2), ("bert", 2, None)])
def test_torch_dist_names_pipeline_stages_tensors_as_the_serial_model(dist_pool, family, pp, split):
    results = dist_pool.run(_saved_layouts, family, pp, split)
    serial = results[0][0]
    written = {}
    for rank, (_, saved, dp_rank) in enumerate(results):
        if dp_rank != 0:
            continue  # one pipeline
        for name, shape in saved:
            assert name not in written, (name, rank, written.get(name))  # each tensor from one stage
            written[name] = shape
    assert written == serial
