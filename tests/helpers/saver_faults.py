"""Faults injected into the HF saver's weight rules, for the tests that show the converter's
verification refuses a wrong mapping (and writes nothing)."""

from typing import Callable

import torch


def break_hf_saver_rule(monkeypatch, saver_hf, ours: str, broken: Callable) -> None:
    """Make the HF saver write our tensor `ours` through broken(rule) (a to_hf function) instead of
    its rule's own to_hf."""
    rules_of = saver_hf.huggingface.weight_rules

    def rules(config):
        table = rules_of(config)
        index = next(i for i, rule in enumerate(table) if rule.ours == ours)
        rule = table[index]
        table[index] = type(rule)(rule.ours, rule.hf, rule.to_ours, broken(rule))
        return table

    monkeypatch.setattr(saver_hf.huggingface, "weight_rules", rules)


def first_query_and_key_heads_swapped(head_dim: int) -> Callable:
    """broken(rule) for a fused QKV rule: its to_hf with the first query head and the first key head exchanged."""

    def broken(rule):
        def to_hf(tensor: torch.Tensor):
            q, k, v = (t.clone() for t in rule.to_hf(tensor))
            q[:head_dim], k[:head_dim] = k[:head_dim].clone(), q[:head_dim].clone()
            return q, k, v

        return to_hf

    return broken
