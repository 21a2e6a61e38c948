"""The pieces of examples/finetune_llama_chat.sh that a laptop has no download for, and its last step.

    python tools/make_chat_example.py data --input corpus.jsonl --output chat.jsonl [--conversations 400]
    python tools/make_chat_example.py tiny-llama --input corpus.jsonl --output-dir tiny-llama-chat
    python tools/make_chat_example.py chat --model-dir hf-out --prompt "What is the Python topic 'for' about?"

data        chat conversations from the default corpus's language-reference topics (`python-docs`
            documents): a system prompt, the question "What is the Python topic 'TITLE' about?" and
            the first sentences of the topic as the answer; --per-line conversations per JSON line
            (Megatron-LM's SFT format, each starting with its system message, packed by --sft).
tiny-llama  a random Llama (2 layers, h 64, GQA) with a byte-level BPE tokenizer trained on the corpus
            (BOS <s>, EOS </s>, pad <pad>, ChatML's <|im_start|> <|im_end|>) whose tokenizer_config.json
            carries the ChatML chat template: what a real Llama-2-chat directory gives on GPUs.
chat        greedy generation with transformers from an HF directory, the prompt rendered with the
            directory's chat template (apply_chat_template with the generation prompt).

Outputs are written to a temporary name beside the target and renamed into place.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Iterator, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.cli import run_cli  # noqa: E402

SYSTEM = "You are a helpful assistant who explains Python."
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


class ChatExampleError(ValueError):
    """Bad input: the message names the file or flag."""


def _documents(path: str) -> Iterator[dict]:
    if not os.path.isfile(path):
        raise ChatExampleError(f"--input {path}: no such file")
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise ChatExampleError(f"{path}:{number}: not valid JSON ({err.msg})") from None


def _answer(text: str, max_chars: int) -> Optional[str]:
    """The first sentences of a topic's text, whitespace squeezed, at most max_chars (None if too short)."""
    lines = [line for line in text.splitlines() if not re.fullmatch(r"\s*[*=~^-]+\s*", line)]  # no underlines
    flat = re.sub(r"\s+", " ", " ".join(lines[1:] if len(lines) > 1 else lines)).strip()  # nor the heading
    sentences = re.split(r"(?<=[.!?]) ", flat)
    answer = ""
    for sentence in sentences:
        if answer and len(answer) + 1 + len(sentence) > max_chars:
            break
        answer = f"{answer} {sentence}".strip()
    answer = answer[:max_chars]
    return answer if len(answer) >= 20 else None


def conversations(corpus: str, limit: int, max_chars: int) -> List[list]:
    found = []
    for document in _documents(corpus):
        if document.get("source") != "python-docs" or not document.get("title"):
            continue
        answer = _answer(document.get("text", ""), max_chars)
        if answer is None:
            continue
        found.append([{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"What is the Python topic '{document['title']}' about?"},
                      {"role": "assistant", "content": answer}])
        if len(found) == limit:
            break
    if not found:
        raise ChatExampleError(f"--input {corpus}: no python-docs topics to make conversations from")
    return found


def _atomic_text(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".chat-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(temporary, path)


def make_data(args: argparse.Namespace) -> None:
    found = conversations(args.input, args.conversations, args.max_answer_chars)
    lines = [sum(found[i:i + args.per_line], []) for i in range(0, len(found), args.per_line)]
    _atomic_text(args.output, "".join(json.dumps({"messages": line}) + "\n" for line in lines))
    print(f"> wrote {len(found)} conversations in {len(lines)} lines to {args.output}")


def make_tiny_llama(args: argparse.Namespace) -> None:
    import tokenizers
    import torch
    import transformers

    texts = [document.get("text", "") for document, _ in zip(_documents(args.input), range(args.documents))]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=SPECIALS,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = CHATML
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=args.max_positions, rms_norm_eps=1e-5,
        initializer_range=0.02, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id)
    model = transformers.LlamaForCausalLM(config)
    parent = os.path.dirname(os.path.abspath(args.output_dir))
    os.makedirs(parent, exist_ok=True)
    temporary = tempfile.mkdtemp(dir=parent, prefix=".tiny-llama-")
    try:
        model.save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)
        if os.path.exists(args.output_dir):
            raise ChatExampleError(f"--output-dir {args.output_dir} exists already")
        os.replace(temporary, args.output_dir)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    print(f"> wrote a tiny random Llama ({sum(p.numel() for p in model.parameters())} parameters) and a "
          f"{len(tokenizer)}-id tokenizer with a ChatML chat template to {args.output_dir}")


def chat(args: argparse.Namespace) -> None:
    import torch
    import transformers

    if not os.path.isdir(args.model_dir):
        raise ChatExampleError(f"--model-dir {args.model_dir}: no such folder")
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    if tokenizer.chat_template is None:
        raise ChatExampleError(f"--model-dir {args.model_dir}: its tokenizer_config.json has no chat_template")
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir)
    if args.adapter_dir is not None:  # a LoRA adapter in HF PEFT's format on this base
        import peft

        if not os.path.isfile(os.path.join(args.adapter_dir, "adapter_config.json")):
            raise ChatExampleError(f"--adapter-dir {args.adapter_dir}: no adapter_config.json there")
        model = peft.PeftModel.from_pretrained(model, args.adapter_dir)
    model.eval()
    messages = [{"role": "system", "content": args.system}, {"role": "user", "content": args.prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    print(f"> prompt: {args.prompt}")
    print(f"> answer: {tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data", help="chat JSON lines from the default corpus")
    data.add_argument("--input", required=True, help="the default corpus (tools/make_default_corpus.py)")
    data.add_argument("--output", required=True, help="the chat JSON-lines file to write")
    data.add_argument("--conversations", type=int, default=400, help="at most this many conversations")
    data.add_argument("--per-line", type=int, default=2, help="conversations per JSON line (packed together)")
    data.add_argument("--max-answer-chars", type=int, default=160, help="length of an answer")
    tiny = commands.add_parser("tiny-llama", help="a tiny random HF Llama with a ChatML tokenizer")
    tiny.add_argument("--input", required=True, help="the corpus the tokenizer is trained on")
    tiny.add_argument("--output-dir", required=True)
    tiny.add_argument("--vocab-size", type=int, default=1000)
    tiny.add_argument("--documents", type=int, default=400, help="corpus documents the tokenizer sees")
    tiny.add_argument("--max-positions", type=int, default=256)
    tiny.add_argument("--seed", type=int, default=1234)
    talk = commands.add_parser("chat", help="generate with transformers through the chat template")
    talk.add_argument("--model-dir", required=True, help="an HF directory (tools/checkpoint/convert.py --saver hf)")
    talk.add_argument("--adapter-dir", default=None,
                      help="an HF PEFT adapter for --model-dir (convert.py --loader lora --saver peft)")
    talk.add_argument("--prompt", required=True)
    talk.add_argument("--system", default=SYSTEM)
    talk.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    for name in ("conversations", "per_line", "max_answer_chars", "vocab_size", "documents", "max_positions",
                 "max_new_tokens"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = get_args(argv)
    {"data": make_data, "tiny-llama": make_tiny_llama, "chat": chat}[args.command](args)


if __name__ == "__main__":
    run_cli(main, "make_chat_example.py", errors=(ChatExampleError,))
