"""Generate text from a checkpoint once, without a server: the prompts' continuations printed.

    python tools/generate_text.py --load CKPT [model flags] --tokenizer-type GPT2BPETokenizer \
        --vocab-file vocab.json --merge-file merges.txt --prompt "def main(" --prompt "import os" \
        [--tokens-to-generate 48] [--top-k 1 | --top-p 0.9 | --temperature 0.8] [--random-seed 1234]

The model is built and loaded as tools/run_text_generation_server.py does (any TP / PP under
torchrun: every rank runs the generation, rank 0 prints). Greedy (--top-k 1) by default. `make run`
ends with this on the tiny model it trained. megatron.inference.api.generate is the library call.
"""

import argparse
import os
import sys
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.cli import run_cli  # noqa: E402
from megatron.inference.checkpoint_model import ServerFlagError, build_model, initialize_for_inference  # noqa: E402


def add_generation_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="one-shot text generation")
    group.add_argument("--prompt", action="append", default=None, help="A prompt (repeat for a batch).")
    group.add_argument("--tokens-to-generate", type=int, default=48, help="New tokens per prompt.")
    group.add_argument("--top-k", type=int, default=1, help="1: greedy (the default); k > 1: sample from the k best.")
    group.add_argument("--top-p", type=float, default=0.0, help="Nucleus sampling (with --top-k 0).")
    group.add_argument("--temperature", type=float, default=1.0, help="Divides the logits before sampling.")
    group.add_argument("--random-seed", type=int, default=None, help="Seed of the sampling.")
    return parser


def main(argv: List[str] = None) -> None:
    from megatron.training.global_vars import get_tokenizer
    from megatron.inference.api import generate

    args = initialize_for_inference(sys.argv[1:] if argv is None else argv, add_generation_args)
    if not args.prompt:
        raise ServerFlagError("give at least one --prompt")
    if args.load is None and args.load_hf is None:
        raise ServerFlagError("a checkpoint is required: --load CKPT or --load-hf HF_DIR")
    top_k = args.top_k if args.top_p == 0.0 else 0
    try:
        result = generate(build_model(args), get_tokenizer(), args.prompt, args.tokens_to_generate, top_k=top_k,
                          top_p=args.top_p, temperature=args.temperature, random_seed=args.random_seed)
    except ValueError as error:  # a sampling parameter out of range
        raise ServerFlagError(str(error)) from None
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        for prompt, text in zip(args.prompt, result["text"]):
            print(f"--- {prompt!r}\n{text}", flush=True)


if __name__ == "__main__":
    run_cli(main, "generate_text.py", errors=(ServerFlagError,))
