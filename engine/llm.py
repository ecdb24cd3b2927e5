"""The library API: `LLM(model=...)`, `generate(prompts, params)`, and a step-wise interface.

    from kvtier.engine import LLM, SamplingParams
    with LLM("smollm2-135m", device="cpu", disk_cache=False) as llm:
        outputs = llm.generate(["Hello!"], SamplingParams(max_tokens=16))

One `LLM` owns a model, a `TierManager` (GPU pool, host and disk tiers), a scheduler and a
model runner, and drives them from the calling thread. Programs that interleave their own work
use `add_request` / `step` / `has_unfinished` instead of `generate`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from kvtier.engine.attention import select_backend
from kvtier.engine.engine_config import EngineConfig, default_disk_cache_dir
from kvtier.engine.loader import LoadedModel, load_model, resolve_device_dtype
from kvtier.engine.model_runner import ModelRunner
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.request import Request, RequestId, check_token_ids
from kvtier.engine.sampler import SamplingParams, sample
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.streaming import OutputTracker, RequestDelta

from kvtier.config import TierConfig
from kvtier.hashing import BlockHasher, namespace_hash
from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.stats import ManagerStats

Prompt = str | Sequence[int]

#: On the CPU the "device" memory is the machine's RAM, shared with everything else; the
#: memory fraction applies to at most this much of it.
CPU_KV_LIMIT_BYTES = 4 << 30

#: While only transfers are in flight a step may have nothing to run; it then waits this long
#: (seconds) instead of spinning.
_IDLE_WAIT_S = 0.0005


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda when available, else cpu; "cpu", "cuda", "cuda:N" as given.

    Raises ValueError for anything else, and for CUDA when it is not available.
    """
    if isinstance(device, torch.device):
        resolved = device
    elif device == "auto":
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        text = str(device)
        if text != "cpu" and not (text == "cuda" or text.startswith("cuda:")):
            raise ValueError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda' or "
                             "'cuda:N'")
        try:
            resolved = torch.device(text)
        except RuntimeError as exc:
            raise ValueError(f"unknown device {device!r}: {exc}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use 'cpu'")
    return resolved


class LLM:
    """An inference engine over one model with tiered KV caching.

    model: "smollm2-135m", a Hugging Face directory, a .gguf file, "random:<name>", or an
    already loaded `LoadedModel` (its device, dtype and attention backend are used; the
    model is shared, never modified, so several engines may run one after the other on it).
    device: "auto", "cpu", "cuda" or "cuda:N"; dtype: "auto" (float32 on CPU, bfloat16 on
    CUDA), "float32", "bfloat16" or "float16". The other keywords are `EngineConfig`'s.
    Raises ValueError for a bad option or a budget that cannot hold one block, and the
    loader's errors (FileNotFoundError, ValueError, OSError) for a model it cannot load.
    """

    def __init__(self, model: str | LoadedModel = "smollm2-135m", *,
                 device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
                 block_size: int = 16,
                 gpu_blocks: int | None = None, gpu_memory_fraction: float = 0.5,
                 host_cache: bool = True, host_cache_gb: float = 1.0,
                 disk_cache: bool = True, disk_cache_dir: str | Path | None = None,
                 disk_cache_gb: float = 10.0, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, hash_algorithm: str = "xxh3_128",
                 attn_backend: str = "auto", seed: int | None = 0,
                 cuda_graphs: bool = True) -> None:
        self.config = EngineConfig(
            block_size=block_size, gpu_blocks=gpu_blocks,
            gpu_memory_fraction=gpu_memory_fraction, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, host_cache=host_cache,
            host_cache_gb=host_cache_gb, disk_cache=disk_cache, disk_cache_dir=disk_cache_dir,
            disk_cache_gb=disk_cache_gb, hash_algorithm=hash_algorithm,
            attn_backend=attn_backend, seed=seed, cuda_graphs=cuda_graphs)
        if isinstance(model, LoadedModel):
            loaded = model
            self.device, self.dtype = _check_loaded(loaded, device, dtype)
        else:
            self.device, self.dtype = resolve_device_dtype(resolve_device(device), dtype)
            backend = select_backend(self.device, block_size, attn_backend)
            loaded = load_model(model, self.device, self.dtype, attn_backend=backend)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.model_id = loaded.model_id
        self.max_model_len = loaded.config.max_position_embeddings
        self.layout = loaded.config.kv_layout(block_size, self.dtype)
        self.num_gpu_blocks = self._num_gpu_blocks(self.layout)
        self.manager = TierManager(self.layout, self._tier_config(self.layout), self.device)
        self.scheduler = Scheduler(self.manager, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.manager.kv_cache, block_size, self._sample)
        if (self.config.cuda_graphs and self.device.type == "cuda"
                and getattr(self.model, "attn_backend", None) == "triton"):
            # Recorded at start (a few seconds at most), not inside the first decode steps.
            self.runner.enable_cuda_graphs(
                max_num_seqs, min(self.max_model_len, self.num_gpu_blocks * block_size))
        self._eos_token_ids = frozenset(loaded.config.eos_token_ids)
        self._requests: dict[RequestId, Request] = {}
        self._generators: dict[RequestId, torch.Generator] = {}
        self._unclaimed: list[RequestOutput] = []
        self._tracker = OutputTracker(self.tokenizer)
        self._stopped: list[Request] = []  # aborted, reported by the next step
        self._request_counter = itertools.count()
        self._closed = False

    # ---- construction helpers ------------------------------------------------------------

    def _num_gpu_blocks(self, layout: KVLayout) -> int:
        cfg = self.config
        if cfg.gpu_blocks is not None:
            return cfg.gpu_blocks
        if self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
        else:
            free_bytes = min(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                             CPU_KV_LIMIT_BYTES)
        num_blocks = int(free_bytes * cfg.gpu_memory_fraction) // layout.bytes_per_block
        # More than every running sequence at full context could ever use is wasted memory.
        ceiling = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        num_blocks = min(num_blocks, ceiling)
        if num_blocks < 1:
            raise ValueError(f"gpu_memory_fraction={cfg.gpu_memory_fraction} of the free "
                             f"memory holds no {layout.bytes_per_block}-byte block; raise it "
                             "or pass gpu_blocks")
        return num_blocks

    def _tier_config(self, layout: KVLayout) -> TierConfig:
        cfg = self.config
        host_bytes = cfg.host_cache_bytes
        if host_bytes and host_bytes < layout.bytes_per_block:
            raise ValueError(f"host_cache_gb={cfg.host_cache_gb} is smaller than one block "
                             f"({layout.bytes_per_block} bytes); raise it or turn the host "
                             "cache off")
        disk_path = None
        if cfg.disk_cache:
            disk_path = Path(cfg.disk_cache_dir) if cfg.disk_cache_dir is not None \
                else default_disk_cache_dir()
        return TierConfig(num_gpu_blocks=self.num_gpu_blocks, host_capacity_bytes=host_bytes,
                          disk_path=disk_path,
                          disk_budget_bytes=cfg.disk_cache_bytes if disk_path else None)

    # ---- requests ------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt, raw: bool = False) -> tuple[int, ...]:
        """Token ids of a prompt: a string goes through the chat template (when the tokenizer
        has one and not `raw`) or plain encoding; token ids are checked and kept.

        Raises ValueError for an empty prompt, out-of-vocabulary ids, or a string when the
        model has no tokenizer.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give some text or token ids")
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_id} has no tokenizer; pass token ids")
            if not raw and getattr(self.tokenizer, "chat_template", None):
                encoded = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True,
                    tokenize=True)
                if not isinstance(encoded, list):  # transformers 5 returns a BatchEncoding
                    encoded = encoded["input_ids"]
            else:
                encoded = self.tokenizer.encode(prompt)
            token_ids: Sequence[int] = encoded
        else:
            token_ids = prompt
        return check_token_ids(token_ids, self.model_config.vocab_size)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    raw: bool = False) -> str:
        """Queue one request; returns its id. `cache_salt` keeps its cached blocks apart
        from other tenants'. Raises ValueError for a bad prompt, a duplicate id, a prompt
        that leaves no room in the model's context, or one that cannot fit alone in the
        GPU block budget."""
        self._check_open()
        token_ids = self.tokenize(prompt, raw)
        self._check_fits(token_ids)
        return self._enqueue(token_ids, params, request_id, cache_salt,
                             prompt if isinstance(prompt, str) else None)

    def _enqueue(self, token_ids: tuple[int, ...], params: SamplingParams | None,
                 request_id: str | None, cache_salt: str | None, text: str | None) -> str:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params)}")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
        index = next(self._request_counter)
        rid = RequestId(request_id if request_id is not None else f"req-{index}")
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        namespace = namespace_hash(self.model_id, self.layout, self.config.hash_algorithm,
                                   cache_salt)
        request = Request(
            request_id=rid, prompt_token_ids=token_ids, params=params,
            hasher=BlockHasher(namespace, self.config.block_size, self.config.hash_algorithm),
            max_num_tokens=min(len(token_ids) + params.max_tokens, self.max_model_len),
            arrival_time=time.perf_counter(), eos_token_ids=self._eos_token_ids,
            ignore_eos=params.ignore_eos, stop_token_ids=frozenset(params.stop_token_ids),
            prompt=text)
        self._requests[rid] = request
        self._generators[rid] = self._generator_for(params, index)
        self.scheduler.add_request(request)
        return rid

    def _check_fits(self, token_ids: Sequence[int]) -> None:
        num_tokens = len(token_ids)
        if num_tokens >= self.max_model_len:
            raise ValueError(f"the prompt has {num_tokens} tokens; the model's context is "
                             f"{self.max_model_len} and at least one token must be generated; "
                             "shorten the prompt")
        bs = self.config.block_size
        num_blocks = -(-num_tokens // bs)
        if num_blocks > self.num_gpu_blocks:
            raise ValueError(f"the prompt needs {num_blocks} blocks of {bs} tokens but the GPU "
                             f"block budget is {self.num_gpu_blocks}; raise gpu_blocks or "
                             "gpu_memory_fraction, or shorten the prompt")

    def _generator_for(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        seed = params.seed
        if seed is None and self.config.seed is not None:
            # Deterministic per run: the engine seed and the request's arrival order.
            seed = self.config.seed + index
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        params = [r.params for r in requests]
        generators = [self._generators.get(r.request_id) for r in requests]
        return sample(logits, params, generators)

    # ---- stepping ------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._stopped)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests that finished in it (and any finished
        earlier that `generate` did not claim). Raises RuntimeError if no request can make
        progress (a scheduling bug; never expected)."""
        _, finished = self._run_step()
        outputs, self._unclaimed = self._unclaimed, []
        outputs += [self._retire(request) for request in finished]
        return outputs

    def stream_step(self) -> list[RequestDelta]:
        """Run one engine step; return a `RequestDelta` (new tokens, new text, finish reason)
        for every request that got a token or finished in it, aborted ones included. The
        last delta of a request carries its `RequestOutput`. Raises as `step`."""
        stepped, finished = self._run_step()
        deltas = [self._tracker.delta(r) for r in stepped if not r.is_finished]
        for request in finished:
            delta = self._tracker.delta(request)
            deltas.append(dataclasses.replace(delta, output=self._retire(request)))
        return deltas

    def abort(self, request_id: str) -> bool:
        """Stop a request now: it leaves the queues and its blocks are freed at once (its full
        blocks stay cached). The next step reports it with finish reason "abort". Returns
        False when no unfinished request has that id."""
        request = self._requests.get(RequestId(request_id))
        if request is None or request.is_finished:
            return False
        self.scheduler.stop(request, "abort")
        self._stopped.append(request)
        return True

    def _run_step(self) -> tuple[list[Request], list[Request]]:
        """One engine step: (requests that sampled a token, requests that finished)."""
        self._check_open()
        plan = self.scheduler.schedule()
        sampled = self.runner.execute(plan.scheduled) if plan.scheduled else []
        finished = self._stopped + self.scheduler.update(plan, sampled)
        self._stopped = []
        stepped = [s.request for s in plan.scheduled if s.samples]
        for request in stepped:
            if not self._tracker.check_stop(request):
                continue
            if request.is_finished:  # its last token also reached a limit: the stop string wins
                request.finish_reason = "stop"
            else:
                self.scheduler.stop(request, "stop")
                finished.append(request)
        if not plan.scheduled and not finished and self.scheduler.has_unfinished():
            # Only transfers can free blocks or finish loads now: wait for them a little.
            if not (self.scheduler.num_loading or self.manager.stats().num_jobs_in_flight):
                raise RuntimeError("the scheduler could not run any request and no transfer "
                                   "is in flight to make room")
            time.sleep(_IDLE_WAIT_S)
        return stepped, finished

    def _retire(self, request: Request) -> RequestOutput:
        """The final output of a finished request, which the engine then forgets."""
        output = self._output(request)
        del self._requests[request.request_id]
        self._generators.pop(request.request_id, None)
        self._tracker.forget(request.request_id)
        return output

    def _output(self, request: Request) -> RequestOutput:
        output_ids = tuple(request.output_token_ids)
        text = self._tracker.final_text(request)  # stop strings cut, stop token's text left out
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             output_ids, text, request.finish_reason, request.metrics())

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 raw: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        `prompts`: one string, one list of token ids, or a list of either. A single
        SamplingParams applies to all; a list gives one per prompt. Every prompt is checked
        before any is queued (ValueError names the first bad one).
        """
        batch = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(batch)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(batch):
                raise ValueError(f"{len(params_list)} sampling params for {len(batch)} prompts; "
                                 "give one, or one per prompt")
        encoded = []
        for index, prompt in enumerate(batch):
            try:
                token_ids = self.tokenize(prompt, raw)
                self._check_fits(token_ids)
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from None
            encoded.append(token_ids)
        self._check_open()
        ids = [self._enqueue(token_ids, params, None, None,
                             prompt if isinstance(prompt, str) else None)
               for token_ids, params, prompt in zip(encoded, params_list, batch)]
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        while pending:
            for output in self.step():
                if output.request_id in pending:
                    pending.discard(output.request_id)
                    done[output.request_id] = output
                else:
                    self._unclaimed.append(output)
        return [done[rid] for rid in ids]

    # ---- inspection and lifetime ---------------------------------------------------------

    def stats(self) -> ManagerStats:
        """The tier manager's counters (per-tier hits and misses, bytes moved, pool state)."""
        return self.manager.stats()

    def close(self) -> None:
        """Wait for in-flight transfers, flush the host tier to disk and close it."""
        if not self._closed:
            self._closed = True
            self.runner.graphs = None  # the graphs' memory pool goes with them
            self.manager.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this LLM is closed; create a new one")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_loaded(loaded: LoadedModel, device: str | torch.device,
                  dtype: str | torch.dtype) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of an already loaded model; ValueError if they contradict the
    ones asked for."""
    weight = next(loaded.model.parameters())
    if device != "auto" and resolve_device(device).type != weight.device.type:
        raise ValueError(f"the loaded model is on {weight.device}, not {device}")
    if dtype != "auto" and resolve_device_dtype(weight.device, dtype)[1] != weight.dtype:
        raise ValueError(f"the loaded model is {weight.dtype}, not {dtype}")
    return weight.device, weight.dtype


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if not items:
        raise ValueError("no prompts given")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt given as token ids
    return items
