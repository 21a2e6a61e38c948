"""Shim so that `pip install -e .` works with old pips; metadata lives in pyproject.toml.

It also installs megatron_compat_accelerate.pth at the top of site-packages, in a wheel and in an
editable install (megatron/startup/accelerate_hook.py): `accelerate launch` then runs this package as its
Megatron-LM with nothing else to do.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "megatron_compat_accelerate.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithPth(build_py):
    """A wheel: the .pth beside the packages, at the top of site-packages."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


cmdclass = {"build_py": BuildPyWithPth}

try:  # an editable install (`pip install -e .`) writes its own wheel: the .pth goes in there too
    from setuptools.command.editable_wheel import editable_wheel

    class _StrategyWithPth:
        def __init__(self, strategy):
            self._strategy = strategy

        def __enter__(self):
            self._strategy.__enter__()
            return self

        def __exit__(self, *exc):
            return self._strategy.__exit__(*exc)

        def __call__(self, wheel, files, mapping):
            self._strategy(wheel, files, mapping)
            with open(os.path.join(HERE, PTH), "rb") as f:
                wheel.writestr(PTH, f.read())

    class EditableWheelWithPth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _StrategyWithPth(super()._select_strategy(*args, **kwargs))

    if hasattr(editable_wheel, "_select_strategy"):
        cmdclass["editable_wheel"] = EditableWheelWithPth
except ImportError:
    pass

setup(cmdclass=cmdclass)
