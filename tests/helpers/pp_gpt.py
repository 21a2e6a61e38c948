"""An 8-layer GPT split over pipeline stages (tests/parallel/test_pipeline_parallel_gpt.py): this rank's
model chunks, the micro-batches, the forward step, one run of a schedule, and the serial model's name of a
stage's parameter. Runs inside DistributedPool workers.
"""

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import schedules
from megatron.model import GPTModel, TransformerConfig
from megatron.model.transformer_layer import get_layer_offset

VOCAB, SEQ, MBS, HIDDEN, LAYERS, SEED = 300, 8, 2, 32, 8, 1234


def padded(tp: int) -> int:
    multiple = 128 * tp
    return -(-VOCAB // multiple) * multiple


def build_chunks(tp: int, pp: int, vpp, sp: bool = False, untied: bool = False):
    """This rank's model chunks and each chunk's global offset of its first layer."""
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp,
                               hidden_dropout=0.0, attention_dropout=0.0)
    chunks, offsets = [], []
    for chunk_id in range(vpp or 1):
        if vpp is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id)
        torch.manual_seed(SEED)
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
        chunks.append(GPTModel(config, vocab_size=padded(tp), num_tokens=VOCAB, max_sequence_length=SEQ,
                               share_embeddings_and_output_weights=not untied,
                               pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage()))
        offsets.append(get_layer_offset(config))
    if vpp is not None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks, offsets


def microbatches(num_microbatches: int):
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)
        loss_mask = (torch.rand(MBS, SEQ, generator=generator) > 0.2).float()
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
        batches.append((tokens, labels, loss_mask, position_ids))
    return batches


def make_forward_step(per_token: bool):
    def forward_step(data_iterator, model):
        tokens, labels, loss_mask, position_ids = next(data_iterator)
        output = model(tokens, position_ids, None, labels=labels)

        def loss_func(losses):
            total = (losses.float() * loss_mask).sum()
            count = loss_mask.sum().to(torch.int64)
            if per_token:
                return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}
            loss = total / loss_mask.sum()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    return forward_step


def run(chunks, num_microbatches: int, per_token: bool, func=None, finalize=finalize_model_grads):
    batches = microbatches(num_microbatches)
    func = func or schedules.get_forward_backward_func()
    iterators = [iter(batches) for _ in chunks]
    losses = func(forward_step_func=make_forward_step(per_token),
                  data_iterator=iterators if len(chunks) > 1 else iterators[0], model=chunks,
                  num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
                  calculate_per_token_loss=per_token, finalize_model_grads_func=finalize)
    return [{k: v.tolist() for k, v in entry.items()} for entry in losses]


def serial_name(name: str, offset: int, untied: bool) -> str:
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
        return ".".join(parts)
    if name == "output_layer.weight" and not untied:
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
    return name
