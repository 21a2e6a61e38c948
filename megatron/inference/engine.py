"""The serving engine: in-flight batching over the paged KV cache (Megatron-Core's dynamic engine).

    engine = DynamicEngine(model, EngineConfig(block_size=16, max_requests=32, ...))
    request = engine.add_request(prompt_ids, SamplingParams(max_tokens=32, top_k=1))
    while engine.has_work(): engine.step()            # or engine.generate(prompts, params)
    request.generated, request.logprobs, request.finish_reason

Every step:
  1. cancelled requests leave (their blocks return to the pool);
  2. waiting requests are admitted in arrival order while fewer than max_requests run and the pool
     has the blocks of their known tokens (the prompt, less the blocks shared from the prefix
     cache) and the running requests keep the blocks they grow into this step; the first request
     that does not fit waits at the head of the queue;
  3. every decoding request gets the block its next token's K/V goes to, when it starts a new one
     (blocks are taken as a request grows, not for max_tokens up front). When the pool has none
     left, the most recently admitted running request is preempted: its blocks return to the pool
     and it goes back to the head of the queue with the tokens it has generated, to be prefilled
     again (prompt and generated tokens) when it is readmitted (vLLM's recompute preemption;
     greedy answers and seeded draws are unchanged: a recomputed prefill draws nothing). With
     reserve_whole the old rule: a request is admitted only with the blocks of prompt + max_tokens
     and never preempted. Either way the pool is never exceeded;
  4. the step's tokens: one for every decoding request, then the prefilling requests' next chunks
     (chunked prefill) until max_tokens tokens: a long prompt takes several steps and never
     holds the decoding requests back;
  5. one forward of the packed tokens (stage_forward: under PP the stages pass [T, 1, h]), the
     last stage choosing each finished chunk's next token with the request's own sampling
     parameters and generator (its seed), the tokens and log-probs broadcast as generate_tokens does;
  6. requests that produced a stop token or max_tokens leave, full prompt blocks join the prefix cache.

Every rank runs the same steps: the scheduling depends only on the requests added and cancelled
(in the same order on every rank) and on the chosen tokens, which are broadcast.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from megatron.core import communication, parallel_state
from megatron.inference.generation import _unwrapped, from_last_stage, model_device, stage_forward
from megatron.inference.kv_cache import BlockPool, PagedContext, chain_keys
from megatron.inference.sampling import check_sampling, sample


class RequestRejected(ValueError):
    """A request the engine cannot take: status is the HTTP answer (413 too long, 503 over the KV
    budget, 429 queue full)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class EngineConfig:
    """Megatron-LM's --inference-dynamic-batching-* settings that apply here.

    num_blocks: the pool size; None: buffer_size_gb worth of blocks (Megatron's
    --inference-dynamic-batching-buffer-size-gb), at most what max_requests requests of
    max_sequence_length tokens can ever hold. max_tokens: tokens per step (the chunked-prefill
    budget), at least max_requests; default max(512, max_requests), or without chunked_prefill
    max_sequence_length (a prompt is prefilled whole, in one step: at most max_tokens tokens).
    max_queue: waiting requests beyond which add_request answers 429. reserve_whole: admit a request
    only with the blocks of prompt + max_tokens (no preemption; long max_tokens hold memory they may
    never use); by default blocks are taken as requests grow and the youngest is preempted when none
    is left."""

    block_size: int = 256
    buffer_size_gb: float = 40.0
    num_blocks: int | None = None
    max_requests: int = 8
    max_tokens: int | None = None
    max_sequence_length: int = 2560
    chunked_prefill: bool = True
    prefix_caching: bool = False
    eviction_policy: str = "ref_zero"
    max_queue: int = 1024
    reserve_whole: bool = False


@dataclass
class SamplingParams:
    """One request's generation: top_k == 1 or temperature == 0 is greedy; seed: its own generator."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple = ()
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.top_k == 1 or self.temperature == 0.0


@dataclass
class Request:
    """A request's state; generated, logprobs and top_logprobs grow as it decodes."""

    request_id: int
    prompt: list
    params: SamplingParams
    generated: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)  # per token: [(id, log-prob)] * k
    finish_reason: str | None = None  # "stop", "length", "cancelled"
    blocks: list = field(default_factory=list)
    computed: int = 0  # positions whose K/V are in the cache
    preempted: int = 0  # times its blocks were taken back (and its tokens prefilled again)
    cached_tokens: int = 0  # of the prompt, found in the prefix cache
    registered: int = 0  # leading blocks offered to the prefix cache
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    token_times: list = field(default_factory=list)
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list:
        return self.prompt + self.generated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def kv_bytes_per_block(model: torch.nn.Module, block_size: int) -> int:
    """Bytes of one block on this rank: K and V of block_size tokens in each of this stage's layers."""
    gpt = _unwrapped(model)
    config = gpt.config
    layers = len(gpt.decoder.layers)
    groups = max(1, config.num_query_groups // config.tensor_model_parallel_size)
    element = torch.empty((), dtype=config.params_dtype).element_size()
    return 2 * layers * block_size * groups * config.kv_channels * element


class DynamicEngine:
    """In-flight batching of requests over one model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig = EngineConfig()) -> None:
        gpt = _unwrapped(model)
        if getattr(gpt.config, "sequence_parallel", False):
            raise ValueError("the inference engine runs without --sequence-parallel")
        if config.block_size < 1 or config.max_requests < 1 or config.max_sequence_length < 1:
            raise ValueError("block_size, max_requests and max_sequence_length must be positive")
        self.model, self.config = model, config
        self.device = model_device(model)
        self.vocab = gpt.num_tokens
        if getattr(gpt, "position_embedding_type", None) == "learned_absolute":
            self.max_sequence_length = min(config.max_sequence_length, gpt.max_sequence_length)
        else:
            self.max_sequence_length = config.max_sequence_length
        default_tokens = max(config.max_requests, 512) if config.chunked_prefill else self.max_sequence_length
        self.max_tokens = config.max_tokens or max(default_tokens, config.max_requests)
        if self.max_tokens < config.max_requests:
            raise ValueError(f"max_tokens per step ({self.max_tokens}) must be at least max_requests "
                             f"({config.max_requests}): every running request decodes each step")
        per_request = math.ceil(self.max_sequence_length / config.block_size)
        num_blocks = config.num_blocks
        if num_blocks is None:
            budget = int(config.buffer_size_gb * (1 << 30)) // kv_bytes_per_block(model, config.block_size)
            num_blocks = min(budget, config.max_requests * per_request)
        self.pool = BlockPool(num_blocks, config.eviction_policy)
        self.context = PagedContext(num_blocks, config.block_size, self.max_sequence_length)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.next_id = 0
        self.steps = 0
        self.max_blocks_in_use = 0
        self.preemptions = 0

    # -- requests -------------------------------------------------------------------------------

    def check_request(self, prompt_length: int, params: SamplingParams) -> None:
        """RequestRejected (413 / 503) or ValueError for a request this engine can never serve."""
        check_sampling(params.top_k, params.top_p, params.temperature if params.temperature > 0 else 1.0, self.vocab)
        if params.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if prompt_length < 1:
            raise ValueError("the prompt needs at least one token")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
        total = prompt_length + params.max_tokens
        if total > self.max_sequence_length:
            raise RequestRejected(413, f"prompt ({prompt_length} tokens) + max_tokens ({params.max_tokens}) = "
                                       f"{total} tokens, more than the engine's {self.max_sequence_length}")
        if not self.config.chunked_prefill and prompt_length > self.max_tokens:
            raise RequestRejected(413, f"the prompt ({prompt_length} tokens) is longer than a step's "
                                       f"{self.max_tokens} tokens and chunked prefill is off")
        if self.blocks_for(total) > self.pool.num_blocks:
            raise RequestRejected(503, f"{total} tokens need {self.blocks_for(total)} KV blocks, more than the "
                                       f"whole cache ({self.pool.num_blocks} blocks of {self.config.block_size})")

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    def add_request(self, prompt: Sequence[int], params: SamplingParams) -> Request:
        """Queue a request (RequestRejected: 413 / 503 / 429 with a message)."""
        prompt = [int(t) for t in prompt]
        self.check_request(len(prompt), params)
        if len(self.waiting) >= self.config.max_queue:
            raise RequestRejected(429, f"{len(self.waiting)} requests are waiting (the queue's limit)")
        request = Request(self.next_id, prompt, params)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.next_id += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return request

    def cancel(self, request_id: int) -> None:
        """End a request now (a disconnected client): its blocks return to the pool."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, "cancelled")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        self.pool.release(request.blocks)
        request.blocks = []
        self.requests.pop(request.request_id, None)

    # -- scheduling -----------------------------------------------------------------------------

    def _admit(self) -> None:
        bs = self.config.block_size
        # Without reserve_whole a request is admitted only if the running requests still get the blocks
        # they grow into this step (_grow): admitting it would otherwise preempt it (or another) at once.
        growing = 0 if self.config.reserve_whole else \
            sum(max(0, self.blocks_for(len(r.tokens)) - len(r.blocks)) for r in self.running)
        while self.waiting and len(self.running) < self.config.max_requests:
            request = self.waiting[0]
            keys = chain_keys(request.prompt, bs, (len(request.prompt) - 1) // bs) if self.config.prefix_caching else []
            shared = self.pool.lookup(keys)
            if self.config.reserve_whole:
                needed = self.blocks_for(len(request.prompt) + request.params.max_tokens) - len(shared)
            else:  # the known tokens (a preempted request's generated ones too); decoding takes more
                needed = self.blocks_for(len(request.tokens)) - len(shared)
            if needed + growing > self.pool.available():  # waits at the head of the queue
                self.pool.release(shared)
                break
            self.waiting.popleft()
            self.pool.lookups += len(keys)
            self.pool.hits += len(shared)
            request.blocks = shared + self.pool.allocate(needed)
            request.computed = request.cached_tokens = len(shared) * bs
            request.registered = len(shared)
            self.running.append(request)
        self.max_blocks_in_use = max(self.max_blocks_in_use, self.pool.in_use())

    def _grow(self) -> None:
        """Give every decoding request the block of the position it writes this step (oldest first);
        with none left, preempt the youngest running request (possibly the one that asked)."""
        for request in list(self.running):
            if request not in self.running:  # preempted for an older one in this loop
                continue
            needed = self.blocks_for(len(request.tokens)) - len(request.blocks)
            while needed > 0 and request in self.running:
                if self.pool.available() >= needed:
                    request.blocks += self.pool.allocate(needed)
                    break
                self._preempt(self.running[-1])
        self.max_blocks_in_use = max(self.max_blocks_in_use, self.pool.in_use())

    def _preempt(self, request: Request) -> None:
        """Take a running request's blocks back; it waits at the head of the queue with its tokens."""
        self.running.remove(request)
        self.pool.release(request.blocks)
        request.blocks, request.computed, request.cached_tokens, request.registered = [], 0, 0, 0
        request.preempted += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def _plan(self) -> list[tuple[Request, int]]:
        """(request, tokens) of this step: decoders first, then prefill chunks within max_tokens.
        Without chunked prefill a prompt runs whole, when it fits the rest of the budget (the oldest
        one always: a long prompt is not starved by decoders)."""
        budget = self.max_tokens
        plan = [(r, 1) for r in self.running if len(r.tokens) - r.computed == 1]
        budget -= len(plan)
        for index, request in enumerate([r for r in self.running if len(r.tokens) - r.computed > 1]):
            pending = len(request.tokens) - request.computed
            if self.config.chunked_prefill:
                n = min(pending, budget)
            else:
                n = pending if pending <= budget or index == 0 else 0
            if n > 0:
                plan.append((request, n))
                budget -= n
            if budget <= 0:
                break
        return plan

    @torch.no_grad()
    def step(self) -> list[Request]:
        """One forward of the running batch; the requests that got a token (or finished)."""
        self._admit()
        if not self.config.reserve_whole:
            self._grow()
        plan = self._plan()
        if not plan:
            return []
        self.steps += 1
        chunks = [(r.computed, n, r.blocks) for r, n in plan]
        self.context.set_step(chunks, self.device)
        ids = torch.tensor([t for r, n in plan for t in r.tokens[r.computed:r.computed + n]],
                           dtype=torch.int64, device=self.device)[None]  # [1, T]
        logits = stage_forward(self.model, ids, self.context.token_positions[None], self.context)  # [1, B, v] or None
        sampling = [r.computed + n == len(r.tokens) for r, n in plan]  # the chunk ends the known tokens
        chosen, log_probs, top = self._choose(logits, [r for r, _ in plan], sampling)
        now = time.perf_counter()
        touched = []
        for i, (request, n) in enumerate(plan):
            request.computed += n
            self._register_prefix(request)
            if not sampling[i]:
                continue
            touched.append(request)
            token = int(chosen[i])
            request.generated.append(token)
            request.token_times.append(now)
            if request.first_token_time is None:
                request.first_token_time = now
            if request.params.logprobs or request.params.top_logprobs:
                request.logprobs.append(float(log_probs[i]))
            if request.params.top_logprobs:
                k = request.params.top_logprobs
                request.top_logprobs.append([(int(t), float(v)) for t, v in zip(top[1][i, :k], top[0][i, :k])])
            if token in request.params.stop_token_ids:
                self._finish(request, "stop")
            elif len(request.generated) >= request.params.max_tokens or len(request.tokens) >= self.max_sequence_length:
                self._finish(request, "length")
        return touched

    def _register_prefix(self, request: Request) -> None:
        if not self.config.prefix_caching:
            return
        bs = self.config.block_size
        full = min(request.computed, len(request.prompt)) // bs  # prompt blocks whose K/V are all written
        if full > request.registered:
            keys = chain_keys(request.prompt, bs, full)
            for j in range(request.registered, full):
                self.pool.register(keys[j], request.blocks[j])
            request.registered = full

    def _choose(self, logits: torch.Tensor | None, requests: list[Request], sampling: list[bool]):
        """Each row's next token [B] (the same on every rank), its log-prob [B] and the top log-probs
        (values, ids) [B, k] (k = the largest top_logprobs asked, or 0)."""
        b = len(requests)
        k = max([r.params.top_logprobs for r in requests] + [0])
        chosen = torch.zeros(b, dtype=torch.int64, device=self.device)
        log_probs = torch.zeros(b, device=self.device)
        top_values = torch.zeros(b, k, device=self.device)
        top_ids = torch.zeros(b, k, dtype=torch.int64, device=self.device)
        if logits is not None:  # the last pipeline stage
            last = logits.reshape(b, -1)  # [1, B, v] -> [B, v]
            chosen = torch.argmax(last, dim=-1)
            for i, request in enumerate(requests):
                params = request.params
                if sampling[i] and not params.greedy:
                    chosen[i] = sample(last[i:i + 1], top_k=params.top_k, top_p=params.top_p,
                                       temperature=params.temperature, generator=request.generator)[0]
            if any(r.params.logprobs or r.params.top_logprobs for r in requests):
                normalized = torch.log_softmax(last, dim=-1)  # [B, v]: the model's distribution
                log_probs = normalized.gather(1, chosen[:, None])[:, 0]
                if k:
                    top_values, top_ids = normalized.topk(min(k, normalized.shape[-1]), dim=-1)
        if parallel_state.get_tensor_model_parallel_world_size() > 1:  # unseeded draws may differ by rank
            communication.broadcast(chosen, parallel_state.get_tensor_model_parallel_src_rank(),
                                    group=parallel_state.get_tensor_model_parallel_group())
        chosen = from_last_stage(chosen)
        if any(r.params.logprobs or r.params.top_logprobs for r in requests):
            log_probs = from_last_stage(log_probs.contiguous())
            if k:
                top_values, top_ids = from_last_stage(top_values.contiguous()), from_last_stage(top_ids.contiguous())
        return chosen.cpu(), log_probs.cpu(), (top_values.cpu(), top_ids.cpu())

    # -- convenience ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_step: Callable[[list], None] | None = None) -> list[Request]:
        """Serve prompts together until every one finished; the requests in prompt order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        requests = [self.add_request(p, q) for p, q in zip(prompts, params)]
        while self.has_work():
            touched = self.step()
            if on_step is not None:
                on_step(touched)
        return requests

    def stats(self) -> dict:
        """Counters: steps, blocks (total, in use, the most ever in use), preemptions, prefix-cache lookups
        and hits."""
        return {"steps": self.steps, "num_blocks": self.pool.num_blocks, "blocks_in_use": self.pool.in_use(),
                "max_blocks_in_use": self.max_blocks_in_use, "preemptions": self.preemptions,
                "prefix_lookups": self.pool.lookups,
                "prefix_hits": self.pool.hits,
                "prefix_hit_rate": self.pool.hits / self.pool.lookups if self.pool.lookups else 0.0}
