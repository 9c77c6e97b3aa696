"""lm-eval against the server: the harness itself, through `--model local-completions`, must score
a small multiple-choice task exactly as `--model hf` scores it on the same checkpoint.

    .venv/bin/python scripts/lm_eval_parity.py --json lm_eval.json
    .venv/bin/python scripts/lm_eval_parity.py --model HF_DIR -- --tensor-parallel-size 2

What it does, all on this machine and with nothing downloaded:
1. lm-eval (`lm-eval[api,hf]`, pinned below) goes into its own venv,
   `~/.cache/v1engine/lm-eval-venv` by default (`--lm-eval-venv`), created on first use with
   `torch==2.13.0` installed first, as `scripts/setup.sh` does (an unpinned torch would pull the
   CUDA build).
2. Two local tasks are written to a temporary directory: `v1e_mc`, a multiple-choice task over a
   jsonl written here (loglikelihood requests: echo + logprobs + max_tokens 1, token-id prompts),
   and `v1e_gen`, a greedy generate_until task over the same questions.
3. `python -m v1engine.serve` serves the checkpoint (default: the embedded SmolLM2-135M-Instruct,
   converted to a cached HF directory); lm-eval runs both tasks with `--model local-completions`
   at batch size 1 and 4 (4 prompts per HTTP request: batched prompts), then with `--model hf`.
4. Every item's per-choice loglikelihood must agree within `--tolerance` (1e-4) and every
   generation must be the same text. The script prints the worst difference and exits 1 if any
   item disagrees; `--json PATH` writes the comparison.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

from _serve_utils import SERVED_NAME, Server, ensure_venv

LM_EVAL_REQUIREMENT = "lm-eval[api,hf]==0.4.13"
DEFAULT_VENV = "~/.cache/v1engine/lm-eval-venv"

# (question, choices, index of the answer): plain facts, so a 135M model has preferences.
_ITEMS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Water freezes at a temperature of", ["0 degrees Celsius", "50 degrees Celsius"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus"], 1),
    ("The opposite of hot is", ["cold", "loud", "green"], 0),
    ("A week has", ["five days", "seven days", "ten days"], 1),
    ("The sun rises in the", ["west", "north", "east"], 2),
    ("Two plus two equals", ["three", "four", "five"], 1),
    ("Cats are a kind of", ["mammal", "fish", "bird"], 0),
    ("The color of the sky on a clear day is", ["blue", "red", "black"], 0),
    ("The first month of the year is", ["March", "January", "June"], 1),
]

_MC_TASK = """task: v1e_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""

_GEN_TASK = """task: v1e_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def ensure_lm_eval_venv(venv: str) -> str:
    """The venv's python, installing lm-eval there first if it is missing."""
    requirements = [["torch==2.13.0"], [LM_EVAL_REQUIREMENT]]
    return ensure_venv(venv, requirements, "lm_eval", "lm_eval_parity")


def write_tasks(directory: str) -> None:
    data = os.path.join(directory, "items.jsonl")
    with open(data, "w") as f:
        for question, choices, answer in _ITEMS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(os.path.join(directory, "v1e_mc.yaml"), "w") as f:
        f.write(_MC_TASK.format(data=data))
    with open(os.path.join(directory, "v1e_gen.yaml"), "w") as f:
        f.write(_GEN_TASK.format(data=data))


def run_lm_eval(python: str, tasks_dir: str, out_dir: str, model: str, model_args: str,
                batch_size: int) -> dict[str, list[dict]]:  # fmt: skip
    """Runs lm-eval once; returns task -> its logged samples, sorted by doc_id."""
    args = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args]
    args += ["--tasks", "v1e_mc,v1e_gen", "--include_path", tasks_dir, "--batch_size"]
    args += [str(batch_size), "--log_samples", "--output_path", out_dir]
    # Offline: the json loader is built into `datasets`, and nothing else may be fetched.
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["OPENAI_API_KEY"] = env.get("OPENAI_API_KEY", "EMPTY")
    print("lm_eval_parity: $", " ".join(args), flush=True)
    subprocess.run(args, check=True, env=env)
    samples = {}
    for task in ("v1e_mc", "v1e_gen"):
        paths = glob.glob(os.path.join(out_dir, "**", f"samples_{task}_*.jsonl"), recursive=True)
        if len(paths) != 1:
            raise RuntimeError(f"expected one samples file for {task} in {out_dir}, got {paths}")
        with open(paths[0]) as f:
            samples[task] = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
    return samples


def loglikelihoods(samples: list[dict]) -> list[list[float]]:
    """Per item, each choice's loglikelihood (lm-eval logs resps as [[ll, is_greedy]] each)."""
    return [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples]


def generations(samples: list[dict]) -> list[str]:
    return [sample["resps"][0][0] for sample in samples]


def compare(reference: dict, candidate: dict, tolerance: float) -> dict:
    ref_ll, cand_ll = loglikelihoods(reference["v1e_mc"]), loglikelihoods(candidate["v1e_mc"])
    worst = max(abs(a - b) for r, c in zip(ref_ll, cand_ll, strict=True) for a, b in zip(r, c))
    ref_gen, cand_gen = generations(reference["v1e_gen"]), generations(candidate["v1e_gen"])
    mismatched = [i for i, (a, b) in enumerate(zip(ref_gen, cand_gen, strict=True)) if a != b]
    return {
        "max_abs_loglikelihood_diff": worst,
        "loglikelihoods_agree": worst <= tolerance,
        "generations_agree": not mismatched,
        "mismatched_generations": [(ref_gen[i], cand_gen[i]) for i in mismatched],
        "loglikelihoods": cand_ll,
        "generations": cand_gen,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an HF checkpoint directory (default: the embedded model)")
    parser.add_argument("--lm-eval-venv", default=DEFAULT_VENV)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json", help="write the comparison here")
    parser.add_argument("server_args", nargs="*", help="after --: flags for v1engine.serve")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from v1engine.model.hf_config import default_model_path, prepare_checkpoint

        model = prepare_checkpoint(default_model_path())
    python = ensure_lm_eval_venv(os.path.expanduser(args.lm_eval_venv))
    with tempfile.TemporaryDirectory(prefix="v1e-lm-eval-") as work:
        write_tasks(work)
        hf_args = f"pretrained={model},dtype=float32"
        reference = run_lm_eval(python, work, os.path.join(work, "hf"), "hf", hf_args, 1)
        server = Server(model, os.path.join(work, "server.log"), args.server_args,
                        args.startup_timeout)  # fmt: skip
        results = {}
        try:
            for batch_size in args.batch_sizes:
                api_args = (
                    f"model={SERVED_NAME},base_url={server.url}/v1/completions,"
                    f"tokenizer_backend=huggingface,tokenizer={model},num_concurrent=1,"
                    "max_retries=1,tokenized_requests=True"
                )
                out = os.path.join(work, f"api-{batch_size}")
                candidate = run_lm_eval(python, work, out, "local-completions", api_args,
                                        batch_size)  # fmt: skip
                results[f"batch_size_{batch_size}"] = compare(reference, candidate, args.tolerance)
        finally:
            server.stop()
    report = {"model": model, "tolerance": args.tolerance, "results": results}
    report["reference_loglikelihoods"] = loglikelihoods(reference["v1e_mc"])
    report["reference_generations"] = generations(reference["v1e_gen"])
    ok = all(r["loglikelihoods_agree"] and r["generations_agree"] for r in results.values())
    for name, result in results.items():
        print(f"lm_eval_parity: {name}: max |loglikelihood diff| "
              f"{result['max_abs_loglikelihood_diff']:.2e}, generations agree: "
              f"{result['generations_agree']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print("lm_eval_parity:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
