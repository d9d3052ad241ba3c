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
"""Native CPU kernels for reading the picked experts' weights while decoding (LatentMoE's `gather` direct read).

While decoding, a routed expert of width m reads its weights once per token, and only the K picked experts count.
Torch has no gathered matrix-vector product: `embedding_bag` over the rows of the decoding layout reads exactly the
picked weights, but on the up side each row is one input scalar's 2m outputs (64 bytes for m = 8), so its per-row
overhead, not memory, bounds the read. These two loops stream each picked expert's contiguous block instead:

- `gathered_up(x, experts, weight)`: x (M, l), experts (M, K) int64, weight (E, l, o) contiguous (the decoding
  layout's `gate_up_proj.transpose(1, 2)`) -> (M K, o), row (t, k) = sum_i x[t, i] weight[experts[t, k], i, :]
  (= W_e x[t], e = experts[t, k]); the same sum, row by row, as the `embedding_bag` of the up side.
- `gathered_down(hidden, experts, weight)`: hidden (M K, m), experts (M, K), weight (E, m, l) contiguous (the
  decoding layout's `down_proj.transpose(1, 2)`) -> (M, l), row t = sum_k sum_j hidden[t K + k, j]
  weight[experts[t, k], j, :]; the `embedding_bag` of the down side.

Both accumulate in `at::opmath_type` (fp32 for fp32 and bf16, float64 for float64), work over a contiguous block per picked expert (the inner loop
over o or a slice of l is vectorised by the compiler) and split the work with torch's own thread pool
(`at::parallel_for`: experts on the up side, one slice of l per thread on the down side), prefetching 2 KB ahead
across block boundaries. Expert ids must lie in [0, E); the
caller masks expert-parallel off-rank ids first;
an id outside [0, E) raises (RuntimeError) rather than reading outside the table.

The extension is compiled on first use with `torch.utils.cpp_extension.load_inline` (a C++ compiler and ninja; about
20 s once, then cached under torch's extensions folder, one build per CPU model since it targets the build machine's
instruction set). Where it cannot be built, `native_gather()` returns None once and logs why, and the callers keep
`embedding_bag`. Set `HF_MOHD_NATIVE_GATHER=0` to never build or use it.
"""

import hashlib
import os
import platform
import threading

import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <vector>

// Software prefetch `distance` bytes ahead of the read position, into the next picked block near a block's end: the
// hardware prefetchers stop at page boundaries and at each new block, which a gathered read meets every few KB.
constexpr int64_t kAhead = 2048;

template <typename T>
static inline void prefetch_ahead(const T* block, int64_t offset, int64_t size, const T* next) {
  const int64_t target = offset + kAhead / static_cast<int64_t>(sizeof(T));
  if (target < size) {
    __builtin_prefetch(block + target);
  } else if (next != nullptr) {
    __builtin_prefetch(next + (target - size));
  }
}

template <typename T>
static void up_kernel(const T* x, const int64_t* experts, const T* weight, T* out, int64_t M, int64_t K, int64_t l,
                      int64_t o) {
  const int64_t size = l * o;
  at::parallel_for(0, M * K, 1, [&](int64_t begin, int64_t end) {
    using A = at::opmath_type<T>;
    std::vector<A> acc(o);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + (r / K) * l;
      const T* block = weight + experts[r] * size;
      const T* next = r + 1 < end ? weight + experts[r + 1] * size : nullptr;
      std::fill(acc.begin(), acc.end(), A(0));
      A* a = acc.data();
      for (int64_t i = 0; i < l; ++i) {
        const A s = static_cast<A>(xr[i]);
        const T* row = block + i * o;
        prefetch_ahead(block, i * o, size, next);
#pragma omp simd
        for (int64_t j = 0; j < o; ++j) a[j] += s * static_cast<A>(row[j]);
      }
      T* dst = out + r * o;
      for (int64_t j = 0; j < o; ++j) dst[j] = static_cast<T>(a[j]);
    }
  });
}

template <typename T>
static void down_kernel(const T* hidden, const int64_t* experts, const T* weight, T* out, int64_t M, int64_t K,
                        int64_t m, int64_t l) {
  // one slice of l per thread (whole rows on one thread), so that each picked block is read row after row
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (l + 63) / 64));
  const int64_t chunk = (l + threads - 1) / threads;
  const int64_t size = m * l;
  at::parallel_for(0, M * threads, 1, [&](int64_t begin, int64_t end) {
    using A = at::opmath_type<T>;
    std::vector<A> acc(chunk);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t token = t / threads, lo = (t % threads) * chunk, width = std::min(chunk, l - lo);
      if (width <= 0) continue;
      A* a = acc.data();
      std::fill(a, a + width, A(0));
      for (int64_t k = 0; k < K; ++k) {
        const T* block = weight + experts[token * K + k] * size;
        const T* next = k + 1 < K ? weight + experts[token * K + k + 1] * size : nullptr;
        const T* h = hidden + (token * K + k) * m;
        for (int64_t j = 0; j < m; ++j) {
          const A s = static_cast<A>(h[j]);
          const T* row = block + j * l + lo;
          for (int64_t d = 0; d < width; d += 64 / static_cast<int64_t>(sizeof(T))) {  // a cache line each
            prefetch_ahead(block, j * l + lo + d, size, next);
          }
#pragma omp simd
          for (int64_t d = 0; d < width; ++d) a[d] += s * static_cast<A>(row[d]);
        }
      }
      T* dst = out + token * l + lo;
      for (int64_t d = 0; d < width; ++d) dst[d] = static_cast<T>(a[d]);
    }
  });
}

static void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
}

static void check_ids(const torch::Tensor& experts, int64_t num_experts) {
  const int64_t* ids = experts.data_ptr<int64_t>();
  for (int64_t i = 0; i < experts.numel(); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_experts, "expert id ", ids[i], " outside [0, ", num_experts, ")");
  }
}

torch::Tensor gathered_up(torch::Tensor x, torch::Tensor experts, torch::Tensor weight) {
  check(x, "x"); check(experts, "experts"); check(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && experts.dim() == 2 && weight.dim() == 3 && x.size(0) == experts.size(0) &&
              weight.size(1) == x.size(1) && experts.scalar_type() == torch::kLong &&
              weight.scalar_type() == x.scalar_type(), "gathered_up: x (M, l), experts (M, K) int64, weight (E, l, o)");
  check_ids(experts, weight.size(0));
  const int64_t M = x.size(0), K = experts.size(1), l = x.size(1), o = weight.size(2);
  auto out = torch::empty({M * K, o}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "gathered_up", [&] {
    up_kernel<scalar_t>(x.data_ptr<scalar_t>(), experts.data_ptr<int64_t>(), weight.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), M, K, l, o);
  });
  return out;
}

torch::Tensor gathered_down(torch::Tensor hidden, torch::Tensor experts, torch::Tensor weight) {
  check(hidden, "hidden"); check(experts, "experts"); check(weight, "weight");
  TORCH_CHECK(hidden.dim() == 2 && experts.dim() == 2 && weight.dim() == 3 &&
              hidden.size(0) == experts.numel() && hidden.size(1) == weight.size(1) &&
              experts.scalar_type() == torch::kLong && weight.scalar_type() == hidden.scalar_type(),
              "gathered_down: hidden (M K, m), experts (M, K) int64, weight (E, m, l)");
  check_ids(experts, weight.size(0));
  const int64_t M = experts.size(0), K = experts.size(1), m = weight.size(1), l = weight.size(2);
  auto out = torch::empty({M, l}, hidden.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, hidden.scalar_type(), "gathered_down", [&] {
    down_kernel<scalar_t>(hidden.data_ptr<scalar_t>(), experts.data_ptr<int64_t>(), weight.data_ptr<scalar_t>(),
                          out.data_ptr<scalar_t>(), M, K, m, l);
  });
  return out;
}
"""

DTYPES = (torch.float32, torch.float64, torch.bfloat16)  # what the kernels take; other dtypes keep embedding_bag
_lock = threading.Lock()
_state: dict = {}


def _build_name() -> str:
    """Extension name: one build per kernel source and CPU (the build targets the build machine's instruction set)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:  # the first core's model name and instruction flags
            seen = {}
            for line in info:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features") and key not in seen:
                    seen[key] = line
            cpu += "".join(seen.values())
    except OSError:
        pass
    digest = hashlib.sha256((SOURCE + cpu + torch.__version__).encode()).hexdigest()[:12]
    return f"hf_mohd_native_gather_{digest}"


def native_gather():
    """The compiled extension (functions `gathered_up`, `gathered_down`; module docstring), or None where it is
    disabled (`HF_MOHD_NATIVE_GATHER=0`) or cannot be built (the reason is logged once). Built at most once per
    process; thread-safe."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        if os.environ.get("HF_MOHD_NATIVE_GATHER", "1") == "0":
            logger.info("HF_MOHD_NATIVE_GATHER=0: the gather kernel reads experts with embedding_bag.")
        else:
            try:
                from torch.utils.cpp_extension import load_inline

                flags = ["-O3", "-fopenmp"] + (["-march=native"] if platform.machine() in ("x86_64", "AMD64") else [])
                module = load_inline(
                    _build_name(),
                    cpp_sources=SOURCE,
                    functions=["gathered_up", "gathered_down"],
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"],
                )
            except Exception as error:  # no compiler, no ninja, a failed build: keep embedding_bag
                logger.warning_once(
                    f"The native gather kernel could not be built ({type(error).__name__}: {error}); LatentMoE "
                    "decoding reads the picked experts with embedding_bag instead."
                )
        _state["module"] = module
        return module


__all__ = ["DTYPES", "native_gather"]
