"""The framework layer, as Megatron-LM names it: flags and their validation, global state,
initialization, the training loop, checkpointing, tokenizers and the rank-aware print helpers.
The only layer that knows argv; megatron/core, megatron/model and megatron/data never import it."""
