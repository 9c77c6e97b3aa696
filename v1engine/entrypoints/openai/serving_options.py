"""The server's options for how it serves requests: the chat template, tool calls, constraints'
whitespace, logprob token names, request logging and reasoning parsing (flags of
`python -m v1engine.serve`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from v1engine.entrypoints.openai.reasoning import REASONING_PARSERS
from v1engine.entrypoints.openai.serving_models import parse_lora_modules
from v1engine.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS
from v1engine.logger import init_logger
from v1engine.lora.request import LoRARequest

logger = init_logger(__name__)


@dataclass
class ServingOptions:
    """The serving flags' values; `OpenAIServing` reads them per request."""

    # A Jinja chat template used instead of the tokenizer's (e.g. a tool-aware one).
    chat_template: str | None = None
    # JSON constraints allow no whitespace between tokens, unless a request's
    # `structured_outputs` says otherwise (OpenAI's API has no per-request field for it).
    disable_any_whitespace: bool = False
    # `tool_choice: "auto"`: the parser that finds the calls in the text (None: "auto" is a 400).
    tool_call_parser: str | None = None
    # Every request's logprobs name tokens "token_id:{id}", as if each sent
    # return_tokens_as_token_ids (vLLM's flag).
    return_tokens_as_token_ids: bool = False
    # Log each request as it is added (vLLM's --enable-log-requests): its id, prompt (cut to
    # max_log_len characters when set) and sampling params.
    log_requests: bool = False
    max_log_len: int | None = None
    # Chat replies' thinking goes to `reasoning` (reasoning.py; None: it stays in the content).
    reasoning_parser: str | None = None
    # The Responses API keeps this many finished responses (store: true) in memory, for
    # GET /v1/responses/{id} and previous_response_id; the least recently used go first.
    max_stored_responses: int = 1000
    # LoRA adapters served by name (--lora-modules; the engine needs --enable-lora).
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)

    def log_request(
        self, engine_id: str, prompt: str | None, prompt_token_ids: list[int], params: Any
    ) -> None:
        """The --enable-log-requests line of one engine request."""
        shown: str | list[int] = prompt if prompt is not None else prompt_token_ids
        cut = self.max_log_len  # None: all of it
        more = f" (first {cut} of {len(shown)})" if cut is not None and len(shown) > cut else ""
        logger.info(
            "Received request %s: prompt %r%s, %d prompt tokens, params %s",
            engine_id,
            shown[:cut],
            more,
            len(prompt_token_ids),
            params,
        )

    @staticmethod
    def add_cli_args(group: Any) -> None:
        _add_output_args(group)
        group.add_argument(
            "--enable-log-requests",
            action="store_true",
            help="log every request: its id, prompt and sampling params",
        )
        group.add_argument(
            "--disable-log-requests",
            action="store_true",
            help="deprecated, as in vLLM: requests are logged only with --enable-log-requests",
        )
        group.add_argument(
            "--max-log-len",
            type=int,
            default=None,
            help="with --enable-log-requests, the most prompt characters logged (default: all)",
        )
        group.add_argument(
            "--max-stored-responses",
            type=int,
            default=1000,
            help="finished /v1/responses kept in memory for retrieval and previous_response_id "
            "(0: none)",
        )
        group.add_argument(
            "--lora-modules",
            nargs="+",
            default=[],
            help="LoRA adapters to serve, as name=path or a JSON object with name and path "
            "(needs --enable-lora); a request's model picks one by name",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServingOptions:
        """Raises ValueError when the chat template file cannot be read, for
        --enable-auto-tool-choice without --tool-call-parser, both --disable-log-requests and
        --enable-log-requests, a negative --max-log-len or --max-stored-responses, or a
        malformed --lora-modules."""
        if args.enable_auto_tool_choice and args.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser "
                f"({', '.join(TOOL_CALL_PARSERS)})"
            )
        if args.disable_log_requests:
            if args.enable_log_requests:
                raise ValueError(
                    "--disable-log-requests and --enable-log-requests contradict each other; "
                    "drop one"
                )
            logger.warning(
                "--disable-log-requests is deprecated: requests are logged only with "
                "--enable-log-requests"
            )
        parser = args.tool_call_parser if args.enable_auto_tool_choice else None
        template = None
        if args.chat_template is not None:
            try:
                with open(args.chat_template, encoding="utf-8") as f:
                    template = f.read()
            except OSError as e:
                raise ValueError(
                    f"cannot read --chat-template {args.chat_template!r}: {e.strerror}"
                ) from e
        if args.max_log_len is not None and args.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
        if args.max_stored_responses < 0:
            raise ValueError(
                f"--max-stored-responses must be >= 0, got {args.max_stored_responses}"
            )
        return cls(
            template,
            args.structured_outputs_disable_any_whitespace,
            parser,
            args.return_tokens_as_token_ids,
            args.enable_log_requests,
            args.max_log_len,
            args.reasoning_parser,
            args.max_stored_responses,
            parse_lora_modules(args.lora_modules),
        )


def _add_output_args(group: Any) -> None:
    """The flags that shape what replies hold: template, constraints, tools, reasoning."""
    group.add_argument(
        "--chat-template",
        default=None,
        help="file of a Jinja chat template to use instead of the tokenizer's",
    )
    group.add_argument(
        "--structured-outputs-disable-any-whitespace",
        action="store_true",
        help="constrained JSON has no whitespace between tokens (a request's "
        "structured_outputs.disable_any_whitespace overrides it)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (needs --tool-call-parser)',
    )
    group.add_argument(
        "--tool-call-parser",
        choices=tuple(TOOL_CALL_PARSERS),
        default=None,
        help="how tool calls are found in a model's text for tool_choice auto",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="put chat replies' <think> text in the message's `reasoning` field",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprobs name tokens "token_id:{id}" for every request, not by their text',
    )
