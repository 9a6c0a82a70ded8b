"""The KV format evaluation's pieces: fixed text, needle prompts, and the measured columns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import kv_eval, kv_formats
from model.config import ModelConfig


def test_documentation_text_is_fixed(default_tokenizer):
    ids = kv_eval.documentation_ids(default_tokenizer, 300)
    assert len(ids) == 300 and ids == kv_eval.documentation_ids(default_tokenizer, 400)[:300]
    assert default_tokenizer.decode(ids).startswith('The "assert" statement')
    with pytest.raises(ValueError, match="asked for"):
        kv_eval.documentation_ids(default_tokenizer, 10 ** 8)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_example_has_the_length_and_the_needle_at_its_depth(default_tokenizer, depth):
    tok = default_tokenizer
    prompt, answer = kv_eval.needle_example(tok, 256, depth, 4817)
    assert len(prompt) + len(answer) == 256
    assert tok.decode(answer) == " 4817"
    text = tok.decode(prompt)
    assert text.rstrip().endswith("The secret number is")
    at = text.index("The secret number is 4817.")
    hay_start, hay_end = text.index('The "assert"'), text.index("What is the secret number")
    assert abs((at - hay_start) / (hay_end - hay_start) - depth) < 0.1
    with pytest.raises(ValueError, match="no room"):
        kv_eval.needle_example(tok, 40, depth, 4817)


def test_evaluate_rows_on_a_tiny_model(default_tokenizer):
    tok = default_tokenizer
    config = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_heads=2,
                         num_kv_heads=1, head_dim=32, layer_kinds=("attention", "sliding_attention"),
                         max_position_embeddings=256, sliding_window=40)
    params = model.init_params(config, jax.random.key(0))
    rows = {r["kv_cache_dtype"]: r for r in kv_eval.evaluate(config, params, tok, ("float32", "int8"), 96)}

    ids = jnp.asarray([kv_eval.documentation_ids(tok, 96)])
    logits, _ = model.forward(params, config, ids, jnp.arange(96)[None], model.init_cache(config, 1, 96))
    logp = jax.nn.log_softmax(logits[0, :-1], axis=-1)
    ppl = float(jnp.exp(-jnp.mean(jnp.take_along_axis(logp, ids[0, 1:, None], axis=-1))))
    base, int8 = rows["float32"], rows["int8"]
    assert base["ppl"] == pytest.approx(ppl, rel=1e-4)
    assert base["dppl"] == 0 and base["attn_err"] == 0
    # int8 rows: |err| <= absmax / 254, a relative row error of at most sqrt(32) / 254.
    assert 0 < int8["attn_err"] < 32 ** 0.5 / 254
    assert int8["bytes_per_token"] == kv_formats.bytes_per_token("int8", config) == 2 * 2 * 36
    assert int8["ppl"] == pytest.approx(ppl, rel=1e-2)
    # A random model does not know the secret numbers: a column that compared nothing
    # (np.all over an empty slice) or the prompt with itself would read 1 here.
    assert base["needle"] == int8["needle"] == 0


def test_default_model_finds_every_needle(default_model, default_tokenizer):
    """SmolLM2-135M repeats the secret number at every depth of a 128-token prompt (float32
    cache): a needle column that reads the greedy tokens at the wrong positions, or compares
    them with the wrong answer, gives 0 here."""
    config, params = default_model
    (row,) = kv_eval.evaluate(config, params, default_tokenizer, ("float32",), 128)
    assert row["needle"] == 1


def test_relative_error():
    want = np.random.default_rng(0).standard_normal((3, 4, 5))
    np.testing.assert_allclose(kv_eval.relative_error(want * 1.01, want), 0.01)
    assert np.all(kv_eval.relative_error(want, want) == 0)


def test_too_short_or_needleless_runs_are_clear_errors(default_tokenizer, capsys):
    config = ModelConfig(vocab_size=default_tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
                         num_heads=2, num_kv_heads=1, head_dim=32, layer_kinds=("attention",),
                         max_position_embeddings=256)
    params = model.init_params(config, jax.random.key(0))
    with pytest.raises(ValueError, match="at least one"):
        next(kv_eval.evaluate(config, params, default_tokenizer, ("float32",), 96, needles=()))
    with pytest.raises(SystemExit):
        kv_eval.main(["--tokens", "64", "--formats", "int8"])
    assert "too short for the needle prompts" in capsys.readouterr().err


def test_plot_rows_writes_a_png_and_leaves_pyplots_backend(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    before = matplotlib.get_backend()
    matplotlib.use("pdf")
    try:
        rows = [dict(kv_cache_dtype=name, dppl=d, needle=1.0, bytes_per_token=b)
                for name, d, b in (("float32", 0.0, 512), ("int8", 0.01, 136))]
        path = tmp_path / "kv_eval.png"
        kv_eval.plot_rows(str(path), "a title", rows, 512)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.get_backend() == "pdf"
    finally:
        matplotlib.use(before)


def test_each_format_is_scored_with_the_keys_llm_stores(default_tokenizer, monkeypatch):
    """Whatever the order of formats, each is scored over the params LLM would run it with:
    centered for CENTERED_FORMATS, in key bases for BASIS_FORMATS only, each of its kind (the
    scoring itself is stubbed: this checks which params reach it)."""
    from model import key_centers

    tok = default_tokenizer
    config = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_heads=2,
                         num_kv_heads=1, head_dim=32, layer_kinds=("attention",), max_position_embeddings=256)
    params = model.init_params(config, jax.random.key(0))
    seen = {}

    def score(run, config, tokens, name, answer_len):
        seen[name] = run
        b, t = tokens.shape
        return jnp.zeros(t - 1), jnp.zeros((b - 1, answer_len), jnp.int32), jnp.ones((1, t, 32))
    monkeypatch.setattr(kv_eval, "_score", score)
    monkeypatch.setattr(kv_eval, "attention_outputs", lambda run, config, residuals, name: residuals)
    names = ("int8", "turboquant-3.5", "nvfp4", "turboquant-2.5", "fp8")
    list(kv_eval.evaluate(config, params, tok, names, 96))
    for name in names:
        layer = seen[name]["layers"][0]
        assert ("k_center" in layer) == (name in key_centers.CENTERED_FORMATS), name
        assert ("k_basis" in layer) == (name in key_centers.BASIS_FORMATS), name
    for name in ("turboquant-2.5", "nvfp4"):  # a balanced basis, a sink reflection: not one for both
        want = key_centers.for_kv_cache(params, config, tok, name)["layers"][0]["k_basis"]
        np.testing.assert_array_equal(seen[name]["layers"][0]["k_basis"], want)
