"""LoRA adapters on the functional model against PEFT's own logits (committed fixtures
made by tests/model/golden.py with peft), per token routed and merged."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import model
from model import lora
from tests.model import golden
from tests.model.test_hf_parity import run_full, tiny_path

ADAPTERS = sorted(golden.LORA_ADAPTERS)


def adapter_path(name: str) -> str:
    return os.path.join(tiny_path("llama"), f"lora_{name}")


@pytest.fixture(scope="module")
def base():
    return model.load(tiny_path("llama"))


def peft_logits(name):
    ref = np.load(os.path.join(adapter_path(name), "logits.npz"))
    return ref["tokens"], ref["logits"]


def test_each_adapter_routed_per_token_matches_peft(base):
    config, params = base
    stacks = lora.init_stacks(config, num_slots=3, rank=8)
    for slot, name in enumerate(ADAPTERS):
        stacks = lora.write_slot(stacks, slot + 1, lora.load_peft_adapter(adapter_path(name), config))
    base_logits = np.load(os.path.join(tiny_path("llama"), "logits.npz"))["logits"]
    for slot, name in enumerate(ADAPTERS):
        tokens, want = peft_logits(name)
        assert np.abs(want - base_logits).max() > 0.1  # the adapter changes the model
        routed = lora.attach(params, stacks, jnp.full(tokens.shape, slot + 1, jnp.int32))
        np.testing.assert_allclose(run_full(config, routed, tokens), want, atol=1e-3, rtol=0)


def test_a_batch_mixing_adapters_and_the_base_matches_each_alone(base):
    config, params = base
    stacks = lora.init_stacks(config, num_slots=2, rank=8)
    for slot, name in enumerate(ADAPTERS):
        stacks = lora.write_slot(stacks, slot, lora.load_peft_adapter(adapter_path(name), config))
    tokens, want_all = peft_logits("all")
    _, want_qv = peft_logits("qv_rslora")
    base_logits = np.load(os.path.join(tiny_path("llama"), "logits.npz"))["logits"]
    # row 0: "all" on its first half, the base on its second; row 1: "qv_rslora"
    slots = np.zeros(tokens.shape, np.int32)
    slots[0, tokens.shape[1] // 2:] = -1
    slots[1] = 1
    got = run_full(config, lora.attach(params, stacks, jnp.asarray(slots)), tokens)
    np.testing.assert_allclose(got[1], want_qv[1], atol=1e-3, rtol=0)
    half = tokens.shape[1] // 2  # causal: the first half saw only "all" tokens
    np.testing.assert_allclose(got[0, :half], want_all[0, :half], atol=1e-3, rtol=0)
    assert np.abs(got[0, half:] - want_all[0, half:]).max() > 1e-2
    assert np.abs(got[0, half:] - base_logits[0, half:]).max() > 1e-2


@pytest.mark.parametrize("name", ADAPTERS)
def test_merged_weights_match_peft(base, name):
    config, params = base
    merged = lora.merge(params, lora.load_peft_adapter(adapter_path(name), config))
    tokens, want = peft_logits(name)
    np.testing.assert_allclose(run_full(config, merged, tokens), want, atol=1e-3, rtol=0)


def test_save_peft_adapter_round_trips(base, tmp_path):
    config, _ = base
    adapter = lora.load_peft_adapter(adapter_path("all"), config)
    tensors = load_file(os.path.join(adapter_path("all"), "adapter_model.safetensors"))
    peft_layout = {}
    for (layer, name), _ in adapter.weights.items():
        module = next(m for m, n in lora.PEFT_MODULES.items() if n == name)
        key = f"base_model.model.model.layers.{layer}.{module}"
        peft_layout[(layer, name)] = (tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"])
    lora.save_peft_adapter(str(tmp_path / "copy"), peft_layout, r=4, lora_alpha=8)
    again = lora.load_peft_adapter(str(tmp_path / "copy"), config)
    assert again.weights.keys() == adapter.weights.keys() and again.rank == adapter.rank
    for key, (a, b) in adapter.weights.items():
        np.testing.assert_array_equal(again.weights[key][0], a)
        np.testing.assert_array_equal(again.weights[key][1], b)


def _edited(tmp_path, source="all", config_edit=None, tensor_edit=None):
    path = tmp_path / "adapter"
    shutil.copytree(adapter_path(source), path)
    if config_edit:
        cfg = json.loads((path / "adapter_config.json").read_text())
        config_edit(cfg)
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    if tensor_edit:
        tensors = load_file(str(path / "adapter_model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("edit,match", [
    (dict(config_edit=lambda c: c.update(use_dora=True)), "DoRA"),
    (dict(config_edit=lambda c: c.update(bias="all")), "bias"),
    (dict(config_edit=lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save"),
    (dict(config_edit=lambda c: c.update(r=0)), "positive 'r'"),
    (dict(tensor_edit=lambda t: t.update({KEY: np.zeros((4, 32), np.float32)})), "another base model"),
    (dict(tensor_edit=lambda t: t.update({"base_model.model.lm_head.lora_A.weight":
                                          np.zeros((4, 64), np.float32)})), "not a LoRA A/B"),
    (dict(tensor_edit=lambda t: t.pop(KEY)), "without its partner"),
    (dict(tensor_edit=lambda t: t.update({KEY.replace("layers.0", "layers.7"): t[KEY]})), "layer 7"),
])
def test_bad_adapters_are_clear_errors(base, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        lora.load_peft_adapter(_edited(tmp_path, **edit), base[0])


def test_missing_files_and_too_high_a_rank_are_clear_errors(base, tmp_path):
    config, _ = base
    with pytest.raises(ValueError, match="not a directory"):
        lora.load_peft_adapter(str(tmp_path / "nowhere"), config)
    with pytest.raises(ValueError, match="lacks"):
        lora.load_peft_adapter(str(tmp_path), config)
    adapter = lora.load_peft_adapter(adapter_path("qv_rslora"), config)  # rank 8
    with pytest.raises(ValueError, match="max_lora_rank"):
        lora.write_slot(lora.init_stacks(config, 1, 4), 0, adapter)
