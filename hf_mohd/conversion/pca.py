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
"""Principal directions of calibration activations, shared by both targets: MoHD's rotation of the residual stream
(SliceGPT, arXiv 2401.15024, section 3.3) and the latent bases of a carved LatentMoE (LatentMoE, arXiv 2601.18089).

Both use the **uncentred** second moment C = (1/M) X^T X of M activation rows: the maps they build (an orthogonal
change of basis; bias-free latent projections) have no bias, so the best rank-l projection of x itself, not of
x - E x, is the one that counts (Ky Fan; Eckart-Young): the top-l eigenvectors of C.
"""

from __future__ import annotations

import torch


def pca_rotation(second_moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, eigenvalues) of a symmetric (D, D) `second_moment`: its eigenvectors as the columns of Q (D, D), sorted by
    decreasing eigenvalue (D,), float64; each column's sign makes its largest-magnitude entry positive (the basis is
    deterministic)."""
    values, vectors = torch.linalg.eigh(second_moment.double())
    order = torch.argsort(values, descending=True)
    values, vectors = values[order], vectors[:, order]
    pivots = vectors.abs().argmax(0)
    signs = torch.sign(vectors[pivots, torch.arange(vectors.shape[1])])
    return vectors * signs, values


def principal_basis(rows: torch.Tensor, size: int) -> tuple[torch.Tensor, float]:
    """The top-`size` principal directions of (M, D) `rows` on their uncentred second moment.

    Returns:
        (V, explained): V (D, size) float64 with orthonormal columns, the eigenvectors of C = (1/M) X^T X (computed
        in float64) of the `size` largest eigenvalues in decreasing order, signs as in `pca_rotation`; explained =
        (sum of the top-`size` eigenvalues) / tr(C) = 1 - ||X - X V V^T||_F^2 / ||X||_F^2, in [0, 1] (0 for all-zero
        rows). M >= D keeps every direction determined (with M < D the trailing eigenvectors span the null space
        arbitrarily).
    """
    x = rows.double()
    vectors, values = pca_rotation(x.T @ x / x.shape[0])
    values = values.clamp_min(0)  # C is positive semi-definite: negative eigenvalues are rounding
    total = values.sum().item()
    explained = values[:size].sum().item() / total if total > 0 else 0.0
    return vectors[:, :size].contiguous(), min(explained, 1.0)


__all__ = ["pca_rotation", "principal_basis"]
