#!/bin/bash
# Zero-shot WikiText-103-style perplexity (loss, ppl, adjusted ppl, token ratio)
# of the tiny GPT that examples/pretrain_gpt.sh trains, on CPU, with tasks/main.py --task WIKITEXT103.
#
#   examples/evaluate_wikitext.sh [CHECKPOINT_DIR] [VOCAB_FILE] [MERGE_FILE] [VALID_DATA]
#
# With no arguments it uses what `make run` builds (data/default/checkpoints/gpt-tiny and
# data/default/tokenizer). Without VALID_DATA it first writes a WIKITEXT103-style file from the
# default corpus (tasks/zeroshot_gpt/make_fixtures.py: CORPUS picks another JSON-lines corpus,
# EVAL_DIR where the file goes) and reuses it afterwards. The model's shape comes from the
# checkpoint (--use-checkpoint-args); SEQ_LENGTH (default 128, the example's) must not exceed its
# --max-position-embeddings. NPROC / TP / PP split the run as in pretrain_gpt.sh (a torch_dist
# checkpoint loads at any TP / PP); EXTRA_ARGS adds flags (docs/tasks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

CHECKPOINT_PATH=${1:-data/default/checkpoints/gpt-tiny}
VOCAB_FILE=${2:-data/default/tokenizer/vocab.json}
MERGE_FILE=${3:-data/default/tokenizer/merges.txt}
VALID_DATA=${4:-}
CORPUS=${CORPUS:-data/default/corpus.jsonl}
EVAL_DIR=${EVAL_DIR:-data/default/eval}
NPROC=${NPROC:-1}
TP=${TP:-1}
PP=${PP:-1}

if [ -z "$VALID_DATA" ]; then
    VALID_DATA=$EVAL_DIR/wiki.valid.tokens
    if [ ! -f "$VALID_DATA" ]; then
        "$PYTHON" tasks/zeroshot_gpt/make_fixtures.py --format wikitext --input "$CORPUS" --output "$VALID_DATA"
    fi
fi

DISTRIBUTED_ARGS=(--nproc-per-node "$NPROC" --nnodes 1 --master-addr localhost --master-port "${MASTER_PORT:-29519}")

TASK_ARGS=(
    --task WIKITEXT103
    --valid-data "$VALID_DATA"
    --load "$CHECKPOINT_PATH"
    --use-checkpoint-args
    --no-load-optim
    --no-load-rng
    --tokenizer-type GPT2BPETokenizer
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --seq-length "${SEQ_LENGTH:-128}"
    --micro-batch-size 8
    --log-interval 10
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
)

"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" tasks/main.py \
    "${TASK_ARGS[@]}" --overlapping-eval "${OVERLAPPING_EVAL:-32}" ${EXTRA_ARGS:-}
