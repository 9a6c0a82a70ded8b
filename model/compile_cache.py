"""JAX's persistent compilation cache, on by default for the serving entry points (and
model.kv_eval).

A warm engine never recompiles within a process, but every new process used to compile
its step shapes again: on this project's 2-core CPU the first `LLM("default").chat(...)`
of 32 tokens took 9.8 s, against 2.9 s when the same 17 executables came from the cache.
`LLM` turns the cache on when it is built, in a user directory:

- `KVFOLD_COMPILE_CACHE=DIR` moves it; `KVFOLD_COMPILE_CACHE=off` (or 0, none, false, or
  empty) disables it; the `--compile-cache-dir` flag of `kvfold serve` and
  `python -m serving.generate` sets the variable for the process.
- Default: `$XDG_CACHE_HOME/kvfold/jax`, else `~/.cache/kvfold/jax`.
- A directory the user already gave jax (`jax_compilation_cache_dir`) is left alone.

Every executable is cached, however fast it compiled (jax's default skips those under a
second, which on CPU is most of an engine's step shapes).
"""

from __future__ import annotations

import os

ENV = "KVFOLD_COMPILE_CACHE"
OFF = ("", "0", "off", "none", "false")


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvfold", "jax")


def configured_dir() -> str | None:
    """The directory KVFOLD_COMPILE_CACHE asks for (the default when unset), or None when
    it disables the cache."""
    value = os.environ.get(ENV)
    if value is None:
        return default_dir()
    return None if value.strip().lower() in OFF else os.path.expanduser(value)


def enable() -> str | None:
    """Point jax's persistent cache at configured_dir() unless jax already has a cache
    directory; returns the directory in use (None: no persistent cache)."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = configured_dir()
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"the compilation cache directory {path!r} cannot be created ({e}); set "
                         f"{ENV}=off or another directory") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
