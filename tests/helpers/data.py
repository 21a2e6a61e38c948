"""Small data sets written for a test: JSONL documents, preprocessed datasets read back, a tiny GPT-2 for Accelerate."""
import json
from pathlib import Path

from megatron.data.indexed_dataset import IndexedDataset


# tools/preprocess_data.py's flags with the NullTokenizer, its input, and its output read back
def null_args(input_path, prefix, *extra, workers=1):
    return ["--input", str(input_path), "--output-prefix", str(prefix), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1000", "--workers", str(workers), *extra]


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({key: text}) + "\n")
    return path


def read_documents(prefix):
    ds = IndexedDataset(str(prefix))
    docs = []
    for d in range(ds.num_documents):
        first, last = ds.document_indices[d], ds.document_indices[d + 1]
        docs.append([ds[i].tolist() for i in range(first, last)])
    return docs


def files_bytes(prefix):
    return {ext: Path(str(prefix) + ext).read_bytes() for ext in (".bin", ".idx")}


# HF Accelerate's Megatron-LM example (tests/functional/test_accelerate_example.py, test_accelerate_guide.py)
def accelerate_fixture(root, corpus_path, gpt2_vocab_dir):
    """A tiny GPT-2 (config, tokenizer: the real GPT-2 vocabulary) in root/tiny-gpt2, and train.txt / validation.txt
    from the first documents of the corpus, for HF Accelerate's Megatron-LM example; returns the model folder."""
    model = root / "tiny-gpt2"
    model.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (model / name).write_bytes((gpt2_vocab_dir / name).read_bytes())
    (model / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 4, "n_embd": 64, "n_head": 4,
        "n_positions": 128, "n_ctx": 128, "vocab_size": 50257, "bos_token_id": 50256, "eos_token_id": 50256}))
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer",
                                                             "model_max_length": 128}))
    with open(corpus_path, encoding="utf-8") as f:
        docs = [json.loads(line)["text"].replace("\n", " ") for _, line in zip(range(31), f)]
    (root / "train.txt").write_text("\n".join(docs[:20]) + "\n")
    (root / "validation.txt").write_text(docs[30][:1500] + "\n")
    return model
