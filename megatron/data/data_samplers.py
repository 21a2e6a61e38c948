"""Data loaders that resume where a checkpoint stopped, as Megatron's pretraining samplers.

    single  (MegatronPretrainingSampler)        samples in dataset order, from consumed_samples on;
                                                each global step takes micro_batch_size x dp
                                                consecutive samples, this rank its own slice
    cyclic  (MegatronPretrainingRandomSampler)  a fresh permutation per epoch (seeded by epoch),
                                                resumed at the same place in the same epoch

The dataset itself is already shuffled (GPTDataset's shuffle index), so 'single' is the default.
"""

from __future__ import annotations

import signal
from typing import Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from megatron.core import device


class MegatronPretrainingSampler:
    """Yields lists of micro_batch_size indices, resuming after consumed_samples."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to load: the dataset is empty (total_samples={total_samples})")
        if consumed_samples >= total_samples:
            raise ValueError(f"the dataset holds {total_samples} samples but {consumed_samples} are already "
                             "consumed; build it with more samples (e.g. a larger --train-iters)")
        if micro_batch_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"bad micro batch size {micro_batch_size} or data-parallel rank "
                             f"{data_parallel_rank}/{data_parallel_size}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_micro_batch = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _slice(self, batch: List[int]) -> List[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start:start + self.micro_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        batch: List[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.global_micro_batch:
                yield self._slice(batch)
                batch = []
        if batch and not self.drop_last:
            yield self._slice(batch)


class MegatronPretrainingRandomSampler:
    """Epoch-wise random order (seed + epoch), resumed from consumed_samples."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, seed: int) -> None:
        if total_samples < micro_batch_size * data_parallel_size:
            raise ValueError(f"the dataset holds {total_samples} samples, fewer than one global micro-batch "
                             f"({micro_batch_size} x {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.seed = seed
        self.global_micro_batch = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.global_micro_batch

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[List[int]]:
        active_total = self.total_samples - self.last_batch_size
        epoch = self.consumed_samples // active_total
        offset = self.consumed_samples % active_total
        # each rank owns a contiguous bucket of the epoch and walks its own permutation of it
        bucket_size = active_total // self.data_parallel_size
        bucket_offset = offset // self.data_parallel_size
        start = self.data_parallel_rank * bucket_size
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        order = (torch.randperm(bucket_size, generator=generator) + start).tolist()[bucket_offset:]
        for i in range(0, len(order) - self.micro_batch_size + 1, self.micro_batch_size):
            yield order[i:i + self.micro_batch_size]


def _ignore_sigterm(worker_id: int) -> None:
    """worker_init_fn under --exit-signal-handler: the worker outlives a SIGTERM meant for the job.

    A scheduler (and torchrun, which signals each training process's group) sends SIGTERM to the
    loader's workers too. PyTorch's worker handler dies of it, and the training process then fails
    with 'DataLoader worker ... is killed by signal' before it can save. Ignored here, the workers
    keep serving batches until the loop saves and exits; they stop when the loader shuts them down.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def build_pretraining_data_loader(dataset: Optional[Dataset], consumed_samples: int, *, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  dataloader_type: str = "single", num_workers: int = 2,
                                  seed: int = 1234, workers_ignore_sigterm: bool = False) -> Optional[DataLoader]:
    """A DataLoader over dataset whose first batch follows the consumed_samples already trained on.

    workers_ignore_sigterm (--exit-signal-handler): the worker processes ignore SIGTERM, so that
    a SIGTERM sent to every process of the job reaches only the training loop's handler.
    """
    if dataset is None:
        return None
    if dataloader_type == "single":
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                             data_parallel_rank, data_parallel_size)
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(len(dataset), consumed_samples, micro_batch_size,
                                                   data_parallel_rank, data_parallel_size, seed)
    else:
        raise ValueError(f"--dataloader-type {dataloader_type!r} is not supported; use 'single' or 'cyclic'")
    # The loader's own generator: creating an iterator draws a worker seed from it, and drawing
    # from the global generator instead would shift the dropout masks of a resumed run.
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                      pin_memory=device.get_device().type == "cuda",
                      persistent_workers=num_workers > 0, generator=generator,
                      worker_init_fn=_ignore_sigterm if workers_ignore_sigterm and num_workers > 0 else None)
