"""The built-in pretraining recipes: the functions pretrain() takes for GPT, BERT, T5 and Mamba.

Each module holds what Megatron-LM's root script of the same name holds (model_provider,
get_batch, forward_step, train_valid_test_datasets_provider, main); pretrain_gpt.py,
pretrain_bert.py, pretrain_t5.py and pretrain_mamba.py at the repository root are entry points that import them.
"""
