#!/bin/bash
# Supervised fine-tuning (full, or LoRA with LORA_RANK) of a Llama chat model, end to end:
#   HF Llama directory -> pretrain_gpt.py --sft --load-hf (chat JSON lines tokenized on the fly,
#   conversations packed, loss on assistant tokens) -> Megatron checkpoint -> HF directory
#   (tools/checkpoint/convert.py --saver hf) -> generation through the chat template.
#
#   examples/finetune_llama_chat.sh [HF_LLAMA_DIR] [CHAT_JSONL] [WORK_DIR]
#
# With no arguments it runs on a laptop CPU in a few minutes: the default corpus (data/default/
# corpus.jsonl, built if missing), a tiny random Llama with a ChatML tokenizer trained on that corpus
# (tools/make_chat_example.py tiny-llama) and a chat file made from the corpus's Python topics
# (tools/make_chat_example.py data: two conversations per line, each starting with its system
# message, so --sft packs them). Each step runs only if its output is not there yet.
#
# A real Llama-2-7B-chat on GPUs (docs/sft.md):
#   PROMPT_FORMAT=llama2-chat NPROC=8 TP=2 SEQ_LENGTH=4096 MICRO_BATCH=1 GLOBAL_BATCH=128 LR=2e-5 MIN_LR=2e-6 \
#   TRAIN_ITERS=1000 DISTRIBUTED_OPTIMIZER=1 BF16=1 \
#     examples/finetune_llama_chat.sh /models/Llama-2-7b-chat-hf my_chats.jsonl /scratch/sft
#
# PROMPT_FORMAT: default (the directory's tokenizer_config.json chat_template), llama2-chat, chatml
# or nemotron-h-aligned. EXTRA_ARGS passes more flags to pretrain_gpt.py (last, so they override).
#
# LoRA instead of full fine-tuning (docs/sft.md, docs/lora.md): LORA_RANK=8 [LORA_ALPHA=16] trains
# adapters on linear_qkv / linear_proj / linear_fc1 / linear_fc2 with the HF weights frozen (the
# checkpoints hold the adapters alone and point to $HF_DIR), exports them as an HF PEFT adapter
# (tools/checkpoint/convert.py --loader lora --saver peft) and chats through peft on the HF base:
#   LORA_RANK=8 examples/finetune_llama_chat.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

WORK_DIR=${3:-data/default/finetune-llama-chat}
HF_DIR=${1:-$WORK_DIR/tiny-llama-chat}
CHAT_DATA=${2:-$WORK_DIR/chat.jsonl}
CORPUS=${CORPUS:-data/default/corpus.jsonl}
PROMPT_FORMAT=${PROMPT_FORMAT:-default}
TRAIN_ITERS=${TRAIN_ITERS:-60}
SEQ_LENGTH=${SEQ_LENGTH:-256}
MICRO_BATCH=${MICRO_BATCH:-4}
GLOBAL_BATCH=${GLOBAL_BATCH:-8}
LR=${LR:-3e-3}
MIN_LR=${MIN_LR:-3e-4}
NPROC=${NPROC:-1}
TP=${TP:-1}
PP=${PP:-1}
CHECKPOINT_PATH=$WORK_DIR/checkpoints
HF_OUT=$WORK_DIR/hf-finetuned
LORA_RANK=${LORA_RANK:-0}
LORA_ARGS=()
if [ "$LORA_RANK" -gt 0 ]; then
    LORA_ARGS=(--lora-rank "$LORA_RANK" --lora-alpha "${LORA_ALPHA:-$(( 2 * LORA_RANK ))}")
    CHECKPOINT_PATH=$WORK_DIR/lora-checkpoints
    PEFT_OUT=$WORK_DIR/peft-adapter
fi

# 1. The inputs: an HF Llama directory and a chat file (made here only when not given).
if { [ ! -d "$HF_DIR" ] || [ ! -f "$CHAT_DATA" ]; } && [ ! -f "$CORPUS" ] && [ "$CORPUS" = data/default/corpus.jsonl ]; then
    "$PYTHON" tools/make_default_corpus.py --output "$CORPUS"
fi
if [ -z "${1:-}" ] && [ ! -d "$HF_DIR" ]; then
    "$PYTHON" tools/make_chat_example.py tiny-llama --input "$CORPUS" --output-dir "$HF_DIR" \
        --max-positions "$SEQ_LENGTH"
fi
if [ ! -f "$CHAT_DATA" ]; then
    "$PYTHON" tools/make_chat_example.py data --input "$CORPUS" --output "$CHAT_DATA"
fi

# 2. SFT: the architecture comes from $HF_DIR/config.json (--load-hf); the run resumes from its own
#    checkpoint in $CHECKPOINT_PATH when there is one.
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
if [ -n "${DISTRIBUTED_OPTIMIZER:-}" ]; then PARALLEL_ARGS+=(--use-distributed-optimizer); fi
PRECISION_ARGS=()
if [ -n "${BF16:-}" ]; then PRECISION_ARGS+=(--bf16); fi

SFT_ARGS=(
    --sft
    --sft-tokenizer-prompt-format "$PROMPT_FORMAT"
    --load-hf "$HF_DIR"
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "$HF_DIR"
    --data-path "$CHAT_DATA"
    --split 95,5,0
    --seq-length "$SEQ_LENGTH"
    --micro-batch-size "$MICRO_BATCH"
    --global-batch-size "$GLOBAL_BATCH"
    --lr "$LR"
    --min-lr "$MIN_LR"
    --lr-decay-style cosine
    --lr-warmup-iters $(( TRAIN_ITERS / 10 ))
    --train-iters "$TRAIN_ITERS"
    --weight-decay 0.0
    --clip-grad 1.0
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --num-workers 1
    --ckpt-format torch
    --log-interval 10
    --eval-interval "$TRAIN_ITERS"
    --eval-iters 2
    --save-interval "$TRAIN_ITERS"
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
)
SFT_ARGS+=("${LORA_ARGS[@]}")  # (LoRA: adapters on the frozen $HF_DIR weights)
if [ "$(cat "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt" 2>/dev/null)" != "$TRAIN_ITERS" ]; then
    "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --nnodes 1 --master-addr localhost \
        --master-port "${MASTER_PORT:-29528}" pretrain_gpt.py \
        "${SFT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${PRECISION_ARGS[@]}" ${EXTRA_ARGS:-}
fi

# 3. Back to HF: a full HF directory (any TP / PP the run used; the tokenizer and its chat template
#    copied; the true vocabulary, the checkpoint holds it padded, is the HF model's), or with LoRA the
#    adapter in HF PEFT's format for the base $HF_DIR.
if [ "$LORA_RANK" -gt 0 ]; then
    rm -rf "$PEFT_OUT"
    "$PYTHON" tools/checkpoint/convert.py --model-type GPT --loader lora --saver peft \
        --load-dir "$CHECKPOINT_PATH" --save-dir "$PEFT_OUT"
    CHAT_MODEL=(--model-dir "$HF_DIR" --adapter-dir "$PEFT_OUT")
else
    VOCAB_SIZE=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$HF_DIR/config.json")
    rm -rf "$HF_OUT"
    "$PYTHON" tools/checkpoint/convert.py --model-type GPT --loader megatron --saver hf \
        --load-dir "$CHECKPOINT_PATH" --save-dir "$HF_OUT" --tokenizer-dir "$HF_DIR" --true-vocab-size "$VOCAB_SIZE"
    CHAT_MODEL=(--model-dir "$HF_OUT")
fi

# 4. Generation with the chat template (transformers, greedy; peft on the base with LoRA).
"$PYTHON" tools/make_chat_example.py chat "${CHAT_MODEL[@]}" \
    --prompt "${PROMPT:-What is the Python topic 'for' about?}"
