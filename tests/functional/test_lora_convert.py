"""LoRA through tools/checkpoint/convert.py on a tiny HF Llama (GQA, SwiGLU): a LoRA run started with
--load-hf, its adapters exported to HF PEFT (loaded by peft.PeftModel.from_pretrained on the HF base: our
logits), merged into a full HF model (the same logits), imported back from PEFT (the same adapters, bit for
bit), and a PEFT adapter trained by peft itself merged on import."""


import pytest
import torch

from megatron.core.tensor_parallel.lora import LoRAConfig
from megatron.model.lora import apply_lora
from tests.helpers import hf_models

peft = pytest.importorskip("peft")
transformers = hf_models.transformers

RANK, ALPHA = 4, 8.0
TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3", "--lr", "2e-2",
         "--lr-decay-style", "constant", "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", str(hf_models.VOCAB - 1), "--seq-length", "16", "--num-workers", "0", "--eval-iters", "0",
         "--log-interval", "1", "--ckpt-format", "torch", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _convert(*argv):
    from tools.checkpoint import convert

    convert.main(["--model-type", "GPT", *map(str, argv)])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(HF base directory, the LoRA run's checkpoint directory)."""
    import pretrain_gpt
    from megatron.training.initialize import _destroy_distributed, reset_megatron

    root = tmp_path_factory.mktemp("lora_convert")
    hf_models.make_hf(hf_models.llama_family("llama")).save_pretrained(root / "hf")
    try:
        pretrain_gpt.main(["--load-hf", str(root / "hf"), *TRAIN, "--lora-rank", str(RANK), "--lora-alpha",
                           str(ALPHA), "--save", str(root / "lora"), "--save-interval", "3"])
    finally:
        reset_megatron()
        _destroy_distributed()
    return root / "hf", root / "lora"


def _tokens():
    return torch.randint(0, hf_models.VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _our_logits(hf_dir, adapters):
    """Our GPTModel of the HF base with the adapters attached (not merged), fp32 logits [b, s, v]."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    ours = hf_models.make_ours(hf, hf_models.UNFUSED)
    apply_lora(ours, LoRAConfig(rank=RANK, alpha=ALPHA), seed=0)
    missing = ours.load_state_dict(adapters, strict=False)
    assert not missing.unexpected_keys and all(".adapter." not in k for k in missing.missing_keys)
    tokens = _tokens()
    with torch.no_grad():
        return ours(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[..., :hf_models.VOCAB]


def _hf_logits(model):
    with torch.no_grad():
        return model(_tokens()).logits


def _close(actual, expected, rel=1e-5):
    error = ((actual - expected).abs().max() / expected.abs().max()).item()
    assert error <= rel, error


def test_peft_export_merge_and_import_round_trip(trained, tmp_path):
    from tools.checkpoint.lora_common import read_adapters

    hf_dir, lora_dir = trained
    adapters = read_adapters(str(lora_dir))
    assert len(adapters.tensors) == 2 * 4 * hf_models.LAYERS
    assert min(t.abs().max().item() for n, t in adapters.tensors.items() if n.endswith("linear_out.weight")) > 0
    ours = _our_logits(hf_dir, adapters.tensors)

    _convert("--loader", "lora", "--saver", "peft", "--load-dir", lora_dir, "--save-dir", tmp_path / "peft")
    config = peft.PeftConfig.from_pretrained(str(tmp_path / "peft"))
    assert sorted(config.target_modules) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                             "v_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    peft_model = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    _close(_hf_logits(peft_model), ours)  # PEFT on the HF base gives our logits

    _convert("--loader", "lora", "--saver", "hf", "--load-dir", lora_dir, "--save-dir", tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    _close(_hf_logits(merged.eval()), ours)  # merge: base + adapter

    _convert("--loader", "peft", "--saver", "lora", "--load-dir", tmp_path / "peft", "--save-dir", tmp_path / "back")
    back = read_adapters(str(tmp_path / "back"))
    assert back.base == adapters.base and back.settings == adapters.settings
    assert sorted(back.tensors) == sorted(adapters.tensors)
    for name, tensor in adapters.tensors.items():
        assert torch.equal(back.tensors[name], tensor), name  # the import round-trips bit for bit


def test_a_peft_trained_adapter_merges_on_import_and_is_refused_as_adapters(trained, tmp_path):
    from megatron.training.checkpoint_safety import CheckpointError

    hf_dir, _ = trained
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj", "k_proj", "down_proj"])
    torch.manual_seed(5)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # trained-looking adapters: B no longer zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.save_pretrained(tmp_path / "theirs")
    expected = _hf_logits(model.eval())
    _convert("--loader", "peft", "--saver", "hf", "--load-dir", tmp_path / "theirs", "--lora-base", hf_dir,
             "--save-dir", tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    _close(_hf_logits(merged.eval()), expected)
    with pytest.raises(CheckpointError, match="different lora_A"):
        _convert("--loader", "peft", "--saver", "lora", "--load-dir", tmp_path / "theirs", "--lora-base", hf_dir,
                 "--save-dir", tmp_path / "adapters")


def test_imported_adapters_train_from_where_the_exported_ones_were(trained, tmp_path):
    """pretrain_gpt --load of the adapters imported back from PEFT (a release checkpoint: iteration 0, fresh
    optimizer) logs the first loss of --load of the original LoRA checkpoint with --finetune."""
    import pretrain_gpt
    from megatron.training.initialize import _destroy_distributed, reset_megatron

    hf_dir, lora_dir = trained
    _convert("--loader", "lora", "--saver", "peft", "--load-dir", lora_dir, "--save-dir", tmp_path / "peft")
    _convert("--loader", "peft", "--saver", "lora", "--load-dir", tmp_path / "peft", "--save-dir", tmp_path / "back")
    flags = ["--load-hf", str(hf_dir), *TRAIN, "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
             "--train-iters", "1", "--lr", "0"]
    losses = []
    try:
        for extra in (["--load", str(lora_dir), "--finetune"], ["--load", str(tmp_path / "back")]):
            result = pretrain_gpt.main([*flags, *extra], record_history=True)
            reset_megatron()
            losses.append([(r.iteration, r.losses["lm loss"]) for r in result.history])
    finally:
        reset_megatron()
        _destroy_distributed()
    assert losses[0] == losses[1] and [i for i, _ in losses[0]] == [1]
