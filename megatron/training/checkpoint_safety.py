"""Reading checkpoint files without running code from them.

Every checkpoint read goes through `load_file`: torch.load(weights_only=True), whose unpickler
only builds tensors, containers and the globals on an allow-list. The list is what real
checkpoints hold, ours and Megatron-LM's:

    global                                          why
    argparse.Namespace                              the saved `args`
    numpy ndarray, dtype, dtype classes,            np.random.get_state() (numpy 1.x pickles the
      numpy(._)core.multiarray._reconstruct/scalar    reconstructors under numpy.core, 2.x under
                                                    numpy._core: both names are accepted)
    _io.BytesIO, builtins.bytes                     Transformer Engine's `_extra_state` buffers
    signal.Signals (and its members)                Megatron 0.16's args.exit_signal
    megatron.core.enums.ModelType, DType, Split,    this project's own enums and configs
      TransformerConfig, OptimizerConfig,
      DistributedDataParallelConfig
    torch dtypes, Size, device, storages            allowed by torch itself

A global outside the list is refused when the unpickler meets it, before anything from the file
runs, with a CheckpointError naming the file and the global. The classes megatron-core pickles
into a Megatron checkpoint (its AttnBackend and CudaGraphScope enums in `args`, the RerunMode,
RerunState and RerunDiagnostic enums of core_v0.13's `rerun_state_machine`: FOREIGN_CLASSES) are
read as inert `ForeignObject` placeholders registered under their names: megatron-core is never
imported (its package is called `megatron` too, so it could not be anyway).

`trust_pickles=True` (--trust-checkpoint-pickles) reads legacy files with full unpickling
instead, for files whose origin the user trusts; the placeholders still stand in for
megatron-core's classes.
"""

from __future__ import annotations

import argparse
import functools
import io
import pickle
import re
import signal
import types
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or does not fit this run; the message names the path."""


class ForeignObject:
    """An object of another program's class, read from a checkpoint without importing it.

    `args` are what the pickle passed to the class (an enum's value), `state` what it set on the
    instance. Equal when class name, args and state are.
    """

    _members: Dict[Any, str] = {}

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        """The enum value (the first argument), or None."""
        return self.args[0] if self.args else None

    @property
    def name(self) -> Optional[str]:
        """The enum member's name when the value is one the table knows."""
        return self._members.get(self.value)

    def __eq__(self, other: Any) -> bool:
        return (type(other) is type(self) and self.args == other.args
                and self.state == other.state)

    def __hash__(self) -> int:
        return hash((type(self).__qualname__, self.args))

    def __repr__(self) -> str:
        cls = type(self).__qualname__
        if self.name is not None:
            return f"{cls}.{self.name}"
        return f"<{type(self).__module__}.{cls}{self.args!r} (not imported)>"


# megatron-core's enums in Megatron-LM's torch checkpoints (core_v0.13-0.16): args.attention_backend,
# args.cuda_graph_scope (0.16) and the rerun_state_machine entry (written by 0.13).
# name -> {value: member name}.
_RERUN = "megatron.core.rerun_state_machine."
FOREIGN_CLASSES: Dict[str, Dict[Any, str]] = {
    "megatron.core.transformer.enums.AttnBackend":
        {1: "flash", 2: "fused", 3: "unfused", 4: "local", 5: "auto"},
    "megatron.core.transformer.enums.CudaGraphScope":
        {1: "full_iteration", 2: "attn", 3: "mlp", 4: "moe", 5: "moe_router",
         6: "moe_preprocess", 7: "mamba"},
    _RERUN + "RerunMode": {"disabled": "DISABLED", "validate_results": "VALIDATE_RESULTS",
                           "report_determinism_stats": "REPORT_DETERMINISM_STATS"},
    _RERUN + "RerunState": {0: "NOT_RUNNING_YET", 1: "INITIAL_RUN", 2: "RERUNNING_IN_PLACE",
                            3: "WILL_RERUN_FROM_CHECKPOINT", 4: "RERUNNING_FROM_CHECKPOINT",
                            5: "RERUNNING_AGAIN_FROM_CHECKPOINT"},
    _RERUN + "RerunDiagnostic": {"correct_result": "CORRECT_RESULT",
                                 "transient_error": "TRANSIENT_ERROR",
                                 "persistent_error": "PERSISTENT_ERROR"},
}


@functools.lru_cache(maxsize=None)
def _placeholders() -> Dict[str, type]:
    classes = {}
    for full_name, members in FOREIGN_CLASSES.items():
        module, qualname = full_name.rsplit(".", 1)
        classes[full_name] = type(qualname, (ForeignObject,),
                                  {"__module__": module, "__qualname__": qualname,
                                   "_members": dict(members)})
    return classes


def _numpy_globals() -> List[Tuple[Any, str]]:
    core = getattr(np, "_core", None) or np.core  # numpy 2.x: _core; 1.x: core
    multiarray = core.multiarray
    entries: List[Tuple[Any, str]] = []
    for package in ("numpy.core", "numpy._core"):  # accept files from either numpy major version
        entries.append((multiarray._reconstruct, f"{package}.multiarray._reconstruct"))
        entries.append((multiarray.scalar, f"{package}.multiarray.scalar"))
    entries += [(np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype")]
    # BUILD on a dtype checks the dtype's own class (numpy.dtypes.UInt32DType...). Numbers and
    # bools only: object dtypes would let a file place arbitrary objects in an array.
    for code in "?bBhHiIlLqQefdgFDG":
        cls = type(np.dtype(code))
        entries.append((cls, f"{cls.__module__}.{cls.__qualname__}"))
    return entries


@functools.lru_cache(maxsize=None)
def safe_globals() -> Tuple[Tuple[Any, str], ...]:
    """The allow-list: (object, the name a pickle refers to it by)."""
    from megatron.core.distributed.param_and_grad_buffer import DistributedDataParallelConfig
    from megatron.core.enums import ModelType
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.data.indexed_dataset import DType
    from megatron.data.utils import Split
    from megatron.model.transformer_config import TransformerConfig

    entries: List[Tuple[Any, str]] = [(argparse.Namespace, "argparse.Namespace")]
    entries += _numpy_globals()
    entries += [(io.BytesIO, "_io.BytesIO"), (bytes, "builtins.bytes")]
    entries.append((signal.Signals, "signal.Signals"))
    # Python >= 3.12 pickles a signal by its global name (signal.SIGTERM)
    entries += [(member, f"signal.{member.name}") for member in signal.Signals]
    for cls in (ModelType, DType, Split, TransformerConfig, OptimizerConfig,
                DistributedDataParallelConfig):
        entries.append((cls, f"{cls.__module__}.{cls.__qualname__}"))
    entries += [(cls, name) for name, cls in _placeholders().items()]
    return tuple(entries)


class _TrustingUnpickler(pickle.Unpickler):
    """Full unpickling (--trust-checkpoint-pickles), megatron-core's classes as placeholders."""

    def find_class(self, module: str, name: str) -> Any:
        placeholder = _placeholders().get(f"{module}.{name}")
        if placeholder is not None:
            return placeholder
        return super().find_class(module, name)


_TRUSTING_PICKLE = types.SimpleNamespace(
    __name__="megatron_trusting_pickle", Unpickler=_TrustingUnpickler,
    load=lambda file, **kwargs: _TrustingUnpickler(file, **kwargs).load())

_NAMED = re.compile(r"GLOBAL (\S+?) (?:was not an allowed global|whose module)"
                    r"|but got <class '([^']+)'>|unrecognized function (\S+)")


def _refused(path: str, error: Exception) -> str:
    """What the safe unpickler refused: the globals, or the reason torch gave."""
    try:
        names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 -- not a zip checkpoint: fall back on the unpickler's message
        names = []
    names = names or sorted({name for match in _NAMED.findall(str(error)) for name in match if name})
    if names:
        return f"refers to {', '.join(names)}, which is not on the list of what checkpoints may hold"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = next((line.split("WeightsUnpickler error:", 1)[1].strip() for line in lines
                   if "WeightsUnpickler error:" in line), lines[-1] if lines else "")
    return f"holds something the safe unpickler does not build ({detail})"


def load_file(path: str, trust_pickles: bool = False, log: Any = print, mmap: bool = False) -> Any:
    """torch.load `path` onto the CPU with the allow-list (see the module docstring).

    mmap=True maps the file instead of reading it: a tensor's bytes are read when it is used (the
    checkpoint converter reads a whole stage's files this way, one tensor at a time).

    Raises CheckpointError naming the file and the refused global(s) when the file refers to
    anything else; other read errors (truncated, not a torch file) propagate as they are.
    trust_pickles=True unpickles fully and says so through `log`.
    """
    if trust_pickles:
        log(f"WARNING: --trust-checkpoint-pickles: reading {path} with full unpickling "
            "(a malicious file can run code)")
        return torch.load(path, map_location="cpu", weights_only=False,
                          pickle_module=_TRUSTING_PICKLE, mmap=mmap)
    with torch.serialization.safe_globals(list(safe_globals())):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as error:
            reason = _refused(path, error)
    raise CheckpointError(
        f"checkpoint file {path} {reason} (unpickling it could run code); nothing from the file "
        "was run. If you trust where the file came from, --trust-checkpoint-pickles reads it "
        "with full unpickling")
