"""Runs vLLM's offline engine on saved model folders and writes what it generated, for the tests and benchmarks.

It runs with the Python of `.venv-vllm` (`bash scripts/setup.sh --vllm`: vLLM and hf-mohd's vLLM plugin); it imports
only vLLM and the standard library, and loads the models as any vLLM user does, from the folder (remote code,
`trust_remote_code=True`). The caller (in `.venv`) writes a JSON spec, runs

    .venv-vllm/bin/python tests/vllm_runner.py SPEC.json RESULT.json

and reads the result. The spec is a list of runs, each {"name", "model", "engine": LLM keyword arguments,
"prompts": [[token ids], ...], "sampling": SamplingParams keyword arguments, "modules": true to list the module
types of layer 0 after load, "env": environment variables for the engine's processes}. All prompts of a run are submitted in one `generate` call, so the engine batches them
continuously. The result maps each run's name to {"outputs": [{"token_ids", "logprobs": the logprob of each
generated token, "prompt_logprobs": the log-probability of each prompt token given the ones before it (None first;
empty unless asked)}], "modules": {qualified name: class name}, "seconds": wall time of `generate`}, or to {"error":
the exception's text} when the engine refused to build or run (a refusal a test expects).
"""

import gc
import json
import os
import sys
import time


# `LLM.apply_model` sends a function to the engine's workers, which vLLM pickles only when allowed (local processes
# of this run only)
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def layer_zero_modules(model) -> dict[str, str]:
    """{qualified name: class name} of the modules of decoder layer 0 of a loaded vLLM model (run in the worker)."""
    return {name: type(module).__name__ for name, module in model.named_modules() if ".layers.0." in f"{name}."}


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
            from vllm_runner import layer_zero_modules as by_reference

            result["modules"] = llm.apply_model(by_reference)[0]  # one answer per worker: rank 0's
        sampling = SamplingParams(**{"temperature": 0.0, "logprobs": 1, "detokenize": False, **spec["sampling"]})
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        result["seconds"] = time.perf_counter() - start
        result["outputs"] = [
            {
                "token_ids": list(out.outputs[0].token_ids),
                "logprobs": [
                    step[token].logprob
                    for step, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True)
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
