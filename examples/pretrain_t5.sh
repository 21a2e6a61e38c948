#!/bin/bash
# Train a tiny T5 (span corruption) on the built-in default corpus, on CPU in a few minutes.
#
#   examples/pretrain_t5.sh [DATA_PREFIX] [VOCAB_FILE] [CHECKPOINT_DIR]
#
# With no arguments it uses the corpus `make run` builds (data/default/corpus.jsonl; built here
# if missing), trains a WordPiece vocabulary on it (tools/train_tokenizer.py, VOCAB_SIZE tokens)
# and preprocesses the corpus into sentences with it (--split-sentences: NLTK's punkt_tab data
# must be installed, or NLTK_DATA point at it) into data/default/python_t5_text_sentence, each
# step only if its output is not there yet (the BERT example's vocabulary serves T5 as well:
# the tokenizer adds the 100 sentinels <extra_id_i> of --vocab-extra-ids itself). Run it again and
# it resumes from the last checkpoint. CORPUS names another JSON-lines corpus; TRAIN_ITERS sets the
# length; POSITIONS=relative trains T5's relative position buckets instead of Megatron's learned
# positions; EXTRA_ARGS passes more flags (they come last, so they override). Parallel layouts:
# NPROC processes split as TP x PP x DP; with PP > 1 the first SPLIT stages (PP / 2 by default) run
# the encoder and the rest the decoder (--pipeline-model-parallel-split-rank), e.g.
#
#   NPROC=2 TP=2 examples/pretrain_t5.sh          # with sequence parallelism
#   NPROC=2 PP=2 examples/pretrain_t5.sh          # encoder on rank 0, decoder on rank 1
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

DATA_PATH=${1:-data/default/python_t5_text_sentence}
VOCAB_FILE=${2:-data/default/tokenizer-bert/vocab.txt}
CHECKPOINT_PATH=${3:-data/default/checkpoints/t5-tiny}
CORPUS=${CORPUS:-data/default/corpus.jsonl}
VOCAB_SIZE=${VOCAB_SIZE:-8192}
TRAIN_ITERS=${TRAIN_ITERS:-200}
NPROC=${NPROC:-1}
TP=${TP:-1}
PP=${PP:-1}

# The data: corpus -> WordPiece vocab.txt -> sentence-level .bin/.idx, each made once.
if [ ! -f "$CORPUS" ] && [ "$CORPUS" = data/default/corpus.jsonl ]; then
    "$PYTHON" tools/make_default_corpus.py --output "$CORPUS"
fi
if [ ! -f "$VOCAB_FILE" ]; then
    "$PYTHON" tools/train_tokenizer.py --input "$CORPUS" --tokenizer-type BertWordPieceLowerCase \
        --vocab-size "$VOCAB_SIZE" --output-dir "$(dirname "$VOCAB_FILE")"
fi
TOKENIZER_ARGS=(--tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB_FILE")
if [ ! -f "$DATA_PATH.idx" ]; then
    # preprocess_data.py --split-sentences writes PREFIX_text_sentence.{bin,idx}
    "$PYTHON" tools/preprocess_data.py --input "$CORPUS" --output-prefix "${DATA_PATH%_text_sentence}" \
        "${TOKENIZER_ARGS[@]}" --split-sentences --workers "${WORKERS:-2}"
fi

PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
if [ "$PP" -gt 1 ]; then PARALLEL_ARGS+=(--pipeline-model-parallel-split-rank "${SPLIT:-$((PP / 2))}"); fi
DISTRIBUTED_ARGS=(--nproc-per-node "$NPROC" --nnodes 1 --master-addr localhost --master-port "${MASTER_PORT:-29521}")

# Megatron's T5 (examples/t5/train_t5_220m.sh, smaller): an encoder and a decoder of --num-layers
# each, learned positions covering both lengths, 100 sentinels. The decoder holds BOS, a sentinel
# per masked span and the masked tokens: 1 + 2 x floor(0.15 x (128 - 2)) = 37 at most.
T5_ARGS=(
    --num-layers 2
    --hidden-size 128
    --num-attention-heads 4
    --kv-channels 32
    --ffn-hidden-size 512
    --encoder-seq-length 128
    --decoder-seq-length 40
    --max-position-embeddings 128
    --position-embedding-type "${POSITIONS:-learned_absolute}"
    --vocab-extra-ids 100
    --attention-dropout 0.1
    --hidden-dropout 0.1
    --init-method-std 0.02
    --mask-prob 0.15
    --short-seq-prob 0.1
)

TRAINING_ARGS=(
    --micro-batch-size 8
    --global-batch-size 16
    --lr 1.0e-3
    --train-iters "$TRAIN_ITERS"
    --lr-decay-iters "$TRAIN_ITERS"
    --lr-decay-style linear
    --min-lr 1.0e-5
    --lr-warmup-fraction 0.01
    --weight-decay 0.01
    --clip-grad 1.0
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    "${TOKENIZER_ARGS[@]}"
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

"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_t5.py \
    "${T5_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
    ${EXTRA_ARGS:-}
