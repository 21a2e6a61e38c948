"""Shim so that `pip install -e .` works with old pips; metadata lives in pyproject.toml."""
from setuptools import setup

setup()
