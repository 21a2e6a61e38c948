"""What test modules share. A test module (tests/**/test_*.py) never imports another one
(tests/unit/test_tests_import_no_tests.py checks it); what two of them need lives here.

paths                   ROOT, the repository root
args                    run_args (the parser's defaults under given values), architecture_defaults
launch                  run_cli (python ... from ROOT), torchrun (pretrain_gpt.py), free_port
training                tiny pretrain_gpt.py flag sets (TINY, MOCK, COMMON) and their log's parsing (LOG_LINE,
                        log_lines, losses, logged_losses, logged_grad_norms, COUNT, TOTAL, VALIDATION)
data                    JSONL written, preprocessed datasets read back, the tiny GPT-2 of the Accelerate example
checkpoints             TinyGPT / TinyOptimizer / TinyScheduler stand-ins (make_args, build, model_file,
                        assert_same_weights); pretrain / pretrain_error, DistributedPool tasks
convert                 checkpoint conversion: the tiny GPTs' FLAGS and legacy_args, run_convert, save_hf,
                        llama31_rope
hf_models               tiny random HF transformers models and our GPTModel built from them
fused_kernels           relative-error asserts, seeded leaves, the per-kernel cases of the fused-kernel tests
tp_gpt                  the 2-layer GPT of the tensor-parallel tests; gather, relative_error,
                        errors_against_serial
dp_gpt                  the 4-layer GPT of the data-parallel tests: microbatches, forward_step, train,
                        make_optimizer
pp_gpt                  the 8-layer GPT of the pipeline tests: build_chunks, microbatches, run, serial_name
tp_pp_bert              the BertModel of the TP / PP tests and compare_stages_with_serial
groups                  explicit data-parallel groups in the 4-rank DistributedPool (dp_group, destroy_groups)
mcore_reference         run_mcore: a snippet run by megatron-core from PyPI (the numerical reference)
padded_vocab_reference  megatron-core's side of the padded-vocabulary loss tests
saver_faults            faults injected into the HF saver's weight rules
finetune_launcher       run_task: a fine-tuning task (tasks/main.py or its stand-in) in this process

The model modules' functions run inside DistributedPool workers (tests/parallel/harness.py, which
stays beside its conftest.py); the workers import them by name. Fixtures stay in conftest.py files
(default_pipeline: tests/functional/conftest.py); tests/conftest.py registers this package for
pytest's assert rewriting.
"""
