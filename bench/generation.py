"""Generation speed: batched greedy decoding with the KV cache, without it, and HF transformers' generate.

    python bench/generation.py                          # batch 1 and 8, prompt 128, 128 new tokens, fp32 and bf16
    python bench/generation.py --batch-sizes 8 --dtypes fp32 --no-uncached --json

One GPT-2-style model (random weights, seeded: GPT2LMHeadModel of --hidden-size / --num-layers /
--num-attention-heads with GPT-2's vocabulary) is mapped into our GPTModel (megatron/convert/huggingface.py),
so both sides hold the same weights. For each dtype and batch size, on the same random prompts:

* ours, cached: megatron.inference.generation.generate_tokens(top_k=1) (the KV cache);
* ours, uncached: the same with use_cache=False (the whole prefix recomputed each step);
* HF: model.generate(do_sample=False, use_cache=True) with its default dynamic cache.

Printed per case: generated tokens per second (batch x new tokens / seconds, the median of --repeats
runs after one warm-up; ours and HF's alternate, run by run), the time to the first token (a run with one new token: the prefill), and
whether our greedy tokens equal HF's (they should in fp32; in bf16 rounding may flip a near-tie).
The ratio ours / HF is quoted in docs/PERFORMANCE.md. Compare figures within one run only. On a CPU
without a fast bf16 path (bench/peak.py's slow_bf16_reason) bf16 is skipped, the reason printed;
--allow-slow-bf16 runs it anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_models(hidden: int, layers: int, heads: int, vocab: int, positions: int, seed: int = 0):
    """(HF GPT2LMHeadModel, our GPTModel with the same weights), both eval, fp32."""
    import transformers

    from megatron.convert.huggingface import config_from_hf, state_dict_from_hf
    from megatron.model import GPTModel, TransformerConfig

    config = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers,
                                     n_head=heads, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    torch.manual_seed(seed)
    hf = transformers.GPT2LMHeadModel(config).eval()
    config_kwargs, model_kwargs = config_from_hf(hf.config, seq_length=positions)
    ours = GPTModel(TransformerConfig(**config_kwargs), **model_kwargs).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), hf.config))
    return hf, ours


def _median_seconds(runs: Dict[str, Callable[[], object]], repeats: int) -> Dict[str, float]:
    """The median wall time of each run, over `repeats` rounds after one warm-up round; the runs
    alternate within a round, so a load that comes and goes on a shared machine slows both sides
    of a ratio alike."""
    for run in runs.values():
        run()  # warm-up
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def bench_case(hf, ours, batch: int, prompt: int, new: int, repeats: int, uncached: bool) -> Dict[str, float]:
    from megatron.inference.generation import generate_tokens

    generator = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, hf.config.vocab_size, (batch, prompt), generator=generator)
    lengths = torch.full((batch,), prompt, dtype=torch.long)
    mask = torch.ones_like(tokens)

    def ours_run(n: int, cache: bool = True):
        return generate_tokens(ours, tokens, lengths, n, top_k=1, use_cache=cache).tokens

    @torch.no_grad()
    def hf_run(n: int):
        return hf.generate(tokens, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           num_beams=1, use_cache=True, pad_token_id=0)

    result: Dict[str, float] = {}
    result["same_tokens"] = float(torch.equal(ours_run(new)[:, :prompt + new], hf_run(new)[:, :prompt + new]))
    decode = _median_seconds({"ours": lambda: ours_run(new), "hf": lambda: hf_run(new)}, repeats)
    for name, seconds in decode.items():
        result[f"{name}_tokens_per_s"] = batch * new / seconds
    if uncached:
        result["ours_uncached_tokens_per_s"] = batch * new / _median_seconds(
            {"uncached": lambda: ours_run(new, False)}, 1)["uncached"]
    first = _median_seconds({"ours": lambda: ours_run(1), "hf": lambda: hf_run(1)}, repeats)
    result["ours_first_token_s"], result["hf_first_token_s"] = first["ours"], first["hf"]
    return result


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=str, default="1,8")
    parser.add_argument("--dtypes", type=str, default="fp32,bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-uncached", action="store_false", dest="uncached",
                        help="Skip the uncached runs (they recompute the prefix: slow).")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--allow-slow-bf16", action="store_true",
                        help="run bf16 even on a CPU without a fast bf16 path (about 100x slower than fp32)")
    options = parser.parse_args(argv)
    from bench.peak import drop_slow_bf16

    dtypes, skipped = drop_slow_bf16(options.dtypes.split(","), options.allow_slow_bf16)
    if skipped:
        print(skipped, file=sys.stderr if options.json else sys.stdout, flush=True)
    if not dtypes:
        return
    positions = options.prompt_length + options.new_tokens
    hf32, ours32 = build_models(options.hidden_size, options.num_layers, options.num_attention_heads,
                                options.vocab_size, positions)
    results = {}
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        hf, ours = hf32.to(dtype), ours32.to(dtype)
        for batch in (int(b) for b in options.batch_sizes.split(",")):
            key = f"{dtype_name} batch {batch}"
            results[key] = bench_case(hf, ours, batch, options.prompt_length, options.new_tokens, options.repeats,
                                      options.uncached)
            if not options.json:
                r = results[key]
                uncached = (f", uncached {r['ours_uncached_tokens_per_s']:.1f}" if "ours_uncached_tokens_per_s" in r
                            else "")
                print(f"{key}: ours {r['ours_tokens_per_s']:.1f} tokens/s{uncached}, HF {r['hf_tokens_per_s']:.1f} "
                      f"-> {r['ours_tokens_per_s'] / r['hf_tokens_per_s']:.2f}x; first token ours "
                      f"{r['ours_first_token_s'] * 1e3:.0f} ms, HF {r['hf_first_token_s'] * 1e3:.0f} ms; "
                      f"same greedy tokens: {'yes' if r['same_tokens'] else 'no'}", flush=True)
        hf32, ours32 = hf.float(), ours.float()
    if options.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
