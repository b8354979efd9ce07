"""The env registry through Python: a bad MAGI_ATTENTION_* value is a ValueError naming the variable and the
allowed values (before anything runs), and env_table lists every variable."""
from __future__ import annotations

import os
import subprocess
import sys

import magi_attn as ma

SNIPPET = """
import numpy as np, magi_attn as ma
q = np.zeros((8, 1, 8))
try:
    ma.forward(ma.masks.full(8), q, q, q)
except ValueError as e:
    print("ValueError:", e)
"""


def _run(env_value: str) -> str:
    env = {"MAGI_ATTENTION_DETERMINISTIC_MODE": env_value, "PATH": "/usr/bin:/bin"}
    if "PYTHONPATH" in os.environ:  # a package not installed but put on the path
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, timeout=120).stdout


def test_bad_value_is_a_value_error_naming_the_variable():
    text = _run("maybe")
    assert "ValueError:" in text and "MAGI_ATTENTION_DETERMINISTIC_MODE" in text and "0" in text and "1" in text


def test_value_that_is_not_utf8_is_shown_escaped():
    text = _run("\udcff")  # the byte 0xff (surrogateescape): the message shows it, not a UnicodeDecodeError
    assert "ValueError:" in text and "MAGI_ATTENTION_DETERMINISTIC_MODE=\\xff" in text, text


def test_good_value_runs():
    assert "ValueError" not in _run("1")


def test_env_table_lists_the_registry():
    table = ma.env_table()
    for name in ("MAGI_ATTENTION_DETERMINISTIC_MODE", "MAGI_ATTENTION_BUILD_COMPUTE_CAPABILITY", "MAX_JOBS"):
        assert name in table
    assert ma.build_info()["version"] == ma.__version__
