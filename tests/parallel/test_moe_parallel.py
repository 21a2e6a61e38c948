"""Expert parallelism: a GPT with MoE layers at EP = 2 / 4, with TP = 2 (+SP, expert TP 2 or 1), with the
allgather and the alltoall dispatcher, with and without capacity dropping, gives the losses and
gradients of the same model at EP = 1 -- and, without dropping, of the serial model on the whole batch.

Every rank builds the reference layout first (the same seed: the experts are drawn per global
expert, so they are identical at every EP / ETP), runs one forward and backward on its share of a
fixed global batch, reduces the gradients as DistributedDataParallel does (dense parameters: the
mean over the data-parallel group; expert parameters, allreduce = False: the sum over the
expert-data-parallel group divided by the data-parallel size; sequence-parallel ones summed over
TP) and gathers every gradient into its full, global form (expert i of EP rank r is expert
r * E/EP + i; TP / ETP shards concatenated along their partition dim). Then the same for the
layout under test, and the two are compared.

With add_bias_linear the experts' biases are set to values drawn per global expert (Megatron
zeroes them at init, which would hide a bias counted once per expert-TP rank) before the run.

The balancing losses are those of each micro-batch (its tokens over the tensor-parallel group), so
the serial model runs each data-parallel replica's share as one micro-batch.
Capacity drops a rank's own tokens (Megatron's rule), so with dropping the reference is EP = 1 at
the same TP / DP layout, whose ranks hold the same tokens; at TP = 1 that is also the serial model
run on the same micro-batches one after another, which the DP-only case checks too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import aux_losses, communication, parallel_state, tensor_parallel
from megatron.core.aux_losses import AuxLossAutoScaler
from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megatron.dist_checkpointing.layout import model_layouts
from megatron.model import GPTModel, TransformerConfig
from megatron.model.moe.experts import _slice
from megatron.model.utils import get_num_parameters_across_model_parallel
from tests.parallel.harness import init_parallel

VOCAB, SEQ, BATCH, HIDDEN, EXPERTS, SEED = 128, 16, 4, 32, 4, 2024


def _config(tp: int, ep: int, etp: int | None, **moe) -> TransformerConfig:
    fields = dict(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=48, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.05, add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        num_moe_experts=EXPERTS, moe_ffn_hidden_size=24, moe_router_topk=2, moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    return TransformerConfig(**{**fields, **moe})


def _set_expert_biases(model: GPTModel) -> None:
    """Each expert bias := values drawn from its global name, this rank's ETP rows of fc1's (SwiGLU:
    [gate_r ; up_r]), fc2's whole."""
    ep, ep_rank = parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank()
    etp, etp_rank = (parallel_state.get_expert_tensor_parallel_world_size(),
                     parallel_state.get_expert_tensor_parallel_rank())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not (getattr(param, "expert_parallel", False) and name.endswith(".bias")):
                continue
            head, rest = name.split(".local_experts.")
            index, tail = rest.split(".", 1)
            layer = int(head.split(".")[2])
            expert = ep_rank * (EXPERTS // ep) + int(index)
            generator = torch.Generator().manual_seed(1000 * layer + 10 * expert + (tail == "linear_fc2.bias"))
            if tail == "linear_fc1.bias":
                full = torch.randn(param.numel() * etp, generator=generator) * 0.5
                param.copy_(_slice(full, 0, 2, etp_rank, etp))
            else:
                param.copy_(torch.randn(param.numel(), generator=generator) * 0.5)


def _model(tp: int, ep: int, etp: int | None, **moe) -> GPTModel:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    return GPTModel(_config(tp, ep, etp, **moe), vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def _batch():
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return tokens, labels


def _rank_share(dp: int, dp_rank: int):
    tokens, labels = _batch()
    per = BATCH // dp
    return tokens[dp_rank * per:(dp_rank + 1) * per], labels[dp_rank * per:(dp_rank + 1) * per]


def _full(tensor: torch.Tensor, param, group, size: int) -> torch.Tensor:
    """The whole tensor from the shards of `group` (partition dim and stride from the param)."""
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    pieces = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    blocks = [torch.chunk(piece, stride, dim=dim) for piece in pieces]
    return torch.cat([blocks[r][j] for j in range(stride) for r in range(size)], dim=dim)


def _global(model: GPTModel, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """name -> full tensor under global names (experts renumbered, shards gathered)."""
    params = dict(model.named_parameters())
    ep, ep_rank = parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank()
    local = EXPERTS // ep
    out = {}
    for name, value in values.items():
        param = params[name]
        if getattr(param, "expert_parallel", False):
            etp_group = parallel_state.get_expert_tensor_parallel_group()
            full = _full(value, param, etp_group, parallel_state.get_expert_tensor_parallel_world_size())
            head, index, tail = name.partition(".local_experts.")[0], *name.partition(".local_experts.")[2].split(".", 1)
            gathered = [torch.empty_like(full) for _ in range(ep)]
            dist.all_gather(gathered, full.contiguous(), group=parallel_state.get_expert_model_parallel_group())
            for r, piece in enumerate(gathered):
                out[f"{head}.local_experts.{r * local + int(index)}.{tail}"] = piece
        else:
            out[name] = _full(value, param, parallel_state.get_tensor_model_parallel_group(),
                              parallel_state.get_tensor_model_parallel_world_size())
    return out


def _reduce_like_ddp(model: GPTModel) -> None:
    dp = parallel_state.get_data_parallel_world_size()
    for param in model.parameters():
        if param.grad is None:
            continue
        if getattr(param, "allreduce", True):
            group = parallel_state.get_data_parallel_group()
        else:
            group = parallel_state.get_expert_data_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(param.grad, group=group)
        param.grad /= dp
    allreduce_sequence_parallel_grads([model])


def _run(tp: int = 1, ep: int = 1, etp: int | None = None, serial: bool = False, microbatches: int = 1,
         starve: bool = False, **moe):
    """(loss of this rank's share, global grads, global weights, parameter count, {name: global shape}
    of the torch_dist layouts) of one forward / backward."""
    aux_losses.clear()
    if serial:
        init_parallel()
        dp, dp_rank = 1, 0
    else:
        init_parallel(tp=tp, ep=ep, etp=etp)
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    model = _model(1 if serial else tp, 1 if serial else ep, None if serial else etp, **moe)
    if starve:
        _starve_expert_3(model)
    if moe.get("add_bias_linear"):
        _set_expert_biases(model)
    tokens, labels = _rank_share(dp, dp_rank)
    AuxLossAutoScaler.set_loss_scale(1.0 / microbatches)
    losses = []
    for tok, lab in zip(tokens.chunk(microbatches), labels.chunk(microbatches)):
        loss = model(tok, None, labels=lab).mean()
        (loss / microbatches).backward()
        losses.append(loss.detach())
    if not serial:
        _reduce_like_ddp(model)
    model.parameter_count = get_num_parameters_across_model_parallel(model)
    named = dict(model.named_parameters())
    grads = _global(model, {n: p.grad.detach().clone() for n, p in named.items()})
    weights = _global(model, {n: p.detach().clone() for n, p in named.items()})
    shapes = {layout.name: layout.global_shape for layout, _ in model_layouts(model)}
    parallel_state.destroy_model_parallel()
    return torch.stack(losses).mean(), grads, weights, model.parameter_count, shapes


def _errors(result, reference):
    loss, grads, weights, count, shapes = result
    ref_loss, ref_grads, ref_weights, ref_count, ref_shapes = reference
    assert count == ref_count, (count, ref_count)  # every expert counted once, over the expert ranks
    # a checkpoint's global tensors (this rank's experts among them) are the same at every layout
    assert {n: ref_shapes.get(n) for n in shapes} == shapes
    assert sorted(grads) == sorted(ref_grads)
    weight_error = max(float((weights[n] - ref_weights[n]).abs().max()) for n in weights)
    grad_errors = {n: float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp(min=1e-12)) for n in grads}
    worst = max(grad_errors, key=grad_errors.get)
    return {"loss": float(abs(loss - ref_loss) / abs(ref_loss)), "grad": grad_errors[worst], "worst": worst,
            "weight": weight_error}


def _against_ep1(tp: int, ep: int, etp: int | None, capacity: float | None, **extra):
    """{dispatcher: errors} of the layout at EP = ep against EP = 1 (and the serial model when dropless).
    At EP = 1 both dispatchers compute the same function, so one reference serves both. extra: more
    config fields, the same in all three."""
    reference = _run(tp=tp, ep=1, etp=etp, moe_expert_capacity_factor=capacity, **extra)
    serial = _run(serial=True, microbatches=4 // tp, **extra) if capacity is None else None
    out = {}
    for dispatcher in ("allgather", "alltoall"):
        result = _run(tp=tp, ep=ep, etp=etp, moe_token_dispatcher_type=dispatcher, moe_expert_capacity_factor=capacity,
                      **extra)
        errors = _errors(result, reference)
        if serial is not None:  # the serial model, on each data-parallel replica's share as one micro-batch
            local = result[0].reshape(1)
            gathered = [torch.empty_like(local) for _ in range(4)]
            dist.all_gather(gathered, local)
            mean = torch.stack(gathered).mean()  # every TP rank holds its replica's loss: the mean is the same
            serial_errors = _errors((mean, *result[1:]), serial)
            errors = {"loss": max(errors["loss"], serial_errors["loss"]),
                      "grad": max(errors["grad"], serial_errors["grad"]),
                      "weight": max(errors["weight"], serial_errors["weight"]), "worst": (errors, serial_errors)}
        out[dispatcher] = errors
    return out


LAYOUTS = [  # (tp, ep, etp)
    (1, 2, None),
    (1, 4, None),
    (2, 2, None),  # expert TP = TP = 2: each expert split over the two TP ranks
    (2, 2, 1),     # expert TP 1: the TP ranks hold different experts
]


@pytest.mark.parametrize("capacity", [None, 1.0], ids=["dropless", "capacity1.0"])
@pytest.mark.parametrize("tp, ep, etp", LAYOUTS, ids=[f"tp{t}ep{e}etp{x or t}" for t, e, x in LAYOUTS])
def test_expert_parallel_loss_and_gradients_equal_ep1(dist_pool, tp, ep, etp, capacity):
    """Both dispatchers, each layout, with and without dropping."""
    for rank, by_dispatcher in enumerate(dist_pool.run(_against_ep1, tp, ep, etp, capacity)):
        for dispatcher, errors in by_dispatcher.items():
            assert errors["weight"] == 0.0, (rank, dispatcher, errors)  # the same experts at every EP / ETP
            assert errors["loss"] < 1e-5 and errors["grad"] < 1e-5, (rank, dispatcher, errors)


BIASED = [  # (tp, ep, etp, grouped GEMM): every layout above, with biased experts
    *[(tp, ep, etp, False) for tp, ep, etp in LAYOUTS],
    (2, 2, None, True),
    (1, 4, None, True),
]


@pytest.mark.parametrize("tp, ep, etp, grouped", BIASED,
                         ids=[f"tp{t}ep{e}etp{x or t}" + ("-grouped" if g else "") for t, e, x, g in BIASED])
def test_biased_experts_equal_ep1_and_the_serial_model(dist_pool, tp, ep, etp, grouped):
    """add_bias_linear: the expert fc1 bias split over expert TP, the fc2 bias counted once in the
    expert-TP sum and weighted with the rest by the router probability; both dispatchers."""
    extra = dict(add_bias_linear=True, moe_grouped_gemm=grouped)
    for rank, by_dispatcher in enumerate(dist_pool.run(_against_ep1, tp, ep, etp, None, **extra)):
        for dispatcher, errors in by_dispatcher.items():
            assert errors["weight"] == 0.0, (rank, dispatcher, errors)
            assert errors["loss"] < 1e-5 and errors["grad"] < 1e-5, (rank, dispatcher, errors)


def _dropping_against_serial_microbatches(ep: int, policy: str, pad: bool):
    drop = dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy, moe_pad_expert_input_to_capacity=pad)
    # The serial model on the four ranks' sequences as four micro-batches drops the same tokens.
    serial = _run(serial=True, microbatches=4, **drop)
    out = {}
    for dispatcher in ("allgather", "alltoall"):
        result = _run(ep=ep, moe_token_dispatcher_type=dispatcher, **drop)
        local = result[0].reshape(1)
        gathered = [torch.empty_like(local) for _ in range(4)]
        dist.all_gather(gathered, local)
        out[dispatcher] = _errors((torch.stack(gathered).mean(), *result[1:]), serial)
    return out


@pytest.mark.parametrize("policy, pad", [("probs", False), ("position", False), ("probs", True)])
def test_dropping_at_ep4_equals_the_serial_model_on_the_same_micro_batches(dist_pool, policy, pad):
    for rank, by_dispatcher in enumerate(dist_pool.run(_dropping_against_serial_microbatches, 4, policy, pad)):
        for dispatcher, errors in by_dispatcher.items():
            assert errors["loss"] < 1e-5 and errors["grad"] < 1e-5, (rank, dispatcher, errors)


# ----------------------------------------------------------------------------- the alltoall traffic

def _starve_expert_3(model: GPTModel) -> None:
    """Every router's logit of expert 3 is -1e4: no token on any rank chooses it."""
    for layer in model.decoder.layers:
        router = layer.mlp.router
        router.gating = lambda x, gating=router.gating: gating(x).index_fill(-1, torch.tensor([3]), -1e4)


def _alltoall_counts():
    """Forward of one MoE layer at EP=4 (one expert per rank): the hidden-state rows the alltoall
    dispatcher sends off-rank, against the (token, expert) pairs whose expert lives on another rank."""
    init_parallel(ep=4)
    model = _model(1, 4, None, moe_token_dispatcher_type="alltoall")
    layer = model.decoder.layers[0].mlp
    rank = parallel_state.get_expert_model_parallel_rank()
    x = torch.randn(8, 2, HIDDEN, generator=torch.Generator().manual_seed(100 + rank))
    model.eval()
    with torch.no_grad():
        _, routing_map = layer.router(x)
        off_rank = int(routing_map.sum()) - int(routing_map[:, rank].sum())  # expert e lives on EP rank e
        with communication.count_communication() as counter:
            layer(x)
    events = [(e.group, e.numel) for e in counter.events if e.op == "all_to_all"]
    parallel_state.destroy_model_parallel()
    return {"events": events, "off_rank": off_rank}


def test_alltoall_sends_exactly_the_tokens_routed_off_rank(dist_pool):
    for rank, result in enumerate(dist_pool.run(_alltoall_counts)):
        counts, dispatch, combine = result["events"]  # the token counts, the tokens, the results back
        assert counts[1] == 3, (rank, result)  # one count per other rank
        assert dispatch[1] == result["off_rank"] * HIDDEN, (rank, result)
        assert result["off_rank"] > 0, rank


def _starved_against_ep1():
    reference = _run(ep=1, starve=True)
    out = {}
    for dispatcher in ("allgather", "alltoall"):
        result = _run(ep=4, starve=True, moe_token_dispatcher_type=dispatcher)
        errors = _errors(result, reference)
        errors["starved_grad"] = float(result[1]["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
                                       .abs().max())
        out[dispatcher] = errors
    return out


def test_a_starved_expert_neither_hangs_nor_changes_the_result(dist_pool):
    for rank, by_dispatcher in enumerate(dist_pool.run(_starved_against_ep1)):
        for dispatcher, errors in by_dispatcher.items():
            assert errors["loss"] < 1e-5 and errors["grad"] < 1e-5, (rank, dispatcher, errors)
            assert errors["starved_grad"] == 0.0, (rank, dispatcher, errors)  # a zero gradient, not None
