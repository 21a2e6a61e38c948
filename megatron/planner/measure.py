"""Measure what one rank of a pretrain_gpt.py layout allocates, next to the plan's prediction.

Run on every rank of a launched job (tests/parallel/test_planner_memory.py, bench/plan_memory.py):
initialize_megatron with the flags, the model and optimizer as pretrain() builds them, one
optimizer step on zero gradients (Adam's state exists only after a step), then

    params, grads, optimizer   megatron/core/optimizer/memory.py: every storage the model and the
                               optimizer hold, counted once (exact, bucket padding included)
    activations                saved_tensor_bytes (megatron/model/activation_memory.py) around one
                               training forward (with the loss on the last stage) of each model
                               chunk of this rank, times the micro-batches the schedule keeps in
                               flight for that chunk (planner.model.in_flight_units, not measured)

    schedule peak              one real train_step (the flags' schedule, mock data) with every
                               saved tensor tracked from autograd's pack hook until autograd frees
                               it: the most bytes held at once (full recompute's rerun included),
                               which checks the in-flight counts

MoE layers: without --moe-pad-expert-input-to-capacity the routed token counts depend on the
router's weights, so the measurement routes as the plan assumes (balanced_routing: token t of a
rank's T goes to experts t k, ..., t k + k - 1 mod E, each expert getting T k / E); with padding
every expert runs exactly its capacity and the routing is left alone.

What is not measured: other transient buffers (communication buffers, the cross entropy's
temporaries, the allocator's slack).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch


@contextlib.contextmanager
def balanced_routing(topk: int):
    """TopKRouter's logits plus 64 at experts t k ... t k + k - 1 (mod E) of token t (rows s-major):
    top-k then picks those, so every expert gets T k / E of a rank's T tokens. Adding a constant
    keeps what autograd saves (an add saves nothing)."""
    from megatron.model.moe.router import TopKRouter

    gating = TopKRouter.gating

    def balanced(self, x):
        logits = gating(self, x)  # [s, b, E]
        rows, experts = logits.numel() // self.num_experts, self.num_experts
        picks = (torch.arange(rows).unsqueeze(1) * topk + torch.arange(topk)) % experts  # [T, k]
        bias = torch.zeros(rows, experts, dtype=logits.dtype).scatter(1, picks, 64.0)
        return logits + bias.reshape(logits.shape)

    TopKRouter.gating = balanced
    try:
        yield
    finally:
        TopKRouter.gating = gating


def _chunk_saved_bytes(chunk: Any, args: Any, first: bool, last: bool) -> int:
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model
    from megatron.model.activation_memory import saved_tensor_bytes

    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    tp = parallel_state.get_tensor_model_parallel_world_size()
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, args.padded_vocab_size // 2, (b, s), generator=generator)  # [b, s]
    positions = torch.arange(s).repeat(b, 1)  # [b, s], its own storage as get_batch's
    if args.context_parallel_size > 1:  # this CP rank's s/c tokens, as get_batch cuts them
        from megatron.training.utils import get_batch_on_this_cp_rank

        cut = get_batch_on_this_cp_rank({"tokens": tokens, "position_ids": positions})
        tokens, positions, s = cut["tokens"], cut["position_ids"], s // args.context_parallel_size
    received = None
    if not first:
        local = s // tp if args.sequence_parallel else s
        received = torch.randn(local, b, h, dtype=args.params_dtype, requires_grad=True)  # [s(/t), b, h]
    unwrap_model(chunk).set_input_tensor(received)
    params = list(chunk.parameters())
    chunk.train()
    with torch.enable_grad():
        return saved_tensor_bytes(lambda: chunk(tokens, positions, None, labels=tokens if last else None),
                                  exclude=params)


class _Held:
    """What a saved-tensor hook hands autograd: freed when autograd frees the saved tensor."""

    __slots__ = ("tracker", "pointer", "tensor")

    def __init__(self, tracker: "_LiveSaved", pointer: int, tensor: torch.Tensor) -> None:
        self.tracker, self.pointer, self.tensor = tracker, pointer, tensor

    def __del__(self) -> None:
        self.tracker.release(self.pointer)


class _LiveSaved:
    """The bytes of the distinct storages autograd holds for backward right now, and their peak,
    while the hooks are installed (parameters' storages left out)."""

    def __init__(self, exclude: list) -> None:
        self.excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
        self.live: dict = {}  # storage pointer -> [bytes, saved tensors holding it]
        self.current = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in self.excluded:
            return tensor
        entry = self.live.get(pointer)
        if entry is None:
            entry = self.live[pointer] = [tensor.untyped_storage().nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _Held(self, pointer, tensor)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, pointer: int) -> None:
        entry = self.live[pointer]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[pointer]


def _train_step_peak(model: list, optimizer: Any, scheduler: Any, train_iter: Any) -> int:
    """One real train_step (the pipeline schedule of the flags, mock data) under _LiveSaved: the
    peak of the saved-tensor bytes this rank held at once (full recompute's rerun included)."""
    from megatron.training.recipes import gpt as pretrain_gpt
    from megatron.training.training import train_step_report

    tracker = _LiveSaved([p for chunk in model for p in chunk.parameters()])
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        _, skipped, _, _ = train_step_report(pretrain_gpt.forward_step, train_iter, model, optimizer, scheduler)
    assert not skipped and tracker.current == 0, tracker.current
    return tracker.peak


def allocated_peak(events: list) -> int:
    """The most bytes held at once by the CPU allocator's blocks that were allocated inside a
    profiled window, from its allocation events [(time ns, pointer, bytes: + allocated, - freed)].

    The profiler sees only this thread's frees: a block whose last reference a collective's
    worker thread drops (gloo's copies inside a collective, a buffer its work object still held)
    is freed unseen. Such a block counts as freed when its pointer is allocated again, and
    _allocation_events adds a free at the end of the collective for what was allocated inside it.
    A free of a block allocated before the window is left out (its size is not known): what the
    window frees of older tensors is not subtracted, an upper bound by at most those bytes."""
    live, current, peak = {}, 0, 0
    # at equal times a free comes first: a pointer is reused only after its block is freed
    for _, pointer, size in sorted(events, key=lambda event: (event[0], event[2] > 0)):
        if size > 0:
            current += size - live.get(pointer, 0)
            live[pointer] = size
            peak = max(peak, current)
        elif pointer in live:
            current -= live.pop(pointer)
    return peak


def _allocation_events(profiler: Any) -> list:
    """(time ns, pointer, bytes) of every CPU allocation and free the profiler recorded, and a
    free at the end of the collective (a c10d:: op) of each block allocated inside one: the
    backend's own copies, freed by its worker thread once the collective is done."""
    from torch._C._profiler import _EventType

    events, stack = [], [(node, None) for node in profiler.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, collective_end = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            size, pointer = node.extra_fields.alloc_size, node.extra_fields.ptr
            events.append((node.start_time_ns, pointer, size))
            if collective_end is not None and size > 0:
                events.append((collective_end, pointer, -size))
        if collective_end is None and node.name.startswith("c10d::"):
            collective_end = node.end_time_ns
        stack.extend((child, collective_end) for child in node.children)
    return events


def _iterations_peak(model: list, optimizer: Any, scheduler: Any, train_iter: Any, iterations: int) -> int:
    """The peak of the live bytes in PyTorch's CPU allocator over `iterations` real train_steps
    (forward, loss, backward, gradient reduction and optimizer step, every transient included), on
    top of what was live before them (parameters, gradients, optimizer state): torch's profiler
    with profile_memory reports every allocation and free of the CPU allocator on this thread,
    autograd's backward included (it runs on the calling thread for CPU tensors)."""
    from megatron.training.recipes import gpt as pretrain_gpt
    from torch.profiler import ProfilerActivity, profile

    from megatron.training.training import train_step_report

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        for _ in range(iterations):
            _, skipped, _, _ = train_step_report(pretrain_gpt.forward_step, train_iter, model, optimizer, scheduler)
            assert not skipped
    return allocated_peak(_allocation_events(profiler))


def measure_rank(argv: list[str]) -> dict:
    """This rank's measured bytes and the plan's prediction for the same flags (see the module
    docstring); collective over the job."""
    from megatron.training.recipes import gpt as pretrain_gpt
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.optimizer.memory import optimizer_memory_per_parameter
    from megatron.training.global_vars import get_args, get_tokenizer
    from megatron.training.initialize import initialize_megatron, reset_megatron
    from megatron.planner.model import in_flight_units, layout_from_args, shape_from_args
    from megatron.planner.plan import plan_rank
    from megatron.training.training import build_train_valid_test_data_iterators, setup_model_and_optimizer

    routing = contextlib.nullcontext()
    if "--num-experts" in argv and "--moe-pad-expert-input-to-capacity" not in argv:
        topk = argv[argv.index("--moe-router-topk") + 1] if "--moe-router-topk" in argv else 2
        routing = balanced_routing(int(topk))
    try:
        routing.__enter__()
        with contextlib.redirect_stdout(io.StringIO()):  # the argument block and build messages
            initialize_megatron(argv=list(argv))
            model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider, ModelType.encoder_or_decoder)
        args = get_args()
        with contextlib.redirect_stdout(io.StringIO()):
            train_iter, _, _ = build_train_valid_test_data_iterators(pretrain_gpt.train_valid_test_datasets_provider)
        schedule_peak = _train_step_peak(model, optimizer, scheduler, train_iter)  # Adam's state exists after it
        memory = optimizer_memory_per_parameter(model, optimizer)
        # the rest of the 3 iterations, their allocator peak on top of the steady state
        iteration_peak = sum(memory["bytes"].values()) + _iterations_peak(model, optimizer, scheduler, train_iter, 2)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        pp, vpp = args.pipeline_model_parallel_size, len(model)
        lay = layout_from_args(args)
        units = in_flight_units(lay, stage)
        per_chunk = []
        for c, chunk in enumerate(model):
            per_chunk.append(_chunk_saved_bytes(chunk, args, first=stage == 0 and c == 0,
                                                last=stage == pp - 1 and c == vpp - 1))
        measured = dict(memory["bytes"])
        measured["activations"] = sum(n * u for n, u in zip(per_chunk, units))
        measured["total"] = sum(measured.values())
        predicted = plan_rank(shape_from_args(args, get_tokenizer().vocab_size), lay, stage)
        return {"stage": stage, "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "dp_rank": parallel_state.get_data_parallel_rank(), "measured": measured,
                "predicted": predicted.memory_breakdown(), "num_parameters": memory["num_parameters"],
                "predicted_parameters": predicted.parameters, "chunk_activations": per_chunk, "units": units,
                "schedule_peak": schedule_peak, "iteration_peak": iteration_peak,
                "predicted_iteration_peak": predicted.peak_bytes,
                "predicted_peak": predicted.memory["activations"] + predicted.memory["recompute_working"]}
    finally:
        routing.__exit__(None, None, None)
        reset_megatron()


# The 10 dense layouts of docs/planner.md's table (the 4 MoE ones follow) on 4 gloo ranks: a 4-layer GPT (h 64, 4 heads,
# s 32, micro-batch 2, global batch 16, vocab 255 padded per TP), dropout on.
BASE_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
              "--lr", "1e-3", "--train-iters", "3", "--mock-data", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "255", "--num-workers", "0", "--eval-iters", "0", "--seed", "1234"]
LLAMA_FLAGS = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
               "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2",
               "--untie-embeddings-and-output-weights"]
LAYOUTS = {
    "tp1-pp1-dp4 fp32": [],
    "tp1-pp1-dp4 bf16 distopt": ["--bf16", "--use-distributed-optimizer"],
    "tp2-dp2 bf16": ["--bf16", "--tensor-model-parallel-size", "2"],
    "tp2-dp2 bf16 sp distopt": ["--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--use-distributed-optimizer"],
    "tp4 bf16 sp selective": ["--bf16", "--tensor-model-parallel-size", "4", "--sequence-parallel",
                              "--recompute-activations"],
    "tp2-pp2 bf16 full": ["--bf16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                          "--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "1"],
    "pp2-dp2 bf16 distopt": ["--bf16", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
    "pp4 fp32": ["--pipeline-model-parallel-size", "4"],
    "pp2-vpp2-dp2 bf16": ["--bf16", "--pipeline-model-parallel-size", "2",
                          "--num-layers-per-virtual-pipeline-stage", "1"],
    "tp2-pp2 bf16 llama selective distopt": ["--bf16", "--tensor-model-parallel-size", "2",
                                             "--pipeline-model-parallel-size", "2", "--recompute-activations",
                                             "--use-distributed-optimizer", *LLAMA_FLAGS],
}


# The 4 MoE layouts: 4 experts of width 64, top-2 (T k / E = 32 or 16 tokens per expert and rank).
MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64"]
LAYOUTS.update({
    "dp4 ep2 bf16 moe alltoall": ["--bf16", *MOE_FLAGS, "--expert-model-parallel-size", "2",
                                  "--moe-token-dispatcher-type", "alltoall"],
    "tp2-dp2 ep2 etp2 bf16 sp moe allgather": ["--bf16", *MOE_FLAGS, "--tensor-model-parallel-size", "2",
                                               "--sequence-parallel", "--expert-model-parallel-size", "2",
                                               "--expert-tensor-parallel-size", "2", "--disable-bias-linear"],
    "dp4 ep2 bf16 distopt moe alltoall grouped shared aux": [
        "--bf16", *MOE_FLAGS, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
        "--use-distributed-optimizer", "--moe-grouped-gemm", "--moe-shared-expert-intermediate-size", "32",
        "--moe-layer-freq", "2", "--moe-aux-loss-coeff", "1e-2", "--swiglu"],
    "tp2-pp2 ep2 etp1 bf16 sp moe alltoall capacity pad fp32-router": [
        "--bf16", *MOE_FLAGS, "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
        "1", "--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "1.5",
        "--moe-pad-expert-input-to-capacity", "--moe-router-dtype", "fp32"],
})


# 2 vocabulary-dominated layouts: GPT-2's 50257 tokens (padded to 50304 / 50432) at hidden 64, where
# the loss's [s, b, V] transients (logits, fp32 copies) are a quarter of the peak.
GPT2_VOCAB = ["--vocab-size", "50257"]
LAYOUTS.update({
    "tp1-pp1-dp4 fp32 gpt2-vocab": GPT2_VOCAB,
    "tp2-dp2 bf16 gpt2-vocab": [*GPT2_VOCAB, "--bf16", "--tensor-model-parallel-size", "2"],
})


# 1 context-parallel layout: CP 2 x DP 2 (allgather, no recompute: its gathered keys and values and its
# index are modelled), gradients reduced over DP x CP, each rank's batch its s/c tokens.
LAYOUTS.update({
    "cp2-dp2 bf16 llama allgather": ["--bf16", "--context-parallel-size", "2", "--cp-comm-type", "allgather",
                                     *LLAMA_FLAGS],
})


def measure_layouts(names: list | None = None) -> dict:
    """Task for every rank of a 4-rank job: {layout: this rank's measure_rank result}."""
    return {name: measure_rank(BASE_FLAGS + LAYOUTS[name]) for name in (names or list(LAYOUTS))}


def table_rows(per_rank: list) -> list:
    """(layout, rank, stage, measured, predicted, relative difference of the totals, predicted and
    measured schedule peak of the activations, predicted peak and the allocator's measured peak)
    per layout and rank from measure_layouts' results."""
    rows = []
    for name in per_rank[0]:
        for rank, results in enumerate(per_rank):
            r = results[name]
            measured, predicted = r["measured"]["total"], r["predicted"]["total"]
            rows.append((name, rank, r["stage"], r["measured"], r["predicted"], (predicted - measured) / measured,
                         r["predicted_peak"], r["schedule_peak"], r["predicted_iteration_peak"], r["iteration_peak"]))
    return rows
