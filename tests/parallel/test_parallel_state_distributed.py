"""parallel_state on 4 real gloo ranks: the groups it creates match the RankGenerator arithmetic,
collectives on them reach exactly the intended peers, bad sizes fail everywhere before any
group exists; and the harness itself reports failures, keeps rank order and recovers."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import RankGenerator
from tests.parallel.harness import DistributedPool, WorkerError, init_parallel

WORLD = 4
LAYOUTS = [(1, 1, "tp-cp-ep-dp-pp"), (2, 1, "tp-cp-ep-dp-pp"), (4, 1, "tp-cp-ep-dp-pp"),
           (2, 2, "tp-cp-ep-dp-pp"), (1, 4, "tp-cp-ep-dp-pp"), (1, 2, "tp-cp-ep-dp-pp"),
           (2, 2, "tp-cp-ep-pp-dp"), (1, 2, "tp-cp-ep-pp-dp")]


# --------------------------------------------------------------------------- tasks (run in workers)

def _groups() -> dict:
    groups = {"tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
              "dp": ps.get_data_parallel_group(), "dp-cp": ps.get_data_parallel_group(with_context_parallel=True),
              "cp": ps.get_context_parallel_group(), "mp": ps.get_model_parallel_group(),
              "tp-dp": ps.get_tensor_and_data_parallel_group(), "ep": ps.get_expert_model_parallel_group(),
              "expert-dp": ps.get_expert_data_parallel_group()}
    if ps.is_rank_in_embedding_group(ignore_virtual=True):
        groups["embd"] = ps.get_embedding_group()
    if ps.is_rank_in_position_embedding_group():
        groups["pos-embd"] = ps.get_position_embedding_group()
    return groups


def _layout(tp, pp, order):
    init_parallel(tp=tp, pp=pp, order=order)
    groups = _groups()
    return {
        "global_rank": dist.get_rank(),
        "ranks": {name: dist.get_process_group_ranks(group) for name, group in groups.items()},
        "dist_rank": {name: dist.get_rank(group) for name, group in groups.items()},
        "names": {name: ps.group_name(group) for name, group in groups.items()},
        "world_name": ps.group_name(dist.group.WORLD),
        "size": {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
                 "dp": ps.get_data_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
                 "dp-cp": ps.get_data_parallel_world_size(with_context_parallel=True),
                 "ep": ps.get_expert_model_parallel_world_size(),
                 "expert-dp": ps.get_expert_data_parallel_world_size()},
        "rank": {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                 "dp": ps.get_data_parallel_rank(), "cp": ps.get_context_parallel_rank(),
                 "dp-cp": ps.get_data_parallel_rank(with_context_parallel=True),
                 "ep": ps.get_expert_model_parallel_rank(), "expert-dp": ps.get_expert_data_parallel_rank()},
        "tp_src": ps.get_tensor_model_parallel_src_rank(), "dp_src": ps.get_data_parallel_src_rank(),
        "pp_first": ps.get_pipeline_model_parallel_first_rank(), "pp_last": ps.get_pipeline_model_parallel_last_rank(),
        "pp_next": ps.get_pipeline_model_parallel_next_rank(), "pp_prev": ps.get_pipeline_model_parallel_prev_rank(),
        "first_stage": ps.is_pipeline_first_stage(), "last_stage": ps.is_pipeline_last_stage(),
        "in_embd": ps.is_rank_in_embedding_group(), "in_pos_embd": ps.is_rank_in_position_embedding_group(),
    }


def _all_reduce_over(tp, pp, order):
    """Each rank contributes 10 ** rank, so a sum shows exactly which ranks took part."""
    init_parallel(tp=tp, pp=pp, order=order)
    out = {}
    for name, group in (("tp", ps.get_tensor_model_parallel_group()), ("dp", ps.get_data_parallel_group()),
                        ("pp", ps.get_pipeline_model_parallel_group())):
        value = torch.tensor([10.0 ** dist.get_rank()], dtype=torch.float64)
        dist.all_reduce(value, group=group)
        out[name] = value.item()
    return out


def _invalid_init(kwargs):
    """The ValueError, the new_group calls made before it, and whether state was left behind."""
    calls = []
    original = dist.new_group
    dist.new_group = lambda *args, **kw: calls.append(args) or original(*args, **kw)
    try:
        init_parallel(**kwargs)
        message = None
    except ValueError as error:
        message = str(error)
    finally:
        dist.new_group = original
    return message, len(calls), ps.model_parallel_is_initialized()


def _init_twice():
    init_parallel(tp=2)
    try:
        init_parallel(tp=2)
    except RuntimeError as error:
        return str(error)
    return None


def _virtual_stages():
    init_parallel(pp=4, vpp=2)
    out = []
    for chunk in range(2):
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        out.append((ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(),
                    ps.is_pipeline_first_stage(ignore_virtual=True), ps.is_rank_in_embedding_group(),
                    ps.is_rank_in_embedding_group(ignore_virtual=True)))
    return ps.get_virtual_pipeline_model_parallel_world_size(), out


def _uninitialised_layout():
    """Before initialize_model_parallel: every rank its own model, DP over the whole world."""
    try:
        ps.get_tensor_model_parallel_group()
        tp_group_error = None
    except RuntimeError as error:
        tp_group_error = str(error)
    own = dist.new_group([0, 1])  # not parallel_state's
    return (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(), ps.group_name(ps.get_data_parallel_group()), tp_group_error,
            ps.group_name(own) if dist.get_rank() < 2 else None)


def _raise_on_rank_2():
    if dist.get_rank() == 2:
        raise KeyError("boom from rank 2")
    return dist.get_rank()


def _echo(x, *, y):
    return dist.get_rank(), dist.get_world_size(), x, y, os.getpid(), torch.get_num_threads()


def _init_and_leave():
    init_parallel(tp=2, pp=2)  # not destroyed here: the harness must do it
    return ps.model_parallel_is_initialized()


def _state_is_clean():
    return ps.model_parallel_is_initialized(), ps.get_tensor_model_parallel_world_size()


def _sleep_on_rank_1(seconds):
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return os.getpid()


def _raise_on_rank_1_before_all_reduce():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes
    return "unreachable"


def _exit_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


# --------------------------------------------------------------------------- expectations

def _group_of(groups, rank):
    return next(group for group in groups if rank in group)


def _expected(tp, pp, order, rank):
    gen = RankGenerator(tp=tp, ep=1, dp=WORLD // (tp * pp), pp=pp, cp=1, order=order)
    ranks = {name: _group_of(gen.get_ranks(token), rank) for name, token in
             (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("dp-cp", "dp-cp"), ("cp", "cp"), ("mp", "tp-pp"),
              ("tp-dp", "tp-dp"), ("expert-dp", "dp"))}
    ranks["ep"] = [rank]
    pp_group = ranks["pp"]
    embedding = [pp_group[0], pp_group[-1]] if pp > 1 else [pp_group[0]]
    if rank in embedding:
        ranks["embd"] = embedding
    if rank == pp_group[0]:
        ranks["pos-embd"] = [rank]
    return ranks


@pytest.mark.parametrize("tp,pp,order", LAYOUTS)
def test_groups_match_rank_arithmetic(dist_pool, tp, pp, order):
    for rank, got in enumerate(dist_pool.run(_layout, tp, pp, order)):
        assert got["global_rank"] == rank
        expected = _expected(tp, pp, order, rank)
        assert got["ranks"] == expected
        assert got["dist_rank"] == {name: group.index(rank) for name, group in expected.items()}
        assert got["names"] == {name: name for name in expected}
        assert got["world_name"] == "world"
        assert got["size"] == {name: len(expected[name]) for name in got["size"]}
        assert got["rank"] == {name: expected[name].index(rank) for name in got["rank"]}
        assert got["tp_src"] == expected["tp"][0] and got["dp_src"] == expected["dp"][0]
        pp_group = expected["pp"]
        stage = pp_group.index(rank)
        assert (got["pp_first"], got["pp_last"]) == (pp_group[0], pp_group[-1])
        assert got["pp_next"] == pp_group[(stage + 1) % pp] and got["pp_prev"] == pp_group[(stage - 1) % pp]
        assert (got["first_stage"], got["last_stage"]) == (stage == 0, stage == pp - 1)
        assert got["in_embd"] == (stage in (0, pp - 1))
        assert got["in_pos_embd"] == (stage == 0)


def test_default_order_groups_by_hand(dist_pool):
    # tp=2, pp=2 on 4 ranks: TP peers adjacent, PP stages farthest apart, DP of size 1.
    results = dist_pool.run(_layout, 2, 2, "tp-cp-ep-dp-pp")
    assert [r["ranks"]["tp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["ranks"]["pp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["ranks"]["dp"] for r in results] == [[0], [1], [2], [3]]
    assert [r["ranks"]["mp"] for r in results] == [[0, 1, 2, 3]] * 4


@pytest.mark.parametrize("tp,pp,order", [(1, 1, "tp-cp-ep-dp-pp"), (2, 1, "tp-cp-ep-dp-pp"),
                                         (4, 1, "tp-cp-ep-dp-pp"), (2, 2, "tp-cp-ep-dp-pp"),
                                         (1, 2, "tp-cp-ep-dp-pp"), (2, 2, "tp-cp-ep-pp-dp")])
def test_all_reduce_reaches_only_group_peers(dist_pool, tp, pp, order):
    for rank, got in enumerate(dist_pool.run(_all_reduce_over, tp, pp, order)):
        expected = _expected(tp, pp, order, rank)
        for name in ("tp", "dp", "pp"):
            assert got[name] == sum(10.0 ** peer for peer in expected[name]), name


@pytest.mark.parametrize("kwargs,message", [
    (dict(tp=3), "world size (4) is not divisible by tensor (3) x pipeline (1) x context (1) = 3"),
    (dict(tp=2, pp=4), "world size (4) is not divisible by tensor (2) x pipeline (4) x context (1) = 8"),
    (dict(tp=0), "tensor_model_parallel_size must be a positive integer, got 0"),
    (dict(ep=3), "world size (4) is not divisible by expert tensor (1) x expert (3) x pipeline (1) = 3"),
    (dict(pp=2, order="tp-dp"), "order 'tp-dp' leaves out pp whose size is 2"),
    (dict(tp=2, pp=2, etp=1, order="tp-cp-ep-pp-dp"), "puts pipeline stages on different ranks"),
])
def test_invalid_sizes_raise_everywhere_before_any_group(dist_pool, kwargs, message):
    for got_message, new_group_calls, initialized in dist_pool.run(_invalid_init, kwargs):
        assert got_message is not None and message in got_message
        assert new_group_calls == 0 and not initialized


def test_double_initialize_is_an_error(dist_pool):
    assert all("already initialized" in message for message in dist_pool.run(_init_twice))


def test_virtual_stages_refine_first_and_last(dist_pool):
    results = dist_pool.run(_virtual_stages)
    assert all(size == 2 for size, _ in results)
    # chunk 0: (first, last, first ignoring virtual, in embedding, in embedding ignoring virtual)
    stages = [chunks for _, chunks in results]
    assert stages[0] == [(True, False, True, True, True), (False, False, True, False, True)]
    assert stages[1] == [(False, False, False, False, False)] * 2
    assert stages[3] == [(False, False, False, False, True), (False, True, False, True, True)]


def test_uninitialised_accessors_give_the_trivial_layout(dist_pool):
    for rank, got in enumerate(dist_pool.run(_uninitialised_layout)):
        assert got[:5] == (WORLD, rank, 1, 0, "world")
        assert "the tp process group is not initialized" in got[5]
        assert got[6] == ("other" if rank < 2 else None)


# --------------------------------------------------------------------------- the harness itself

def test_results_in_rank_order_with_arguments(dist_pool):
    results = dist_pool.run(_echo, [1, 2], y="why")
    assert [r[:4] for r in results] == [(rank, WORLD, [1, 2], "why") for rank in range(WORLD)]
    assert len({r[4] for r in results}) == WORLD  # one process per rank
    assert all(r[5] == 1 for r in results)  # one thread per worker


def test_failure_on_one_rank_names_it_and_pool_survives(dist_pool):
    pids = [r[4] for r in dist_pool.run(_echo, 0, y=0)]
    with pytest.raises(WorkerError) as caught:
        dist_pool.run(_raise_on_rank_2)
    text = str(caught.value)
    assert sorted(caught.value.failures) == [2]
    assert "failed on rank 2 of 4" in text and "--- rank 2 ---" in text
    assert "Traceback (most recent call last)" in text and "_raise_on_rank_2" in text
    assert "KeyError: 'boom from rank 2'" in text
    assert "rank 0" not in text and "did not answer" not in text
    # Same processes, next task runs normally.
    assert [r[4] for r in dist_pool.run(_echo, 0, y=0)] == pids


def test_parallel_state_reset_between_tasks(dist_pool):
    assert dist_pool.run(_init_and_leave) == [True] * WORLD
    assert dist_pool.run(_state_is_clean) == [(False, 1)] * WORLD


def test_unpicklable_task_is_refused(dist_pool):
    with pytest.raises(TypeError, match="module-level function"):
        dist_pool.run(lambda: 1)


@pytest.fixture(scope="module")
def small_pool():
    # a 60 s task timeout, far from the 0.5 s grace, so a busy machine cannot blur the two; the
    # silent-rank test shortens it to 3 s for its own task
    pool = DistributedPool(2, timeout_s=60, failure_grace_s=0.5)
    yield pool
    pool.close()


def test_silent_rank_times_out_and_pool_restarts(small_pool):
    before = small_pool.run(_sleep_on_rank_1, 0)
    small_pool.timeout_s = 3
    start = time.monotonic()
    try:
        with pytest.raises(WorkerError) as caught:
            small_pool.run(_sleep_on_rank_1, 600)
    finally:
        small_pool.timeout_s = 60
    # The 3 s timeout, not rank 1's 600 s sleep, ended the task. The margin is wide because the
    # kill and its joins are scheduled like everything else: a run with every core busy once took 58 s.
    assert time.monotonic() - start < 120
    assert caught.value.silent == (1,)
    assert "rank 1 did not answer in time (timeout 3 s)" in str(caught.value)
    assert "rank 0 finished but waited for the others" in str(caught.value)
    after = small_pool.run(_sleep_on_rank_1, 0)
    assert set(after).isdisjoint(before)  # a fresh set of workers


def test_dead_worker_is_reported_and_pool_restarts(small_pool):
    with pytest.raises(WorkerError) as caught:
        small_pool.run(_exit_on_rank_1)
    assert caught.value.dead == {1: 3}
    assert "rank 1 died (exit code 3)" in str(caught.value)
    assert small_pool.run(_echo, 5, y=6)[1][:4] == (1, 2, 5, 6)


def test_failure_leaving_peers_in_a_collective_does_not_wait_for_the_timeout(small_pool):
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        small_pool.run(_raise_on_rank_1_before_all_reduce)
    assert time.monotonic() - start < 30  # the 0.5 s grace period, not the 60 s timeout
    assert sorted(caught.value.failures) == [1] and caught.value.silent == (0,)
    assert "ValueError: rank 1 gives up" in str(caught.value)
    assert small_pool.run(_echo, 1, y=2)[0][:4] == (0, 2, 1, 2)
