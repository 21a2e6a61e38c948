"""The features of Accelerate's Megatron-LM guide beyond its pretraining example, written as the
guide writes them, for tests/functional/test_accelerate_guide.py.

    torchrun ... -m megatron.training.accelerate_launch guide_features.py CONFIG.json

CONFIG (JSON): feature (gpt | indexed | resume | bert | t5 | hf_checkpoint), model_dir, out (a JSON file the main
process writes with what it measured), steps, and per feature:
  gpt      the guide's GPTTrainStepWithCustomLoss (key-token-weighted loss; at TP = PP = 1 also the
           same loss computed directly from the model's logits), `other_megatron_args`, then
           `megatron_generate` in the guide's modes;
  indexed  MegatronLMDummyDataLoader over `data_path` (.bin/.idx), the guide's `while` loop
           (ranks other than TP rank 0 get no dataloader), return_logits on evaluation;
  resume   phase full | first | second: `steps` steps; or half of them and save_state to `ckpt`;
           or load_state from `ckpt` and the other half. Evaluation returns logits
           (return_logits), gathered over DP, with the directly computed loss;
  bert, t5 a tiny MegatronBert / T5 through prepare: train, evaluate;
  hf_checkpoint  the guide's recipe: an HF GPT-2 (`hf_dir`) converted to Megatron (`megatron_dir`,
           `release` renamed to `iter_0000000`), loaded with load_state and no optimizer state: its
           loss against the HF model's own.
The script's arguments are one positional file: MegatronLMDummyDataLoader parses sys.argv with
Megatron's data flags, which options of the script's own could abbreviate.
"""

import itertools
import json
import os
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, MegatronBertConfig,
                          MegatronBertForMaskedLM, T5Config, T5ForConditionalGeneration, default_data_collator)

from accelerate import Accelerator
from accelerate.utils import (GPTTrainStep, MegatronLMDummyDataLoader, MegatronLMDummyScheduler, MegatronLMPlugin,
                              avg_losses_across_data_parallel_group)
from accelerate.utils.megatron_lm import gather_across_data_parallel_groups

CONFIG = json.load(open(sys.argv[1]))
TEXTS = ["The purpose of life is", "Are you human?", "The arsenal was constructed at the request of",
         "How are you doing these days?"]


# ---------------------------------------------------------------- the guide's custom train step, as it writes it

class GPTTrainStepWithCustomLoss(GPTTrainStep):
    def __init__(self, megatron_args, **kwargs):
        super().__init__(megatron_args)
        self.kwargs = kwargs

    def get_loss_func(self):
        def loss_func(inputs, loss_mask, output_tensor):
            batch_size, seq_length = output_tensor.shape
            losses = output_tensor.float()
            loss_mask = loss_mask.view(-1).float()
            loss = losses.view(-1) * loss_mask

            # Resize and average loss per sample
            loss_per_sample = loss.view(batch_size, seq_length).sum(axis=1)
            loss_mask_per_sample = loss_mask.view(batch_size, seq_length).sum(axis=1)
            loss_per_sample = loss_per_sample / loss_mask_per_sample

            # Calculate and scale weighting
            weights = torch.stack([(inputs == kt).float() for kt in self.kwargs["keytoken_ids"]]).sum(axis=[0, 2])
            weights = 1.0 + self.kwargs["alpha"] * weights
            # Calculate weighted average
            weighted_loss = (loss_per_sample * weights).mean()

            # Reduce loss across data parallel groups
            averaged_loss = avg_losses_across_data_parallel_group([weighted_loss])

            return weighted_loss, {"lm loss": averaged_loss[0]}

        return loss_func

    def get_forward_step_func(self):
        def forward_step(data_iterator, model):
            """Forward step."""
            # Get the batch.
            tokens, labels, loss_mask, attention_mask, position_ids = self.get_batch(data_iterator)
            output_tensor = model(tokens, position_ids, attention_mask, labels=labels)

            return output_tensor, partial(self.loss_func, tokens, loss_mask)

        return forward_step


# ---------------------------------------------------------------- helpers

def corpus_blocks(tokenizer, block_size, count):
    """`count` rows of `block_size` GPT-2 ids from the local text file, without the end-of-text id."""
    ids = tokenizer(open(CONFIG["text_file"], encoding="utf-8").read())["input_ids"]
    rows = [ids[i * block_size:(i + 1) * block_size] for i in range(count)]
    assert all(len(row) == block_size for row in rows), "the text file is too short"
    return [{"input_ids": torch.tensor(row), "attention_mask": torch.ones(block_size, dtype=torch.long),
             "labels": torch.tensor(row)} for row in rows]


def write(accelerator, result):
    if accelerator.is_main_process:  # the last rank: the last pipeline stage
        result.update(main_process_index=accelerator.process_index, num_processes=accelerator.num_processes)
        with open(CONFIG["out"], "w") as f:
            json.dump(result, f)


def prepare_with_rows(accelerator, model, rows):
    """The guide's prepare call: an AdamW, the dummy scheduler over CONFIG's steps, a training
    dataloader of rows[4:] and an evaluation one of rows[:4]."""
    micro = CONFIG["micro_batch_size"]
    train_dataloader = DataLoader(rows[4:], batch_size=micro, collate_fn=default_data_collator)
    eval_dataloader = DataLoader(rows[:4], batch_size=micro, collate_fn=default_data_collator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = MegatronLMDummyScheduler(optimizer=optimizer, total_num_steps=CONFIG["steps"], warmup_num_steps=0)
    model, optimizer, _, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, lr_scheduler, train_dataloader, eval_dataloader)
    return model, optimizer, train_dataloader, eval_dataloader


def megatron_args_summary():
    from megatron.training import get_args

    args = get_args()
    return {key: getattr(args, key, None) for key in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size", "position_embedding_type",
        "group_query_attention", "num_query_groups", "micro_batch_size", "global_batch_size", "use_distributed_optimizer",
        "model_type_name", "hidden_dropout", "attention_dropout", "swiglu", "normalization",
        "untie_embeddings_and_output_weights", "add_bias_linear", "ffn_hidden_size", "clip_grad")}


def direct_gpt_losses(model, batch, eod, vocab_size):
    """Per-token cross entropy of the (TP = PP = 1) model's logits over the tokenizer's vocab_size ids,
    as accelerate's GPTTrainStep batches a transformers batch: the ids, the next ids with eod after
    the last; loss mask 0 where the input is eod."""
    tokens = batch["input_ids"].long()
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], eod)], dim=1)
    length = tokens.shape[1]
    attention_mask = torch.ones(length, length, dtype=torch.bool).triu(1)[None, None]  # True: masked
    position_ids = torch.arange(length)[None].expand_as(tokens)
    with torch.no_grad():
        logits = model.module[0](tokens, position_ids, attention_mask).float()
    real = logits[..., :vocab_size]  # the padding ids the embedding has beyond the tokenizer's are not in the loss
    losses = F.cross_entropy(real.reshape(-1, vocab_size), labels.reshape(-1), reduction="none")
    return logits, losses.view(tokens.shape), (tokens != eod).float()


# ---------------------------------------------------------------- features

def gpt_custom_loss_and_generate():
    # specifying tokenizer's vocab and merges file (for megatron_generate), and the test's other args
    vocab_file = os.path.join(CONFIG["model_dir"], "vocab.json")
    merge_file = os.path.join(CONFIG["model_dir"], "merges.txt")
    other_megatron_args = {"vocab_file": vocab_file, "merge_file": merge_file, **CONFIG["other_megatron_args"]}
    megatron_lm_plugin = MegatronLMPlugin(other_megatron_args=other_megatron_args)
    accelerator = Accelerator(megatron_lm_plugin=megatron_lm_plugin)
    tokenizer = AutoTokenizer.from_pretrained(CONFIG["model_dir"])

    # Custom loss function for the Megatron model (the guide's main())
    keytoken_ids = []
    keywords = ["plt", "pd", "sk", "fit", "predict", " plt", " pd", " sk", " fit", " predict", " the", " of"]
    for keyword in keywords:
        ids = tokenizer([keyword]).input_ids[0]
        if len(ids) == 1:
            keytoken_ids.append(ids[0])
    accelerator.print(f"Keytoken ids: {keytoken_ids}")
    accelerator.state.megatron_lm_plugin.custom_train_step_class = GPTTrainStepWithCustomLoss
    accelerator.state.megatron_lm_plugin.custom_train_step_kwargs = {"keytoken_ids": keytoken_ids, "alpha": 0.25}

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG["model_dir"]))
    blocks = corpus_blocks(tokenizer, 32, 4 * (CONFIG["steps"] + 1))
    model, optimizer, train_dataloader, eval_dataloader = prepare_with_rows(accelerator, model, blocks)
    result = {"args": megatron_args_summary(), "keytoken_ids": keytoken_ids,
              "handler": type(model.train_step_handler).__name__}

    model.eval()
    batch = next(iter(eval_dataloader))
    with torch.no_grad():
        result["eval_loss"] = float(model(**batch).loss)
    if accelerator.num_processes == 1:  # the same loss, computed here from the model's logits
        _, losses, mask = direct_gpt_losses(model, batch, tokenizer.eos_token_id, len(tokenizer))
        per_sample = (losses * mask).sum(dim=1) / mask.sum(dim=1)
        weights = 1.0 + 0.25 * sum((batch["input_ids"] == kt).float() for kt in keytoken_ids).sum(dim=1)
        result["direct_eval_loss"] = float((per_sample * weights).mean())
        result["plain_eval_loss"] = float(per_sample.mean())
        result["weights"] = weights.tolist()

    model.train()
    result["train_losses"] = []
    for step, batch in enumerate(train_dataloader):
        if step == CONFIG["steps"]:
            break
        result["train_losses"].append(float(model(**batch).loss))
    # what `model(**batch).loss` gave on each rank (every pipeline stage, not only the last)
    every_rank = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(every_rank, [result["eval_loss"], *result["train_losses"]])
    result["every_rank_losses"] = every_rank

    # megatron_generate, in the guide's modes (shorter)
    tokenizer.pad_token = tokenizer.eos_token
    max_new_tokens = 6
    batch_encodings = tokenizer(TEXTS, return_tensors="pt", padding=True)
    modes = {
        "top_p": dict(top_p=0.8, top_p_decay=0.5, temperature=0.9),
        "top_k": dict(top_k=50, temperature=0.9),
        "greedy": dict(top_k=1),
        "add_BOS": dict(add_BOS=True),
    }
    result["generated"] = {}
    for name, kwargs in modes.items():
        generated_tokens = model.megatron_generate(batch_encodings["input_ids"], batch_encodings["attention_mask"],
                                                   max_new_tokens=max_new_tokens, **kwargs)
        result["generated"][name] = generated_tokens.tolist()
    batch_encodings = tokenizer(["The purpose of life is"], return_tensors="pt", padding=True)
    generated_tokens = model.megatron_generate(batch_encodings["input_ids"], batch_encodings["attention_mask"],
                                               max_new_tokens=max_new_tokens, num_beams=4, length_penalty=1.5)
    result["generated"]["beam"] = generated_tokens.tolist()
    result["decoded_greedy"] = tokenizer.batch_decode(result["generated"]["greedy"])
    write(accelerator, result)


def indexed_dataset_loop():
    accelerator = Accelerator(megatron_lm_plugin=MegatronLMPlugin(return_logits=True))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG["model_dir"]))
    # a. MegatronLMDummyDataLoader with the dataset args
    megatron_dataloader_config = {
        "data_path": [CONFIG["data_path"]],
        "vocab_file": os.path.join(CONFIG["model_dir"], "vocab.json"),  # the dataset's end-of-document id
        "merge_file": os.path.join(CONFIG["model_dir"], "merges.txt"),
        "split": "80,20,0",
        "seq_length": 32,
        "micro_batch_size": CONFIG["micro_batch_size"],
    }
    megatron_dataloader = MegatronLMDummyDataLoader(**megatron_dataloader_config)
    accelerator.state.megatron_lm_plugin.megatron_dataset_flag = True
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = MegatronLMDummyScheduler(optimizer=optimizer, total_num_steps=CONFIG["steps"], warmup_num_steps=0)
    # b. the dummy dataloader three times: train, validation, test
    model, optimizer, lr_scheduler, train_dataloader, eval_dataloader, _ = accelerator.prepare(
        model, optimizer, lr_scheduler, megatron_dataloader, megatron_dataloader, megatron_dataloader)
    from megatron.core import mpu

    result = {"args": megatron_args_summary(), "train_losses": [], "eval_losses": []}
    # Only TP rank 0 reads the data; Accelerate 1.16 hands the other TP ranks a dataloader of {}
    gathered = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(gathered, (mpu.get_tensor_model_parallel_rank(),
                                                   type(train_dataloader).__name__))
    result["tp_rank_and_dataloader"] = gathered
    # c. the guide's while loop
    completed_steps, eval_interval, eval_iters = 0, CONFIG["steps"], 2
    while completed_steps < CONFIG["steps"]:
        model.train()
        batch = next(train_dataloader) if train_dataloader is not None else {}
        outputs = model(**batch)
        loss = outputs.loss
        completed_steps += 1
        result["train_losses"].append(float(loss))

        if completed_steps % eval_interval == 0:
            eval_completed_steps = 0
            logits = []
            while eval_completed_steps < eval_iters:
                model.eval()
                with torch.no_grad():
                    batch = next(eval_dataloader) if eval_dataloader is not None else {}
                    outputs = model(**batch)
                result["eval_losses"].append(float(outputs.loss))
                if mpu.is_pipeline_last_stage():
                    logits.append(gather_across_data_parallel_groups(outputs.logits))
                eval_completed_steps += 1
    if mpu.is_pipeline_last_stage():
        result["logits_shape"] = list(logits[0].shape)
        if accelerator.is_main_process:
            torch.save(torch.cat(logits), CONFIG["out"] + ".logits.pt")
    write(accelerator, result)


def save_load_resume():
    # dropout on: the resumed run must also restore the random state
    plugin = MegatronLMPlugin(return_logits=True, attention_dropout=0.1, hidden_dropout=0.1)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    tokenizer = AutoTokenizer.from_pretrained(CONFIG["model_dir"])
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG["model_dir"]))
    steps, phase = CONFIG["steps"], CONFIG["phase"]
    micro = CONFIG["micro_batch_size"]
    blocks = corpus_blocks(tokenizer, 32, 2 * micro * (steps + 1))
    train_dataloader = DataLoader(blocks[2 * micro:], batch_size=micro, collate_fn=default_data_collator)
    eval_dataloader = DataLoader(blocks[:2 * micro], batch_size=micro, collate_fn=default_data_collator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Accelerate divides both numbers by the data-parallel size (TP = PP = 1 here): `steps` iterations, 1 of warmup
    lr_scheduler = MegatronLMDummyScheduler(optimizer=optimizer, total_num_steps=steps * accelerator.num_processes,
                                            warmup_num_steps=accelerator.num_processes)
    model, optimizer, lr_scheduler, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, lr_scheduler, train_dataloader, eval_dataloader)
    first, last = {"full": (0, steps), "first": (0, steps // 2), "second": (steps // 2, steps)}[phase]
    # The batches first: starting an iteration over the dataloader draws from torch's generator (its
    # base seed), which load_state then restores to where the first job saved it
    batches = list(itertools.islice(train_dataloader, last))
    if phase == "second":
        accelerator.load_state(CONFIG["ckpt"])
    result = {"args": megatron_args_summary(), "train_losses": [], "lr": []}
    model.train()
    for step, batch in enumerate(batches):
        if step < first:
            continue  # what skip_first_batches does after a resume
        if step == last:
            break
        outputs = model(**batch)
        result["train_losses"].append(float(outputs.loss))
        result["lr"].append(optimizer.param_groups[0]["lr"])
        if outputs.logits is not None:  # on the last stage, in training as well
            result["train_logits_shape"] = list(outputs.logits.shape)
    if phase == "first":
        accelerator.save_state(CONFIG["ckpt"])
        write(accelerator, result)
        return
    from megatron.core import mpu

    model.eval()
    batch = next(iter(eval_dataloader))
    with torch.no_grad():
        outputs = model(**batch)
    result["eval_loss"] = float(outputs.loss)
    if mpu.is_pipeline_last_stage():
        logits = gather_across_data_parallel_groups(outputs.logits)
        result["logits_shape"] = list(logits.shape)
        full_batch = default_data_collator(blocks[:micro * mpu.get_data_parallel_world_size()])
        if mpu.get_tensor_model_parallel_world_size() == 1 and mpu.get_pipeline_model_parallel_world_size() == 1:
            direct_logits, losses, mask = direct_gpt_losses(model, full_batch, tokenizer.eos_token_id, len(tokenizer))
            result["logits_max_difference"] = float((logits.float() - direct_logits).abs().max())
            result["direct_eval_loss"] = float((losses * mask).sum() / mask.sum())
        if accelerator.is_main_process:
            torch.save(logits, CONFIG["out"] + ".logits.pt")
    write(accelerator, result)


def bert_or_t5(kind):
    accelerator = Accelerator()
    if kind == "bert":
        config = MegatronBertConfig(vocab_size=CONFIG["vocab_size"], hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=256, max_position_embeddings=64)
        model = MegatronBertForMaskedLM(config)
    else:
        config = T5Config(vocab_size=CONFIG["vocab_size"], d_model=64, d_kv=16, d_ff=256, num_layers=2,
                          num_heads=4, decoder_start_token_id=0)
        model = T5ForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(4 * (CONFIG["steps"] + 1)):
        ids = torch.randint(5, 25, (24,), generator=generator)  # a few ids: learnable in a few steps
        if kind == "bert":  # masked LM: 15% of the positions predict their id, the rest -100
            chosen = torch.rand(24, generator=generator) < 0.15
            chosen[3] = True
            labels = torch.where(chosen, ids, torch.full_like(ids, -100))
            inputs = torch.where(chosen, torch.full_like(ids, 4), ids)
            rows.append({"input_ids": inputs, "attention_mask": torch.ones(24, dtype=torch.long),
                         "token_type_ids": (torch.arange(24) >= 12).long(), "labels": labels,
                         "next_sentence_label": torch.randint(0, 2, (), generator=generator)})
        else:  # span corruption, in miniature: the encoder sees the ids, the decoder writes them reversed
            rows.append({"input_ids": ids, "attention_mask": torch.ones(24, dtype=torch.long),
                         "labels": ids[:12].flip(0)})
    model, optimizer, train_dataloader, eval_dataloader = prepare_with_rows(accelerator, model, rows)
    from megatron.training import get_args

    from megatron.core.utils import unwrap_model

    result = {"args": megatron_args_summary(), "model_class": type(unwrap_model(model.module[0])).__name__,
              "pretraining_flag": get_args().pretraining_flag, "train_losses": [], "eval_losses": []}

    def evaluate():
        model.eval()
        with torch.no_grad():
            result["eval_losses"].append(float(sum(model(**batch).loss for batch in eval_dataloader)))

    evaluate()
    model.train()
    for step, batch in enumerate(train_dataloader):
        if step == CONFIG["steps"]:
            break
        result["train_losses"].append(float(model(**batch).loss))
    evaluate()
    write(accelerator, result)


def hf_checkpoint():
    """The guide's recipe for starting from an HF checkpoint: converted to Megatron, `release`
    renamed to `iter_0000000` (tracker 0), loaded with load_state and no optimizer state. With
    use_checkpoint_args the model flags come from the checkpoint; without it (a Llama) from the HF
    config through Accelerate's parser alone."""
    hf_dir, megatron_dir = CONFIG["hf_dir"], CONFIG["megatron_dir"]
    other_megatron_args = {"auto_detect_ckpt_format": True}  # our converter writes the torch format
    if CONFIG["use_checkpoint_args"]:  # the model flags of the checkpoint
        other_megatron_args.update(use_checkpoint_args=True, load=megatron_dir,
                                   use_rotary_position_embeddings=False)  # GPT-2's learned positions
    megatron_lm_plugin = MegatronLMPlugin(no_load_optim=True, other_megatron_args=other_megatron_args)
    accelerator = Accelerator(megatron_lm_plugin=megatron_lm_plugin)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir)
    eod = hf_model.config.eos_token_id
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf_model.config.vocab_size, (8, 32), generator=generator)
    ids[ids == eod] = (eod + 1) % hf_model.config.vocab_size  # no end-of-text inside
    rows = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids]
    eval_dataloader = DataLoader(rows, batch_size=CONFIG["micro_batch_size"], collate_fn=default_data_collator)
    batch = next(iter(eval_dataloader))
    with torch.no_grad():  # the loss GPTTrainStep computes (the next id, eod after the last), from HF's logits
        tokens = batch["input_ids"]
        labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], eod)], dim=1)
        logits = hf_model(input_ids=tokens).logits
        hf_loss = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))
    optimizer = torch.optim.AdamW(hf_model.parameters(), lr=1e-3)
    lr_scheduler = MegatronLMDummyScheduler(optimizer=optimizer, total_num_steps=4, warmup_num_steps=0)
    model, optimizer, lr_scheduler, eval_dataloader = accelerator.prepare(hf_model, optimizer, lr_scheduler,
                                                                          eval_dataloader)
    accelerator.load_state(megatron_dir)
    model.eval()
    with torch.no_grad():
        loss = float(model(**next(iter(eval_dataloader))).loss)
    model.train()
    train_loss = float(model(**next(iter(eval_dataloader))).loss)
    write(accelerator, {"args": megatron_args_summary(), "hf_loss": hf_loss, "loss": loss, "train_loss": train_loss,
                        "iteration": model.iteration})


FEATURES = {"hf_checkpoint": hf_checkpoint, "gpt": gpt_custom_loss_and_generate, "indexed": indexed_dataset_loop, "resume": save_load_resume,
            "bert": partial(bert_or_t5, "bert"), "t5": partial(bert_or_t5, "t5")}

if __name__ == "__main__":
    FEATURES[CONFIG["feature"]]()
