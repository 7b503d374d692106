"""Triton compiles counted, and logged by name once the engine serves (the hooks called as Triton calls them)."""

from __future__ import annotations

import logging
import types

from peagle.kernels.compile_watch import CompileWatch


def _fn(name, *params):
    jit = types.SimpleNamespace(params=[types.SimpleNamespace(name=p) for p in params])
    return types.SimpleNamespace(name=name, jit_function=jit, module="m")


def _compile(watch, fn, constants):
    watch._before(key="k", fn=fn)
    watch._after(key="k", fn=fn, compile={"key": "k", "constants": constants})


def test_compiles_before_serving_are_counted_quietly_and_after_it_logged_by_name(caplog):
    watch = CompileWatch()
    fn = _fn("_paged_attention_kernel", "q_ptr", "out_ptr", "BLOCK_M", "NUM_SPLITS")
    with caplog.at_level(logging.WARNING, logger="peagle.kernels.compile_watch"):
        _compile(watch, fn, {(2,): 16, (3,): 1})
        assert caplog.records == []
        watch.serving()
        _compile(watch, fn, {(2,): 64, (3,): 4})
    assert (watch.count, watch.serving_count) == (2, 1)
    [record] = caplog.records
    assert "variant while serving: _paged_attention_kernel" in record.getMessage()
    assert "BLOCK_M=64, NUM_SPLITS=4" in record.getMessage()


def test_install_keeps_the_hooks_set_before():
    from triton import knobs
    calls = []
    saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    knobs.runtime.jit_cache_hook = lambda **kw: calls.append("before")
    knobs.runtime.jit_post_compile_hook = lambda **kw: calls.append("after")
    try:
        watch = CompileWatch()
        assert watch.install()
        knobs.runtime.jit_cache_hook(key="k", fn=_fn("f"))
        knobs.runtime.jit_post_compile_hook(key="k", fn=_fn("f"), compile={"constants": {}})
        assert calls == ["before", "after"] and watch.count == 1
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved
