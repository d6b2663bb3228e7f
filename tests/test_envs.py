"""cp_attention.envs: one parsing rule, errors that name the variable, the docs table current,
and no other module of the package reading the environment."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cp_attention import envs

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "envs.md"


@pytest.mark.parametrize("raw, value", [("1", True), ("true", True), (" Yes ", True), ("ON", True),
                                        ("0", False), ("false", False), ("no", False),
                                        ("Off", False), ("", False)])
def test_one_boolean_rule(monkeypatch, raw, value):
    for name, variable in envs.VARIABLES.items():
        if variable.kind == "bool":
            monkeypatch.setenv(name, raw)
            assert getattr(envs, name) is value


@pytest.mark.parametrize("name", [n for n, v in envs.VARIABLES.items() if v.kind == "bool"])
def test_unparsable_boolean_names_the_variable(monkeypatch, name):
    monkeypatch.setenv(name, "2")
    with pytest.raises(envs.EnvError, match=rf"^{name}='2' is not a boolean"):
        getattr(envs, name)


def test_defaults_when_unset(monkeypatch):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert envs.CP_ATTENTION_DEBUG is False and envs.CP_ATTENTION_VLLM_REORDER is True
    assert envs.CP_ATTENTION_OPS == "auto" and envs.VLLM_DIST_IDENT is None
    assert envs.CP_ATTENTION_CACHE == Path.home() / ".cache" / "cp_attention"


def test_choice_and_path(monkeypatch):
    monkeypatch.setenv("CP_ATTENTION_OPS", " Reference ")
    assert envs.CP_ATTENTION_OPS == "reference"
    monkeypatch.setenv("CP_ATTENTION_OPS", "")
    assert envs.CP_ATTENTION_OPS == "auto"
    monkeypatch.setenv("CP_ATTENTION_OPS", "fast")
    with pytest.raises(envs.EnvError, match=r"^CP_ATTENTION_OPS='fast' must be one of 'auto', "):
        envs.CP_ATTENTION_OPS
    monkeypatch.setenv("CP_ATTENTION_CACHE", "~/x")
    assert envs.CP_ATTENTION_CACHE == Path.home() / "x"


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="CP_ATTENTION_NOPE"):
        envs.CP_ATTENTION_NOPE


def test_overridden_restores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("CP_TEST_UNSET", raising=False)
    with envs.overridden(OMP_NUM_THREADS="1", CP_TEST_UNSET="x"):
        import os
        assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["CP_TEST_UNSET"] == "x"
    assert os.environ["OMP_NUM_THREADS"] == "7" and "CP_TEST_UNSET" not in os.environ


def test_docs_table_is_current():
    assert envs.markdown_table() in DOC.read_text(), (
        "docs/envs.md is stale: regenerate its table with "
        "`python -c 'from cp_attention import envs; print(envs.markdown_table())'`")


def test_only_envs_and_launch_read_the_environment():
    """The package reads variables through envs alone; launch/ reads torchrun's own."""
    readers = {p.relative_to(ROOT).as_posix() for p in (ROOT / "cp_attention").rglob("*.py")
               if re.search(r"os\.environ|os\.getenv|getenv\(", p.read_text())}
    assert readers == {"cp_attention/envs.py", "cp_attention/launch/torchrun_main.py",
                       "cp_attention/launch/device.py"}


def test_every_named_variable_is_registered():
    """Each CP_ATTENTION_* name the package, tests, CI or docs mention is in envs.VARIABLES."""
    names: set[str] = set()
    files = [*ROOT.glob("cp_attention/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md",
             *ROOT.glob(".ci/*")]
    for path in files:
        names |= set(re.findall(r"\bCP_ATTENTION_[A-Z_]*[A-Z]\b", path.read_text()))
    assert names - set(envs.VARIABLES) == set()
