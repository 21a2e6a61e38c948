"""megatron.inference.beam_search equals HuggingFace transformers' `num_beams` search.

Tiny random GPT-2 and Llama (GQA) models, their output sharpened (embeddings scaled) so that beams
are not near-ties; a stop token chosen among the likely first tokens, so that some hypotheses end
early and others run to the length limit; length penalties 1.0, 0.0 and 2.0. All beam_width
hypotheses and their scores must equal `generate(num_beams=..., num_return_sequences=...)`'s, first
with the HF model's own logits (the algorithm), then with our GPTModel holding the mapped weights.
"""

import pytest
import torch

from megatron.inference.beam_search import beam_search, model_next_logits
from tests.helpers.hf_models import gpt2, llama_family, make_hf, make_ours

BEAMS, NEW = 3, 6
PROMPT = [5, 17, 42, 8, 99]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one intra-op thread


def _sharp(hf):
    with torch.no_grad():
        hf.get_input_embeddings().weight.mul_(8.0)
        out = hf.get_output_embeddings().weight
        if out.data_ptr() != hf.get_input_embeddings().weight.data_ptr():
            out.mul_(8.0)
    return hf


@pytest.fixture(scope="module")
def models():
    return {"gpt2": _sharp(make_hf(gpt2(), seed=3)), "llama": _sharp(make_hf(llama_family("llama"), seed=4))}


def _hf_next_logits(hf):
    @torch.no_grad()
    def next_logits(tokens):
        return hf(tokens).logits[:, -1, :].float()
    return next_logits


STOP_RANK = {"gpt2": 0, "llama": 2}  # chosen so that hypotheses that stopped early are among the best


def _stop_token(hf, name):
    """One of the likely first tokens: some beams take it, and stop, at once."""
    logits = _hf_next_logits(hf)(torch.tensor([PROMPT]))[0]
    return int(torch.topk(logits, 3).indices[STOP_RANK[name]])


def _hf_beams(hf, stop, length_penalty):
    pad = hf.config.vocab_size - 3  # for HF's shorter rows; checked not to be generated
    out = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                      num_beams=BEAMS, num_return_sequences=BEAMS, max_new_tokens=NEW, do_sample=False,
                      length_penalty=length_penalty, early_stopping=False, eos_token_id=stop, pad_token_id=pad,
                      output_scores=True, return_dict_in_generate=True)
    return out.sequences, out.sequences_scores, pad


def _assert_same(result, hf_sequences, hf_scores, pad):
    assert len(result.tokens) == BEAMS
    for ours, theirs in zip(result.tokens, hf_sequences.tolist()):
        assert theirs[:len(ours)] == ours and all(t == pad for t in theirs[len(ours):]), (ours, theirs)
    torch.testing.assert_close(torch.tensor(result.scores), hf_scores.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_search_equals_transformers_num_beams(models, name, length_penalty):
    hf = models[name]
    stop = _stop_token(hf, name)
    sequences, scores, pad = _hf_beams(hf, stop, length_penalty)
    result = beam_search(_hf_next_logits(hf), PROMPT, BEAMS, NEW, stop_token=stop, length_penalty=length_penalty)
    _assert_same(result, sequences, scores, pad)
    if name == "gpt2" or length_penalty == 0.0:  # the stop path is taken: a hypothesis ended early
        assert min(len(t) for t in result.tokens) < len(PROMPT) + NEW and any(t[-1] == stop for t in result.tokens)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_our_model_gives_the_same_beams(models, name):
    hf = models[name]
    ours = make_ours(hf, {})
    stop = _stop_token(hf, name)
    sequences, scores, pad = _hf_beams(hf, stop, 1.0)
    result = beam_search(model_next_logits(ours), PROMPT, BEAMS, NEW, stop_token=stop, length_penalty=1.0,
                         vocab_size=hf.config.vocab_size)
    _assert_same(result, sequences, scores, pad)


def test_without_a_stop_token_every_hypothesis_runs_to_the_limit(models):
    hf = models["gpt2"]
    result = beam_search(_hf_next_logits(hf), PROMPT, BEAMS, NEW)
    assert [len(t) for t in result.tokens] == [len(PROMPT) + NEW] * BEAMS
    assert result.scores == sorted(result.scores, reverse=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"beam_width": 0}, "beam_width must be an integer >= 1"),
    ({"tokens_to_generate": 0}, "tokens_to_generate must be an integer >= 1"),
    ({"prompt": []}, "the prompt is empty"),
])
def test_bad_arguments_are_refused(kwargs, message):
    args = {"prompt": PROMPT, "beam_width": 2, "tokens_to_generate": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        beam_search(lambda tokens: torch.zeros(tokens.shape[0], 8), **args)


def test_a_finished_candidate_outside_the_best_beam_width_is_not_kept(models):
    """Llama, the 4th most likely first token as the stop token, no length penalty: a candidate that
    stops but ranks between beam_width and 2 x beam_width must not become a hypothesis (transformers
    keeps it only as a spare); counting it would change the result."""
    hf = models["llama"]
    logits = _hf_next_logits(hf)(torch.tensor([PROMPT]))[0]
    stop = int(torch.topk(logits, 4).indices[3])
    sequences, scores, pad = _hf_beams(hf, stop, 0.0)
    _assert_same(beam_search(_hf_next_logits(hf), PROMPT, BEAMS, NEW, stop_token=stop, length_penalty=0.0),
                 sequences, scores, pad)
