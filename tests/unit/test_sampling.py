"""megatron.inference.sampling: greedy, temperature, top-k and top-p as Megatron-LM defines them.

The statistical tests draw many tokens from a toy vocabulary and check (1) that nothing outside the
allowed set is ever drawn and (2) that the frequencies fit the renormalised distribution: Pearson's
chi-square with its p-value from the regularised upper incomplete gamma function (p > 1e-4, so a
correct sampler fails about once in ten thousand runs; the seeds are fixed, so a run is repeatable).
"""

import math

import pytest
import torch

from megatron.inference.sampling import check_sampling, greedy, next_top_p, sample

# a toy distribution over 8 ids, most likely first: 0.30 0.20 0.15 0.12 0.10 0.07 0.04 0.02
PROBS = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
DRAWS = 20000


def _counts(top_k=0, top_p=0.0, temperature=1.0, vocab_size=None, seed=0, logits=None):
    logits = (PROBS.log() if logits is None else logits).expand(DRAWS, -1).contiguous()
    tokens = sample(logits, top_k=top_k, top_p=top_p, temperature=temperature, vocab_size=vocab_size,
                    generator=torch.Generator().manual_seed(seed))
    assert tokens.shape == (DRAWS,) and tokens.dtype == torch.int64
    return torch.bincount(tokens, minlength=logits.shape[-1]).double()


def _chi_square_p(counts, expected_probs):
    """p-value of Pearson's chi-square of counts against expected_probs (cells with p > 0)."""
    keep = expected_probs > 0
    expected = expected_probs[keep].double() * counts.sum()
    statistic = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2).item()


def _renormalised(mask):
    p = torch.where(mask, PROBS, torch.zeros_like(PROBS))
    return p / p.sum()


def test_greedy_is_top_k_1_and_ignores_padding_ids():
    logits = torch.tensor([[0.1, 2.0, 0.3, 9.0], [5.0, 1.0, 0.0, 0.0]])
    assert sample(logits, top_k=1).tolist() == [3, 0]
    assert sample(logits, top_k=1, vocab_size=3).tolist() == [1, 0]  # id 3 is a padding row
    assert greedy(logits, vocab_size=3).tolist() == [1, 0]


def test_plain_sampling_follows_the_softmax():
    counts = _counts()
    assert _chi_square_p(counts, PROBS) > 1e-4


def test_temperature_sharpens_the_distribution_as_softmax_of_logits_over_t():
    counts = _counts(temperature=0.5)
    expected = torch.softmax(PROBS.log() / 0.5, dim=-1)
    assert _chi_square_p(counts, expected) > 1e-4
    assert _chi_square_p(counts, PROBS) < 1e-6  # and it is not the untempered one


@pytest.mark.parametrize("top_k", [2, 3, 5])
def test_top_k_never_leaves_the_k_most_likely_and_fits_their_renormalised_probabilities(top_k):
    counts = _counts(top_k=top_k)
    allowed = torch.arange(8) < top_k
    assert counts[~allowed].sum() == 0
    assert _chi_square_p(counts, _renormalised(allowed)) > 1e-4


@pytest.mark.parametrize("top_p, nucleus", [(0.25, 1), (0.5, 2), (0.6, 3), (0.65, 3), (0.9, 6)])
def test_top_p_keeps_the_smallest_set_reaching_p_and_fits_it(top_p, nucleus):
    # cumulative: 0.30 0.50 0.65 0.77 0.87 0.94 0.98 1.00; the token crossing top_p is kept
    counts = _counts(top_p=top_p)
    allowed = torch.arange(8) < nucleus
    assert counts[~allowed].sum() == 0
    if nucleus > 1:
        assert _chi_square_p(counts, _renormalised(allowed)) > 1e-4
    else:
        assert counts[0] == DRAWS


def test_padding_ids_are_never_drawn():
    logits = torch.cat([PROBS.log(), torch.full((4,), 10.0)])  # 4 padding rows with the largest logits
    counts = _counts(logits=logits, vocab_size=8)
    assert counts[8:].sum() == 0 and _chi_square_p(counts[:8], PROBS) > 1e-4


def test_a_seed_reproduces_the_draws_and_another_seed_does_not():
    logits = PROBS.log().expand(64, -1).contiguous()

    def draw(seed, **kw):
        return sample(logits, generator=torch.Generator().manual_seed(seed), **kw)

    for kw in ({}, {"top_k": 4}, {"top_p": 0.9}, {"temperature": 0.7}):
        assert torch.equal(draw(1, **kw), draw(1, **kw)), kw
    assert not torch.equal(draw(1), draw(2))


def test_top_p_decays_after_each_token_down_to_its_bound():
    assert next_top_p(0.9, 0.5, 0.2) == pytest.approx(0.45)
    assert next_top_p(0.3, 0.5, 0.2) == pytest.approx(0.2)  # not below the bound
    assert next_top_p(0.3, 0.5) == pytest.approx(0.15)  # no bound
    assert next_top_p(0.9) == 0.9 and next_top_p(0.0, 0.5, 0.2) == 0.0  # no decay, or no top-p


@pytest.mark.parametrize("kwargs, message", [
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0"),
    ({"top_p": 1.5}, r"top_p must be a number in \[0, 1\]"),
    ({"top_k": 2, "top_p": 0.5}, "cannot both be set"),
    ({"temperature": 0.0}, "temperature must be a number > 0"),
    ({"top_k": 9, "vocab_size": 8}, r"top_k \(9\) is larger than the vocabulary \(8\)"),
])
def test_bad_parameters_name_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_sampling(**kwargs)
    with pytest.raises(ValueError, match=message):
        sample(PROBS.log().expand(2, -1), **{"vocab_size": 8, **kwargs})


def test_chi_square_p_value_matches_known_critical_values():
    # chi-square critical values at p = 0.05: dof 1 -> 3.841, dof 4 -> 9.488
    for dof, critical in ((1, 3.841), (4, 9.488)):
        p = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                    torch.tensor(critical / 2, dtype=torch.float64)).item()
        assert math.isclose(p, 0.05, abs_tol=2e-4)
