"""Run a HuggingFace example script written for transformers 4 under transformers 5, unchanged.

    python run_with_transformers5.py SCRIPT [ARGS...]

transformers 5 removed `transformers.utils.send_example_telemetry` (a call home to the Hub that
the examples make once); Accelerate's Megatron-LM example still imports it. This supplies a no-op
under that name, then runs SCRIPT as __main__ with ARGS. Nothing else is touched.
"""

import runpy
import sys

import transformers.utils

if not hasattr(transformers.utils, "send_example_telemetry"):
    transformers.utils.send_example_telemetry = lambda *args, **kwargs: None

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
