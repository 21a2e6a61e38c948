"""Convert a checkpoint to another parallel layout (Megatron-LM's tools/checkpoint/convert.py interface).

    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver megatron \
        --load-dir ckpt/tp2_pp2 --save-dir ckpt/tp4_pp1 \
        --target-tensor-parallel-size 4 --target-pipeline-parallel-size 1

The loader (tools/checkpoint/loader_NAME.py) yields a Metadata and then whole tensors one at a
time under the names of a TP = 1, PP = 1 GPTModel (BertModel with --model-type BERT, T5Model with
--model-type T5); the saver
(saver_NAME.py) writes them. Plugins are modules with add_arguments(parser) and
load_checkpoint(args) -> (metadata, tensors), or save_checkpoint(metadata, tensors, args, save_dir)
and read_back(save_dir) -> (args, tensors).
Unlike Megatron-LM's the two run in one process (a generator, not a queue).

The saver writes into a temporary folder beside --save-dir. Unless --no-verify, the source and the
written checkpoint are then both built as TP = 1 models on CPU and their logits compared on fixed
token sequences (megatron/convert/verify.py; for --model-type BERT BertModels, MLM and binary-head
logits with a padding mask; for T5 T5Models, the decoder's logits over a padded encoder input);
only a conversion that matches is renamed to
--save-dir. On any failure the temporary folder is removed: --save-dir never holds a partial or
unverified checkpoint. docs/checkpoints.md has the details.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shutil
import sys
import tempfile
from types import ModuleType
from typing import List, Optional

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.training.checkpoint_safety import CheckpointError  # noqa: E402
from megatron.training.cli import run_cli  # noqa: E402
from megatron.convert.layout_rules import UnknownTensorError  # noqa: E402

MODEL_TYPES = ("GPT", "BERT", "T5")


class ConversionError(ValueError):
    """Bad input to the converter, or a conversion that failed verification."""


def _plugin(kind: str, name: str) -> ModuleType:
    """tools/checkpoint/{kind}_{name}.py, else a module `{kind}_{name}` or `name` on sys.path."""
    name = "core" if name == "mcore" else name  # Megatron-LM's alias
    needs = ("add_arguments",) + (("load_checkpoint",) if kind == "loader" else ("save_checkpoint", "read_back"))
    for module in (f"tools.checkpoint.{kind}_{name}", f"{kind}_{name}", name):
        try:
            plugin = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module and not module.startswith(str(error.name) + "."):
                raise  # the plugin exists but one of its imports is missing
            continue
        missing = [function for function in needs if not callable(getattr(plugin, function, None))]
        if missing:
            raise ConversionError(f"--{kind} {name}: module {module} is not a {kind} plugin "
                                  f"(it has no {', '.join(missing)})")
        return plugin
    here = os.path.dirname(os.path.abspath(__file__))
    known = sorted(f[len(kind) + 1:-3] for f in os.listdir(here) if f.startswith(kind + "_") and f.endswith(".py"))
    raise ConversionError(f"--{kind} {name}: no such {kind} (available: {', '.join(known)})")


def build_parser(loader: Optional[ModuleType] = None, saver: Optional[ModuleType] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Convert a checkpoint to another parallel layout.",
                                     allow_abbrev=False, add_help=loader is not None)
    parser.add_argument("--model-type", type=str, default=None, help=f"One of {', '.join(MODEL_TYPES)}.")
    parser.add_argument("--loader", type=str, default="megatron", help="Loader plugin (loader_NAME.py).")
    parser.add_argument("--saver", type=str, default="megatron", help="Saver plugin (saver_NAME.py).")
    parser.add_argument("--load-dir", type=str, default=None, help="The checkpoint to read.")
    parser.add_argument("--save-dir", type=str, default=None, help="Where to write (must not hold anything).")
    parser.add_argument("--megatron-path", type=str, default=None, help="Accepted for compatibility; ignored.")
    parser.add_argument("--max-queue-size", type=int, default=50, help="Accepted for compatibility; ignored.")
    parser.add_argument("--no-checking", action="store_false", dest="checking",
                        help="Accepted for compatibility; ignored.")
    parser.add_argument("--no-verify", action="store_false", dest="verify",
                        help="Skip comparing the logits of the source and the converted checkpoint.")
    for plugin in (loader, saver):
        if plugin is not None:
            plugin.add_arguments(parser)
    return parser


def parse_args(argv: Optional[List[str]]) -> tuple:
    known, _ = build_parser().parse_known_args(argv)
    if known.model_type is None:
        raise ConversionError(f"--model-type is required (one of {', '.join(MODEL_TYPES)})")
    if known.model_type not in MODEL_TYPES:
        raise ConversionError(f"--model-type {known.model_type}: not supported (supported: {', '.join(MODEL_TYPES)})")
    loader, saver = _plugin("loader", known.loader), _plugin("saver", known.saver)
    args = build_parser(loader, saver).parse_args(argv)
    for flag in ("load_dir", "save_dir"):
        if getattr(args, flag) is None:
            raise ConversionError(f"--{flag.replace('_', '-')} is required")
    return args, loader, saver


def _staging_dir(save_dir: str) -> str:
    """A fresh temporary folder beside save_dir (same file system: the final rename is atomic)."""
    save_dir = os.path.abspath(save_dir)
    if os.path.exists(save_dir) and (not os.path.isdir(save_dir) or os.listdir(save_dir)):
        raise ConversionError(f"--save-dir {save_dir} already exists and is not empty; choose a new folder")
    parent = os.path.dirname(save_dir)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(save_dir)}.", suffix=".converting", dir=parent)


def load(args: argparse.Namespace, loader: ModuleType) -> tuple:
    """loader.load_checkpoint, its args marked with --model-type (args.model_family: which model
    verify and pretrain_{gpt,bert}.py build); a checkpoint marked with another type is refused."""
    meta, tensors = loader.load_checkpoint(args)
    family = getattr(meta.args, "model_family", None)  # None: unmarked (GPT, or a pretrain_bert/t5.py run's)
    if family is None and isinstance(getattr(meta.args, "hf_config", None), dict):
        family = "GPT"  # from an HF causal LM (args_from_hf marks BERT and T5)
    if family is not None and family != args.model_type:
        raise ConversionError(f"--model-type {args.model_type}: the checkpoint under {args.load_dir} holds a "
                              f"{family} model")
    if args.model_type != "GPT":  # GPT checkpoints stay unmarked, as before BERT joined
        meta.args.model_family = args.model_type
    return meta, tensors


def verify(args: argparse.Namespace, loader: ModuleType, saver: ModuleType, staging: str) -> None:
    """Compare the logits of the source and of what was written (raise ConversionError if they differ)."""
    from megatron.convert import verify as checks

    meta, tensors = load(args, loader)
    target_args, target_tensors = saver.read_back(staging)
    vocab = meta.true_vocab_size or min(int(meta.args.padded_vocab_size), int(target_args.padded_vocab_size))
    tokens = checks.sample_tokens(vocab, int(meta.args.max_position_embeddings))
    source = checks.serial_logits(meta.args, tensors, tokens)  # one model at a time: memory ~ one model
    target = checks.serial_logits(target_args, target_tensors, tokens)
    result = checks.compare_logits(source, target, vocab)
    if checks.is_bert(meta.args):  # logits_of appended the binary logits as one more position
        result = dataclasses.replace(result, tokens=result.tokens - 1, what="MLM + binary-head logits")
    print(result.describe(), flush=True)
    if not result.ok:
        raise ConversionError(f"the converted checkpoint's logits differ from the source's ({result.describe()}); "
                              "nothing was written to --save-dir")


def main(argv: Optional[List[str]] = None) -> None:
    args, loader, saver = parse_args(argv)
    staging = _staging_dir(args.save_dir)
    try:
        meta, tensors = load(args, loader)
        saver.save_checkpoint(meta, tensors, args, staging)
        if args.verify:
            verify(args, loader, saver, staging)
        final = os.path.abspath(args.save_dir)
        if os.path.isdir(final):
            os.rmdir(final)  # empty (checked above); rename needs it gone or empty
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(f"converted {args.load_dir} -> {args.save_dir}", flush=True)


def cli(argv: Optional[List[str]] = None) -> None:
    """main() as a program: bad input is one line `convert.py: error: ...` and exit status 1."""
    run_cli(lambda: main(argv), "convert.py", errors=(ConversionError, CheckpointError, UnknownTensorError))


if __name__ == "__main__":
    cli()
