# Copyright 2026 The hf-mohd Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Training tokens/s of `hf-mohd train` in 1 process against 2 processes (FSDP2 and DeepSpeed ZeRO-2 over gloo).

The same run (MoHD of `configs/train/mohd_wiki.yaml`'s shape, the same global batch of 16 x 128 tokens, fp32) is
trained by: 1 process with 1 torch thread, 1 process with 2 threads, and `accelerate launch` with
`configs/accelerate/fsdp2_cpu.yaml` and `deepspeed_zero2_cpu.yaml` (2 processes x 1 thread x 8 sequences). The
figure is the trainer's own `tokens_per_s` (wall clock, all processes' tokens) of the steps after the first log
window, read from `log.jsonl`. On a 2-core machine this measures the cost of sharding and gloo communication, not
scaling: the two processes share the cores a 2-thread process would use.

    python -m bench.bench_distributed --output bench/results/distributed.json
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import command_line, git_commit, machine_description, write_results


ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = {
    "model_type": "mohd",
    "hidden_size": 256,
    "head_dim": 32,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "tie_word_embeddings": True,
    "num_sub_dims": 16,
    "num_shared_sub_dims": 6,
    "num_routed_sub_dims_per_tok": 2,
}
LAUNCHERS = {
    "fsdp2_2proc": ROOT / "configs" / "accelerate" / "fsdp2_cpu.yaml",
    "deepspeed_zero2_2proc": ROOT / "configs" / "accelerate" / "deepspeed_zero2_cpu.yaml",
}


def corpus(path: Path) -> str:
    """The first 40 articles of the Wikipedia sample of the gensim wheel as .jsonl (`hf_mohd.corpora`, layout "lines",
    the text the committed results/distributed.json trained on; docs/design.md section 8)."""
    from hf_mohd.corpora import wikipedia_articles

    with open(path, "w") as handle:
        for article in wikipedia_articles("lines")[:40]:
            handle.write(json.dumps({"text": article.text}) + "\n")
    return str(path)


def run(name: str, work: Path, data: str, steps: int) -> dict:
    processes = 1 if name.startswith("single") else 2
    threads = 2 if name == "single_2threads" else 1
    config = {
        "output_dir": str(work / name),
        "max_steps": steps,
        "micro_batch_size": 16 // processes,
        "mixed_precision": "no",
        "router_aux_loss": True,
        "log_every": 5,
        "save_every": 0,
        "save_final": False,
        "progress_bar": False,
        "optim": {"lr": 3e-3, "warmup_steps": 5},
        "model": {"tokenizer_vocab_size": 4096, "architecture": ARCHITECTURE},
        "data": {"path": data, "seq_len": 128, "eval_fraction": 0.0},
    }
    path = work / f"{name}.json"
    path.write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    if processes == 1:
        command = [sys.executable, "-m", "hf_mohd", "train", str(path)]
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(LAUNCHERS[name])]
        command += ["--main_process_port", str(port), "-m", "hf_mohd", "train", str(path)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (work / name / "log.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # the first window includes start-up
    return {
        "processes": processes,
        "threads_per_process": threads,
        "global_batch_tokens": 16 * 128,
        "tokens_per_s_windows": rates,
        "tokens_per_s": statistics.median(rates),
        "final_loss": records[-1].get("loss"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    before = machine_description()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = corpus(work / "corpus.jsonl")
        for name in ("single_1thread", "single_2threads", *LAUNCHERS):
            results[name] = run(name, work, data, args.steps)
            print(f"{name:>24}: {results[name]['tokens_per_s']:8.0f} tokens/s")
    base = results["single_2threads"]["tokens_per_s"]
    for result in results.values():
        result["ratio_to_single_2threads"] = result["tokens_per_s"] / base
    payload = {
        "command": command_line(),
        "git_commit": git_commit(),
        "architecture": ARCHITECTURE,
        "results": results,
        "machine_at_start": before,
        "machine_at_end": machine_description(),
    }
    if args.output:
        write_results(args.output, payload)
    print(json.dumps({k: round(v["ratio_to_single_2threads"], 3) for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
