"""Chat data for the --sft tests: a tiny byte-level BPE tokenizer folder (transformers' format, with
chat templates) and JSON-lines conversations; the transformers reference of a template's tokens
and assistant mask."""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
WORDS = ("the cat sat on a mat and then it ran to the big red house where a dog was asleep by the door "
         "what is two plus three it is five please tell me a story about the sea once upon a time "
         "hello how are you today I am fine thank you very much").split()

# The named formats of megatron/data/sft_conversation.py written out with transformers'
# {% generation %} markers around what the loss covers: the reference for the assistant masks.
LLAMA2_GENERATION = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set turns = messages[1:] %}{% else %}{% set system = none %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% if message['role'] == 'user' %}"
    "{% if loop.first and system is not none %}"
    "{% set text = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set text = message['content'] %}{% endif %}"
    "{{ bos_token + '[INST] ' + text.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{% generation %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}"
    "{% endgeneration %}{% endif %}{% endfor %}")
CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tokenizer_folder(directory, chat_template: str | None = None, vocab_size: int = 300):
    """A byte-level BPE tokenizer (vocab_size ids, SPECIALS first) saved as transformers saves one."""
    import tokenizers
    import transformers

    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template is not None:
        fast.chat_template = chat_template
    Path(directory).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory


def sentence(rng: random.Random, low: int = 2, high: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def conversation(rng: random.Random, turns: int = 1, system: bool = True, words: tuple = (2, 6)) -> list:
    messages = [{"role": "system", "content": sentence(rng, *words)}] if system else []
    for _ in range(turns):
        messages += [{"role": "user", "content": sentence(rng, *words)},
                     {"role": "assistant", "content": sentence(rng, *words)}]
    return messages


def write_chat_jsonl(path, lines) -> Path:
    """lines: message lists, written as {"messages": [...]} one per line."""
    with open(path, "w", encoding="utf-8") as f:
        for messages in lines:
            f.write(json.dumps({"messages": messages}) + "\n")
    return Path(path)


def hf_reference(hf_tokenizer, generation_template: str, messages: list):
    """(ids, assistant mask) as transformers' apply_chat_template gives them for a template with
    {% generation %} markers."""
    out = hf_tokenizer.apply_chat_template(messages, chat_template=generation_template, tokenize=True,
                                           return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(x) for x in out["assistant_masks"]]


def llama_folder(directory, chat_template: str | None = None, vocab_size: int = 300, positions: int = 128):
    """A tiny random HF Llama (tests/helpers/hf_models) saved with tokenizer_folder's tokenizer: what
    --load-hf and --tokenizer-model read. Returns the transformers model."""
    from tests.helpers import hf_models

    tokenizer_folder(directory, chat_template, vocab_size)
    hf = hf_models.make_hf(hf_models.llama_family("llama", vocab_size=vocab_size, max_position_embeddings=positions))
    hf.save_pretrained(str(directory))
    return hf


def sft_argv(model, data, seq_length: int, *extra, iters: int = 1, gbs: int = 1):
    """pretrain_gpt.py's flags for SFT from the llama_folder `model` on the JSON-lines `data` (a list)."""
    return ["--sft", "--load-hf", str(model), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            str(model), "--data-path", *data, "--split", "1,0,0", "--seq-length", str(seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(gbs), "--train-iters", str(iters),
            "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--seed", "7", *extra]
