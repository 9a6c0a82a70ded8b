"""The XLA path the paged-attention entries run on CPU (blocked online softmax) equals the
dense reference: every option, garbage past a sequence's pages, empty sequences, a last
block only partly filled by the table, and every low-bit page format."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import kv_formats
from pallas_kernels.paged_attention.ref import paged_attention_quantized_ref, paged_attention_ref
from pallas_kernels.paged_attention.xla import paged_attention_xla
from pallas_kernels.paged_blocks import PAGES_PER_BLOCK
from pallas_kernels.variant import resolve, sigmoid
from tests.pallas_kernels.helpers import assert_close, paged_inputs
from tests.pallas_kernels.test_paged_attention_quantized import FORMATS

MAX_PAGES = 2 * PAGES_PER_BLOCK + 3  # three blocks, the last one padded
PAGE_SIZE = 4
KV_LENS = [0, 1, 4, 37, PAGE_SIZE * MAX_PAGES, 45]


def _inputs(seed, num_kv_heads=2, head_dim=16):
    rng = np.random.default_rng(seed)
    return paged_inputs(rng, kv_lens=KV_LENS, num_q_heads=6, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, page_size=PAGE_SIZE, max_pages=MAX_PAGES)


@pytest.mark.parametrize("options", [
    {}, {"sliding_window": 9}, {"soft_cap": 5.0}, {"sinks": (0.3, -1.0, 2.0, 0.0, 1.0, -0.5)},
    {"variant": sigmoid(-1.0)},  # no softmax: the dense path
])
def test_equals_the_dense_reference(options):
    q, k, v, bt, kl = _inputs(seed=len(options) + 7)
    sinks = jnp.asarray(options["sinks"], jnp.float32) if "sinks" in options else None
    static = dict(sm_scale=0.3, sliding_window=options.get("sliding_window"),
                  variant=resolve(options.get("variant"), options.get("soft_cap")))
    want = paged_attention_ref(q, k, v, bt, kl, sinks, **static)
    got = paged_attention_xla(q, k, v, bt, kl, sinks, **static)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


@pytest.mark.parametrize("name", sorted(FORMATS) + ["nvfp4-scaled"])
def test_low_bit_pages_equal_the_dense_reference(name):
    """Every format's parts, in its kernel basis (rotated TurboQuant rows, an NVFP4 tensor
    scale folded into query and output), against dequantized pages."""
    q, k, v, bt, kl = _inputs(seed=3, num_kv_heads=1, head_dim=64)
    fmt = kv_formats.resolve(FORMATS[name.removesuffix("-scaled")])
    kq, vq = fmt.quantize(k), fmt.quantize(v)
    if name == "nvfp4-scaled":  # a real scalar tensor scale, as quant.nvfp4_quantize(x) makes
        kq, vq = kq._replace(tensor_scale=jnp.float32(0.25)), vq._replace(tensor_scale=jnp.float32(3.0))
    static = dict(sm_scale=0.125, sliding_window=None, variant=resolve(None, 10.0))
    want = paged_attention_quantized_ref(q, kq, vq, bt, kl, None, kv_format=fmt, **static)
    got = paged_attention_xla(q, kq, vq, bt, kl, None, kv_format=fmt, **static)
    assert_close(got[0], want[0], rtol=2e-5, atol=2e-5)
    assert_close(got[1], want[1], rtol=2e-5, atol=2e-5)
