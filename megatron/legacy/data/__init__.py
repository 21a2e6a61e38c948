"""Megatron-LM's legacy data entry point (dataset_utils.build_train_valid_test_datasets for BERT and T5)
over megatron/data's datasets."""
