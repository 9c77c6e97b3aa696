"""LangChain's `with_structured_output` against the server: each method must return a `Person`.

    .venv/bin/python scripts/langchain_structured.py --json langchain.json
    .venv/bin/python scripts/langchain_structured.py --model HF_DIR -- --tensor-parallel-size 2

What it does:
1. `langchain-openai` (pinned below) goes into its own venv, `~/.cache/v1engine/langchain-venv` by
   default (`--langchain-venv`), created on first use.
2. `python -m v1engine.serve` serves the model (default: the embedded SmolLM2-135M-Instruct) with
   `--structured-outputs-disable-any-whitespace`, so constrained JSON is compact.
3. This script runs again in that venv (`--client URL`), where
   `ChatOpenAI(base_url=URL, api_key="none", model=..., temperature=0)
   .with_structured_output(Person, method=m, include_raw=True)` answers one prompt for each m of
   json_schema (response_format json_schema), function_calling (`tools` with a named
   `tool_choice`) and json_mode (response_format json_object; the prompt asks for JSON, which
   LangChain requires of that method).
4. Every method must give a `Person` (name: str, age: int); the script prints a table, exits 1 if
   any did not (with the raw reply and the error), and `--json PATH` writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

LANGCHAIN_REQUIREMENT = "langchain-openai==1.7.3"
DEFAULT_VENV = "~/.cache/v1engine/langchain-venv"
METHODS = ["json_schema", "function_calling", "json_mode"]
SERVER_FLAGS = ["--structured-outputs-disable-any-whitespace"]
PROMPT = (
    "Alice is a 30-year-old engineer from Lyon. Extract the person and reply with a JSON object "
    'with the keys "name" (a string) and "age" (an integer).'
)


# -- client side: runs in the langchain venv ---------------------------------------------------
def run_client(url: str, model: str, max_tokens: int) -> list[dict]:
    """Each method's result: whether it gave a Person, the Person, the raw reply, the error."""
    import httpx
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    sent: list[httpx.Request] = []
    llm = ChatOpenAI(
        base_url=f"{url}/v1",
        api_key="none",
        model=model,
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
        # Keeps each request's body, to show what a failed method sent.
        http_client=httpx.Client(timeout=300, event_hooks={"request": [sent.append]}),
    )
    results = []
    for method in METHODS:
        structured = llm.with_structured_output(Person, method=method, include_raw=True)
        start, sent_before = time.perf_counter(), len(sent)
        try:
            reply = structured.invoke(PROMPT)
            parsed, error, raw = reply["parsed"], reply["parsing_error"], reply["raw"]
            raw_text = json.dumps(
                {"content": raw.content, "tool_calls": raw.tool_calls}, default=str
            )
        except Exception as e:  # a refused request: report it, go on with the next method
            parsed, error, raw_text = None, e, None
        results.append(
            {
                "method": method,
                "ok": isinstance(parsed, Person),
                "person": parsed.model_dump() if isinstance(parsed, Person) else None,
                "raw": raw_text,
                "error": None if error is None else f"{type(error).__name__}: {error}",
                "seconds": round(time.perf_counter() - start, 2),
                "request": sent[-1].content.decode() if len(sent) > sent_before else None,
            }
        )
    return results


# -- driver side: runs in the project's venv ---------------------------------------------------
def run_methods(python: str, url: str, max_tokens: int) -> list[dict]:
    from _serve_utils import SERVED_NAME

    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        args = [python, os.path.abspath(__file__), "--client", url, "--served-name", SERVED_NAME]
        args += ["--max-tokens", str(max_tokens), "--client-out", out.name]
        print("langchain_structured: $", " ".join(args), flush=True)
        subprocess.run(args, check=True)
        return json.load(out)


def serve_and_run(model: str, python: str, args: argparse.Namespace) -> tuple[list[dict], str]:
    """The methods' results, and the last lines of the server's log."""
    from _serve_utils import Server

    with tempfile.TemporaryDirectory(prefix="v1e-langchain-") as work:
        log = os.path.join(work, "server.log")
        server = Server(model, log, SERVER_FLAGS + args.server_args, args.startup_timeout)
        try:
            results = run_methods(python, server.url, args.max_tokens)
        finally:
            server.stop()
        with open(log) as f:
            return results, "".join(f.readlines()[-40:])


def print_table(results: list[dict]) -> None:
    print(f"\n{'method':>16} {'ok':>4} {'seconds':>7}  result")
    for r in results:
        shown = (
            r["person"] if r["ok"] else f"{r['error']}; raw reply: {r['raw']}; sent {r['request']}"
        )
        print(f"{r['method']:>16} {'yes' if r['ok'] else 'NO':>4} {r['seconds']:>7.2f}  {shown}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an HF checkpoint directory or .gguf (default: the embedded)")
    p.add_argument("--langchain-venv", default=DEFAULT_VENV)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    p.add_argument("--served-name", help=argparse.SUPPRESS)
    p.add_argument("--client-out", help=argparse.SUPPRESS)
    p.add_argument("server_args", nargs="*", help="after --: more flags for v1engine.serve")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.client:
        with open(args.client_out, "w") as f:
            json.dump(run_client(args.client, args.served_name, args.max_tokens), f)
        return 0
    from _serve_utils import ensure_venv

    model = args.model
    if model is None:
        from v1engine.model.hf_config import default_model_path

        model = default_model_path()
    venv = os.path.expanduser(args.langchain_venv)
    python = ensure_venv(
        venv, [[LANGCHAIN_REQUIREMENT]], "langchain_openai", "langchain_structured"
    )
    results, log_tail = serve_and_run(model, python, args)
    print_table(results)
    ok = all(r["ok"] for r in results)
    if not ok:
        print("langchain_structured: the server log's last lines:\n" + log_tail)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"model": model, "langchain": LANGCHAIN_REQUIREMENT, "results": results},
                f,
                indent=2,
            )
    print("langchain_structured:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
