"""Rank arithmetic of parallel_state, without any process group: RankGenerator and
generate_masked_orthogonal_rank_groups against Megatron's documented example and against
independent reference implementations; validation errors; the single-process layout."""

import itertools

import pytest

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import RankGenerator, generate_masked_orthogonal_rank_groups

ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]
AXES = ["tp", "cp", "ep", "dp", "pp"]


@pytest.fixture(autouse=True)
def clean_state():
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


def reference_groups(sizes: dict, order: str, token: str) -> list[list[int]]:
    """Groups by direct index arithmetic: decompose every rank into per-axis coordinates (first
    axis of `order` fastest) and put together the ranks that agree on every axis not in `token`."""
    names = order.split("-")
    by_key = {}
    world = 1
    for name in names:
        world *= sizes[name]
    for rank in range(world):
        coords, rest = {}, rank
        for name in names:
            coords[name] = rest % sizes[name]
            rest //= sizes[name]
        key = tuple(coords[name] for name in names if name not in token.split("-"))
        by_key.setdefault(key, []).append(rank)
    return sorted(by_key.values())


def classic_megatron_groups(world: int, tp: int, pp: int) -> dict:
    """The loops of Megatron's original initialize_model_parallel (cp = ep = 1, order tp-dp-pp)."""
    per_stage = world // pp
    dp = [list(range(stage * per_stage + j, (stage + 1) * per_stage, tp)) for stage in range(pp) for j in range(tp)]
    tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]
    pp_groups = [list(range(i, world, per_stage)) for i in range(per_stage)]
    return {"dp": dp, "tp": tp_groups, "pp": pp_groups}


# --------------------------------------------------------------------------- the documented example

def test_docstring_example_16_ranks_tp2_pp4():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=4, cp=1, order="tp-cp-ep-dp-pp")
    assert gen.world_size == 16
    assert gen.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert gen.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert gen.get_ranks("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert gen.get_ranks("tp-pp") == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert gen.get_ranks("tp-dp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert gen.get_ranks("cp") == [[rank] for rank in range(16)]


def test_docstring_example_of_masked_groups():
    # sizes [tp=2, dp=3, pp=2], dp varying: rank = tp_rank + 2 * dp_rank + 6 * pp_rank
    assert generate_masked_orthogonal_rank_groups(12, [2, 3, 2], [False, True, False]) == \
        [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert generate_masked_orthogonal_rank_groups(12, [2, 3, 2], [True, False, True]) == \
        [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]
    assert generate_masked_orthogonal_rank_groups(12, [2, 3, 2], [True, True, True]) == [list(range(12))]
    assert generate_masked_orthogonal_rank_groups(12, [2, 3, 2], [False] * 3) == [[r] for r in range(12)]


def test_alternative_order_puts_pp_before_dp():
    # --use-tp-pp-dp-mapping: 8 ranks, tp=2, pp=2, dp=2 -> pp stride 2, dp stride 4
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-pp-dp")
    assert gen.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert gen.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


# --------------------------------------------------------------------------- against references

SIZE_GRID = list(itertools.product([1, 2, 4], [1, 2], [1, 2], [1, 2, 3], [1, 2, 4]))  # tp, cp, ep, dp, pp
TOKENS = ["-".join(names) for n in range(1, 6) for names in itertools.combinations(AXES, n)]


@pytest.mark.parametrize("order", ORDERS)
def test_every_token_matches_reference_over_many_layouts(order):
    checked = 0
    for tp, cp, ep, dp, pp in SIZE_GRID:
        sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
        gen = RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order)
        assert gen.world_size == tp * cp * ep * dp * pp
        for token in TOKENS:
            groups = gen.get_ranks(token)
            assert groups == reference_groups(sizes, order, token), (sizes, order, token)
            # the groups partition the world
            assert sorted(itertools.chain.from_iterable(groups)) == list(range(gen.world_size))
            checked += 1
    assert checked == len(SIZE_GRID) * 31


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 8), (2, 1, 4), (8, 1, 1), (2, 4, 2), (1, 4, 4), (4, 2, 2), (2, 2, 3)])
def test_tp_dp_pp_match_classic_megatron_loops(tp, pp, dp):
    world = tp * pp * dp
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    classic = classic_megatron_groups(world, tp, pp)
    for token in ("dp", "tp", "pp"):
        assert sorted(gen.get_ranks(token)) == sorted(classic[token]), token


def test_rank_offset_shifts_every_rank():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp", rank_offset=8)
    assert gen.get_ranks("tp") == [[8, 9], [10, 11]]
    assert gen.get_ranks("dp") == [[8, 10], [9, 11]]


def test_size_one_axes_left_out_are_appended():
    gen = RankGenerator(tp=2, ep=1, dp=3, pp=1, cp=1, order="dp-tp")
    assert gen.order == "dp-tp-cp-ep-pp"
    assert gen.get_ranks("dp") == [[0, 1, 2], [3, 4, 5]]  # dp now varies fastest
    assert gen.get_ranks("tp") == [[0, 3], [1, 4], [2, 5]]


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("kwargs,order,message", [
    (dict(pp=2), "tp-cp-ep-dp", "order 'tp-cp-ep-dp' leaves out pp whose size is 2"),
    ({}, "tp-xx-dp", "order 'tp-xx-dp' must be distinct axes"),
    ({}, "tp-dp-tp", "order 'tp-dp-tp' must be distinct axes"),
    (dict(tp=0), "tp-cp-ep-dp-pp", "tensor parallel size (tp) must be a positive integer, got 0"),
    (dict(dp=2.0), "tp-cp-ep-dp-pp", "data parallel size (dp) must be a positive integer, got 2.0"),
])
def test_rank_generator_rejects_bad_layouts(kwargs, order, message):
    sizes = dict(tp=1, ep=1, dp=1, pp=1, cp=1) | kwargs
    with pytest.raises(ValueError) as caught:
        RankGenerator(**sizes, order=order)
    assert message in str(caught.value)


def test_rank_generator_rejects_unknown_tokens():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    with pytest.raises(ValueError, match="rank token 'tp-mp'"):
        gen.get_ranks("tp-mp")


def test_masked_groups_reject_inconsistent_sizes():
    with pytest.raises(ValueError, match=r"world size \(10\) is not the product of the parallel sizes \[2, 3\] = 6"):
        generate_masked_orthogonal_rank_groups(10, [2, 3], [True, False])
    with pytest.raises(ValueError, match="differ in length"):
        generate_masked_orthogonal_rank_groups(6, [2, 3], [True])
    with pytest.raises(ValueError, match="positive integers"):
        generate_masked_orthogonal_rank_groups(0, [0, 3], [True, False])


@pytest.mark.parametrize("world,sizes,message", [
    (6, dict(tp=4, pp=1, cp=1, ep=1, etp=4),
     "world size (6) is not divisible by tensor (4) x pipeline (1) x context (1) = 4"),
    (8, dict(tp=2, pp=2, cp=4, ep=1, etp=2),
     "world size (8) is not divisible by tensor (2) x pipeline (2) x context (4) = 16"),
    (8, dict(tp=2, pp=1, cp=1, ep=3, etp=2),
     "world size (8) is not divisible by expert tensor (2) x expert (3) x pipeline (1) = 6"),
    (8, dict(tp=2, pp=2, cp=1, ep=1, etp=1, order="tp-cp-ep-pp-dp"),
     "order 'tp-cp-ep-pp-dp' puts pipeline stages on different ranks for dense layers (tensor (2) x context (1))"),
])
def test_layout_errors_name_the_sizes(world, sizes, message):
    sizes.setdefault("order", "tp-cp-ep-dp-pp")
    with pytest.raises(ValueError) as caught:
        ps._plan_rank_groups(world, **sizes)
    assert message in str(caught.value)


def test_plan_embedding_and_expert_groups():
    plan = ps._plan_rank_groups(16, tp=2, pp=4, cp=1, ep=1, etp=2, order="tp-cp-ep-dp-pp")
    assert plan["embd"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert plan["pos-embd"] == [[0], [1], [2], [3]]
    assert plan["mp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert plan["dp-cp"] == plan["dp"]
    assert plan["embd"] == [[g[0], g[-1]] for g in plan["pp"]]
    # 8 ranks, tp=2, ep=2: the expert grid is (etp=2, ep=2, expert-dp=2)
    experts = ps._plan_rank_groups(8, tp=2, pp=1, cp=1, ep=2, etp=2, order="tp-cp-ep-dp-pp")
    assert experts["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert experts["expert-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert experts["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # dense layers see ep as 1
    # pp = 1: the embedding group is the rank itself
    assert ps._plan_rank_groups(2, tp=1, pp=1, cp=1, ep=1, etp=1, order="tp-cp-ep-dp-pp")["embd"] == [[0], [1]]


# --------------------------------------------------------------------------- one process, no dist

def test_single_process_layout_without_torch_distributed():
    assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel()
    assert ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_group() is None and ps.get_data_parallel_group() is None
    assert ps.get_model_parallel_group() is None and ps.get_embedding_group() is None
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()) == (1, 0)
    assert (ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()) == (1, 0)
    assert (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()) == (1, 0)
    assert ps.get_data_parallel_world_size(with_context_parallel=True) == 1
    assert ps.get_expert_model_parallel_world_size() == 1 and ps.get_context_parallel_world_size() == 1
    assert ps.get_pipeline_model_parallel_next_rank() == 0 == ps.get_pipeline_model_parallel_prev_rank()
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.is_rank_in_embedding_group() and ps.is_rank_in_position_embedding_group()
    with pytest.raises(RuntimeError, match="already initialized"):
        ps.initialize_model_parallel()
    ps.destroy_model_parallel()
    ps.destroy_model_parallel()  # safe to repeat
    assert not ps.model_parallel_is_initialized()


def test_uninitialised_accessors_give_the_trivial_layout():
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_data_parallel_world_size() == 1
    assert ps.get_data_parallel_rank() == 0 and ps.get_data_parallel_group() is None
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()


@pytest.mark.parametrize("kwargs,message", [
    (dict(tensor_model_parallel_size=2), "every parallel size must be 1; got tensor (2), pipeline (1)"),
    (dict(pipeline_model_parallel_size=0), "pipeline_model_parallel_size must be a positive integer, got 0"),
    (dict(virtual_pipeline_model_parallel_size=0), "virtual_pipeline_model_parallel_size must be a positive"),
    (dict(order="tp-dp-xx"), "order 'tp-dp-xx' must be distinct axes"),
])
def test_single_process_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError) as caught:
        ps.initialize_model_parallel(**kwargs)
    assert message in str(caught.value)
    assert not ps.model_parallel_is_initialized()


def test_virtual_pipeline_rank_and_size():
    ps.initialize_model_parallel(virtual_pipeline_model_parallel_size=2)
    assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
    assert ps.get_virtual_pipeline_model_parallel_rank() == 0
    assert ps.is_pipeline_first_stage() and not ps.is_pipeline_last_stage()
    ps.set_virtual_pipeline_model_parallel_rank(1)
    assert not ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.is_pipeline_first_stage(ignore_virtual=True)
    ps.destroy_model_parallel()
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None


def test_group_name_of_unknown_groups():
    assert ps.group_name(None) == "world"
    assert ps.group_name(object()) == "other"


# --------------------------------------------------------------------------- expert groups

@pytest.mark.parametrize("etp,expected", [
    # expert grid (etp=2, ep=2, expert-dp=2): rank = etp_rank + 2 * ep_rank + 4 * edp_rank
    (2, {"etp": [[0, 1], [2, 3], [4, 5], [6, 7]], "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
         "expert-dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "tp-ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
         "tp-ep-pp": [[0, 1, 2, 3], [4, 5, 6, 7]]}),
    # expert grid (etp=1, ep=2, expert-dp=4): rank = ep_rank + 2 * edp_rank; experts ignore the dense TP split
    (1, {"etp": [[r] for r in range(8)], "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
         "expert-dp": [[0, 2, 4, 6], [1, 3, 5, 7]], "tp-ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
         "tp-ep-pp": [[0, 1], [2, 3], [4, 5], [6, 7]]}),
])
def test_expert_groups_world_8_tp2_ep2(etp, expected):
    plan = ps._plan_rank_groups(8, tp=2, pp=1, cp=1, ep=2, etp=etp, order="tp-cp-ep-dp-pp")
    assert {name: plan[name] for name in expected} == expected
    assert plan["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the dense layers are unchanged


def test_expert_tensor_model_pipeline_groups_span_the_pipeline():
    # 8 ranks, tp = etp = 1, ep = 2, pp = 2: expert grid (ep=2, expert-dp=2, pp=2)
    plan = ps._plan_rank_groups(8, tp=1, pp=2, cp=1, ep=2, etp=1, order="tp-cp-ep-dp-pp")
    assert plan["tp-ep-pp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert plan["expert-dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # every expert param once: the expert norm groups and the expert-dp groups tile the world
    assert sorted(r for group in plan["tp-ep-pp"] for r in group) == list(range(8))


def test_single_process_expert_accessors():
    assert ps.get_expert_tensor_parallel_world_size() == 1 and ps.get_expert_tensor_parallel_rank() == 0
    ps.initialize_model_parallel()
    assert ps.get_expert_tensor_parallel_group() is None
    assert ps.get_expert_tensor_and_model_parallel_group() is None
    assert ps.get_expert_tensor_model_pipeline_parallel_group() is None
    assert (ps.get_expert_tensor_and_model_parallel_world_size(), ps.get_expert_tensor_and_model_parallel_rank()) == (1, 0)
    ps.destroy_model_parallel()
