"""``python ARGS`` for the tests, as a child forked from a server process that has already imported JAX, glm53 and the
libraries the entry points use.

Why: the suite runs ~70 entry points and scripts (``python -m experiments.X ...``, refusals most of them). A fresh
interpreter spends ~2.4 CPU-seconds importing JAX, orbax, glm53 and the rest before its first line of work (0.5 s of it
ml_dtypes registering its NumPy loops): on 2 cores that was the largest cost left in the suite that is not compiling.
A forked child starts with those modules imported and pays nothing for them.

What the child keeps of a real ``python ARGS``: a process of its own with the given argv, working directory and
environment, stdout and stderr captured, ``sys.path`` as the interpreter sets it (first the working directory for
``-m``, the script's directory for a script, ``''`` for ``-c``; then the run's ``PYTHONPATH``), the exit status the
interpreter gives (``SystemExit``'s code; 1 and a traceback on stderr for an uncaught exception), and atexit handlers
run at exit. What it cannot keep: JAX reads its ``JAX_*`` settings when it is imported, so a call whose environment
differs from the server's in a ``JAX_``, ``TF_``, ``PYTHON`` or ``LD_`` variable other than ``PYTHONPATH``, or whose
``PYTHONPATH`` holds a ``sitecustomize``, runs a real interpreter instead, as does any call while
``GLM53_REAL_PROCESSES`` is set. ``XLA_*`` variables may differ (``XLA_FLAGS`` with a run's own device count, say): XLA
reads them when a backend starts, in the child. The server never starts a JAX backend (a fork would copy its threads'
state), which ``serve`` checks before answering.

    p = python_runner.run(["-m", "experiments.plan", "--config=configs/tiny.py"], cwd=ROOT, timeout=300)

returns a ``subprocess.CompletedProcess`` (text stdout and stderr) like ``subprocess.run(..., capture_output=True,
text=True)``, and raises ``subprocess.TimeoutExpired`` the same way (the child killed first; what it had written as
bytes).
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types

# What a fresh interpreter would import first in the suite's entry points. Not the entry points themselves: running a
# module that is already in sys.modules as __main__ is not what ``python -m`` does.
PRELOAD = ("numpy", "jax", "jax.numpy", "jax.experimental.pallas", "absl.app", "absl.flags", "absl.logging",
           "ml_collections", "ml_collections.config_flags", "orbax.checkpoint", "safetensors.numpy", "tokenizers",
           "tqdm", "matplotlib", "glm53", "experiments.cli")
_SAME_ENV_PREFIXES = ("JAX_", "TF_", "PYTHON", "LD_")

_server = None
_server_env = None
_buffered = b""  # what the server has written that no _readline has returned yet
_lock = threading.Lock()


def _relevant(env):
    return {k: v for k, v in env.items() if k.startswith(_SAME_ENV_PREFIXES) and k != "PYTHONPATH"}


def _forkable(env) -> bool:
    """Whether a fork of the server can be ``python`` in ``env`` (the module docstring says when it cannot)."""
    if os.environ.get("GLM53_REAL_PROCESSES") or _relevant(env) != _relevant(_server_env):
        return False
    entries = env.get("PYTHONPATH", "").split(os.pathsep)
    # A real interpreter imports these at start-up, from the first entry of sys.path that has one.
    return not any(os.path.exists(os.path.join(e, f"{name}.py")) for e in entries if e
                   for name in ("sitecustomize", "usercustomize"))


def _readline(deadline=None):
    """The server's next line, or None at ``deadline`` (time.monotonic()). Read unbuffered from its pipe: a buffered
    reader could hold the exit status while select() says nothing more is coming."""
    global _buffered
    fd = _server.stdout.fileno()
    while b"\n" not in _buffered:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], wait)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            raise RuntimeError(f"the test python server exited ({_server.wait()}); its stderr is the test's")
        _buffered += chunk
    line, _buffered = _buffered.split(b"\n", 1)
    return line.decode()


def _start():
    global _server, _server_env, _buffered
    _server_env = dict(os.environ)
    _buffered = b""
    _server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, bufsize=0, env=_server_env)
    ready = _readline()
    if ready != "ready":
        raise RuntimeError(f"the test python server did not start: {ready!r} (its stderr is the test's)")


def _stop():
    if _server is not None and _server.poll() is None:
        _server.stdin.close()
        try:
            _server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _server.kill()


atexit.register(_stop)


def run(args, cwd=None, env=None, timeout=None, fresh=False):
    """``subprocess.run([sys.executable, *args], cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True)``,
    forked from the server where the environment allows (the module docstring says when it does not). ``fresh``: a
    real interpreter always, for a program that sets ``JAX_*`` variables itself before importing JAX (in a fork JAX
    is imported already, with the server's)."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    cwd = os.path.abspath(cwd or os.getcwd())
    with _lock:
        if _server is None or _server.poll() is not None:
            _start()
        if fresh or not _forkable(env):
            return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        with tempfile.TemporaryDirectory(prefix="glm53-run-") as d:
            out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
            request = {"args": args, "cwd": cwd, "env": env, "stdout": out, "stderr": err}
            _server.stdin.write((json.dumps(request) + "\n").encode())
            pid = int(_readline())
            returncode = _readline(None if timeout is None else time.monotonic() + timeout)
            if returncode is None:
                os.kill(pid, signal.SIGKILL)
                _readline()
                # bytes, as subprocess.run gives them in a TimeoutExpired even with text=True
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout, _read(out).encode(),
                                                _read(err).encode())
            return subprocess.CompletedProcess([sys.executable, *args], int(returncode), _read(out), _read(err))


def _pythonpath_entries(value: str) -> list[str]:
    """What the interpreter puts on sys.path for ``PYTHONPATH=value``, after its first entry: each made absolute from
    the working directory (an empty one is the working directory itself), each once (``site`` drops repeats)."""
    return list(dict.fromkeys(os.path.abspath(e) for e in value.split(os.pathsep))) if value else []


_server_pythonpath_entries = 0  # in the server: how many entries its own PYTHONPATH put on sys.path


def _read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _child(request):
    """In the forked child: become ``python ARGS`` and never return."""
    import runpy
    import traceback
    os.setpgid(0, 0)  # a timeout's kill reaches only this run, as it would a subprocess's
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                           (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
        opened = os.open(path, mode, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # a fresh interpreter picks its temp directory from this environment (TMPDIR), not ours
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = request["args"]
    code = 0
    try:
        first = {"-m": os.getcwd(), "-c": ""}.get(args[0], os.path.dirname(os.path.realpath(args[0])))
        entries = _pythonpath_entries(os.environ.get("PYTHONPATH", ""))
        sys.path[:] = [first, *entries, *(e for e in sys.path[_server_pythonpath_entries:] if e not in entries)]
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]  # runpy puts the module's file in argv[0], as -m does
            sys.modules.pop(args[1], None)
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:  # noqa: B036 - as the interpreter does with anything uncaught, KeyboardInterrupt too
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the run's first frame, not this one's
        code = 1
    try:
        threading._shutdown()  # noqa: SLF001 - what the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()  # noqa: SLF001
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream at exit is the child's own business
                pass
        os._exit(code & 0xFF)


def serve():
    """The server: import PRELOAD, then fork one child per request line on stdin, answering its pid and its exit
    status on stdout."""
    global _server_pythonpath_entries
    sys.path.pop(0)  # this file's directory, which a real interpreter of the request would not have
    _server_pythonpath_entries = len(_pythonpath_entries(os.environ.get("PYTHONPATH", "")))
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    from jax._src import xla_bridge
    if xla_bridge._backends:  # noqa: SLF001 - the one thing that makes forking this process unsafe
        raise RuntimeError(f"importing {PRELOAD} started a JAX backend: a forked child would inherit its threads")
    protocol = sys.stdout
    sys.stdout = sys.stderr  # nothing but the protocol on the real stdout
    protocol.write("ready\n")
    protocol.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            sys.stdin = open(os.devnull)
            sys.stdout = sys.__stdout__
            _child(request)
        protocol.write(f"{pid}\n")
        protocol.flush()
        _, status = os.waitpid(pid, 0)
        protocol.write(f"{os.waitstatus_to_exitcode(status)}\n")
        protocol.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
