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
"""Native CPU kernels for decoding: reading only the picked experts' (LatentMoE) or sub-dimensions' (MoHD) weights.

LatentMoE's `gather` direct read. While decoding, a routed expert of width m reads its weights once per token, and
only the K picked experts count. Torch has no gathered matrix-vector product: `embedding_bag` over the rows of the
decoding layout reads exactly the picked weights, but on the up side each row is one input scalar's 2m outputs (64
bytes for m = 8), so its per-row overhead, not memory, bounds the read. These two loops stream each picked expert's
contiguous block instead:

- `gathered_up(x, experts, weight)`: x (M, l), experts (M, K) int64, weight (E, l, o) contiguous (the decoding
  layout's `gate_up_proj.transpose(1, 2)`) -> (M K, o), row (t, k) = sum_i x[t, i] weight[experts[t, k], i, :]
  (= W_e x[t], e = experts[t, k]); the same sum, row by row, as the `embedding_bag` of the up side.
- `gathered_down(hidden, experts, weight)`: hidden (M K, m), experts (M, K), weight (E, m, l) contiguous (the
  decoding layout's `down_proj.transpose(1, 2)`) -> (M, l), row t = sum_k sum_j hidden[t K + k, j]
  weight[experts[t, k], j, :]; the `embedding_bag` of the down side.

Both accumulate in `at::opmath_type` (fp32 for fp32 and bf16, float64 for float64), work over a contiguous block per
picked expert (the inner loop over o or a slice of l is vectorised by the compiler) and split the work with torch's
own thread pool (`at::parallel_for`: experts on the up side, one slice of l per thread on the down side), prefetching
2 KB ahead across block boundaries. Expert ids must lie in [0, E); the caller masks expert-parallel off-rank ids
first; an id outside [0, E) raises (RuntimeError) rather than reading outside the table.

MoHD's one-token sublayer (the native form of `MoHDTokenPlan`), one dispatched op per step of it instead of one per block span
and per bookkeeping op (N blocks of s channels, the first N_s shared, k routed ones picked per token):

- `mohd_route(x, weight, top_k, offset, gate_mode)`: x (1, D), weight (C, D) the router's -> ids (1, k) int64
  (choice + `offset`), gates (1, k) in x's dtype: logits W x accumulated in fp32 (float64 for float64), softmax,
  the k largest probabilities with ties to the lower index, in the order of a stable descending sort (k passes of a
  strict-greater scan), gates p_j (`gate_mode` 0), k p_j / sum of the chosen p (1) or 1 (2).
- `mohd_gather_in(x, ids, gates, weight_t, num_shared, block)`: x (1, D), weight_t (D, O) with contiguous rows (the
  fused block-major storage of q/k/v or gate/up) -> (1, O) = (g ⊙ x) weight_t with g 1 on the shared blocks, the
  gates on the picked ones and 0 elsewhere, as one product per run of consecutive active blocks (each run's rows
  contiguous, read once).
- `mohd_gather_out(hidden, ids, weight, fusion, num_shared, block, scale)`: hidden (1, I), weight (D, I) row-major
  (o_proj, down_proj), fusion (N, N) or None -> (1, D) = scale F y, y the active output blocks (one product per run
  of them) and zero elsewhere; without `fusion`, scale y.

A routed id outside [N_s, N) raises (RuntimeError). The products call ATen's `mm` / `addmm` from C++ on the weight
slices (the BLAS's own rate), so only the bookkeeping around them is new code.

Every kernel is a torch operator (`torch.ops.hf_mohd_native_gather_<digest>.*`, registered with the dispatcher when
the library loads), so profilers and operator counts see each call. The namespace carries the digest of this source and build
(`_build_name`): two different copies of this file in one process (this package's and the remote code of a
checkpoint saved by another version) register two namespaces instead of colliding in one. The library is compiled on first use with
`torch.utils.cpp_extension.load_inline` (a C++ compiler and ninja; about 30 s once, then cached under torch's
extensions folder, one build per CPU model since it targets the build machine's instruction set). Where it cannot be
built, `native_gather()` returns None once and logs why, and the callers keep their torch forms (`embedding_bag`,
MoHD's spans plan). Set `HF_MOHD_NATIVE_GATHER=0` to never build or use it.
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
#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <tuple>
#include <type_traits>
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

// MoHD, one token (decoding at batch 1): the router, the gathered input side and the gathered output side of one
// sublayer, each one call. Blocks are s consecutive channels; the first N_s are shared, the routed ones are chosen.

// logits = W_r x accumulated in A (fp32, float64 for float64), p = softmax(logits), the k largest p with ties to the
// lower index (k passes of a strict-greater scan: the order of a stable descending sort), gates by `gate_mode`:
// 0 p_j, 1 k p_j / sum of the chosen p, 2 one.
template <typename T>
static void route_kernel(const T* x, const T* weight, int64_t C, int64_t D, int64_t k, int64_t offset,
                         int64_t gate_mode, int64_t* ids, T* gates) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  std::vector<A> p(C);
  for (int64_t c = 0; c < C; ++c) {
    const T* row = weight + c * D;
    A acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < D; ++i) acc += static_cast<A>(x[i]) * static_cast<A>(row[i]);
    p[c] = acc;
  }
  A top = p[0];
  for (int64_t c = 1; c < C; ++c) top = std::max(top, p[c]);
  A sum = 0;
  for (int64_t c = 0; c < C; ++c) {
    p[c] = std::exp(p[c] - top);
    sum += p[c];
  }
  for (int64_t c = 0; c < C; ++c) p[c] /= sum;
  std::vector<char> taken(C, 0);
  std::vector<A> chosen(k);
  A chosen_sum = 0;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t c = 0; c < C; ++c) {
      if (!taken[c] && (best < 0 || p[c] > p[best])) best = c;
    }
    taken[best] = 1;
    ids[j] = best + offset;
    chosen[j] = p[best];
    chosen_sum += p[best];
  }
  for (int64_t j = 0; j < k; ++j) {
    const A gate = gate_mode == 0 ? chosen[j] : gate_mode == 1 ? static_cast<A>(k) * chosen[j] / chosen_sum : A(1);
    gates[j] = static_cast<T>(gate);
  }
}

// The active blocks of one token as maximal runs [start, stop) of consecutive block ids, in increasing order: the
// shared blocks 0 .. N_s - 1 first (a routed block next to them joins that run), then the sorted routed ids.
static std::vector<std::pair<int64_t, int64_t>> active_spans(const int64_t* ids, int64_t k, int64_t num_shared) {
  std::vector<int64_t> sorted(ids, ids + k);
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::pair<int64_t, int64_t>> spans;
  if (num_shared > 0) spans.emplace_back(0, num_shared);
  for (int64_t id : sorted) {
    if (!spans.empty() && spans.back().second >= id) {
      spans.back().second = std::max(spans.back().second, id + 1);
    } else {
      spans.emplace_back(id, id + 1);
    }
  }
  return spans;
}

static void check_routed_ids(const torch::Tensor& ids, int64_t num_blocks, int64_t num_shared) {
  check(ids, "ids");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == 1 && ids.scalar_type() == torch::kLong, "ids (1, k) int64");
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < ids.numel(); ++j) {
    TORCH_CHECK(p[j] >= num_shared && p[j] < num_blocks, "routed block id ", p[j], " outside [", num_shared, ", ",
                num_blocks, ")");
  }
}

std::tuple<torch::Tensor, torch::Tensor> mohd_route(torch::Tensor x, torch::Tensor weight, int64_t top_k,
                                                    int64_t offset, int64_t gate_mode) {
  check(x, "x"); check(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weight.dim() == 2 && weight.size(1) == x.size(1) &&
              weight.scalar_type() == x.scalar_type() && top_k >= 1 && top_k <= weight.size(0) &&
              gate_mode >= 0 && gate_mode <= 2, "mohd_route: x (1, D), weight (C, D), 1 <= top_k <= C");
  auto ids = torch::empty({1, top_k}, x.options().dtype(torch::kLong));
  auto gates = torch::empty({1, top_k}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "mohd_route", [&] {
    route_kernel<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), weight.size(0), x.size(1), top_k,
                           offset, gate_mode, ids.data_ptr<int64_t>(), gates.data_ptr<scalar_t>());
  });
  return {ids, gates};
}

torch::Tensor mohd_gather_in(torch::Tensor x, torch::Tensor ids, torch::Tensor gates, torch::Tensor weight_t,
                             int64_t num_shared, int64_t block) {
  check(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weight_t.dim() == 2 && weight_t.size(0) == x.size(1) &&
              weight_t.stride(1) == 1 && x.size(1) % block == 0 && weight_t.scalar_type() == x.scalar_type() &&
              gates.scalar_type() == x.scalar_type(), "mohd_gather_in: x (1, D), weight_t (D, O) rows contiguous, D = N s");
  check_routed_ids(ids, x.size(1) / block, num_shared);
  check(gates, "gates");
  TORCH_CHECK(gates.dim() == 2 && gates.size(0) == 1 && gates.size(1) == ids.size(1), "ids and gates (1, k)");
  // g ⊙ x over the routed blocks (the shared blocks have gate 1), then one product per run of active blocks, each
  // run's s-row slices of x and of weight_t contiguous, accumulated in place
  auto gated = x.clone();
  const int64_t k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j) {
    gated.narrow(1, id[j] * block, block).mul_(gates.select(1, j));
  }
  auto out = torch::empty({1, weight_t.size(1)}, x.options());
  bool first = true;
  for (const auto& span : active_spans(id, k, num_shared)) {
    const int64_t start = span.first * block, width = (span.second - span.first) * block;
    auto rows = gated.narrow(1, start, width);
    auto weight = weight_t.narrow(0, start, width);
    if (first) {
      at::mm_out(out, rows, weight);
      first = false;
    } else {
      at::addmm_out(out, out, rows, weight);
    }
  }
  return out;
}

torch::Tensor mohd_gather_out(torch::Tensor hidden, torch::Tensor ids, torch::Tensor weight,
                              std::optional<torch::Tensor> fusion, int64_t num_shared, int64_t block, double scale) {
  check(hidden, "hidden"); check(weight, "weight");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == 1 && weight.dim() == 2 && weight.size(1) == hidden.size(1) &&
              weight.size(0) % block == 0 && weight.scalar_type() == hidden.scalar_type(),
              "mohd_gather_out: hidden (1, I), weight (D, I), D = N s");
  const int64_t N = weight.size(0) / block;
  check_routed_ids(ids, N, num_shared);
  const bool fused = fusion.has_value();
  if (fused) {
    check(*fusion, "fusion");
    TORCH_CHECK(fusion->dim() == 2 && fusion->size(0) == N && fusion->size(1) == N &&
                fusion->scalar_type() == hidden.scalar_type(), "mohd_gather_out: fusion (N, N)");
  }
  // y: the active output blocks (one product per run of them, rows of the row-major weight), zero elsewhere
  auto y = torch::zeros({1, weight.size(0)}, hidden.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t k = ids.size(1);
  const auto spans = active_spans(id, k, num_shared);
  for (const auto& span : spans) {
    const int64_t start = span.first * block, width = (span.second - span.first) * block;
    auto rows = y.narrow(1, start, width);
    at::mm_out(rows, hidden, weight.narrow(0, start, width).t());
  }
  if (!fused) {
    return scale == 1.0 ? y : y.mul_(scale);
  }
  // z = scale F y over the blocks: only the active columns of F meet nonzero blocks
  auto out = torch::empty({1, weight.size(0)}, hidden.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, hidden.scalar_type(), "mohd_gather_out", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* f = fusion->data_ptr<scalar_t>();
    const scalar_t* yv = y.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    std::vector<A> z(block);
    for (int64_t n = 0; n < N; ++n) {
      std::fill(z.begin(), z.end(), A(0));
      for (const auto& span : spans) {
        for (int64_t b = span.first; b < span.second; ++b) {
          const A weight_nb = static_cast<A>(f[n * N + b]);
          const scalar_t* yb = yv + b * block;
          for (int64_t c = 0; c < block; ++c) z[c] += weight_nb * static_cast<A>(yb[c]);
        }
      }
      for (int64_t c = 0; c < block; ++c) o[n * block + c] = static_cast<scalar_t>(static_cast<A>(scale) * z[c]);
    }
  });
  return out;
}

TORCH_LIBRARY(HF_MOHD_NAMESPACE, m) {
  m.def("gathered_up(Tensor x, Tensor experts, Tensor weight) -> Tensor", &gathered_up);
  m.def("gathered_down(Tensor hidden, Tensor experts, Tensor weight) -> Tensor", &gathered_down);
  m.def("mohd_route(Tensor x, Tensor weight, int top_k, int offset, int gate_mode) -> (Tensor, Tensor)", &mohd_route);
  m.def("mohd_gather_in(Tensor x, Tensor ids, Tensor gates, Tensor weight_t, int num_shared, int block) -> Tensor",
        &mohd_gather_in);
  m.def("mohd_gather_out(Tensor hidden, Tensor ids, Tensor weight, Tensor? fusion, int num_shared, int block, "
        "float scale) -> Tensor", &mohd_gather_out);
}
"""

DTYPES = (torch.float32, torch.float64, torch.bfloat16)  # what the kernels take; other dtypes keep the torch forms
_lock = threading.Lock()
_state: dict = {}


def _build_name() -> str:
    """Extension name: one build per kernel source, CPU (the build targets the build machine's instruction set) and
    torch installation (the build compiles against its headers and links its libraries: two environments with the same
    torch version, such as a project's and a serving engine's, would otherwise rebuild one shared folder in turn)."""
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
    installation = torch.__version__ + os.path.dirname(torch.__file__)
    digest = hashlib.sha256((SOURCE + cpu + installation).encode()).hexdigest()[:12]
    return f"hf_mohd_native_gather_{digest}"


def native_gather():
    """The compiled kernels as their `torch.ops` namespace, `hf_mohd_native_gather_<digest>` (`gathered_up`,
    `gathered_down`, `mohd_route`, `mohd_gather_in`, `mohd_gather_out`; module docstring), or None where it is
    disabled (`HF_MOHD_NATIVE_GATHER=0`) or cannot be built (the reason is logged once). Built at most once per
    process; thread-safe."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        if os.environ.get("HF_MOHD_NATIVE_GATHER", "1") == "0":
            logger.info("HF_MOHD_NATIVE_GATHER=0: decoding keeps the torch forms (embedding_bag, MoHD's spans plan).")
        else:
            try:
                from torch.utils.cpp_extension import load_inline

                flags = ["-O3", "-fopenmp"] + (["-march=native"] if platform.machine() in ("x86_64", "AMD64") else [])
                name = _build_name()
                load_inline(
                    name,
                    cpp_sources=SOURCE,
                    extra_cflags=flags + [f"-DHF_MOHD_NAMESPACE={name}"],
                    extra_ldflags=["-fopenmp"],
                    is_python_module=False,  # a plain library: its ops register with the dispatcher on load
                )
                module = getattr(torch.ops, name)
            except Exception as error:  # no compiler, no ninja, a failed build: keep the torch forms
                logger.warning_once(
                    f"The native decoding kernels could not be built ({type(error).__name__}: {error}); LatentMoE "
                    "decoding reads the picked experts with embedding_bag and MoHD's with its spans plan instead."
                )
        _state["module"] = module
        return module


__all__ = ["DTYPES", "native_gather"]
