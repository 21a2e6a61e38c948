"""Tensor-parallel building blocks in one process (TP world size 1): each layer equals its serial
PyTorch counterpart built from the same seed, the vocab-parallel loss equals F.cross_entropy, the
RNG tracker isolates its streams, and the communication counter records what it is shown."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.core import communication, parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabUtility,
    broadcast_data,
    copy_tensor_model_parallel_attributes,
    divide,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    split_tensor_along_last_dim,
    vocab_parallel_cross_entropy,
)
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.model.transformer_config import TransformerConfig
from megatron.model.utils import init_method_normal

STD = 0.5  # large enough that a wrong slice or a missing init shows


def make_config(**overrides):
    fields = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "hidden_dropout": 0.0,
              "attention_dropout": 0.0}
    fields.update(overrides)
    return TransformerConfig(**fields)


def serial_linear(seed, in_features, out_features, bias=True):
    """nn.Linear initialised like the TP layers: normal(0, STD) weight from the default generator, zero bias."""
    torch.manual_seed(seed)
    weight = torch.empty(out_features, in_features)
    init_method_normal(STD)(weight)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias:
            linear.bias.zero_()
    return linear


# ----------------------------------------------------------------------------- utils

def test_divide_returns_the_quotient_and_names_both_numbers_when_it_does_not_divide():
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        divide(10, 4)


def test_split_tensor_along_last_dim_gives_equal_views_in_order():
    tensor = torch.arange(24.0).view(2, 12)
    chunks = split_tensor_along_last_dim(tensor, 3)
    assert [chunk.shape for chunk in chunks] == [torch.Size([2, 4])] * 3
    assert torch.equal(torch.cat(chunks, dim=-1), tensor)
    assert chunks[1][0].tolist() == [4.0, 5.0, 6.0, 7.0]
    with pytest.raises(ValueError, match="12 is not divisible by 5"):
        split_tensor_along_last_dim(tensor, 5)


def test_vocab_ranges_tile_the_padded_vocabulary():
    ranges = [VocabUtility.vocab_range_from_global_vocab_size(512, rank, 4) for rank in range(4)]
    assert ranges == [(0, 128), (128, 256), (256, 384), (384, 512)]
    assert VocabUtility.vocab_range_from_per_partition_vocab_size(64, 3, 4) == (192, 256)
    assert VocabUtility.vocab_range_from_global_vocab_size(300, 0, 1) == (0, 300)
    with pytest.raises(ValueError, match="300 is not divisible by 8"):
        VocabUtility.vocab_range_from_global_vocab_size(300, 0, 8)
    with pytest.raises(ValueError, match="rank 4"):
        VocabUtility.vocab_range_from_global_vocab_size(512, 4, 4)


# ----------------------------------------------------------------------------- attributes

def test_tensor_parallel_attributes_set_default_copy_and_duplicate_rule():
    split, replicated, copy = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    set_tensor_model_parallel_attributes(split, True, 0, 3)
    assert (split.tensor_model_parallel, split.partition_dim, split.partition_stride) == (True, 0, 3)
    with pytest.raises(ValueError, match="tensor_model_parallel"):
        set_tensor_model_parallel_attributes(split, True, 1, 1)
    set_defaults_if_not_set_tensor_model_parallel_attributes(replicated)
    assert (replicated.tensor_model_parallel, replicated.partition_dim, replicated.partition_stride) == (False, -1, 1)
    copy_tensor_model_parallel_attributes(copy, split)
    assert (copy.tensor_model_parallel, copy.partition_dim, copy.partition_stride) == (True, 0, 3)
    # TP rank 0 counts replicated parameters too.
    assert param_is_not_tensor_parallel_duplicate(split) and param_is_not_tensor_parallel_duplicate(replicated)


# ----------------------------------------------------------------------------- layers at TP = 1

def _assert_matches_serial(layer, serial, x, grad):
    """Output and weight/bias/input gradients of a TP=1 layer equal those of the nn.Linear."""
    x_serial, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    serial(x_serial).backward(grad)
    output, output_bias = layer(x_tp)
    output.backward(grad)
    assert output_bias is None
    torch.testing.assert_close(output, serial(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, serial.weight.grad, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, serial.bias.grad, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(x_tp.grad, x_serial.grad, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_parallel_linear_equals_nn_linear(sequence_parallel):
    config = make_config(sequence_parallel=sequence_parallel)
    serial = serial_linear(3, 8, 12)
    torch.manual_seed(3)
    layer = ColumnParallelLinear(8, 12, config=config, init_method=init_method_normal(STD), bias=True)
    assert torch.equal(layer.weight, serial.weight) and torch.equal(layer.bias, torch.zeros(12))
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0

    _assert_matches_serial(layer, serial, torch.randn(5, 2, 8), torch.randn(5, 2, 12))  # x [s, b, in], grad [s, b, out]


def test_column_parallel_linear_skip_bias_add_external_weight_and_errors():
    config = make_config()
    torch.manual_seed(0)
    layer = ColumnParallelLinear(8, 6, config=config, init_method=init_method_normal(STD), skip_bias_add=True)
    with torch.no_grad():
        layer.bias.fill_(2.0)
    x = torch.randn(3, 1, 8)
    output, output_bias = layer(x)
    assert output_bias is layer.bias
    torch.testing.assert_close(output, x @ layer.weight.t())

    tied = ColumnParallelLinear(8, 6, config=config, init_method=init_method_normal(STD), bias=False,
                                skip_weight_param_allocation=True, gather_output=True)
    assert tied.weight is None and list(tied.parameters()) == []
    other = torch.randn(6, 8)
    torch.testing.assert_close(tied(x, weight=other)[0], x @ other.t())
    with pytest.raises(ValueError, match="skip_weight_param_allocation"):
        tied(x)
    with pytest.raises(ValueError, match=r"\(5, 8\)"):
        tied(x, weight=torch.randn(5, 8))
    with pytest.raises(ValueError, match="gather_output"):
        ColumnParallelLinear(8, 6, config=make_config(sequence_parallel=True), init_method=init_method_normal(STD),
                             gather_output=True)


@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_equals_nn_linear(input_is_parallel):
    config = make_config()
    serial = serial_linear(4, 12, 8)
    with torch.no_grad():
        serial.bias.copy_(torch.arange(8.0))
    torch.manual_seed(4)
    layer = RowParallelLinear(12, 8, config=config, init_method=init_method_normal(STD),
                              input_is_parallel=input_is_parallel)
    with torch.no_grad():
        layer.bias.copy_(torch.arange(8.0))
    assert torch.equal(layer.weight, serial.weight)
    assert layer.weight.partition_dim == 1 and layer.bias.sequence_parallel is False

    _assert_matches_serial(layer, serial, torch.randn(5, 2, 12), torch.randn(5, 2, 8))


def test_row_parallel_linear_skip_bias_add_and_sequence_parallel_rules():
    layer = RowParallelLinear(4, 3, config=make_config(sequence_parallel=True), init_method=init_method_normal(STD),
                              skip_bias_add=True)
    assert layer.bias.sequence_parallel is True
    x = torch.randn(2, 1, 4)
    output, output_bias = layer(x)
    assert output_bias is layer.bias
    torch.testing.assert_close(output, x @ layer.weight.t())
    with pytest.raises(ValueError, match="input_is_parallel"):
        RowParallelLinear(4, 3, config=make_config(sequence_parallel=True), init_method=init_method_normal(STD),
                          input_is_parallel=False)


def test_params_dtype_is_the_fp32_draw_cast():
    config = make_config(params_dtype=torch.bfloat16, bf16=True)
    serial = serial_linear(5, 8, 4)
    torch.manual_seed(5)
    layer = ColumnParallelLinear(8, 4, config=config, init_method=init_method_normal(STD))
    assert layer.weight.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.weight, serial.weight.to(torch.bfloat16))


def test_no_initialization_leaves_the_generator_alone():
    torch.manual_seed(6)
    expected = torch.rand(3)
    torch.manual_seed(6)
    ColumnParallelLinear(8, 4, config=make_config(perform_initialization=False), init_method=init_method_normal(STD))
    assert torch.equal(torch.rand(3), expected)


def test_vocab_parallel_embedding_equals_nn_embedding():
    torch.manual_seed(7)
    reference = torch.empty(20, 8)
    init_method_normal(STD)(reference)
    torch.manual_seed(7)
    embedding = VocabParallelEmbedding(20, 8, init_method=init_method_normal(STD), config=make_config())
    assert torch.equal(embedding.weight, reference)
    assert (embedding.vocab_start_index, embedding.vocab_end_index) == (0, 20)

    ids = torch.randint(0, 20, (2, 5))  # [b, s]
    output = embedding(ids)
    torch.testing.assert_close(output, F.embedding(ids, reference))
    output.sum().backward()
    expected_grad = torch.zeros(20, 8).index_add_(0, ids.reshape(-1), torch.ones(10, 8))
    torch.testing.assert_close(embedding.weight.grad, expected_grad)


def test_vocab_parallel_embedding_reduce_scatter_output_is_sequence_first():
    torch.manual_seed(8)
    embedding = VocabParallelEmbedding(16, 4, init_method=init_method_normal(STD), config=make_config(),
                                       reduce_scatter_embeddings=True)
    ids = torch.randint(0, 16, (3, 6))  # [b, s]
    output = embedding(ids)
    assert output.shape == (6, 3, 4)  # [s, b, h]
    torch.testing.assert_close(output, F.embedding(ids, embedding.weight).transpose(0, 1))


def test_vocab_parallel_embedding_draws_only_the_real_rows():
    torch.manual_seed(9)
    real = torch.empty(13, 4)
    init_method_normal(STD)(real)
    after_serial = torch.rand(5)
    torch.manual_seed(9)
    embedding = VocabParallelEmbedding(16, 4, init_method=init_method_normal(STD), config=make_config(),
                                       num_initialized_embeddings=13)
    assert torch.equal(embedding.weight[:13], real)
    assert torch.equal(embedding.weight[13:], torch.zeros(3, 4))
    assert torch.equal(torch.rand(5), after_serial)  # padding did not move the stream
    with pytest.raises(ValueError, match="num_initialized_embeddings"):
        VocabParallelEmbedding(16, 4, init_method=init_method_normal(STD), config=make_config(),
                               num_initialized_embeddings=17)


# ----------------------------------------------------------------------------- cross entropy

def test_vocab_parallel_cross_entropy_equals_f_cross_entropy():
    torch.manual_seed(10)
    logits = (3 * torch.randn(4, 3, 50)).requires_grad_()  # [s, b, v]
    target = torch.randint(0, 50, (4, 3))
    reference_logits = logits.detach().clone().requires_grad_()
    before = logits.detach().clone()
    loss = vocab_parallel_cross_entropy(logits, target)
    expected = F.cross_entropy(reference_logits.view(12, 50), target.view(12), reduction="none").view(4, 3)
    torch.testing.assert_close(loss, expected)
    assert torch.equal(logits.detach(), before)  # the caller's logits are untouched
    weights = torch.rand(4, 3)
    (loss * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(logits.grad, reference_logits.grad)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy_excludes_padding(label_smoothing):
    torch.manual_seed(11)
    logits = torch.randn(3, 2, 64).requires_grad_()  # 40 real ids padded to 64
    with torch.no_grad():
        logits[..., 40:] = 100.0  # padding logits that would dominate if counted
    target = torch.randint(0, 40, (3, 2))
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=label_smoothing, unpadded_vocab_size=40)
    real = logits.detach()[..., :40].clone().requires_grad_()
    expected = F.cross_entropy(real.reshape(6, 40), target.reshape(6), reduction="none",
                               label_smoothing=label_smoothing).view(3, 2)
    torch.testing.assert_close(loss, expected)
    loss.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(logits.grad[..., :40], real.grad)
    assert torch.equal(logits.grad[..., 40:], torch.zeros(3, 2, 24))


def test_vocab_parallel_cross_entropy_rejects_bad_arguments():
    logits, target = torch.randn(2, 1, 8), torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=1.0)
    with pytest.raises(ValueError, match=r"unpadded_vocab_size \(9\)"):
        vocab_parallel_cross_entropy(logits, target, unpadded_vocab_size=9)


# ----------------------------------------------------------------------------- RNG tracker

def test_fork_draws_from_its_own_stream_and_restores_the_default():
    tracker = RNGStatesTracker()
    tracker.add("stream", 1234)
    torch.manual_seed(1)
    default_before = torch.get_rng_state()
    with tracker.fork("stream"):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), default_before)
    with tracker.fork("stream"):
        second = torch.rand(4)  # the stream continues where it stopped
    reference = torch.Generator().manual_seed(1234)
    assert torch.equal(first, torch.rand(4, generator=reference))
    assert torch.equal(second, torch.rand(4, generator=reference))
    torch.manual_seed(1)
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(1)))


def test_fork_restores_the_default_after_an_exception_and_states_round_trip():
    tracker = RNGStatesTracker()
    tracker.add("a", 5)
    saved = tracker.get_states()
    default_before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom"), tracker.fork("a"):
        torch.rand(3)
        raise RuntimeError("boom")
    assert torch.equal(torch.get_rng_state(), default_before)
    with tracker.fork("a"):
        after_three = torch.rand(2)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(5)[3:], after_three)


def test_tracker_rejects_duplicates_and_unknown_names():
    tracker = RNGStatesTracker()
    tracker.add("a", 5)
    with pytest.raises(ValueError, match="seed 5"):
        tracker.add("b", 5)
    with pytest.raises(ValueError, match="'a'"):
        tracker.add("a", 6)
    with pytest.raises(KeyError, match="'missing'"), tracker.fork("missing"):
        pass
    tracker.reset()
    assert tracker.get_states() == {}


def test_model_parallel_cuda_manual_seed_seeds_default_and_model_parallel_streams():
    assert get_rng_tracker() is get_cuda_rng_tracker()
    torch.manual_seed(99)
    torch.rand(7)
    model_parallel_cuda_manual_seed(42)
    with get_cuda_rng_tracker().fork():
        model_parallel = torch.rand(4)
    default = torch.rand(4)
    assert torch.equal(default, torch.rand(4, generator=torch.Generator().manual_seed(42)))
    assert torch.equal(model_parallel, torch.rand(4, generator=torch.Generator().manual_seed(42 + 2718)))
    assert set(get_cuda_rng_tracker().get_states()) == {"model-parallel-rng"}


# ----------------------------------------------------------------------------- broadcast_data

def test_broadcast_data_with_one_rank_returns_the_tensors():
    data = {"tokens": torch.arange(12).view(3, 4), "labels": torch.arange(5)}
    out = broadcast_data(["tokens", "labels"], data, torch.int64)
    assert torch.equal(out["tokens"], data["tokens"]) and torch.equal(out["labels"], data["labels"])
    with pytest.raises(ValueError, match="'mask' has dtype torch.float32, expected torch.int64"):
        broadcast_data(["mask"], {"mask": torch.zeros(2)}, torch.int64)


# ----------------------------------------------------------------------------- communication counter

@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_communication_counter_records_op_group_and_full_size(one_process_group):
    tp_group = parallel_state.get_tensor_model_parallel_group()
    x = torch.ones(6)
    with communication.count_communication() as outer:
        communication.all_reduce(x, group=tp_group)
        with communication.count_communication() as inner:
            gathered = torch.empty(6, dtype=torch.float64)
            communication.all_gather_into_tensor(gathered, torch.full((6,), 2.0, dtype=torch.float64))
        out = torch.empty(3, 2)
        communication.reduce_scatter_tensor(out, torch.ones(3, 2), group=tp_group)
        communication.broadcast(torch.zeros(4, dtype=torch.int64), src=0, group=tp_group)
    assert torch.equal(x, torch.ones(6)) and torch.equal(gathered, torch.full((6,), 2.0, dtype=torch.float64))
    assert [(e.op, e.group, e.numel, e.nbytes) for e in outer.events] == [
        ("all_reduce", "tp", 6, 24),
        ("all_gather", "world", 6, 48),
        ("reduce_scatter", "tp", 6, 24),
        ("broadcast", "tp", 4, 32),
    ]
    assert [(e.op, e.group) for e in inner.events] == [("all_gather", "world")]
    communication.all_reduce(torch.ones(2), group=tp_group)  # outside: nobody records
    assert len(outer.events) == 4
    assert outer.summary() == {("all_reduce", "tp"): (1, 24), ("all_gather", "world"): (1, 48),
                               ("reduce_scatter", "tp"): (1, 24), ("broadcast", "tp"): (1, 32)}
    outer.reset()
    assert outer.events == [] and outer.summary() == {}


def test_global_counting_switch(one_process_group):
    counter = communication.get_global_counter()
    counter.reset()
    communication.set_counting(True)
    try:
        communication.all_reduce(torch.ones(3))
        communication.all_reduce(torch.ones(5))
    finally:
        communication.set_counting(False)
    communication.all_reduce(torch.ones(7))
    assert counter.summary() == {("all_reduce", "world"): (2, 32)}
    counter.reset()
