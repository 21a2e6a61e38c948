#!/bin/bash
# Train a tiny Mixtral-style model (the Llama layer with a mixture of experts in every MLP: 4 experts,
# top-2 routing, aux loss; Megatron-LM's examples/mixtral flags) on the built-in default corpus, on
# CPU in a few minutes.
#
#   examples/pretrain_mixtral.sh [DATA_PREFIX] [TOKENIZER_MODEL] [CHECKPOINT_DIR]
#
# With no arguments it uses the corpus `make run` builds (data/default/corpus.jsonl; built here
# if missing), trains a SentencePiece BPE tokenizer on it (tools/train_tokenizer.py, VOCAB_SIZE
# pieces) and preprocesses the corpus with that tokenizer into data/default/python_llama_*, each
# step only if its output is not there yet. Run it again and it resumes from the last
# checkpoint. CORPUS names another JSON-lines corpus for those steps; TRAIN_ITERS sets the
# length; TENSORBOARD_DIR logs TensorBoard scalars; EXTRA_ARGS passes more flags (they come
# last, so they override). It shares its data with examples/pretrain_llama.sh. Parallel layouts:
# NPROC processes split as TP x PP x DP, the experts over EP ranks of the data-parallel ones, e.g.
#
#   NPROC=4 EP=4 DISTRIBUTED_OPTIMIZER=1 examples/pretrain_mixtral.sh   # one expert per rank
#   NPROC=4 TP=2 EP=2 examples/pretrain_mixtral.sh                      # experts split over TP too
#   DISPATCHER=allgather NPROC=2 EP=2 examples/pretrain_mixtral.sh
#
# (TP adds --sequence-parallel, which MoE needs; the torch_dist checkpoint loads at any layout.)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

DATA_PATH=${1:-data/default/python_llama_text_document}
TOKENIZER_MODEL=${2:-data/default/tokenizer-llama/tokenizer.model}
CHECKPOINT_PATH=${3:-data/default/checkpoints/mixtral-tiny}
CORPUS=${CORPUS:-data/default/corpus.jsonl}
VOCAB_SIZE=${VOCAB_SIZE:-8192}
TRAIN_ITERS=${TRAIN_ITERS:-200}
NPROC=${NPROC:-1}
TP=${TP:-1}
PP=${PP:-1}
EP=${EP:-1}

# The data: corpus -> SentencePiece model -> .bin/.idx, each made once.
if [ ! -f "$CORPUS" ] && [ "$CORPUS" = data/default/corpus.jsonl ]; then
    "$PYTHON" tools/make_default_corpus.py --output "$CORPUS"
fi
if [ ! -f "$TOKENIZER_MODEL" ]; then
    "$PYTHON" tools/train_tokenizer.py --input "$CORPUS" --tokenizer-type SentencePieceTokenizer \
        --vocab-size "$VOCAB_SIZE" --output-dir "$(dirname "$TOKENIZER_MODEL")"
fi
TOKENIZER_ARGS=(--tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL")
if [ ! -f "$DATA_PATH.idx" ]; then
    # preprocess_data.py writes PREFIX_text_document.{bin,idx}
    "$PYTHON" tools/preprocess_data.py --input "$CORPUS" --output-prefix "${DATA_PATH%_text_document}" \
        "${TOKENIZER_ARGS[@]}" --append-eod --workers "${WORKERS:-2}"
fi

PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
               --expert-model-parallel-size "$EP")
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
if [ -n "${VPP:-}" ]; then PARALLEL_ARGS+=(--num-virtual-stages-per-pipeline-rank "$VPP"); fi
if [ -n "${DISTRIBUTED_OPTIMIZER:-}" ]; then PARALLEL_ARGS+=(--use-distributed-optimizer --overlap-grad-reduce); fi

DISTRIBUTED_ARGS=(--nproc-per-node "$NPROC" --nnodes 1 --master-addr localhost --master-port "${MASTER_PORT:-29519}")

# Mixtral's architecture under Megatron-LM's flag names: the Llama layer, then the experts.
MODEL_ARGS=(
    --num-layers 4
    --hidden-size 128
    --ffn-hidden-size 224
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --position-embedding-type rope
    --rotary-base 10000
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --seq-length 128
    --max-position-embeddings 128
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
)
MOE_ARGS=(
    --num-experts 4
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type "${DISPATCHER:-alltoall}"
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 16
    --lr 1.0e-3
    --train-iters "$TRAIN_ITERS"
    --lr-decay-iters "$TRAIN_ITERS"
    --lr-decay-style cosine
    --min-lr 1.0e-4
    --lr-warmup-iters $(( TRAIN_ITERS / 10 ))
    --weight-decay 0.1
    --adam-beta2 0.95
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
if [ -n "${TENSORBOARD_DIR:-}" ]; then
    OUTPUT_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
fi

"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
    ${EXTRA_ARGS:-}
