"""The CLI, end to end on the engine (with the session's already-loaded default model)."""

import pytest

import model
from serving import generate


@pytest.fixture()
def cli_on_loaded_model(monkeypatch, default_model, default_tokenizer):
    monkeypatch.setattr(model, "load", lambda source, dtype=None, weights_dtype=None, seed=0: default_model)
    monkeypatch.setattr(model, "load_tokenizer", lambda source: default_tokenizer)


def test_cli_answers_paris_streaming(cli_on_loaded_model, capsys):
    generate.main(["What is the capital of France?", "--max-tokens", "16", "--max-model-len", "256"])
    out = capsys.readouterr().out
    assert "Paris" in out
    assert "<|im_end|>" not in out  # stops at EOS, does not print it


def test_cli_raw_sampling_is_seeded(cli_on_loaded_model, capsys):
    args = ["The capital of France is", "--raw", "--max-tokens", "6", "--temperature", "0.8",
            "--top-k", "20", "--top-p", "0.9", "--max-model-len", "256"]
    generate.main(args + ["--seed", "1"])
    first = capsys.readouterr().out
    generate.main(args + ["--seed", "1"])
    assert capsys.readouterr().out == first and first.strip()
    generate.main(args + ["--seed", "1", "--num-scheduler-steps", "4"])  # decode steps run 4 per call
    assert capsys.readouterr().out == first


@pytest.mark.parametrize("flag,value", [("--max-tokens", "0"), ("--temperature", "-1"),
                                        ("--top-p", "0"), ("--top-p", "1.5"), ("--top-k", "-2")])
def test_cli_rejects_bad_sampling_flags_before_loading(flag, value, monkeypatch, capsys):
    monkeypatch.setattr(model, "load", lambda *a, **k: pytest.fail("loaded a model for bad input"))
    with pytest.raises(SystemExit) as e:
        generate.main(["hi", flag, value])
    assert e.value.code == 2
    assert flag.lstrip("-").replace("-", "_") in capsys.readouterr().err


def test_cli_rejects_bad_speculative_config_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(model, "load", lambda *a, **k: pytest.fail("loaded a model for bad input"))
    with pytest.raises(SystemExit) as e:
        generate.main(["hi", "--speculative-config", "{method: eagle3}"])
    assert e.value.code == 2 and "--speculative-config is not JSON" in capsys.readouterr().err


def test_cli_weights_dtype_reaches_the_loader(monkeypatch, default_model, default_tokenizer, capsys):
    seen = []
    monkeypatch.setattr(model, "load", lambda source, dtype=None, weights_dtype=None, seed=0:
                        seen.append(weights_dtype) or default_model)
    monkeypatch.setattr(model, "load_tokenizer", lambda source: default_tokenizer)
    generate.main(["Hi", "--max-tokens", "2", "--max-model-len", "256", "--weights-dtype", "gguf"])
    assert seen == ["gguf"]
    with pytest.raises(SystemExit) as e:
        generate.main(["Hi", "--weights-dtype", "int3"])
    assert e.value.code == 2 and "weights-dtype" in capsys.readouterr().err


def test_cli_without_a_chat_template_asks_for_raw(monkeypatch, default_model, default_tokenizer, capsys):
    """A base model (no chat template in its file, as Gemma 3 270M's GGUF) is a usage error
    naming --raw unless the prompt is raw."""
    from model.tokenizer import Tokenizer

    bare = Tokenizer(default_tokenizer._tok, None, default_tokenizer.bos_token_id, default_tokenizer.eos_token_id)
    monkeypatch.setattr(model, "load", lambda source, dtype=None, weights_dtype=None, seed=0: default_model)
    monkeypatch.setattr(model, "load_tokenizer", lambda source: bare)
    with pytest.raises(SystemExit) as e:
        generate.main(["Hi", "--max-model-len", "256"])
    assert e.value.code == 2 and "--raw" in capsys.readouterr().err
    generate.main(["The capital of France is", "--raw", "--max-tokens", "2", "--max-model-len", "256"])
    assert capsys.readouterr().out.strip()
