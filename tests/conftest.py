import os

import pytest

# Compile once across test runs on CPU.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))


@pytest.fixture(scope="session")
def default_model():
    """(config, params) of the embedded SmolLM2-135M-Instruct, loaded once per session."""
    import model

    return model.load("default")


@pytest.fixture(scope="session")
def default_tokenizer():
    import model

    return model.load_tokenizer("default")
