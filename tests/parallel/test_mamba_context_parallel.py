"""Mamba context parallelism (megatron/model/mamba/context_parallel.py) against the serial run: same losses
and every gradient (rel 1e-5), and the refused sizes.

The model: the hybrid pattern M*-M (Mamba, attention with its own CP exchange, MLP, Mamba), hidden 32,
8 Mamba heads of 8 in 4 groups, state 8, chunk 16 (4 chunks of the 64-token sequence: the scan
carries its state across chunks held by different CP ranks), untied output, RMSNorm, SwiGLU. The CP
runs cut each micro-batch with get_batch_on_this_cp_rank (the load-balanced 2N chunks), reduce
gradients with DistributedDataParallel over DP x CP and call finalize_model_grads; the loss mask
drops more of CP rank 0's tokens, so the per-micro-batch mean has to count the whole sequence's.

    layout        4 ranks
    cp2-dp2       CP 2 x DP 2 (each replica half the micro-batches): 4 heads, 2 groups per CP rank
    cp2-tp2-sp    CP 2 x TP 2 with sequence parallelism: heads over TP first (4, 2 groups), then over
                  CP (2 heads, 1 group per rank)
    cp2-dp2-recompute   CP 2 x DP 2 with full recompute (uniform, 1 layer): the exchanges rerun in backward

Each layout also counts the exchanges: every Mamba layer runs two all-to-alls on the CP group in the
forward and two in the backward, nothing else (the attention layer's ring is "cp_ring"), moving the
bytes of _a2a_bytes; and a forward with an inference context (generation) is refused in one line.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.communication import count_communication
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import gather_tensor_parallel
from megatron.inference.context import InferenceContext
from megatron.model import TransformerConfig
from megatron.model.mamba import MambaModel
from megatron.training.utils import get_batch_on_this_cp_rank

VOCAB, SEQ, MBS, HIDDEN, SEED, MICROBATCHES, PATTERN = 100, 64, 2, 32, 1234, 2, "M*-M"
LAYOUTS = {"cp2-dp2": dict(cp=2, split_data=True), "cp2-tp2-sp": dict(cp=2, tp=2, sp=True),
           "cp2-dp2-recompute": dict(cp=2, split_data=True, recompute=True)}


def _padded(tp: int) -> int:
    return -(-VOCAB // (128 * tp)) * (128 * tp)


def _model(cp: int = 1, tp: int = 1, sp: bool = False, recompute: bool = False) -> MambaModel:
    config = TransformerConfig(
        num_layers=len(PATTERN), hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=48,
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        hidden_dropout=0.0, attention_dropout=0.0, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=4,
        mamba_chunk_size=16, init_method_std=0.1, tensor_model_parallel_size=tp, sequence_parallel=sp,
        context_parallel_size=cp, fused_kernels_cpu_impl="reference",
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}))
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    return MambaModel(config, vocab_size=_padded(tp), num_tokens=VOCAB, max_sequence_length=SEQ,
                      hybrid_override_pattern=PATTERN, share_embeddings_and_output_weights=False)


def _microbatches():
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(MICROBATCHES):
        loss_mask = (torch.rand(MBS, SEQ, generator=generator) > 0.3).float()
        loss_mask[:, :5] = 0.0  # the first chunk (CP rank 0's) loses more tokens than the others
        batches.append({"tokens": torch.randint(0, VOCAB, (MBS, SEQ), generator=generator),
                        "labels": torch.randint(0, VOCAB, (MBS, SEQ), generator=generator), "loss_mask": loss_mask,
                        "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)})
    return batches


def _forward_step(data_iterator, model):
    batch = get_batch_on_this_cp_rank(next(data_iterator))  # [b, s/N] each
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s/N]
    loss_mask = batch["loss_mask"]

    def loss_func(output):
        loss = (output.float() * loss_mask).sum()
        count = loss_mask.sum().to(torch.int)
        return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

    return losses, loss_func


def _run(model, batches, serial: bool):
    func = schedules.forward_backward_no_pipelining
    reported = func(forward_step_func=_forward_step, data_iterator=iter(batches), model=[model],
                    num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS,
                    finalize_model_grads_func=None if serial else finalize_model_grads)
    return [entry["lm loss"] for entry in reported]  # [sum, count] of this rank's tokens, per micro-batch


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def _compare(layout: dict, serial_losses: list, serial_grads: dict) -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.get("tp", 1),
                                             context_parallel_size=layout["cp"])
    model = _model(layout["cp"], layout.get("tp", 1), layout.get("sp", False), layout.get("recompute", False))
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    share = slice(None)
    if layout.get("split_data"):  # each DP replica its half of the micro-batches
        d, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        share = slice(r * MICROBATCHES // d, (r + 1) * MICROBATCHES // d)
    batches = _microbatches()[share]
    with count_communication() as counter:
        reported = _run(model, batches, serial=False)
    cp_a2a = [e for e in counter.events if e.op == "all_to_all" and e.group == "cp"]
    losses = []
    for entry in reported:  # the whole micro-batch's sum and count: summed over the CP ranks
        total = entry.clone()
        dist.all_reduce(total, group=parallel_state.get_context_parallel_group())
        losses.append((total[0] / total[1]).item())
    grad_errors = {}
    for name, param in model.module.named_parameters():
        grad = gather_tensor_parallel(param, param.main_grad)
        rows = slice(0, VOCAB) if "word_embeddings" in name or "output_layer" in name else slice(None)
        grad_errors[name] = _relative_error(grad[rows], serial_grads[name][rows])
    local = get_batch_on_this_cp_rank(batches[0])
    try:  # generation under CP: refused (the first layer is a Mamba layer)
        with torch.no_grad():
            model.module(local["tokens"], local["position_ids"], None, inference_context=InferenceContext(MBS, SEQ))
        generation = None
    except ValueError as error:
        generation = str(error)
    parallel_state.destroy_model_parallel()
    return {"losses": losses, "serial_losses": serial_losses[share], "grad_errors": grad_errors,
            "a2a_calls_per_microbatch": len(cp_a2a) / len(batches), "a2a_bytes": sum(e.nbytes for e in cp_a2a),
            "microbatches": len(batches), "generation": generation}


def _compare_layouts() -> dict:
    parallel_state.initialize_model_parallel()
    serial = _model()
    reported = _run(serial, _microbatches(), serial=True)
    parallel_state.destroy_model_parallel()
    losses = [(x[0] / x[1]).item() for x in reported]
    grads = {name: p.grad for name, p in serial.named_parameters()}
    return {name: _compare(layout, losses, grads) for name, layout in LAYOUTS.items()}


def _a2a_bytes(tp: int, cp: int, microbatches: int, recompute: bool) -> int:
    """What one CP rank sends in the Mamba layers' all-to-alls (communication.py counts what leaves a rank):
    per layer and micro-batch, forward and backward each, x, B, C, dt [s/N, b, (d_in + 2 ng n + nh)/t] and
    y [s, b, d_in/(t N)], the (N-1)/N of each that goes to other ranks; fp32. Full recompute runs the forward's
    exchanges again in backward: 3/2 of that."""
    d_in, bc, nh, mamba_layers = 64, 4 * 8, 8, PATTERN.count("M")
    to_heads = (SEQ // cp) * MBS * (d_in + 2 * bc + nh) // tp
    to_sequence = SEQ * MBS * d_in // (tp * cp)
    passes = 3 if recompute else 2
    return passes * mamba_layers * microbatches * (cp - 1) * (to_heads + to_sequence) // cp * 4


def test_mamba_context_parallel_equals_the_serial_run(dist_pool):
    results = dist_pool.run(_compare_layouts)
    for rank, per_layout in enumerate(results):
        for name, result in per_layout.items():
            bad = {key: error for key, error in result["grad_errors"].items() if error > 1e-5}
            assert not bad, (name, rank, bad)
            assert result["losses"] == pytest.approx(result["serial_losses"], rel=1e-5), (name, rank)
            layout = LAYOUTS[name]
            recompute = layout.get("recompute", False)
            # two Mamba layers: to_heads and to_sequence each, forward and backward (and the recomputed forward)
            assert result["a2a_calls_per_microbatch"] == 2 * 2 * (3 if recompute else 2), (name, rank)
            assert result["a2a_bytes"] == _a2a_bytes(layout.get("tp", 1), layout["cp"], result["microbatches"],
                                                     recompute), (name, rank)
            assert result["generation"] == "generation with --context-parallel-size > 1 is not supported", name
    assert any("mixer.conv1d.weight" in key for key in results[0]["cp2-tp2-sp"]["grad_errors"])


# ------------------------------------------------------------------------------ refused sizes

def _refusal(argv):
    """pretrain_mamba.main's error on this rank (None if it ran)."""
    import pretrain_mamba
    from megatron.training.initialize import reset_megatron

    try:
        pretrain_mamba.main(argv)
    except ValueError as error:
        return str(error)
    finally:
        reset_megatron()
    return None


REFUSED = ["--num-layers", "2", "--hybrid-override-pattern", "M*", "--hidden-size", "32", "--num-attention-heads",
           "4", "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2", "--seq-length", "16",
           "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
           "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
           "64", "--position-embedding-type", "none", "--normalization", "RMSNorm", "--eval-iters", "0"]


@pytest.mark.parametrize("flags, heads, groups", [(["--context-parallel-size", "4"], 8, 2),
                                                  (["--context-parallel-size", "2", "--tensor-model-parallel-size",
                                                    "2"], 4, 1)], ids=["cp4", "tp2-cp2"])
def test_mamba_heads_or_groups_that_do_not_split_over_cp_are_refused(dist_pool, flags, heads, groups):
    """8 heads in 2 groups: CP 4 cannot split the 2 groups, TP 2 x CP 2 the 1 group of a TP rank."""
    messages = dist_pool.run(_refusal, [*REFUSED, *flags])
    cp, tp = int(flags[1]), int(flags[3]) if len(flags) > 2 else 1
    expected = (f"Mamba context parallelism splits each tensor-parallel rank's Mamba heads ({heads}) and "
                f"--mamba-num-groups ({groups}) over the --context-parallel-size ({cp}) ranks: both must be "
                f"divisible by it (heads 8 and groups 2 over --tensor-model-parallel-size {tp})")
    assert messages == [expected] * dist_pool.world_size
