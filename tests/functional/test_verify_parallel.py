"""tools/verify_parallel.py: a supported layout reports differences under 1e-5 and exits 0; a layer
broken under tensor parallelism (tests/functional/broken_spec.py: fc2 without its all-reduce) is
reported by name with exit status 1; a bad --layout is one argparse error."""

import io

import pytest

from tools import verify_parallel

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--eval-iters", "0", "--cpu-threads", "1"]


def test_a_supported_layout_verifies_under_1e_5():
    out = io.StringIO()
    assert verify_parallel.verify("tp2sp-pp2distopt", MODEL, iterations=2, out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "OK: every difference is under 1e-05" in text
    for line in text.splitlines():
        if line.startswith("  largest"):
            assert float(line.split(": ")[1].split()[0]) < 1e-5, line
    assert "tensors compared" in text


def test_a_layer_broken_under_tensor_parallelism_is_named():
    out = io.StringIO()
    flags = [*MODEL, "--spec", "tests.functional.broken_spec", "broken_layer_spec"]
    assert verify_parallel.verify("tp2", flags, iterations=1, out=out) == 1
    failed = [line for line in out.getvalue().splitlines() if line.startswith("FAILED: ")]
    assert failed, out.getvalue()
    assert "the loss of iteration 1 differs" in failed[0]
    assert "gradient(s) differ by more than 1e-05" in failed[0] and "decoder.layers." in failed[0]


@pytest.mark.parametrize("layout, message", [
    ("tp2xx3", "cannot read 'xx3'"), ("sp-dp2", "sp (sequence parallelism) needs tp > 1"), ("", "is empty"),
    ("tp0", "tp must be at least 1"),
])
def test_bad_layouts_are_one_line_errors(layout, message):
    with pytest.raises(verify_parallel.LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        verify_parallel.parse_layout(layout)


def test_layout_flags_are_megatrons():
    layout = verify_parallel.parse_layout("tp2sp-pp2-vpp2-ep2-dp2-distopt")
    assert verify_parallel.world_size(layout) == 8
    assert verify_parallel.layout_flags(layout) == [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-virtual-stages-per-pipeline-rank", "2", "--expert-model-parallel-size", "2", "--sequence-parallel",
        "--use-distributed-optimizer"]


def test_layout_accepts_context_parallelism():
    layout = verify_parallel.parse_layout("cp2-tp2sp-dp2")
    assert verify_parallel.world_size(layout) == 8
    assert verify_parallel.layout_flags(layout) == [
        "--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel"]
