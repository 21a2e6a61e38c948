"""Text generation (megatron/inference): greedy decoding equals HuggingFace's generate token for
token, with the key/value cache and without, for a batch of prompts of different lengths.

The tiny random models of test_hf_equivalence (tests/helpers/hf_models.py; GPT-2: learned positions,
tied output; Llama: RoPE, grouped-query attention) mapped into ours. HF runs each prompt alone (no
padding) up to the batch's common final length, max prompt + tokens_to_generate, as Megatron's loop
extends every row.
"""

from __future__ import annotations

import pytest
import torch

from megatron.inference.context import InferenceContext
from megatron.inference.generation import generate_tokens

from tests.helpers.hf_models import FUSED, UNFUSED, VOCAB, gpt2, llama_family, make_hf, make_ours

transformers = pytest.importorskip("transformers")

LENGTHS = (5, 9, 7)
NEW = 8
MODELS = {"gpt2": gpt2, "llama-gqa": lambda: llama_family("llama")}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one intra-op thread


@pytest.fixture(scope="module", params=list(MODELS))
def hf(request):
    return make_hf(MODELS[request.param]())


def prompts(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (len(LENGTHS), max(LENGTHS)), generator=generator), torch.tensor(LENGTHS)


def hf_greedy(hf, prompt: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's greedy continuation of one prompt [n] to `total` tokens, and the log-prob of each new token."""
    new = total - prompt.numel()
    out = hf.generate(prompt[None], do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    log_probs = torch.stack(out.logits, dim=1)[0].log_softmax(-1)  # [new, v]
    generated = out.sequences[0, prompt.numel():]
    return out.sequences[0], log_probs.gather(1, generated[:, None])[:, 0]


@pytest.mark.parametrize("flags", [FUSED, UNFUSED], ids=["fused", "unfused"])
def test_greedy_matches_hf_generate(hf, flags):
    ours = make_ours(hf, flags)
    tokens, lengths = prompts()
    out = generate_tokens(ours, tokens, lengths, NEW, top_k=1, return_output_log_probs=True)
    total = max(LENGTHS) + NEW
    assert out.tokens.shape == (len(LENGTHS), total)
    assert out.output_log_probs.shape == (len(LENGTHS), total - 1)
    assert out.lengths.tolist() == [total] * len(LENGTHS)
    for row, n in enumerate(LENGTHS):
        expected, expected_log_probs = hf_greedy(hf, tokens[row, :n], total)
        assert out.tokens[row].tolist() == expected.tolist(), row
        # output_log_probs[t] scores token t + 1: the generated ones start at column n - 1.
        torch.testing.assert_close(out.output_log_probs[row, n - 1:], expected_log_probs, rtol=0, atol=1e-4)


def test_cached_equals_uncached_and_prompt_log_probs_match_a_full_forward(hf):
    ours = make_ours(hf, FUSED)
    tokens, lengths = prompts(seed=5)
    cached = generate_tokens(ours, tokens, lengths, NEW, top_k=1, return_output_log_probs=True)
    uncached = generate_tokens(ours, tokens, lengths, NEW, top_k=1, return_output_log_probs=True, use_cache=False)
    assert torch.equal(cached.tokens, uncached.tokens)
    torch.testing.assert_close(cached.output_log_probs, uncached.output_log_probs, rtol=0, atol=1e-5)
    # Every column, prompt tokens included, is the log-prob a single forward of the final tokens gives.
    full = cached.tokens
    with torch.no_grad():
        logits = ours(full, torch.arange(full.shape[1]).expand_as(full)).log_softmax(-1)  # [b, L, v]
    expected = logits[:, :-1].gather(2, full[:, 1:, None])[..., 0]
    torch.testing.assert_close(cached.output_log_probs, expected, rtol=0, atol=1e-4)


def test_kv_cache_steps_equal_a_full_forward(hf):
    """Prefill of 6 tokens then 1-token steps: each step's logits equal the full forward's at that position."""
    ours = make_ours(hf, UNFUSED)
    tokens = prompts()[0][:, :9]
    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    with torch.no_grad():
        full = ours(tokens, positions)  # [b, s, v]
        context = InferenceContext(b, s)
        pieces = [ours(tokens[:, :6], positions[:, :6], inference_context=context)]
        context.increment(6)
        for t in range(6, s):
            pieces.append(ours(tokens[:, t:t + 1], positions[:, t:t + 1], inference_context=context))
            context.increment(1)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)
    assert len(context.key_value_memory_dict) == hf.config.num_hidden_layers
    key, _ = context.key_value_memory_dict[1]
    assert key.shape == (b, hf.config.num_key_value_heads if hasattr(hf.config, "num_key_value_heads")
                         else hf.config.n_head, ours.config.kv_channels, s)  # K^T [max_b, ng, hn, max_s]


@pytest.mark.parametrize("position", ["alibi", "learned_absolute"])
def test_kv_cache_steps_with_alibi_and_a_mask_free_decode(position):
    """ALiBi's bias for queries at the offset, and a model of our own (no HF counterpart)."""
    from megatron.model import GPTModel, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1)
    model = GPTModel(config, vocab_size=64, max_sequence_length=16, position_embedding_type=position).eval()
    tokens = torch.randint(0, 64, (2, 10))
    positions = torch.arange(10).expand(2, 10)
    with torch.no_grad():
        full = model(tokens, positions)
        context = InferenceContext(2, 10)
        pieces = [model(tokens[:, :4], positions[:, :4], inference_context=context)]
        context.increment(4)
        for t in range(4, 10):
            pieces.append(model(tokens[:, t:t + 1], positions[:, t:t + 1], inference_context=context))
            context.increment(1)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


def _own_model(position: str = "learned_absolute", dtype: torch.dtype = torch.float32):
    from megatron.model import GPTModel, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1)
    return GPTModel(config, vocab_size=64, max_sequence_length=16, position_embedding_type=position).eval().to(dtype)


def test_only_the_last_position_gets_logits_when_asked():
    """materialize_only_last_token_logits: the output layer runs on the last position alone (its
    input has one position), and those logits are the full forward's last ones; generate_tokens
    asks for it unless it returns log-probs."""
    model = _own_model()
    seen = []
    model.output_layer.register_forward_hook(lambda module, args, kwargs=None: seen.append(args[0].shape[0]))
    tokens = torch.randint(0, 64, (2, 7))
    positions = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        full = model(tokens, positions)
        last = model(tokens, positions, inference_context=InferenceContext(2, 7, materialize_only_last_token_logits=True))
    assert last.shape == (2, 1, 64) and seen == [7, 1]
    torch.testing.assert_close(last, full[:, -1:], rtol=0, atol=1e-6)
    seen.clear()
    generate_tokens(model, tokens[:, :5], torch.tensor([5, 5]), 2, top_k=1)
    assert seen == [1, 1]  # prefill of 5 positions, then one step: one position's logits each
    seen.clear()
    generate_tokens(model, tokens[:, :5], torch.tensor([5, 5]), 2, top_k=1, return_output_log_probs=True)
    assert seen == [5, 1]


@pytest.mark.parametrize("position", ["alibi", "learned_absolute"])
def test_half_precision_decode_over_the_whole_buffer_equals_the_prefix(position, monkeypatch):
    """In bf16, once the cache is half full, a one-token step attends over the whole (zeroed) buffer
    with its tail masked out (InferenceContext.key_length); its logits equal those of the same steps
    over the cached prefix alone, with ALiBi's bias and with a mask passed in."""
    model = _own_model(position, torch.bfloat16)
    tokens = torch.randint(0, 64, (2, 12))
    positions = torch.arange(12).expand(2, 12)

    def decode(user_mask: bool):
        context = InferenceContext(2, 12)
        with torch.no_grad():
            model(tokens[:, :4], positions[:, :4], inference_context=context)
            context.increment(4)
            steps, lengths = [], []
            for t in range(4, 12):
                lengths.append(context.key_length(1))
                mask = torch.zeros(1, 1, 1, t + 1, dtype=torch.bool) if user_mask else None
                steps.append(model(tokens[:, t:t + 1], positions[:, t:t + 1], attention_mask=mask,
                                   inference_context=context).float())
                context.increment(1)
        return torch.cat(steps, dim=1), lengths

    for user_mask in (False, True):
        whole, lengths = decode(user_mask)
        assert lengths == [5, 12, 12, 12, 12, 12, 12, 12]  # from offset + 1 >= 12 / 2 on: the whole buffer
        with monkeypatch.context() as patch:
            patch.setattr(InferenceContext, "key_length", lambda self, s: self.sequence_len_offset + s)
            prefix, lengths = decode(user_mask)
        assert lengths == list(range(5, 13))
        torch.testing.assert_close(whole, prefix, rtol=0, atol=2e-2)
    fp32 = InferenceContext(1, 4)
    fp32.append_key_value(1, torch.zeros(2, 1, 1, 8), torch.zeros(2, 1, 1, 8))
    fp32.increment(2)
    assert fp32.key_length(1) == 3  # fp32's batched matmul reads a strided prefix in place


def test_no_grad_forward_skips_the_graph_and_equals_the_grad_forward():
    """apply_function: under no_grad the autograd Functions' forwards run directly; same logits."""
    model = _own_model()
    tokens = torch.randint(0, 64, (2, 7))
    positions = torch.arange(7).expand(2, 7)
    with_graph = model(tokens, positions)
    with torch.no_grad():
        without = model(tokens, positions)
    assert with_graph.requires_grad and not without.requires_grad
    assert torch.equal(with_graph.detach(), without)


def test_refuses_more_tokens_than_learned_positions():
    ours = make_ours(make_hf(gpt2()), FUSED)  # n_positions 64
    tokens, lengths = prompts()
    with pytest.raises(ValueError, match="learned positions"):
        generate_tokens(ours, tokens, lengths, 64 - max(LENGTHS) + 1, top_k=1)
    with pytest.raises(ValueError, match="tokens_to_generate"):
        generate_tokens(ours, tokens, lengths, -1, top_k=1)


def test_stops_when_every_row_produced_the_stop_token(hf):
    ours = make_ours(hf, FUSED)
    tokens, lengths = prompts()
    free = generate_tokens(ours, tokens, lengths, NEW, top_k=1)
    # The stop token: what row 0 generates at its third step (position n + 2); row 0 ends there.
    stop = int(free.tokens[0, LENGTHS[0] + 2])
    out = generate_tokens(ours, tokens, lengths, NEW, top_k=1, stop_token=stop)
    first_stop = [next((t for t in range(n, free.tokens.shape[1]) if free.tokens[row, t] == stop), None)
                  for row, n in enumerate(LENGTHS)]
    ends = [t + 1 if t is not None else free.tokens.shape[1] for t in first_stop]
    assert out.lengths.tolist() == ends
    assert out.tokens.shape[1] == max(ends)
    assert torch.equal(out.tokens, free.tokens[:, :max(ends)])
    # stop_early=False (Megatron's use_eod_token_for_early_termination=False): every step runs, same lengths
    late = generate_tokens(ours, tokens, lengths, NEW, top_k=1, stop_token=stop, stop_early=False)
    assert late.lengths.tolist() == ends and torch.equal(late.tokens, free.tokens)
    # Megatron's stop_on_eol: the newline token ends a row instead of the termination token.
    eol = generate_tokens(ours, tokens, lengths, NEW, top_k=1, stop_on_eol=True, newline_token=stop, eod=-1)
    assert eol.lengths.tolist() == ends


def test_prevent_newline_after_colon_and_seeded_sampling(hf):
    ours = make_ours(hf, FUSED)
    tokens, lengths = prompts()
    greedy = generate_tokens(ours, tokens, lengths, NEW, top_k=1)
    # Call the token row 0 generates first "newline" and its prompt's last token "colon": it is now forbidden.
    colon, newline = int(tokens[0, LENGTHS[0] - 1]), int(greedy.tokens[0, LENGTHS[0]])
    out = generate_tokens(ours, tokens, lengths, NEW, top_k=1, prevent_newline_after_colon=True,
                          colon_token=colon, newline_token=newline)
    assert out.tokens[0, LENGTHS[0]] != newline
    after_colon = (out.tokens[:, :-1] == colon) & (out.tokens[:, 1:] == newline)
    generated = torch.arange(out.tokens.shape[1] - 1)[None] >= (lengths[:, None] - 1)
    assert not (after_colon & generated).any()

    a = generate_tokens(ours, tokens, lengths, NEW, top_k=5, temperature=0.8, random_seed=7)
    b = generate_tokens(ours, tokens, lengths, NEW, top_k=5, temperature=0.8, random_seed=7)
    c = generate_tokens(ours, tokens, lengths, NEW, top_k=5, temperature=0.8, random_seed=8)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    for row, n in enumerate(LENGTHS):  # prompts are kept
        assert torch.equal(a.tokens[row, :n], tokens[row, :n])


def test_api_generate_and_score_give_megatrons_response():
    from megatron.inference.api import generate, score
    from megatron.training.tokenizer.null_tokenizer import NullTokenizer

    hf = make_hf(gpt2())
    ours = make_ours(hf, FUSED)
    tokenizer = NullTokenizer(VOCAB - 1)  # ids 0 .. 126, eod 127 (GPT-2's eos here)
    prompts_text = ["3 1 4 1 5", "9 2 6 5 3 5 8 9", "7 9"]
    response = generate(ours, tokenizer, prompts_text, tokens_to_generate=6, top_k=1, logprobs=True, add_BOS=True)
    assert set(response) == {"text", "segments", "logprobs", "tokens"}
    ids = [[tokenizer.eod] + [int(x) for x in p.split()] for p in prompts_text]
    width = max(map(len, ids))
    padded = torch.tensor([row + [tokenizer.eod] * (width - len(row)) for row in ids])
    out = generate_tokens(ours, padded, torch.tensor(list(map(len, ids))), 6, top_k=1, eod=tokenizer.eod,
                          return_output_log_probs=True)
    for row, ids_row in enumerate(ids):
        n = int(out.lengths[row])
        assert response["tokens"][row] == out.tokens[row, :n].tolist()
        assert response["tokens"][row][:len(ids_row)] == ids_row
        assert response["text"][row] == " ".join(map(str, response["tokens"][row]))
        assert response["segments"][row] == [str(t) for t in response["tokens"][row]]
        assert response["logprobs"][row] == pytest.approx(out.output_log_probs[row, :n - 1].tolist(), abs=1e-6)

    scored = score(ours, tokenizer, prompts_text, return_logits=True)
    with torch.no_grad():
        row = torch.tensor([[3, 1, 4, 1, 5]])
        expected = hf(row).logits.log_softmax(-1)[0, :-1].gather(1, row[0, 1:, None])[:, 0]
    assert scored["tokens"][0] == [3, 1, 4, 1, 5]
    assert scored["logprobs"][0] == pytest.approx(expected.tolist(), abs=1e-4)
    assert [len(lp) for lp in scored["logprobs"]] == [4, 7, 1]
    assert scored["logits"][2].shape == (2, VOCAB)
    assert generate(ours, tokenizer, prompts_text, tokens_to_generate=0)["logprobs"] == scored["logprobs"]


def test_beam_search_with_the_kv_cache_equals_the_recomputed_one(hf, monkeypatch):
    from megatron.inference import generation
    from megatron.inference.beam_search import beam_search, model_next_logits
    from megatron.inference.generation import cached_next_logits

    prefills = []

    class CountingContext(InferenceContext):
        def __init__(self, *args, **kwargs):
            prefills.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(generation, "InferenceContext", CountingContext)
    ours = make_ours(hf, FUSED)
    prompt = prompts()[0][1, :6].tolist()
    calls = []
    cached = cached_next_logits(ours, len(prompt) + NEW)

    def counting(tokens):
        calls.append(tokens.shape)
        return cached(tokens)

    expected = beam_search(model_next_logits(ours), prompt, 3, NEW, length_penalty=1.0, vocab_size=VOCAB)
    result = beam_search(counting, prompt, 3, NEW, length_penalty=1.0, vocab_size=VOCAB)
    assert result.tokens == expected.tokens
    assert result.scores == pytest.approx(expected.scores, abs=1e-4)
    assert len(calls) > 2 and len(prefills) == 1  # one prefill, then the reordered cache every step


def test_api_beam_search_gives_the_best_hypotheses_as_text():
    from megatron.inference import api
    from megatron.inference.beam_search import beam_search, model_next_logits
    from megatron.training.tokenizer.null_tokenizer import NullTokenizer

    ours = make_ours(make_hf(gpt2()), FUSED)
    tokenizer = NullTokenizer(VOCAB - 1)
    response = api.beam_search(ours, tokenizer, ["3 1 4 1 5"], 6, 3, num_return_gen=2, length_penalty=0.5)
    expected = beam_search(model_next_logits(ours), [3, 1, 4, 1, 5], 3, 6, stop_token=tokenizer.eod,
                           length_penalty=0.5, vocab_size=VOCAB)
    assert response["text"] == [" ".join(map(str, row)) for row in expected.tokens[:2]]
    assert response["segments"][0] == [str(token) for token in expected.tokens[0]]
    assert response["scores"] == pytest.approx(expected.scores[:2], abs=1e-4)
    with pytest.raises(ValueError, match="one prompt"):
        api.beam_search(ours, tokenizer, ["1", "2"], 4, 2)


def test_on_step_sees_each_steps_tokens_as_they_are_chosen(hf):
    ours = make_ours(hf, FUSED)
    tokens, lengths = prompts()
    seen = []
    out = generate_tokens(ours, tokens, lengths, NEW, top_k=1, eod=None,
                          on_step=lambda step, new: seen.append((step, new.clone())))
    assert [step for step, _ in seen] == list(range(int(lengths.min()), int(lengths.max()) + NEW))
    for step, new in seen:  # rows past their prompt keep the token chosen at that step
        started = lengths <= step
        assert torch.equal(out.tokens[started, step], new[started])


def test_server_stream_equals_the_whole_greedy_answer():
    import http.client
    import json

    from megatron.inference.server import ApiBackend, GenerationServer
    from megatron.training.tokenizer.null_tokenizer import NullTokenizer

    ours = make_ours(make_hf(gpt2()), FUSED)
    server = GenerationServer(ApiBackend(ours, NullTokenizer(VOCAB - 1)), port=0, log_requests=False).start()
    try:
        def post(body):
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            connection.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
            text = connection.getresponse().read().decode()
            connection.close()
            return text

        request = {"prompt": ["3 1 4 1 5", "9 2"], "max_tokens": 7, "temperature": 0, "stop": [" 1 "]}
        whole = json.loads(post(request))["choices"]
        events = [json.loads(line[6:])["choices"][0] for line in post({**request, "stream": True}).split("\n\n")
                  if line and line != "data: [DONE]"]
        for index in (0, 1):
            pieces = [event["text"] for event in events if event["index"] == index and event["text"]]
            assert len(pieces) > 1  # token by token, not one final chunk
            assert "".join(pieces) == whole[index]["text"]
            assert [e["finish_reason"] for e in events if e["index"] == index][-1] == whole[index]["finish_reason"]
    finally:
        server.stop()


def test_top_logprobs_are_the_models_most_likely_next_tokens():
    """generate_tokens(top_logprobs=k) and /v1/completions' logprobs=k: for every generated token the k
    most likely tokens and their log-probs, equal to a direct forward over the final tokens."""
    import http.client
    import json

    from megatron.inference.server import ApiBackend, GenerationServer
    from megatron.training.tokenizer.null_tokenizer import NullTokenizer

    ours = make_ours(make_hf(gpt2()), FUSED)
    tokens, lengths = prompts()
    out = generate_tokens(ours, tokens, lengths, NEW, top_k=1, top_logprobs=3)
    values, ids = out.top_log_probs
    with torch.no_grad():
        full = ours(out.tokens, torch.arange(out.tokens.shape[1]).expand_as(out.tokens)).log_softmax(-1)
    for row, n in enumerate(LENGTHS):
        expected = full[row, n - 1:-1].topk(3, dim=-1)  # the columns that decided this row's new tokens
        torch.testing.assert_close(values[row, n - 1:], expected.values, rtol=0, atol=1e-5)
        assert torch.equal(ids[row, n - 1:, 0], out.tokens[row, n:])  # greedy: the top one is the token chosen
    assert bool((ids[:, :min(LENGTHS) - 1] == -1).all())  # prompt columns decided nothing

    server = GenerationServer(ApiBackend(ours, NullTokenizer(VOCAB - 1)), port=0, log_requests=False).start()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = {"prompt": "3 1 4 1 5", "max_tokens": 4, "temperature": 0, "logprobs": 2}
        connection.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                           headers={"Content-Type": "application/json"})
        choice = json.loads(connection.getresponse().read())["choices"][0]
        connection.close()
    finally:
        server.stop()
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    answer = generate_tokens(ours, prompt, torch.tensor([5]), 4, top_k=1).tokens
    with torch.no_grad():
        direct = ours(answer, torch.arange(9)[None]).log_softmax(-1)[0, 4:8].topk(2, dim=-1)
    top = choice["logprobs"]["top_logprobs"]
    assert len(top) == 4
    for position, alternatives in enumerate(top):
        expected = {str(int(i)): float(v) for i, v in zip(direct.indices[position], direct.values[position])}
        assert alternatives.keys() == expected.keys()
        for text, value in alternatives.items():
            assert abs(value - expected[text]) < 1e-4
        assert max(alternatives.values()) == pytest.approx(choice["logprobs"]["token_logprobs"][position], abs=1e-4)
