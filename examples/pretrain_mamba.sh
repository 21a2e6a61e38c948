#!/bin/bash
# Train a tiny hybrid Mamba-2 / attention / MLP model (8 layers, hidden 128) on the built-in default
# corpus, on CPU in a few minutes (Megatron-LM's examples/mamba/train.sh at laptop size).
#
#   examples/pretrain_mamba.sh [DATA_PREFIX] [VOCAB_FILE] [MERGE_FILE] [CHECKPOINT_DIR]
#
# With no arguments it uses what `make run` builds under data/default. Run it again and it resumes
# from the last checkpoint. PATTERN sets the layers (M Mamba, * attention, - MLP; default M-M*M-M-);
# PATTERN=MMMMMMMM is a pure Mamba-2 model. Parallel layouts: NPROC processes split as TP x PP x DP:
#
#   NPROC=4 TP=2 PP=2 examples/pretrain_mamba.sh             # the pattern split 4 + 4 over the stages
#   NPROC=2 DISTRIBUTED_OPTIMIZER=1 examples/pretrain_mamba.sh
#
# (TP splits the Mamba heads and groups and adds --sequence-parallel.)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

DATA_PATH=${1:-data/default/python_text_document}
VOCAB_FILE=${2:-data/default/tokenizer/vocab.json}
MERGE_FILE=${3:-data/default/tokenizer/merges.txt}
CHECKPOINT_PATH=${4:-data/default/checkpoints/mamba-tiny}
PATTERN=${PATTERN:-M-M*M-M-}
NPROC=${NPROC:-1}
TP=${TP:-1}
PP=${PP:-1}

PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
if [ -n "${DISTRIBUTED_OPTIMIZER:-}" ]; then PARALLEL_ARGS+=(--use-distributed-optimizer --overlap-grad-reduce); fi

DISTRIBUTED_ARGS=(--nproc-per-node "$NPROC" --nnodes 1 --master-addr localhost --master-port "${MASTER_PORT:-29518}")

MAMBA_ARGS=(
    --num-layers "${#PATTERN}"
    --hybrid-override-pattern "$PATTERN"
    --hidden-size 128
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --mamba-state-dim 16
    --mamba-head-dim 32
    --mamba-num-groups 2
    --swiglu
    --normalization RMSNorm
    --disable-bias-linear
    --position-embedding-type none
    --untie-embeddings-and-output-weights
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
    --ckpt-format torch_dist
)
if [ -n "${TENSORBOARD_DIR:-}" ]; then
    OUTPUT_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
fi

"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_mamba.py \
    "${MAMBA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" ${EXTRA_ARGS:-}
