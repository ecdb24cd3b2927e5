"""The library API: `LLM(model=...)`, `generate(prompts, params)`, `chat(messages, params)`,
and a step-wise interface. It follows vLLM's offline API: `generate` takes raw prompts (no
chat template), `chat` applies the model's chat template, and both return `RequestOutput`s
whose `outputs[i].text` is the i-th completion.

    from kvtier.engine import LLM, SamplingParams
    with LLM("smollm2-135m", device="cpu", disk_cache=False) as llm:
        outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
        answer = llm.chat([{"role": "user", "content": "Hello!"}])[0].outputs[0].text

One `LLM` owns a model, a `TierManager` (GPU pool, host and disk tiers), a scheduler and a
model runner, and drives them from the calling thread. Programs that interleave their own work
use `add_request` / `step` / `has_unfinished` instead of `generate`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from kvtier.engine.assembly import assemble
from kvtier.engine.block_taps import BlockTap
from kvtier.engine.completions import Completions, completion_request_ids
from kvtier.engine.config_sources import load_engine_config
from kvtier.engine.flush_progress import FlushProgressLine
from kvtier.engine.loader import LoadedModel
from kvtier.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvtier.engine.prompts import Conversation, Prompt, as_prompt_list, render_chat
from kvtier.engine.request import Request, RequestId, check_token_ids
from kvtier.engine.request_failures import RequestFailures, record_logprobs, sample_each_alone
from kvtier.engine.restore_gate import RestoreCounts
from kvtier.engine.sampler import SamplingParams, make_generator
from kvtier.engine.scheduler import MAX_STEPS_AHEAD, TRANSFER_WAIT_S
from kvtier.engine.streaming import OutputTracker, RequestDelta
from kvtier.engine.thread_time import ThreadTime
from kvtier.engine.warmup import WarmupReport

from kvtier.hashing import BlockHasher, namespace_hash
from kvtier.manager import FlushReport
from kvtier.stats import ManagerStats
from kvtier.tiers.remote.config import RemoteConfig

log = logging.getLogger("kvtier.engine")


class LLM:
    """An inference engine over one model with tiered KV caching.

    model: "smollm2-135m", a Hugging Face hub id found in the local cache, a model
    directory, a .gguf file, "random:<name>", or an already loaded `LoadedModel` (its
    device, dtype and attention backend are used; the model is shared, its weights never
    modified, so several engines may run one after the other on it; each engine's runner
    sets the model's kernels to its own `deterministic` mode before every step). config: a
    YAML file of settings.
    The other keywords are `EngineConfig`'s fields (see there, and for how kvtier's
    `gpu_memory_utilization` differs from vLLM's); a keyword left None takes its value from
    the config file, else `$KVTIER_CONFIG`'s file, else a `KVTIER_<FIELD>` environment
    variable, else the default. warmup: on CUDA, compile every kernel shape a step can reach
    before the first request (`kvtier.engine.warmup`; logs its time; Triton's cache goes
    under the user cache directory); False skips it (tests that build many engines).
    remote_cache="redis://..." shares KV blocks with other engines through Redis.
    Raises ValueError for a bad option or a budget that cannot hold one block, and the
    loader's errors (FileNotFoundError, ValueError, OSError) for a model it cannot load.
    """

    def __init__(self, model: str | LoadedModel | None = None, *,
                 config: str | Path | None = None,
                 device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None,
                 block_size: int | None = None, gpu_blocks: int | None = None,
                 gpu_memory_utilization: float | None = None,
                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None,
                 long_prefill_token_threshold: int | None = None,
                 host_cache: bool | None = None, host_cache_gb: float | None = None,
                 disk_cache: bool | None = None, disk_cache_dir: str | Path | None = None,
                 disk_cache_gb: float | None = None, disk_durable: bool | None = None,
                 disk_shards: int | None = None, disk_worker: bool | None = None,
                 hash_algorithm: str | None = None,
                 cache_salt: str | None = None, attn_backend: str | None = None,
                 seed: int | None = None, cuda_graphs: bool | None = None,
                 warmup: bool | None = None, restore_min_saving_s: float | None = None,
                 remote_cache: str | RemoteConfig | None = None,
                 deterministic: bool | None = None,
                 flush_timeout_s: float | None = None) -> None:
        explicit = dict(
            model=model if isinstance(model, str) else None,
            device=str(device) if isinstance(device, torch.device) else device,
            dtype=str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype,
            block_size=block_size, gpu_blocks=gpu_blocks,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            host_cache=host_cache, host_cache_gb=host_cache_gb, disk_cache=disk_cache,
            disk_cache_dir=disk_cache_dir, disk_cache_gb=disk_cache_gb,
            disk_durable=disk_durable, disk_shards=disk_shards, disk_worker=disk_worker,
            hash_algorithm=hash_algorithm,
            cache_salt=cache_salt,
            attn_backend=attn_backend,
            seed=seed, cuda_graphs=cuda_graphs, warmup=warmup,
            restore_min_saving_s=restore_min_saving_s, remote_cache=remote_cache,
            deterministic=deterministic, flush_timeout_s=flush_timeout_s)
        self.config = cfg = load_engine_config(explicit, config)
        parts = assemble(cfg, model if isinstance(model, LoadedModel) else None, device, dtype,
                         self._sample)
        loaded = parts.loaded
        self.device, self.dtype = parts.device, parts.dtype
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.model_id = loaded.model_id
        self.model_fingerprint = loaded.cache_identity
        self.max_model_len = parts.max_model_len
        self.layout = parts.layout
        self.num_gpu_blocks = parts.num_gpu_blocks
        self.manager = parts.manager
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.warmup_report: WarmupReport | None = parts.warmup_report
        self._eos_token_ids = frozenset(loaded.config.eos_token_ids)
        self._requests: dict[RequestId, Request] = {}
        self._generators: dict[RequestId, torch.Generator] = {}
        self._logprobs: dict[RequestId, list[dict[int, Logprob]]] = {}
        self._completions = Completions()  # the caller's requests behind the engine's
        self._unclaimed: list[RequestOutput] = []
        self._tracker = OutputTracker(self.tokenizer)
        self._stopped: list[Request] = []  # aborted, reported by the next step
        # Requests a computation of their own failed: they end with "error" at the end of
        # the step.
        self._failures = RequestFailures()
        self._step_requests: list[Request] = []  # the running step's, for `_abort_step`
        self._thread_time = ThreadTime()  # see `thread_time`
        # When the running step's launch began and its `Scheduler.launched` ended.
        self._launch_began = self._launch_ended = 0.0
        self._request_counter = itertools.count()
        self._closed = False

    # ---- requests ------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        """Token ids of a raw prompt: a string is encoded as it is (the tokenizer's special
        tokens, such as BOS, included; no chat template); token ids are checked and kept.

        Raises ValueError for an empty prompt, out-of-vocabulary ids, or a string when the
        model has no tokenizer.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give some text or token ids")
            token_ids: Sequence[int] = self._require_tokenizer().encode(prompt)
        else:
            token_ids = prompt
        return check_token_ids(token_ids, self.model_config.vocab_size)

    def render_chat(self, messages: Conversation) -> str:
        """The text of a conversation through the model's chat template, ending with the
        prompt for the assistant's turn. Raises ValueError for an empty or malformed
        conversation, or a model without a chat template."""
        return render_chat(self._require_tokenizer(), messages, self.model_id)

    def tokenize_chat(self, messages: Conversation) -> tuple[int, ...]:
        """Token ids of a conversation through the chat template (see `render_chat`)."""
        text = self.render_chat(messages)
        # The template already holds the special tokens (BOS and the turn markers).
        encoded = self._require_tokenizer().encode(text, add_special_tokens=False)
        return check_token_ids(encoded, self.model_config.vocab_size)

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_id} has no tokenizer; pass token ids")
        return self.tokenizer

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    block_tap: BlockTap | None = None) -> str:
        """Queue one request on a raw prompt (text or token ids; use `tokenize_chat` for a
        conversation); returns its id. `cache_salt` keeps its cached blocks apart from other
        tenants' (default: the engine's `cache_salt`). Raises ValueError for a bad prompt, a
        duplicate id, a prompt that leaves no room in the model's context, or one that cannot
        fit alone in the GPU block budget. `block_tap` is given the prompt's blocks as they
        become ready (`kvtier.engine.block_taps.BlockTap`; with n > 1, the first
        completion's)."""
        self._check_open()
        token_ids = self.tokenize(prompt)
        self._check_fits(token_ids)
        parent_id = self._enqueue(token_ids, params, request_id, cache_salt,
                                  prompt if isinstance(prompt, str) else None)
        if block_tap is not None:
            self.scheduler.tap_blocks(RequestId(self.completion_ids(parent_id)[0]), block_tap)
        return parent_id

    def completion_ids(self, request_id: str) -> list[str]:
        """The engine requests of a queued request: itself when n = 1, else `<i>_<id>`
        for each of its n completions (as `stream_step` reports them)."""
        return self._completions.ids(request_id)

    def _enqueue(self, token_ids: tuple[int, ...], params: SamplingParams | None,
                 request_id: str | None, cache_salt: str | None, text: str | None) -> str:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params)}")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
        index = next(self._request_counter)
        parent_id = request_id if request_id is not None else f"req-{index}"
        # n > 1: one engine request per completion; they share the prompt's cached blocks.
        if parent_id in self._completions or any(
                c in self._requests for c in completion_request_ids(parent_id, params.n)):
            raise ValueError(f"request id {parent_id!r} is already in use")
        salt = cache_salt if cache_salt is not None else self.config.cache_salt
        namespace = namespace_hash(self.model_fingerprint, self.layout,
                                   self.config.hash_algorithm, salt)
        child_ids = self._completions.add(parent_id, text, token_ids, params.n)
        for completion, rid in enumerate(child_ids):
            request = Request(
                request_id=rid, prompt_token_ids=token_ids, params=params,
                hasher=BlockHasher(namespace, self.config.block_size,
                                   self.config.hash_algorithm),
                max_num_tokens=min(len(token_ids) + params.max_tokens, self.max_model_len),
                arrival_time=time.perf_counter(), eos_token_ids=self._eos_token_ids,
                ignore_eos=params.ignore_eos, stop_token_ids=frozenset(params.stop_token_ids),
                prompt=text)
            self._requests[rid] = request
            self._generators[rid] = make_generator(params, self.device, self.config.seed, index,
                                                   completion)
            if params.logprobs is not None:
                self._logprobs[rid] = []
            self.scheduler.add_request(request)
        return parent_id

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
                             "gpu_memory_utilization, or shorten the prompt")

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        token_ids = sample_each_alone(logits, requests, self._generators, self._failures)
        if any(r.params.logprobs is not None for r in requests):
            decode = None if self.tokenizer is None else \
                (lambda t: self.tokenizer.decode([t]))
            record_logprobs(logits, token_ids, requests, decode, self._failures, self._logprobs)
        return token_ids

    # ---- stepping ------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._stopped)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests that finished in it (and any finished
        earlier that `generate` did not claim). A request with n > 1 is returned once all
        its completions have finished. Raises RuntimeError if no request can make progress
        (a scheduling bug; never expected)."""
        _, finished = self._run_step()
        outputs, self._unclaimed = self._unclaimed, []
        for request in finished:
            output = self._complete(request)
            if output is not None:
                outputs.append(output)
        return outputs

    def stream_step(self) -> list[RequestDelta]:
        """Run one engine step; return a `RequestDelta` (new tokens, new text, finish reason)
        for every engine request that got a token or finished in it, aborted ones included
        (with n > 1, each completion streams as its own engine request, `<i>_<id>`). The
        last delta of a request carries its `RequestOutput` (with n > 1: the last delta of
        the last completion to finish). Raises as `step`."""
        stepped, finished = self._run_step()
        deltas = []
        for request in stepped:
            if request.is_finished:
                continue
            delta = self._delta(request)
            if delta is not None:
                deltas.append(delta)
        # A text that failed to decode ends its request now.
        self._failures.end_failed(self._requests, self.scheduler, finished)
        for request in finished:
            rid = request.request_id
            delta = self._delta(request) or RequestDelta(
                rid, (), "", "error", index=self._completions.index_of(rid))
            error = self._failures.message(rid)
            output = self._complete(request)
            deltas.append(dataclasses.replace(
                delta, output=output, error=error,
                finish_reason="error" if error is not None else delta.finish_reason))
        return deltas

    def _delta(self, request: Request) -> RequestDelta | None:
        """The request's `RequestDelta` with its logprobs; None when its text failed."""
        try:
            delta = self._tracker.delta(request)
        except Exception as exc:  # noqa: BLE001 (a tokenizer that fails on these ids)
            self._failures.fail(request, "detokenizing its output", exc)
            return None
        completion = self._completions.index_of(request.request_id)
        if completion:
            delta = dataclasses.replace(delta, index=completion)
        logprobs = self._logprobs.get(request.request_id)
        if logprobs is not None:
            end = len(request.output_token_ids)
            delta = dataclasses.replace(
                delta, logprobs=tuple(logprobs[end - len(delta.token_ids):end]))
        return delta

    def abort(self, request_id: str) -> bool:
        """Stop a request now (every completion of it, with n > 1): it leaves the queues and
        its blocks are freed at once (its full blocks stay cached). The next step reports it
        with finish reason "abort". Returns False when no unfinished request has that id."""
        targets = [request for rid, request in self._requests.items()
                   if self._completions.request_of(rid) == request_id and not request.is_finished
                   and request not in self._stopped]
        for request in targets:
            self.scheduler.stop(request, "abort")
            self._stopped.append(request)
        return bool(targets)

    def _run_step(self) -> tuple[list[Request], list[Request]]:
        """One engine step: (requests that sampled a token, requests that finished).

        An unexpected error inside the step ends the step's requests with "error" (every
        unfinished one when the step had none, so that a request that fails the scheduler
        cannot fail every later step too) and the engine goes on; an error while ending
        them is raised (the engine's state cannot be trusted any more)."""
        self._check_open()
        self._step_requests = []
        try:
            return self._step()
        except Exception as exc:  # noqa: BLE001 (the step's requests fail, the engine goes on)
            log.exception("an engine step failed; its requests end with an error")
            return [], self._abort_step(exc)

    def _launched(self) -> None:
        """`Scheduler.launched`, timed: the runner calls it once the step is queued."""
        launched = time.perf_counter()
        self.scheduler.launched()
        self._launch_ended = time.perf_counter()
        self._thread_time.launching_s += launched - self._launch_began
        self._thread_time.after_launch_s += self._launch_ended - launched

    def _abort_step(self, exc: Exception) -> list[Request]:
        requests = [r for r in self._step_requests if not r.is_finished] \
            or [r for r in self.scheduler.running if not r.is_finished] \
            or [r for r in self._requests.values() if not r.is_finished]
        for request in requests:
            self._failures.fail_step(request)
            self.scheduler.stop(request, "error")
        finished, self._stopped = self._stopped + requests, []
        return finished

    def _step(self) -> tuple[list[Request], list[Request]]:
        # Plan the next step once the GPU is down to MAX_STEPS_AHEAD queued steps, landing
        # loads meanwhile (a restore's claims are then made on what has landed by then).
        began = time.perf_counter()
        while self.runner.step_timer.num_queued() > MAX_STEPS_AHEAD:
            self.scheduler.while_device_busy()
        planning = time.perf_counter()
        plan = self.scheduler.schedule()
        self._launch_began = time.perf_counter()
        self._thread_time.waiting_s += planning - began
        self._thread_time.planning_s += self._launch_began - planning
        self._step_requests = [s.request for s in plan.scheduled]
        # The restores' further loads, the stores the last update queued and the transfers'
        # host work run while the GPU computes this step.
        if plan.scheduled:
            # While loads are under way they land as the GPU computes, not at the step's
            # end; otherwise the sampled ids are simply waited for.
            busy = self.scheduler.while_device_busy if self.scheduler.num_loading else None
            sampled = self.runner.execute(plan.scheduled, self._launched, busy)
            self._thread_time.waiting_s += time.perf_counter() - self._launch_ended
        else:
            sampled = []
            self._launched()
        self.scheduler.prefill_rate.observe_steps(self.runner.step_timer.finished())
        self.scheduler.prefill_rate.set_backlog(self.runner.step_timer.unfinished())
        finished = self._stopped + self.scheduler.update(plan, sampled)
        self._stopped = []
        stepped = [s.request for s in plan.scheduled if s.samples]
        for request in stepped:
            try:
                if not self._tracker.check_stop(request):
                    continue
            except Exception as exc:  # noqa: BLE001 (this request fails, alone)
                self._failures.fail(request, "looking for its stop strings", exc)
                continue
            if request.is_finished:  # its last token also reached a limit: the stop string wins
                request.finish_reason = "stop"
            else:
                self.scheduler.stop(request, "stop")
                finished.append(request)
        self._failures.end_failed(self._requests, self.scheduler, finished)
        if self.scheduler.idle(ran=bool(plan.scheduled or finished)):
            self.manager.wait_for_transfers(TRANSFER_WAIT_S)
        return stepped, finished

    def _complete(self, request: Request) -> RequestOutput | None:
        """Record a finished engine request; the parent's output once all its completions
        are in."""
        rid = request.request_id
        del self._requests[rid]
        self._generators.pop(rid, None)
        output_ids = tuple(request.output_token_ids)
        try:
            text = self._tracker.final_text(request)  # stop strings cut, stop token's left out
        except Exception as exc:  # noqa: BLE001 (this request fails, alone)
            self._failures.fail(request, "detokenizing its output", exc)
            text = ""
        self._tracker.forget(rid)
        error = self._failures.pop(rid)
        logprobs = self._logprobs.pop(rid, None)
        cumulative = None if logprobs is None or error is not None else \
            sum(entry[token].logprob for entry, token in zip(logprobs, output_ids))
        completion = self._completions.index_of(rid)
        return self._completions.finish(rid, CompletionOutput(
            completion, text, output_ids, cumulative, logprobs,
            "error" if error is not None else request.finish_reason, error), request.metrics())

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every raw prompt (no chat template, as vLLM's `generate`); outputs
        come back in the prompts' order.

        `prompts`: one string, one list of token ids, a {"prompt": str} or
        {"prompt_token_ids": [...]} mapping, or a list of any of these. A single
        SamplingParams applies to all; a list gives one per prompt. Every prompt is checked
        before any is queued (ValueError names the first bad one).
        """
        batch = as_prompt_list(prompts)
        encoded = []
        for index, prompt in enumerate(batch):
            try:
                token_ids = self.tokenize(prompt)
                self._check_fits(token_ids)
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from None
            encoded.append(token_ids)
        texts = [p if isinstance(p, str) else None for p in batch]
        return self._run(encoded, texts, sampling_params)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
             ) -> list[RequestOutput]:
        """Answer one conversation, or each of a list of them, through the model's chat
        template (system prompts included), as vLLM's `chat`. A message is
        {"role": "system" | "user" | "assistant", "content": str}. Outputs come back in
        order; each output's `prompt` is the rendered template text. Raises ValueError for
        a model without a chat template or a malformed conversation (naming which one).
        """
        if messages and isinstance(messages[0], Mapping):
            conversations: list[Conversation] = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        if not conversations:
            raise ValueError("no conversation given")
        encoded, texts = [], []
        for index, conversation in enumerate(conversations):
            try:
                texts.append(self.render_chat(conversation))
                token_ids = self.tokenize_chat(conversation)
                self._check_fits(token_ids)
            except ValueError as exc:
                raise ValueError(f"conversation {index}: {exc}") from None
            encoded.append(token_ids)
        return self._run(encoded, texts, sampling_params)

    def _run(self, encoded: list[tuple[int, ...]], texts: list[str | None],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None
             ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(encoded)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(encoded):
                raise ValueError(f"{len(params_list)} sampling params for {len(encoded)} "
                                 "prompts; give one, or one per prompt")
        self._check_open()
        ids = [self._enqueue(token_ids, params, None, None, text)
               for token_ids, params, text in zip(encoded, params_list, texts)]
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        try:
            while pending:
                for output in self.step():
                    if output.request_id in pending:
                        pending.discard(output.request_id)
                        done[output.request_id] = output
                    else:
                        self._unclaimed.append(output)
        except BaseException:
            self._discard(pending)  # no request of a failed call stays queued
            raise
        return [done[rid] for rid in ids]

    def _discard(self, parent_ids: set[str]) -> None:
        """Abort the requests `parent_ids` and forget them (their outputs are dropped)."""
        for parent_id in parent_ids:
            self.abort(parent_id)
        stopped, self._stopped = self._stopped, []
        for request in stopped:
            if self._completions.request_of(request.request_id) in parent_ids:
                self._complete(request)
            else:
                self._stopped.append(request)

    # ---- inspection and lifetime ---------------------------------------------------------

    def stats(self, lower_tiers: bool = True) -> ManagerStats:
        """The tier manager's counters (`TierManager.stats`; `lower_tiers` as there)."""
        return self.manager.stats(lower_tiers)

    def restore_counts(self) -> RestoreCounts:
        """How this engine's prefix lookups below the GPU went so far (a copy; see
        `kvtier.engine.restore_gate.RestoreCounts`): restores started, hits given up for lack
        of GPU blocks, prefixes the measured rates sent to compute, probes."""
        return dataclasses.replace(self.scheduler.restore_counts)

    @property
    def planning_seconds(self) -> float:
        """Seconds this engine's thread has spent planning steps (`Scheduler.schedule`:
        polling transfers, lookups, allocations, issuing loads) since it started: time in
        which the GPU runs only what earlier steps queued, and then waits."""
        return self._thread_time.planning_s

    def thread_time(self) -> ThreadTime:
        """Where this engine's thread spent its steps since it started (a copy; see
        `kvtier.engine.thread_time.ThreadTime`): planning, launching, the tiers' work
        while the GPU computes, waiting for the GPU."""
        return dataclasses.replace(self._thread_time)

    def restore_rates(self) -> dict[str, Any]:
        """The speeds this engine's restores are sized by now (`kvtier.engine.restore_rates`):
        the model's prefill tokens/s with no context and its seconds per key attended to,
        and per slow tier the tokens/s it delivered to recent restores and its first-read
        latency. None where nothing was measured yet."""
        prefill, tiers = self.scheduler.prefill_rate, self.scheduler.tier_rates
        return {"prefill_tokens_per_s": prefill.tokens_per_s,
                "prefill_per_key_s": prefill.per_key_s if prefill.per_token_s else None,
                "tiers": {tier.value: {"tokens_per_s": rate,
                                       "latency_s": tiers.latency_s.get(tier)}
                          for tier, rate in tiers.tokens_per_s.items()}}

    def close(self) -> FlushReport:
        """Wait for in-flight transfers, write what is still pending to the disk tier (the
        host's dirty blocks and the GPU-resident blocks that found no host slot yet, within
        `flush_timeout_s`, with progress on stderr), then close the tiers. Returns what the
        flush wrote and what it could not (also said on stderr); a second call reports
        nothing."""
        if self._closed:
            return FlushReport(0, 0, 0.0)
        self._closed = True
        self.runner.graphs = None  # the graphs' memory pool goes with them
        progress = FlushProgressLine(self.config.flush_timeout_s)
        report = self.manager.close(self.config.flush_timeout_s, progress)
        progress.done(report)
        return report

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this LLM is closed; create a new one")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
