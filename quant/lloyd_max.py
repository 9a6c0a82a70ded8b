"""Lloyd-Max scalar codebooks for one coordinate of a uniformly random unit vector.

If x is uniform on the unit sphere in R^d, each coordinate has density
    f(t) proportional to (1 - t^2)^((d - 3) / 2) on [-1, 1]
(close to N(0, 1/d) for large d). TurboQuant quantizes every coordinate of a randomly
rotated vector with the MSE-optimal (Lloyd-Max) codebook for this exact density.

Computed in float64 numpy: the density is integrated on a fine midpoint grid (cumulative
mass and first moment), and Lloyd's iteration (boundaries at midpoints, centroids at the
conditional means) runs to a fixed point. f is log-concave for d >= 3, so the fixed point
is the unique optimum. Results are cached per (dim, bits).
"""

from __future__ import annotations

import functools

import numpy as np

_GRID = 1 << 18
_MAX_ITERS = 50_000
_TOL = 1e-13


@functools.lru_cache(maxsize=None)
def _grid(dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Cell edges, cumulative mass and cumulative first moment at the edges, and E[t^2]."""
    # Beyond 40 standard deviations (1/sqrt(d)) the mass is far below float64 resolution.
    half = min(1.0, 40.0 / np.sqrt(dim))
    edges = np.linspace(-half, half, _GRID + 1)
    mid = 0.5 * (edges[:-1] + edges[1:])
    logf = 0.5 * (dim - 3) * np.log1p(-mid * mid)
    w = np.exp(logf - logf.max())
    w /= w.sum()
    mass = np.concatenate([[0.0], np.cumsum(w)])
    moment = np.concatenate([[0.0], np.cumsum(w * mid)])
    return edges, mass, moment, float(np.sum(w * mid * mid))


def _validate(dim: int, bits: int) -> None:
    if not isinstance(dim, (int, np.integer)) or dim < 2:
        raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
    if not isinstance(bits, (int, np.integer)) or not 0 <= bits <= 8:
        raise ValueError(f"codebook bits must be an integer in 0..8, got {bits!r}")


@functools.lru_cache(maxsize=None)
def _solve(dim: int, bits: int) -> tuple[np.ndarray, float]:
    edges, mass, moment, second = _grid(dim)
    k = 1 << bits
    # Start from the quantile midpoints of the distribution.
    c = np.interp((np.arange(k) + 0.5) / k, mass, edges)
    for _ in range(_MAX_ITERS):
        bounds = np.concatenate([[edges[0]], 0.5 * (c[:-1] + c[1:]), [edges[-1]]])
        m = np.diff(np.interp(bounds, edges, mass))
        g = np.diff(np.interp(bounds, edges, moment))
        new = g / m
        done = np.max(np.abs(new - c)) < _TOL
        c = new
        if done:
            break
    c = 0.5 * (c - c[::-1])  # exact symmetry
    bounds = np.concatenate([[edges[0]], 0.5 * (c[:-1] + c[1:]), [edges[-1]]])
    m = np.diff(np.interp(bounds, edges, mass))
    # At the optimum E[t * c(t)] = E[c(t)^2], so the distortion is E[t^2] - sum m_k c_k^2.
    mse = dim * (second - float(np.sum(m * c * c)))
    c.setflags(write=False)
    return c, mse


def sphere_codebook(dim: int, bits: int) -> np.ndarray:
    """Sorted float64 centroids [2**bits] for one coordinate of a unit vector in R^dim.

    bits = 0 gives the single centroid [0.0] (the mean). Read-only, cached.
    """
    _validate(dim, bits)
    return _solve(int(dim), int(bits))[0]


def sphere_codebook_mse(dim: int, bits: int) -> float:
    """Exact Lloyd-Max distortion E||x - x_hat||^2 for a unit x in R^dim, all coordinates
    quantized with sphere_codebook(dim, bits) after a random rotation (d times the
    per-coordinate MSE)."""
    _validate(dim, bits)
    return _solve(int(dim), int(bits))[1]
