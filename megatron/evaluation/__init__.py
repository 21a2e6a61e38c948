"""Zero-shot scoring of GPT checkpoints with EleutherAI lm-evaluation-harness's conventions (lm_harness.py)."""
