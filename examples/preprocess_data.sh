#!/bin/bash
# Turn a loose-JSON corpus into GPT training files (PREFIX_text_document.bin/.idx).
#
#   examples/preprocess_data.sh [INPUT.jsonl] [OUTPUT_PREFIX] [VOCAB_FILE] [MERGE_FILE]
#
# With no arguments it preprocesses the built-in default corpus with its tokenizer
# (run `make run` once to build them). Any GPT-2-style vocab.json/merges.txt works.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

INPUT=${1:-data/default/corpus.jsonl}
OUTPUT_PREFIX=${2:-data/default/example}
VOCAB_FILE=${3:-data/default/tokenizer/vocab.json}
MERGE_FILE=${4:-data/default/tokenizer/merges.txt}
WORKERS=${WORKERS:-$(nproc)}

"$PYTHON" tools/preprocess_data.py \
    --input "$INPUT" \
    --output-prefix "$OUTPUT_PREFIX" \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file "$VOCAB_FILE" \
    --merge-file "$MERGE_FILE" \
    --append-eod \
    --workers "$WORKERS"

"$PYTHON" tools/inspect_dataset.py --data-path "${OUTPUT_PREFIX}_text_document" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
