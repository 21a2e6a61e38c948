"""Packed SFT samples (megatron/data/sft_dataset.pack, megatron/model/packed_seq.py): each conversation
of a packed row gets exactly its unpacked loss and gradients, and no attention crosses conversations,
through every attention core (CPU fused, unfused, SDPA) and position embedding (RoPE, learned)."""

import random

import numpy as np
import pytest
import torch

from megatron.convert.huggingface import config_from_hf, state_dict_from_hf
from megatron.model import GPTModel, TransformerConfig
from tests.helpers import hf_models, sft

transformers = pytest.importorskip("transformers")

SEQ = 128
CORES = {"fused-cpu": hf_models.FUSED, "unfused": hf_models.UNFUSED, "sdpa": dict(use_flash_attn=True)}


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """Three tokenized conversations (ids, loss flags) of different lengths, ChatML."""
    from megatron.data.sft_conversation import PROMPT_FORMATS, tokenize_conversation
    from megatron.training.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(str(sft.tokenizer_folder(tmp_path_factory.mktemp("tok"))))
    rng = random.Random(11)
    found = [tokenize_conversation(tokenizer, PROMPT_FORMATS["chatml"], sft.conversation(rng, turns, system=turns > 1,
                                                                                 words=(1, 2)))
             for turns in (1, 2, 1)]
    assert sum(len(ids) for ids, _ in found) <= SEQ
    return found, tokenizer.pad


def _model(position: str, core: dict):
    torch.manual_seed(0)
    if position == "rope":
        hf = hf_models.make_hf(hf_models.llama_family("llama", vocab_size=300, max_position_embeddings=SEQ))
    else:
        hf = hf_models.make_hf(hf_models.gpt2(vocab_size=300, n_positions=SEQ))
    config_kwargs, model_kwargs = config_from_hf(hf.config, seq_length=SEQ)
    model = GPTModel(TransformerConfig(**{**core, **config_kwargs}), **model_kwargs)
    model.load_state_dict(state_dict_from_hf(hf.state_dict(), hf.config))
    return model.train()


def _batch(samples):
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def _run(model, batch, packed: bool):
    """(per-token losses [b, s], grads by name) of the masked loss sum."""
    from megatron.model.packed_seq import PackedSeqParams

    model.zero_grad(set_to_none=True)
    params = PackedSeqParams(batch["cu_seqlens"]) if packed else None
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params)
    (losses * batch["loss_mask"]).sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("position, core", [("rope", "fused-cpu"), ("rope", "sdpa"), ("learned_absolute", "unfused")])
def test_packed_rows_give_each_conversation_its_unpacked_loss_and_gradients(conversations, position, core):
    from megatron.data.sft_dataset import pack

    found, pad = conversations
    model = _model(position, CORES[core])
    orders = [(0, 1, 2), (2, 0)]  # two rows with different boundaries in one micro-batch
    packed = _batch([pack([found[i] for i in order], SEQ, pad) for order in orders])
    packed_losses, packed_grads = _run(model, packed, packed=True)
    alone = _batch([pack([conversation], SEQ, pad) for conversation in found])
    alone_losses, _ = _run(model, alone, packed=False)  # the plain causal path
    alone_grads = [_run(model, {k: v[i:i + 1] for k, v in alone.items()}, packed=False)[1] for i in range(len(found))]
    expected_grads = {}
    for row, order in enumerate(orders):
        for slot, i in enumerate(order):
            start, end = int(packed["cu_seqlens"][row, slot]), int(packed["cu_seqlens"][row, slot + 1])
            got = (packed_losses[row, start:end] * packed["loss_mask"][row, start:end]).sum()
            n = end - start if slot + 1 < len(order) else len(found[i][0]) - 1
            want = (alone_losses[i, :n] * alone["loss_mask"][i, :n]).sum()
            assert float(want) > 0 and float(got) == pytest.approx(float(want), rel=1e-5), (row, i)
            for name, grad in alone_grads[i].items():
                expected_grads[name] = expected_grads.get(name, 0) + grad
    assert packed_grads.keys() == expected_grads.keys()
    for name, grad in packed_grads.items():
        assert _relative(grad, expected_grads[name]) < 1e-5, name


@pytest.mark.parametrize("core", list(CORES))
def test_a_packed_row_leaks_no_attention_across_conversations(conversations, core):
    """New tokens for the middle conversation change its logits and no other's; the first and last
    conversations' loss has no gradient at the middle one's input embeddings."""
    from megatron.data.sft_dataset import pack
    from megatron.model.packed_seq import PackedSeqParams

    found, pad = conversations
    model = _model("rope", CORES[core]).eval()
    sample = pack(found, SEQ, pad)
    cu = sample["cu_seqlens"]
    middle = slice(int(cu[1]), int(cu[2]))
    other = torch.ones(SEQ, dtype=torch.bool)
    other[middle] = False
    changed = sample["tokens"].clone()
    changed[middle] = torch.randint(5, 300, (middle.stop - middle.start,), generator=torch.Generator().manual_seed(1))
    params = PackedSeqParams(cu[None])
    with torch.no_grad():
        before = model(sample["tokens"][None], sample["position_ids"][None], None, packed_seq_params=params)[0]
        after = model(changed[None], sample["position_ids"][None], None, packed_seq_params=params)[0]
    assert torch.allclose(before[other], after[other], rtol=0, atol=1e-6)
    assert (before[middle] - after[middle]).abs().max() > 1e-2
    embeddings = {}

    def keep(module, inputs, output):
        output.retain_grad()
        embeddings["out"] = output  # [s, b, h]

    handle = model.embedding.register_forward_hook(keep)
    losses = model(sample["tokens"][None], sample["position_ids"][None], None, labels=sample["labels"][None],
                   packed_seq_params=params)
    handle.remove()
    (losses[0] * sample["loss_mask"] * other).sum().backward()
    grad = embeddings["out"].grad[:, 0]  # [s, h]
    assert grad[middle].abs().max() == 0 and grad[other].abs().max() > 0


def test_overflow_policy_cuts_the_crossing_conversation_and_drops_the_rest():
    from megatron.data.sft_dataset import pack

    def conversation(n, first):
        return np.arange(first, first + n, dtype=np.int64), np.arange(n) % 2 == 1

    sample = pack([conversation(10, 100), conversation(20, 200), conversation(5, 300)], 16, pad=0)
    assert sample["tokens"].tolist() == list(range(100, 110)) + list(range(200, 206))
    assert sample["labels"].tolist() == list(range(101, 110)) + list(range(200, 207))
    assert sample["position_ids"].tolist() == list(range(10)) + list(range(6))
    assert sample["cu_seqlens"].tolist() == [0, 10] + [16] * 15 and int(sample["max_seqlen"]) == 10
    # no label across the boundary (position 9 predicts conversation 2's first token)
    assert sample["loss_mask"].tolist() == [float(i % 2 == 0) for i in range(9)] + [0.0] + \
        [float(i % 2 == 0) for i in range(6)]
    short = pack([conversation(4, 100)], 8, pad=7)  # padding continues the positions, no loss
    assert short["tokens"].tolist() == [100, 101, 102, 103, 7, 7, 7, 7]
    assert short["position_ids"].tolist() == list(range(8)) and short["loss_mask"][3:].sum() == 0
