"""From a validated OpenAI request to engine requests and back: tokenization, sampling
parameters, and one job that runs every prompt of a request and merges their outputs.

A completions request may carry several prompts; each becomes one engine request (with n
samples), and choice i of the response is sample i % n of prompt i // n, as OpenAI numbers
them. Leaving the job early (client gone) aborts every engine request it started, which
frees their KV blocks before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio

from engine import (
    ContextLengthExceededError,
    EngineClient,
    EngineError,
    IncrementalDetokenizer,
    InvalidRequestError,
    LoraRequest,
    OutputStream,
    RequestErrorCode,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
    TenantContext,
    Tokenizer,
)
from gateway.http.errors import BadRequestError
from gateway.openai.requests import Endpoint, GenerationRequest
from gateway.openai.schema_check import SchemaCheck, schema_check
from gateway.openai.tool_calls import render_messages, required_call_grammar
from gateway.server.served_model import ServedModel

# Longest a cancelled job waits for the engine's final (abort) outputs.
_ABORT_WAIT_S = 2.0
# Outputs per choice that may wait unread (the client's socket and the server's send buffer
# full) before the job stops its engine requests: the engine does not generate for a client
# that has stopped reading, and what waits for one is bounded.
MAX_UNREAD_OUTPUTS_PER_CHOICE = 256


@dataclass(frozen=True)
class PreparedPrompt:
    """One prompt as the engine takes it."""

    token_ids: list[int]
    # The prompt as text (for echo); None until decoded for token-id prompts.
    text: str | None


async def prepare_prompts(
    request: GenerationRequest, model: ServedModel, off_loop: anyio.CapacityLimiter | None
) -> list[PreparedPrompt]:
    """Render the chat template or take the prompts as given, and tokenize.

    off_loop: in a worker thread under this limiter, with an encoder that releases the GIL,
    so the event loop serves other tenants meanwhile (a 1 MiB prompt takes about a second to
    encode). None: on the loop, for small prompts, which a hand-over to a thread only delays.
    """
    if off_loop is None:
        return _prepare(request, model, model.tokenizer.encode)
    return await anyio.to_thread.run_sync(
        _prepare, request, model, model.tokenizer.encode_unlocked, limiter=off_loop
    )


def _prepare(
    request: GenerationRequest, model: ServedModel, encode: Callable[[str, bool], list[int]]
) -> list[PreparedPrompt]:
    tokenizer = model.tokenizer
    if request.endpoint.is_chat:
        offered = request.tools.tools if request.tools.is_active else ()
        messages, tools = render_messages(request.messages, offered, tokenizer.chat_template)
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools)
        except EngineError as exc:
            raise _translate(exc) from exc
        except (TypeError, ValueError, KeyError) as exc:
            # Message fields the template does not expect (e.g. tool_calls of odd shape).
            raise BadRequestError(
                f"the messages cannot be rendered with this model's chat template: {exc}",
                param="messages",
            ) from exc
        _check_not_too_long(text, model, "messages")
        # The template already holds the special tokens it wants (BOS included).
        return [PreparedPrompt(encode(text, False), text)]
    prompts = []
    for index, prompt in enumerate(request.prompts):
        param = "prompt" if len(request.prompts) == 1 else f"prompt[{index}]"
        if isinstance(prompt, str):
            _check_not_too_long(prompt, model, param)
            prompts.append(PreparedPrompt(encode(prompt, True), prompt))
            continue
        for token_id in prompt:
            if not 0 <= token_id < model.vocab_size:
                raise BadRequestError(
                    f"token id {token_id} is outside this model's vocabulary "
                    f"(0..{model.vocab_size - 1})",
                    param=param,
                )
        prompts.append(PreparedPrompt(list(prompt), None))
    return prompts


def _check_not_too_long(text: str, model: ServedModel, param: str) -> None:
    """400 context_length_exceeded, without encoding, for a text that cannot fit."""
    num_tokens = model.tokenizer.min_num_tokens(text)
    if num_tokens >= model.max_model_len:
        raise BadRequestError(
            f"the prompt has at least {num_tokens} tokens ({len(text)} characters); this "
            f"model's context is {model.max_model_len}",
            param=param,
            code="context_length_exceeded",
        )


def sampling_params(request: GenerationRequest, model: ServedModel) -> SamplingParams:
    fields = request.sampling
    stop_token_ids = list(fields.stop_token_ids)
    if not fields.ignore_eos:
        # The engine knows one EOS id; a model may end turns with others too.
        stop_token_ids += [t for t in model.eos_token_ids[1:] if t not in stop_token_ids]
    for token_id in fields.stop_token_ids:
        if token_id >= model.vocab_size:
            raise BadRequestError(
                f"stop token id {token_id} is outside this model's vocabulary",
                param="stop_token_ids",
            )
    try:
        return SamplingParams(
            structured=_constraint(request, model),
            n=fields.n,
            temperature=fields.temperature,
            top_p=fields.top_p,
            top_k=fields.top_k,
            min_p=fields.min_p,
            repetition_penalty=fields.repetition_penalty,
            presence_penalty=fields.presence_penalty,
            frequency_penalty=fields.frequency_penalty,
            seed=fields.seed,
            max_tokens=fields.max_tokens,
            min_tokens=fields.min_tokens,
            stop=list(fields.stop),
            stop_token_ids=stop_token_ids,
            ignore_eos=fields.ignore_eos,
            logprobs=fields.num_logprobs,
            skip_special_tokens=fields.skip_special_tokens,
            # Text is made where it is cheapest (docs/ARCHITECTURE.md, "Where text is made"):
            # here, by the job, unless stop strings need it in the engine's step.
            detokenize=bool(fields.stop),
        )
    except EngineError as exc:
        raise _translate(exc) from exc


def _constraint(request: GenerationRequest, model: ServedModel) -> StructuredOutput | None:
    """The request's structured output, or the grammar of the call its tool_choice forces."""
    tools = request.tools
    if tools.choice.mode not in ("required", "function"):
        return request.structured
    grammar = required_call_grammar(model.tool_format, tools.tools, tools.choice, tools.parallel)
    return StructuredOutput("grammar", grammar, "tool_choice")


async def check_constraints(
    request: GenerationRequest,
    params: SamplingParams,
    model: ServedModel,
    cache_salt: str,
) -> SchemaCheck | None:
    """400 naming the field for a schema or grammar llguidance does not take with this
    model's tokenizer, or a JSON schema the validator refuses. Checked in the grammar worker
    thread (a large schema takes up to ~20 ms), in the tenant's turn (cache_salt names it):
    a tenant sending many schemas delays its own checks, not another tenant's. Returns the
    check of the finished outputs where the output must match a JSON schema."""
    constraints = request.constraints()
    if params.structured is not None and params.structured not in constraints:
        constraints.append(params.structured)  # a forced tool call's grammar
    if not constraints:
        return None
    structured = params.structured
    check = (schema_check(structured)
             if structured is not None and structured.lenient else None)
    try:
        await asyncio.wrap_future(model.grammars.check_async(constraints, cache_salt))
    except EngineError as exc:
        raise _translate(exc) from exc
    return check


def check_fits(
    engine: EngineClient,
    prompts: list[PreparedPrompt],
    params: SamplingParams,
    tenant: TenantContext,
    endpoint: Endpoint,
) -> list[int]:
    """Raise 400 (context_length_exceeded) unless every prompt can ever run; returns the
    resolved max_tokens of each prompt."""
    resolved = []
    for prompt in prompts:
        try:
            resolved.append(engine.validate_request(prompt.token_ids, params, tenant))
        except EngineError as exc:
            error = _translate(exc)
            if error.param == "messages" and endpoint is Endpoint.COMPLETIONS:
                error.param = "prompt"
            raise error from exc
    return resolved


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    num_output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None  # a RequestErrorCode, with error


@dataclass
class JobSummary:
    """Token counts of a whole request once it is over (or as far as it got)."""

    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_completion_tokens: int
    # Sums over every sample of every prompt (engine metering).
    num_preemptions: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)


# A non-streamed reply that fails its JSON schema's check is sampled again this many times
# (at temperature > 0) before the request ends as structured_output_invalid.
STRUCTURED_OUTPUT_RESAMPLES = 2


class GenerationJob:
    """Runs the engine requests of one HTTP request and yields (choice index, output)."""

    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        prompts: list[PreparedPrompt],
        params: SamplingParams,
        tenant: TenantContext,
        tokenizer: Tokenizer,
        lora: LoraRequest | None = None,
        check: SchemaCheck | None = None,
        resamples: int = 0,
    ) -> None:
        """lora: the adapter the request runs on (None: the base model); check: what each
        choice's output must satisfy once it stops (its JSON schema), else it ends as an
        error (structured_output_invalid); resamples: how many times a choice whose output
        fails the check is sampled again first (a new engine request of its prompt, another
        seed), every attempt metered (a streamed choice's text is out: none)."""
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.num_choices = len(prompts) * params.n
        self.choices = [ChoiceState() for _ in range(self.num_choices)]
        # Latest output of each choice: its counters and metrics describe the sample.
        self.last_outputs: list[RequestOutput | None] = [None] * self.num_choices
        # The latest metering of each choice (outputs carry it now and then, always at the end).
        self.last_metrics: list[RequestMetrics | None] = [None] * self.num_choices
        self._engine = engine
        self._tenant = tenant
        self._lora = lora
        self._stream: OutputStream | None = None
        self._num_open = 0  # choices not finished yet, once started
        # The engine makes no text for these params: each choice's is made here.
        self._detokenizers: list[IncrementalDetokenizer] | None = None
        if not params.detokenize:
            self._detokenizers = [
                IncrementalDetokenizer(tokenizer, prompts[choice // params.n].token_ids,
                                       params.skip_special_tokens)
                for choice in range(self.num_choices)
            ]
        # Stopped because its consumer fell MAX_UNREAD_OUTPUTS_PER_CHOICE outputs behind.
        self.is_stopped_unread = False
        self._check = check
        # Each checked choice's text so far, in pieces (joined once, when it stops).
        self._texts: list[list[str]] | None = (
            [[] for _ in range(self.num_choices)] if check is not None else None)
        self._tokenizer = tokenizer
        # Sampling at temperature 0 gives the same output again: no resample.
        self._resamples_left = [resamples if params.temperature > 0 else 0] * self.num_choices
        self._resampled: set[int] = set()  # choices restarted since their consumer last asked
        self._resample_ids: list[str] = []  # the engine requests of the resamples
        # What discarded attempts used: billed with the rest (summary, all_metrics).
        self._discarded_tokens = 0
        self._discarded_metrics: list[RequestMetrics] = []
        self._cached_tokens: dict[int, int] = {}  # per prompt, from its first output

    def engine_request_id(self, prompt_index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{prompt_index}"

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output of every choice, in arrival order; ends when all have finished.
        An engine failure arrives as an output with finish_reason "error"."""
        stream = self._stream = OutputStream(
            MAX_UNREAD_OUTPUTS_PER_CHOICE * self.num_choices, self._stop_unread
        )
        self._num_open = self.num_choices
        try:
            for index, prompt in enumerate(self.prompts):
                self._engine.submit(self.engine_request_id(index), prompt.token_ids,
                                    self.params, self._tenant, stream, index * self.params.n,
                                    lora=self._lora)
            while self._num_open:
                choice, output = await stream.get()
                self._apply(choice, output)
                yield choice, output
        finally:
            await self.cancel()

    async def cancel(self) -> None:
        """Abort whatever still runs: the engine frees its blocks before its next step and
        sends each sample's final output, whose metering (the GPU time spent so far) this
        waits for, briefly, so an aborted request is billed for what it used."""
        stream = self._stream
        if stream is None:
            return
        self._resamples_left = [0] * self.num_choices  # nothing starts while it ends
        if self._num_open and self._engine.is_running:
            for index in range(len(self.prompts)):
                self._engine.abort(self.engine_request_id(index))
            for request_id in self._resample_ids:
                self._engine.abort(request_id)
            with contextlib.suppress(TimeoutError, EngineError):
                async with asyncio.timeout(_ABORT_WAIT_S):
                    while self._num_open:
                        self._apply(*await stream.get())
        self._engine.release([*(self.engine_request_id(i) for i in range(len(self.prompts))),
                              *self._resample_ids])
        # Outputs that arrived after the consumer left.
        while (item := stream.get_nowait()) is not None:
            self._apply(*item)

    def _stop_unread(self) -> None:
        """Abort the engine requests of a consumer that does not read: the engine frees
        their blocks and sends their final outputs (metering), which end the job."""
        self.is_stopped_unread = True
        self._resamples_left = [0] * self.num_choices
        for index in range(len(self.prompts)):
            self._engine.abort(self.engine_request_id(index))
        for request_id in self._resample_ids:
            self._engine.abort(request_id)

    def _apply(self, choice: int, output: RequestOutput) -> None:
        if self._detokenizers is not None:
            self._detokenize(choice, output)
        state = self.choices[choice]
        state.num_output_tokens = output.num_output_tokens
        prompt_index = choice // self.params.n
        self._cached_tokens.setdefault(prompt_index, output.num_cached_tokens)
        self.last_outputs[choice] = output
        if output.metrics is not None:
            self.last_metrics[choice] = output.metrics
        if self._texts is not None:
            self._texts[choice].append(output.new_text)
            if output.finished and output.finish_reason == "stop":
                self._check_output(choice, output)
        if output.finished and state.finish_reason is None:
            self._num_open -= 1
            state.finish_reason = output.finish_reason
            state.error = output.error
            state.error_code = output.error_code

    @property
    def is_finished(self) -> bool:
        """Every choice has ended, whatever the reason."""
        return all(choice.finish_reason is not None for choice in self.choices)

    @property
    def is_complete(self) -> bool:
        """Every choice ended by a stop condition or its length limit."""
        return all(choice.finish_reason in ("stop", "length") for choice in self.choices)

    def summary(self) -> JobSummary:
        num_prompt = sum(len(p.token_ids) for p in self.prompts)
        num_cached = sum(self._cached_tokens.values())
        num_preemptions = sum(m.num_preemptions for m in self.all_metrics())
        return JobSummary(
            num_prompt_tokens=num_prompt,
            num_cached_prompt_tokens=num_cached,
            # Resampled choices' discarded attempts included: their tokens were generated.
            num_completion_tokens=(sum(c.num_output_tokens for c in self.choices)
                                   + self._discarded_tokens),
            num_preemptions=num_preemptions,
            finish_reasons=[c.finish_reason for c in self.choices],
        )

    def _check_output(self, choice: int, output: RequestOutput) -> None:
        """A stopped choice's whole output against its schema: one that fails is sampled
        again while resamples are left (the output then ends nothing: the consumer sees
        pop_resampled), else ends as an error the request caused (its schema asked what the
        grammar could not enforce)."""
        assert self._check is not None and self._texts is not None
        problem = self._check.problem("".join(self._texts[choice]))
        if problem is None:
            return
        if self._resamples_left[choice] > 0 and self._resample(choice, output):
            return
        output.finish_reason = "error"
        output.error = problem
        output.error_code = RequestErrorCode.STRUCTURED_OUTPUT_INVALID

    def _resample(self, choice: int, output: RequestOutput) -> bool:
        """Discard the choice's attempt (its tokens and metering kept for the bill) and
        submit its prompt again as a request of one sample, on another seed; False when the
        engine takes no more work."""
        self._resamples_left[choice] -= 1
        attempt = len(self._resample_ids) + 1
        request_id = f"{self.request_id}-resample-{attempt}"
        params = self.params
        seed = None if params.seed is None else (params.seed + 7919 * attempt) % (1 << 63)
        prompt = self.prompts[choice // params.n]
        assert self._stream is not None
        try:
            self._engine.submit(request_id, prompt.token_ids,
                                dataclasses.replace(params, n=1, seed=seed), self._tenant,
                                self._stream, choice, lora=self._lora)
        except EngineError:
            return False
        self._resample_ids.append(request_id)
        self._discarded_tokens += output.num_output_tokens
        self.choices[choice].num_output_tokens = 0  # the new attempt's, as they come
        if output.metrics is not None:
            self._discarded_metrics.append(output.metrics)
        self.last_metrics[choice] = None
        assert self._texts is not None
        self._texts[choice] = []
        if self._detokenizers is not None:
            self._detokenizers[choice] = IncrementalDetokenizer(
                self._tokenizer, prompt.token_ids, params.skip_special_tokens)
        self._resampled.add(choice)
        output.finished, output.finish_reason = False, None
        output.new_text, output.new_token_ids, output.logprobs = "", [], []
        return True

    def pop_resampled(self, choice: int) -> bool:
        """Whether the choice was sampled again since the last call: what its consumer
        gathered of it so far is void."""
        if choice in self._resampled:
            self._resampled.discard(choice)
            return True
        return False

    def all_metrics(self) -> list[RequestMetrics]:
        """The metering of every attempt of every choice (for the usage record)."""
        return [*self._discarded_metrics, *(m for m in self.last_metrics if m is not None)]

    def _detokenize(self, choice: int, output: RequestOutput) -> None:
        """The output's text, made from its tokens (the engine made none)."""
        assert self._detokenizers is not None
        detokenizer = self._detokenizers[choice]
        text = detokenizer.add_tokens(output.new_token_ids)
        if output.finish_reason in ("stop", "length"):
            text += detokenizer.flush()
        output.new_text = text


def _translate(exc: EngineError) -> BadRequestError:
    code = "context_length_exceeded" if isinstance(exc, ContextLengthExceededError) else None
    param = exc.param if isinstance(exc, InvalidRequestError) else None
    return BadRequestError(str(exc), param=param, code=code)
