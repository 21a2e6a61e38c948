"""megatron_compat: our GPT checkpoints as a model of EleutherAI's lm-evaluation-harness (lm_eval >= 0.4.9).

    python -m megatron.evaluation.lm_eval_adapter --model megatron_compat \
        --model_args load_hf=HF_DIR,batch_size=8 --tasks hellaswag --output_path results/
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
| batch_size, max_length, max_gen_toks | as lm-eval's HFLM (max_length: default --max-position-embeddings) |

The three request types go to HarnessLM (megatron/evaluation/lm_harness.py), which follows HFLM's
rules; lm_eval only schedules the requests and computes the metrics. Tested serially; under
torchrun (TP / PP) every rank would run lm_eval's loop over the same requests (so the collectives
line up) and each would write its results. This module imports lm_eval; the rest of
megatron/evaluation does not need it.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any, List, Optional, Tuple

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model


@register_model("megatron_compat")
class MegatronCompatLM(TemplateLM):
    """lm_eval's LM interface over a HarnessLM (built from model_args, or given as harness_lm)."""

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
    from tools.lm_eval_harness import build_harness_lm, initialize

    if str(batch_size).startswith("auto"):
        raise ValueError("megatron_compat takes a fixed batch_size (no 'auto')")
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
    cli_evaluate()


if __name__ == "__main__":
    main()
