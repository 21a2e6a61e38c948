"""megatron-core 0.16.1's side of the padded-vocabulary loss tests, computed once per test session.

One megatron-core subprocess (its import alone takes most of the time) builds, on CPU at TP=1 with
use_cpu_initialization:
    GPTModel (local spec) tied and untied, over GPT-2's 50,257 ids padded to 50,304: its state dict and
    its per-token losses [b, s] on one batch (tokens, labels, position ids, causal mask saved too);
    LanguageModelEmbedding and an output-layer ColumnParallelLinear over 300 ids padded to 384, drawn
    after torch.manual_seed(SEED);
    the two TP=2 slices [256, h] of a 512-row VocabParallelEmbedding, drawn after torch.manual_seed(SEED)
    by _initialize_affine_weight_cpu exactly as VocabParallelEmbedding calls it on TP rank 0 and 1.
tests/unit/test_padded_vocab_loss.py and tests/parallel/test_padded_vocab_loss_parallel.py compare
our model with these. Skips (with the install command) when megatron-core is missing.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.helpers.mcore_reference import run_mcore

SEED, LAYERS, HIDDEN, HEADS, SEQ, BATCH = 1234, 2, 32, 4, 16, 2
GPT2_VOCAB, GPT2_PADDED = 50257, 50304  # GPT-2's tokenizer, padded to a multiple of 128 (TP=1)
SMALL_VOCAB = 300  # padded to 384 at TP=1, 512 at TP=2

_SNIPPET = '''
import os, socket, torch, torch.distributed as dist
patch_for_cpu()
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, model_parallel_cuda_manual_seed
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu
from megatron.core.transformer.transformer_config import TransformerConfig

SEED, LAYERS, HIDDEN, HEADS, SEQ, BATCH = {seed}, {layers}, {hidden}, {heads}, {seq}, {batch}
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(SEED)
config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                           attention_dropout=0.0, use_cpu_initialization=True)
generator = torch.Generator().manual_seed(7)
tokens = torch.randint(0, {gpt2_vocab}, (BATCH, SEQ), generator=generator)
labels = torch.randint(0, {gpt2_vocab}, (BATCH, SEQ), generator=generator)
labels[0, 0] = {gpt2_vocab} - 1  # the last real id, next to the padding
position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)  # True = masked
out = {{"tokens": tokens, "labels": labels, "position_ids": position_ids, "mask": mask}}
for tied in (True, False):
    torch.manual_seed(SEED)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size={gpt2_padded}, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=tied)
    name = "tied" if tied else "untied"
    with torch.no_grad():
        out[name + "_losses"] = model(tokens, position_ids, mask, labels=labels).float()  # [b, s]
    out[name + "_state_dict"] = model.state_dict()

small = (-(-{small} // 128)) * 128
torch.manual_seed(SEED)
embedding = LanguageModelEmbedding(config, vocab_size=small, max_sequence_length=SEQ)
out["embedding_word"] = embedding.word_embeddings.weight.detach()
out["embedding_position"] = embedding.position_embeddings.weight.detach()
torch.manual_seed(SEED)
output_layer = ColumnParallelLinear(HIDDEN, small, config=config, init_method=config.init_method, bias=False)
out["output_layer"] = output_layer.weight.detach()
tp2 = (-(-{small} // 256)) * 256
for rank in (0, 1):
    torch.manual_seed(SEED)
    weight = torch.empty(tp2 // 2, HIDDEN)
    _initialize_affine_weight_cpu(weight, tp2, HIDDEN, tp2 // 2, 0, config.embedding_init_method,
                                  params_dtype=config.params_dtype, rank=rank, world_size=2)
    out["tp2_embedding_rank%d" % rank] = weight
torch.save(out, os.path.join({folder!r}, "reference.pt"))
import megatron.core.package_info as info
emit({{"version": info.__version__}})
'''


@functools.lru_cache(maxsize=None)
def megatron_core_reference() -> dict[str, Any]:
    """The tensors listed in the module docstring (state dicts with megatron-core's `_extra_state`
    keys as it wrote them), plus "version"."""
    with tempfile.TemporaryDirectory() as folder:
        meta = run_mcore(_SNIPPET.format(seed=SEED, layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq=SEQ,
                                         batch=BATCH, gpt2_vocab=GPT2_VOCAB, gpt2_padded=GPT2_PADDED,
                                         small=SMALL_VOCAB, folder=folder))
        reference = torch.load(Path(folder) / "reference.pt", weights_only=True)
    reference.update(meta)
    return reference
