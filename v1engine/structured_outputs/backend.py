"""Compiling `StructuredOutputsParams` into xgrammar grammars: cached, on a small thread pool.

Both processes that see a request compile its grammar: the front end (engine/processor.py) to
refuse a bad schema, regex or grammar with a ValueError before anything is sent, and the engine
core, whose matchers need the compiled grammar. One `xgrammar.GrammarCompiler` per tokenizer and
vocabulary width is kept per process (`_shared_compiler`), so when the core runs in the client's
process (`LLM`) its compile of a grammar the front end just checked is a cache hit.

A grammar's token masks are as wide as the model's logits (`vocab_size`, which may exceed the
tokenizer's vocabulary: padding rows are never allowed).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from types import ModuleType
from typing import TYPE_CHECKING, Any

from v1engine.structured_outputs.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

# A grammar that takes longer than this to compile fails its request instead of holding it.
DEFAULT_COMPILE_TIMEOUT_S = 30.0
# Compiled grammars kept per backend (each is a few KB to a few MB).
_MAX_CACHED_GRAMMARS = 1024
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false: ")


def import_xgrammar() -> ModuleType:
    """xgrammar, imported on first use: it imports transformers (0.6 s), which an engine core
    that never sees a structured request should not spend before it starts its workers."""
    import xgrammar

    return xgrammar


_compilers: dict[tuple[str, int], xgr.GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def _shared_compiler(
    tokenizer_key: str, vocab_size: int, load_tokenizer: Callable[[], Any]
) -> xgr.GrammarCompiler:
    """This process's compiler for one tokenizer and logits width (built once: reading the
    vocabulary takes a fraction of a second, and the compiler's own cache lives in it)."""
    with _compilers_lock:
        compiler = _compilers.get((tokenizer_key, vocab_size))
        if compiler is None:
            xgrammar = import_xgrammar()
            info = xgrammar.TokenizerInfo.from_huggingface(load_tokenizer(), vocab_size=vocab_size)
            compiler = xgrammar.GrammarCompiler(info, max_threads=_num_threads())
            _compilers[(tokenizer_key, vocab_size)] = compiler
        return compiler


def _num_threads() -> int:
    return max(1, min(4, (os.cpu_count() or 2) // 2))


class GrammarBackend:
    """Compiles grammars on a small thread pool, one compile per distinct grammar.

    Args:
        tokenizer_key: names the tokenizer (its path), for sharing compilers within a process.
        load_tokenizer: returns the Hugging Face tokenizer; called once, on a pool thread.
        vocab_size: the model's logits width.
    """

    def __init__(
        self, tokenizer_key: str, load_tokenizer: Callable[[], Any], vocab_size: int
    ) -> None:
        self.tokenizer_key = tokenizer_key
        self.load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._executor = ThreadPoolExecutor(_num_threads(), thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future[xgr.CompiledGrammar]] = OrderedDict()

    def compile_async(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar, soon; a bad grammar's future raises ValueError naming it."""
        key = params.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._executor.submit(self._compile, params)
                self._cache[key] = future
                if len(self._cache) > _MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return future

    def compile(
        self, params: StructuredOutputsParams, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    ) -> xgr.CompiledGrammar:
        """Compiles (or finds) the grammar, waiting at most `timeout_s`.

        Raises:
            ValueError: the schema, regex or grammar is invalid, or took too long to compile.
        """
        try:
            return self.compile_async(params).result(timeout=timeout_s)
        except FutureTimeoutError:
            raise ValueError(compile_timeout_message(params, timeout_s)) from None

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        compiler = _shared_compiler(self.tokenizer_key, self.vocab_size, self.load_tokenizer)
        kind = params.kind
        if params.whitespace_pattern is not None:
            raise ValueError(
                "StructuredOutputsParams.whitespace_pattern is not supported by the xgrammar "
                "backend; use disable_any_whitespace=True for compact JSON"
            )
        try:
            return _compile_kind(compiler, params, kind)
        except RuntimeError as e:  # xgrammar's parse errors
            raise ValueError(
                f"invalid StructuredOutputsParams.{kind} {_preview(getattr(params, kind))}: "
                f"{_xgrammar_message(e)}"
            ) from None

    def shutdown(self) -> None:
        # A compile cannot be interrupted; the pool's threads end when their compiles do.
        self._executor.shutdown(wait=False, cancel_futures=True)


def _compile_kind(
    compiler: xgr.GrammarCompiler, params: StructuredOutputsParams, kind: str
) -> xgr.CompiledGrammar:
    any_whitespace = not params.disable_any_whitespace
    if kind == "json":
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
    if kind == "json_object":
        if any_whitespace:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        # JSON string literals are EBNF string literals, escapes included.
        return compiler.compile_grammar("root ::= " + " | ".join(map(json.dumps, params.choice)))
    if kind == "structural_tag":
        return _compile_structural_tag(compiler, params.structural_tag)
    return compiler.compile_grammar(params.grammar)


def _compile_structural_tag(
    compiler: xgr.GrammarCompiler, tag: str | dict[str, Any]
) -> xgr.CompiledGrammar:
    """vLLM's two forms (see StructuredOutputsParams.structural_tag): the `structures` and
    `triggers` of its older API go to xgrammar's legacy call, anything else to its own."""
    spec = json.loads(tag) if isinstance(tag, str) else tag
    if "structures" not in spec:
        return compiler.compile_structural_tag(json.dumps(spec))
    xgr = import_xgrammar()
    try:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in spec["structures"]
        ]
        triggers = spec["triggers"]
    except (KeyError, TypeError) as e:
        raise RuntimeError(
            'each of "structures" needs "begin", "schema" and "end", and "triggers" lists the '
            f"texts that start them (missing or malformed: {e})"
        ) from None
    return compiler.compile_structural_tag(items, triggers)


def compile_timeout_message(params: StructuredOutputsParams, timeout_s: float) -> str:
    return (
        f"StructuredOutputsParams.{params.kind} {_preview(getattr(params, params.kind))} took "
        f"longer than {timeout_s:g} s to compile; simplify it"
    )


def _preview(value: object, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _xgrammar_message(error: RuntimeError) -> str:
    # "[04:49:38] /project/cpp/regex_converter.cc:83: Regex parsing error ...": drop the
    # timestamp and the source location, which mean nothing to the user.
    text = str(error).strip()
    head, sep, rest = text.partition(": ")
    text = rest if sep and head.startswith("[") else text
    # "Check failed: (std::holds_alternative<Grammar>(result)) is false: ": the C++ assertion.
    return _CHECK_FAILED.sub("", text)
