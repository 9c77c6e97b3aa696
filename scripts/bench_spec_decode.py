"""Greedy chat decode with n-gram speculative decoding against without, in the same run.

    python scripts/bench_spec_decode.py --pairs 3 --json spec.json [--dtype float32] \
        [--spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}']

Two engines on the default model (TP=1) live side by side in this process, one plain and one with
`speculative_config`. For each workload and batch size a pair times both, in alternating order
from pair to pair: one `chat` call per batch of conversations (batch 1: each conversation alone),
`--max-tokens` greedy tokens each (EOS ends a reply; both engines give the same tokens, which is
checked, so they count the same). The figure is the median over pairs of each pair's ratio
(speculative / plain tokens per second); every pair also records the drafts' acceptance.

Workloads: "copy" asks for text that repeats the prompt (a passage or a function to return
edited, the case n-gram drafts are for); "free" asks open questions, where drafts rarely match and
the figure shows what drafting costs when it does not help; "json" asks for the people a text
names as JSON under a schema (structured outputs: the drafts the grammar rejects are dropped,
and each verifying row samples within its own bitmask row). `--workloads` picks some.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from _bench_utils import cpu_machine_info

_PASSAGE = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the public library, to repair the "
    "roads in the northern district, and to hire two more teachers for the primary school. The "
    "proposal to build a new sports hall was postponed until the spring, when the final costs "
    "will be known."
)
_FUNCTION = """def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        total = 0
        for j in range(window):
            total += values[i + j]
        result.append(total / window)
    return result
"""
COPY = [
    f"Repeat the following text exactly, word for word:\n\n{_PASSAGE}",
    f"Add type hints to this Python function and return the whole function:\n\n{_FUNCTION}",
    f"Correct any spelling mistakes in this text and return all of it:\n\n{_PASSAGE}",
    f"Rename the variable `total` to `window_sum` in this function:\n\n{_FUNCTION}",
]
FREE = [
    "Write a short story about a dragon who learns to cook.",
    "What are three good habits for a healthy life? Explain each.",
    "Describe how a bicycle works to a ten-year-old.",
    "Give me some ideas for a weekend trip in the mountains.",
]
_PEOPLE = (
    "Maria Lopez, 34, moved from Madrid to Lyon last year, where she met Tom Becker, 41, a "
    "teacher from Berlin. Their neighbour Anna Rossi, 29, works in Milan."
)
JSON = [
    f"List every person in this text as JSON with name, age and city:\n\n{_PEOPLE}",
    f"Return the people mentioned below as a JSON object (name, age, home city):\n\n{_PEOPLE}",
    f"Extract name, age and city of each person as JSON:\n\n{_PASSAGE} {_PEOPLE}",
    f"Give me this text's people as JSON records:\n\n{_PEOPLE}",
]
_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
}
PEOPLE_SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": _PERSON}},
    "required": ["people"],
}
# name -> (prompts, the JSON schema replies follow, or None).
WORKLOADS = {"copy": (COPY, None), "free": (FREE, None), "json": (JSON, PEOPLE_SCHEMA)}


def _timed(llm, conversations, params, batch: int) -> tuple[float, list[list[int]]]:
    """Seconds for every conversation, `batch` at a time, and the tokens they got."""
    tokens = []
    start = time.perf_counter()
    for first in range(0, len(conversations), batch):
        outputs = llm.chat(conversations[first : first + batch], params, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outputs]
    return time.perf_counter() - start, tokens


def _spec_counts(llm) -> tuple[int, int, int]:
    stats = llm.engine_core.scheduler.make_stats()
    return stats.num_spec_drafts, stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    from v1engine import LLM, SamplingParams
    from v1engine.structured_outputs import StructuredOutputsParams

    common = dict(dtype=args.dtype, max_model_len=1024, kv_cache_memory_bytes=1 << 28)
    engines = {"plain": LLM(**common), "spec": LLM(**common, speculative_config=args.spec)}
    results: dict[str, Any] = {}
    try:
        for name in args.workloads:
            prompts, schema = WORKLOADS[name]
            structured = None if schema is None else StructuredOutputsParams(json=schema)
            params = SamplingParams(
                temperature=0, max_tokens=args.max_tokens, structured_outputs=structured
            )
            conversations = [[{"role": "user", "content": p}] for p in prompts]
            for batch in args.batch_sizes:
                for llm in engines.values():  # warm-up
                    _timed(llm, conversations[:batch], params, batch)
                pairs = []
                for pair in range(args.pairs):
                    order = ["plain", "spec"] if pair % 2 == 0 else ["spec", "plain"]
                    before = _spec_counts(engines["spec"])
                    runs = {v: _timed(engines[v], conversations, params, batch) for v in order}
                    after = _spec_counts(engines["spec"])
                    num_tokens = sum(map(len, runs["plain"][1]))
                    pairs.append({
                        "plain_tok_s": num_tokens / runs["plain"][0],
                        "spec_tok_s": num_tokens / runs["spec"][0],
                        "same_tokens": runs["plain"][1] == runs["spec"][1],
                        "drafts": after[0] - before[0],
                        "draft_tokens": after[1] - before[1],
                        "accepted_tokens": after[2] - before[2],
                    })  # fmt: skip
                    p = pairs[-1]
                    print(
                        f"{name} batch {batch} pair {pair + 1}: plain {p['plain_tok_s']:.1f} "
                        f"tok/s, spec {p['spec_tok_s']:.1f} tok/s, accepted "
                        f"{p['accepted_tokens']}/{p['draft_tokens']} drafted tokens",
                        flush=True,
                    )
                results[f"{name}_batch{batch}"] = _summary(pairs)
    finally:
        for llm in engines.values():
            llm.shutdown()
    return results


def _summary(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [p["spec_tok_s"] / p["plain_tok_s"] for p in pairs]
    drafts = sum(p["drafts"] for p in pairs)
    accepted = sum(p["accepted_tokens"] for p in pairs)
    return {
        "pairs": pairs,
        "plain_median_tok_s": statistics.median(p["plain_tok_s"] for p in pairs),
        "spec_median_tok_s": statistics.median(p["spec_tok_s"] for p in pairs),
        "median_ratio": statistics.median(ratios),
        "same_tokens": all(p["same_tokens"] for p in pairs),
        "acceptance_rate": accepted / max(1, sum(p["draft_tokens"] for p in pairs)),
        "mean_acceptance_length": 1 + accepted / max(1, drafts),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--batch-sizes", default="1,4", type=lambda s: [int(b) for b in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument(
        "--workloads",
        default=list(WORKLOADS),
        type=lambda s: s.split(","),
        help=f"comma-separated, of {', '.join(WORKLOADS)}",
    )
    p.add_argument(
        "--spec",
        type=json.loads,
        default={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
        help="the speculative_config, a JSON object",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if unknown := sorted(set(args.workloads) - set(WORKLOADS)):
        p.error(f"unknown workloads {unknown}; choose among {', '.join(WORKLOADS)}")
    results = run(args)
    print()
    for key, entry in results.items():
        print(
            f"{key}: plain {entry['plain_median_tok_s']:.1f} tok/s, spec "
            f"{entry['spec_median_tok_s']:.1f} tok/s, spec/plain {entry['median_ratio']:.2f}x; "
            f"acceptance {100 * entry['acceptance_rate']:.0f}%, mean acceptance length "
            f"{entry['mean_acceptance_length']:.2f}; same tokens: {entry['same_tokens']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": cpu_machine_info(), "results": results}, f)


if __name__ == "__main__":
    main()
