#!/bin/bash
# Train the tiny GPT of examples/pretrain_gpt.sh on several nodes: run this script once on every node.
#
#   examples/pretrain_gpt_distributed.sh [DATA_PREFIX] [VOCAB_FILE] [MERGE_FILE] [CHECKPOINT_DIR]
#
# As in Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, the launch is described by
#   GPUS_PER_NODE  processes per node (default 2; on CPU each is a process with gloo)
#   NNODES         number of nodes (default 1)
#   NODE_RANK      this node's index, 0 .. NNODES-1 (default 0)
#   MASTER_ADDR    address of node 0, reachable from every node (default localhost)
#   MASTER_PORT    a free port on node 0 (default 6000)
# and the layout by TP (default GPUS_PER_NODE: tensor parallelism inside a node) and PP (default 1);
# DP = GPUS_PER_NODE x NNODES / (TP x PP). Rank 0 prints how the groups fall on the nodes and warns
# when a tensor-parallel group spans nodes (docs/parallelism.md, "Several nodes").
#
# Two "nodes" on one machine (two shells, or one with &):
#
#   NNODES=2 NODE_RANK=0 examples/pretrain_gpt_distributed.sh &
#   NNODES=2 NODE_RANK=1 examples/pretrain_gpt_distributed.sh         # TP = 2 per node, DP = 2 across
#
# With RDZV_ID set, torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT replaces the fixed
# node ranks (nodes may start in any order; torchrun numbers them). Pass more flags in EXTRA_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

GPUS_PER_NODE=${GPUS_PER_NODE:-2}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-$GPUS_PER_NODE}
PP=${PP:-1}

DATA_PATH=${1:-data/default/python_text_document}
VOCAB_FILE=${2:-data/default/tokenizer/vocab.json}
MERGE_FILE=${3:-data/default/tokenizer/merges.txt}
CHECKPOINT_PATH=${4:-data/default/checkpoints/gpt-tiny-distributed}

DISTRIBUTED_ARGS=(--nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES")
if [ -n "${RDZV_ID:-}" ]; then
    DISTRIBUTED_ARGS+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID")
else
    DISTRIBUTED_ARGS+=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi

PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi

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

# The checkpoint directory must be one every node sees (a shared file system): each rank
# writes its own shards of the torch_dist checkpoint there.
OUTPUT_ARGS=(
    --log-interval 10
    --save-interval 100
    --eval-interval 50
    --eval-iters 5
    --ckpt-format torch_dist
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
)

"$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${GPT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" ${EXTRA_ARGS:-}
