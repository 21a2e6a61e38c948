# Two commands do all the set-up on a fresh machine (both are idempotent):
#   make run    install what is needed, then run the main job on the built-in default data
#   make test   install what is needed, then run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch; on a GPU machine use e.g. `make TORCH_SPEC=torch run`.
TORCH_SPEC ?= torch==2.13.0
DATA ?= data/default
VOCAB_SIZE ?= 8192
WORKERS ?= 2
PYTEST_ARGS ?=

.PHONY: run test setup setup-test bench compare-peers clean-data

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[tokenizers]"
	touch $@

# The test extra, and megatron-core from PyPI beside the venv (the numerical reference some
# tests compare with; its `megatron` package has our package's name, so it lives in its own
# folder and tests run it in subprocesses with PYTHONPATH pointing there: tests/helpers/mcore_reference.py).
$(VENV)/.installed-test: $(VENV)/.installed $(VENV)/peers/megatron_core/.installed
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# ---------------------------------------------------------------- the main job
# The built-in default: a corpus made from Python's own documentation and standard library,
# a byte-level BPE tokenizer trained on it, the corpus preprocessed into .bin/.idx, and a tiny
# GPT trained on it (examples/pretrain_gpt.sh: 200 iterations on CPU, checkpoints under $(DATA)/checkpoints),
# then a few lines generated from it (tools/generate_text.py).
$(DATA)/corpus.jsonl: tools/make_default_corpus.py | $(VENV)/.installed
	$(PY) tools/make_default_corpus.py --output $@

$(DATA)/tokenizer/vocab.json: $(DATA)/corpus.jsonl | $(VENV)/.installed
	$(PY) tools/train_tokenizer.py --input $< --tokenizer-type GPT2BPETokenizer \
		--vocab-size $(VOCAB_SIZE) --output-dir $(DATA)/tokenizer

$(DATA)/python_text_document.idx: $(DATA)/tokenizer/vocab.json | $(VENV)/.installed
	$(PY) tools/preprocess_data.py --input $(DATA)/corpus.jsonl --output-prefix $(DATA)/python \
		--tokenizer-type GPT2BPETokenizer --vocab-file $(DATA)/tokenizer/vocab.json \
		--merge-file $(DATA)/tokenizer/merges.txt --append-eod --workers $(WORKERS)

run: $(DATA)/python_text_document.idx
	$(PY) tools/inspect_dataset.py --data-path $(DATA)/python_text_document \
		--tokenizer-type GPT2BPETokenizer --vocab-file $(DATA)/tokenizer/vocab.json \
		--merge-file $(DATA)/tokenizer/merges.txt
	PYTHON=$(PY) examples/pretrain_gpt.sh $(DATA)/python_text_document $(DATA)/tokenizer/vocab.json \
		$(DATA)/tokenizer/merges.txt $(DATA)/checkpoints/gpt-tiny
	$(PY) tools/generate_text.py --load $(DATA)/checkpoints/gpt-tiny --use-checkpoint-args \
		--tokenizer-type GPT2BPETokenizer --vocab-file $(DATA)/tokenizer/vocab.json \
		--merge-file $(DATA)/tokenizer/merges.txt --tokens-to-generate 32 \
		--prompt "def main(" --prompt "import os" --prompt "The module"

# ---------------------------------------------------------------- tests and benchmarks
test: $(VENV)/.installed-test
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

bench: $(DATA)/python_text_document.idx
	$(PY) bench/preprocess.py
	$(PY) bench/dataset_index.py
	$(PY) bench/train_gpt.py

# ours vs HF transformers (the test extra) vs megatron-core from PyPI, fp32 and bf16 (docs/PERFORMANCE.md).
# megatron-core goes beside the venv's site-packages, not into it: its `megatron` package has our
# package's name, so bench/compare_peers.py runs it in its own processes with its own PYTHONPATH.
MCORE_SPEC ?= megatron-core==0.16.1
$(VENV)/peers/megatron_core/.installed: | $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --target $(VENV)/peers/megatron_core "$(MCORE_SPEC)"
	touch $@

compare-peers: $(VENV)/.installed-test $(VENV)/peers/megatron_core/.installed
	$(PY) bench/compare_peers.py

clean-data:
	rm -rf $(DATA)
