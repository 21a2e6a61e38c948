"""Expert parameters (`allreduce = False`) under data parallelism, on the pool's 4 gloo ranks: their
own grad buffers reduced over the expert-data-parallel group and scaled by 1/(dense DP x CP), the
distributed optimizer sharding them over that group (same steps as the plain optimizer, state
saved per expert-data-parallel root and loaded back), grad norms over all distinct parameters,
and the new expert process groups.

The toy model has a "dense" linear layer, replicated on every rank, and a two-matrix "expert"
whose weights differ per expert-parallel rank (seeded by it). Each rank's data depends only on
its dense data-parallel rank (tensor-parallel peers see the same tokens, as in a real model), so
the expected reduced gradient of every parameter follows from all ranks' local gradients:

    dense  main_grad = sum over the DP group of local grads / d              (d = DP x CP size)
    expert main_grad = sum over the expert-DP group of local grads / d

Layouts (world 4): EP=2 (DP 4, expert-DP 2); EP=4 (expert-DP 1: the expert bucket is still
scaled by 1/4); TP=2 with ETP=1 and EP=2 (DP 2, expert-DP 2); PP=2 x EP=2 with experts on one
stage only. Finally the real MoE GPT (megatron/model/moe) at DP=4: EP=2 logs the losses and
grad norms of EP=1, plain and distributed optimizer (a wrong expert scaling, 1/expert-DP, fails it).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer import params_norm
from tests.parallel.harness import init_parallel

HIDDEN, FFN, TOKENS, SEED = 8, 12, 6, 1234
LAYOUTS = {"ep2": dict(ep=2), "ep4": dict(ep=4), "tp2-etp1-ep2": dict(tp=2, etp=1, ep=2)}


class _Toy(nn.Module):
    """dense [h, h] + bias, then an expert MLP fc1 [ffn, h], fc2 [h, ffn] (per expert-parallel rank)."""

    def __init__(self, seed_offset: int = 0) -> None:
        super().__init__()
        torch.manual_seed(SEED + seed_offset)
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        torch.manual_seed(SEED + 1000 * (1 + ps.get_expert_model_parallel_rank()) + seed_offset)
        self.fc1 = nn.Parameter(torch.randn(FFN, HIDDEN) * 0.3)
        self.fc2 = nn.Parameter(torch.randn(HIDDEN, FFN) * 0.3)
        for param in (self.fc1, self.fc2):
            param.allreduce = False      # Megatron's marker: reduce over the expert-DP group
            param.expert_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)                                           # [t, h]
        # detached: the dense grads must not depend on this rank's experts, so tensor-parallel
        # peers (same tokens, other experts) hold equal dense grads, as in a real model
        y = torch.tanh(h.detach() @ self.fc1.t()) @ self.fc2.t()    # [t, ffn] -> [t, h]
        return h.pow(2).mean() + y.pow(2).mean()


def _tokens(step: int, micro: int) -> torch.Tensor:
    """[t, h]: this rank's micro-batch; it depends on the dense data-parallel rank only."""
    generator = torch.Generator().manual_seed(100 * step + 10 * micro + ps.get_data_parallel_rank())
    return torch.randn(TOKENS, HIDDEN, generator=generator)


def _ddp(model, distributed=False, overlap=False, bucket_size=None, average=False):
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
                                           use_distributed_optimizer=distributed, bucket_size=bucket_size,
                                           average_in_collective=average)
    model.config = _ModelConfig()
    return DistributedDataParallel(model.config, config, model)


class _ModelConfig:
    calculate_per_token_loss = False


def _backward(ddp, step: int, micro_batches: int = 2) -> None:
    """Micro-batches 0..n-2 under no_sync, the last one launching the buckets; then the DP reduction."""
    ddp.zero_grad_buffer()
    for micro in range(micro_batches):
        if micro < micro_batches - 1:
            with ddp.no_sync():
                ddp(_tokens(step, micro)).backward()
        else:
            ddp(_tokens(step, micro)).backward()
    finalize_model_grads([ddp])


def _local_grads(step: int, micro_batches: int = 2) -> dict:
    """This rank's unreduced gradients of the same model and data (no wrapper)."""
    model = _Toy()
    for micro in range(micro_batches):
        model(_tokens(step, micro)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _all_ranks(tensor: torch.Tensor) -> list:
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor.contiguous())
    return pieces


def _expected_grads(step: int) -> dict:
    """name -> the reduced gradient this rank should hold (module docstring)."""
    local = _local_grads(step)
    d = ps.get_data_parallel_world_size(with_context_parallel=True)
    dense_group = dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True))
    expert_group = ps.get_expert_data_parallel_group()
    expert_ranks = dist.get_process_group_ranks(expert_group) if expert_group is not None else [dist.get_rank()]
    expected = {}
    for name, grad in local.items():
        every = _all_ranks(grad)
        peers = expert_ranks if name.startswith("fc") else dense_group
        expected[name] = sum(every[r] for r in peers) / d
    return expected


def _distinct_grad_norm(expected: dict) -> float:
    """sqrt(|dense|^2 + sum over experts of |expert|^2): one copy of each distinct parameter."""
    dense = sum(expected[n].double().pow(2).sum() for n in ("dense.weight", "dense.bias"))
    mine = sum(expected[n].double().pow(2).sum() for n in ("fc1", "fc2")).reshape(1)
    every = _all_ranks(mine)
    # one representative per expert: the expert-parallel ranks of this rank's tp-ep-pp group (etp = 1 here)
    owners = dist.get_process_group_ranks(ps.get_expert_tensor_model_pipeline_parallel_group()) \
        if ps.get_expert_tensor_model_pipeline_parallel_group() is not None else [dist.get_rank()]
    experts = sum(every[r] for r in owners)
    return float((dense + experts).sqrt())


# ------------------------------------------------------------------ tasks

def _main_grads(layout: str, overlap: bool, bucket_size, average: bool):
    init_parallel(**LAYOUTS[layout])
    ddp = _ddp(_Toy(), overlap=overlap, bucket_size=bucket_size, average=average)
    _backward(ddp, step=0)
    expected = _expected_grads(0)
    errors = {name: (p.main_grad - expected[name]).abs().max().item() / expected[name].abs().max().item()
              for name, p in ddp.module.named_parameters()}
    return {"errors": errors, "expert_buffers": len(ddp.expert_parallel_buffers), "dense_buffers": len(ddp.buffers),
            "expert_dp": ddp.expert_data_parallel_world_size, "dp": ddp.data_parallel_world_size}


def _optimizer(ddp, clip_grad=1.0):
    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, adam_eps=1e-4, clip_grad=clip_grad,
                             log_num_zeros_in_grad=True)
    return get_megatron_optimizer(config, [ddp])


def _params(ddp) -> dict:
    ddp.finish_param_sync()
    return {name: p.detach().clone() for name, p in ddp.module.named_parameters()}


def _relative(got: dict, expected: dict) -> float:
    return max(((got[n] - v).abs().max() / v.abs().max()).item() for n, v in expected.items())


def _distributed_matches_plain(layout: str, steps: int = 3):
    init_parallel(**LAYOUTS[layout])
    plain = _ddp(_Toy())
    plain_optimizer = _optimizer(plain)
    sharded = _ddp(_Toy(), distributed=True, bucket_size=40)
    sharded_optimizer = _optimizer(sharded)
    out = {"param_errors": [], "norms": [], "zeros": []}
    for step in range(steps):
        expected_norm = _distinct_grad_norm(_expected_grads(step)) if step == 0 else None
        results = []
        for ddp, optimizer in ((plain, plain_optimizer), (sharded, sharded_optimizer)):
            optimizer.zero_grad()
            _backward(ddp, step)
            ok, norm, zeros = optimizer.step()
            results.append((ok, norm, zeros))
        out["param_errors"].append(_relative(_params(sharded), _params(plain)))
        out["norms"].append((results[0][1], results[1][1], expected_norm))
        out["zeros"].append((results[0][2], results[1][2]))
        out["ok"] = all(r[0] for r in results)
    out["params_norm"] = (params_norm([plain]), params_norm([sharded]),
                          _distinct_norm_of_params(plain))
    return out


def _distinct_norm_of_params(ddp) -> float:
    named = dict(ddp.module.named_parameters())
    dense = sum(named[n].detach().double().pow(2).sum() for n in ("dense.weight", "dense.bias"))
    mine = sum(named[n].detach().double().pow(2).sum() for n in ("fc1", "fc2")).reshape(1)
    every = _all_ranks(mine)
    owners = dist.get_process_group_ranks(ps.get_expert_tensor_model_pipeline_parallel_group())
    return float((dense + sum(every[r] for r in owners)).sqrt())


def _state_of(optimizer) -> dict:
    """Every owned shard's main param and Adam moments, by (buffer, start)."""
    out = {}
    for shard in optimizer.shards():
        state = optimizer.optimizer.state[shard.main]
        out[(shard.buffer_index, shard.start)] = torch.cat(
            [shard.main.detach(), state["exp_avg"], state["exp_avg_sq"]]).clone()
    return out


def _save_and_load(layout: str, directory: str):
    import os

    init_parallel(**LAYOUTS[layout])
    ddp = _ddp(_Toy(), distributed=True, bucket_size=40)
    optimizer = _optimizer(ddp)
    for step in range(2):
        optimizer.zero_grad()
        _backward(ddp, step)
        optimizer.step()
    # one directory per (TP, EP) rank, as the classic checkpoint's mp_rank_TT_EEE
    rank_dir = os.path.join(directory, f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_"
                                       f"{ps.get_expert_model_parallel_rank():03d}")
    os.makedirs(rank_dir, exist_ok=True)
    filename = os.path.join(rank_dir, "distrib_optim.pt")
    dist.barrier()
    checksum = optimizer.save_parameter_state(filename)
    dp_zero = optimizer.get_parameter_state_dp_zero()
    saved_buffers = None if dp_zero is None else sorted(k for k in dp_zero if isinstance(k, int))
    expert_buffers = None if dp_zero is None else dp_zero.get("expert_parallel_buffers")
    sd = optimizer.state_dict()
    before, params_before = _state_of(optimizer), _params(ddp)
    dist.barrier()

    fresh = _ddp(_Toy(seed_offset=7), distributed=True, bucket_size=40)
    fresh.load_state_dict(ddp.state_dict())
    fresh_optimizer = _optimizer(fresh)
    fresh_optimizer.load_state_dict(sd)
    fresh_optimizer.load_parameter_state(filename)
    after = _state_of(fresh_optimizer)
    state_error = max((after[k] - v).abs().max().item() for k, v in before.items()) if before else 0.0
    # one more step on both: the same params
    for opt, model in ((optimizer, ddp), (fresh_optimizer, fresh)):
        opt.zero_grad()
        _backward(model, 2)
        opt.step()
    return {"wrote": checksum is not None, "saved_buffers": saved_buffers, "expert_buffers": expert_buffers,
            "same_keys": sorted(after) == sorted(before), "state_error": state_error,
            "step_error": _relative(_params(fresh), _params(ddp)), "params_before": len(params_before),
            "global_rank": dist.get_rank()}


def _broadcast(layout: str):
    init_parallel(**LAYOUTS[layout])
    ddp = _ddp(_Toy(seed_offset=dist.get_rank()))  # a different draw everywhere
    ddp.broadcast_params()
    out = {}
    for name, param in ddp.module.named_parameters():
        group = ps.get_expert_data_parallel_group() if name.startswith("fc") else ps.get_data_parallel_group()
        every = _all_ranks(param.detach())
        ranks = dist.get_process_group_ranks(group)
        out[name] = {"equal_in_group": all(torch.equal(every[r], every[ranks[0]]) for r in ranks),
                     "differs_elsewhere": any(not torch.equal(every[r], param.detach())
                                              for r in range(dist.get_world_size()) if r not in ranks)}
    return out


def _expert_groups(tp: int, ep: int, etp):
    init_parallel(tp=tp, ep=ep, etp=etp)
    groups = {"etp": ps.get_expert_tensor_parallel_group(), "tp-ep": ps.get_expert_tensor_and_model_parallel_group(),
              "tp-ep-pp": ps.get_expert_tensor_model_pipeline_parallel_group()}
    return {"ranks": {name: dist.get_process_group_ranks(g) for name, g in groups.items()},
            "sizes": (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_and_model_parallel_world_size()),
            "ranks_in": (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_and_model_parallel_rank()),
            "etp_is_tp": groups["etp"] is ps.get_tensor_model_parallel_group(),
            "names": {name: ps.group_name(g) for name, g in groups.items()},
            "created": len(ps._STATE.created)}


class _DenseOnly(nn.Module):
    """A pipeline stage without MoE layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED + 1)
        self.dense = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x).pow(2).mean()


def _norm_from_main_grads(ddp) -> float:
    """sqrt of every distinct reduced gradient's square, straight from main_grad: dense ones counted
    on DP rank 0 of each stage, expert ones on expert-DP rank 0 (tp = 1 here)."""
    mine = torch.zeros(1, dtype=torch.float64)
    for param in ddp.module.parameters():
        expert = not getattr(param, "allreduce", True)
        if (ps.get_expert_data_parallel_rank() if expert else ps.get_data_parallel_rank()) == 0:
            mine += param.main_grad.double().pow(2).sum()
    return float(sum(_all_ranks(mine)).sqrt())


def _stage_without_experts():
    """PP = 2 x EP = 2: only stage 0 holds experts; stage 1 must still join the expert norm's reduction."""
    init_parallel(pp=2, ep=2)
    out = {}
    for distributed in (False, True):
        model = _Toy() if ps.is_pipeline_first_stage() else _DenseOnly()
        ddp = _ddp(model, distributed=distributed)
        optimizer = _optimizer(ddp, clip_grad=1e9)
        optimizer.zero_grad()
        _backward(ddp, 0)
        direct = None if distributed else _norm_from_main_grads(ddp)
        ok, norm, _ = optimizer.step()
        out["sharded" if distributed else "plain"] = norm
        out["direct"] = direct if direct is not None else out["direct"]
        out["has_experts"] = optimizer.has_expert_params
        out["params_norm_" + ("sharded" if distributed else "plain")] = params_norm([ddp])
    return out


def _moe_gpt_run(ep: int, distributed: bool, steps: int = 3):
    """A 2-layer MoE GPT (4 experts, top-2, no capacity) at DP = 4 with EP = ep: (losses, grad norms,
    router weights). The experts are the same functions at every EP, so the run must not depend on it."""
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import schedules
    from megatron.model import GPTModel, TransformerConfig
    from tests.helpers import dp_gpt

    init_parallel(ep=ep)
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, hidden_dropout=0.0,
                               attention_dropout=0.0, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                               expert_model_parallel_size=ep, add_bias_linear=False)
    model = GPTModel(config, vocab_size=256, max_sequence_length=8)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                        use_distributed_optimizer=distributed), model)
    optimizer = _optimizer(ddp, clip_grad=1.0)
    rank, d = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    losses, norms = [], []
    for step in range(steps):
        batches = dp_gpt.microbatches(step, 4)[rank * 4 // d:(rank + 1) * 4 // d]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out = schedules.get_forward_backward_func()(
            forward_step_func=dp_gpt.forward_step, data_iterator=iter(batches), model=[ddp],
            num_microbatches=len(batches), seq_length=8, micro_batch_size=2, grad_scale_func=optimizer.scale_loss,
            finalize_model_grads_func=finalize_model_grads)
        loss = torch.tensor([sum(x["lm loss"].item() for x in out) / len(out)], dtype=torch.float64)
        dist.all_reduce(loss)
        ok, norm, _ = optimizer.step()
        losses.append(loss.item() / dist.get_world_size())
        norms.append(norm)
    routers = {n: p.detach().clone() for n, p in ddp.module.named_parameters() if "router" in n}
    return {"losses": losses, "norms": norms, "routers": routers,
            "expert_buffers": len(ddp.expert_parallel_buffers)}


def _inf_in_expert_grads(distributed: bool):
    """fp16 loss scaling at EP = 2: an inf in EP rank 1's expert gradient (on both of its expert-DP
    replicas, as a reduced gradient would be) must make every rank skip the step."""
    init_parallel(ep=2)
    ddp = _ddp(_Toy(), distributed=distributed)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, fp16=True, initial_loss_scale=1024.0, hysteresis=1)
    optimizer = get_megatron_optimizer(config, [ddp])
    before = _params(ddp)
    optimizer.zero_grad()
    _backward(ddp, 0)
    if ps.get_expert_model_parallel_rank() == 1:
        ddp.module.fc1.main_grad[0, 0] = float("inf")
    ok, _, _ = optimizer.step()
    after = _params(ddp)
    return {"ok": ok, "scale": optimizer.get_loss_scale().item(),
            "unchanged": all(torch.equal(before[n], after[n]) for n in before)}


# ------------------------------------------------------------------ tests

@pytest.mark.parametrize("layout,overlap,bucket_size,average", [
    ("ep2", False, None, False), ("ep2", True, 40, False), ("ep4", True, 40, False),
    ("tp2-etp1-ep2", False, None, False), ("ep2", False, None, True), ("ep4", False, None, True)])
def test_expert_main_grad_is_the_expert_dp_sum_over_d(dist_pool, layout, overlap, bucket_size, average):
    for got in dist_pool.run(_main_grads, layout, overlap, bucket_size, average):
        assert got["expert_buffers"] == 1 and got["dense_buffers"] == 1
        assert max(got["errors"].values()) < 1e-6, got["errors"]


@pytest.mark.parametrize("layout", ["ep2", "tp2-etp1-ep2"])
def test_distributed_optimizer_steps_like_the_plain_one(dist_pool, layout):
    results = dist_pool.run(_distributed_matches_plain, layout)
    for got in results:
        assert got["ok"]
        assert max(got["param_errors"]) < 1e-6, got["param_errors"]
        for plain, sharded, direct in got["norms"]:
            assert sharded == pytest.approx(plain, rel=1e-6)
            if direct is not None:
                assert plain == pytest.approx(direct, rel=1e-6)
        assert all(plain == sharded for plain, sharded in got["zeros"])
        plain, sharded, direct = got["params_norm"]
        assert plain == pytest.approx(direct, rel=1e-9) and sharded == pytest.approx(direct, rel=1e-6)
    # every rank reports the same global norm
    assert len({round(got["norms"][0][0], 9) for got in results}) == 1


@pytest.mark.parametrize("layout", ["ep2", "tp2-etp1-ep2"])
def test_distributed_optimizer_state_round_trip(dist_pool, tmp_path, layout):
    results = dist_pool.run(_save_and_load, layout, str(tmp_path))
    for got in results:
        assert got["same_keys"] and got["state_error"] == 0.0
        assert got["step_error"] < 1e-6
    writers = {got["global_rank"]: got["saved_buffers"] for got in results if got["wrote"]}
    # buffers: 0 dense, 1 expert. ep2 (DP [0..3], expert-DP [0, 2] [1, 3]): rank 0 saves both,
    # rank 1 (expert-DP root of EP rank 1) the expert buffer; tp2-etp1-ep2 (DP [0, 2] [1, 3],
    # expert-DP [0, 2] [1, 3]): ranks 0 and 1 save both, into their own directories.
    assert writers == ({0: [0, 1], 1: [1]} if layout == "ep2" else {0: [0, 1], 1: [0, 1]})
    assert all(got["expert_buffers"] == [1] for got in results if got["wrote"])


def test_broadcast_params_over_expert_data_parallel_group(dist_pool):
    for got in dist_pool.run(_broadcast, "ep2"):
        assert all(entry["equal_in_group"] for entry in got.values()), got
        assert got["fc1"]["differs_elsewhere"] and not got["dense.weight"]["differs_elsewhere"]


def test_expert_groups_on_four_ranks(dist_pool):
    # tp = etp = 2, ep = 2 needs 8 ranks: here tp 2 / etp 2 / ep 1 and tp 2 / etp 1 / ep 2
    same = dist_pool.run(_expert_groups, 2, 1, None)
    for rank, got in enumerate(same):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert got["ranks"] == {"etp": pair, "tp-ep": pair, "tp-ep-pp": pair}
        assert got["etp_is_tp"] and got["names"]["etp"] == "tp"  # reused, not created twice
        assert got["sizes"] == (2, 2) and got["ranks_in"] == (rank % 2, rank % 2)
    split = dist_pool.run(_expert_groups, 2, 2, 1)
    for rank, got in enumerate(split):
        pair = [rank - rank % 2, rank - rank % 2 + 1]  # expert grid (etp 1, ep 2, expert-dp 2)
        assert got["ranks"] == {"etp": [rank], "tp-ep": pair, "tp-ep-pp": pair}
        assert got["sizes"] == (1, 2) and got["ranks_in"] == (0, rank % 2)
        assert got["names"]["tp-ep"] == "tp"  # the same ranks as the TP group: that group, lent
    # the 12 older kinds made one group each on every rank; the three expert kinds only borrowed
    assert {got["created"] for got in same + split} == {12}


def test_pipeline_stage_without_experts_joins_the_expert_norm(dist_pool):
    results = dist_pool.run(_stage_without_experts)
    for got in results:
        assert got["has_experts"]  # agreed over the pipeline, also on the dense-only stage
        assert got["plain"] == pytest.approx(got["direct"], rel=1e-6)
        assert got["sharded"] == pytest.approx(got["direct"], rel=1e-6)
    assert len({round(got["plain"], 9) for got in results}) == 1
    assert len({round(got["params_norm_plain"], 9) for got in results}) == 1


@pytest.mark.parametrize("distributed", [False, True])
def test_moe_gpt_at_ep2_takes_the_ep1_steps(dist_pool, distributed):
    reference = dist_pool.run(_moe_gpt_run, 1, distributed)
    expert_parallel = dist_pool.run(_moe_gpt_run, 2, distributed)
    for ref, got in zip(reference, expert_parallel):
        assert got["expert_buffers"] == 1 and ref["expert_buffers"] == 1
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        for name, value in ref["routers"].items():
            assert torch.allclose(got["routers"][name], value, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("distributed", [False, True])
def test_inf_in_one_expert_skips_the_step_everywhere(dist_pool, distributed):
    for got in dist_pool.run(_inf_in_expert_grads, distributed):
        assert got == {"ok": False, "scale": 512.0, "unchanged": True}
