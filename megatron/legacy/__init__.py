"""Megatron-LM's `megatron.legacy` package names, as thin adapters over this project's models and datasets.

HuggingFace Accelerate's Megatron-LM integration (accelerate/utils/megatron_lm.py) and older
Megatron scripts import these:

    megatron.legacy.model          GPTModel, BertModel, T5Model, Float16Module, Classification
    megatron.legacy.data.dataset_utils   build_train_valid_test_datasets (BERT and T5 samples)

Like Megatron-LM's legacy classes they take only the TransformerConfig and the stage flags and read
the rest (vocabulary, sequence length, tokenizer) from the global args that initialize_megatron()
sets. They are subclasses of megatron.model's classes, built as pretrain_bert.py / pretrain_t5.py /
pretrain_gpt.py build theirs: same numbers, same state-dict keys, so checkpoints move freely between
the two. docs/bert_t5.md lists the mapping.
"""
