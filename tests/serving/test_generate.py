import numpy as np
import pytest

import model
from serving import generate
from serving.generate import Generator


@pytest.fixture()
def generator(default_model, default_tokenizer):
    return Generator(*default_model, default_tokenizer)


@pytest.fixture()
def cli_on_loaded_model(monkeypatch, default_model, default_tokenizer):
    """Run the CLI's own code path on the session's already-loaded model."""
    monkeypatch.setattr(model, "load", lambda source, dtype=None: default_model)
    monkeypatch.setattr(model, "load_tokenizer", lambda source: default_tokenizer)
    monkeypatch.setattr(generate, "COMPILATION_CACHE", None)


def test_cli_answers_paris_streaming(cli_on_loaded_model, capsys):
    generate.main(["What is the capital of France?", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert "Paris" in out
    assert "<|im_end|>" not in out  # stops at EOS, does not print it


def test_cli_raw_completion_and_sampling_is_seeded(cli_on_loaded_model, capsys):
    args = ["The capital of France is", "--raw", "--max-tokens", "6", "--temperature", "0.8",
            "--top-k", "20", "--top-p", "0.9"]
    generate.main(args + ["--seed", "1"])
    first = capsys.readouterr().out
    generate.main(args + ["--seed", "1"])
    assert capsys.readouterr().out == first and first.strip()


@pytest.mark.parametrize("flag,value", [("--max-tokens", "0"), ("--temperature", "-1"),
                                        ("--top-p", "0"), ("--top-p", "1.5"), ("--top-k", "-2")])
def test_cli_rejects_bad_sampling_flags_before_loading(flag, value, monkeypatch, capsys):
    monkeypatch.setattr(model, "load", lambda *a, **k: pytest.fail("loaded a model for bad input"))
    with pytest.raises(SystemExit) as e:
        generate.main(["hi", flag, value])
    assert e.value.code == 2
    assert flag.lstrip("-").replace("-", "_") in capsys.readouterr().err


def test_batched_greedy_equals_single(generator):
    """Right-padding a batch must not change any sequence's greedy tokens."""
    prompts = [generator.prompt_ids(p) for p in
               ("What is the capital of France?", "Name a color.", "Count to five, please, in words.")]
    alone = [generator.generate(p, max_tokens=8, ignore_eos=True) for p in prompts]
    batched = np.stack(list(generator.stream(prompts, max_tokens=8, ignore_eos=True)), axis=1)
    assert batched.tolist() == alone


def test_prompt_past_context_is_rejected(generator):
    ids = [1] * 100
    with pytest.raises(ValueError, match="context"):
        list(generator.stream([ids], max_tokens=generator.config.max_position_embeddings))


@pytest.mark.parametrize("prompts", [[[]], [], [[49152]], [[-1]]])
def test_bad_prompts_are_rejected(generator, prompts):
    with pytest.raises(ValueError):
        list(generator.stream(prompts, max_tokens=4))
