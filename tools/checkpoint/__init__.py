"""tools/checkpoint/convert.py and its loader_* / saver_* plugins."""
