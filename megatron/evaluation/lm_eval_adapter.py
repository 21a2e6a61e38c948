"""megatron_compat: our GPT checkpoints as a model of EleutherAI's lm-evaluation-harness (lm_eval >= 0.4.9).

    python -m megatron.evaluation.lm_eval_adapter --model megatron_compat \
        --model_args load_hf=HF_DIR --batch_size 8 --tasks hellaswag --output_path results/
    python -m megatron.evaluation.lm_eval_adapter --model megatron_compat \
        --model_args "load=CKPT,megatron_args=--use-checkpoint-args --tokenizer-type GPT2BPETokenizer --vocab-file v.json --merge-file m.txt" \
        --tasks my_task --include_path my_tasks/

Importing this module registers the class with lm_eval's model registry (@register_model), and
running it is lm_eval's own command line with the class registered. model_args:

| key | meaning |
|---|---|
| load_hf | a transformers directory (our --load-hf: config.json, safetensors, tokenizer.json) |
| load | our checkpoint directory (--load) |
| megatron_args | any other flags of ours, one string (split as a shell splits it): model shape, tokenizer, --tensor-model-parallel-size ... |
| max_length, max_gen_toks | as lm-eval's HFLM (max_length: default --max-position-embeddings) |

The batch size is lm_eval's own `--batch_size N` (a fixed N, no 'auto'; lm_eval's default is 1),
which lm_eval hands to the model beside model_args. `batch_size=N` in model_args as well is accepted
when it is the same N (lm_eval 0.4.13 alone would stop with "got multiple values for keyword
argument 'batch_size'"); a different N is one error line naming both, before lm_eval loads its tasks.

The three request types go to HarnessLM (megatron/evaluation/lm_harness.py), which follows HFLM's
rules; lm_eval only schedules the requests and computes the metrics. Tested serially; under
torchrun (TP / PP) every rank would run lm_eval's loop over the same requests (so the collectives
line up) and each would write its results. This module imports lm_eval; the rest of
megatron/evaluation does not need it.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any, Dict, List, Optional, Tuple

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model


class ModelArgsError(ValueError):
    """model_args that cannot build the model (one line, no traceback, from the command line)."""


def merge_model_args(model_args: Dict[str, Any], lm_eval_args: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """model_args plus what lm_eval's command line adds beside them (batch_size, max_batch_size,
    device; None: not given), where lm_eval itself would pass a key twice. batch_size must then
    agree; for device and max_batch_size, which this model does not use (the device comes from
    megatron.core.device, the batch size is fixed), model_args' value is kept."""
    merged = dict(model_args)
    for key, value in (lm_eval_args or {}).items():
        if value is None:
            continue
        if key not in merged:
            merged[key] = value
        elif key == "batch_size" and str(merged[key]) != str(value):  # '8' from the command line, 8 from model_args
            raise ModelArgsError(f"batch_size={merged[key]} in --model_args and --batch_size {value} differ "
                                 "(lm_eval's --batch_size defaults to 1 when not given): give it once, "
                                 f"e.g. --batch_size {merged[key]}")
    return merged


@register_model("megatron_compat")
class MegatronCompatLM(TemplateLM):
    """lm_eval's LM interface over a HarnessLM (built from model_args, or given as harness_lm)."""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[Dict[str, Any]] = None):
        from lm_eval.utils import simple_parse_args_string

        return cls(**merge_model_args(simple_parse_args_string(arg_string), additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: Dict[str, Any], additional_config: Optional[Dict[str, Any]] = None):
        return cls(**merge_model_args(arg_dict, additional_config))

    def __init__(self, load_hf: Optional[str] = None, load: Optional[str] = None, megatron_args: str = "",
                 batch_size: Any = 8, max_length: Optional[int] = None, max_gen_toks: int = 256,
                 harness_lm: Any = None, **_lm_eval_extras: Any):
        super().__init__()
        if harness_lm is None:
            harness_lm = _build(load_hf, load, megatron_args, batch_size, max_length, max_gen_toks)
        self.lm = harness_lm

    @property
    def eot_token_id(self) -> int:
        return self.lm.eot_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.lm.prefix_token_id

    @property
    def max_length(self) -> int:
        return self.lm.max_length

    def tok_encode(self, string: str, **kwargs: Any) -> List[int]:
        return self.lm.tok_encode(string)

    def _loglikelihood_tokens(self, requests: List[Tuple[Any, List[int], List[int]]], **kwargs: Any):
        return self.lm.loglikelihood_tokens([(context, continuation) for _, context, continuation in requests])

    def loglikelihood(self, requests: List[Any], disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        return self.lm.loglikelihood([tuple(r.args) for r in requests])

    def loglikelihood_rolling(self, requests: List[Any], disable_tqdm: bool = False) -> List[float]:
        return self.lm.loglikelihood_rolling([r.args[0] for r in requests])

    def generate_until(self, requests: List[Any], disable_tqdm: bool = False) -> List[str]:
        return self.lm.generate_until([(r.args[0], r.args[1]) for r in requests])


def _build(load_hf: Optional[str], load: Optional[str], megatron_args: str, batch_size: Any,
           max_length: Optional[int], max_gen_toks: int) -> Any:
    from megatron.evaluation.harness_setup import build_harness_lm, initialize

    if str(batch_size).startswith("auto"):
        raise ModelArgsError("megatron_compat takes a fixed --batch_size N (no 'auto')")
    argv = shlex.split(megatron_args or "")
    argv += ["--load-hf", load_hf] if load_hf else []
    argv += ["--load", load] if load else []
    argv += ["--eval-batch-size", str(int(batch_size)), "--max-gen-toks", str(int(max_gen_toks))]
    argv += ["--max-length", str(int(max_length))] if max_length else []
    return build_harness_lm(initialize(argv))


def main(argv: Optional[List[str]] = None) -> None:
    """lm_eval's command line, with megatron_compat registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    _check_batch_size(list(sys.argv))
    cli_evaluate()


def _check_batch_size(argv: List[str]) -> None:
    """merge_model_args' batch_size check on the command line, before lm_eval indexes its task
    library (tens of seconds) only to stop when it builds the model."""
    try:  # lm_eval 0.4.10's command line and later; before it, the check waits for the model's creation
        import dataclasses

        from lm_eval._cli import HarnessCLI
        from lm_eval.config.evaluate_config import EvaluatorConfig
    except ImportError:
        return
    saved = sys.argv
    try:
        sys.argv = argv  # HarnessCLI parses sys.argv (and inserts its 'run')
        harness = HarnessCLI().parse_args()  # lm-eval's Namespace (its subcommands differ in their fields)
    finally:
        sys.argv = saved
    if getattr(harness, "model", None) != "megatron_compat" or not isinstance(getattr(harness, "model_args", None), dict):
        return
    default = {f.name: f.default for f in dataclasses.fields(EvaluatorConfig)}.get("batch_size")
    merge_model_args(harness.model_args, {"batch_size": getattr(harness, "batch_size", default)})


if __name__ == "__main__":
    from megatron.training.cli import run_cli

    run_cli(main, "lm_eval_adapter", errors=(ModelArgsError,))
