"""Serve a checkpoint over HTTP: Megatron's `PUT /api` and OpenAI's `POST /v1/completions`.

    torchrun --nproc-per-node 2 tools/run_text_generation_server.py --load CKPT [model flags] \
        --tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ... --tensor-model-parallel-size 2
    python tools/run_text_generation_server.py --load-hf HF_DIR --port 5000

The model is built and loaded as pretraining builds it (initialize_megatron, get_model,
load_checkpoint or the --load-hf weights; no optimizer). Rank 0 serves; before each generation
it broadcasts the request (as JSON bytes) to every rank, and the other ranks wait in a loop for
the next request and run the same generation, so the tensor- and pipeline-parallel collectives
of the engine line up. Bad flags end in one line (megatron.training.cli).
"""

import argparse
import json
import os
import sys
import traceback
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.cli import run_cli  # noqa: E402
from megatron.inference.checkpoint_model import ServerFlagError, build_model, initialize_for_inference  # noqa: E402,F401
from megatron.inference.server import GenerationBackend  # noqa: E402

_STOP, _GENERATE = 0, 1


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="text generation server")
    group.add_argument("--host", default="127.0.0.1",
                       help="Address to bind (Megatron binds every interface; 0.0.0.0 for that).")
    group.add_argument("--port", type=int, default=5000, help="Port to listen on (0: any free port).")
    group.add_argument("--max-body-bytes", type=int, default=1 << 20, help="Largest request body accepted.")
    group.add_argument("--max-prompts", type=int, default=128, help="Most prompts (x n) in one request.")
    group.add_argument("--max-tokens-to-generate", type=int, default=1024,
                       help="Largest tokens_to_generate / max_tokens accepted.")
    group.add_argument("--served-model-name", default="megatron", help="The model name OpenAI answers carry.")
    return parser


def _check_server_flags(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ServerFlagError(f"--port must be between 0 and 65535, got {args.port}")
    for flag in ("max_body_bytes", "max_prompts", "max_tokens_to_generate"):
        if getattr(args, flag) < 1:
            raise ServerFlagError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.load is None and args.load_hf is None:
        raise ServerFlagError("a checkpoint is required: --load CKPT or --load-hf HF_DIR")


class BroadcastBackend(GenerationBackend):
    """Rank 0's backend: hands each request to every rank, then generates with them."""

    def __init__(self, local: Any):
        self.local = local
        self.streams = local.streams

    def generate(self, request: Any, on_step: Any = None) -> Dict[str, Any]:
        _broadcast_message(_GENERATE, request.to_json())
        # The other ranks run the same steps without a hook: only rank 0 writes the stream.
        return self.local.generate(request, on_step=on_step) if on_step is not None else self.local.generate(request)

    def stop_ids(self, request: Any) -> Any:
        return self.local.stop_ids(request)

    def tokenize(self, text: str) -> List[int]:
        return self.local.tokenize(text)

    def detokenize(self, ids: List[int]) -> str:
        return self.local.detokenize(ids)


def _broadcast_message(kind: int, text: str = "") -> None:
    from megatron.core import communication, device

    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return
    payload = torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)
    header = torch.tensor([kind, payload.numel()], dtype=torch.int64, device=device.get_device())
    communication.broadcast(header, 0)  # [kind, n bytes]
    if payload.numel():
        communication.broadcast(payload.to(device.get_device()), 0)  # [n bytes] of JSON


def follow_rank_0(backend: Any) -> None:
    """Ranks above 0: run each request rank 0 broadcasts, until it says stop."""
    from megatron.core import communication, device
    from megatron.inference.server_requests import GenerationRequest

    while True:
        header = torch.zeros(2, dtype=torch.int64, device=device.get_device())
        communication.broadcast(header, 0)
        kind, size = int(header[0]), int(header[1])
        if kind == _STOP:
            return
        payload = torch.zeros(size, dtype=torch.uint8, device=device.get_device())
        communication.broadcast(payload, 0)
        request = GenerationRequest.from_json(bytes(payload.cpu().tolist()).decode("utf-8"))
        try:
            backend.generate(request)
        except ValueError:
            pass  # rank 0 met the same error and answered the client with it
        except Exception:  # noqa: BLE001 - as rank 0 answers 500 and serves on, this rank follows on
            traceback.print_exc(file=sys.stderr)


def _listen(args: argparse.Namespace) -> Any:
    """Rank 0's server, bound (its backend is set once the model is loaded)."""
    from megatron.inference.server import GenerationServer
    from megatron.inference.server_requests import Limits

    limits = Limits(max_body_bytes=args.max_body_bytes, max_prompts=args.max_prompts,
                    max_tokens_to_generate=args.max_tokens_to_generate)
    try:
        return GenerationServer(None, host=args.host, port=args.port, limits=limits,
                                model_name=args.served_model_name)
    except OSError as error:
        raise ServerFlagError(f"--host {args.host} --port {args.port}: cannot listen there: "
                              f"{error.strerror or error}") from None


def main(argv: List[str] = None) -> None:
    from megatron.training.global_vars import get_tokenizer
    from megatron.inference.server import ApiBackend

    args = initialize_for_inference(sys.argv[1:] if argv is None else argv, add_server_args)
    _check_server_flags(args)
    serving = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    server = _listen(args) if serving else None  # before the model loads: a taken port fails at once
    backend = ApiBackend(build_model(args), get_tokenizer())
    if not serving:
        follow_rank_0(backend)
        return
    server.backend = BroadcastBackend(backend)
    print(json.dumps({"serving": f"http://{args.host}:{server.port}", "paths": ["/api", "/v1/completions"]}),
          flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        _broadcast_message(_STOP)


if __name__ == "__main__":
    from megatron.inference.server import EngineUnavailableError

    run_cli(main, "run_text_generation_server.py", errors=(ServerFlagError, EngineUnavailableError),
            interrupted="stopped")
