"""Pre-flight planner: what a pretrain_gpt.py layout needs per rank (memory, communication, time,
MFU) on a described device, and a search over layouts. docs/planner.md."""

from megatron.planner.model import Layout, ModelShape, PlanError, layout_from_args, shape_from_args
from megatron.planner.plan import Device, Plan, RankPlan, add_device_args, device_from_args, make_plan, search

__all__ = ["Device", "Layout", "ModelShape", "Plan", "PlanError", "RankPlan", "add_device_args",
           "device_from_args", "layout_from_args", "make_plan", "search", "shape_from_args"]
