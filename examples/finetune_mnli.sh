#!/bin/bash
# Fine-tune the tiny BERT that examples/pretrain_bert.sh trains on MNLI (or QQP: TASK=QQP), on CPU,
# with Megatron-LM's tasks/main.py flags.
#
#   examples/finetune_mnli.sh [PRETRAINED_CHECKPOINT] [VOCAB_FILE] [DATA_DIR] [CHECKPOINT_DIR]
#
# DATA_DIR holds GLUE's files: MNLI/train.tsv, MNLI/dev_matched.tsv, MNLI/dev_mismatched.tsv (QQP:
# QQP/train.tsv, QQP/dev.tsv). Without them (the default data/default/tasks) the script writes small
# ones in those formats from the default corpus (tools/make_task_fixtures.py: labels by a rule a small
# BERT learns; there is no offline copy of GLUE). The defaults are pretrain_bert.sh's checkpoint and
# vocabulary, and its model flags; run pretrain_bert.sh first. Run again and it resumes from
# CHECKPOINT_DIR (--load). EPOCHS sets --epochs (0: evaluation only), EXTRA_ARGS passes more flags
# (last, so they override). Parallel layouts: NPROC processes split as TP x PP x DP, e.g.
#
#   NPROC=2 TP=2 examples/finetune_mnli.sh
#   NPROC=2 PP=2 examples/finetune_mnli.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

PRETRAINED_CHECKPOINT=${1:-data/default/checkpoints/bert-tiny}
VOCAB_FILE=${2:-data/default/tokenizer-bert/vocab.txt}
DATA_DIR=${3:-data/default/tasks}
TASK=${TASK:-MNLI}
CHECKPOINT_PATH=${4:-data/default/checkpoints/bert-tiny-${TASK,,}}
CORPUS=${CORPUS:-data/default/corpus.jsonl}
NPROC=${NPROC:-1}
TP=${TP:-1}
PP=${PP:-1}

if [ "$TASK" = MNLI ]; then
    TRAIN_DATA=("$DATA_DIR/MNLI/train.tsv")
    VALID_DATA=("$DATA_DIR/MNLI/dev_matched.tsv" "$DATA_DIR/MNLI/dev_mismatched.tsv")
else
    TRAIN_DATA=("$DATA_DIR/QQP/train.tsv")
    VALID_DATA=("$DATA_DIR/QQP/dev.tsv")
fi
if [ ! -f "${TRAIN_DATA[0]}" ]; then
    if [ ! -f "$CORPUS" ] && [ "$CORPUS" = data/default/corpus.jsonl ]; then
        "$PYTHON" tools/make_default_corpus.py --output "$CORPUS"
    fi
    "$PYTHON" tools/make_task_fixtures.py --corpus "$CORPUS" --output-dir "$DATA_DIR" --train "${FIXTURE_ROWS:-512}"
fi

PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
DISTRIBUTED_ARGS=(--nproc-per-node "$NPROC" --nnodes 1 --master-addr localhost --master-port "${MASTER_PORT:-29521}")

# The model flags of the pretrained BERT (pretrain_bert.sh's); --seq-length may be shorter.
COMMON_TASK_ARGS=(
    --num-layers 4
    --hidden-size 128
    --num-attention-heads 4
    --seq-length 128
    --max-position-embeddings 128
    --tokenizer-type BertWordPieceLowerCase
    --vocab-file "$VOCAB_FILE"
)

# Megatron-LM's README flags for MNLI (its 5e-5 learning rate is for a 345M BERT; the tiny one
# and the fixture's rule take a larger one).
COMMON_TASK_ARGS_EXT=(
    --train-data "${TRAIN_DATA[@]}"
    --valid-data "${VALID_DATA[@]}"
    --pretrained-checkpoint "$PRETRAINED_CHECKPOINT"
    --save-interval 10000
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --log-interval 10
    --eval-interval 1000
    --eval-iters 10
    --weight-decay 1.0e-1
)

"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" tasks/main.py \
    --task "$TASK" \
    "${COMMON_TASK_ARGS[@]}" "${COMMON_TASK_ARGS_EXT[@]}" "${PARALLEL_ARGS[@]}" \
    --epochs "${EPOCHS:-3}" \
    --micro-batch-size 8 \
    --lr 2.0e-3 \
    --lr-warmup-fraction 0.065 \
    --num-workers 0 \
    ${EXTRA_ARGS:-}
