"""The persistent compilation cache LLM turns on (model/compile_cache.py): a second process
loads every step it compiles from disk; `off` leaves no cache behind."""

import json
import os
import subprocess
import sys

import pytest

from model import compile_cache

# A tiny model over the default tokenizer, one greedy generate; prints the jax cache events.
SCRIPT = """
import json, jax
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
import model
from model.config import ModelConfig
from serving import LLM, SamplingParams
config = ModelConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                     head_dim=8, layer_kinds=("attention",) * 2, max_position_embeddings=256, eos_token_id=2)
llm = LLM.from_loaded(config, model.init_params(config, jax.random.key(0)), model.load_tokenizer("default"),
                      max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)
out = llm.generate({"prompt_token_ids": list(range(5, 25))}, SamplingParams(temperature=0, max_tokens=4))
print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses"),
                  "dir": jax.config.jax_compilation_cache_dir, "tokens": out[0].outputs[0].token_ids}))
"""


def _run(value):
    env = {**os.environ, compile_cache.ENV: value}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_nothing(tmp_path):
    path = str(tmp_path / "cache")
    first, second = _run(path), _run(path)
    assert first["dir"] == second["dir"] == path
    assert first["misses"] > 0 and os.listdir(path)
    assert second["misses"] == 0 and second["hits"] == first["misses"]
    assert second["tokens"] == first["tokens"]


def test_off_means_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    result = _run("off")
    assert result["dir"] is None and result["hits"] == result["misses"] == 0
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("value,want", [(None, "HOME/kvfold/jax"), ("off", None), ("0", None), ("", None),
                                        ("None", None), ("~/elsewhere", "~/elsewhere")])
def test_the_variable_moves_or_disables_the_cache(monkeypatch, value, want):
    monkeypatch.setenv("XDG_CACHE_HOME", "HOME")
    if value is None:
        monkeypatch.delenv(compile_cache.ENV, raising=False)
    else:
        monkeypatch.setenv(compile_cache.ENV, value)
    assert compile_cache.configured_dir() == (os.path.expanduser(want) if want else None)
