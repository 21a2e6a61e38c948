"""Accelerate's Megatron-LM integration on this package with nothing beyond the install.

The install puts `megatron_compat_accelerate.pth` in site-packages. When a Python process starts
with ACCELERATE_USE_MEGATRON_LM set (`accelerate launch --use_megatron_lm`, or an accelerate config
with Megatron-LM, sets it for the script), that file imports this module, which waits for the first
`import accelerate` and then calls megatron.training.accelerate_launch.enable() (the fixes it
lists, before Accelerate's modules run; on a machine without a GPU, also the CPU path). Without the
variable nothing is imported. MEGATRON_ACCELERATE_HOOK=0 turns it off. An accelerate release the
launcher is not tested with stops `import accelerate` with the launcher's one-line message.
"""

import importlib.abc
import os
import sys


class _OnFirstAccelerateImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "accelerate":
            return None
        sys.meta_path.remove(self)
        from megatron.training import accelerate_launch

        try:
            accelerate_launch.enable()
        except accelerate_launch.AccelerateLaunchError as error:
            raise ImportError(str(error)) from None
        return None  # accelerate itself is found as usual; its modules then meet enable()'s hook


def install() -> None:
    if os.environ.get("MEGATRON_ACCELERATE_HOOK", "1").strip() == "0" or "accelerate" in sys.modules:
        return
    if not any(isinstance(finder, _OnFirstAccelerateImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OnFirstAccelerateImport())


install()
