"""Training speed of a GPT on this machine: tokens/s, ms per iteration and model TFLOP/s.

    python bench/train_gpt.py                       # the stated default config, mock data
    python bench/train_gpt.py --bf16 --iters 20     # any pretrain_gpt.py flag may follow

The default config (printed first) is a GPT of 4 layers, hidden 256, 8 heads, sequence 256,
micro-batch 4, global batch 8, fp32, dropout 0, on synthetic data (--mock-data, NullTokenizer
with a 32,000-token vocabulary), so the figure measures the model and the loop, not the disk.
Warm-up iterations are run first and not timed. TFLOP/s uses the GPT FLOPs formula of
megatron/training/training_log.py (docs/training.md).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import device  # noqa: E402
from megatron.training.global_vars import get_args  # noqa: E402
from megatron.training.initialize import initialize_megatron  # noqa: E402
from megatron.training.training import (  # noqa: E402
    build_train_valid_test_data_iterators,
    setup_model_and_optimizer,
    train_step,
)
from megatron.training.training_log import num_floating_point_operations  # noqa: E402

DEFAULT_FLAGS = [
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
    "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "4", "--global-batch-size", "8",
    "--lr", "1e-4", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
    "--eval-iters", "0", "--num-workers", "0", "--log-interval", "1000000",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    known, rest = parser.parse_known_args()
    total = known.warmup + known.iters
    argv = DEFAULT_FLAGS + ["--train-iters", str(total)] + rest

    import pretrain_gpt

    initialize_megatron(args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, argv=argv)
    args = get_args()
    model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider, None)
    train_iter, _, _ = build_train_valid_test_data_iterators(pretrain_gpt.train_valid_test_datasets_provider)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    print(f"config: layers {args.num_layers}, hidden {args.hidden_size}, heads {args.num_attention_heads}, "
          f"seq {args.seq_length}, micro-batch {args.micro_batch_size}, global batch {args.global_batch_size}, "
          f"vocab {args.padded_vocab_size}, {precision}, device {device.device_name()}, "
          f"torch threads {__import__('torch').get_num_threads()}")
    for _ in range(known.warmup):
        train_step(pretrain_gpt.forward_step, train_iter, model, optimizer, scheduler)
    device.synchronize()
    start = time.perf_counter()
    for _ in range(known.iters):
        train_step(pretrain_gpt.forward_step, train_iter, model, optimizer, scheduler)
    device.synchronize()
    seconds = (time.perf_counter() - start) / known.iters
    tokens = args.global_batch_size * args.seq_length
    tflops = num_floating_point_operations(args, args.global_batch_size) / seconds / 1e12
    print(f"measured over {known.iters} iterations after {known.warmup} warm-up:")
    print(f"  ms/iteration:   {seconds * 1000:.1f}")
    print(f"  tokens/s:       {tokens / seconds:,.0f}")
    print(f"  model TFLOP/s:  {tflops:.4f}")


if __name__ == "__main__":
    main()
