"""A deliberately broken layer for tools/verify_parallel.py's test: the MLP's row-parallel fc2 skips
its all-reduce, so under tensor parallelism each rank keeps only its partial sum (serially, with
one rank, nothing is missing and the layer is right)."""

from megatron.core.tensor_parallel import RowParallelLinear
from megatron.model.layer_specs import get_gpt_layer_spec


class RowParallelLinearWithoutReduce(RowParallelLinear):
    def forward(self, input_):
        partial = input_.matmul(self.weight.t())  # [s, b, out]: this rank's share of the sum only
        if self.skip_bias_add:
            return partial, self.bias
        return (partial if self.bias is None else partial + self.bias), None


def broken_layer_spec():
    spec = get_gpt_layer_spec()
    spec.submodules.mlp.submodules.linear_fc2 = RowParallelLinearWithoutReduce
    return spec
