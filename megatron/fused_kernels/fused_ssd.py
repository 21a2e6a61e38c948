"""The Mamba-2 selective state-space scan (SSD) and its causal depthwise convolution, in PyTorch.

Per head h (nh heads of hd channels, state size n, heads grouped ng to a B/C group), with the
discretised step dt_t > 0 and A_h < 0, the recurrence over positions t is

    state_t = exp(dt_t A_h) state_{t-1} + dt_t x_t B_t^T      state [hd, n]
    y_t     = state_t C_t + D_h x_t

ssd_scan computes it chunk by chunk in matrix form (the "state-space duality" of Mamba-2): inside a
chunk of L positions the outputs are a masked attention-like product (C B^T weighted by the decay
between positions), the chunk's contribution to the state is one more product, and only the
c = s / L chunk-end states are carried from chunk to chunk -- a c x c product, no loop over
positions. ssd_recurrence is the per-position loop, the reference the tests and bench/ compare
against; ssd_step is one position of it (decoding with a cached state).

Everything runs in fp32 (the reference kernels keep dt, A and the states in fp32) and returns fp32.
Shapes: x [b, s, nh, hd], dt [b, s, nh], A [nh], B and C [b, s, ng, n], D [nh], state [b, nh, hd, n].

chunk_scan and conv1d_silu are what the model calls (megatron/model/mamba/mixer.py): on CUDA, when
importable (never required), mamba_ssm's Triton mamba_chunk_scan_combined and causal_conv1d's
causal_conv1d_fn; otherwise, and always on CPU, ssd_scan and causal_conv1d here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: entry (i, j) = a_{j+1} + ... + a_i for j <= i, -inf above the diagonal.

    Summed by a cumulative sum of masked copies rather than as a difference of two cumulative sums,
    which would cancel catastrophically over long chunks."""
    length = a.shape[-1]
    strictly_lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    terms = a[..., None, :].expand(*a.shape, length).transpose(-1, -2)  # [..., i, j] = a_i
    sums = terms.masked_fill(~strictly_lower, 0).cumsum(dim=-2)  # sum_{k = j+1..i} a_k
    lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~lower, float("-inf"))


def _heads(t: torch.Tensor, nh: int) -> torch.Tensor:
    """B or C [b, s, ng, n] -> [b, s, nh, n]: each group serves nh / ng consecutive heads."""
    return t.repeat_interleave(nh // t.shape[2], dim=2)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             chunk_size: int, D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
             return_final_state: bool = False):
    """y [b, s, nh, hd] (fp32) of the recurrence above, chunk-wise; with return_final_state also the
    state after the last position [b, nh, hd, n]. initial_state: the state before position 0 (None: 0)."""
    b, s, nh, hd = x.shape
    x, dt, A = x.float(), dt.float(), A.float()
    B, C = _heads(B.float(), nh), _heads(C.float(), nh)  # [b, s, nh, n]
    pad = (-s) % chunk_size
    # Padded positions have dt = 0: no decay and no input, so the final state is that of position s.
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))  # [b, s', nh, hd]
    a = F.pad(dt * A, (0, 0, 0, pad))  # [b, s', nh], log-decay per position
    B, C = F.pad(B, (0, 0, 0, 0, 0, pad)), F.pad(C, (0, 0, 0, 0, 0, pad))
    c, L = (s + pad) // chunk_size, chunk_size
    xdt = xdt.view(b, c, L, nh, hd)
    B, C = B.view(b, c, L, nh, -1), C.view(b, c, L, nh, -1)  # [b, c, L, nh, n]
    a = a.view(b, c, L, nh).permute(0, 3, 1, 2)  # [b, nh, c, L]
    a_cum = a.cumsum(dim=-1)  # [b, nh, c, L]: log-decay from the chunk's start through position l

    # 1. Within each chunk: y_l = sum_{j <= l} (C_l . B_j) exp(a_{j+1} + .. + a_l) xdt_j.
    decay = torch.exp(segment_sums(a))  # [b, nh, c, L, L]
    scores = torch.einsum("bclhn,bcjhn->bhclj", C, B) * decay  # [b, nh, c, L(l), L(j)]
    y = torch.einsum("bhclj,bcjhp->bclhp", scores, xdt)  # [b, c, L, nh, hd]

    # 2. Each chunk's own contribution to the state at its end (from a zero start).
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b, nh, c, L]: decay from position l to the chunk's end
    B_to_end = B * to_end.permute(0, 2, 3, 1)[..., None]  # [b, c, L, nh, n]
    chunk_states = torch.einsum("bclhn,bclhp->bchpn", B_to_end, xdt)  # [b, c, nh, hd, n]

    # 3. Across chunks: the state entering chunk k sums every earlier chunk's contribution, decayed
    #    over the chunks between (a (c+1) x (c+1) lower-triangular product; row 0 is the initial state).
    start = x.new_zeros(b, 1, nh, hd, B.shape[-1]) if initial_state is None \
        else initial_state.float()[:, None]  # [b, 1, nh, hd, n]
    chunk_states = torch.cat([start, chunk_states], dim=1)  # [b, c+1, nh, hd, n]
    across = torch.exp(segment_sums(F.pad(a_cum[..., -1], (1, 0))))  # [b, nh, c+1, c+1]
    states = torch.einsum("bhkj,bjhpn->bkhpn", across, chunk_states)  # [b, c+1, nh, hd, n]
    entering, final_state = states[:, :-1], states[:, -1]

    # 4. The entering state read out at each position of its chunk, decayed from the chunk's start.
    from_start = torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]  # [b, c, L, nh, 1]
    y = y + torch.einsum("bclhn,bchpn->bclhp", C, entering) * from_start
    y = y.reshape(b, c * L, nh, hd)[:, :s]  # [b, s, nh, hd]
    if D is not None:
        y = y + D.float()[:, None] * x
    return (y, final_state) if return_final_state else y


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One position: x [b, nh, hd], dt [b, nh], B and C [b, ng, n], state [b, nh, hd, n] ->
    (y [b, nh, hd], the new state), both fp32."""
    nh = x.shape[1]
    x, dt = x.float(), dt.float()
    B = B.float().repeat_interleave(nh // B.shape[1], dim=1)  # [b, nh, n]
    C = C.float().repeat_interleave(nh // C.shape[1], dim=1)
    decay = torch.exp(dt * A.float())  # [b, nh]
    state = state.float() * decay[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, C)
    if D is not None:
        y = y + D.float()[:, None] * x
    return y, state


def ssd_recurrence(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as ssd_scan, one position at a time (the reference): (y [b, s, nh, hd], final state)."""
    b, s, nh, hd = x.shape
    state = x.new_zeros(b, nh, hd, B.shape[-1], dtype=torch.float32) if initial_state is None else initial_state
    outputs = []
    for t in range(s):
        y, state = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        outputs.append(y)
    return torch.stack(outputs, dim=1), state


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over the sequence: x [b, ch, s], weight [ch, 1, k], bias [ch].

    state [b, ch, k-1]: the k-1 inputs before position 0 (None: zeros, i.e. the start of a sequence).
    Returns (out [b, ch, s], the new state: the last k-1 inputs, for the next call)."""
    k = weight.shape[-1]
    if state is None:
        state = x.new_zeros(x.shape[0], x.shape[1], k - 1)
    window = torch.cat([state.to(x.dtype), x], dim=-1)  # [b, ch, k-1+s]
    out = F.conv1d(window, weight, bias, groups=x.shape[1])  # [b, ch, s]
    return out, window[..., window.shape[-1] - (k - 1):]


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               chunk_size: int, D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, final state) of the chunked scan: mamba_ssm's kernel for CUDA tensors when it is installed,
    else ssd_scan."""
    if x.device.type == "cuda":
        try:
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        except ImportError:
            pass
        else:
            return mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None if D is None else D.float(),
                                             initial_states=initial_state, return_final_states=True)
    return ssd_scan(x, dt, A, B, C, chunk_size, D=D, initial_state=initial_state, return_final_state=True)


def conv1d_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """silu(causal_conv1d(x)) and the new state (None from the CUDA kernel, which a training forward
    without a state uses when causal_conv1d is installed)."""
    if x.device.type == "cuda" and state is None:
        try:
            from causal_conv1d import causal_conv1d_fn
        except ImportError:
            pass
        else:
            return causal_conv1d_fn(x.contiguous(), weight.squeeze(1), bias, activation="silu"), None
    out, new_state = causal_conv1d(x, weight, bias, state)
    return F.silu(out), new_state
