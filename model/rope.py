"""Rotary position embeddings with the usual scaling variants.

Frequencies follow Hugging Face's `rope_utils` formulas so checkpoints trained with
a scaling variant load unchanged; the halves layout (`rotate_half`) is HF's too.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig, RopeScaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(dim: int, theta: float, scaling: RopeScaling,
                     max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies (float32 [dim // 2]) and the cos/sin attention factor."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.float32(theta) ** exponents
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    kind, factor = scaling.rope_type, np.float32(scaling.factor)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return (inv_freq / factor).astype(np.float32), 1.0
    original = scaling.original_max_position_embeddings or max_position_embeddings
    if kind == "llama3":
        low_wavelen = original / scaling.low_freq_factor
        high_wavelen = original / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    # yarn: interpolate low frequencies, extrapolate high ones, ramp in between.
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = (_yarn_mscale(float(factor), scaling.mscale)
                                / _yarn_mscale(float(factor), scaling.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(float(factor))

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp.astype(np.float32)
    interpolation_freq = np.float32(1.0) / (factor * pos_freqs)
    inv_freq = interpolation_freq * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_tables(config: ModelConfig, positions: jnp.ndarray, local: bool = False
                ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin of shape [*positions.shape, head_dim] (float32) for `positions` (int).

    local: the tables of sliding-window layers, which rotate with their own unscaled base
    when the config gives one (Gemma 3's rope_local_theta)."""
    theta, scaling = config.rope_theta, config.rope_scaling
    if local and config.rope_local_theta is not None:
        theta, scaling = config.rope_local_theta, RopeScaling()
    inv_freq, attention_factor = rope_frequencies(config.head_dim, theta, scaling,
                                                  config.max_position_embeddings)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * attention_factor, jnp.sin(emb) * attention_factor


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate x [batch, seq, heads, head_dim] by cos/sin [batch, seq, head_dim]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
