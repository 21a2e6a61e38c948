"""A Megatron-LM-compatible framework for training transformer language models."""

__version__ = "0.1.0"
