#!/bin/bash
# Train a tiny GPT (4 layers, hidden 128) on the built-in default corpus, on CPU in a few minutes.
#
#   examples/pretrain_gpt.sh [DATA_PREFIX] [VOCAB_FILE] [MERGE_FILE] [CHECKPOINT_DIR]
#
# With no arguments it uses what `make run` builds under data/default. Run it again and it
# resumes from the last checkpoint. Set TENSORBOARD_DIR to log TensorBoard scalars and pass more
# flags via EXTRA_ARGS. Parallel layouts: NPROC processes split as TP x PP x DP, e.g.
#
#   NPROC=8 TP=2 PP=2 DISTRIBUTED_OPTIMIZER=1 examples/pretrain_gpt.sh     # DP = 8 / (2 x 2) = 2
#   NPROC=2 PP=2 VPP=2 examples/pretrain_gpt.sh                            # interleaved 1F1B
#
# (TP adds --sequence-parallel; a checkpoint loads back only at the TP/PP it was saved with, at
# any DP size.)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

DATA_PATH=${1:-data/default/python_text_document}
VOCAB_FILE=${2:-data/default/tokenizer/vocab.json}
MERGE_FILE=${3:-data/default/tokenizer/merges.txt}
CHECKPOINT_PATH=${4:-data/default/checkpoints/gpt-tiny}
NPROC=${NPROC:-1}
TP=${TP:-1}
PP=${PP:-1}

PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
if [ -n "${VPP:-}" ]; then PARALLEL_ARGS+=(--num-virtual-stages-per-pipeline-rank "$VPP"); fi
if [ -n "${DISTRIBUTED_OPTIMIZER:-}" ]; then PARALLEL_ARGS+=(--use-distributed-optimizer --overlap-grad-reduce); fi

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
    "${GPT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" ${EXTRA_ARGS:-}
