"""Megatron-LM's megatron.inference.text_generation interface (communication, generation), as
Accelerate's Megatron-LM integration imports it, over this project's megatron.inference."""
