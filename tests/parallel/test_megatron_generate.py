"""megatron_generate (Accelerate's MegatronEngine.megatron_generate) and Megatron-LM's
text_generation interface at TP = 2 x PP = 2 give the serial run's tokens in every mode.

Every rank sets the global args as Accelerate's initialize leaves them (GPT-2's BPE, the legacy
GPTModel of 4 layers, hidden 32) and builds the serial model (TP = PP = 1: the 4 ranks are 4
replicas); then the TP = 2 x PP = 2 model, whose parameters are the serial ones' shards (a stage
takes its layers). Both padded vocabularies are the TP = 2 one, so that the shards are the serial
rows. Each mode runs on both, with the same seed: greedy (top_k = 1), top-k, top-p with decay and
bound, the whole distribution at a temperature (top_k = top_p = 0, Megatron's sampling), add_BOS,
max_length, beam search on one prompt; greedy also equals megatron.inference.api.generate.
Only rank 0's prompts count (Accelerate broadcasts them): the other ranks pass other ids.
"""

import copy

import pytest
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layout import shard_for_rank
from megatron.inference.api import generate
from megatron.inference.text_generation import communication as comm
from megatron.inference.text_generation.accelerate_generate import megatron_generate
from megatron.inference.text_generation.generation import (beam_search_and_return_on_first_stage,
                                                           generate_tokens_probs_and_return_on_first_stage)
from megatron.legacy.model import GPTModel
from megatron.model.transformer_layer import get_layer_offset
from megatron.training import global_vars
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron.training.tokenizer import vocab_size_with_padding
from megatron.training.tokenizer.null_tokenizer import NullTokenizer
from tests.parallel.harness import init_parallel

SEED, SEQ, NEW = 1234, 64, 10
TEXTS = ["The purpose of life is", "Are you human?", "Note:"]  # "Note:" ends in a colon: no newline after it
MODES = {  # name: megatron_generate's keywords
    "greedy": dict(top_k=1),
    "top-k": dict(top_k=5, temperature=0.9, random_seed=7),
    "top-p-decay": dict(top_p=0.8, top_p_decay=0.5, top_p_bound=0.3, temperature=0.9, random_seed=11),
    "temperature": dict(temperature=0.7, random_seed=3),
    "add-BOS": dict(top_k=1, add_BOS=True),
    "max-length": dict(top_k=1, max_length=20, max_new_tokens=None),
    "beam": dict(num_beams=3, length_penalty=1.5),
}


def _set_args(vocab_dir: str, tp: int, pp: int):
    """The global args (with the GPT-2 tokenizer) as Accelerate's initialize leaves them."""
    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "1", "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--vocab-file", f"{vocab_dir}/vocab.json", "--merge-file", f"{vocab_dir}/merges.txt",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), "--seed", str(SEED),
            "--mock-data"]
    args = parse_and_validate_args(argv=argv, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    global_vars.set_global_variables(args)
    args.model_type_name = "gpt"  # Accelerate's plugin sets it
    args.data_parallel_size = 1  # the serial run: 4 replicas that each generate alone
    two = copy.copy(args)
    two.tensor_model_parallel_size = 2
    args.padded_vocab_size = vocab_size_with_padding(global_vars.get_tokenizer().vocab_size, two)
    return args


def _model(args) -> GPTModel:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    return GPTModel(core_transformer_config_from_args(args), num_tokentypes=0, parallel_output=True,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())


def _shard(model: GPTModel, full: dict) -> GPTModel:
    """model's parameters cut from the serial state dict (its layers, its TP slice)."""
    offset, rank = get_layer_offset(model.config), parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offset)
            key = ".".join(parts)
            if key not in full:  # tied: the last stage's copy of the embedding
                key = "embedding.word_embeddings.weight"
            param.copy_(shard_for_rank(full[key], param, tp, rank))
    return model


def _prompts(tokenizer):
    """Right-padded ids [b, n] (padding eod) and the attention mask, as transformers' tokenizer pads."""
    rows = [tokenizer.tokenize(text) for text in TEXTS]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), tokenizer.eod, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    return ids, mask


def _run_modes(model) -> dict:
    tokenizer = global_vars.get_tokenizer()
    ids, mask = _prompts(tokenizer)
    given = ids  # megatron_generate takes rank 0's prompts: the other ranks pass other ids
    if torch.distributed.get_rank() != 0:
        given = torch.randint(0, 1000, ids.shape, generator=torch.Generator().manual_seed(99))
    out = {}
    for name, keywords in MODES.items():
        keywords = {"max_new_tokens": NEW, **keywords}
        batch = 1 if name == "beam" else len(TEXTS)
        out[name] = megatron_generate(model, given[:batch], mask[:batch], **keywords)
    # Megatron's functions themselves: log-probs, lengths, the beams' scores
    tokens = torch.full((len(TEXTS), 16), tokenizer.eod)
    tokens[:, :ids.shape[1]] = ids
    torch.manual_seed(5)
    chunk = model.module[0]
    out["megatron-generate"] = generate_tokens_probs_and_return_on_first_stage(
        [chunk], tokens, mask.sum(-1), return_output_log_probs=True, top_k=3, use_eod_token_for_early_termination=False)
    out["megatron-beam"] = beam_search_and_return_on_first_stage(chunk, tokens[:1], mask[:1].sum(-1), 4,
                                                                 tokenizer.eod, 3, 1.0)
    out["api-greedy"] = generate(chunk, tokenizer, TEXTS, out["greedy"].shape[1] - ids.shape[1], top_k=1,
                                 prevent_newline_after_colon=True)["tokens"]
    out["prompt-ids"], out["prompt-lengths"] = ids.tolist(), mask.sum(-1).tolist()
    return out


class _Engine:
    """What megatron_generate reads of Accelerate's MegatronEngine: .module, the list of chunks."""

    def __init__(self, model):
        self.module, self.base_model = [model], model


def _serial_and_parallel(vocab_dir: str) -> dict:
    try:
        init_parallel(tp=1)
        args = _set_args(vocab_dir, 1, 1)
        serial = _model(args)
        results = {"serial": _run_modes(_Engine(serial))}
        full = serial.state_dict()
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()
        init_parallel(tp=2, pp=2)
        args = _set_args(vocab_dir, 2, 2)
        results["tp2-pp2"] = _run_modes(_Engine(_shard(_model(args), full)))
        return results
    finally:
        global_vars.unset_global_variables()


@pytest.fixture(scope="module")
def results(dist_pool, gpt2_vocab_dir):
    return dist_pool.run(_serial_and_parallel, str(gpt2_vocab_dir))


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_at_tp2_pp2_gives_the_serial_tokens(results, mode):
    for rank, result in enumerate(results):
        serial, parallel = result["serial"][mode], result["tp2-pp2"][mode]
        assert torch.equal(parallel, serial), (rank, mode, serial.tolist(), parallel.tolist())
        assert serial.shape[1] % 4 == 0, (rank, mode, serial.shape)  # Accelerate's width, a multiple of 4
        assert torch.equal(serial, results[0]["serial"][mode]), (rank, mode)  # rank 0's prompts everywhere


def test_the_rows_keep_their_prompts(results):
    result = results[0]["serial"]
    ids, lengths = result["prompt-ids"], result["prompt-lengths"]
    for mode in MODES:
        bos = 1 if mode == "add-BOS" else 0
        for row, prompt, n in zip(result[mode].tolist(), ids, lengths):
            assert row[bos:bos + n] == prompt[:n], mode
            if bos:
                assert row[0] == 50256  # GPT-2's eod as BOS
    width = 4 * -(-(len(ids[0]) + NEW) // 4)  # prompt width + new tokens, rounded up to a multiple of 4
    assert result["greedy"].shape[1] <= width and result["max-length"].shape[1] <= 20
    assert result["beam"].shape == (1, width)  # the hypothesis, then the row's eod padding


def test_greedy_equals_the_projects_generate(results):
    for rank, result in enumerate(results):
        for layout in ("serial", "tp2-pp2"):
            greedy = result[layout]["greedy"].tolist()
            for row, expected in zip(greedy, result[layout]["api-greedy"]):
                assert row[:len(expected)] == expected, (rank, layout)
                assert len(expected) == len(row) or expected[-1] == 50256  # api.generate cuts after eod


def test_megatrons_functions_at_tp2_pp2_give_the_serial_results(results):
    for rank, result in enumerate(results):
        serial, parallel = result["serial"], result["tp2-pp2"]
        (tokens, lengths, log_probs), (tokens2, lengths2, log_probs2) = serial["megatron-generate"], \
            parallel["megatron-generate"]
        assert tokens.shape == (len(TEXTS), 16) and log_probs.shape == (len(TEXTS), 15)  # no early stop
        assert torch.equal(tokens2, tokens) and torch.equal(lengths2, lengths), rank
        torch.testing.assert_close(log_probs2, log_probs, rtol=0, atol=1e-4)
        (beams, scores), (beams2, scores2) = serial["megatron-beam"], parallel["megatron-beam"]
        assert beams.shape == (3, 16) and scores.shape == (3,)
        assert torch.equal(beams2, beams), rank
        torch.testing.assert_close(scores2, scores, rtol=0, atol=1e-4)
        assert bool((scores[:-1] >= scores[1:]).all())  # best first


# --------------------------------------------------------------------------- the broadcasts

def _broadcasts() -> dict:
    init_parallel(tp=2, pp=2)
    rank = torch.distributed.get_rank()
    out = {"ints": comm.broadcast_int_list(3, int_list=[1, 2, 3] if rank == 0 else None).tolist(),
           "floats": comm.broadcast_float_list(2, float_list=[0.5, 1.5] if rank == 0 else None).tolist(),
           "replica": comm.broadcast_int_list(1, int_list=[rank], data_parallel=True).tolist()}
    last = parallel_state.is_pipeline_last_stage()
    mine = torch.tensor([10.0 + rank, 20.0])
    out["from-last"] = comm.broadcast_from_last_pipeline_stage(2, torch.float32, mine if last else None).tolist()
    received = comm.broadcast_from_last_to_first_pipeline_stage(2, torch.float32, mine if last else None)
    out["last-to-first"] = None if received is None else received.tolist()
    target = torch.zeros(2, 3)
    if last:
        target[:, 1] = torch.tensor([7.0, 8.0])
    comm.copy_from_last_to_first_pipeline_stage(2, torch.float32, target[:, 1])  # a non-contiguous view
    out["copied"] = target[:, 1].tolist()
    return out


def test_the_broadcasts_reach_the_ranks_megatron_says(dist_pool):
    results = dist_pool.run(_broadcasts)
    # TP = 2 x PP = 2: ranks 0, 1 are stage 0 and ranks 2, 3 stage 1; pipeline groups {0, 2} and {1, 3}
    for rank, out in enumerate(results):
        assert out["ints"] == [1, 2, 3] and out["floats"] == [0.5, 1.5]
        assert out["replica"] == [0]  # the model-parallel group's first rank
        last_rank = 2 + rank % 2
        assert out["from-last"] == [10.0 + last_rank, 20.0]
        assert out["last-to-first"] == [10.0 + last_rank, 20.0]
        assert out["copied"] == [7.0, 8.0]


# --------------------------------------------------------------------------- the argument checks

@pytest.fixture
def accelerate_globals(monkeypatch):
    args = type("Args", (), dict(model_type_name="gpt", data_parallel_size=1, sequence_parallel=False,
                                 recompute_granularity=None, vocab_file="vocab.json"))()
    monkeypatch.setattr(global_vars, "_ARGS", args)
    monkeypatch.setattr(global_vars, "_TOKENIZER", NullTokenizer(100))
    return args


INPUTS = torch.zeros(2, 5, dtype=torch.int64)


@pytest.mark.parametrize("setting, keywords, error, message", [
    ("model_type_name", "bert", NotImplementedError, "Generate method is not implemented for this model"),
    ("data_parallel_size", 2, ValueError, "Generate method requires data parallelism to be 1"),
    ("sequence_parallel", True, ValueError, "Generate method requires sequence parallelism to be False"),
    ("recompute_granularity", "full", ValueError, "Checkpoint activations cannot be set for inference"),
    ("vocab_file", None, ValueError, "Vocab file is required for inference"),
    (None, {}, ValueError, "`max_length` or `max_new_tokens` are required for inference"),
    (None, dict(max_new_tokens=4, temperature=0.0), ValueError,
     "temperature must be a positive number less than or equal to 100.0"),
    (None, dict(max_new_tokens=4, top_k=1001), ValueError,
     "top_k must be a positive number less than or equal to 1000"),
    (None, dict(max_new_tokens=4, top_k=5, top_p=0.5), ValueError, "top_p and top_k sampling cannot be set together"),
    (None, dict(max_new_tokens=4, top_p=1.5), ValueError, "top_p must be less than or equal to 1.0"),
    (None, dict(max_new_tokens=4, top_p_decay=2.0), ValueError, "top_p_decay must be less than or equal to 1.0"),
    (None, dict(max_new_tokens=4, top_p_bound=-1.0), ValueError, "top_p_bound must be less than or equal to 1.0"),
    (None, dict(max_new_tokens=4, add_BOS=1), ValueError, "add_BOS must be a boolean"),
    (None, dict(max_new_tokens=4, num_beams=2.0), ValueError, "beam_width must be an integer"),
    (None, dict(max_new_tokens=4, num_beams=0), ValueError, "beam_width must be greater than 0"),
    (None, dict(max_new_tokens=4, num_beams=2), ValueError, "When doing beam_search, batch size must be 1"),
    (None, dict(max_new_tokens=4, stop_token="x"), ValueError, "stop_token must be an integer"),
    (None, dict(max_length=5), ValueError, "max_new_tokens must be greater than 0"),
    (None, dict(max_new_tokens=0), ValueError, "max_new_tokens must be greater than 0"),
])
def test_the_argument_checks_raise_accelerates_one_line_errors(accelerate_globals, setting, keywords, error, message):
    if setting is not None:
        setattr(accelerate_globals, setting, keywords)
        keywords = dict(max_new_tokens=4)
    with pytest.raises(error) as raised:
        megatron_generate(torch.nn.Linear(1, 1), INPUTS, **keywords)
    assert str(raised.value) == message


def test_more_than_one_model_chunk_is_refused_in_one_line(accelerate_globals):
    with pytest.raises(ValueError, match=r"^text generation takes one model chunk per pipeline stage, got 2 "
                                         r"\(virtual pipeline parallelism / interleaving is not supported"):
        generate_tokens_probs_and_return_on_first_stage([torch.nn.Linear(1, 1)] * 2, INPUTS, torch.tensor([5, 5]))
