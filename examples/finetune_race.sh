#!/bin/bash
# Fine-tune the tiny BERT that examples/pretrain_bert.sh trains on RACE, on CPU, with Megatron-LM's
# tasks/main.py flags.
#
#   examples/finetune_race.sh [PRETRAINED_CHECKPOINT] [VOCAB_FILE] [DATA_DIR] [CHECKPOINT_DIR]
#
# DATA_DIR holds RACE's tree: RACE/{train,dev}/{middle,high}/*.txt (one JSON document per file).
# Without it (the default data/default/tasks) the script writes a small one in that format from the
# default corpus (tools/make_task_fixtures.py: the answer's option carries a marker word; there is no
# offline copy of RACE). The defaults are pretrain_bert.sh's checkpoint, vocabulary and model flags;
# run pretrain_bert.sh first. Run again and it resumes from CHECKPOINT_DIR (--load). EPOCHS sets
# --epochs (0: evaluation only), EXTRA_ARGS passes more flags (last, so they override). Parallel
# layouts: NPROC processes split as TP x PP x DP, e.g. NPROC=2 TP=2 examples/finetune_race.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

PRETRAINED_CHECKPOINT=${1:-data/default/checkpoints/bert-tiny}
VOCAB_FILE=${2:-data/default/tokenizer-bert/vocab.txt}
DATA_DIR=${3:-data/default/tasks}
CHECKPOINT_PATH=${4:-data/default/checkpoints/bert-tiny-race}
CORPUS=${CORPUS:-data/default/corpus.jsonl}
NPROC=${NPROC:-1}
TP=${TP:-1}
PP=${PP:-1}

TRAIN_DATA=("$DATA_DIR/RACE/train/middle" "$DATA_DIR/RACE/train/high")
VALID_DATA=("$DATA_DIR/RACE/dev/middle" "$DATA_DIR/RACE/dev/high")
if [ ! -d "${TRAIN_DATA[0]}" ]; then
    if [ ! -f "$CORPUS" ] && [ "$CORPUS" = data/default/corpus.jsonl ]; then
        "$PYTHON" tools/make_default_corpus.py --output "$CORPUS"
    fi
    "$PYTHON" tools/make_task_fixtures.py --corpus "$CORPUS" --output-dir "$DATA_DIR" --train "${FIXTURE_ROWS:-512}"
fi

PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
DISTRIBUTED_ARGS=(--nproc-per-node "$NPROC" --nnodes 1 --master-addr localhost --master-port "${MASTER_PORT:-29522}")

# The model flags of the pretrained BERT (pretrain_bert.sh's).
COMMON_TASK_ARGS=(
    --num-layers 4
    --hidden-size 128
    --num-attention-heads 4
    --seq-length 128
    --max-position-embeddings 128
    --tokenizer-type BertWordPieceLowerCase
    --vocab-file "$VOCAB_FILE"
)

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

# Megatron-LM's README flags for RACE (micro-batch 4 questions: 16 sequences; its 1e-5 learning
# rate is for a 345M BERT).
"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" tasks/main.py \
    --task RACE \
    "${COMMON_TASK_ARGS[@]}" "${COMMON_TASK_ARGS_EXT[@]}" "${PARALLEL_ARGS[@]}" \
    --epochs "${EPOCHS:-3}" \
    --micro-batch-size 4 \
    --lr 2.0e-3 \
    --lr-warmup-fraction 0.06 \
    --clip-grad 1.0 \
    --hidden-dropout 0.1 \
    --attention-dropout 0.1 \
    --num-workers 0 \
    ${EXTRA_ARGS:-}
