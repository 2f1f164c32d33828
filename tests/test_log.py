"""Logging: the compile path logs through ``logging`` under ``mori_jit``; MORI_JIT_VERBOSE maps to levels."""
from __future__ import annotations

import logging

import pytest

from mori_jit.examples.axpy_spec import AXPY, AxpyCfg
from mori_jit.jit.compile import build
from mori_jit.jit.log import LOGGER_NAME, apply_verbosity, level_for
from mori_jit.jit.toolchain import make_toolchain


@pytest.fixture(autouse=True)
def _logger_as_found():
    yield
    logger = logging.getLogger(LOGGER_NAME)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True


def test_levels():
    assert [level_for(v) for v in (0, 1, 2, 3)] == [logging.WARNING, logging.INFO, logging.DEBUG, logging.DEBUG]


def _build(blocks: int):
    cfg = AxpyCfg(blockNum=blocks)
    return AXPY.entry_name(cfg), build(AXPY, cfg, make_toolchain("sm_90a"))


def test_verbose_1_logs_compiles_to_stderr(fake_cc, capsys, monkeypatch):
    monkeypatch.setenv("MORI_JIT_VERBOSE", "1")
    name, _ = _build(3)
    err = capsys.readouterr().err
    assert f"[mori-jit] compiling {name} for sm_90a\n" in err
    assert str(fake_cc.nvcc) not in err and "hit" not in err  # commands and hits are DEBUG
    _build(3)
    assert capsys.readouterr().err == ""


def test_verbose_2_adds_commands_and_hits(fake_cc, capsys, monkeypatch):
    monkeypatch.setenv("MORI_JIT_VERBOSE", "2")
    name, entry = _build(5)
    err = capsys.readouterr().err
    assert f"[mori-jit] {fake_cc.nvcc} --cubin" in err and f"[mori-jit] compiling {name}" in err
    _build(5)
    assert capsys.readouterr().err == f"[mori-jit] hit {entry.path.name}\n"


def test_silent_by_default_and_after_the_variable_goes(fake_cc, capsys, monkeypatch):
    _build(7)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("MORI_JIT_VERBOSE", "1")
    _build(8)
    assert "[mori-jit] compiling" in capsys.readouterr().err
    monkeypatch.delenv("MORI_JIT_VERBOSE")
    _build(9)
    assert capsys.readouterr().err == ""
    logger = logging.getLogger(LOGGER_NAME)
    assert logger.handlers == [] and logger.propagate and logger.level == logging.NOTSET


def test_an_applications_logging_gets_the_records(fake_cc, caplog, capsys):
    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    name, _ = _build(11)
    got = [(r.name, r.levelno) for r in caplog.records]
    assert ("mori_jit.jit.compile", logging.INFO) in got and ("mori_jit.jit.compile", logging.DEBUG) in got
    assert any(r.getMessage() == f"compiling {name} for sm_90a" for r in caplog.records)
    assert capsys.readouterr().err == "" and apply_verbosity().handlers == []  # no handler of ours


def test_an_applications_own_handler_is_kept(fake_cc, capsys, monkeypatch):
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logging.getLogger(LOGGER_NAME).addHandler(handler)
    monkeypatch.setenv("MORI_JIT_VERBOSE", "1")
    name, _ = _build(13)
    assert [r.getMessage() for r in seen] == [f"compiling {name} for sm_90a"]
    assert capsys.readouterr().err == ""
