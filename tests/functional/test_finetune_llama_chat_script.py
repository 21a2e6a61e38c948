"""examples/finetune_llama_chat.sh end to end on CPU: the default corpus (80 documents) -> a tiny random
HF Llama with a ChatML tokenizer and a packed chat file -> pretrain_gpt.py --sft --load-hf -> an HF
directory (tools/checkpoint/convert.py --saver hf, verified) -> generation through its chat template;
then the LoRA variant (LORA_RANK) on the same inputs -> an HF PEFT adapter -> generation through peft."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.training import log_lines
from tools import make_default_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "finetune_llama_chat.sh")
ITERS = 4


def test_finetune_llama_chat_script_trains_exports_and_chats(tmp_path):
    transformers = pytest.importorskip("transformers")
    corpus = tmp_path / "corpus.jsonl"
    make_default_corpus.build_corpus(str(corpus), max_documents=80)
    work = tmp_path / "work"
    env = dict(os.environ, PYTHON=sys.executable, CORPUS=str(corpus), TRAIN_ITERS=str(ITERS), SEQ_LENGTH="128",
               EXTRA_ARGS="--log-interval 1 --num-workers 0", MASTER_PORT=str(29700 + os.getpid() % 200))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", SCRIPT, "", "", str(work)], env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    # the chat file packs two conversations per line, each with its system message
    first = json.loads((work / "chat.jsonl").read_text().splitlines()[0])["messages"]
    assert [m["role"] for m in first] == ["system", "user", "assistant"] * 2
    assert "> building train, validation, and test SFT datasets (prompt format default) ..." in out
    rows = log_lines(out)
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1)) and all(r["loss"] > 0 for r in rows)
    assert "verification: " in out and "-> OK" in out  # the HF export matches the checkpoint's logits
    hf_out = work / "hf-finetuned"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_out))
    assert tokenizer.chat_template is not None  # the template travelled with the tokenizer
    tuned = transformers.AutoModelForCausalLM.from_pretrained(str(hf_out))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(work / "tiny-llama-chat"))
    assert not all(a.equal(b) for a, b in zip(tuned.parameters(), base.parameters()))  # it was fine-tuned
    assert "> prompt: What is the Python topic 'for' about?" in out and "> answer: " in out

    # LoRA on the same model and chat file (the script reuses them): adapters only, exported for PEFT
    lora = subprocess.run(["bash", SCRIPT, "", "", str(work)], env=dict(env, LORA_RANK="4"), capture_output=True,
                          text=True, timeout=300)
    out = lora.stdout + lora.stderr
    assert lora.returncode == 0, out[-3000:]
    rows = log_lines(out)
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1)) and all(r["loss"] > 0 for r in rows)
    adapter = work / "peft-adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert (adapter / "adapter_model.safetensors").is_file()
    assert "> answer: " in out.split("> prompt: What is the Python topic 'for' about?")[-1]
