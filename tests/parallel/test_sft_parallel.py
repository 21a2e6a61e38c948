"""--sft with packed conversations at TP = 2 (x DP = 2, sequence parallel), PP = 2 (x DP = 2, the
distributed optimizer) and TP = 2 x PP = 2 against the serial run: the same losses and grad norms
(rel 1e-5) over two steps of pretrain_gpt.py's own loop (each pipeline stage reads the
conversation boundaries, the second TP rank receives them by broadcast)."""

import random

import pytest

from tests.helpers import sft

pytest.importorskip("transformers")

SEQ = 96
LAYOUTS = {
    "tp2-sp-dp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2-dp2-distopt": ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
    "tp2-pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
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
    serial = _records(argv)
    results = dist_pool.run(_layouts, {name: argv + flags for name, flags in LAYOUTS.items()})
    for name in LAYOUTS:
        reported = [per_layout[name] for per_layout in results if per_layout[name][1][0] is not None]
        assert reported, name
        for records in reported:
            assert sorted(records) == [1, 2], name
            for iteration, (loss, grad_norm) in records.items():
                assert loss == pytest.approx(serial[iteration][0], rel=1e-5), (name, iteration)
                assert grad_norm == pytest.approx(serial[iteration][1], rel=1e-5), (name, iteration)
