"""Collecting training data: Wikipedia extraction, cleanup, deduplication, decontamination.

Each stage is a script of its own (`python tools/data_collection/<stage>.py --help`), reads and
writes loose JSON (one document a line), streams its input, runs its work on --workers
processes, writes every output under a temporary name renamed when complete, and stops on bad
input with one line `FILE:LINE: reason`. docs/datasets.md describes the chain.
"""
