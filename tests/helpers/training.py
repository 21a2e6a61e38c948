"""Tiny GPT runs of pretrain_gpt.py: their flag sets, and the parsing of what they log."""
import re

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "3e-3", "--num-workers", "0", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1", "--seed", "1234"]
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]

LOG_LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] "  # Megatron's local-time prefix
    r"iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| elapsed time per iteration \(ms\): [\d.]+ \| "
    r"throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| learning rate: (\S+) \| global batch size: +(\d+) \| "
    r"(?:lm loss: (\S+) \| )?(?:(?:seq_)?load_balancing_loss: \S+ \| )?(?:z_loss: \S+ \| )?"  # MoE's
    r"loss scale: ([\d.]+) \| (?:grad norm: ([\d.]+|nan|inf) \| )?"
    r"number of skipped iterations: +(\d+) \| number of nan iterations: +(\d+) \|$")


def log_lines(out):
    """Parsed training log lines: dicts of iteration, consumed, lr, gbs, loss, scale, grad_norm, skipped, nan.

    As in Megatron, an interval whose every iteration was skipped has no loss and no grad norm.
    """
    rows = []
    for line in out.splitlines():
        if "| consumed samples:" in line:  # a log line must match whole: a garbled one fails here
            m = LOG_LINE.match(line)
            assert m, f"log line not in Megatron's format: {line!r}"
            rows.append({"iteration": int(m[1]), "train_iters": int(m[2]), "consumed": int(m[3]),
                         "lr": float(m[4]), "gbs": int(m[5]), "loss": m[6] and float(m[6]), "scale": float(m[7]),
                         "grad_norm": m[8] and float(m[8]), "skipped": int(m[9]), "nan": int(m[10])})
    return rows


def losses(result):
    """(iteration, lm loss) of each iteration of pretrain(..., record_history=True)'s result."""
    return [(r.iteration, r.losses["lm loss"]) for r in result.history]


# A tiny GPT on the default corpus, run at several parallel layouts (tests/functional/test_*_parallel_training.py)
COMMON = [*TINY, "--ckpt-format", "torch",  # the files per TP rank are checked
          "--hidden-dropout", "0", "--attention-dropout", "0", "--split", "90,10,0", "--eval-interval", "5",
          "--eval-iters", "1", "--lr-warmup-iters", "2"]
COUNT = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)")
TOTAL = re.compile(r"number of parameters in the model \(every rank, replicated ones once\): (\d+)")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def logged_losses(stdout):
    """iteration -> the lm loss of its log line."""
    return {row["iteration"]: row["loss"] for row in log_lines(stdout)}


def logged_grad_norms(stdout):
    """iteration -> the grad norm of its log line."""
    return {row["iteration"]: row["grad_norm"] for row in log_lines(stdout)}
