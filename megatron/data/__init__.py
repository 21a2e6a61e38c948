"""Datasets: the indexed (.bin/.idx) format, GPT samples, blending and the builder of the splits.

The dataset classes are imported lazily (`from megatron.data.gpt_dataset import GPTDataset`),
so that importing `megatron.data.indexed_dataset` alone stays cheap.
"""
