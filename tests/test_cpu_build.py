"""``cp-attn build`` (the ahead-of-time build of the C++ CPU kernels) and the logged fallbacks."""
from __future__ import annotations

import logging

import pytest

from cp_attention.launch import demo
from cp_attention.ops import ReferenceOps, cpu_build, get_ops


@pytest.fixture
def fresh_loader():
    """load_cpu_extension without its per-process cache, restored afterwards."""
    cpu_build.load_cpu_extension.cache_clear()
    yield
    cpu_build.load_cpu_extension.cache_clear()


def test_cp_attn_build_reports_the_built_module(cpu_ops, capsys):
    """With the kernels built (the cpu_ops fixture), `cp-attn build` only loads them and says
    where they are; exit status 0."""
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["build"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "already built" in out and str(cpu_build.extension_path()) in out


def _failing_build(monkeypatch):
    def load(**kwargs):
        raise RuntimeError("Error building extension: g++: error: no such compiler")
    monkeypatch.setattr(cpu_build, "_load_built", lambda name: None)
    monkeypatch.setattr(cpu_build, "load", load)


def test_failed_build_is_logged_with_its_reason(monkeypatch, caplog, fresh_loader):
    """A server operator sees the fallback in the log (warnings are often filtered): a warning
    on the cp_attention logger naming the compiler's error, and get_ops falls back."""
    _failing_build(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="cp_attention"), \
            pytest.warns(RuntimeWarning, match="no such compiler"):
        assert isinstance(get_ops("cpu"), ReferenceOps)
    messages = [r.getMessage() for r in caplog.records if r.name == "cp_attention"]
    assert any("compiling the C++ CPU attention kernels now" in m for m in messages)
    assert any("failed" in m and "no such compiler" in m and "ReferenceOps" in m
               for m in messages)


def test_cp_attn_build_fails_loudly(monkeypatch, capsys, fresh_loader):
    _failing_build(monkeypatch)
    assert cpu_build.build_main([]) == 1
    assert "FAILED" in capsys.readouterr().err


def test_forced_reference_is_logged(monkeypatch, caplog, capsys, fresh_loader):
    monkeypatch.setenv(cpu_build.FORCE_ENV, "reference")
    with caplog.at_level(logging.INFO, logger="cp_attention"):
        assert isinstance(get_ops("cpu"), ReferenceOps)
    assert any(cpu_build.FORCE_ENV in r.getMessage() for r in caplog.records)
    assert cpu_build.build_main([]) == 0
    assert "nothing built" in capsys.readouterr().out


def test_a_build_leaves_the_extension_name_unchanged(monkeypatch, tmp_path):
    """cpp_extension's load() appends its own flags to the flag lists it is given; had it been
    handed ours, the name (a hash of the flags) would change after a first build and a later
    load in the same process would build and register a second library (an abort)."""
    before = cpu_build.extension_path()

    def load_appending_flags(**kwargs):
        kwargs["extra_cflags"].append("-fPIC")
        kwargs["extra_ldflags"].append("-ltorch")

    monkeypatch.setattr(cpu_build, "load", load_appending_flags)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    cpu_build._compile("cp_attention_cpu_flags_test", [])
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert cpu_build.extension_path() == before
