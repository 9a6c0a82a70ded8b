"""dispatch: eager calls of an entry compile once per shape and static configuration."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionVariant, dispatch, paged_attention, ragged_paged_attention
from pallas_kernels.paged_attention import kv_formats
from tests import conftest
from tests.pallas_kernels.helpers import paged_inputs

pytestmark = pytest.mark.skipif(
    conftest.kernel_mode() == "compiled",
    reason="counts the CPU staged call's compilations; KVFOLD_KERNELS=compiled replaces it",
)


def _compiles(call) -> int:
    before = dispatch._staged._cache_size()
    call()
    return dispatch._staged._cache_size() - before


def _paged(seed, **options):
    rng = np.random.default_rng(seed)  # fresh values, same shapes, every call
    args = paged_inputs(rng, kv_lens=[3, 9], num_q_heads=4, num_kv_heads=2, head_dim=16,
                        page_size=4, max_pages=3)
    return lambda: paged_attention(*args, **options)


def _recency(s, q_pos, kv_pos, q_head):
    return s - 0.1 * (q_pos - kv_pos)


def test_paged_attention_compiles_once_per_static_configuration():
    # soft_cap composes the variant's logits transform inside the entry on every call.
    options = dict(sliding_window=5, soft_cap=30.0, variant=AttentionVariant(logits_fn=_recency),
                   sinks=jnp.ones(4, jnp.float32))
    assert [_compiles(_paged(seed, **options)) for seed in range(3)] == [1, 0, 0]
    assert _compiles(_paged(3, **{**options, "soft_cap": 20.0})) == 1
    assert _compiles(_paged(4, **{**options, "sliding_window": 6})) == 1
    assert _compiles(_paged(5, **options)) == 0


def _ragged(seed, **options):
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    tokens, num_pages = 4, 6
    q, k, v = f32(tokens, 4, 16), f32(tokens, 2, 16), f32(tokens, 2, 16)
    fmt = kv_formats.resolve(options["kv_format"])
    k_pages, v_pages = (fmt.quantize(f32(num_pages, 4, 2, 16)) for _ in range(2))
    table = jnp.asarray(rng.permutation(num_pages)[:4].reshape(2, 2).astype(np.int32))
    cu_q_lens = jnp.asarray([0, 3, 4], jnp.int32)  # a 3-token chunk and a decode row
    kv_lens = jnp.asarray([5, 7], jnp.int32)
    return lambda: ragged_paged_attention(q, k, v, k_pages, v_pages, table, cu_q_lens, kv_lens,
                                          **options)


def test_ragged_paged_attention_compiles_once_per_static_configuration():
    # kv_format is resolved to a fresh format object on every call.
    options = dict(kv_format="int8", soft_cap=30.0, max_q_len=4)
    assert [_compiles(_ragged(seed, **options)) for seed in range(3)] == [1, 0, 0]
    assert _compiles(_ragged(3, **{**options, "kv_format": "fp8"})) == 1
    assert _compiles(_ragged(4, **options)) == 0
