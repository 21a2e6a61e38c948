"""megatron.legacy, the names HuggingFace Accelerate's Megatron-LM integration imports
(accelerate/utils/megatron_lm.py): every class built with Accelerate's exact call (its
model_provider_func, after its initialize(): global args without a tokenizer, orig_vocab_size and
padded_vocab_size set) is the model pretrain_bert.py / pretrain_t5.py / pretrain_gpt.py build (same
init, same keys) and computes the same outputs and losses from the batches Accelerate's
BertTrainStep / T5TrainStep make of build_train_valid_test_datasets's samples; those samples are
this project's BERT / T5 dataset samples (the T5 masks in Megatron-LM's legacy 2-D form).
Everything runs on a generated WordPiece vocabulary and `_text_sentence` dataset."""
from __future__ import annotations

import contextlib
import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from megatron.data.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
from megatron.data.indexed_dataset import IndexedDatasetBuilder
from megatron.data.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from megatron.legacy.data.dataset_utils import build_train_valid_test_datasets
from megatron.legacy.model import BertModel, Float16Module, GPTModel, T5Model
from megatron.legacy.model.classification import Classification
from megatron.model import BertModel as OurBert, GPTModel as OurGPT, T5Model as OurT5, bert_loss
from megatron.model.classification import Classification as OurClassification
from megatron.model.t5_model import t5_attention_masks
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron.training.global_vars import set_global_variables, unset_global_variables
from megatron.training.tokenizer import build_tokenizer, vocab_size_with_padding

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one intra-op thread

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_KEYS = ("text", "types", "labels", "is_random", "loss_mask", "padding_mask")  # BertTrainStep's
T5_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask", "enc_dec_mask")  # T5TrainStep's
SEQ, SEQ_DEC, SPLIT, SIZES, SEED = 32, 16, "8,1,1", [12, 4, 4], 1234


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(prefix, vocab file): 150 documents of 2-6 sentences of 3-10 words over a 200-word vocabulary."""
    root = tmp_path_factory.mktemp("legacy_data")
    (root / "vocab.txt").write_text("\n".join(SPECIALS + [f"w{i}" for i in range(200)]) + "\n")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(root / "data_text_sentence.bin"), dtype=np.uint16)
    for _ in range(150):
        sentences = [(len(SPECIALS) + rng.integers(200, size=int(rng.integers(3, 11)))).tolist()
                     for _ in range(int(rng.integers(2, 7)))]
        builder.add_document([t for s in sentences for t in s], [len(s) for s in sentences])
    builder.finalize(str(root / "data_text_sentence.idx"))
    return str(root / "data_text_sentence"), str(root / "vocab.txt")


@contextlib.contextmanager
def accelerate_globals(data, family: str, *flags: str):
    """The global args as Accelerate's initialize() leaves them: validated, set without a tokenizer,
    orig_vocab_size the tokenizer's size and padded_vocab_size padded from it."""
    prefix, vocab = data
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", "1", "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--data-path", prefix, "--split", SPLIT, "--vocab-file", vocab, "--seed", str(SEED), *flags]
    if family == "T5":
        argv += ["--decoder-seq-length", str(SEQ_DEC), "--vocab-extra-ids", "100"]
    args = parse_and_validate_args(argv=argv, args_defaults={"tokenizer_type": "BertWordPieceLowerCase",
                                                             "model_family": family})
    set_global_variables(args, build_tokenizer=False)
    args.orig_vocab_size = build_tokenizer(copy.copy(args)).vocab_size
    args.padded_vocab_size = vocab_size_with_padding(args.orig_vocab_size, args)
    try:
        yield args
    finally:
        unset_global_variables()


def _same_state(legacy: torch.nn.Module, ours: torch.nn.Module) -> None:
    """The same keys (this project's) and, built from the same seed, the same tensors."""
    theirs, own = legacy.state_dict(), ours.state_dict()
    assert list(theirs) == list(own)
    for name in own:
        assert torch.equal(theirs[name], own[name]), name


def _batch(dataset, count: int = 2) -> dict:
    return default_collate([dataset[i] for i in range(count)])


# ---------------------------------------------------------------------------------------------- models

@pytest.mark.parametrize("binary_head", [True, False], ids=["binary-head", "no-binary-head"])
def test_bert_is_pretrain_berts_model_on_accelerates_batch(data, binary_head):
    flags = () if binary_head else ("--bert-no-binary-head",)
    with accelerate_globals(data, "BERT", *flags) as args:
        config = core_transformer_config_from_args(args)
        torch.manual_seed(0)
        legacy = BertModel(config=config, num_tokentypes=2 if args.bert_binary_head else 0,  # model_provider_func
                           add_binary_head=args.bert_binary_head, parallel_output=True, pre_process=True,
                           post_process=True)
        torch.manual_seed(0)
        ours = OurBert(config, vocab_size=args.padded_vocab_size, num_tokens=args.orig_vocab_size,  # pretrain_bert's
                       max_sequence_length=args.max_position_embeddings,
                       num_tokentypes=2 if binary_head else 0, add_binary_head=binary_head)
        train, _, _ = build_train_valid_test_datasets(data_prefix=[args.data_path[0]], splits_string=args.split,
                                                      train_valid_test_num_samples=SIZES, seed=args.seed,
                                                      max_seq_length=args.seq_length, binary_head=binary_head)
    _same_state(legacy, ours)
    assert isinstance(legacy, OurBert) and legacy.num_tokens == args.orig_vocab_size
    data_b = _batch(train)  # BertTrainStep.get_batch_megatron
    tokens, types, order = data_b["text"].long(), data_b["types"].long(), data_b["is_random"].long()
    loss_mask, labels, padding = data_b["loss_mask"].float(), data_b["labels"].long(), data_b["padding_mask"].long()
    assert (labels == -1).any()
    types = types if binary_head else None
    lm_loss, sop_logits = legacy(tokens, padding, tokentype_ids=types, lm_labels=labels)
    # BertTrainStep's loss_func_pretrain
    lm = torch.sum(lm_loss.float().view(-1) * loss_mask.reshape(-1)) / loss_mask.sum()
    loss = lm + F.cross_entropy(sop_logits.view(-1, 2).float(), order.view(-1), ignore_index=-1) \
        if binary_head else lm
    own_lm_loss, own_binary = ours(tokens, padding, tokentype_ids=types, lm_labels=labels)
    own_loss, _ = bert_loss(own_lm_loss, own_binary, loss_mask, order)  # pretrain_bert.py's loss_func
    assert torch.equal(lm_loss * loss_mask, own_lm_loss * loss_mask)
    assert torch.equal(loss, own_loss) and torch.isfinite(loss)
    assert (sop_logits is None) == (not binary_head)
    if binary_head:
        assert torch.equal(sop_logits, own_binary)
    logits, _ = legacy(tokens, padding, tokentype_ids=types)
    assert logits.shape == (2, SEQ, args.padded_vocab_size)
    assert torch.equal(logits, ours(tokens, padding, tokentype_ids=types)[0])


def test_t5_is_pretrain_t5s_model_on_accelerates_batch(data):
    with accelerate_globals(data, "T5") as args:
        config = core_transformer_config_from_args(args)
        torch.manual_seed(0)
        legacy = T5Model(config=config, num_tokentypes=0, parallel_output=True, pre_process=True,  # model_provider_func
                         post_process=True, add_encoder=True, add_decoder=True)
        torch.manual_seed(0)
        ours = OurT5(config, vocab_size=args.padded_vocab_size, num_tokens=args.orig_vocab_size,  # pretrain_t5's
                     max_sequence_length=args.max_position_embeddings)
        train, _, _ = build_train_valid_test_datasets(data_prefix=[args.data_path[0]], splits_string=args.split,
                                                      train_valid_test_num_samples=SIZES, seed=args.seed,
                                                      max_seq_length=args.encoder_seq_length,
                                                      max_seq_length_dec=args.decoder_seq_length, dataset_type="t5")
    _same_state(legacy, ours)
    data_b = _batch(train)  # T5TrainStep.get_batch_megatron
    tokens_enc, tokens_dec = data_b["text_enc"].long(), data_b["text_dec"].long()
    labels, loss_mask = data_b["labels"].long(), data_b["loss_mask"].float()
    enc_mask, dec_mask, enc_dec_mask = (data_b[k] < 0.5 for k in ("enc_mask", "dec_mask", "enc_dec_mask"))
    assert enc_mask.shape == (2, SEQ, SEQ) and (labels == -1).any()
    output = legacy(tokens_enc, tokens_dec, enc_mask, dec_mask, enc_dec_mask, tokentype_ids=None, lm_labels=labels)
    loss = torch.sum(output.float().view(-1) * loss_mask.reshape(-1)) / loss_mask.sum()  # T5TrainStep's loss_func
    # pretrain_t5.py's get_batch and forward_step on the project's own samples of the same data
    own = _batch(train.dataset)
    masks = t5_attention_masks(own["enc_mask"], own["dec_mask"])
    own_output = ours(own["text_enc"], own["text_dec"], *masks, lm_labels=own["labels"].clamp(min=0))
    own_loss = torch.sum(own_output.view(-1) * own["loss_mask"].float().reshape(-1)) / own["loss_mask"].sum()
    assert torch.equal(output * loss_mask, own_output * loss_mask)
    assert torch.equal(loss, own_loss) and torch.isfinite(loss)
    logits = legacy(tokens_enc, tokens_dec, enc_mask, dec_mask, enc_dec_mask)
    assert logits.shape == (2, SEQ_DEC, args.padded_vocab_size)
    assert torch.equal(logits, ours(own["text_enc"], own["text_dec"], *masks))


def test_classification_logits_and_loss(data):
    with accelerate_globals(data, "BERT") as args:
        config = core_transformer_config_from_args(args)
        torch.manual_seed(0)
        legacy = Classification(config=config, num_classes=3, num_tokentypes=2, pre_process=True,
                                post_process=True)  # model_provider_func, fine-tuning
        torch.manual_seed(0)
        ours = OurClassification(config, 3, args.padded_vocab_size, args.max_position_embeddings,
                                 num_tokens=args.orig_vocab_size)
        torch.manual_seed(1)
        pretrained = BertModel(config)
    _same_state(legacy, ours)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, args.orig_vocab_size, (4, SEQ), generator=generator)
    padding = torch.ones(4, SEQ, dtype=torch.long)
    padding[1, 20:] = 0
    labels = torch.tensor([0, 2, 1, 2])
    logits = legacy(tokens, padding, tokentype_ids=None)  # BertTrainStep, fine-tuning: no types
    assert logits.shape == (4, 3)
    assert torch.equal(logits, ours(tokens, padding))
    loss = torch.nn.CrossEntropyLoss()(logits.view(-1, 3), labels.view(-1))  # loss_func_finetune
    loss.backward()
    assert torch.isfinite(loss) and legacy.classification_head.weight.grad.abs().sum() > 0
    legacy.load_state_dict(pretrained.state_dict())  # a pretraining checkpoint: the trunk loads, the head stays
    trunk = {k: v for k, v in pretrained.state_dict().items() if k.startswith(("embedding.", "encoder.", "pooler."))}
    assert all(torch.equal(legacy.state_dict()[k], v) for k, v in trunk.items())


def test_gpt_is_pretrain_gpts_model(data):
    with accelerate_globals(data, "GPT", "--position-embedding-type", "rope") as args:
        config = core_transformer_config_from_args(args)
        torch.manual_seed(0)
        legacy = GPTModel(config, num_tokentypes=0, parallel_output=True, pre_process=True, post_process=True)
        torch.manual_seed(0)
        ours = OurGPT(config, vocab_size=args.padded_vocab_size, num_tokens=args.orig_vocab_size,
                      max_sequence_length=args.max_position_embeddings, position_embedding_type="rope")
    _same_state(legacy, ours)
    tokens = torch.randint(0, args.orig_vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(SEQ).expand(2, SEQ)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    labels = tokens.roll(-1, dims=1)
    assert torch.equal(legacy(tokens, positions, causal, labels=labels), ours(tokens, positions, causal, labels=labels))
    assert torch.equal(legacy(tokens, positions, None), ours(tokens, positions, None))


def test_bert_pipeline_stages_through_set_input_tensor(data):
    """A first stage (post_process=False) hands its hidden states to a last stage (pre_process=False)
    through set_input_tensor, as the schedules do: the loss of the whole model. (Without pipeline
    groups each stage holds config.num_layers layers: two stages of 2 make the whole model of 4.)"""
    with accelerate_globals(data, "BERT") as args:
        config = core_transformer_config_from_args(args)  # 2 layers
        whole = BertModel(dataclasses.replace(config, num_layers=4))
        first = BertModel(config, post_process=False)
        last = BertModel(config, pre_process=False)
    state = whole.state_dict()
    first.load_state_dict({k: v for k, v in state.items() if k in first.state_dict()})
    later = {k.replace(f"encoder.layers.{i + 2}.", f"encoder.layers.{i}."): v for k, v in state.items()
             for i in range(2) if k.startswith(f"encoder.layers.{i + 2}.")}
    last.load_state_dict({**{k: v for k, v in state.items() if k in last.state_dict()}, **later,
                          "output_layer.weight": state["embedding.word_embeddings.weight"]})
    tokens = torch.randint(0, args.orig_vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    padding = torch.ones(2, SEQ, dtype=torch.long)
    padding[0, 25:] = 0
    types = (torch.arange(SEQ) >= 10).long().expand(2, SEQ)
    labels = tokens.flip(1)
    hidden = first(tokens, padding, tokentype_ids=types)
    assert hidden.shape == (SEQ, 2, 32)
    last.set_input_tensor([hidden])
    staged = last(None, padding, lm_labels=labels)
    expected = whole(tokens, padding, tokentype_ids=types, lm_labels=labels)
    for got, want in zip(staged, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_float16_module_wraps_a_legacy_model(data):
    with accelerate_globals(data, "BERT", "--bf16") as args:
        config = core_transformer_config_from_args(args)
        model = Float16Module(config, BertModel(config))
    tokens = torch.randint(0, args.orig_vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(4))
    lm_loss, binary_logits = model(tokens, torch.ones(2, SEQ, dtype=torch.long), lm_labels=tokens)
    assert lm_loss.dtype == binary_logits.dtype == torch.float32
    assert next(model.module.parameters()).dtype == torch.bfloat16
    assert "embedding.word_embeddings.weight" in model.state_dict()


# ---------------------------------------------------------------------------------------------- data

def test_bert_samples_are_the_projects_samples(data):
    prefix, vocab = data
    with accelerate_globals(data, "BERT") as args:
        datasets = build_train_valid_test_datasets(data_prefix=[prefix], splits_string=SPLIT,  # Accelerate's call
                                                   train_valid_test_num_samples=SIZES, seed=SEED,
                                                   max_seq_length=SEQ, binary_head=True)
        tokenizer = build_tokenizer(copy.copy(args))
    config = BERTMaskedWordPieceDatasetConfig(random_seed=SEED, sequence_length=SEQ, blend=([prefix], None),
                                              split=SPLIT, tokenizer=tokenizer, masking_max_ngram=3,
                                              classification_head=True)
    expected = BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, SIZES, None, config).build()
    for legacy, own in zip(datasets, expected):
        assert len(legacy) == len(own) >= 4
        for i in range(len(own)):
            sample, reference = legacy[i], own[i]
            assert set(BERT_KEYS) <= set(sample) and sample.keys() == reference.keys()
            for key in reference:
                assert np.array_equal(sample[key], reference[key]), (i, key)


def test_t5_samples_are_the_projects_samples_with_legacy_masks(data):
    prefix, vocab = data
    with accelerate_globals(data, "T5") as args:
        datasets = build_train_valid_test_datasets(data_prefix=[prefix], splits_string=SPLIT,  # Accelerate's call
                                                   train_valid_test_num_samples=SIZES, seed=SEED, max_seq_length=SEQ,
                                                   max_seq_length_dec=SEQ_DEC, dataset_type="t5")
        tokenizer = build_tokenizer(copy.copy(args))
    config = T5MaskedWordPieceDatasetConfig(random_seed=SEED, sequence_length=SEQ, sequence_length_decoder=SEQ_DEC,
                                            blend=([prefix], None), split=SPLIT, tokenizer=tokenizer)
    expected = BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, SIZES, None, config).build()
    for legacy, own in zip(datasets, expected):
        assert len(legacy) == len(own) >= 4
        for i in range(len(own)):
            sample, reference = legacy[i], own[i]
            assert set(T5_KEYS) <= set(sample)
            for key in ("text_enc", "text_dec", "labels", "loss_mask", "truncated"):
                assert np.array_equal(sample[key], reference[key]), (i, key)
            enc, dec = torch.as_tensor(reference["enc_mask"])[None], torch.as_tensor(reference["dec_mask"])[None]
            masked_out = t5_attention_masks(enc, dec)  # pretrain_t5.py's masks, True = masked out
            assert sample["enc_mask"].shape == (SEQ, SEQ) and sample["enc_dec_mask"].shape == (SEQ_DEC, SEQ)
            for key, mask in zip(("enc_mask", "dec_mask", "enc_dec_mask"), masked_out):
                assert sample[key].dtype == np.int64
                assert torch.equal(torch.as_tensor(sample[key]) < 0.5, mask[0, 0]), (i, key)


# ---------------------------------------------------------------------------------------------- errors

def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_bad_input_is_one_line(data):
    config = core_transformer_config_from_args(parse_and_validate_args(argv=[
        "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer"]))
    with pytest.raises(RuntimeError) as error:
        BertModel(config)
    assert "initialize_megatron()" in _one_line(error)
    with pytest.raises(RuntimeError) as error:
        build_train_valid_test_datasets([data[0]], SPLIT, SIZES, SEQ, SEED)
    assert "initialize_megatron()" in _one_line(error)
    with accelerate_globals(data, "T5") as args:
        config = core_transformer_config_from_args(args)
        with pytest.raises(ValueError) as error:
            T5Model(config, num_tokentypes=2)
        assert "num_tokentypes=2" in _one_line(error)
        with pytest.raises(ValueError) as error:
            build_train_valid_test_datasets([data[0]], SPLIT, SIZES, SEQ, SEED, dataset_type="ict")
        assert "'ict'" in _one_line(error)
        with pytest.raises(ValueError) as error:
            build_train_valid_test_datasets([data[0]], SPLIT, SIZES, SEQ, SEED, dataset_type="t5")
        assert "--decoder-seq-length" in _one_line(error)
