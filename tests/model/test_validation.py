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
