"""Run an unchanged HuggingFace Accelerate Megatron-LM script on this project, on CPU with gloo.

    torchrun --nproc-per-node 4 -m megatron.training.accelerate_launch \\
        --config_file megatron_lm_config.yaml  megatron_lm_gpt_pretraining.py --model_name_or_path ...

Accelerate 1.16 cannot drive this package by itself, for reasons that are Accelerate's, not the
script's. On any machine:
  * `accelerate.utils.is_megatron_lm_available()` asks for the `megatron-core` distribution's
    version; this project is installed as `megatron-compat` and does not claim that name;
  * its GPTTrainStep reads `args.eos_token_id`, which only its glm4_moe config parser sets (a GPT-2,
    Llama, BERT or T5 model stops with an AttributeError, on Megatron-LM too): every parser here
    also passes the HF config's eos_token_id;
  * it dropped `MegatronEngine.megatron_generate` (its guide still shows it): supplied from
    megatron.inference.text_generation.accelerate_generate;
  * its train steps take `(accelerator, args)` while its engine builds a custom one with `(args)`
    alone, as the guide's GPTTrainStepWithCustomLoss expects: both forms are taken;
  * GPTTrainStep asks for the tokenizer when `vocab_file` is set, though Megatron is initialized
    without one: it is built from the args;
  * its engine's train and eval steps return the losses on the last pipeline stage only (the other
    stages' `model(**batch).loss` is 0, so the guide's example, where every rank writes
    all_results.json, leaves a perplexity of 1.0 or the real one, whichever rank writes last): the
    scalar losses are broadcast from the last stage over the pipeline group, so every rank returns
    the same numbers (logits stay on the last stage);
  * the plugin passes recompute_granularity "full" with recompute off, and its default
    use_rotary_position_embeddings=True overrides an explicit position_embedding_type (and asks a T5
    for rope): recompute only when asked for, the explicit type wins, T5 keeps its positions.
On a machine without a GPU, also:
  * `AcceleratorState` picks `DistributedType.MEGATRON_LM` only for GPUs: here it does so on the
    CPU, over the gloo group Accelerate forms with ACCELERATE_USE_CPU (what `accelerate launch
    --cpu` sets);
  * `accelerate/utils/megatron_lm.py` asserts `torch.cuda.is_available()` and places batches and
    loss accumulators with `torch.cuda.current_device()` / `torch.cuda.FloatTensor`: that module
    sees a `torch` whose `cuda` namespace places on the CPU; torch itself is untouched.
Each fix is applied right after Accelerate's module defines what it fixes (an import hook, before
any other module reads it); everything else is Accelerate's own code calling this package's
Megatron-LM interface. The launcher knows only the Accelerate releases it is tested with
(TESTED_ACCELERATE_VERSIONS) and refuses any other in one line.

`--config_file` reads the YAML `accelerate config` writes and sets the environment variables
`accelerate launch` would (ACCELERATE_USE_MEGATRON_LM, MEGATRON_LM_TP_DEGREE, ...,
ACCELERATE_MIXED_PRECISION); without it, set them yourself. MEGATRON_LM_CONTEXT_PARALLEL_SIZE
defaults to 1 (accelerate 1.16's plugin would take 2 when it is unset). From Python (a notebook,
one process) call `enable()` before the first `import accelerate`.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import runpy
import sys
import types
from typing import Any, Callable, Dict, List, Optional

import torch

TESTED_ACCELERATE_VERSIONS = ("1.16.0",)

_PATCHED_MODULES = ("accelerate.utils.imports", "accelerate.utils.dataclasses", "accelerate.state",
                    "accelerate.utils.megatron_lm")


class AccelerateLaunchError(Exception):
    """A one-line reason the launcher cannot run the script."""


def check_accelerate_version() -> str:
    """The installed accelerate's version, if it is one this launcher is tested with."""
    try:
        version = importlib.metadata.version("accelerate")
    except importlib.metadata.PackageNotFoundError:
        raise AccelerateLaunchError(
            f"accelerate is not installed: pip install accelerate=={TESTED_ACCELERATE_VERSIONS[-1]}") from None
    if version not in TESTED_ACCELERATE_VERSIONS:
        raise AccelerateLaunchError(
            f"accelerate {version} is installed; the CPU launcher is tested with accelerate "
            f"{', '.join(TESTED_ACCELERATE_VERSIONS)} only: pip install accelerate=={TESTED_ACCELERATE_VERSIONS[-1]}")
    return version


# ----------------------------------------------------------------------------- the three answers


def _megatron_lm_available():
    """accelerate's is_megatron_lm_available(), for this package: on when the environment asks for
    Megatron-LM and `megatron.training` is importable (Accelerate's own test, minus the version of
    the megatron-core distribution)."""
    flag = os.environ.get("ACCELERATE_USE_MEGATRON_LM", "false").strip().lower()
    if flag not in ("1", "true", "yes", "y", "on", "t"):
        return None
    return importlib.util.find_spec("megatron.training")


class _CudaOnCPU(types.SimpleNamespace):
    """The part of `torch.cuda` accelerate/utils/megatron_lm.py uses, placing on the CPU."""

    def __init__(self):
        super().__init__(
            is_available=lambda: True,
            current_device=lambda: torch.device("cpu"),
            empty_cache=lambda: None,
            synchronize=lambda *a, **k: None,
            FloatTensor=lambda data: torch.tensor(data, dtype=torch.float32),
            LongTensor=lambda data: torch.tensor(data, dtype=torch.long),
        )

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"torch.cuda.{name} is not available to Accelerate's Megatron-LM code on CPU")


class _TorchOnCPU(types.ModuleType):
    """`torch` as accelerate/utils/megatron_lm.py sees it under this launcher: every attribute is
    torch's own except `cuda`."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaOnCPU()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _patch_imports(module: types.ModuleType) -> None:
    module.is_megatron_lm_available = _megatron_lm_available


def _patch_state(module: types.ModuleType) -> None:
    cls = module.AcceleratorState
    if getattr(cls.__init__, "_megatron_cpu", False):
        return
    original = cls.__init__
    DistributedType = module.DistributedType

    def __init__(self, *args, megatron_lm_plugin=None, **kwargs):
        original(self, *args, megatron_lm_plugin=megatron_lm_plugin, **kwargs)
        if (_megatron_lm_available() and megatron_lm_plugin is not None
                and self.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU)):
            # What AcceleratorState does on GPUs (state.py, the MEGATRON_LM branch), on the CPU.
            self.distributed_type = DistributedType.MEGATRON_LM
            megatron_lm_plugin.set_mixed_precision(self._mixed_precision)
            self.megatron_lm_plugin = megatron_lm_plugin
            module.PartialState._shared_state["distributed_type"] = self.distributed_type

    __init__._megatron_cpu = True
    cls.__init__ = __init__


def _engine_megatron_generate(self, inputs, attention_mask=None, max_length=None, max_new_tokens=None,
                              num_beams=None, temperature=None, top_k=None, top_p=None, length_penalty=None, **kwargs):
    """MegatronEngine.megatron_generate, as accelerate <= 1.12 had it (1.16 dropped it; its guide
    still shows it): megatron.inference.text_generation.accelerate_generate.megatron_generate."""
    from megatron.inference.text_generation.accelerate_generate import megatron_generate

    return megatron_generate(self, inputs, attention_mask=attention_mask, max_length=max_length,
                             max_new_tokens=max_new_tokens, num_beams=num_beams, temperature=temperature,
                             top_k=top_k, top_p=top_p, length_penalty=length_penalty, **kwargs)


# The Accelerator whose MegatronEngine is being built: a train step written as the guide shows it
# (`__init__(self, megatron_args, **kwargs)`) is given only the args.
_ENGINE_ACCELERATOR: List[Any] = []


def _fit_arguments(method: Callable) -> Callable:
    """method called with Accelerate 1.16's arguments (accelerator first); an override written as the
    guide shows it (without the accelerator) gets the rest of them."""
    import inspect

    def call(*args):
        try:
            inspect.signature(method).bind(*args)
        except TypeError:
            return method(*args[1:])
        return method(*args)

    return call


def _train_step_init(original: Callable) -> Callable:
    """GPT/Bert/T5TrainStep.__init__ accepting the guide's form `(megatron_args)` as well as Accelerate
    1.16's `(accelerator, args)`, and overrides of get_batch_func / get_loss_func with or without the
    accelerator argument (the guide's GPTTrainStepWithCustomLoss defines `get_loss_func(self)`)."""

    def __init__(self, *args, **kwargs):
        if len(args) + len(kwargs) == 1:  # the guide's super().__init__(megatron_args)
            if not _ENGINE_ACCELERATOR:
                raise TypeError(f"{type(self).__name__}(megatron_args) outside accelerator.prepare: "
                                f"pass (accelerator, megatron_args)")
            args = (_ENGINE_ACCELERATOR[-1], *args, *kwargs.values())
            kwargs = {}
        hooks = ("get_batch_func", "get_loss_func")
        for name in hooks:
            setattr(self, name, _fit_arguments(getattr(self, name)))
        try:
            original(self, *args, **kwargs)
        finally:
            for name in hooks:
                self.__dict__.pop(name, None)

    __init__._megatron_guide = True
    return __init__


def _engine_init(original: Callable) -> Callable:
    def __init__(self, accelerator, *args, **kwargs):
        _ENGINE_ACCELERATOR.append(accelerator)
        try:
            original(self, accelerator, *args, **kwargs)
        finally:
            _ENGINE_ACCELERATOR.pop()

    __init__._megatron_guide = True
    return __init__


def share_last_stage_losses(loss_dict: Dict[str, Any]) -> Dict[str, Any]:
    """The scalar entries of the last pipeline stage's loss_dict on every rank of its pipeline group
    (other entries, such as logits, stay where they are): one broadcast of the values, as
    training._reduce_losses shares the log line's losses."""
    from megatron.core import communication, parallel_state as mpu

    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return loss_dict
    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    shared = [{k: float(v) for k, v in loss_dict.items() if torch.is_tensor(v) and v.dim() == 0} if last else None]
    communication.broadcast_object_list(shared, src=mpu.get_pipeline_model_parallel_last_rank(),
                                        group=mpu.get_pipeline_model_parallel_group())
    if last:
        return loss_dict
    return {**loss_dict, **{k: torch.tensor(v) for k, v in shared[0].items()}}


def _shared_losses(step: Callable, train: bool) -> Callable:
    def call(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        if train:  # (loss_dict, skipped_iter, grad_norm, num_zeros_in_grad)
            return (share_last_stage_losses(out[0]), *out[1:])
        return share_last_stage_losses(out)

    call._megatron_shared = True
    return call


def _tokenizer_of_the_args() -> Any:
    """get_tokenizer() for Accelerate's GPTTrainStep, which asks for one whenever args.vocab_file is
    set (the guide sets it for megatron_generate) although Accelerate 1.16 initializes Megatron with
    build_tokenizer=False (Megatron-LM's get_tokenizer then fails its assertion): the tokenizer the
    args describe, built once."""
    from megatron.training.global_vars import get_tokenizer_or_build

    return get_tokenizer_or_build()


def _patch_megatron_lm_common(module: types.ModuleType) -> None:
    """On any machine: megatron_generate, the guide's custom train step form, a tokenizer for
    GPTTrainStep when the args name a vocabulary, the losses on every pipeline stage."""
    module.get_tokenizer = _tokenizer_of_the_args
    if not hasattr(module.MegatronEngine, "megatron_generate"):
        module.MegatronEngine.megatron_generate = _engine_megatron_generate
    if not getattr(module.MegatronEngine.__init__, "_megatron_guide", False):
        module.MegatronEngine.__init__ = _engine_init(module.MegatronEngine.__init__)
    for name, train in (("train_step", True), ("eval_step", False)):
        step = getattr(module.MegatronEngine, name)
        if not getattr(step, "_megatron_shared", False):
            setattr(module.MegatronEngine, name, _shared_losses(step, train))
    for name in ("GPTTrainStep", "BertTrainStep", "T5TrainStep"):
        cls = getattr(module, name)
        if not getattr(cls.__init__, "_megatron_guide", False):
            cls.__init__ = _train_step_init(cls.__init__)


def _patch_megatron_lm(module: types.ModuleType) -> None:
    _patch_megatron_lm_common(module)
    module.torch = _TorchOnCPU()


def _llama_args(hf_config: Any, keep: set) -> Dict[str, Any]:
    """Accelerate's llama parser passes the shape only (a GPT-2-like model of Llama's size): our args
    of the model the HF config describes (SwiGLU, RMSNorm, query groups, rope base and scaling, untied
    output, no biases), as --load-hf takes them; keys in `keep` (the user's other_megatron_args) and
    the plugin's dropout stay as given."""
    from megatron.convert.hf_files import hf_arg_values

    values = hf_arg_values(hf_config)
    return {key: value for key, value in values.items()
            if key not in keep and key not in ("hidden_dropout", "attention_dropout")}


def _patch_dataclasses(module: types.ModuleType) -> None:
    """accelerate 1.16's GPTTrainStep reads `args.eos_token_id` (its eod and pad id), which only its
    glm4_moe config parser sets: every other model type stops with an AttributeError (on
    Megatron-LM as well). Each parser also passes the HF config's eos_token_id."""
    parsers = module.MODEL_CONFIGS_TO_MEGATRON_PARSERS
    for model_type, parser in list(parsers.items()):
        if getattr(parser, "_megatron_eos", False):
            continue

        def with_eos(plugin, model, batch_data, _parser=parser, _model_type=model_type):
            _parser(plugin, model, batch_data)
            defaults = plugin.megatron_lm_default_args
            defaults.setdefault("eos_token_id", getattr(model.config, "eos_token_id", None))
            if (not plugin.recompute_activations and plugin.recompute_granularity == "full"
                    and "MEGATRON_LM_RECOMPUTE_GRANULARITY" not in os.environ):
                # Accelerate 1.16 passes its default recompute_granularity "full" even when recompute
                # activations is off (the default, and `accelerate config`'s "no"): no recompute then.
                defaults.update(recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
            other = plugin.other_megatron_args or {}
            if _model_type == "llama":  # the Llama-family GPTModel of the HF config (a plus over Megatron-LM)
                defaults.update(_llama_args(model.config, keep=set(other)))
            if "position_embedding_type" in other or (
                    defaults.get("model_type_name") == "t5" and "use_rotary_position_embeddings" not in other
                    and "MEGATRON_LM_USE_ROTARY_POSITION_EMBEDDINGS" not in os.environ):
                # The guide's other_megatron_args={"position_embedding_type": "alibi"}: Accelerate 1.16's
                # own default use_rotary_position_embeddings=True would turn it into rope. T5 keeps its
                # learned positions (our T5Model has no rope) unless rope is asked for.
                defaults["use_rotary_position_embeddings"] = False

        with_eos._megatron_eos = True
        parsers[model_type] = with_eos


_PATCHES: Dict[str, Callable[[types.ModuleType], None]] = {
    "accelerate.utils.imports": _patch_imports,
    "accelerate.utils.dataclasses": _patch_dataclasses,
    "accelerate.state": _patch_state,
    "accelerate.utils.megatron_lm": _patch_megatron_lm,
}


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


_ALWAYS = ("accelerate.utils.imports", "accelerate.utils.dataclasses")  # on GPUs as well


class _AccelerateHook(importlib.abc.MetaPathFinder):
    """Applies a patch to each of its modules right after the module executes."""

    def __init__(self, patches: Dict[str, Callable[[types.ModuleType], None]]):
        self._patches = patches

    def find_spec(self, fullname, path, target=None):
        if fullname not in self._patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchAfterExec(spec.loader, self._patches[fullname])
        return spec


def enable(cpu: Optional[bool] = None) -> None:
    """Let Accelerate's Megatron-LM integration run this package. Call it before accelerate is first
    imported; idempotent. cpu (default: no GPU here) adds the CPU answers (the MEGATRON_LM state, the
    CPU `torch.cuda` of megatron_lm.py, ACCELERATE_USE_CPU so that Accelerate joins the gloo group);
    without it only Accelerate's own GPU path runs, with the availability and eos_token_id fixes."""
    from megatron.core import device

    check_accelerate_version()
    if any(isinstance(finder, _AccelerateHook) for finder in sys.meta_path):
        return
    imported = [name for name in _PATCHED_MODULES if name in sys.modules]
    if imported:
        raise AccelerateLaunchError(
            "accelerate was imported before megatron.training.accelerate_launch.enable(): call it first")
    # accelerate 1.16's MegatronLMPlugin takes context_parallel_size 2 when nothing sets it (even on
    # one process); `accelerate launch` sets it only when the config has it. Unset means 1 here.
    os.environ.setdefault("MEGATRON_LM_CONTEXT_PARALLEL_SIZE", "1")
    cpu = not device.accelerator_available() if cpu is None else cpu
    patches = dict(_PATCHES) if cpu else {**{name: _PATCHES[name] for name in _ALWAYS},
                                          "accelerate.utils.megatron_lm": _patch_megatron_lm_common}
    if cpu:
        # What `accelerate launch --cpu` sets: Accelerate then forms its MULTI_CPU (gloo) state.
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    sys.meta_path.insert(0, _AccelerateHook(patches))


# ----------------------------------------------------------------------------- accelerate config


def env_from_accelerate_config(path: str) -> Dict[str, str]:
    """The environment `accelerate launch --config_file PATH` gives a Megatron-LM script."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise AccelerateLaunchError(f"--config_file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise AccelerateLaunchError(f"--config_file {path}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise AccelerateLaunchError(f"--config_file {path}: not an accelerate config (a mapping expected)")
    megatron = config.get("megatron_lm_config") or {}
    if not isinstance(megatron, dict) or not megatron:
        raise AccelerateLaunchError(f"--config_file {path}: has no megatron_lm_config section "
                                    "(answer yes to Megatron-LM in `accelerate config`)")
    env = {"ACCELERATE_USE_MEGATRON_LM": "true"}
    for key, value in megatron.items():
        if not key.startswith("megatron_lm_"):
            raise AccelerateLaunchError(f"--config_file {path}: unknown megatron_lm_config key {key!r}")
        env["MEGATRON_LM_" + key[len("megatron_lm_"):].upper()] = str(value)
    if config.get("mixed_precision") not in (None, ""):
        env["ACCELERATE_MIXED_PRECISION"] = str(config["mixed_precision"])
    return env


# ----------------------------------------------------------------------------- main


def _parse(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.training.accelerate_launch",
        description="Run an Accelerate Megatron-LM script on this project on CPU (under torchrun for several ranks).")
    parser.add_argument("--config_file", default=None,
                        help="The YAML `accelerate config` wrote (its megatron_lm_config and mixed_precision).")
    parser.add_argument("script", help="The training script, run as __main__.")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="The script's own arguments.")
    return parser.parse_args(argv)


def prepare(argv: List[str]) -> List[str]:
    """Everything before the script runs (flags, config, version, the hook): the script's argv."""
    args = _parse(argv)
    if not os.path.isfile(args.script):
        raise AccelerateLaunchError(f"{args.script}: no such script")
    if args.config_file is not None:
        os.environ.update(env_from_accelerate_config(args.config_file))
    os.environ.setdefault("ACCELERATE_USE_MEGATRON_LM", "true")
    enable()
    return [args.script, *args.script_args]


def run_script(script_argv: List[str]) -> None:
    """Run the script as `python script.py args` would: as __main__, its folder first on sys.path."""
    sys.argv = list(script_argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script_argv[0])))
    runpy.run_path(script_argv[0], run_name="__main__")


def main(argv: Optional[List[str]] = None) -> None:
    from megatron.training.cli import run_cli

    script_argv: List[str] = []

    def _prepare() -> None:
        script_argv.extend(prepare(sys.argv[1:] if argv is None else argv))

    try:
        run_cli(_prepare, "megatron.training.accelerate_launch", errors=(AccelerateLaunchError,))
    except SystemExit as done:
        if done.code:
            raise
    run_script(script_argv)  # the script's own errors keep their tracebacks


if __name__ == "__main__":
    main()
