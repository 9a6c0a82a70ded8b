"""DeepSeek-V4.1 presets and plan validation, the KV budget and the cache that backs it."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import model
from model import kv_budget
from model.deepseek import preset
from model.deepseek.cache import (
    decode_index_key,
    decode_kv,
    decode_window,
    encode_index_key,
    encode_kv,
    encode_window,
    fake_quant,
)
from model.deepseek.config import layer_plan
from tests.round_trips import rounding_round_trips


def test_flash_preset_is_the_released_plan():
    c = preset("deepseek-v4.1-flash")
    assert c.num_layers == 40 and c.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    kinds = c.layer_kinds
    assert kinds[:2] == ("csa_swa",) * 2
    assert [i for i, k in enumerate(kinds) if k.startswith(("csa_full", "csa_candidates"))] == [2, 8, 14, 20]
    assert kinds[20] == "csa_candidates_r1"
    assert [i for i, k in enumerate(kinds) if k.startswith("csa_reindex")] == [24, 28, 32, 36]
    assert (c.num_heads, c.head_dim, c.rope_dim, c.window) == (64, 512, 64, 128)
    assert (c.index_heads, c.index_dim, c.index_top_k, c.num_candidate_blocks) == (32, 128, 512, 2048)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank) == (1280, 8, 1024)
    # Shapes only: nobody materializes Flash's weights on CPU.
    shapes = jax.eval_shape(lambda k: model.init_params(c, k), jax.random.key(0))
    assert shapes["layers"][20]["wq_b"].shape == (1280, 64 * 512)
    assert shapes["layers"][20]["wo_a"].shape == (8, 8 * 512, 1024)


def test_tiny_has_every_kind_and_both_ratios():
    c = preset("deepseek-v4.1-tiny")
    assert {"csa_swa", "csa_full_r2", "csa_reuse_r2", "csa_candidates_r1", "csa_reuse_r1",
            "csa_reindex_r1"} <= set(c.layer_kinds)


@pytest.mark.parametrize("plan, match", [
    ({"compress_ratios": [0, 2, 1], "kv_sources": (1,), "index_sources": (1,), "candidate_sources": ()},
     "does not follow a KV source with ratio 1"),
    ({"compress_ratios": [0, 2, 2], "kv_sources": (), "index_sources": (), "candidate_sources": ()},
     "does not follow a KV source"),
    ({"compress_ratios": [1, 1], "kv_sources": (0,), "index_sources": (0, 1), "candidate_sources": ()},
     "candidate source"),
    ({"compress_ratios": [0, 4], "kv_sources": (1,), "index_sources": (1,), "candidate_sources": ()},
     "compress_ratios"),
    ({"compress_ratios": [0, 1], "kv_sources": (1,), "index_sources": (), "candidate_sources": ()},
     "index source"),
    ({"compress_ratios": [0, 1], "kv_sources": (0,), "index_sources": (0,), "candidate_sources": ()},
     "SWA only"),
])
def test_bad_plans_raise(plan, match):
    with pytest.raises(ValueError, match=match):
        layer_plan(**plan)


def test_bad_config_and_preset_raise():
    with pytest.raises(ValueError, match="unknown DeepSeek preset"):
        preset("deepseek-v5")
    with pytest.raises(ValueError, match="unknown preset"):
        kv_budget.budget("gpt-5")
    c = preset("deepseek-v4.1-tiny")
    with pytest.raises(ValueError, match="do not match the plan"):
        dataclasses.replace(c, layer_kinds=("csa_swa",) * c.num_layers)
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(c, num_kv_heads=2, num_heads=4)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        model.init_cache(c, 1, 16, kv_cache_dtype="fp8")


def test_budget_numbers():
    flash = kv_budget.budget("deepseek-v4.1-flash")
    assert flash.bytes_per_token == 890 == preset("deepseek-v4.1-flash").kv_bytes_per_token
    text = kv_budget.report(flash)
    assert "10,324 B/token = 11.6x" in text and "652 / 356 = 1.83x" in text
    want = {"deepseek-v3": 70272, "deepseek-v3.2": 48068, "llama-3-8b": 131072, "smollm2-135m": 23040}
    for name, total in want.items():
        assert kv_budget.budget(name).bytes_per_token == total, name
    assert round(kv_budget.budget("deepseek-v4-flash").bytes_per_token) == 3514
    assert kv_budget.budget("default").bytes_per_token == 23040


def test_plot_writes_a_png_and_leaves_pyplots_backend(tmp_path):
    """A notebook's backend (here pdf) is what it was after the plot: kv_budget draws on a
    bare Figure rather than switching pyplot to Agg."""
    matplotlib = pytest.importorskip("matplotlib")
    before = matplotlib.get_backend()
    matplotlib.use("pdf")
    try:
        path = tmp_path / "kv.png"
        kv_budget.main(["deepseek-v3", "--plot", str(path)])
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.get_backend() == "pdf"
    finally:
        matplotlib.use(before)


def test_allocated_global_cache_is_the_budget():
    """Sum the nbytes of every global array the model allocates for N tokens."""
    c = preset("deepseek-v4.1-tiny")
    for batch, n in ((1, 64), (3, 96)):
        cache = model.init_cache(c, batch, n, page_size=16)
        global_bytes = sum(a.nbytes for layer in cache.layers for a in jax.tree.leaves(layer["global"]))
        assert global_bytes == batch * n * c.kv_bytes_per_token
        window = sum(layer["local"]["window"][k].nbytes for layer in cache.layers for k in ("values", "scales"))
        assert window == batch * c.num_layers * c.window * 66  # 64-d FP8 row + 2 UE8M0 scales
    kv = cache.layers[c.kv_sources[0]]["global"]["kv"]
    assert kv["packed"].dtype == jnp.uint8 and kv["packed"].shape[-1] == c.head_dim // 2  # 2 codes a byte


def test_cache_formats_exact_on_representable_rows():
    rng = np.random.default_rng(0)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    e2m1 = np.concatenate([e2m1, -e2m1])
    # NVFP4 (tensor scale 1): every block holds +-6 (so the scale is exact) times an E4M3 scale.
    scales = rng.choice(np.arange(1, 0x7E, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32),
                        (8, 4))
    codes = rng.choice(e2m1, (8, 4, 16))
    codes[..., 0] = 6.0
    x = jnp.asarray((codes * scales[..., None]).reshape(8, 64))
    np.testing.assert_array_equal(np.asarray(decode_kv(encode_kv(x), jnp.float32)), np.asarray(x))
    # MXFP4: E2M1 values times a power of two per 32.
    codes = rng.choice(e2m1, (8, 1, 32))
    codes[..., 0] = -6.0
    x = jnp.asarray((codes * 2.0 ** rng.integers(-20, 20, (8, 1, 1))).reshape(8, 32).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(decode_index_key(encode_index_key(x), jnp.float32)), np.asarray(x))
    # FP8 + UE8M0: every finite E4M3 value (a block's amax 448 keeps the scale at 1).
    e4m3 = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8).view(ml_dtypes.float8_e4m3fn)
    vals = np.resize(e4m3.astype(np.float32), (8, 64))
    vals[:, ::32] = 448.0
    np.testing.assert_array_equal(np.asarray(decode_window(encode_window(jnp.asarray(vals)), jnp.float32)), vals)


@pytest.mark.parametrize("codec", ["kv", "index_key", "window"])
def test_fake_quant_rounds_in_the_same_program_on_every_backend(codec):
    """fake_quant's value (what prefill attends over) is decode(encode(x)) in one program. It
    must not hold a float convert pair that XLA:GPU would fold away (tests/round_trips.py), or
    prefill would see unrounded rows on a GPU while decode reads the rounded ones."""
    pair = {"kv": (encode_kv, decode_kv), "index_key": (encode_index_key, decode_index_key),
            "window": (encode_window, decode_window)}[codec]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 64)), jnp.float32)
    assert rounding_round_trips(lambda x: fake_quant(x, *pair)[0], x) == []
