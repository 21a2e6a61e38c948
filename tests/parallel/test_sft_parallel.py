"""--sft with packed conversations at TP = 2 (x DP = 2, sequence parallel), PP = 2 (x DP = 2, the
distributed optimizer) and TP = 2 x PP = 2 against the serial run: the same losses and grad norms
(rel 1e-5) over two steps of pretrain_gpt.py's own loop (each pipeline stage reads the
conversation boundaries, the second TP rank receives them by broadcast), and at CP = 2 x TP = 2 +
SP (p2p) and CP = 2 x DP = 2 (a2a): each CP rank its chunks of the packed rows. The same with LoRA
adapters on the frozen HF model (--lora-rank, every target module) against LoRA's serial run: the
layouts of issue 33 (TP 2, PP 2, TP 2 x PP 2, DP 2 with the distributed optimizer)."""

import random

import pytest

from tests.helpers import sft

pytest.importorskip("transformers")

SEQ = 96
LAYOUTS = {
    "tp2-sp-dp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2-dp2-distopt": ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
    "tp2-pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "cp2-tp2-sp": ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "cp2-dp2-a2a": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
}
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
LORA_LAYOUTS = {
    "lora-tp2-sp-dp2": LAYOUTS["tp2-sp-dp2"],
    "lora-pp2-dp2-distopt": LAYOUTS["pp2-dp2-distopt"],
    "lora-tp2-pp2": LAYOUTS["tp2-pp2"],
    "lora-dp4-distopt": ["--use-distributed-optimizer"],
}


def _records(argv):
    """Every rank: train; (iteration -> (lm loss, grad norm)) as the last stage records them."""
    import pretrain_gpt
    from megatron.training.initialize import reset_megatron

    try:
        result = pretrain_gpt.main(list(argv), record_history=True)
    finally:
        reset_megatron()
    return {r.iteration: (r.losses.get("lm loss"), r.grad_norm) for r in result.history}


def _layouts(argvs: dict) -> dict:
    return {name: _records(argv) for name, argv in argvs.items()}


def test_packed_sft_layouts_equal_the_serial_run(dist_pool, tmp_path):
    model = tmp_path / "model"
    sft.llama_folder(model)
    rng = random.Random(2)
    lines = [sft.conversation(rng, words=(1, 2)) + sft.conversation(rng, words=(1, 2)) for _ in range(12)]
    data = [str(sft.write_chat_jsonl(tmp_path / "chat.jsonl", lines))]
    argv = sft.sft_argv(model, data, SEQ, "--sft-tokenizer-prompt-format", "chatml", "--lr", "1e-2", iters=2, gbs=4)
    serial = {"": _records(argv), "lora-": _records(argv + LORA)}
    runs = {**{name: argv + flags for name, flags in LAYOUTS.items()},
            **{name: argv + LORA + flags for name, flags in LORA_LAYOUTS.items()}}
    assert serial[""][1] != serial["lora-"][1]  # (LoRA trains other weights: another grad norm)
    results = dist_pool.run(_layouts, runs)
    for name in runs:
        reference = serial["lora-" if name.startswith("lora-") else ""]
        reported = [per_layout[name] for per_layout in results if per_layout[name][1][0] is not None]
        assert reported, name
        for records in reported:
            assert sorted(records) == [1, 2], name
            for iteration, (loss, grad_norm) in records.items():
                assert loss == pytest.approx(reference[iteration][0], rel=1e-5), (name, iteration)
                assert grad_norm == pytest.approx(reference[iteration][1], rel=1e-5), (name, iteration)
