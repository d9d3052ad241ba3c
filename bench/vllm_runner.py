"""Runs vLLM's offline engine on saved model folders and writes what it generated, for the tests and benchmarks.

The runner half (`main`, `run`) runs with the Python of `.venv-vllm` (`bash scripts/setup.sh --vllm`: vLLM and
hf-mohd's vLLM plugin); it imports only vLLM and the standard library, and loads the models as any vLLM user does,
from the folder (remote code, `trust_remote_code=True`). The caller half, `run_vllm` (in `.venv`, standard library
only), writes a JSON spec, runs

    .venv-vllm/bin/python bench/vllm_runner.py SPEC.json RESULT.json

and reads the result. The spec is a list of runs, each {"name", "model", "engine": LLM keyword arguments,
"prompts": [[token ids], ...], "sampling": SamplingParams keyword arguments, "modules": true to list the module
types of layer 0 after load (or a string: of the modules whose qualified name holds it), "sparse_execution": true for
MoHD's strategies and layer 0's parameter shapes and strides (`sparse_execution`), "env": environment variables for the
engine's processes, "throughput": optional, below}.
All prompts of a run are submitted in one `generate` call, so the engine batches them continuously. The result maps
each run's name to {"outputs": [{"token_ids", "logprobs": the logprob of each generated token, "prompt_logprobs": the
log-probability of each prompt token given the ones before it (None first; empty unless asked)}], "modules":
{qualified name: class name}, "sparse_execution": {qualified name: strategy class, or {"shape", "stride"}}, "seconds": wall time of `generate`, "throughput": below}, or to {"error": the
exception's text} when the engine refused to build or run (a refusal a test expects).

"throughput": {"loads": {label: [[token ids], ...]}, "repeats": R, "warmup": W} times `generate` on each load's
prompts (all submitted at once: that many concurrent requests) W times untimed, then R times round-robin over the
loads, with the run's sampling; the result's "throughput" maps each label to {"seconds": [R wall times],
"output_tokens": tokens generated per call}.
"""

import functools
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path


# the Python of `.venv-vllm` (`bash scripts/setup.sh --vllm`), where vLLM and hf-mohd's plugin are installed
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"

# `LLM.apply_model` sends a function to the engine's workers, which vLLM pickles only when allowed (local processes
# of this run only)
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def module_types(model, part: str = ".layers.0.") -> dict[str, str]:
    """{qualified name: class name} of the modules of a loaded vLLM model whose name (with a final ".") holds `part`,
    by default those of decoder layer 0 (run in the worker)."""
    return {name: type(module).__name__ for name, module in model.named_modules() if part in f"{name}."}


def sparse_execution(model) -> dict[str, object]:
    """{qualified name: value} of what decides how a loaded vLLM model's MoHD sublayers compute (run in the worker):
    the class of each sublayer's strategy (`<sublayer>.strategy`) and the shape and strides of each parameter of layer
    0."""
    found = {
        f"{name}.strategy": type(module.strategy).__name__
        for name, module in model.named_modules()
        if hasattr(module, "strategy")
    }
    found.update(
        {
            name: {"shape": list(param.shape), "stride": list(param.stride())}
            for name, param in model.named_parameters()
            if ".layers.0." in name
        }
    )
    return found


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = {"dtype": "float32", "skip_tokenizer_init": True, "trust_remote_code": True, **spec["engine"]}
    saved = dict(os.environ)
    os.environ.update(spec.get("env", {}))  # read by the engine's processes as they start
    try:
        llm = LLM(model=spec["model"], **engine)
    except Exception as error:  # the engine core reports its own error text; keep the last line
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        result = {}
        if spec.get("modules"):
            # by reference to this file as a module (on the workers' sys.path), not as `__main__`
            from vllm_runner import module_types as by_reference

            part = spec["modules"] if isinstance(spec["modules"], str) else ".layers.0."
            # one answer per worker: rank 0's
            result["modules"] = llm.apply_model(functools.partial(by_reference, part=part))[0]
        if spec.get("sparse_execution"):
            from vllm_runner import sparse_execution

            result["sparse_execution"] = llm.apply_model(sparse_execution)[0]
        sampling = SamplingParams(**{"temperature": 0.0, "logprobs": 1, "detokenize": False, **spec["sampling"]})
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        result["seconds"] = time.perf_counter() - start
        if "throughput" in spec:
            result["throughput"] = timed_loads(llm, sampling, **spec["throughput"])
        result["outputs"] = [
            {
                "token_ids": list(out.outputs[0].token_ids),
                "logprobs": [  # empty with `logprobs=None` (throughput runs)
                    step[token].logprob
                    for step, token in zip(out.outputs[0].logprobs or [], out.outputs[0].token_ids, strict=False)
                ],
                # with `prompt_logprobs` asked: the log-probability of each prompt token given the ones before it
                "prompt_logprobs": [
                    None if step is None else step[token].logprob
                    for step, token in zip(out.prompt_logprobs or [], out.prompt_token_ids, strict=False)
                ],
            }
            for out in outputs
        ]
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def timed_loads(llm, sampling, loads: dict, repeats: int, warmup: int = 1) -> dict:
    """{label: {"seconds": [wall time of each timed `generate`], "output_tokens": per call}} (see the module
    docstring); the loads' repetitions alternate so that the machine's drift spreads over all of them."""
    from vllm.inputs import TokensPrompt

    batches = {label: [TokensPrompt(prompt_token_ids=ids) for ids in prompts] for label, prompts in loads.items()}
    timings = {label: {"seconds": [], "output_tokens": 0} for label in loads}
    for round_index in range(warmup + repeats):
        for label, prompts in batches.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            seconds = time.perf_counter() - start
            if round_index >= warmup:
                timings[label]["seconds"].append(seconds)
                timings[label]["output_tokens"] = sum(len(out.outputs[0].token_ids) for out in outputs)
    return timings


def run_vllm(runs: list[dict], workdir: Path, timeout: float = 900, python: str | None = None) -> dict:
    """Runs `runs` (the spec above) in `.venv-vllm` and returns the result (caller side, in `.venv`).

    Args:
        runs: the spec's runs.
        workdir: a folder for SPEC.json and RESULT.json (the runner's working directory).
        timeout: seconds for the whole runner.
        python: the interpreter that has vLLM (default: `.venv-vllm`'s).
    Returns:
        run name -> result; a run whose engine refused to start gets the workers' error lines appended to its
        "error" (the engine only says "see root cause above").
    Raises:
        RuntimeError: the runner failed (its last output lines are written to stderr first).
    """
    spec, result = Path(workdir) / "spec.json", Path(workdir) / "result.json"
    spec.write_text(json.dumps(runs))
    process = subprocess.run(
        [python or str(VLLM_PYTHON), str(Path(__file__).resolve()), str(spec), str(result)],
        cwd=workdir,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    log = process.stdout + process.stderr
    if process.returncode or not result.exists():
        sys.stderr.write(log[-20000:])
        raise RuntimeError(f"vLLM runner failed (exit {process.returncode}); its output is above.")
    results = json.loads(result.read_text())
    causes = [line for line in log.splitlines() if "Error:" in line and "ERROR" in line]
    for outcome in results.values():
        if "error" in outcome:
            outcome["error"] += "\n" + "\n".join(dict.fromkeys(causes))
    return results


def main() -> None:
    spec_path, result_path = sys.argv[1:3]
    with open(spec_path) as file:
        runs = json.load(file)
    results = {}
    for spec in runs:
        results[spec["name"]] = run(spec)
        with open(result_path, "w") as file:  # after every run: a crash later keeps what was measured
            json.dump(results, file)


if __name__ == "__main__":  # vLLM's engine core starts by spawn, which re-imports this file
    main()
