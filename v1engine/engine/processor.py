"""Processor: a user's prompt and SamplingParams -> the engine-core requests to send.

Both front ends (`LLM` and `AsyncLLM`) go through it, in this order: tokenize the prompt (or render
a chat through the model's template), check the request against the engine's limits
(`validate_request`, the one copy of that check, run here under the caller's request id and before
anything decodes the prompt: an id outside the vocabulary must not reach the detokenizer), fan
`n > 1` out into n core requests (a structured-output grammar is compiled first, so an invalid
schema, regex or grammar is refused here with a ValueError naming it), register each with the
`OutputProcessor`, and hand the requests to the caller, who sends them through its
`EngineCoreClient`. The client's send runs the check again per child (the client is its own guard,
as the core is), and a ValueError raised for a child is re-raised by the caller with the parent's
id (`as_parent_error`); the caller then calls `abort` to forget what was registered.

A pooling engine (`runner="pooling"`) takes embedding or classification requests instead
(`process_pooling`, the model's task only): one core request each, a one-token generation to the
scheduler, whose token the workers replace with the prompt's last hidden state or a classifier's
class logits (see pooling_params.py). Each engine serves one kind; the other is refused with a
ValueError naming `--runner`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

from v1engine.config import EngineConfig
from v1engine.core_protocol import EngineCoreInfo
from v1engine.engine.output_processor import OutputKind, OutputProcessor
from v1engine.engine.pooling_state import PoolingState
from v1engine.lora.adapter import CheckedAdapters
from v1engine.lora.request import LoRARequest
from v1engine.model.hf_config import classifier_activation, pooling_task
from v1engine.pooling_params import PoolingParams
from v1engine.request import EngineCoreRequest, validate_request
from v1engine.sampling_params import SamplingParams
from v1engine.structured_outputs.params import StructuredOutputsParams
from v1engine.tokenizer import eos_token_id

if TYPE_CHECKING:
    from v1engine.structured_outputs.backend import GrammarBackend

# A prompt is text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}.
PromptType = str | list[int] | dict[str, Any]
# A prompt dict's keys (vLLM's TextPrompt / TokensPrompt, text only).
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})

# A pooling engine schedules each prompt as a one-token generation; its workers return the
# prompt's last hidden state where they would sample that token.
_POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
# What a pooling engine does with a prompt (vLLM's task names): its model does one of them.
POOLING_TASKS = ("embed", "classify")
# Asked of a pooling model whose task is the other one.
_WRONG_TASK = {
    "embed": "model {model!r} is a sequence classifier: it classifies, it does not embed; "
    "use LLM.classify or POST /classify",
    "classify": "model {model!r} embeds: classification needs a *ForSequenceClassification "
    "checkpoint; use LLM.embed or POST /v1/embeddings",
}


class Processor:
    """Args:
    config: the engine configuration (for the model's EOS id when the tokenizer has none).
    tokenizer: the model's tokenizer, or None: prompts must then be token ids.
    output_processor: where each request is registered before it is sent.
    info: the engine's limits (from its READY message) that requests are checked against.
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        output_processor: OutputProcessor,
        info: EngineCoreInfo,
    ) -> None:
        self.tokenizer = tokenizer
        self.output_processor = output_processor
        self.info = info
        self.eos_token_id = eos_token_id(tokenizer, config.model_config.hf_config)
        self.model_config = config.model_config
        self.scheduling_policy = config.scheduler_config.policy
        # A pooling engine's task ("embed" or "classify") and a classifier's activation.
        hf_config = self.model_config.hf_config
        pooling = self.model_config.runner_type == "pooling" and hf_config is not None
        self.pooling_task = pooling_task(hf_config) if pooling else None
        self.classifier_activation = (
            classifier_activation(hf_config) if self.pooling_task == "classify" else None
        )
        lora_config = config.lora_config
        self.loras = None
        if lora_config is not None:
            self.loras = CheckedAdapters(hf_config, lora_config.max_lora_rank)
        # Built on the first structured request (it reads the whole vocabulary once).
        self._grammar_backend: GrammarBackend | None = None
        # The API server checks grammars from threads: one backend, built once.
        self._grammar_backend_lock = threading.Lock()

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """`(text or None, token ids)` of a prompt. Raises ValueError for an unusable one,
        and for a dict with keys it would ignore (vLLM's multimodal and embeddings inputs)."""
        if isinstance(prompt, dict):
            unknown = sorted(prompt.keys() - _PROMPT_KEYS)
            if unknown:
                raise ValueError(
                    f"prompt keys {unknown} are not served: a prompt dict takes "
                    f"{sorted(_PROMPT_KEYS)} (this engine runs text-only models: no "
                    "multi_modal_data, no prompt_embeds)"
                )
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self._require_tokenizer("text prompts").encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            "a prompt must be a str, a list of token ids or a dict with 'prompt' or "
            f"'prompt_token_ids', got {type(prompt).__name__}"
        )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> tuple[str, list[int]]:
        """`(text, token ids)` of a conversation through the chat template (`chat_template`,
        else the model's); the options are vLLM's (`chat_template_kwargs` go to the template as
        variables, `tools` as the `tools` variable, for templates that describe them).

        Raises:
            ValueError: no tokenizer, or the template cannot render these messages.
        """
        tokenizer = self._require_tokenizer("chat")
        try:
            text = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                tools=tools,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
        except Exception as e:  # jinja errors, or a tokenizer without a chat template
            raise ValueError(f"cannot apply the chat template: {e}") from e
        # By default none: the template already wrote the special tokens (BOS, role markers)
        # it wants.
        return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def process(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: OutputKind,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[EngineCoreRequest]:
        """Registers the request (its n children when n > 1) with the output processor and
        returns the core requests to send, in order. `priority` (lower is served first) needs
        the "priority" scheduling policy; a `cache_salt` keeps its prefix-cache blocks to
        requests of the same salt; `lora_request` names the LoRA adapter it runs with (read
        and checked here the first time).

        The prompt is first cut to its last `params.truncate_prompt_tokens` tokens, and bad
        words are tokenized into `params._bad_words_token_ids` (on a copy) for the workers.

        Raises:
            ValueError: the request cannot be served (a bad prompt, sampling value, priority
                or salt; stop strings or bad words without a tokenizer; an id in use; an
                adapter the engine cannot serve), named by `request_id`; nothing is registered.
        """
        self._check_generation(params, priority, lora_request)
        params = whole_vocabulary_logprobs(params, self.info.vocab_size)
        prompt_token_ids = truncate_prompt(
            prompt_token_ids, params.truncate_prompt_tokens, self.info.max_model_len
        )
        if params.bad_words:
            token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            params = dataclasses.replace(params, _bad_words_token_ids=token_ids)
        eos = self.eos_token_id
        fields = {"priority": priority, "cache_salt": cache_salt, "lora_request": lora_request}
        parent = EngineCoreRequest(request_id, prompt_token_ids, params, eos, **fields)
        in_use = self.output_processor.parent_states
        validate_request(parent, self.info, in_use)
        requests = []
        for child_id, index, child_params in make_child_requests(request_id, params):
            self.output_processor.add_request(
                child_id, prompt, prompt_token_ids, params, output_kind, request_id, index
            )
            child = EngineCoreRequest(child_id, prompt_token_ids, child_params, eos, **fields)
            requests.append(child)
        return requests

    def _check_generation(
        self, params: SamplingParams, priority: int, lora_request: LoRARequest | None
    ) -> None:
        """What `process` refuses before looking at the prompt (ValueError)."""
        self._require_runner("generate", "generation")
        check_priority(priority, self.scheduling_policy)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids instead")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; ban token ids with logit_bias -100")
        if params.structured_outputs is not None:
            self.check_grammar(params.structured_outputs)
        if lora_request is not None and self.loras is not None:
            self.loras.check(lora_request)  # without LoRA, validate_request refuses it

    def process_pooling(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        priority: int = 0,
        task: str | None = None,
    ) -> EngineCoreRequest:
        """Registers a pooling request (`task`: "embed" or "classify"; None: the model's) with
        the output processor and returns the one core request to send (its id is `request_id`;
        the prompt cut to truncate_prompt_tokens).

        Raises:
            ValueError: as `check_pooling_task`, or the request cannot be served (as `process`,
                or params the model's task does not take); nothing registered.
        """
        task = task or self.pooling_task or "embed"
        self.check_pooling_task(task)
        check_priority(priority, self.scheduling_policy)
        params.check_for_model(task, self.model_config.hf_config, self.model_config.model)
        info = self.info
        prompt_token_ids = truncate_prompt(
            prompt_token_ids, params.truncate_prompt_tokens, info.max_model_len
        )
        request = EngineCoreRequest(
            request_id, prompt_token_ids, _POOLING_SAMPLING_PARAMS, priority=priority
        )
        # Checked here too: validate_request's message speaks of room for output.
        if len(prompt_token_ids) >= info.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(prompt_token_ids)} tokens but this "
                f"engine embeds at most max_model_len - 1 = {info.max_model_len - 1}; shorten it, "
                "set truncate_prompt_tokens or raise max_model_len"
            )
        in_use = self.output_processor.request_states  # a pooling engine's requests: no n > 1
        validate_request(request, info, in_use)
        self.output_processor.add_pooling_request(
            PoolingState(request_id, prompt_token_ids, params, self.classifier_activation)
        )
        return request

    def check_pooling_task(self, task: str) -> None:
        """Raises ValueError unless this engine pools and its model does `task` ("embed" or
        "classify")."""
        if task not in POOLING_TASKS:
            why = "unknown"
            if task in ("token_embed", "token_classify"):  # vLLM's per-token tasks
                why = "not served (the workers pool each prompt's last token only)"
            raise ValueError(f"pooling task {task!r} is {why}; this engine serves {POOLING_TASKS}")
        self._require_runner("pooling", "classification" if task == "classify" else "embedding")
        if task != self.pooling_task:
            raise ValueError(_WRONG_TASK[task].format(model=self.model_config.model))

    def _require_runner(self, runner_type: str, what: str) -> None:
        if self.model_config.runner_type != runner_type:
            other = self.model_config.runner_type
            raise ValueError(
                f"{what} needs an engine started with runner={runner_type!r}, but this one "
                f"runs its model with runner={other!r}; restart it with --runner {runner_type} "
                f"(LLM(..., runner={runner_type!r}))"
            )

    def check_grammar(self, params: StructuredOutputsParams) -> None:
        """Compiles the grammar (cached: the engine core's compile in this process is then a
        hit), so a bad one fails here, before anything is sent.

        Raises:
            ValueError: no tokenizer, or the schema, regex or grammar is invalid or took longer
                than the compile time-out; names the field and what is wrong.
        """
        self._require_tokenizer("structured outputs")
        if self.info.vocab_size is None:
            raise ValueError("structured outputs need a model (its vocabulary)")
        with self._grammar_backend_lock:
            if self._grammar_backend is None:
                # Imported here: xgrammar loads only for an engine that sees structured outputs.
                from v1engine.structured_outputs.backend import GrammarBackend

                key = self.model_config.tokenizer or self.model_config.model
                tokenizer = self.tokenizer
                self._grammar_backend = GrammarBackend(key, lambda: tokenizer, self.info.vocab_size)
        self._grammar_backend.compile(params)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Forgets the given front-end requests; returns their core ids still to abort."""
        return self.output_processor.abort_requests(request_ids)

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                f"{what} need a tokenizer; pass token ids, or do not set skip_tokenizer_init"
            )
        return self.tokenizer


def truncate_prompt(
    prompt_token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int
) -> list[int]:
    """The last `truncate_prompt_tokens` prompt tokens (all of them when None); -1 keeps as many
    as leave room for one output token (vLLM's -1 means max_model_len, but a prompt here must be
    shorter than max_model_len)."""
    if truncate_prompt_tokens is None:
        return prompt_token_ids
    keep = max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return prompt_token_ids[-keep:]


def bad_words_token_ids(tokenizer: Any, bad_words: list[str]) -> list[list[int]]:
    """Each bad word's token-id sequences, as vLLM bans them: the word as written and after a
    space (BPE vocabularies spell a word at the start of text and inside it differently),
    without special tokens, each distinct sequence once."""
    sequences: list[list[int]] = []
    for word in bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            token_ids = list(tokenizer.encode(text, add_special_tokens=False))
            if token_ids and token_ids not in sequences:
                sequences.append(token_ids)
    return sequences


def whole_vocabulary_logprobs(params: SamplingParams, vocab_size: int | None) -> SamplingParams:
    """`params` with vLLM's -1 logprobs / prompt_logprobs (every token's) as the vocabulary's
    size, which validate_request then holds to max_logprobs.

    Raises:
        ValueError: -1 on a model-free engine (no vocabulary).
    """
    names = [name for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1]
    if not names:
        return params
    if vocab_size is None:
        raise ValueError(f"{names[0]}=-1 asks for every token's logprob, but there is no model")
    return dataclasses.replace(params, **dict.fromkeys(names, vocab_size))


def check_priority(priority: Any, policy: str) -> None:
    """Raises ValueError for a priority that is not an int, or not 0 under "fcfs" (which would
    silently ignore it)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an int, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority {priority} needs the priority scheduling policy, but this engine serves "
            "first come, first served; restart it with --scheduling-policy priority "
            "(LLM(..., scheduling_policy='priority')), or send priority 0"
        )


def make_child_requests(
    parent_id: str, sampling_params: SamplingParams
) -> list[tuple[str, int, SamplingParams]]:
    """The n core requests behind one request: `(child_id, index, child_params)` each.

    Children are ids f"{index}_{parent_id}" with n=1, and seed+index when seeded, so the n
    samples differ yet a seeded request is reproducible. They share the prompt, so only child 0
    computes prompt logprobs (the others may use the prefix cache). `dataclasses.replace` runs
    the params' checks again, so values changed after construction are caught here.
    """
    children = []
    for index in range(sampling_params.n):
        seed = None if sampling_params.seed is None else sampling_params.seed + index
        prompt_logprobs = sampling_params.prompt_logprobs if index == 0 else None
        child_params = dataclasses.replace(
            sampling_params, n=1, seed=seed, prompt_logprobs=prompt_logprobs
        )
        children.append((f"{index}_{parent_id}", index, child_params))
    return children


def as_parent_error(error: ValueError, child_id: str, parent_id: str) -> ValueError:
    """A child request's error told in terms of its parent, the id the caller knows."""
    return ValueError(str(error).replace(repr(child_id), repr(parent_id)))
