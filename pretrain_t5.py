"""Pretrain a T5 model (span corruption: the encoder reads the text with a sentinel per masked
span, the decoder writes the spans).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix t5 --vocab-file vocab.txt         --tokenizer-type BertWordPieceLowerCase --split-sentences
    python pretrain_t5.py --num-layers 2 --hidden-size 64 ... --encoder-seq-length 512         --decoder-seq-length 128 --max-position-embeddings 512 --vocab-extra-ids 100         --data-path t5_text_sentence --vocab-file vocab.txt [--position-embedding-type relative]

The same machinery as pretrain_gpt.py (TP, SP, DP, the distributed optimizer) and Megatron's
encoder-decoder pipelines (--pipeline-model-parallel-split-rank S: stages [0, S) the encoder,
[S, PP) the decoder; docs/parallelism.md); the recipe:

    model_provider: T5Model (shared embeddings, bidirectional encoder, causal decoder with
        cross-attention, the LM head tied to the embeddings with its own bias); learned absolute
        positions (Megatron's default) or --position-embedding-type relative (T5's buckets,
        --relative-attention-num-buckets / --relative-attention-max-distance)
    train_valid_test_datasets_provider: T5MaskedWordPieceDataset over `_text_sentence` data
    forward_step: the per-token LM loss of the labels, averaged over loss_mask (pretrain_gpt's
        loss_func, as Megatron's pretrain_t5.py), logged as `lm loss`

Lengths: --seq-length (Megatron's --encoder-seq-length) is the encoder's, --decoder-seq-length the
decoder's; --max-position-embeddings must cover both with learned positions.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the recipe lives in the package (megatron/training/recipes/t5.py); this script is its entry point
from megatron.training.recipes.t5 import (  # noqa: E402,F401
    BATCH_KEYS,
    T5_ARGS_DEFAULTS,
    model_provider,
    get_batch,
    forward_step,
    is_dataset_built_on_rank,
    train_valid_test_datasets_provider,
    add_t5_args,
    main,
)

if __name__ == "__main__":
    from megatron.training.cli import run_cli

    run_cli(main, "pretrain_t5.py")  # bad input: one line and exit status 1 (MEGATRON_DEBUG=1: traceback)
