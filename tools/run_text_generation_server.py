"""Serve a checkpoint over HTTP on the inference engine: Megatron's `PUT /api`, OpenAI's
`POST /v1/completions` and `POST /v1/chat/completions`.

    torchrun --nproc-per-node 2 tools/run_text_generation_server.py --load CKPT [model flags] \
        --tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ... --tensor-model-parallel-size 2
    python tools/run_text_generation_server.py --load-hf HF_DIR --port 5000 \
        --inference-max-requests 32 --inference-dynamic-batching-block-size 16 --enable-chunked-prefill

The model is built and loaded as pretraining builds it (initialize_megatron, get_model,
load_checkpoint or the --load-hf weights; no optimizer). Requests are served together by
megatron/inference/engine.py (in-flight batching over a paged KV cache; the --inference-* flags).
Rank 0 serves; each engine iteration it broadcasts the operations it applied (new requests,
cancellations, /api calls; JSON bytes) and the other ranks apply them and step with it
(server_engine.follow_engine), so the tensor- and pipeline-parallel collectives line up. Bad flags
end in one line (megatron.training.cli).
"""

import argparse
import json
import os
import sys
from typing import Any, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.cli import run_cli  # noqa: E402
from megatron.inference.checkpoint_model import ServerFlagError, build_model, initialize_for_inference  # noqa: E402,F401


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
    group.add_argument("--max-queue", type=int, default=1024,
                       help="Requests waiting for the engine beyond which a new one is answered 429.")
    group.add_argument("--chat-template", default=None,
                       help="The chat template of /v1/chat/completions: chatml, llama2-chat or a Jinja file "
                            "(default: the HF tokenizer folder's chat_template, if any).")
    return parser


def _check_server_flags(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ServerFlagError(f"--port must be between 0 and 65535, got {args.port}")
    for flag in ("max_body_bytes", "max_prompts", "max_tokens_to_generate", "max_queue", "inference_max_requests",
                 "inference_max_seq_length", "inference_dynamic_batching_block_size"):
        if getattr(args, flag) < 1:
            raise ServerFlagError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.load is None and args.load_hf is None:
        raise ServerFlagError("a checkpoint is required: --load CKPT or --load-hf HF_DIR")


def engine_config(args: argparse.Namespace) -> Any:
    """The engine's settings from Megatron-LM's --inference-* flags."""
    from megatron.inference.engine import EngineConfig

    for flag in ("inference_dynamic_batching_max_requests", "inference_dynamic_batching_max_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ServerFlagError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not args.inference_dynamic_batching_buffer_size_gb > 0:
        raise ServerFlagError("--inference-dynamic-batching-buffer-size-gb must be positive, got "
                              f"{args.inference_dynamic_batching_buffer_size_gb}")
    max_requests = args.inference_dynamic_batching_max_requests or args.inference_max_requests
    max_tokens = args.inference_dynamic_batching_max_tokens
    if max_tokens is not None and max_tokens < max_requests:
        raise ServerFlagError(f"--inference-dynamic-batching-max-tokens ({max_tokens}) must be at least the "
                              f"maximum number of requests ({max_requests})")
    return EngineConfig(block_size=args.inference_dynamic_batching_block_size,
                        buffer_size_gb=args.inference_dynamic_batching_buffer_size_gb, max_requests=max_requests,
                        max_tokens=max_tokens, max_sequence_length=args.inference_max_seq_length,
                        chunked_prefill=args.enable_chunked_prefill,
                        prefix_caching=args.inference_dynamic_batching_enable_prefix_caching,
                        eviction_policy=args.inference_dynamic_batching_prefix_caching_eviction_policy)


def _tokenizer_dir(args: argparse.Namespace) -> Any:
    model = getattr(args, "tokenizer_model", None)
    return model if model and os.path.isdir(model) else None


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
    from megatron.inference.engine import DynamicEngine
    from megatron.inference.server import ApiBackend
    from megatron.inference.server_chat import load_chat_template
    from megatron.inference.server_engine import EngineBackend, follow_engine, json_broadcaster

    args = initialize_for_inference(sys.argv[1:] if argv is None else argv, add_server_args)
    _check_server_flags(args)
    config = engine_config(args)
    try:
        template = load_chat_template(args.chat_template, _tokenizer_dir(args))
    except ValueError as error:
        raise ServerFlagError(str(error)) from None
    serving = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    server = _listen(args) if serving else None  # before the model loads: a taken port fails at once
    model, tokenizer = build_model(args), get_tokenizer()
    try:
        engine = DynamicEngine(model, config)
    except ValueError as error:
        raise ServerFlagError(str(error)) from None
    many = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    send, receive = json_broadcaster() if many else (None, None)
    if not serving:
        follow_engine(engine, ApiBackend(model, tokenizer), receive)
        return
    backend = EngineBackend(engine, tokenizer, broadcast=send, max_queue=args.max_queue)
    server.backend, server.chat_template = backend, template
    print(json.dumps({"serving": f"http://{args.host}:{server.port}",
                      "paths": ["/api", "/v1/completions", "/v1/chat/completions"],
                      "kv_blocks": engine.pool.num_blocks, "block_size": config.block_size}), flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        backend.stop()  # the other ranks leave with it


if __name__ == "__main__":
    from megatron.inference.server import EngineUnavailableError

    run_cli(main, "run_text_generation_server.py", errors=(ServerFlagError, EngineUnavailableError),
            interrupted="stopped")
