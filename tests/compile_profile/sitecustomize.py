"""Where the test suite's time goes: every JAX trace, lowering, XLA compilation and persistent-cache hit of every
Python process a run starts (pytest workers, the entry points and multi-process tests they start, notebook kernels),
with the test that caused it. Nearly all of the suite's time is XLA compiling tiny models' steps, so this is the
profile that says what to cut (``python -m tests.compile_profile.summarize`` reads it).

Usage, from an empty compilation cache for the cold figure:

    rm -rf /tmp/glm53-test-jax-cache-$(id -u)
    PYTHONPATH=tests/compile_profile GLM53_COMPILE_PROFILE=/tmp/cprof JAX_LOG_COMPILES=1 \\
        python -m pytest -q -n 2 --dist worksteal tests
    python -m tests.compile_profile.summarize /tmp/cprof

Why log lines and not ``jax.monitoring`` (which ``glm53.engine.compile_seconds`` sums): its duration events carry no
function name, and a listener needs jax imported. Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``,
which every process of the run inherits. JAX is not imported here (``tests/conftest.py`` sets the XLA flags before
it is): only logging handlers are attached, to the loggers JAX_LOG_COMPILES=1 makes JAX write to, and they stop
those lines reaching stderr, which some tests read.
"""

import logging
import os
import re
import sys

_DIR = os.environ.get("GLM53_COMPILE_PROFILE")
_PATTERNS = (
    ("compile", re.compile(r"Finished XLA compilation of (.*) in ([0-9.e-]+) sec")),  # a compile or a cache load
    ("trace", re.compile(r"Finished tracing (.*) for jit in ([0-9.e-]+) sec")),
    ("lower", re.compile(r"Finished jaxpr to MLIR module conversion (.*) in ([0-9.e-]+) sec")),
    ("cache_hit", re.compile(r"Persistent compilation cache hit for '([^']*)'()")),
)


class _Recorder(logging.Handler):
    def __init__(self, directory: str):
        super().__init__()
        self.path = os.path.join(directory, f"events-{os.getpid()}.tsv")
        self.file = None

    def emit(self, record):
        msg = record.getMessage()
        for kind, pattern in _PATTERNS:
            m = pattern.search(msg)
            if m:
                break
        else:
            return
        if self.file is None:
            self.file = open(self.path, "a")
            self.file.write(f"#argv\t{' '.join(sys.argv)[:300]}\n")
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        self.file.write(f"{kind}\t{m.group(2) or 0}\t{m.group(1)}\t{test}\n")
        self.file.flush()


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    _handler = _Recorder(_DIR)
    for _name in ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.compiler", "jax._src.pjit"):
        _logger = logging.getLogger(_name)
        _logger.addHandler(_handler)
        _logger.propagate = False
        _logger.setLevel(logging.WARNING)
