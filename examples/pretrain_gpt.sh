#!/bin/bash
# Train a tiny GPT (4 layers, hidden 128) on the built-in default corpus, on CPU in a few minutes.
#
#   examples/pretrain_gpt.sh [DATA_PREFIX] [VOCAB_FILE] [MERGE_FILE] [CHECKPOINT_DIR]
#
# With no arguments it uses what `make run` builds under data/default. Run it again and it
# resumes from the last checkpoint. Set TENSORBOARD_DIR to log TensorBoard scalars, NPROC to
# train on several processes once data parallelism lands, and pass more flags via EXTRA_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

DATA_PATH=${1:-data/default/python_text_document}
VOCAB_FILE=${2:-data/default/tokenizer/vocab.json}
MERGE_FILE=${3:-data/default/tokenizer/merges.txt}
CHECKPOINT_PATH=${4:-data/default/checkpoints/gpt-tiny}
NPROC=${NPROC:-1}

DISTRIBUTED_ARGS=(--nproc-per-node "$NPROC" --nnodes 1 --master-addr localhost --master-port "${MASTER_PORT:-29517}")

GPT_ARGS=(
    --num-layers 4
    --hidden-size 128
    --num-attention-heads 4
    --seq-length 128
    --max-position-embeddings 128
    --micro-batch-size 4
    --global-batch-size 16
    --lr 1.0e-3
    --train-iters 200
    --lr-decay-iters 200
    --lr-decay-style cosine
    --min-lr 1.0e-4
    --lr-warmup-iters 20
    --weight-decay 0.1
    --clip-grad 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --tokenizer-type GPT2BPETokenizer
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --split 949,50,1
    --num-workers 1
)

OUTPUT_ARGS=(
    --log-interval 10
    --save-interval 100
    --eval-interval 50
    --eval-iters 5
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
)
if [ -n "${TENSORBOARD_DIR:-}" ]; then
    OUTPUT_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
fi

"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" ${EXTRA_ARGS:-}
