"""--sft: chat JSON lines tokenized on the fly, the loss on assistant tokens only (megatron/data/sft_dataset.py).

The first iteration's loss is transformers' loss with labels -100 outside the assistant turns
(the mask from transformers' own {% generation %} markers); resuming mid-epoch is bit-exact; a
malformed line stops pretrain_gpt.py with FILE:LINE: reason, no traceback.
"""

import json
import random

import pytest
import torch

from tests.helpers import sft

transformers = pytest.importorskip("transformers")

VOCAB = 300
SEQ = 128


def _model_folder(directory, chat_template=None):
    return sft.llama_folder(directory, chat_template, VOCAB)


def _argv(model, data, *extra, iters=1, gbs=1):
    return sft.sft_argv(model, data, SEQ, *extra, iters=iters, gbs=gbs)


@pytest.mark.parametrize("prompt_format, generation_template", [
    ("llama2-chat", sft.LLAMA2_GENERATION),  # a named format
    ("default", sft.CHATML_GENERATION),  # the ChatML template of tokenizer_config.json
])
def test_first_iteration_loss_is_transformers_loss_on_assistant_tokens(tmp_path, prompt_format, generation_template):
    from megatron.data.sft_conversation import PROMPT_FORMATS, tokenize_conversation
    from megatron.training.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer

    model = tmp_path / "model"
    hf = _model_folder(model, chat_template=PROMPT_FORMATS["chatml"] if prompt_format == "default" else None)
    rng = random.Random(3)
    messages = sft.conversation(rng, turns=2)
    data = sft.write_chat_jsonl(tmp_path / "chat.jsonl", [messages])
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(str(model))
    ids, assistant = sft.hf_reference(reference_tokenizer, generation_template, messages)
    # Our tokens and mask are transformers' (for both named formats, without and with a system prompt).
    ours = HuggingFaceTokenizer(str(model))
    for name, reference in (("llama2-chat", sft.LLAMA2_GENERATION), ("chatml", sft.CHATML_GENERATION)):
        for probe in (messages, sft.conversation(rng, turns=3, system=False)):
            got_ids, got_loss = tokenize_conversation(ours, PROMPT_FORMATS[name], probe)
            assert (got_ids.tolist(), got_loss.tolist()) == sft.hf_reference(reference_tokenizer, reference, probe)
    assert sum(assistant) > 4 and len(ids) < SEQ
    labels = [i if trained else -100 for i, trained in zip(ids, assistant)]
    with torch.no_grad():
        expected = hf(torch.tensor([ids]), labels=torch.tensor([labels])).loss.item()
    losses, _ = _pretrain(_argv(model, [str(data)], "--sft-tokenizer-prompt-format", prompt_format, "--lr", "0"))
    assert losses[1] == pytest.approx(expected, rel=1e-5)


def _pretrain(argv):
    """Train in this process: ({iteration: lm loss}, [(prefix, validation losses)])."""
    import pretrain_gpt
    from megatron.training.initialize import reset_megatron

    try:
        result = pretrain_gpt.main(list(argv), record_history=True)
    finally:
        reset_megatron()
    return {r.iteration: r.losses["lm loss"] for r in result.history}, result.validation


def test_a_blend_resumes_mid_epoch_bit_exact_with_validation_from_split(tmp_path):
    """A weighted blend of two files, --split for validation: 4 iterations straight = 2, save,
    resume, 2 more, bit for bit (the consumed samples pick up the shuffled order mid-epoch),
    validation losses included; a data-loader worker tokenizes."""
    model = tmp_path / "model"
    _model_folder(model)
    rng = random.Random(5)
    files = []
    for name in ("a", "b"):
        lines = [sft.conversation(rng, turns=rng.randint(1, 2)) + sft.conversation(rng) for _ in range(10)]
        files.append(str(sft.write_chat_jsonl(tmp_path / f"{name}.jsonl", lines)))
    data = ["0.7", files[0], "0.3", files[1]]
    common = ["--sft-tokenizer-prompt-format", "chatml", "--lr", "1e-3", "--lr-decay-iters", "4", "--num-workers",
              "1", "--ckpt-format", "torch", "--split", "8,2,0", "--eval-interval", "2", "--eval-iters", "1"]
    straight, straight_valid = _pretrain(_argv(model, data, *common, iters=4, gbs=2))
    first, first_valid = _pretrain(_argv(model, data, *common, "--save", str(tmp_path / "ckpt"), "--save-interval",
                                         "2", iters=2, gbs=2))
    resumed, resumed_valid = _pretrain(_argv(model, data, *common, "--load", str(tmp_path / "ckpt"), iters=4, gbs=2))
    assert sorted(resumed) == [3, 4]
    assert [first[1], first[2], resumed[3], resumed[4]] == [straight[i] for i in range(1, 5)]
    # validation at iterations 2 and 4, and at the end of each run
    assert [prefix for prefix, _ in straight_valid] == ["iteration 2", "iteration 4", "iteration 4 on validation set"]
    assert first_valid[0] == straight_valid[0] and resumed_valid == straight_valid[1:]
    assert all(losses["lm loss"] > 0 for _, losses in straight_valid)


def test_blends_and_splits_build_as_for_gpt_data(tmp_path):
    """--data-path 0.7 A 0.3 B --split 6,4,0: each split takes its own lines of each file, blended by weight."""
    from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.data.sft_conversation import PROMPT_FORMATS
    from megatron.data.sft_dataset import SFTDataset, SFTDatasetConfig
    from megatron.training.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(str(sft.tokenizer_folder(tmp_path / "tok")))
    files = []
    for name, word in (("a", "cat"), ("b", "dog")):
        lines = [[{"role": "user", "content": f"{word} {i}"}, {"role": "assistant", "content": word}]
                 for i in range(10)]
        files.append(str(sft.write_chat_jsonl(tmp_path / f"{name}.jsonl", lines)))
    config = SFTDatasetConfig(random_seed=3, sequence_length=32, blend=(files, [0.7, 0.3]), split="6,4,0",
                              tokenizer=tokenizer, chat_template=PROMPT_FORMATS["chatml"])
    train, valid, test = BlendedMegatronDatasetBuilder(SFTDataset, [20, 10, 0], lambda: True, config).build()
    assert test is None
    for blend, lines in ((train, range(0, 6)), (valid, range(6, 10))):
        texts = [tokenizer.detokenize(blend[i]["tokens"].tolist()) for i in range(len(blend))]
        from_a = [t for t in texts if "cat" in t]
        assert len(from_a) == pytest.approx(0.7 * len(texts), abs=1)
        assert len(from_a) + sum("dog" in t for t in texts) == len(texts)
        assert {int(t.split("user\n")[1].split()[1].split("<")[0]) for t in texts} <= set(lines)
    again = BlendedMegatronDatasetBuilder(SFTDataset, [20, 10, 0], lambda: True, config).build()[0]
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(len(train)))  # the seed decides


BAD_LINES = [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]', "not valid JSON"),
    ('{"text": "hello"}', 'needs a "messages" list'),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "message 0: needs a role"),
    ('[{"role": "user", "content": 3}]', "message 0 (user): content must be a string"),
    ('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}',
     "conversation 0: no assistant message"),
]


def test_lines_split_into_conversations_at_system_messages():
    from megatron.data.sft_dataset import parse_line

    system, user, answer = ({"role": role, "content": role[0]} for role in ("system", "user", "assistant"))
    openai = [user, answer, user, answer]  # an OpenAI-style list: one conversation, no system prompt
    assert parse_line(json.dumps(openai)) == parse_line(json.dumps({"messages": openai})) == [openai]
    megatron = [system, user, answer, system, user, answer, user, answer]  # Megatron-LM's: two conversations
    assert parse_line(json.dumps({"messages": megatron})) == [megatron[:3], megatron[3:]]


def test_a_malformed_line_stops_with_file_line_reason(tmp_path):
    from megatron.data.sft_dataset import SFTDataError, SFTLowLevelDataset

    good = json.dumps({"messages": sft.conversation(random.Random(0))})
    for bad, reason in BAD_LINES:
        path = tmp_path / "chat.jsonl"
        path.write_text(f"{good}\n\n{bad}\n{good}\n")
        with pytest.raises(SFTDataError) as caught:
            SFTLowLevelDataset(str(path))
        assert str(caught.value).startswith(f"{path}:3: ") and reason in str(caught.value), str(caught.value)
    # pretrain_gpt.py says it in one line, before the model is built
    from tests.helpers.launch import run_cli

    path = tmp_path / "chat.jsonl"
    path.write_text(f"{good}\n{BAD_LINES[1][0]}\n")
    tokenizer = sft.tokenizer_folder(tmp_path / "tok")
    done = run_cli(["pretrain_gpt.py", "--sft", "--sft-tokenizer-prompt-format", "chatml", "--num-layers", "1",
                    "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "32",
                    "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
                    "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer),
                    "--data-path", str(path), "--split", "1,0,0", "--num-workers", "0"])
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f'pretrain_gpt.py: error: {path}:2: a JSON object needs a "messages" list'], done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "building GPT model" not in done.stdout  # said while the flags are checked
