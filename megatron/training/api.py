"""The Python API: train from a typed config, in a notebook or under torchrun, with no command line.

    from megatron.training.api import pretrain
    from megatron.training.config import MegatronConfig

    config = MegatronConfig.load("run.yaml")          # or MegatronConfig(), then set fields
    config.model.num_layers = 4
    result = pretrain(config)                          # the built-in GPT recipe
    result = pretrain(config, recipe="bert")           # BERT / T5: their recipes' defaults too
    result = pretrain(config, train_valid_test_dataset_provider=..., model_provider=...,
                      model_type=ModelType.encoder_or_decoder, forward_step_func=...)  # your own

pretrain(config) runs exactly what `pretrain_gpt.py` runs for the command line that gives the config
(megatron.training.arguments.argv_from_config): the same validation, messages, log lines and
numbers. It may be called again in the same process (each call starts from fresh globals and
parallel groups; the torch.distributed process group of a torchrun job is kept).

    model = load("checkpoints/gpt")                    # a checkpoint folder (its stored args), or
    model = load("hf/Llama-3.2-1B")                    # a HuggingFace folder (config.json + safetensors)
    model.generate(["The cat"], max_new_tokens=16)     # ["The cat sat ..."]: prompt and continuation
    model.score(["The cat sat"])                       # [[log p(token 1 | 0), log p(token 2 | 0, 1), ...]]

load() builds the model as tools/generate_text.py and the server do (megatron.inference), at the
layout of `config` (serial by default; under torchrun every rank calls generate / score together).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Optional

from megatron.core.enums import ModelType
from megatron.training.config import MegatronConfig

RECIPES = ("gpt", "bert", "t5", "mamba")


def _recipe(name: str) -> Dict[str, Any]:
    """pretrain()'s arguments of a built-in recipe (megatron/training/recipes/NAME.py)."""
    if name not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {name!r}")
    return importlib.import_module(f"megatron.training.recipes.{name}").pretrain_arguments()


def pretrain(config: MegatronConfig, train_valid_test_dataset_provider: Optional[Callable] = None,
             model_provider: Optional[Callable] = None, model_type: Optional[ModelType] = None,
             forward_step_func: Optional[Callable] = None, *, recipe: Optional[str] = None,
             extra_args_provider: Optional[Callable] = None, args_defaults: Optional[Dict] = None,
             record_history: bool = False) -> Any:
    """Train as megatron.training.training.pretrain does, with `config`'s settings instead of argv.

    Give the four providers (Megatron's pretrain() arguments) or a recipe ("gpt" when neither);
    returns the TrainingResult (its history holds every iteration with record_history=True).
    """
    from megatron.training.arguments import argv_from_config
    from megatron.training.training import pretrain as pretrain_with_argv

    if not isinstance(config, MegatronConfig):
        raise TypeError(f"pretrain(config): a megatron.training.config.MegatronConfig, got {type(config).__name__}")
    providers = (train_valid_test_dataset_provider, model_provider, model_type, forward_step_func)
    if any(p is not None for p in providers):
        if recipe is not None:
            raise ValueError("pretrain(): give the providers or a recipe, not both")
        if any(p is None for p in providers):
            raise ValueError("pretrain(): give all four of train_valid_test_dataset_provider, model_provider, "
                             "model_type and forward_step_func (or none, for a built-in recipe)")
        run = dict(train_valid_test_dataset_provider=train_valid_test_dataset_provider,
                   model_provider=model_provider, model_type=model_type, forward_step_func=forward_step_func)
    else:
        run = _recipe(recipe or "gpt")
    if extra_args_provider is not None:
        run["extra_args_provider"] = extra_args_provider
    if args_defaults is not None:
        run["args_defaults"] = {**run.get("args_defaults", {}), **args_defaults}
    argv = argv_from_config(config, run.get("extra_args_provider"))
    return pretrain_with_argv(run["train_valid_test_dataset_provider"], run["model_provider"], run["model_type"],
                              run["forward_step_func"], extra_args_provider=run.get("extra_args_provider"),
                              args_defaults=run.get("args_defaults"), argv=argv, record_history=record_history)


class LoadedModel:
    """A loaded GPT-family model with its tokenizer: generate() and score() (megatron.inference.api)."""

    def __init__(self, model: Any, tokenizer: Any, args: Any) -> None:
        self.model, self.tokenizer, self.args = model, tokenizer, args

    def generate(self, prompts: Any, max_new_tokens: int = 32, *, top_k: int = 1, top_p: float = 0.0,
                 temperature: float = 1.0, random_seed: Optional[int] = None, **kwargs: Any) -> Any:
        """Each prompt followed by its continuation (greedy by default; top_k > 1, or top_p with
        top_k=0, samples). A single string gives a string; a list, a list."""
        from megatron.inference.api import generate

        single = isinstance(prompts, str)
        if max_new_tokens < 1:
            raise ValueError(f"generate(max_new_tokens={max_new_tokens}): at least 1 (score() scores a text)")
        out = generate(self.model, self.tokenizer, [prompts] if single else list(prompts), max_new_tokens,
                       top_k=top_k, top_p=top_p, temperature=temperature, random_seed=random_seed, **kwargs)
        return out["text"][0] if single else out["text"]

    def score(self, texts: Any) -> Any:
        """Per text, the log-probability of each token given the ones before it (one fewer than its
        tokens). A single string gives one list; a list, a list of lists."""
        from megatron.inference.api import score

        single = isinstance(texts, str)
        out = score(self.model, self.tokenizer, [texts] if single else list(texts))
        return out["logprobs"][0] if single else out["logprobs"]


def load(path: str, config: Optional[MegatronConfig] = None) -> LoadedModel:
    """The model of a checkpoint folder (--load with --use-checkpoint-args: its own shape and
    tokenizer) or of a HuggingFace folder (--load-hf), ready for generate() and score().

    `config` adds settings (a layout, a tokenizer the checkpoint does not name, ...)."""
    import os

    from megatron.inference.checkpoint_model import build_model, initialize_for_inference
    from megatron.training.arguments import argv_from_config
    from megatron.training.checkpointing import CheckpointError
    from megatron.training.global_vars import get_tokenizer

    if os.path.isfile(os.path.join(path, "config.json")):
        source = ["--load-hf", path]
    elif os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")):
        source = ["--load", path, "--use-checkpoint-args", "--auto-detect-ckpt-format"]
    else:
        raise CheckpointError(f"load({path!r}): neither a checkpoint folder (latest_checkpointed_iteration.txt) "
                              f"nor a HuggingFace folder (config.json)")
    args = initialize_for_inference([*argv_from_config(config or MegatronConfig()), *source])
    return LoadedModel(build_model(args), get_tokenizer(), args)
