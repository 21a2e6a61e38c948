"""megatron/core/node_topology.py without processes: the node of a rank, the printed lines, the warnings."""
from megatron.core import node_topology
from megatron.core.parallel_state import _plan_rank_groups


def _plan(world, tp=1, pp=1, cp=1, ep=1, etp=None):
    return _plan_rank_groups(world, tp, pp, cp, ep, etp or tp, "tp-cp-ep-dp-pp")


def test_the_node_is_torchruns_group_rank_else_rank_over_local_world_size():
    assert node_topology.local_node_index(5, {"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "8"}) == 1
    assert node_topology.local_node_index(5, {"LOCAL_WORLD_SIZE": "2"}) == 2
    assert node_topology.local_node_index(5, {}) == 0


def test_node_line_names_the_ranks_of_each_node():
    assert node_topology.describe_nodes([0, 0, 1, 1]) == "> node topology: 2 nodes x 2 ranks (node 0: ranks 0-1, " \
                                                         "node 1: ranks 2-3)"
    line = node_topology.describe_nodes([n for n in range(16) for _ in range(8)])
    assert line == "> node topology: 16 nodes x 8 ranks (node 0: ranks 0-7, node 1: ranks 8-15, ..., " \
                   "node 15: ranks 120-127)"


def test_tp_inside_nodes_and_dp_pp_across_print_no_warning():
    nodes = [r // 8 for r in range(32)]  # 4 nodes x 8
    line, warnings = node_topology.describe_groups(_plan(32, tp=8, pp=2), nodes, ["tp", "dp", "pp"])
    assert line == ("> groups on nodes: tensor-parallel 4 x 8 ranks, each inside a node | data-parallel 16 x 2 ranks, "
                    "across 2 nodes | pipeline-parallel 16 x 2 ranks, across 2 nodes")
    assert warnings == []


def test_a_tensor_parallel_group_across_nodes_is_named_in_a_warning():
    nodes = [r // 2 for r in range(8)]  # 4 nodes x 2, TP = 4
    line, warnings = node_topology.describe_groups(_plan(8, tp=4), nodes, ["tp", "dp"])
    assert "tensor-parallel 2 x 4 ranks, across 2 nodes" in line
    assert warnings == ["WARNING: 2 of 2 tensor-parallel groups span nodes: ranks [0, 1, 2, 3] on nodes [0, 1]; "
                        "ranks [4, 5, 6, 7] on nodes [2, 3]. They all-reduce in every layer over the network "
                        "between nodes; make the tensor-parallel size divide the ranks per node (--nproc-per-node)"]


def test_an_expert_tensor_parallel_group_across_nodes_warns_too():
    nodes = [r // 2 for r in range(8)]  # TP = 2 inside a node, but expert TP = 4
    line, warnings = node_topology.describe_groups(_plan(8, tp=2, ep=2, etp=4), nodes, ["tp", "ep", "etp", "dp"])
    assert "tensor-parallel 4 x 2 ranks, each inside a node" in line
    assert "expert tensor-parallel 2 x 4 ranks, across 2 nodes" in line
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: 2 of 2 expert tensor-parallel groups span nodes: ")


def test_a_rank_order_that_splits_some_groups_counts_them():
    nodes = [0, 0, 0, 1, 1, 1]  # 2 nodes x 3 ranks, TP = 2: the middle group straddles
    line, warnings = node_topology.describe_groups(_plan(6, tp=2), nodes, ["tp", "dp"])
    assert "tensor-parallel 3 x 2 ranks, 1 of them across nodes" in line
    assert "WARNING: 1 of 3 tensor-parallel groups span nodes: ranks [2, 3] on nodes [0, 1]." in warnings[0]
