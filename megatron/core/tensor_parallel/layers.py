"""Linear and embedding layers whose weights are split over the tensor-parallel ranks.

    layer                   weight on one of t ranks   splits                    output
    ColumnParallelLinear    [out/t, in]                output features (dim 0)   [..., out/t] (or gathered)
    RowParallelLinear       [out, in/t]                input features (dim 1)    [..., out], summed over ranks
    VocabParallelEmbedding  [v/t, h]                   vocabulary rows (dim 0)   [b, s, h], summed over ranks

A column layer followed by a row layer (attention's qkv -> proj, the MLP's fc1 -> fc2) needs
one all-reduce forward and one backward, and nothing between the two.

Initialisation: every rank draws the FULL weight in fp32 on the CPU with init_method from the
default generator (which all TP ranks seed alike), keeps its partition and casts it to
config.params_dtype. A TP=t model therefore equals the TP=1 model weight for weight, and the
generator ends in the same state on every rank whatever t is.

Sequence parallelism (config.sequence_parallel): activations outside the TP regions are split
along the sequence, [s/t, b, h]. A column layer then all-gathers its input (and re-gathers it in
backward rather than keeping the gathered copy), and a row layer reduce-scatters its output.

Gradient-accumulation fusion (config.gradient_accumulation_fusion): backward adds a layer's
weight gradient straight into the weight's DDP `main_grad` instead of returning it.

fp32 GEMMs on CPU: torch runs fp32 matmuls through MKL; oneDNN's fp32 inner-product kernel
(torch.ops.mkldnn._linear_pointwise, full fp32 arithmetic) is 7 to 20% faster here for the
forward (x W^T + b, bias fused) and the input gradient (g W), and slower for the weight
gradient, which stays with MKL (measured at the benchmark GPT's shapes: docs/PERFORMANCE.md).
The layers use it when config.fused_kernels_cpu_impl is "native" (the default), the operands
are fp32 CPU tensors and torch has oneDNN; "reference" keeps F.linear (the plain path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    _reduce_scatter_along_first_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.utils import VocabUtility, divide
from megatron.core.utils import apply_function

InitMethod = Callable[[torch.Tensor], torch.Tensor]


class ParallelLayerConfig(Protocol):
    """The config fields these layers read (megatron.model.TransformerConfig has them all)."""

    sequence_parallel: bool
    params_dtype: torch.dtype
    perform_initialization: bool
    gradient_accumulation_fusion: bool
    fused_kernels_cpu_impl: str

# What a parameter's TP attributes mean when a layer did not set them: replicated on every rank.
_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Mark `tensor` as split (or not) over TP along `dim`; checkpoint tools and grad-norm code read these."""
    for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, name):
            raise ValueError(f"tensor already has the tensor-parallel attribute {name!r}")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    for name, default in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, default)


def copy_tensor_model_parallel_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True for a TP-split parameter, and for a replicated one on TP rank 0 only (so a grad norm
    or parameter count over the model-parallel group counts every replicated value once)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or (
        parallel_state.get_tensor_model_parallel_rank() == 0
    )


def _init_partition(
    weight: torch.Tensor,
    full_shape: tuple[int, int],
    partition_dim: int,
    stride: int,
    init_method: InitMethod,
    rows: torch.Tensor | None = None,
) -> None:
    """Draw the full weight [out, in] in fp32, copy this rank's partition into `weight`.

    With stride k the partition dim is cut into t * k equal blocks dealt round-robin: rank r
    keeps blocks r, r + t, ... (for a fused weight whose k sub-matrices are each split over TP).
    `rows` (partition dim 0): this rank's rows of the full weight, listed.
    """
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    if rows is not None:
        with torch.no_grad():
            weight.copy_(master[rows])
        return
    world_size = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    block = divide(weight.size(partition_dim), stride)
    blocks = torch.split(master, block, dim=partition_dim)  # t * stride blocks
    with torch.no_grad():
        weight.copy_(torch.cat(blocks[rank::world_size], dim=partition_dim))


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = _onednn_available()


def _use_onednn(fused_kernels_cpu_impl: str, *tensors: torch.Tensor) -> bool:
    """oneDNN's fp32 GEMM for this call: the fast CPU path ("native") is on and every operand is an
    fp32 CPU tensor. Not inside torch.compile (Inductor lowers this op only for frozen, constant weights)."""
    return (_ONEDNN and fused_kernels_cpu_impl == "native"
            and not torch.compiler.is_compiling()
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors))


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T + bias -> [..., out]; weight may be a transposed view."""
    if not onednn:
        return F.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def _new_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype))


class _LinearWithGradAccumulation(torch.autograd.Function):
    """y = x W^T + b, with two options Megatron's LinearWithGradAccumulationAndAsyncCommunication has.

    sequence_parallel: x is [s/t, b, in] and is all-gathered to [s, b, in] here, keeping only x
    (not the gathered input). Backward re-gathers x for the weight gradient and reduce-scatters
    the input gradient back to [s/t, b, in]: activation memory stays s*b*in/t at the price of a
    second all-gather.

    gradient_accumulation_fusion: when the weight has a `main_grad` (DistributedDataParallel gave
    it one), backward adds grad_output^T @ x straight into main_grad, in main_grad's dtype, and
    sets weight.grad_added_to_main_grad instead of returning the weight gradient. The DDP hook
    then sees the flag, skips its add and resets it. See _fused_weight_grad for the
    placeholder gradient returned in its place.
    """

    @staticmethod
    def forward(ctx, input_, weight, bias, sequence_parallel, gradient_accumulation_fusion, onednn=False):
        total_input = _gather_along_first_dim(input_) if sequence_parallel else input_  # [s, b, in]
        ctx.save_for_backward(input_, weight)
        ctx.has_bias = bias is not None
        ctx.sequence_parallel = sequence_parallel
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.onednn = onednn
        return _linear(total_input, weight, bias, onednn)  # [s, b, out]

    @staticmethod
    def backward(ctx, grad_output):  # grad_output [s, b, out]
        input_, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        total_input = input_
        # The re-gather is issued first, as Megatron does, so that an asynchronous version can
        # overlap it with the input-gradient matmul.
        if ctx.sequence_parallel and ctx.needs_input_grad[1]:
            total_input = _gather_along_first_dim(input_)  # [s/t, b, in] -> [s, b, in]
        if ctx.needs_input_grad[0]:
            # [s, b, in], partial over the TP ranks
            grad_input = _linear(grad_output, weight.t(), None, True) if ctx.onednn else grad_output.matmul(weight)
            if ctx.sequence_parallel:
                grad_input = _reduce_scatter_along_first_dim(grad_input)  # [s/t, b, in]
        if ctx.needs_input_grad[1]:
            grad_2d = grad_output.reshape(-1, grad_output.size(-1))  # [s*b, out]
            input_2d = total_input.reshape(-1, total_input.size(-1))  # [s*b, in]
            if ctx.gradient_accumulation_fusion and hasattr(weight, "main_grad"):
                grad_weight = _fused_weight_grad(weight, grad_2d, input_2d)
            else:
                grad_weight = grad_2d.t().matmul(input_2d)  # [out, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.size(-1)).sum(dim=0)  # [out]
        return grad_input, grad_weight, grad_bias, None, None, None


def _fused_weight_grad(weight: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> torch.Tensor:
    """main_grad += grad_2d^T @ input_2d in main_grad's dtype; returns the placeholder gradient.

    The placeholder is an uninitialised tensor shaped and strided like the weight (Megatron's
    torch.empty). It must be a gradient, not None, so that the weight's AccumulateGrad node runs
    and with it the DDP hook (which reports the parameter ready for an overlapped reduction). It
    is the cheapest tensor that reaches the hook without a copy: AccumulateGrad stores it as
    .grad as is, where a stride-0 expanded zero would be cloned into a full dense tensor (the
    gradient layout contract) and another dtype cast. Nothing writes or reads it; the hook drops
    it at once, so at most one such buffer is alive, briefly, per backward step.
    """
    main_grad = weight.main_grad
    if grad_2d.dtype == main_grad.dtype:
        main_grad.addmm_(grad_2d.t(), input_2d)  # [out, in] += [out, s*b] @ [s*b, in], one GEMM with beta = 1
    elif grad_2d.device.type == "cpu":
        # bf16/fp16 activations, fp32 main_grad. The CPU has no GEMM with half-precision inputs and an
        # fp32 output; casting both inputs to fp32 would run this GEMM at the fp32 ceiling (half the
        # bf16 one here) after two activation-sized casts. So: a half-precision GEMM (fp32
        # accumulation inside, one rounding of the weight-sized product), added into main_grad --
        # what Megatron does without gradient-accumulation fusion.
        main_grad.add_(torch.mm(grad_2d.t(), input_2d))
    else:
        # [out, in] += [out, s*b] @ [s*b, in] in fp32: the sum over tokens is not rounded to half precision.
        main_grad.addmm_(grad_2d.t().to(main_grad.dtype), input_2d.to(main_grad.dtype))
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W [out, in] split by rows: this rank computes out/t of the outputs.

    forward(input_, weight=None) -> (output, output_bias). input_ is [s, b, in] replicated, or
    [s/t, b, in] under sequence parallelism; output is [s, b, out/t], or [s, b, out] with
    gather_output. `weight` overrides the layer's own (e.g. an output layer tied to the word
    embedding; then build it with skip_weight_param_allocation=True). With skip_bias_add the
    bias is returned as output_bias instead of added, for a caller that fuses the add.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ParallelLayerConfig,
        init_method: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        partition_rows: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.input_size = input_size
        self.output_size = output_size
        if partition_rows is None:
            self.output_size_per_partition = divide(output_size, world_size)
            rows = None
        else:  # this rank's rows of the full weight, given (a layout strides cannot say: replicated K/V heads)
            rows = torch.as_tensor(list(partition_rows), dtype=torch.long)
            if rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= output_size:
                raise ValueError(f"partition_rows must be indices in [0, {output_size})")
            self.output_size_per_partition = rows.numel()
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = config.sequence_parallel
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.fused_kernels_cpu_impl = config.fused_kernels_cpu_impl  # "native": oneDNN fp32 GEMMs
        if self.sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel")

        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = _new_param(self.output_size_per_partition, input_size, dtype=config.params_dtype)
            if config.perform_initialization:
                _init_partition(self.weight, (output_size, input_size), 0, stride, init_method, rows)
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)
        self.adapter: nn.Module | None = None  # a LoRA adapter (tensor_parallel/lora.py) when one is attached
        if rows is not None:
            for param in (self.weight, self.bias):
                if param is not None:
                    param.partition_rows = rows  # [out/t] global row of each local row (gather / convert)

    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, *, add_bias: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """add_bias overrides skip_bias_add for this call (True: the bias joins the GEMM, None is returned)."""
        skip_bias_add = self.skip_bias_add if add_bias is None else not add_bias
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear built with skip_weight_param_allocation needs forward(..., weight=)")
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise ValueError(
                f"weight has shape {tuple(weight.shape)}, expected "
                f"({self.output_size_per_partition}, {self.input_size}) on this tensor-parallel rank"
            )
        bias = None if skip_bias_add else self.bias
        # Fused only into the layer's own weight: a weight passed in (the tied embedding) may get
        # a second gradient elsewhere, which autograd would sum with the placeholder.
        fuse = self.gradient_accumulation_fusion and weight is self.weight
        if self.sequence_parallel:
            input_parallel = input_  # [s/t, b, in], all-gathered inside the linear
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_)  # [s, b, in]
        onednn = _use_onednn(self.fused_kernels_cpu_impl, input_parallel, weight)
        if self.sequence_parallel or fuse or onednn:
            output_parallel = apply_function(_LinearWithGradAccumulation, input_parallel, weight, bias,
                                             self.sequence_parallel, fuse, onednn)  # [s, b, out/t]
        else:
            output_parallel = F.linear(input_parallel, weight, bias)  # [s, b, out/t]
        if self.adapter is not None:  # LoRA (tensor_parallel/lora.py): reads the input before the TP copy
            output_parallel = output_parallel + self.adapter(input_)  # [s, b, out/t]
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output_parallel)  # [s, b, out]
        else:
            output = output_parallel
        return output, (self.bias if skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size_per_partition={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W [out, in] split by columns: this rank multiplies its in/t inputs.

    forward(input_) -> (output, output_bias). input_ is this rank's [s, b, in/t] (input_is_parallel)
    or the full [s, b, in], which is split here. The partial products are summed over the ranks
    (all-reduce to [s, b, out], or reduce-scatter to [s/t, b, out] under sequence parallelism) and
    the bias, replicated, is added once after the sum. Under sequence parallelism each rank's bias
    gradient covers its s/t tokens only, so the bias carries `sequence_parallel = True` and its
    gradient must be all-reduced over TP before the optimizer step.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ParallelLayerConfig,
        init_method: InitMethod,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        stride: int = 1,
    ) -> None:
        super().__init__()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = divide(input_size, world_size)
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = config.sequence_parallel
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.fused_kernels_cpu_impl = config.fused_kernels_cpu_impl  # "native": oneDNN fp32 GEMMs
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")

        self.weight = _new_param(output_size, self.input_size_per_partition, dtype=config.params_dtype)
        if config.perform_initialization:
            _init_partition(self.weight, (output_size, input_size), 1, stride, init_method)
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype))
            self.bias.sequence_parallel = config.sequence_parallel
        else:
            self.register_parameter("bias", None)
        self.adapter: nn.Module | None = None  # a LoRA adapter (tensor_parallel/lora.py) when one is attached

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.input_is_parallel:
            input_parallel = input_  # [s, b, in/t]
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_)  # [s, b, in] -> [s, b, in/t]
        onednn = _use_onednn(self.fused_kernels_cpu_impl, input_parallel, self.weight)
        if self.gradient_accumulation_fusion or onednn:
            output_parallel = apply_function(_LinearWithGradAccumulation, input_parallel, self.weight, None, False,
                                             self.gradient_accumulation_fusion, onednn)  # [s, b, out]
        else:
            output_parallel = F.linear(input_parallel, self.weight)  # [s, b, out], partial sum
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel)  # [s/t, b, out]
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel)  # [s, b, out]
        if self.adapter is not None:  # LoRA (tensor_parallel/lora.py): its own reduction, added after the base's
            output = output + self.adapter(input_parallel)
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None:
            output = output + self.bias
        return output, None

    def extra_repr(self) -> str:
        return (f"input_size_per_partition={self.input_size_per_partition}, output_size={self.output_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the padded vocabulary, num_embeddings) are split over the TP ranks.

    forward(input_ [b, s] global token ids) -> [b, s, h], or this rank's [s/t, b, h] with
    reduce_scatter_embeddings. Each rank looks up the ids in its row range [first, last), zeros
    the others, and the ranks' results are summed. With num_initialized_embeddings = n (the
    tokenizer's real vocabulary) init_method draws only rows [0, n), in order, and the padding
    rows start at zero: the initial model and the RNG stream after it do not depend on padding.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod,
        config: ParallelLayerConfig,
        reduce_scatter_embeddings: bool = False,
        num_initialized_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, rank, world_size
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        if num_initialized_embeddings is None:
            num_initialized_embeddings = num_embeddings
        if not 0 <= num_initialized_embeddings <= num_embeddings:
            raise ValueError(
                f"num_initialized_embeddings ({num_initialized_embeddings}) must be in "
                f"[0, num_embeddings ({num_embeddings})]"
            )
        self.num_initialized_embeddings = num_initialized_embeddings

        self.weight = _new_param(self.num_embeddings_per_partition, embedding_dim, dtype=config.params_dtype)
        if config.perform_initialization:
            self._initialize(init_method)
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def _initialize(self, init_method: InitMethod) -> None:
        real = torch.empty(self.num_initialized_embeddings, self.embedding_dim, dtype=torch.float32)
        init_method(real)  # [n, h], drawn exactly as an unpadded table would be
        master = torch.zeros(self.num_embeddings, self.embedding_dim, dtype=torch.float32)  # [v, h]
        master[: self.num_initialized_embeddings] = real
        with torch.no_grad():
            self.weight.copy_(master[self.vocab_start_index : self.vocab_end_index])  # [v/t, h]

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            # Ids outside this rank's rows look up row 0 and are zeroed; another rank supplies them.
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)  # [b, s]
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
            output_parallel = F.embedding(local_ids, self.weight)  # [b, s, h]
            output_parallel = output_parallel.masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            output_parallel = F.embedding(input_, self.weight)  # [b, s, h]
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
            return reduce_scatter_to_sequence_parallel_region(output_parallel)  # [s/t, b, h]
        return reduce_from_tensor_model_parallel_region(output_parallel)  # [b, s, h]

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, rows=[{self.vocab_start_index}, {self.vocab_end_index}), "
                f"embedding_dim={self.embedding_dim}")
