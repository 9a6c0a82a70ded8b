"""Counting XLA compilations, for tests that a warm engine compiles nothing."""

import contextlib

import jax


@contextlib.contextmanager
def counting():
    """Yields a list that collects one entry per backend compilation inside the block
    (jax's backend_compile_duration events: the persistent cache's hits are not counted)."""
    events = []

    def listener(name, secs, **kw):
        if name.endswith("backend_compile_duration"):
            events.append(name)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
