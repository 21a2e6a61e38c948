"""A 2-layer GPT (vocabulary of 300 ids, padded to 128 x t rows) split over tensor-parallel ranks,
against the same GPT on one rank (tests/parallel/test_tensor_parallel_gpt.py), and the comparison
tools other parallel tests share: `gather` (a TP-sharded tensor made whole), `relative_error`,
`errors_against_serial`. Runs inside DistributedPool workers.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.model import GPTModel, TransformerConfig

VOCAB, SEQ, BATCH, HIDDEN, SEED = 300, 8, 2, 32, 1234
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def padded(tp: int) -> int:
    multiple = 128 * tp
    return -(-VOCAB // multiple) * multiple


def model_config(tp: int, sp: bool, dropout: float = 0.0) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, tensor_model_parallel_size=tp,
                             sequence_parallel=sp, hidden_dropout=dropout, attention_dropout=dropout)


def build(tp: int, sp: bool, untied: bool = False, dropout: float = 0.0) -> GPTModel:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    return GPTModel(model_config(tp, sp, dropout), vocab_size=padded(tp), num_tokens=VOCAB, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=not untied)


def batch():
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels[0, 0] = VOCAB - 1  # the last real id sits next to the padding rows
    loss_mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.2).float()
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return tokens, labels, loss_mask, position_ids


def loss_and_grads(model: GPTModel):
    """Masked mean loss of one batch, backward, finalize; returns (loss, {name: grad}, {name: weight})."""
    tokens, labels, loss_mask, position_ids = batch()
    losses = model(tokens, position_ids, None, labels=labels)  # [b, s]
    loss = (losses * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    finalize_model_grads([model])
    named = dict(model.named_parameters())
    return loss.item(), {n: p.grad.detach().clone() for n, p in named.items()}, \
        {n: p.detach().clone() for n, p in named.items()}


def gather(param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor from the TP ranks' shards (replicated tensors are returned as they are)."""
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    world = parallel_state.get_tensor_model_parallel_world_size()
    shards = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(shards, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=param.partition_dim)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def errors_against_serial(model: torch.nn.Module, grads: dict, weights: dict, serial_grads: dict,
                          serial_weights: dict, vocab: int, vocab_params) -> tuple[dict, dict, float]:
    """Per parameter of this TP rank's model, the relative error of its gathered gradient and weight
    against the serial run's ({name: error} twice), and the largest gradient on the padded-vocab rows
    of `vocab_params` (those rows are left out of the comparison: the serial model has fewer)."""
    grad_errors, weight_errors, padding_grad = {}, {}, 0.0
    for name, param in model.named_parameters():
        grad, weight = gather(param, grads[name]), gather(param, weights[name])
        serial_grad, serial_weight = serial_grads[name], serial_weights[name]
        if name in vocab_params:
            padding_grad = max(padding_grad, grad[vocab:].abs().max().item())
            grad, weight, serial_grad, serial_weight = (t[:vocab] for t in (grad, weight, serial_grad, serial_weight))
        assert grad.shape == serial_grad.shape, (name, grad.shape, serial_grad.shape)
        grad_errors[name] = relative_error(grad, serial_grad)
        weight_errors[name] = relative_error(weight, serial_weight)
    return grad_errors, weight_errors, padding_grad
