"""The tests' forked ``python`` (tests/python_runner.py) gives what a fresh interpreter gives: the entry points' outputs
and exit statuses that the other tests check are those a user would see."""

import os
import pathlib
import subprocess
import sys

import pytest

import python_runner

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = """
import os, sys, tempfile
print(sys.argv[1:], sys.path, os.getcwd(), os.environ.get("GLM53_RUNNER_PROBE"), tempfile.gettempdir())
import jax
print(jax.device_count() > 0, flush=True)
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["raise"]:
    raise ValueError("raised")
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else "a message")
"""


@pytest.mark.parametrize("args", [
    ["-m", "experiments.plan", "--history=abc"],  # absl's usage error: one line, status 1
    ["-m", "experiments.capacity", "--config=configs/tiny.py", "--history=100"],  # a full run, status 0
    ["-c", SCRIPT, "3"], ["-c", SCRIPT, "raise"], ["-c", SCRIPT, "message"]])
def test_a_forked_run_gives_what_a_fresh_interpreter_gives(args, tmp_path):
    # a PYTHONPATH of the run's own (a relative entry and an empty one: both are the working directory's)
    # and a temp directory of its own (TMPDIR)
    env = {**os.environ, "GLM53_RUNNER_PROBE": "set", "TMPDIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(["tests", "", os.environ.get("PYTHONPATH", "")])}
    real = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    forked = python_runner.run(args, cwd=ROOT, env=env, timeout=300)
    assert forked.returncode == real.returncode and forked.stdout == real.stdout, (forked, real)
    if args[-1] == "raise":  # the same traceback but the frames that ran the code
        assert forked.stderr.startswith("to stderr\nTraceback (most recent call last):\n")
        assert forked.stderr.endswith('  File "<string>", line 8, in <module>\nValueError: raised\n'), forked.stderr
        assert real.stderr.endswith('  File "<string>", line 8, in <module>\nValueError: raised\n'), real.stderr
    else:
        assert forked.stderr == real.stderr


def test_a_run_past_its_timeout_is_killed_and_the_next_runs():
    with pytest.raises(subprocess.TimeoutExpired) as e:
        python_runner.run(["-c", "import time; print('started', flush=True); time.sleep(60)"], timeout=3)
    assert e.value.stdout == b"started\n"  # bytes, as subprocess.run's own TimeoutExpired has them
    assert python_runner.run(["-c", "print('next')"], timeout=60).stdout == "next\n"


def test_another_jax_environment_runs_a_real_interpreter():
    """JAX reads JAX_* when imported: a run asking for other values cannot be a fork of the server."""
    env = {**os.environ, "JAX_ENABLE_X64": "1"}
    p = python_runner.run(["-c", "import jax.numpy as jnp; print(jnp.zeros(1).dtype)"], env=env, timeout=120)
    assert p.returncode == 0 and p.stdout == "float64\n", p


def test_xla_flags_of_its_own_reach_a_forked_run():
    """XLA reads XLA_FLAGS when the run starts its backend, so a run may have its own (the planner's device count)."""
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=16", "")
    env = {**os.environ, "XLA_FLAGS": flags + " --xla_force_host_platform_device_count=3"}
    p = python_runner.run(["-c", "import jax; print(jax.device_count())"], env=env, timeout=120)
    assert p.returncode == 0 and p.stdout == "3\n", p
