"""Checkpoint conversion: weight and config mappings to other libraries (huggingface.py: HuggingFace),
the tensor-parallel split of every key (layout_rules.py), our checkpoints as a stream of whole tensors
(megatron_format.py) and the logits check of a conversion (verify.py); tools/checkpoint/convert.py
is the command line."""
