#!/bin/bash
# Collect training data from a Wikipedia dump, as Megatron-LM's README describes, end to end:
#   dump -> JSON (extract_wikipedia) -> cleanup -> dedup -> decontamination -> .bin/.idx
#
#   examples/collect_wikipedia.sh [OUTPUT_DIR] [DUMP.xml.bz2]
#
# With no dump it writes a small one itself (tools/data_collection/synthetic.py: 200 synthetic
# articles, 20 of them repeated under other titles, one that quotes a LAMBADA passage, plus a
# redirect and a talk page) and a one-line LAMBADA file, so the whole chain runs offline in
# seconds. Give real evaluation files with TASKS="LAMBADA:lambada_test.jsonl RACE:RACE/test ...".
# The tokenizer: VOCAB_FILE and MERGE_FILE (GPT-2 style) when set, else the built-in default's
# (make run), else a 2,000-token BPE trained on the collected text (needs the tokenizers package).
# Needs the data extra: pip install -e .[data]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${1:-data/wikipedia-example}
DUMP=${2:-}
WORKERS=${WORKERS:-$(nproc)}
SPLIT=${SPLIT:-regex}        # sentence splitting: regex (no data needed) or nltk (needs punkt_tab)
MIN_WORDS=${MIN_WORDS:-50}   # Megatron's cleanup uses 128 on web text
mkdir -p "$OUT"

QUOTE="the old keeper of the lighthouse watched the grey ships sail slowly past the harbour wall every morning"
if [ -z "$DUMP" ]; then
    DUMP="$OUT/dump.xml.bz2"
    "$PYTHON" tools/data_collection/synthetic.py dump --output "$DUMP" --articles 200 --copies 20 \
        --extra-text "This article quotes a test set. ${QUOTE^}, and then he went home to sleep. It was a long day for everyone in the village and the people were tired after the storm."
fi
if [ -z "${TASKS:-}" ]; then
    printf '{"text": "%s"}\n' "$QUOTE" > "$OUT/lambada_test.jsonl"
    TASKS="LAMBADA:$OUT/lambada_test.jsonl"
fi
TASK_FLAGS=()
for task in $TASKS; do TASK_FLAGS+=(--task "$task"); done

"$PYTHON" tools/data_collection/extract_wikipedia.py --input "$DUMP" --output "$OUT/wiki.jsonl" \
    --workers "$WORKERS" --split-sentences "$SPLIT"
"$PYTHON" tools/data_collection/cleanup.py --input "$OUT/wiki.jsonl" --output "$OUT/wiki.clean.jsonl" \
    --no-url-filter --languages en --min-words "$MIN_WORDS" --workers "$WORKERS"
"$PYTHON" tools/data_collection/dedup.py run --input "$OUT/wiki.clean.jsonl" --output-dir "$OUT/dedup" \
    --threshold 0.8 --workers "$WORKERS"
"$PYTHON" tools/data_collection/decontaminate.py --input "$OUT/dedup/wiki.clean.jsonl" \
    --output "$OUT/wiki.final.jsonl" "${TASK_FLAGS[@]}" --workers "$WORKERS"

if [ -n "${VOCAB_FILE:-}" ] && [ -n "${MERGE_FILE:-}" ]; then
    :
elif [ -f data/default/tokenizer/vocab.json ]; then
    VOCAB_FILE=data/default/tokenizer/vocab.json MERGE_FILE=data/default/tokenizer/merges.txt
else
    "$PYTHON" tools/train_tokenizer.py --input "$OUT/wiki.final.jsonl" --tokenizer-type GPT2BPETokenizer \
        --vocab-size 2000 --output-dir "$OUT/tokenizer"
    VOCAB_FILE=$OUT/tokenizer/vocab.json MERGE_FILE=$OUT/tokenizer/merges.txt
fi
"$PYTHON" tools/preprocess_data.py --input "$OUT/wiki.final.jsonl" --output-prefix "$OUT/wiki" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
    --append-eod --workers "$WORKERS"
echo "Wrote $OUT/wiki_text_document.bin/.idx (reports: $OUT/*.report.json, $OUT/dedup/dedup.report.json)"
