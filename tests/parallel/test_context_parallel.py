"""Context parallelism against the serial run: same losses and every gradient (rel 1e-5).

A tiny GPT (learned positions, LayerNorm, multi-head, tied embeddings) and a tiny Llama (RoPE,
RMSNorm, SwiGLU, grouped-query attention, untied output) run the same micro-batches serially and
in each layout below; the CP runs cut every micro-batch with get_batch_on_this_cp_rank (the
load-balanced 2N chunks), reduce gradients with DistributedDataParallel over DP x CP and call
finalize_model_grads. The loss masks drop a different share of tokens on each CP rank, so the
per-micro-batch mean (default) and the per-token mean (calculate_per_token_loss) both have to
count the tokens of the whole sequence.

    layout            4 ranks
    cp4-<type>        CP = 4, each of p2p, a2a, allgather; a2a+p2p with [2, 2]
    cp2-<type>        CP = 2 x DP = 2 (each replica half the micro-batches)
    cp2-tp2-sp-<type> CP = 2 x TP = 2 with sequence parallelism
    cp2-pp2           CP = 2 x PP = 2 (1F1B), and interleaved (2 virtual chunks)
    recompute         selective (CP2 x TP2 + SP, p2p) and full (CP4, a2a+p2p): the exchanges rerun in backward
    cp4-mixed         one comm type per layer (Megatron's list form of --cp-comm-type)
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import gather_tensor_parallel
from megatron.model import GPTModel, TransformerConfig
from megatron.model.layer_specs import get_llama_layer_spec
from megatron.model.transformer_layer import get_layer_offset
from megatron.training.utils import get_batch_on_this_cp_rank

VOCAB, SEQ, MBS, HIDDEN, HEADS, LAYERS, SEED, MICROBATCHES = 300, 16, 2, 32, 8, 4, 1234, 4
TYPES = ("p2p", "a2a", "allgather")

LAYOUTS = {
    **{f"cp4-{t}": dict(cp=4, comm=t) for t in TYPES},
    "cp4-a2a+p2p": dict(cp=4, comm="a2a+p2p", hier=[2, 2]),
    "cp4-mixed": dict(cp=4, comm=["p2p", "allgather", "a2a", "a2a+p2p"], hier=[2, 2]),
    **{f"cp2-{t}": dict(cp=2, comm=t, split_data=True) for t in TYPES},
    **{f"cp2-tp2-sp-{t}": dict(cp=2, tp=2, sp=True, comm=t) for t in TYPES},
    **{f"cp2-pp2-{t}": dict(cp=2, pp=2, comm=t) for t in TYPES},
    "cp2-pp2-v2": dict(cp=2, pp=2, vpp=2, comm="a2a"),
    "cp2-tp2-sp-selective": dict(cp=2, tp=2, sp=True, comm="p2p", recompute="selective"),
    "cp4-full-recompute": dict(cp=4, comm="a2a+p2p", hier=[2, 2], recompute="full"),
}


def _padded(tp: int) -> int:
    return -(-VOCAB // (128 * tp)) * (128 * tp)


def _config(model: str, per_token: bool, cp: int = 1, tp: int = 1, pp: int = 1, vpp=None, sp: bool = False,
            comm=None, hier=None, recompute=None) -> TransformerConfig:
    llama = model == "llama"
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=2 if llama else None,
        ffn_hidden_size=48, normalization="RMSNorm" if llama else "LayerNorm", add_bias_linear=not llama,
        gated_linear_unit=llama, activation_func=F.silu if llama else F.gelu, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp, context_parallel_size=cp,
        cp_comm_type=comm, hierarchical_context_parallel_sizes=hier, calculate_per_token_loss=per_token,
        recompute_granularity=recompute, recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
        fused_kernels_cpu_impl="reference")


def build_chunks(model: str, per_token: bool, **layout):
    config = _config(model, per_token, **{k: v for k, v in layout.items() if k != "split_data"})
    vpp = layout.get("vpp")
    chunks, offsets = [], []
    for chunk_id in range(vpp or 1):
        if vpp is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id)
        torch.manual_seed(SEED)
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
        llama = model == "llama"
        chunks.append(GPTModel(config, vocab_size=_padded(config.tensor_model_parallel_size), num_tokens=VOCAB,
                               max_sequence_length=SEQ, share_embeddings_and_output_weights=not llama,
                               position_embedding_type="rope" if llama else "learned_absolute",
                               transformer_layer_spec=get_llama_layer_spec() if llama else None,
                               pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage()))
        offsets.append(get_layer_offset(config))
    if vpp is not None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks, offsets


def microbatches():
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)
        loss_mask = (torch.rand(MBS, SEQ, generator=generator) > 0.3).float()
        loss_mask[:, :3] = 0.0  # the first chunk (CP rank 0's) loses more tokens than the others
        batches.append({"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
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


def packed_microbatches():
    """Rows of several documents each (other boundaries in each row; documents span the CP chunks):
    cu_seqlens [b, s + 1] padded with s, position_ids restarting at each document."""
    batches = microbatches()
    for index, batch in enumerate(batches):
        cu_rows, positions = [], []
        for row in range(MBS):
            ends = PACKED_ENDS[(index + row) % len(PACKED_ENDS)]
            cu = torch.full((SEQ + 1,), SEQ, dtype=torch.int32)
            cu[:len(ends) + 1] = torch.tensor([0, *ends], dtype=torch.int32)
            cu_rows.append(cu)
            starts = torch.tensor([0, *ends[:-1]])
            document = torch.searchsorted(torch.tensor(ends), torch.arange(SEQ), right=True)
            positions.append(torch.arange(SEQ) - starts[document])
        batch["cu_seqlens"] = torch.stack(cu_rows)  # [b, s + 1]
        batch["position_ids"] = torch.stack(positions)  # [b, s]
    return batches


PACKED_ENDS = ([5, 11, 16], [3, 16], [7, 8, 14, 16], [16])  # each row's document ends (s = 16)


def _packed_forward_step(data_iterator, model):
    from megatron.model.packed_seq import PackedSeqParams

    batch = get_batch_on_this_cp_rank(next(data_iterator))  # [b, s/N] each, cu_seqlens [b, s + 1] whole
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=PackedSeqParams(batch["cu_seqlens"]))  # [b, s/N]
    loss_mask = batch["loss_mask"]

    def loss_func(output):
        loss = (output.float() * loss_mask).sum()
        count = loss_mask.sum().to(torch.int)
        return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

    return losses, loss_func


def _run(chunks, per_token: bool, serial: bool, share: slice = slice(None), packed: bool = False):
    batches = (packed_microbatches() if packed else microbatches())[share]
    iterators = [iter(batches) for _ in chunks]
    func = schedules.forward_backward_no_pipelining if serial else schedules.get_forward_backward_func()
    step = _packed_forward_step if packed else _forward_step
    reported = func(forward_step_func=step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
                    model=chunks, num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS,
                    calculate_per_token_loss=per_token, finalize_model_grads_func=None if serial else finalize_model_grads)
    return [entry["lm loss"] for entry in reported]  # [sum, count] of this rank's tokens, per micro-batch


def _serial(model: str, per_token: bool, packed: bool = False):
    parallel_state.initialize_model_parallel()
    (serial,), _ = build_chunks(model, per_token)
    reported = _run([serial], per_token, serial=True, packed=packed)
    parallel_state.destroy_model_parallel()
    losses = [(x[0] / x[1]).item() for x in reported]
    return losses, {name: p.grad for name, p in serial.named_parameters()}


def _serial_name(name: str, offset: int) -> str:
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def _compare(model: str, per_token: bool, layout: dict, serial_losses: list, serial_grads: dict,
             packed: bool = False) -> dict:
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.get("tp", 1), pipeline_model_parallel_size=layout.get("pp", 1),
        virtual_pipeline_model_parallel_size=layout.get("vpp"), context_parallel_size=layout["cp"],
        hierarchical_context_parallel_sizes=layout.get("hier"))
    chunks, offsets = build_chunks(model, per_token, **layout)
    chunks = [DistributedDataParallel(c.config, DistributedDataParallelConfig(), c) for c in chunks]
    share = slice(None)
    if layout.get("split_data"):  # each DP replica its half of the micro-batches
        d, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        share = slice(r * MICROBATCHES // d, (r + 1) * MICROBATCHES // d)
    reported = _run(chunks, per_token, serial=False, share=share, packed=packed)
    losses = []
    for entry in reported:  # the whole micro-batch's sum and count: summed over the CP ranks
        total = entry.clone()
        dist.all_reduce(total, group=parallel_state.get_context_parallel_group())
        losses.append((total[0] / total[1]).item())
    grad_errors = {}
    for chunk, offset in zip(chunks, offsets):
        for name, param in chunk.module.named_parameters():
            if name == "output_layer.weight" and model == "gpt":  # the last stage's copy of the tied embedding
                name = "embedding.word_embeddings.weight"
            expected = serial_grads[_serial_name(name, offset)]
            grad = gather_tensor_parallel(param, param.main_grad)
            rows = slice(0, VOCAB) if "word_embeddings" in name or "output_layer" in name else slice(None)
            grad_errors[f"{name}@{offset}"] = _relative_error(grad[rows], expected[rows])
    parallel_state.destroy_model_parallel()
    return {"losses": losses, "serial_losses": serial_losses[share], "grad_errors": grad_errors}


def _compare_layouts(model: str, per_token: bool, names: list) -> dict:
    serial = _serial(model, per_token)
    return {name: _compare(model, per_token, LAYOUTS[name], *serial) for name in names}


@pytest.mark.parametrize("model, per_token", [("gpt", False), ("llama", True)], ids=["gpt-per-sample", "llama-per-token"])
def test_context_parallel_layouts_equal_the_serial_run(dist_pool, model, per_token):
    results = dist_pool.run(_compare_layouts, model, per_token, list(LAYOUTS))
    for rank, per_layout in enumerate(results):
        for name, result in per_layout.items():
            bad = {key: error for key, error in result["grad_errors"].items() if error > 1e-5}
            assert not bad, (name, rank, bad)
            if result["losses"]:  # the last pipeline stage reports them
                assert result["losses"] == pytest.approx(result["serial_losses"], rel=1e-5), (name, rank)
    for name, layout in LAYOUTS.items():
        reported = [per_layout[name]["losses"] for per_layout in results if per_layout[name]["losses"]]
        assert len(reported) == dist_pool.world_size // layout.get("pp", 1), name


# ------------------------------------------------------------------------------ packed sequences

PACKED_LAYOUTS = {
    "cp2-p2p": LAYOUTS["cp2-p2p"],
    "cp2-a2a": LAYOUTS["cp2-a2a"],
    "cp2-allgather": LAYOUTS["cp2-allgather"],
    "cp4-a2a+p2p": LAYOUTS["cp4-a2a+p2p"],
    "cp2-tp2-sp-p2p": LAYOUTS["cp2-tp2-sp-p2p"],
    "cp2-tp2-sp-a2a": LAYOUTS["cp2-tp2-sp-a2a"],
    "cp2-pp2": LAYOUTS["cp2-pp2"],
}


def _packed_leak(comm: str, hier=None) -> dict:
    """Logits of a packed batch at CP 4 (llama, RoPE) before and after changing the first token of
    the rows' first documents: this rank's tokens of the other documents get the same logits, the
    first documents' later tokens other ones."""
    parallel_state.initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=hier)
    (model,), _ = build_chunks("llama", False, cp=4, comm=comm, hier=hier)
    model.eval()
    from megatron.model.packed_seq import PackedSeqParams

    batch = packed_microbatches()[0]
    changed = dict(batch, tokens=batch["tokens"].clone())
    changed["tokens"][:, 0] = (changed["tokens"][:, 0] + 1) % VOCAB
    logits = []
    with torch.no_grad():
        for data in (batch, changed):
            local = get_batch_on_this_cp_rank(data)
            logits.append(model(local["tokens"], local["position_ids"], None,
                                packed_seq_params=PackedSeqParams(local["cu_seqlens"])))  # [b, s/N, v]
        refused = {}  # masks CP cannot take: one that hides a token from itself, one of another shape
        for case, mask in (("self", torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool)),
                           ("shape", torch.zeros(1, 1, SEQ // 2, SEQ // 2, dtype=torch.bool))):
            try:
                model(local["tokens"], local["position_ids"], mask)
                refused[case] = None
            except ValueError as error:
                refused[case] = str(error)
    first = PackedSeqParams(batch["cu_seqlens"]).segment_ids(SEQ) == 0  # [b, s]
    first = get_batch_on_this_cp_rank({"first": first})["first"]  # this rank's tokens
    difference = (logits[0] - logits[1]).abs().amax(dim=-1)  # [b, s/N]
    parallel_state.destroy_model_parallel()
    return {"other_documents": difference[~first].max().item() if (~first).any() else 0.0,
            "first_document": difference[first].min().item() if first.any() else None, "refused": refused}


def _packed_runs(model: str, per_token: bool) -> dict:
    serial = _serial(model, per_token, packed=True)
    compared = {name: _compare(model, per_token, layout, *serial, packed=True) for name, layout in PACKED_LAYOUTS.items()}
    leaks = {comm: _packed_leak(comm, hier=[2, 2] if comm == "a2a+p2p" else None)
             for comm in ("p2p", "a2a", "allgather", "a2a+p2p")} if model == "llama" else {}
    return {"compared": compared, "leaks": leaks}


@pytest.mark.parametrize("model, per_token", [("gpt", False), ("llama", True)], ids=["gpt-per-sample", "llama-per-token"])
def test_packed_sequences_under_cp_equal_the_serial_packed_run(dist_pool, model, per_token):
    """Packed rows (per-document causal mask, positions restarting per document; other boundaries
    in each row of the micro-batch) at CP 2 x DP 2 (p2p, a2a, allgather), CP 4 (a2a+p2p),
    CP 2 x TP 2 + SP (p2p, a2a) and CP 2 x PP 2 (p2p; each stage makes the masks from the whole
    row's cu_seqlens): the serial packed run's losses and every gradient (rel 1e-5).
    With llama also: no attention across documents at CP 4 (each comm type), and a mask hiding a
    token from itself or of another shape refused in one line."""
    results = dist_pool.run(_packed_runs, model, per_token)
    for rank, result in enumerate(results):
        for name, compared in result["compared"].items():
            bad = {key: error for key, error in compared["grad_errors"].items() if error > 1e-5}
            assert not bad, (name, rank, bad)
            if compared["losses"]:  # the last pipeline stage reports them
                assert compared["losses"] == pytest.approx(compared["serial_losses"], rel=1e-5), (name, rank)
        for comm, leak in result["leaks"].items():
            assert leak["other_documents"] == 0.0, (comm, rank, leak)  # masked keys weigh exactly 0
            if leak["first_document"] is not None:
                assert leak["first_document"] > 1e-4, (comm, rank, leak)
            assert "attend to itself" in leak["refused"]["self"], leak["refused"]
            assert "a mask over the whole sequence" in leak["refused"]["shape"], leak["refused"]
    for name, layout in PACKED_LAYOUTS.items():
        reported = [result["compared"][name]["losses"] for result in results if result["compared"][name]["losses"]]
        assert len(reported) == dist_pool.world_size // layout.get("pp", 1), name
    if model == "llama":
        assert all(result["leaks"] for result in results)
        assert any(result["leaks"]["p2p"]["first_document"] is not None for result in results)


# ------------------------------------------------------------------------------ MoE

MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2, moe_aux_loss_coeff=0.01,
           moe_z_loss_coeff=0.001)


def _moe_chunks(cp: int = 1, ep: int = 1, comm=None):
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=48,
                               hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
                               normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                               context_parallel_size=cp, cp_comm_type=comm, expert_model_parallel_size=ep,
                               fused_kernels_cpu_impl="reference", **MOE)
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    return GPTModel(config, vocab_size=_padded(1), num_tokens=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def _moe_compare(comm: str) -> dict:
    """A 2-layer MoE GPT (4 experts, top-2, aux and z losses) serially and at CP 2 x EP 2: the balancing
    losses count the tokens of the whole sequence (summed over TP x CP), experts see every CP rank's tokens."""
    parallel_state.initialize_model_parallel()
    serial = _moe_chunks()
    _run([serial], False, serial=True)
    expected = {name: p.grad for name, p in serial.named_parameters()}
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(context_parallel_size=2, expert_model_parallel_size=2)
    model = DistributedDataParallel(_moe_chunks(2, 2, comm).config, DistributedDataParallelConfig(),
                                    _moe_chunks(2, 2, comm))
    _run([model], False, serial=False)
    local = MOE["num_moe_experts"] // 2
    first = parallel_state.get_expert_model_parallel_rank() * local
    errors = {}
    for name, param in model.module.named_parameters():
        serial_name = name
        if ".local_experts." in name:  # local expert i of EP rank r is global expert r * E/EP + i
            head, rest = name.split(".local_experts.")
            index, tail = rest.split(".", 1)
            serial_name = f"{head}.local_experts.{first + int(index)}.{tail}"
        rows = slice(0, VOCAB) if "word_embeddings" in name or "output_layer" in name else slice(None)
        errors[name] = _relative_error(param.main_grad[rows], expected[serial_name][rows])
    parallel_state.destroy_model_parallel()
    return errors


@pytest.mark.parametrize("comm", TYPES)
def test_moe_cp2_ep2_gradients_equal_the_serial_run(dist_pool, comm):
    for rank, errors in enumerate(dist_pool.run(_moe_compare, comm)):
        assert any(".local_experts." in name for name in errors)
        bad = {name: error for name, error in errors.items() if error > 1e-5}
        assert not bad, (rank, bad)


# ------------------------------------------------------------------------------ attention dropout

def _dropout_runs() -> dict:
    """CP 2 (p2p and a2a) with attention dropout 0.1: the dropout draws from the TP rank's tracker stream,
    so the same seed gives the same loss, and selective recompute redraws the same masks (same gradients)."""
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    out = {}
    for comm in ("p2p", "a2a"):
        runs = []
        for recompute in (None, "selective"):
            config = _config("llama", False, cp=2, comm=comm, recompute=recompute)
            config.attention_dropout = 0.1
            torch.manual_seed(SEED)
            tensor_parallel.model_parallel_cuda_manual_seed(SEED)
            model = GPTModel(config, vocab_size=_padded(1), num_tokens=VOCAB, max_sequence_length=SEQ,
                             position_embedding_type="rope", share_embeddings_and_output_weights=False,
                             transformer_layer_spec=get_llama_layer_spec())
            batch = get_batch_on_this_cp_rank(microbatches()[0])
            loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum()
            loss.backward()
            runs.append((loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])))
        model.eval()
        with torch.no_grad():
            plain = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum().item()
        out[comm] = {"losses": [r[0] for r in runs], "plain": plain,
                     "recompute_grad_error": _relative_error(runs[1][1], runs[0][1])}
    parallel_state.destroy_model_parallel()
    return out


def test_attention_dropout_under_cp_is_seeded_and_survives_recompute(dist_pool):
    for per_comm in dist_pool.run(_dropout_runs):
        for comm, result in per_comm.items():
            first, recomputed = result["losses"]  # two models built from the same seeds
            assert first == recomputed, comm
            assert first != result["plain"], comm  # the dropout acted
            assert result["recompute_grad_error"] == 0.0, comm  # recompute redrew the same masks


# ------------------------------------------------------------------------------ optimizer step

# SGD with clip_grad below the norm: the step depends on the grad norm, which must count each
# gradient once although the CP ranks hold the same (reduced) gradients.
OPTIMIZER = dict(optimizer="sgd", lr=0.1, clip_grad=0.5, log_num_zeros_in_grad=True)


def _optimizer_step(layout: dict) -> dict:
    """One global batch and one step, serially and at `layout` (CP x DP, each DP replica half the
    micro-batches; the distributed optimizer shards over DP x CP)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    def step(chunks, share, serial):
        optimizer = get_megatron_optimizer(OptimizerConfig(**OPTIMIZER), chunks)
        optimizer.zero_grad()
        reported = _run(chunks, False, serial=serial, share=share)
        _, grad_norm, num_zeros = optimizer.step()
        return reported, grad_norm, num_zeros

    parallel_state.initialize_model_parallel()
    (serial,), _ = build_chunks("llama", False)
    _, serial_norm, serial_zeros = step([serial], slice(None), serial=True)  # plain optimizer, param.grad
    expected = {name: p.detach().clone() for name, p in serial.named_parameters()}
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(context_parallel_size=layout["cp"])
    (model,), _ = build_chunks("llama", False, cp=layout["cp"], comm=layout["comm"])
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=3000)  # several buckets
    model = DistributedDataParallel(model.config, ddp, model)
    d, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    _, grad_norm, num_zeros = step([model], slice(r * MICROBATCHES // d, (r + 1) * MICROBATCHES // d), serial=False)
    errors = {name: _relative_error(p.detach(), expected[name]) for name, p in model.module.named_parameters()}
    shards = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    parallel_state.destroy_model_parallel()
    return {"serial_norm": serial_norm, "grad_norm": grad_norm, "serial_zeros": serial_zeros,
            "num_zeros": num_zeros, "errors": errors, "shards": shards}


@pytest.mark.parametrize("comm", TYPES)
def test_cp2_dp2_distributed_optimizer_step_equals_the_serial_step(dist_pool, comm):
    for result in dist_pool.run(_optimizer_step, dict(cp=2, comm=comm)):
        assert result["shards"] == 4  # the optimizer state is cut over DP x CP
        assert result["serial_norm"] > OPTIMIZER["clip_grad"]  # the step is clipped: it depends on the norm
        assert result["grad_norm"] == pytest.approx(result["serial_norm"], rel=1e-5)
        assert result["num_zeros"] == result["serial_zeros"]
        bad = {name: error for name, error in result["errors"].items() if error > 1e-5}
        assert not bad, bad


# ------------------------------------------------------------------------------ activation bytes

def _activation_bytes() -> dict:
    """Bytes one bf16 layer saves for backward (activation_memory.measure_layer_activation_bytes), the
    paper's and the Llama-style one, with selective and full recompute: serially and on every CP rank."""
    from megatron.model.activation_memory import measure_layer_activation_bytes

    def measure(kind, recompute, llama):
        return measure_layer_activation_bytes(64, 2, 64, 8, dtype=torch.bfloat16, recompute=recompute,
                                              llama_query_groups=2 if llama else None)

    cases = [(recompute, llama) for recompute in ("selective", "full") for llama in (False, True)]
    measured = {}
    for cp, kinds in ((1, ("p2p",)), (2, TYPES), (4, TYPES + ("a2a+p2p",))):
        parallel_state.initialize_model_parallel(context_parallel_size=cp,
                                                 hierarchical_context_parallel_sizes=[2, 2] if cp == 4 else None)
        for kind in kinds:
            for recompute, llama in cases:
                config_kind = kind if cp > 1 else None
                measured[(cp, config_kind, recompute, llama)] = _measure_with(measure, config_kind, recompute, llama)
        parallel_state.destroy_model_parallel()
    return measured


def _measure_with(measure, kind, recompute, llama):
    from megatron.model import activation_memory

    original = activation_memory.layer_config

    def with_comm_type(*args, **kwargs):  # the layer's cp_comm_type (the measurement's config has the default)
        config = original(*args, **kwargs)
        config.cp_comm_type = kind
        return config

    activation_memory.layer_config = with_comm_type
    try:
        return measure(kind, recompute, llama)
    finally:
        activation_memory.layer_config = original


def test_activation_bytes_per_cp_rank_are_the_serial_bytes_over_n(dist_pool):
    """With recompute every saved tensor is per token (layer norms, linear inputs, q/k/v or the layer
    input): each CP rank saves exactly 1/N of the serial layer's bytes, for every comm type."""
    per_rank = dist_pool.run(_activation_bytes)
    for measured in per_rank:
        for (cp, kind, recompute, llama), value in measured.items():
            serial = measured[(1, None, recompute, llama)]
            assert value * cp == serial, (cp, kind, recompute, llama, value, serial)
    assert len({tuple(sorted(m.items())) for m in per_rank}) == 1  # the same on every rank (balanced layout)
