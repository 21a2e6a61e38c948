"""BertModel split over tensor-parallel ranks and pipeline stages against the same model on one rank
(tests/parallel/test_bert_parallel.py; also the trunk of the legacy, task-head and T5 comparisons):
the model, its batch (MLM + sentence order, with padding), and `compare_stages_with_serial`.
Runs inside DistributedPool workers.
"""

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import schedules
from megatron.model import BertModel, TransformerConfig, bert_loss
from megatron.model.transformer_layer import get_layer_offset
from tests.helpers.tp_gpt import gather, padded, relative_error
from tests.parallel.harness import init_parallel

VOCAB, SEQ, BATCH, HIDDEN, SEED = 300, 8, 2, 32, 4321
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")


def build(tp: int, sp: bool, untied: bool, layers: int = 2, pp: int = 1, post_ln: bool = False) -> BertModel:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return BertModel(config, vocab_size=padded(tp), num_tokens=VOCAB, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=not untied,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), post_layernorm=post_ln)


def batch(seed: int = 7):
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


def forward_step(data_iterator, model):
    tokens, labels, padding_mask, types, loss_mask, order = next(data_iterator)
    output = model(tokens, padding_mask, tokentype_ids=types, lm_labels=labels)  # every stage takes the mask
    return output, lambda output: bert_loss(*output, loss_mask, order)


def run(model, num_microbatches: int, func, finalize):
    batches = [batch(seed) for seed in range(num_microbatches)]
    losses = func(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                  num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=BATCH,
                  finalize_model_grads_func=finalize)
    return [{k: v.item() for k, v in entry.items()} for entry in losses]


def compare_stages_with_serial(build, tp: int, pp: int, m: int) -> dict:
    """build(tp, pp) on one rank, then split over TP x PP under the pipeline schedule: the serial and
    parallel losses, each parameter's gradient error against the serial one, and whether the initial
    weights are the same (the padded vocabulary rows aside)."""
    init_parallel(tp=1)
    serial = build(1, 1)
    serial_losses = run(serial, m, schedules.forward_backward_no_pipelining, finalize=None)
    serial_params = dict(serial.named_parameters())
    parallel_state.destroy_model_parallel()

    init_parallel(tp=tp, pp=pp)
    model = build(tp, pp)
    losses = run(model, m, schedules.get_forward_backward_func(), finalize=finalize_model_grads)
    offset = get_layer_offset(model.config)
    errors, weights_equal = {}, True
    for name, param in model.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["encoder", "layers"]:
            parts[2] = str(int(parts[2]) + offset)
        serial_name = "embedding.word_embeddings.weight" if name == "output_layer.weight" else ".".join(parts)
        expected = serial_params[serial_name]
        grad, weight = gather(param, param.grad), gather(param, param.detach())
        rows = slice(0, VOCAB) if name in VOCAB_PARAMS else slice(None)  # the padded vocabularies differ
        weights_equal &= torch.equal(weight[rows], expected.detach()[rows])
        errors[name] = relative_error(grad[rows], expected.grad[rows])
    return {"serial_losses": serial_losses, "losses": losses, "errors": errors, "weights_equal": weights_equal,
            "last_stage": parallel_state.is_pipeline_last_stage()}
