"""Accelerate's Megatron-LM guide, feature by feature, on this project on CPU (gloo).

tests/data/accelerate/guide_features.py writes each feature as the guide does and runs under
`torchrun -m megatron.training.accelerate_launch`, on one process and on a parallel layout; the
main process reports what it measured as JSON:

    gpt      the guide's GPTTrainStepWithCustomLoss (its key-token-weighted loss), with the guide's
             other_megatron_args (rotary + multiquery; alibi), then megatron_generate in the guide's
             modes: 1 process vs TP 2 x PP 2
    indexed  MegatronLMDummyDataLoader over a .bin/.idx dataset with the guide's while loop, and
             return_logits on evaluation: 1 process vs TP 2 (its second rank gets no dataloader)
    resume   save_state after 2 of 4 steps, load_state in a new job, 2 more: vs 4 steps in one job
             (DP 2, the distributed optimizer, dropout on), and the returned logits
    bert/t5  a MegatronBert masked LM and a T5 through accelerator.prepare: 1 process vs TP 2
    hf_checkpoint  the guide's HF -> Megatron recipe: an HF GPT-2 converted by tools/checkpoint/convert.py,
             `release` renamed to `iter_0000000`, load_state without the optimizer: the HF model's loss
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.data import accelerate_fixture
from tests.helpers.launch import free_port
from tests.helpers.paths import ROOT

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

SCRIPT = ROOT / "tests" / "data" / "accelerate" / "guide_features.py"
STEPS = 4


def _launch(root, name, nproc, config, tp=1, pp=1, distributed_optimizer=False, launcher=True, env=None):
    """torchrun [-m megatron.training.accelerate_launch] guide_features.py CONFIG; launcher=False runs
    the script as `accelerate launch` does on GPUs (torchrun with ACCELERATE_USE_MEGATRON_LM and the
    MEGATRON_LM_* variables): only the installed start-up hook (megatron/startup) is there."""
    config = {"steps": STEPS, "out": str(root / f"{name}.json"), "text_file": str(root / "train.txt"),
              "model_dir": str(root / "tiny-gpt2"), **config}
    (root / f"{name}.config.json").write_text(json.dumps(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(root / "hf_home"),
           "MEGATRON_LM_TP_DEGREE": str(tp), "MEGATRON_LM_PP_DEGREE": str(pp),
           "MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER": str(distributed_optimizer).lower(), "OMP_NUM_THREADS": "1",
           **(env or {})}
    if not launcher:
        env["ACCELERATE_USE_MEGATRON_LM"] = "true"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), *(["-m", "megatron.training.accelerate_launch"] if launcher else []),
           str(SCRIPT), str(root / f"{name}.config.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env, timeout=900)
    assert proc.returncode == 0, f"{name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads((root / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def root(tmp_path_factory, corpus_path, gpt2_vocab_dir):
    root = tmp_path_factory.mktemp("accelerate_guide")
    accelerate_fixture(root, corpus_path, gpt2_vocab_dir)
    return root


# ---------------------------------------------------------------- custom train step, positions, generate

GPT_LAYOUTS = {"serial": (1, 1, 1), "tp2pp2": (4, 2, 2)}
OTHER_ARGS = {"rotary_multiquery": {"position_embedding_type": "rotary", "attention_head_type": "multiquery"},
              "alibi": {"position_embedding_type": "alibi"}}


@pytest.fixture(scope="module")
def gpt_runs(root):
    runs = {}
    for other, other_args in OTHER_ARGS.items():
        for layout, (nproc, tp, pp) in GPT_LAYOUTS.items():
            if other == "alibi" and layout != "serial":
                continue
            runs[other, layout] = _launch(root, f"gpt_{other}_{layout}", nproc, {
                "feature": "gpt", "micro_batch_size": 2, "other_megatron_args": other_args}, tp=tp, pp=pp)
    return runs


def test_the_guides_custom_loss_is_the_key_token_weighted_loss_of_the_models_logits(gpt_runs):
    """GPTTrainStepWithCustomLoss, written as the guide writes it (`super().__init__(megatron_args)`,
    `get_loss_func(self)`), is the engine's train step; its evaluation loss equals the weighted
    loss computed from the model's own logits, which differs from the unweighted mean."""
    run = gpt_runs["rotary_multiquery", "serial"]
    assert run["handler"] == "GPTTrainStepWithCustomLoss"
    assert run["keytoken_ids"], "no keyword is one GPT-2 token"
    assert any(w > 1 for w in run["weights"]), "the evaluation batch holds no key token: the test shows nothing"
    assert run["eval_loss"] == pytest.approx(run["direct_eval_loss"], rel=1e-5)
    assert abs(run["eval_loss"] - run["plain_eval_loss"]) > 1e-3


def test_the_custom_loss_trains_the_same_at_tp2_pp2(gpt_runs):
    serial, parallel = gpt_runs["rotary_multiquery", "serial"], gpt_runs["rotary_multiquery", "tp2pp2"]
    assert parallel["args"]["tensor_model_parallel_size"] == 2 and parallel["args"]["pipeline_model_parallel_size"] == 2
    assert (parallel["main_process_index"], parallel["num_processes"]) == (3, 4)  # the main process is the last rank
    assert parallel["eval_loss"] == pytest.approx(serial["eval_loss"], rel=1e-5)
    assert parallel["train_losses"] == pytest.approx(serial["train_losses"], rel=1e-5)
    assert len(serial["train_losses"]) == STEPS and serial["train_losses"][-1] < serial["train_losses"][0]


def test_every_pipeline_stage_returns_the_last_stages_losses(gpt_runs):
    """model(**batch).loss on every rank of TP 2 x PP 2 is the last stage's loss (Accelerate's engine
    alone gives 0 on the first stage, so a script where every rank writes a result, as the example's
    all_results.json, writes either number)."""
    run = gpt_runs["rotary_multiquery", "tp2pp2"]
    every_rank = run["every_rank_losses"]
    assert len(every_rank) == 4 and len(every_rank[0]) == 1 + STEPS
    assert all(losses == every_rank[-1] for losses in every_rank), every_rank
    assert every_rank[-1] == [run["eval_loss"], *run["train_losses"]] and 0.0 not in every_rank[-1]


@pytest.mark.parametrize("other, kind, groups", [("rotary_multiquery", "rope", 1), ("alibi", "alibi", None)])
def test_other_megatron_args_position_embedding_and_multiquery_reach_the_model(gpt_runs, other, kind, groups):
    """The guide's spellings: position_embedding_type rotary / alibi (Accelerate's own default
    use_rotary_position_embeddings does not override alibi), attention_head_type multiquery = one
    key/value group (replicated on both TP ranks at TP 2)."""
    for layout in GPT_LAYOUTS:
        if (other, layout) not in gpt_runs:
            continue
        args = gpt_runs[other, layout]["args"]
        assert args["position_embedding_type"] == kind
        assert args["group_query_attention"] == (groups is not None)
        if groups is not None:
            assert args["num_query_groups"] == groups


def test_alibi_trains(gpt_runs):
    losses = gpt_runs["alibi", "serial"]["train_losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    assert losses != gpt_runs["rotary_multiquery", "serial"]["train_losses"]


def test_megatron_generate_through_the_prepared_engine_at_tp2_pp2_equals_serial(gpt_runs):
    """The guide's calls (top-p with decay, top-k, add_BOS, beam search on one prompt; and greedy)
    on the trained model: the same tokens at TP 2 x PP 2 as on one process."""
    serial, parallel = gpt_runs["rotary_multiquery", "serial"], gpt_runs["rotary_multiquery", "tp2pp2"]
    assert set(serial["generated"]) == {"top_p", "top_k", "greedy", "add_BOS", "beam"}
    for mode, tokens in serial["generated"].items():
        assert parallel["generated"][mode] == tokens, mode
    prompts = 4
    assert len(serial["generated"]["greedy"]) == prompts and len(serial["generated"]["beam"]) == 1
    assert serial["decoded_greedy"][1].startswith("Are you human?")


# ---------------------------------------------------------------- indexed datasets and logits

@pytest.fixture(scope="module")
def indexed_runs(root):
    from megatron.data.indexed_dataset import IndexedDatasetBuilder
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(root / "tiny-gpt2"))
    builder = IndexedDatasetBuilder(str(root / "text_document.bin"))
    for line in (root / "train.txt").read_text().splitlines():
        builder.add_item(tokenizer(line)["input_ids"] + [tokenizer.eos_token_id])
        builder.end_document()
    builder.finalize(str(root / "text_document.idx"))
    config = {"feature": "indexed", "data_path": str(root / "text_document")}
    config = {**config, "micro_batch_size": 2}
    return {"serial": _launch(root, "indexed_serial", 1, config), "tp2": _launch(root, "indexed_tp2", 2, config, tp=2),
            "tp2_installed_hook": _launch(root, "indexed_tp2_hook", 2, config, tp=2, launcher=False)}, root


def test_the_indexed_dataset_loop_trains_the_same_at_tp2_where_tp_rank_1_has_no_dataloader(indexed_runs):
    """MegatronLMDummyDataLoader + megatron_dataset_flag: our pretrain_gpt's dataset provider and
    get_batch (Accelerate imports them), the guide's `while` loop; at TP 2 the second rank gets no
    dataloader ({} batches) and receives the first one's by broadcast."""
    runs, _ = indexed_runs
    (rank0, reader), (rank1, dummy) = runs["tp2"]["tp_rank_and_dataloader"]
    assert (rank0, rank1) == (0, 1) and reader != dummy == "DummyMegatronDataloader"
    assert runs["serial"]["tp_rank_and_dataloader"] == [[0, reader]]
    assert len(runs["serial"]["train_losses"]) == STEPS and len(runs["serial"]["eval_losses"]) == 2
    assert runs["tp2"]["train_losses"] == pytest.approx(runs["serial"]["train_losses"], rel=1e-5)
    assert runs["tp2"]["eval_losses"] == pytest.approx(runs["serial"]["eval_losses"], rel=1e-5)
    assert runs["serial"]["train_losses"][-1] < runs["serial"]["train_losses"][0]


def test_without_the_launcher_the_installed_hook_runs_the_script_as_accelerate_launch_would(indexed_runs):
    """What `accelerate launch` gives a script on a GPU machine (torchrun, ACCELERATE_USE_MEGATRON_LM,
    MEGATRON_LM_TP_DEGREE): the .pth the install puts in site-packages makes Accelerate take this
    package as its Megatron-LM; the same losses as under the launcher."""
    runs, _ = indexed_runs
    assert runs["tp2_installed_hook"]["args"]["tensor_model_parallel_size"] == 2
    assert runs["tp2_installed_hook"]["train_losses"] == runs["tp2"]["train_losses"]
    assert runs["tp2_installed_hook"]["eval_losses"] == runs["tp2"]["eval_losses"]


def test_return_logits_on_evaluation_are_the_same_at_tp2(indexed_runs):
    """return_logits=True: outputs.logits on the last stage, over the whole padded vocabulary (its
    padding depends on TP: 50304 rows at TP 1, 50432 at TP 2); the tokenizer's 50257 are the same."""
    runs, root = indexed_runs
    serial = torch.load(root / "indexed_serial.json.logits.pt")
    parallel = torch.load(root / "indexed_tp2.json.logits.pt")
    assert runs["serial"]["logits_shape"] == [2, 32, 50304] and runs["tp2"]["logits_shape"] == [2, 32, 50432]
    assert serial.shape == (4, 32, 50304)  # the two evaluation batches
    torch.testing.assert_close(parallel[..., :50257], serial[..., :50257], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- save_state / load_state

@pytest.fixture(scope="module")
def resume_runs(root):
    config = {"feature": "resume", "micro_batch_size": 2, "ckpt": str(root / "resume_ckpt")}
    runs = {}
    for phase in ("full", "first", "second"):
        runs[phase] = _launch(root, f"resume_{phase}", 2, {**config, "phase": phase}, distributed_optimizer=True,
                              env={"MEGATRON_LM_GRADIENT_CLIPPING": "0.5"})  # `accelerate config`'s clipping
    return runs, root


def test_load_state_resumes_bit_exact(resume_runs):
    """save_state after 2 steps, load_state in a new job and 2 more steps: the losses, learning rates
    and the evaluation after them are the uninterrupted job's, bit for bit (dropout on: the RNG
    states come back too). Each job takes its batches before load_state (starting an iteration
    draws from torch's generator, as a resumed PyTorch loop must allow for)."""
    runs, root = resume_runs
    args = runs["full"]["args"]
    assert args["use_distributed_optimizer"] and args["data_parallel_size"] == 2 and args["hidden_dropout"] == 0.1
    assert args["clip_grad"] == 0.5 and args["global_batch_size"] == 4  # DP 2 x micro-batch 2 x 1 micro-batch
    assert (root / "resume_ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS // 2)
    assert runs["first"]["train_losses"] == runs["full"]["train_losses"][:STEPS // 2]
    assert runs["second"]["train_losses"] == runs["full"]["train_losses"][STEPS // 2:]  # bit-exact
    assert runs["second"]["lr"] == runs["full"]["lr"][STEPS // 2:]
    assert runs["second"]["eval_loss"] == runs["full"]["eval_loss"]


def test_returned_logits_are_the_models_and_give_its_loss(resume_runs):
    runs, _ = resume_runs
    run = runs["full"]
    assert run["train_logits_shape"] == [2, 32, 50304]  # a training step returns this rank's logits too
    assert run["logits_shape"] == [4, 32, 50304]  # 2 per DP rank, gathered
    assert run["logits_max_difference"] < 1e-4
    assert run["eval_loss"] == pytest.approx(run["direct_eval_loss"], rel=1e-5)


# ---------------------------------------------------------------- BERT and T5

@pytest.fixture(scope="module")
def encoder_runs(root):
    runs = {}
    for kind in ("bert", "t5"):
        for layout, (nproc, tp) in (("serial", (1, 1)), ("tp2", (2, 2))):
            runs[kind, layout] = _launch(root, f"{kind}_{layout}", nproc,
                                         {"feature": kind, "micro_batch_size": 2, "vocab_size": 1000}, tp=tp)
    return runs


@pytest.mark.parametrize("kind, model_class", [("bert", "BertModel"), ("t5", "T5Model")])
def test_bert_and_t5_train_through_prepare_the_same_at_tp2(encoder_runs, kind, model_class):
    serial, parallel = encoder_runs[kind, "serial"], encoder_runs[kind, "tp2"]
    assert serial["args"]["model_type_name"] == kind and serial["pretraining_flag"]
    assert serial["model_class"] == parallel["model_class"] == model_class  # megatron.legacy.model's
    assert parallel["args"]["tensor_model_parallel_size"] == 2
    assert len(serial["train_losses"]) == STEPS
    assert parallel["train_losses"] == pytest.approx(serial["train_losses"], rel=1e-5)
    assert parallel["eval_losses"] == pytest.approx(serial["eval_losses"], rel=1e-5)
    assert serial["eval_losses"][1] < serial["eval_losses"][0]  # it learned


# ---------------------------------------------------------------- the guide's HF -> Megatron recipe

def _convert_to_iter_0(root, name, hf_model, vocab_dir=None):
    """The guide's recipe: HF -> Megatron with tools/checkpoint/convert.py, `release` -> `iter_0000000`,
    the tracker says 0."""
    import shutil

    hf_dir, megatron_dir = root / f"hf-{name}", root / f"megatron-{name}"
    hf_model.save_pretrained(hf_dir)
    for file in ("vocab.json", "merges.txt") if vocab_dir else ():
        shutil.copy(vocab_dir / file, hf_dir / file)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py"), "--model-type", "GPT",
                           "--loader", "hf", "--saver", "megatron", "--load-dir", str(hf_dir),
                           "--save-dir", str(megatron_dir)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (megatron_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    (megatron_dir / "release").rename(megatron_dir / "iter_0000000")
    (megatron_dir / "latest_checkpointed_iteration.txt").write_text("0")
    return hf_dir, megatron_dir


@pytest.fixture(scope="module")
def hf_checkpoint_runs(root, gpt2_vocab_dir):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # initializer_range 0.2: logits far from uniform, so that a model that did not load gives another loss
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=50257,
                                      initializer_range=0.2))
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         tie_word_embeddings=False, rms_norm_eps=1e-5, initializer_range=0.2,
                                         eos_token_id=2, bos_token_id=1))
    runs = {}
    for name, model, vocab_dir, checkpoint_args in (("gpt2", gpt2, gpt2_vocab_dir, True), ("llama", llama, None, False)):
        hf_dir, megatron_dir = _convert_to_iter_0(root, name, model, vocab_dir)
        runs[name] = _launch(root, f"hf_checkpoint_{name}", 1, {
            "feature": "hf_checkpoint", "micro_batch_size": 2, "hf_dir": str(hf_dir), "megatron_dir": str(megatron_dir),
            "use_checkpoint_args": checkpoint_args})
    return runs


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_guides_hf_to_megatron_recipe_loads_the_hf_weights(hf_checkpoint_runs, name):
    """GPT-2 with the checkpoint's model flags (use_checkpoint_args); a Llama with the flags Accelerate's
    parser gives through the launcher's Llama mapping alone (SwiGLU, RMSNorm, 2 query groups, untied,
    no biases): the converted weights load, and the model gives the HF model's loss."""
    run = hf_checkpoint_runs[name]
    assert run["loss"] == pytest.approx(run["hf_loss"], rel=1e-5)
    # a model that did not load (initialized as Megatron does, std 0.02) is near ln(vocab)
    assert abs(run["loss"] - math.log(50257 if name == "gpt2" else 1000)) > 0.5
    assert run["train_loss"] == pytest.approx(run["loss"], rel=1e-5) and run["iteration"] == 1  # trains on from 0
    args = run["args"]
    if name == "gpt2":
        assert args["position_embedding_type"] == "learned_absolute"
    else:
        assert (args["swiglu"], args["normalization"], args["num_query_groups"], args["add_bias_linear"],
                args["untie_embeddings_and_output_weights"], args["ffn_hidden_size"],
                args["position_embedding_type"]) == (True, "RMSNorm", 2, False, True, 160, "rope")
