"""Where a measurement came from: the git revision (and whether the tree was dirty), the command, the machine."""

import json
import os
import subprocess
import sys

import jax


def git_revision() -> dict:
    """``{"commit", "dirty"}`` of this checkout. A copy of the tree without ``.git`` (e.g. on a lent GPU machine)
    takes them from ``GLM53_GIT_REVISION`` / ``GLM53_GIT_DIRTY``, set by whoever copied it."""
    if os.environ.get("GLM53_GIT_REVISION"):
        return {"commit": os.environ["GLM53_GIT_REVISION"], "dirty": os.environ.get("GLM53_GIT_DIRTY", "0") == "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True)
        return {"commit": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.CalledProcessError) as e:
        return {"commit": None, "dirty": None, "error": str(e)}


# The environment a result depends on besides its command: XLA's flags change what compiles (an A/B under
# --xla_gpu_autotune_level=0 is a different experiment), the pinned allocator's cap what fits, JAX_PLATFORMS where
# it ran.
ENV_PREFIXES = ("XLA_", "JAX_", "TF_CPP_")


def run_environment() -> dict:
    """The ``XLA_*`` / ``JAX_*`` / ``TF_CPP_*`` variables set for this run, sorted by name."""
    return {k: os.environ[k] for k in sorted(os.environ) if k.startswith(ENV_PREFIXES)}


def provenance() -> dict:
    return {"git": git_revision(), "command": "python -m " + " ".join([module_name()] + sys.argv[1:]),
            "environment": run_environment(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind}


def module_name() -> str:
    """The running entry point as ``python -m`` names it (``experiments.generate``), else the script's path."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else sys.argv[0]


def write_results(path: str, results: dict) -> None:
    """``results`` with its provenance added, written to ``path`` as JSON (nothing written when ``path`` is empty)."""
    results.update(provenance())
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {path}")
