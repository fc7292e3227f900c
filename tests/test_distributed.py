"""Several processes: experiments.launch starts 2 processes x 8 CPU devices on localhost (gloo collectives), the
mesh spans all 16, and experiments.generate runs unchanged: tokens equal to one process on one device, offload
bit-identical to resident across the processes."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from glm53 import distributed
from glm53.config import ConfigError
from experiments.launch import xla_flags_with_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = ["--config=configs/tiny.py", "--config.model.num_attention_heads=16", "--config.dtype=float32",
        "--config.run.prompt_len=40", "--config.run.max_new_tokens=6", "--noroofline"]


def _run(cmd, env=None):
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    return p


@pytest.mark.slow  # by default the 2 x 2 run of test_save_and_restore_across_two_processes covers several processes
def test_two_processes_of_eight_devices_match_one_device(tmp_path):
    one = tmp_path / "one.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    _run([sys.executable, "-m", "experiments.generate", *ARGS, f"--config.run.output_json={one}"], env)
    two = tmp_path / "two.json"
    p = _run([sys.executable, "-m", "experiments.launch", "--processes=2", "--devices_per_process=8", "--",
              sys.executable, "-m", "experiments.generate", *ARGS, "--config.mesh.tp=16", "--config.cache.mode=offload",
              "--config.run.compare_resident=True", f"--config.run.output_json={two}"], env)
    assert "[launch] exit codes [0, 0]" in p.stdout and "[p1]" in p.stdout
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert b["tokens"] == a["tokens"]
    assert b["figures"]["comparison"]["tokens_identical"] and b["figures"]["comparison"]["logits_bit_identical"]
    assert b["config"]["mesh"]["tp"] == 16


@pytest.mark.parametrize("mode", ["offload"])
def test_save_and_restore_across_two_processes(tmp_path, mode):
    """A session saved on a mesh of 2 processes x 2 devices (process 0 writes, the others wait) and restored by a
    fresh engine on the same mesh continues exactly as the original, offload; and the whole life equals
    one process on one device. A save process 0 cannot write, or one a process cannot read, fails in every
    process (none is left waiting) and the engine keeps decoding."""
    script = str(ROOT / "tests" / "multiprocess_sessions.py")
    # The processes keep this run's XLA flags (conftest.py's cheaper compilation: at full optimisation they compiled
    # about twice as long) with their own device counts; experiments.launch gives each launched process its count.
    flags = os.environ.get("XLA_FLAGS", "")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GLM53_")},
           "XLA_FLAGS": xla_flags_with_devices(flags, None)}
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    _run([sys.executable, script, str(one), str(tmp_path / "save1"), mode],
         {**env, "XLA_FLAGS": xla_flags_with_devices(flags, 1)})
    p = _run([sys.executable, "-m", "experiments.launch", "--processes=2", "--devices_per_process=2", "--",
              sys.executable, script, str(two), str(tmp_path / "save2"), mode], env)
    assert "[launch] exit codes [0, 0]" in p.stdout
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert (a["processes"], a["devices"], b["processes"], b["devices"]) == (1, 1, 2, 4)
    assert b["restored"] == b["rest"][str(b["a"])]  # the restored session continues as the saved one did
    assert {k: b[k] for k in ("first", "rest", "restored")} == {k: a[k] for k in ("first", "rest", "restored")}
    assert os.path.isdir(b["saved"]) and b["saved"].startswith(str(tmp_path / "save2"))
    # a save process 0 cannot write fails in every process (the others learn it from process 0) and the engine
    # keeps decoding, the same tokens in both
    p0, p1 = (json.loads((tmp_path / f"two.json.p{i}").read_text()) for i in (0, 1))
    assert (p0["failed_save"], p1["failed_save"]) == ("FileExistsError", "RuntimeError")
    # a save only process 0 can read: every process refuses the restore
    assert p0["failed_restore"] == p1["failed_restore"] == "SessionFileError"
    assert p0["after"] == p1["after"] and len(p0["after"]) == 2


def test_launch_fails_when_a_process_fails(tmp_path):
    p = subprocess.run([sys.executable, "-m", "experiments.launch", "--processes=2", "--devices_per_process=1", "--",
                        sys.executable, "-c", "import os, sys; sys.exit(int(os.environ['GLM53_PROCESS_ID']) * 3)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "exit codes [0, 3]" in p.stdout


def test_initialize_needs_all_three_settings(monkeypatch):
    for k in distributed.ENV:
        monkeypatch.delenv(k, raising=False)
    assert distributed.initialize() is False  # one process: nothing to join
    monkeypatch.setenv("GLM53_COORDINATOR", "localhost:1")
    with pytest.raises(ConfigError, match="needs all of"):
        distributed.initialize()
    with pytest.raises(ConfigError, match="process_id=2 must be in"):
        distributed.initialize("localhost:1", 2, 2)
    assert distributed.initialize("localhost:1", 1, 0) is False
