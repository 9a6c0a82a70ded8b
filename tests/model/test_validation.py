"""Bad input at the model's edges gets a ValueError that names the problem."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model.config import ModelConfig


def test_missing_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        model.load(str(tmp_path / "nope.gguf"))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        model.load(str(bad))


def test_unsupported_gguf_architecture_names_supported_ones(tmp_path):
    import gguf

    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gemma'.*llama"):
        model.load(str(path))


def test_unsupported_hf_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"unsupported architecture.*LlamaForCausalLM"):
        model.load(str(tmp_path))


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        model.load(str(tmp_path))


def test_wrong_source_type():
    with pytest.raises(ValueError, match="model source"):
        model.load(42)


def tiny_config(**kw):
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=4, num_kv_heads=2,
                head_dim=4, layer_kinds=("attention",) * 2, max_position_embeddings=64)
    return ModelConfig(**{**base, **kw})


def test_cache_longer_than_context():
    with pytest.raises(ValueError, match="context"):
        model.init_cache(tiny_config(), 1, 65)


def test_sequence_longer_than_cache_names_context():
    config = tiny_config()
    params = model.init_params(config, jax.random.key(0))
    cache = model.init_cache(config, 1, 16, page_size=8)
    tokens = jnp.ones((1, 17), jnp.int32)
    with pytest.raises(ValueError, match="longer than the cache"):
        model.forward(params, config, tokens, jnp.arange(17)[None], cache)


def test_positions_of_the_wrong_shape_are_named_before_block_tables_are_read():
    config = tiny_config()
    params = model.init_params(config, jax.random.key(0))
    with pytest.raises(ValueError, match="positions"):
        model.forward(params, config, jnp.ones((1, 4), jnp.int32), jnp.arange(4), model.init_cache(config, 1, 16))


def test_block_table_entries_must_be_pages_of_the_pool():
    config = tiny_config()
    params = model.init_params(config, jax.random.key(0))
    cache = model.init_paged_cache(config, 4, 8, jnp.float32, jnp.asarray([[0, 1], [2, 3]], jnp.int32))
    tokens = jnp.ones((2, 12), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = 4 is not a page"):
        model.forward(params, config, tokens, positions,
                      model.KVCache(cache.layers, jnp.asarray([[0, 1], [2, 4]], jnp.int32), 8))
    # Entries past a sequence's positions are never read: padding them with -1 is fine.
    short = jnp.asarray([[0, -1], [2, -1]], jnp.int32)
    model.forward(params, config, tokens[:, :8], positions[:, :8], model.KVCache(cache.layers, short, 8))
    cache = model.init_paged_cache(config, 4, 8, jnp.float32, jnp.asarray([[0, 1], [2, 3]], jnp.int32))
    bad = model.KVCache(cache.layers, jnp.asarray([[0, -1], [2, 3]], jnp.int32), cache.page_size)
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = -1 is not a page"):
        model.forward(params, config, tokens, positions, bad)
    # Traced tables are not checked, but sequence 0's -1 entry drops its writes (positions
    # 8..11) instead of wrapping to the last page, sequence 1's (which it leaves empty).
    positions = positions.at[1, 8:].set(-1)
    _, got = jax.jit(model.forward, static_argnums=1)(params, config, tokens, positions, bad)
    for layer in got.layers:
        for name in ("k", "v"):
            assert np.all(np.asarray(layer[name][3]) == 0) and np.all(np.asarray(layer[name][1]) == 0)
            assert np.any(np.asarray(layer[name][0]) != 0) and np.any(np.asarray(layer[name][2]) != 0)


@pytest.mark.parametrize("kw,match", [
    (dict(num_heads=3), "multiple of"), (dict(head_dim=5), "even"),
    (dict(layer_kinds=()), "at least one"), (dict(layer_kinds=("sliding_attention",)), "sliding_window"),
    (dict(vocab_size=0), "vocab_size")])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**kw)


def test_unknown_layer_kind():
    with pytest.raises(ValueError, match="unknown layer kind"):
        model.init_params(tiny_config(layer_kinds=("mamba",)), jax.random.key(0))


def test_bad_chat_messages(default_tokenizer):
    for bad in ([], [{"role": "user"}], "hello", [{"role": "user", "content": 3}]):
        with pytest.raises(ValueError, match="message"):
            default_tokenizer.apply_chat_template(bad)


def test_forward_rejects_gaps_in_a_row_of_positions():
    """The attention kernel reads a row as one run of positions; a gap would put K/V in
    the wrong slots, so it is a ValueError (padding may sit anywhere)."""
    config = tiny_config()
    params = model.init_params(config, jax.random.key(0))
    tokens = jnp.ones((2, 4), jnp.int32)
    ok = jnp.asarray([[-1, 3, 4, 5], [0, 1, -1, -1]])
    model.forward(params, config, tokens, ok, model.init_cache(config, 2, 16))
    with pytest.raises(ValueError, match="positions of row 1 must be consecutive"):
        model.forward(params, config, tokens, jnp.asarray([[0, 1, 2, 3], [0, 2, 3, 4]]),
                      model.init_cache(config, 2, 16))


def test_forward_packed_names_bad_layouts():
    config = tiny_config()
    params = model.init_params(config, jax.random.key(0))
    cache = model.init_cache(config, 2, 16)
    layout = model.RaggedLayout(jnp.asarray([0, 2, 3], jnp.int32), jnp.asarray([2, 1], jnp.int32),
                                None, None, None, 2, 1)
    tokens, positions = jnp.ones(4, jnp.int32), jnp.asarray([0, 1, 0, -1], jnp.int32)
    hidden, _, _ = model.forward_packed(params, config, tokens, positions, cache, layout)
    assert hidden.shape == (4, config.hidden_size)
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        model.forward_packed(params, config, tokens[None], positions[None], cache, layout)
    with pytest.raises(ValueError, match="cu_q_lens"):
        model.forward_packed(params, config, tokens, positions, model.init_cache(config, 3, 16), layout)
    wide = tiny_config(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32)  # KIVI's group
    with pytest.raises(ValueError, match="KIVI"):
        model.forward_packed(model.init_params(wide, jax.random.key(0)), wide, tokens, positions,
                             model.init_cache(wide, 2, 32, kv_cache_dtype="kivi-int4"), layout)


def _tiny_qwen3_copy(tmp_path, keep, architecture="Qwen3ForCausalLM"):
    """tests/model/fixtures/tiny_qwen3 rewritten with only the tensors `keep(name)` accepts."""
    import os

    from safetensors.numpy import load_file, save_file

    from tests.model import golden

    src = os.path.join(golden.FIXTURES, "tiny_qwen3")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if keep(k)}, str(tmp_path / "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "architectures": [architecture]}))
    return str(tmp_path)


def test_qwen3_checkpoint_without_qk_norms_is_refused(tmp_path):
    path = _tiny_qwen3_copy(tmp_path, lambda name: "q_norm" not in name)
    with pytest.raises(ValueError, match=r"lacks.*layer 0 q_norm.*layer 1 q_norm"):
        model.load(path)


def test_qk_norms_in_a_checkpoint_that_does_not_declare_them_are_refused(tmp_path):
    path = _tiny_qwen3_copy(tmp_path, lambda name: True, architecture="LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"layer 0 tensors \['k_norm', 'q_norm'\].*llama"):
        model.load(path)
