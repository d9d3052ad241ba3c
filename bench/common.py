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
"""Timing, peak memory, copy bandwidth and machine description shared by the benchmarks in `bench/`.

Timing reports two clocks per measurement: wall time (`time.perf_counter`) and the process CPU time
(`time.process_time`). On a machine shared with other jobs, wall time includes the time the process waits for a core;
with one torch thread the CPU time is the time the work itself took, so it is the clock the ratios use by default
(`--clock`). Peak memory is the peak resident set size (VmHWM) of the process during the measured calls, reset
before each measurement through `/proc/self/clear_refs` (Linux); the figure includes the model's weights.
"""

import argparse
import ctypes
import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


RESULTS_DIR = Path(__file__).resolve().parent / "results"

# The fixed bench shape (LLaMA base; MoHD presets and LatentMoE configs are derived from it).
BENCH_SHAPE = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "head_dim": 64,
    "intermediate_size": 2816,
    "vocab_size": 32000,
    "tie_word_embeddings": True,
    "batch": 4,
    "seq": 512,
    "decode_batch": 1,
}
# `--quick`: a smaller setting for development runs (not comparable with the fixed shape).
QUICK_SHAPE = {**BENCH_SHAPE, "num_hidden_layers": 2, "batch": 2, "seq": 128}


def base_arguments(description: str) -> argparse.ArgumentParser:
    """Command-line options common to the benchmarks."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="smaller shape (2 layers, batch 2 x seq 128)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, see README)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement (after 1 warm-up)")
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="clock the printed ratios use (both are stored)"
    )
    parser.add_argument("--no-sweep", action="store_true", help="skip the sequence-length / batch sweep")
    parser.add_argument("--output", type=Path, default=None, help="result JSON path (a PNG is written next to it)")
    return parser


def setup(args) -> dict:
    """Applies threads/seed and returns the shape to use."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return dict(QUICK_SHAPE if args.quick else BENCH_SHAPE)


def machine_description() -> dict:
    """CPU model, core count, load average, torch threads and library versions (stored with every result)."""
    from hf_mohd.versions import cpu_model, library_versions

    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "torch_threads": torch.get_num_threads(),
        **library_versions(),  # python, torch, transformers, accelerate, safetensors, peft, lm-eval
        "blas": "mkl" if torch.backends.mkl.is_available() else "other",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _read_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def release_free_memory() -> None:
    """Returns freed heap memory to the OS (glibc `malloc_trim`), so that the resident size before a measurement
    does not already hold the previous measurement's freed buffers; a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_memory() -> bool:
    """Resets the process's peak RSS counter (Linux `clear_refs` 5); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(fn: Callable[[], object], reps: int = 3, warmup: int = 1) -> dict:
    """Runs `fn` `warmup` times, then `reps` timed times.

    Returns:
        wall_s / cpu_s: medians over the reps (seconds); wall_min_s / cpu_min_s: minima; peak_rss_mib: peak resident
        memory of the process during the timed reps (None where the platform cannot reset the counter), which
        includes every model the benchmark holds; peak_rss_above_start_mib: that peak minus the resident memory
        just before the timed reps (activations, gradients, caches of this measurement).
    """
    for _ in range(warmup):
        fn()
    release_free_memory()
    rss_before = _read_status_kib("VmRSS")
    can_reset = reset_peak_memory()
    walls, cpus = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpus.append(time.process_time() - c0)
        walls.append(time.perf_counter() - w0)
    hwm = _read_status_kib("VmHWM") if can_reset else None
    return {
        "wall_s": statistics.median(walls),
        "cpu_s": statistics.median(cpus),
        "wall_min_s": min(walls),
        "cpu_min_s": min(cpus),
        "reps": reps,
        "peak_rss_mib": None if hwm is None else round(hwm / 1024, 1),
        "rss_before_mib": None if rss_before is None else round(rss_before / 1024, 1),
        "peak_rss_above_start_mib": None if hwm is None or rss_before is None else round((hwm - rss_before) / 1024, 1),
    }


def interleaved_medians(fns: dict[str, Callable[[], tuple[float, float]]], reps: int, warmup: int = 1) -> dict:
    """Runs every model's `fn` `reps` times, round-robin (one repetition of each model per round, after `warmup`
    runs of each).

    On a shared VM the machine's speed drifts over minutes (seen here: the same Llama prefill 3.9 s in one run and 5.0
    s in the next, the same Llama decoding step 45-60 ms within one minute); timing each model's repetitions one
    after the other lets the drift fall on whichever model ran during it, round-robin spreads it over all of them.

    Args:
        fns: name -> callable returning (wall, cpu) seconds of one repetition.
    Returns:
        name -> {"wall_s", "cpu_s": medians; "wall_min_s", "cpu_min_s": minima; "reps"; "wall_runs", "cpu_runs":
        every repetition} (seconds).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    runs = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            runs[name].append(fn())
    results = {}
    for name, timings in runs.items():
        walls, cpus = [t[0] for t in timings], [t[1] for t in timings]
        results[name] = {
            "wall_s": statistics.median(walls),
            "cpu_s": statistics.median(cpus),
            "wall_min_s": min(walls),
            "cpu_min_s": min(cpus),
            "reps": reps,
            "wall_runs": [round(w, 5) for w in walls],
            "cpu_runs": [round(c, 5) for c in cpus],
        }
    return results


def measure_interleaved(
    fns: dict[str, Callable[[], object]],
    reps: int = 3,
    warmup: int = 1,
    after: Callable[[str], None] | None = None,
) -> dict[str, dict]:
    """`measure` for several models at once, their timed repetitions round-robin (`interleaved_medians`).

    First each model runs its warm-ups and one run alone for its peak memory (the counter is reset just before it,
    after `after(name)` freed what the warm-up left), then `reps` rounds time one repetition of every model.

    Args:
        fns: name -> the callable to time.
        after: called with the name after each run of that model, outside the timing (e.g. to free gradients).
    Returns:
        name -> the fields of `interleaved_medians` plus the peak memory fields of `measure` (from the memory run).
    """
    memory = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        if after is not None:
            after(name)
        release_free_memory()
        rss_before = _read_status_kib("VmRSS")
        can_reset = reset_peak_memory()
        fn()
        hwm = _read_status_kib("VmHWM") if can_reset else None
        if after is not None:
            after(name)
        memory[name] = {
            "peak_rss_mib": None if hwm is None else round(hwm / 1024, 1),
            "rss_before_mib": None if rss_before is None else round(rss_before / 1024, 1),
            "peak_rss_above_start_mib": None
            if hwm is None or rss_before is None
            else round((hwm - rss_before) / 1024, 1),
        }

    def timed(name: str, fn: Callable[[], object]) -> Callable[[], tuple[float, float]]:
        def run() -> tuple[float, float]:
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            timing = time.perf_counter() - w0, time.process_time() - c0
            if after is not None:
                after(name)
            return timing

        return run

    timings = interleaved_medians({name: timed(name, fn) for name, fn in fns.items()}, reps, warmup=0)
    return {name: {**timings[name], **memory[name]} for name in fns}


def copy_bandwidth(megabytes: int = 256, reps: int = 5) -> dict:
    """STREAM-style copy bandwidth with the current torch threads: (bytes read + bytes written) / time.

    Returns the best and the median over `reps` copies of a `megabytes` float32 array, in GB/s (1e9 bytes/s), for
    both clocks.
    """
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    walls, cpus = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        dst.copy_(src)
        cpus.append(time.process_time() - c0)
        walls.append(time.perf_counter() - w0)
    moved = 2 * src.numel() * src.element_size()
    return {
        "bytes_per_copy": moved,
        "wall_best_gb_s": moved / min(walls) / 1e9,
        "wall_median_gb_s": moved / statistics.median(walls) / 1e9,
        "cpu_best_gb_s": moved / max(min(cpus), 1e-9) / 1e9,
        "cpu_median_gb_s": moved / max(statistics.median(cpus), 1e-9) / 1e9,
    }


# namespaces of the dispatched ops a decoding step runs: torch's and this package's native kernels (`native_gather`,
# whose namespace is hf_mohd_native_gather_<digest of its source>)
OP_NAMESPACES = ("aten::", "hf_mohd_native_gather_")


def top_level_op_events(profile) -> list:
    """The events of a `torch.profiler.profile` that are dispatched ops (aten's or this package's native kernels)
    not called from inside another such op: the ops a forward dispatches itself, each costing dispatch time whatever
    it computes."""
    return [
        event
        for event in profile.events()
        if event.name.startswith(OP_NAMESPACES)
        and (event.cpu_parent is None or not event.cpu_parent.name.startswith(OP_NAMESPACES))
    ]


def command_line() -> str:
    """The command that runs this process: `python -m bench.<module> ...` for a module run with -m."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    program = ["-m", spec.name] if spec is not None and spec.name else sys.argv[:1]
    return " ".join([Path(sys.executable).name, *program, *sys.argv[1:]])


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_results(path: Path, payload: dict) -> Path:
    """`payload` as indented JSON at `path`, written atomically (`hf_mohd.atomic_folder.write_json_atomically`)."""
    from hf_mohd.atomic_folder import write_json_atomically

    return write_json_atomically(path, payload)


def fmt_ratio(value: float | None) -> str:
    return "   n/a" if value is None else f"{value:6.3f}"
