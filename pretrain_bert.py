"""Pretrain a BERT model (masked LM + the binary sentence-order head).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix bert --vocab-file vocab.txt         --tokenizer-type BertWordPieceLowerCase --split-sentences
    python pretrain_bert.py --num-layers 2 --hidden-size 64 ... --data-path bert_text_sentence         --vocab-file vocab.txt [--bert-no-binary-head] [--mask-prob 0.15] [--short-seq-prob 0.1]

The same machinery as pretrain_gpt.py (TP, SP, PP, DP, the distributed optimizer); the recipe:

    model_provider: BertModel (bidirectional attention under the padding mask, tokentype
        embeddings, the LM head tied to the word embeddings, the pooler and binary head unless
        --bert-no-binary-head)
    train_valid_test_datasets_provider: BERTMaskedWordPieceDataset over `_text_sentence` data
    forward_step: the masked-LM loss averaged over the masked tokens, plus the sentence-order loss,
        logged as `lm loss` and `sop loss` (Megatron's names)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the recipe lives in the package (megatron/training/recipes/bert.py); this script is its entry point
from megatron.training.recipes.bert import (  # noqa: E402,F401
    BATCH_KEYS,
    model_provider,
    get_batch,
    loss_func,
    forward_step,
    is_dataset_built_on_rank,
    train_valid_test_datasets_provider,
    main,
)

if __name__ == "__main__":
    from megatron.training.cli import run_cli

    run_cli(main, "pretrain_bert.py")  # bad input: one line and exit status 1 (MEGATRON_DEBUG=1: traceback)
