"""Tensor- and sequence-parallel layers on 4 gloo ranks (TP = 2 or 4, DP = 4 / TP) against serial PyTorch.

Every task builds, on every rank, the serial reference from the same seeds as the parallel layer
and returns (actual, expected) pairs for this rank's slice: output columns of a column-parallel
layer, input columns of a row-parallel one, vocabulary rows of the embedding and the loss, s/t
sequence rows under sequence parallelism. The parent asserts every pair of every rank, so
together the slices cover the gathered tensors. Data differ between the DP groups (seeded by
the DP rank), so a collective reaching the wrong group shows.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import communication, parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_to_all,
    broadcast_data,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from megatron.model.transformer_config import TransformerConfig
from megatron.model.utils import init_method_normal
from tests.parallel.conftest import WORLD_SIZE
from tests.parallel.harness import init_parallel

TP_SIZES = [2, 4]
STD = 0.5
S, B, H, FFN = 8, 2, 8, 16  # s, b, h, ffn: all divisible by TP = 4
VOCAB, REAL_VOCAB = 512, 300  # a 300-id tokenizer padded to 512 (TP = 4: rank 3 holds only padding)
ATOL, RTOL = 1e-5, 1e-5


def _init(tp):
    """Set up TP = tp; returns (tp rank, dp rank): the dp rank tells the TP groups apart."""
    init_parallel(tp=tp)
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank()


def _randn(shape, *seed):
    generator = torch.Generator().manual_seed(sum(part * 1000**i for i, part in enumerate(seed)))
    return torch.randn(shape, generator=generator)


def _config(tp, sequence_parallel=False):
    return TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN,
                             hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                             sequence_parallel=sequence_parallel)


def _part(size, rank, tp):
    return slice(rank * size // tp, (rank + 1) * size // tp)


def _serial_weight(seed, rows, cols):
    """The TP = 1 weight for `seed`; also leaves the default generator where the layers leave it."""
    torch.manual_seed(seed)
    weight = torch.empty(rows, cols)
    init_method_normal(STD)(weight)
    return weight


def _events(counter):
    return [(event.op, event.group, event.numel) for event in counter.events]


def _assert_pairs(per_rank):
    for rank, pairs in enumerate(per_rank):
        for name, (actual, expected) in pairs.items():
            assert actual is not None, f"rank {rank}: {name} is None"
            torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, r=rank, n=name: f"rank {r}, {n}: {m}")


def _tp_groups(per_rank, tp):
    return [per_rank[start : start + tp] for start in range(0, WORLD_SIZE, tp)]


# ----------------------------------------------------------------------------- mappings

def _mapping_task(tp):
    rank, dp = _init(tp)

    def per_rank(shape, tag):  # every TP rank's tensor, known on every rank
        return [_randn(shape, tag, dp, r) for r in range(tp)]

    def shared(shape, tag):  # one tensor, the same on the whole TP group
        return _randn(shape, tag, dp, 99)

    seq, last = _part(S, rank, tp), _part(H, rank, tp)
    pairs = {}

    def check(name, fn, x, grad, expected_out, expected_grad):
        x = x.clone().requires_grad_()
        out = fn(x)
        out.backward(grad)
        pairs[name + " forward"] = (out.detach(), expected_out)
        pairs[name + " backward"] = (x.grad, expected_grad)

    x, grads = shared((S, B, H), 1), per_rank((S, B, H), 2)
    check("copy_to_tp", copy_to_tensor_model_parallel_region, x, grads[rank], x, sum(grads))
    xs, grad = per_rank((S, B, H), 3), shared((S, B, H), 4)
    check("reduce_from_tp", reduce_from_tensor_model_parallel_region, xs[rank], grad, sum(xs), grad)
    x, grads = shared((S, B, H), 5), per_rank((S, B, H // tp), 6)
    check("scatter_to_tp", scatter_to_tensor_model_parallel_region, x, grads[rank], x[..., last], torch.cat(grads, -1))
    xs, grad = per_rank((S, B, H // tp), 7), shared((S, B, H), 8)
    check("gather_from_tp", gather_from_tensor_model_parallel_region, xs[rank], grad, torch.cat(xs, -1), grad[..., last])
    x, grads = shared((S, B, H), 9), per_rank((S // tp, B, H), 10)
    check("scatter_to_sp", scatter_to_sequence_parallel_region, x, grads[rank], x[seq], torch.cat(grads, 0))
    xs, grads = per_rank((S // tp, B, H), 11), per_rank((S, B, H), 12)
    check("gather_from_sp", gather_from_sequence_parallel_region, xs[rank], grads[rank],
          torch.cat(xs, 0), sum(grads)[seq])
    xs, grad = per_rank((S // tp, B, H), 13), shared((S, B, H), 14)
    check("gather_from_sp without tp grad",
          lambda x: gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False),
          xs[rank], grad, torch.cat(xs, 0), grad[seq])
    xs, grads = per_rank((S, B, H), 15), per_rank((S // tp, B, H), 16)
    check("reduce_scatter_to_sp", reduce_scatter_to_sequence_parallel_region, xs[rank], grads[rank],
          sum(xs)[seq], torch.cat(grads, 0))

    # Unequal row counts (the MoE dispatchers' case), rank 0 with none, over an explicit group.
    group = parallel_state.get_tensor_model_parallel_group()
    sizes = [(r * 3) % 4 for r in range(tp)]  # tp 2: [0, 3]; tp 4: [0, 3, 2, 1]
    own = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    xs = [_randn((n, B, H), 17, dp, r) for r, n in enumerate(sizes)]
    grads = per_rank((sum(sizes), B, H), 18)
    check("gather_from_sp with split sizes",
          lambda x: gather_from_sequence_parallel_region(x, group=group, output_split_sizes=sizes),
          xs[rank], grads[rank], torch.cat(xs, 0), sum(grads)[own])
    xs = per_rank((sum(sizes), B, H), 19)
    grads = [_randn((n, B, H), 20, dp, r) for r, n in enumerate(sizes)]
    check("reduce_scatter_to_sp with split sizes",
          lambda x: reduce_scatter_to_sequence_parallel_region(x, group=group, input_split_sizes=sizes),
          xs[rank], grads[rank], sum(xs)[own], torch.cat(grads, 0))
    # all_to_all: rank i sends routes[i][j] rows to rank j (zero on some routes)
    routes = [[(i + 2 * j) % 3 for j in range(tp)] for i in range(tp)]
    xs = [_randn((sum(routes[i]), B, H), 21, dp, i) for i in range(tp)]
    grads = [_randn((sum(routes[i][j] for i in range(tp)), B, H), 22, dp, j) for j in range(tp)]
    sent = [torch.split(xs[i], routes[i]) for i in range(tp)]  # sent[i][j]: rank i's rows for rank j
    returned = [torch.split(grads[j], [routes[i][j] for i in range(tp)]) for j in range(tp)]
    check("all_to_all with split sizes",
          lambda x: all_to_all(group, x, [routes[i][rank] for i in range(tp)], routes[rank]),
          xs[rank], grads[rank], torch.cat([sent[i][rank] for i in range(tp)]),
          torch.cat([returned[j][rank] for j in range(tp)]))
    x, grad = per_rank((tp * 2, B, H), 23), per_rank((tp * 2, B, H), 24)
    check("all_to_all in equal pieces", lambda x: all_to_all(group, x), x[rank], grad[rank],
          torch.cat([x[i][2 * rank:2 * rank + 2] for i in range(tp)]),
          torch.cat([grad[j][2 * rank:2 * rank + 2] for j in range(tp)]))
    return pairs


@pytest.mark.parametrize("tp", TP_SIZES)
def test_mappings_forward_and_backward(dist_pool, tp):
    per_rank = dist_pool.run(_mapping_task, tp)
    assert len(per_rank[0]) == 24
    _assert_pairs(per_rank)


# ----------------------------------------------------------------------------- linear layers

def _column_task(tp, sequence_parallel, gather_output):
    rank, dp = _init(tp)
    rows, seq = _part(FFN, rank, tp), _part(S, rank, tp)
    weight = _serial_weight(11, FFN, H)
    after_serial = torch.rand(3)
    torch.manual_seed(11)
    layer = ColumnParallelLinear(H, FFN, config=_config(tp, sequence_parallel), init_method=init_method_normal(STD),
                                 gather_output=gather_output)
    after_parallel = torch.rand(3)
    bias = _randn((FFN,), 1, 0)  # a nonzero bias, the same on every rank
    with torch.no_grad():
        layer.bias.copy_(bias[rows])

    x, grad = _randn((S, B, H), 2, dp), _randn((S, B, FFN), 3, dp)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, weight, bias))
    serial_out = F.linear(xs, ws, bs)
    serial_out.backward(grad)

    x_local = (x[seq] if sequence_parallel else x).clone().requires_grad_()  # [s/t, b, h] under SP
    out, out_bias = layer(x_local)
    out.backward(grad if gather_output else grad[..., rows])
    return {
        "generator after init": (after_parallel, after_serial),
        "weight": (layer.weight.detach(), weight[rows]),
        "output": (out.detach(), serial_out.detach() if gather_output else serial_out.detach()[..., rows]),
        "weight grad": (layer.weight.grad, ws.grad[rows]),
        "bias grad": (layer.bias.grad, bs.grad[rows]),
        "input grad": (x_local.grad, xs.grad[seq] if sequence_parallel else xs.grad),
        "output_bias is None": (torch.tensor(out_bias is None), torch.tensor(True)),
    }


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("sequence_parallel,gather_output", [(False, False), (False, True), (True, False)])
def test_column_parallel_linear_equals_serial_linear(dist_pool, tp, sequence_parallel, gather_output):
    _assert_pairs(dist_pool.run(_column_task, tp, sequence_parallel, gather_output))


def _strided_column_task(tp):
    """stride 2: a fused [2 * ffn, h] weight whose two halves are each split over TP."""
    rank, _ = _init(tp)
    weight = _serial_weight(13, 2 * FFN, H)
    torch.manual_seed(13)
    layer = ColumnParallelLinear(H, 2 * FFN, config=_config(tp), init_method=init_method_normal(STD), stride=2)
    first_half, second_half = weight[:FFN], weight[FFN:]
    expected = torch.cat([first_half[_part(FFN, rank, tp)], second_half[_part(FFN, rank, tp)]])
    return {"weight": (layer.weight.detach(), expected),
            "stride attribute": (torch.tensor(layer.weight.partition_stride), torch.tensor(2))}


@pytest.mark.parametrize("tp", TP_SIZES)
def test_column_parallel_linear_with_stride_keeps_its_block_of_each_sub_matrix(dist_pool, tp):
    _assert_pairs(dist_pool.run(_strided_column_task, tp))


def _row_task(tp, sequence_parallel, input_is_parallel):
    rank, dp = _init(tp)
    cols, seq = _part(FFN, rank, tp), _part(S, rank, tp)
    weight = _serial_weight(12, H, FFN)
    torch.manual_seed(12)
    layer = RowParallelLinear(FFN, H, config=_config(tp, sequence_parallel), init_method=init_method_normal(STD),
                              input_is_parallel=input_is_parallel)
    bias = _randn((H,), 4, 0)
    with torch.no_grad():
        layer.bias.copy_(bias)

    x, grad = _randn((S, B, FFN), 5, dp), _randn((S, B, H), 6, dp)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, weight, bias))
    serial_out = F.linear(xs, ws, bs)
    serial_out.backward(grad)

    x_local = (x[..., cols] if input_is_parallel else x).clone().requires_grad_()
    out, _ = layer(x_local)
    out.backward(grad[seq] if sequence_parallel else grad)
    return {
        "weight": (layer.weight.detach(), weight[:, cols]),
        "output": (out.detach(), serial_out.detach()[seq] if sequence_parallel else serial_out.detach()),
        "weight grad": (layer.weight.grad, ws.grad[:, cols]),
        # Under SP each rank's bias gradient covers its own s/t tokens (summed over TP later).
        "bias grad": (layer.bias.grad, grad[seq].sum(dim=(0, 1)) if sequence_parallel else bs.grad),
        "serial bias grad": (bs.grad, bs.grad),
        "input grad": (x_local.grad, xs.grad[..., cols] if input_is_parallel else xs.grad),
    }


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("sequence_parallel,input_is_parallel", [(False, True), (False, False), (True, True)])
def test_row_parallel_linear_equals_serial_linear(dist_pool, tp, sequence_parallel, input_is_parallel):
    per_rank = dist_pool.run(_row_task, tp, sequence_parallel, input_is_parallel)
    _assert_pairs(per_rank)
    if sequence_parallel:
        for group in _tp_groups(per_rank, tp):
            partial_sum = sum(result["bias grad"][0] for result in group)
            torch.testing.assert_close(partial_sum, group[0]["serial bias grad"][0], rtol=RTOL, atol=ATOL)


def _mlp_task(tp, sequence_parallel):
    """Column -> GeLU -> Row, the MLP, against the serial composite; counts the collectives."""
    rank, dp = _init(tp)
    config = _config(tp, sequence_parallel)
    seq = _part(S, rank, tp)
    w1, w2 = _serial_weight(21, FFN, H), _serial_weight(22, H, FFN)
    torch.manual_seed(21)
    fc1 = ColumnParallelLinear(H, FFN, config=config, init_method=init_method_normal(STD))
    torch.manual_seed(22)
    fc2 = RowParallelLinear(FFN, H, config=config, init_method=init_method_normal(STD))

    x, grad = _randn((S, B, H), 7, dp), _randn((S, B, H), 8, dp)
    xs, w1s, w2s = (t.clone().requires_grad_() for t in (x, w1, w2))
    serial_out = F.linear(F.gelu(F.linear(xs, w1s)), w2s)
    serial_out.backward(grad)

    x_local = (x[seq] if sequence_parallel else x).clone().requires_grad_()
    with communication.count_communication() as forward:
        hidden, _ = fc1(x_local)
        out, _ = fc2(F.gelu(hidden))
    with communication.count_communication() as backward:
        out.backward(grad[seq] if sequence_parallel else grad)
    rows = _part(FFN, rank, tp)
    return {
        "pairs": {
            "output": (out.detach(), serial_out.detach()[seq] if sequence_parallel else serial_out.detach()),
            "fc1 weight grad": (fc1.weight.grad, w1s.grad[rows]),
            "fc2 weight grad": (fc2.weight.grad, w2s.grad[:, rows]),
            "input grad": (x_local.grad, xs.grad[seq] if sequence_parallel else xs.grad),
        },
        "forward": _events(forward),
        "backward": _events(backward),
    }


@pytest.mark.parametrize("tp", TP_SIZES)
def test_column_row_pair_communicates_one_all_reduce_each_way(dist_pool, tp):
    per_rank = dist_pool.run(_mlp_task, tp, False)
    _assert_pairs([result["pairs"] for result in per_rank])
    for result in per_rank:
        assert result["forward"] == [("all_reduce", "tp", S * B * H)]  # fc2's partial sums
        assert result["backward"] == [("all_reduce", "tp", S * B * H)]  # fc1's input gradient


@pytest.mark.parametrize("tp", TP_SIZES)
def test_column_row_pair_with_sequence_parallelism_communicates_gathers_and_reduce_scatters(dist_pool, tp):
    per_rank = dist_pool.run(_mlp_task, tp, True)
    _assert_pairs([result["pairs"] for result in per_rank])
    full = S * B * H  # sizes are those of the whole [s, b, h] tensor
    for result in per_rank:
        assert result["forward"] == [("all_gather", "tp", full), ("reduce_scatter", "tp", full)]
        # fc2's output grad gathered; fc1 re-gathers its input, reduce-scatters its input grad.
        assert result["backward"] == [("all_gather", "tp", full), ("all_gather", "tp", full),
                                      ("reduce_scatter", "tp", full)]


# ----------------------------------------------------------------------------- embedding

def _embedding_task(tp, reduce_scatter_embeddings, num_initialized):
    rank, dp = _init(tp)
    rows, seq = _part(VOCAB, rank, tp), _part(S, rank, tp)
    drawn = num_initialized or VOCAB
    real = _serial_weight(31, drawn, H)
    after_serial = torch.rand(3)
    table = torch.zeros(VOCAB, H)
    table[:drawn] = real
    torch.manual_seed(31)
    embedding = VocabParallelEmbedding(VOCAB, H, init_method=init_method_normal(STD), config=_config(tp),
                                       reduce_scatter_embeddings=reduce_scatter_embeddings,
                                       num_initialized_embeddings=num_initialized)
    after_parallel = torch.rand(3)

    generator = torch.Generator().manual_seed(32 + dp)
    ids = torch.randint(0, drawn, (B, S), generator=generator)  # [b, s]
    ids[0, :4] = torch.tensor([0, 127, 128, drawn - 1])  # rank boundaries and the last id
    table_s = table.clone().requires_grad_()
    serial_out = F.embedding(ids, table_s)  # [b, s, h]
    grad = _randn((B, S, H), 33, dp)
    serial_out.backward(grad)

    out = embedding(ids)
    if reduce_scatter_embeddings:
        expected = serial_out.detach().transpose(0, 1)[seq]  # [s/t, b, h]
        out.backward(grad.transpose(0, 1)[seq])
    else:
        expected = serial_out.detach()  # [b, s, h]
        out.backward(grad)
    return {
        "generator after init": (after_parallel, after_serial),
        "weight": (embedding.weight.detach(), table[rows]),
        "output": (out.detach(), expected),
        "weight grad": (embedding.weight.grad, table_s.grad[rows]),
    }


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("reduce_scatter_embeddings", [False, True])
def test_vocab_parallel_embedding_equals_nn_embedding(dist_pool, tp, reduce_scatter_embeddings):
    _assert_pairs(dist_pool.run(_embedding_task, tp, reduce_scatter_embeddings, None))


@pytest.mark.parametrize("tp", TP_SIZES)
def test_vocab_parallel_embedding_initialises_real_rows_only(dist_pool, tp):
    per_rank = dist_pool.run(_embedding_task, tp, False, REAL_VOCAB)
    _assert_pairs(per_rank)
    for group in _tp_groups(per_rank, tp):
        table = torch.cat([result["weight"][0] for result in group])  # [512, h] gathered
        assert torch.equal(table[REAL_VOCAB:], torch.zeros(VOCAB - REAL_VOCAB, H))
        assert bool((table[:REAL_VOCAB].abs().sum(dim=1) > 0).all())


# ----------------------------------------------------------------------------- cross entropy

def _cross_entropy_task(tp, label_smoothing):
    rank, dp = _init(tp)
    cols = _part(VOCAB, rank, tp)
    logits = 3 * _randn((S, B, VOCAB), 41, dp)
    logits[..., REAL_VOCAB:] = 50.0  # padding logits that would dominate the softmax if counted
    target = torch.randint(0, REAL_VOCAB, (S, B), generator=torch.Generator().manual_seed(42 + dp))
    target[0] = torch.tensor([5, REAL_VOCAB - 1])  # targets on the first and the last real rank
    weights = _randn((S, B), 43, dp)

    real = logits[..., :REAL_VOCAB].clone().requires_grad_()
    serial_loss = F.cross_entropy(real.reshape(S * B, REAL_VOCAB), target.reshape(S * B), reduction="none",
                                  label_smoothing=label_smoothing).view(S, B)
    (serial_loss * weights).sum().backward()
    full_grad = torch.zeros(S, B, VOCAB)
    full_grad[..., :REAL_VOCAB] = real.grad

    local = logits[..., cols].clone().requires_grad_()  # [s, b, v/t]
    with communication.count_communication() as counter:
        loss = vocab_parallel_cross_entropy(local, target, label_smoothing=label_smoothing,
                                            unpadded_vocab_size=REAL_VOCAB)
    (loss * weights).sum().backward()
    return {
        "pairs": {"loss": (loss.detach(), serial_loss.detach()), "logits grad": (local.grad, full_grad[..., cols])},
        "events": _events(counter),
    }


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy_equals_cross_entropy_on_gathered_logits(dist_pool, tp, label_smoothing):
    per_rank = dist_pool.run(_cross_entropy_task, tp, label_smoothing)
    _assert_pairs([result["pairs"] for result in per_rank])
    # max, target logit, sum of exps (and the sum of log-probs with smoothing): [s, b] each.
    expected_calls = 4 if label_smoothing else 3
    for result in per_rank:
        assert result["events"] == [("all_reduce", "tp", S * B)] * expected_calls


# ----------------------------------------------------------------------------- RNG and data

def _rng_task(tp):
    rank, _ = _init(tp)
    model_parallel_cuda_manual_seed(1234)
    ones = torch.ones(256)
    with get_cuda_rng_tracker().fork():
        forked = F.dropout(ones, 0.5, training=True)
    default = F.dropout(ones, 0.5, training=True)
    return {"tp_rank": rank, "forked": forked, "default": default}


@pytest.mark.parametrize("tp", TP_SIZES)
def test_dropout_differs_across_tp_ranks_only_inside_the_fork(dist_pool, tp):
    per_rank = dist_pool.run(_rng_task, tp)
    for result in per_rank:  # the default stream is the same everywhere
        assert torch.equal(result["default"], per_rank[0]["default"])
    for group in _tp_groups(per_rank, tp):
        masks = [result["forked"] for result in group]
        for i in range(tp):
            for j in range(i + 1, tp):
                assert not torch.equal(masks[i], masks[j]), f"TP ranks {i} and {j} drew the same dropout mask"
            assert not torch.equal(masks[i], group[i]["default"])
    # The stream depends on the TP rank only: TP rank r draws alike in every DP group.
    for rank, result in enumerate(per_rank):
        assert result["tp_rank"] == rank % tp
        assert torch.equal(result["forked"], per_rank[rank % tp]["forked"])


def _broadcast_task(tp):
    rank, dp = _init(tp)
    generator = torch.Generator().manual_seed(50 + dp)
    expected = {"tokens": torch.randint(0, 1000, (B, S + 1), generator=generator),
                "lengths": torch.randint(0, 9, (B,), generator=generator)}
    data = expected if rank == 0 else None
    with communication.count_communication() as counter:
        received = broadcast_data(["tokens", "lengths"], data, torch.int64)
    return {"received": received, "expected": expected, "events": _events(counter),
            "src": parallel_state.get_tensor_model_parallel_src_rank()}


@pytest.mark.parametrize("tp", TP_SIZES)
def test_broadcast_data_sends_tp_rank_zeros_batch_to_its_group(dist_pool, tp):
    per_rank = dist_pool.run(_broadcast_task, tp)
    for rank, result in enumerate(per_rank):
        assert result["src"] == rank - rank % tp
        assert result["received"].keys() == {"tokens", "lengths"}
        for key in ("tokens", "lengths"):
            assert torch.equal(result["received"][key], result["expected"][key])
        # the shapes, then every tensor in one buffer
        assert result["events"] == [("broadcast", "tp", 2 * 8), ("broadcast", "tp", B * (S + 1) + B)]
    if tp < WORLD_SIZE:  # the TP groups each got their own batch
        assert not torch.equal(per_rank[0]["received"]["tokens"], per_rank[-1]["received"]["tokens"])
