"""What the experiments' entry points share around absl and ml_collections.

``run(main)`` is absl's ``app.run`` with one change: a ``--config.X`` override naming a field the config lacks is a
one-line flag error (``flag --config.cache.hot_row=5: the config has no field 'hot_row'; did you mean "hot_rows"?``)
instead of ml_collections' 50-line traceback, whose hint ends up buried in an ``AttributeError``'s repr. Every other
flag error is absl's own. ``check_checkpoint`` and ``unread_overrides`` keep a run from quietly ignoring what its
command line asked for.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

from absl import app, flags
from ml_collections import config_flags

# glm53 (and with it JAX, ~1.4 s of a process's start) is imported by the helpers that use it, not here:
# experiments.launch needs only ``run`` and starts its processes in 0.1 s instead of 1.5 s.


# The repository (or the install) that holds configs/: an entry point's default config is found from any working
# directory, not only from the repository root.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define_config(default: str | None, help_string: str, **kwargs):
    """``--config``, an ml_collections config file; ``default`` (``"configs/x.py"``) is read from this install's
    ``configs/``, wherever the command runs."""
    return config_flags.DEFINE_config_file("config", None if default is None else os.path.join(ROOT, default),
                                           help_string, **kwargs)


def module_name() -> str:
    """``glm53.provenance.module_name``, imported when a message needs it."""
    from glm53 import provenance

    return provenance.module_name()


def run(main) -> None:
    def refusing(argv):
        # absl prints a UsageError below the module's docstring and every flag's help (70 lines for plan's
        # --history=abc), the message last; it is one line here, as the other refusals are.
        try:
            if "out" in flags.FLAGS:  # every entry point's results file, found unwritable before the work
                refuse_an_unwritable_output(flags.FLAGS.out, "out")
            return main(argv)
        except app.UsageError as e:
            sys.exit(f"{module_name()}: {e}\nPass --helpshort or --helpfull to see help on flags.")
        except ValueError as e:
            # glm53's ConfigError (a setting that cannot work, named with why) from wherever main met it: one line,
            # as the entry points' own checks say theirs, not a traceback through the library. Only a raised one
            # needs the class, so it is looked up where glm53 was imported instead of importing it here.
            config = sys.modules.get("glm53.config")
            if config is None or not isinstance(e, config.ConfigError):
                raise
            from glm53 import distributed  # a run of several processes ends at once, so the launcher stops the rest

            distributed.fail(f"{module_name()}: {e}")

    app.run(refusing, flags_parser=_parse_flags)


def _parse_flags(argv: list) -> list:
    try:
        rest = app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError) as e:  # ml_collections: an override's path through the config is missing
        sys.exit(f"FATAL Flags parsing error: {unknown_field_message(e, argv)}\n"
                 "Pass --helpshort or --helpfull to see help on flags.")
    except OSError as e:  # a --config.X override made ml_collections load a config file it cannot
        _config_not_loaded(e, argv)
    if "config" in flags.FLAGS:
        # ml_collections defers a config file's load error to the first read of the flag, a two-traceback OSError
        # inside main: it is a flag error, said in one line before anything runs.
        try:
            value = flags.FLAGS["config"].value
            if value is not None:
                getattr(value, "keys")  # a config that failed to load raises on any attribute
        except OSError as e:
            _config_not_loaded(e, argv)
    return rest


def _config_not_loaded(error: OSError, argv: list) -> None:
    """The one-line exit for a ``--config`` file that does not load (missing, misspelled, or failing itself)."""
    path = "?"  # as given: the flag itself counts as unparsed when an override's load failed
    for i, a in enumerate(argv[1:], 1):
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
        elif a == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    reason = str(error.__cause__ or error).strip().splitlines()[-1].strip()
    sys.exit(f"FATAL Flags parsing error: --config={path}: cannot load it ({reason}); a relative path is read "
             f"from the working directory, {os.getcwd()}; the shipped configs are in "
             f"{os.path.join(ROOT, 'configs')}\nPass --helpshort or --helpfull to see help on flags.")


def unknown_field_message(error: BaseException, argv: list) -> str:
    """ml_collections wraps its message (the missing key quoted, then a suggestion on the next line) in a KeyError,
    itself in an AttributeError for a leaf; the flag is the command-line override whose path holds that key."""
    while error.args and isinstance(error.args[0], BaseException):
        error = error.args[0]
    text = str(error.args[0]) if error.args else str(error)
    first, _, hint = text.partition("\n")
    key = first.strip("'\"")
    given = [a for a in argv[1:] if a.startswith("--") and "." in a.split("=", 1)[0]
             and key in re.split(r"[.=]", a.split("=", 1)[0].lstrip("-"))]
    where = f"flag {given[0]}: " if given else ""
    hint = f"; {hint[0].lower()}{hint[1:]}" if hint else ""
    return f"{where}the config has no field {key!r}{hint}"


def overrides(name: str = "config") -> dict:
    """``{"cache.hot_rows": 4096, ...}``: the config fields the command line set (``--config.cache.hot_rows=4096``)."""
    return dict(config_flags.get_override_values(flags.FLAGS[name]))


def checkpoint_problem(config, given: dict, *, reads_checkpoint: bool) -> str | None:
    """Why ``config`` cannot run as asked, or None. With ``config.checkpoint`` set, the model is the checkpoint's:
    ``--config.model.*`` overrides would be ignored (the checkpoint's own config fixes its architecture), and an
    experiment that builds random weights from ``config.model`` would ignore the checkpoint itself."""
    path = config.get("checkpoint", "")
    if not path:
        return None
    if not reads_checkpoint:
        return (f"--config.checkpoint={path}: this experiment builds random weights from config.model and reads no "
                "checkpoint; run a checkpoint through experiments.generate, or leave config.checkpoint empty")
    model_fields = sorted(k for k in given if k == "model" or k.startswith("model."))
    if model_fields:
        named = ", ".join(f"--config.{k}" for k in model_fields)
        return (f"{named}: the model comes from --config.checkpoint={path}, whose own config fixes its "
                f"architecture (config.model is read only for random weights); drop the override"
                f"{'s' if len(model_fields) > 1 else ''}")
    return None


def check_run_settings(config) -> None:
    """``config.run``'s batch, lengths, sampling and MTP depth against each other and the model's config (its
    positions, its MTP module), before any weight exists: a ``glm53.ConfigError`` naming the flag (``run`` says it in
    one line). For the entry points that run ``config.run`` as it is."""
    import glm53
    from glm53.engine import check_sampling

    run = config.run
    if run.batch < 1:
        raise glm53.ConfigError(f"--config.run.batch={run.batch}: the run needs at least one prompt")
    if run.prompt_len < 1 or run.max_new_tokens < 1:
        raise glm53.ConfigError(f"--config.run.prompt_len={run.prompt_len} and --config.run.max_new_tokens="
                                f"{run.max_new_tokens} must both be >= 1")
    try:
        check_sampling(run.mtp, run.temperature, run.top_p, run.seed,
                       None if run.accept_override < 0 else run.accept_override, has_mtp=True)
    except (TypeError, ValueError) as e:
        raise glm53.ConfigError(f"--config.run: {e}") from None
    cfg = model_config(config)
    if run.mtp and not cfg.num_nextn_predict_layers:
        raise glm53.ConfigError(f"--config.run.mtp={run.mtp} needs an MTP module, and this model has none "
                                "(num_nextn_predict_layers=0)")
    need = run.prompt_len + run.max_new_tokens + run.mtp
    if need > cfg.max_position_embeddings:
        raise glm53.ConfigError(f"--config.run.prompt_len={run.prompt_len} + --config.run.max_new_tokens="
                                f"{run.max_new_tokens} (+ mtp {run.mtp}) needs {need} positions, but the model has "
                                f"max_position_embeddings={cfg.max_position_embeddings}")


def model_config(config) -> glm53.ModelConfig:
    """The model's config as the entry point will find it, read without any weight: a checkpoint's own
    (``config.checkpoint``: an HF directory's config.json or a glm53 save's) when one is set, else ``config.model``."""
    import glm53
    from glm53 import checkpoint

    path = config.get("checkpoint", "")
    if not path:
        return glm53.ModelConfig.from_config_dict(config.model)
    if os.path.exists(os.path.join(path, checkpoint.NATIVE_META)):
        return checkpoint.read_native_config(path)[0]
    return checkpoint.read_hf_config(path)


def check_checkpoint(config, *, reads_checkpoint: bool, name: str = "config") -> None:
    """``checkpoint_problem`` for this process's command line: a one-line exit naming the flag."""
    problem = checkpoint_problem(config, overrides(name), reads_checkpoint=reads_checkpoint)
    if problem:
        sys.exit(f"{module_name()}: {problem}")


def cache_fields_but(config, *left: str) -> tuple:
    """``("cache.kv_format", ...)``: every field of ``config.cache`` but ``left`` (which the experiment sets itself),
    for ``refuse_unread_overrides``."""
    return tuple(f"cache.{k}" for k in config.cache if k not in left)


def refuse_unread_overrides(read: tuple, why: str, name: str = "config") -> None:
    """``unread_overrides`` for this process's command line: a one-line exit naming the flags the entry point would
    ignore (and record in its results as if they had been used)."""
    problem = unread_overrides(overrides(name), read, why)
    if problem:
        sys.exit(f"{module_name()}: {problem}")


def refuse_an_unrunnable_cache(cfg, cc) -> None:
    """A one-line exit for an offload cache ``Engine`` would refuse (``glm53.offload.validate``), for the entry points
    that count or plan an engine without building one (a figure for it would describe nothing that can run)."""
    if cc.mode != "offload":
        return
    from glm53 import offload
    from glm53.config import ConfigError

    try:
        offload.validate(cfg, cc)
    except ConfigError as e:
        sys.exit(f"{module_name()}: {e}")


def output_problem(path: str, flag: str) -> str | None:
    """Why the results file ``path`` (given as ``--flag``) cannot be written, or None. Its folder is made, as the
    run's own write would, and a file is created and removed there: ``os.access`` says yes to root for any path
    (``/proc/x.json`` passed it), and the write came only after the run's work, as a traceback."""
    if not path:
        return None
    if os.path.isdir(path):
        return f"--{flag}={path} is a directory: give the path of a file to write"
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".glm53-write-check-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"--{flag}={path}: cannot write a file in {folder} ({e.strerror or e})"
    return None


def refuse_an_unwritable_output(path: str, flag: str) -> None:
    """``output_problem`` as a one-line exit, before anything runs."""
    problem = output_problem(path, flag)
    if problem:
        sys.exit(f"{module_name()}: {problem}")


def refuse_an_unusable_save_directory(path: str, flag: str) -> None:
    """A one-line exit, before anything runs, when a session cannot be saved to ``path`` (``--flag``): a file, or a
    directory holding other files (``glm53.session_io.check_target``). Found at the save, it came after the prefill
    the save was for."""
    if not path:
        return
    from glm53 import session_io

    try:
        session_io.check_target(path)
    except (OSError, ValueError) as e:
        sys.exit(f"{module_name()}: --{flag}={path}: {e}")


def check_modes(config, modes, flag: str | None = None) -> None:
    """Before the model is built: ``modes`` (``--flag``'s cache modes) are known ones, and where offload is among them,
    ``config``'s cache is one an offload engine can run (``refuse_an_unrunnable_cache``). The A/Bs met an offload
    cache too small for a round only after their resident half had run."""
    import glm53

    bad = sorted(set(modes) - set(glm53.config.CACHE_MODES))
    if bad:
        raise app.UsageError(f"--{flag}={','.join(modes)}: the cache modes are {', '.join(glm53.config.CACHE_MODES)} "
                             f"(got {', '.join(map(repr, bad))})")
    if "offload" in modes:
        cc = glm53.CacheConfig.from_config_dict(config.cache).replace(mode="offload")
        refuse_an_unrunnable_cache(model_config(config), cc)


def token_counts(flag: str, values: list, what: str = "history lengths in tokens") -> list[int]:
    """A list flag of counts (``--history=50000,1048576``) as ints, each at least 1; a usage error naming the flag
    and ``what`` it counts otherwise (a word or a zero would otherwise be a traceback or a table of zeros)."""
    try:
        counts = [int(x) for x in values]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise app.UsageError(f"--{flag}={','.join(values)}: give {what}, whole numbers >= 1, comma-separated")
    return counts


def readable(value, digits: int = 4):
    """``value`` (a summary dict, list, number) with floats rounded to ``digits`` significant digits, for printing:
    the JSON keeps full precision; the terminal needs ``0.9772``, not ``0.9772135416666666``."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: readable(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(readable(v, digits) for v in value)
    return value


def params_text(n: float) -> str:
    """A parameter count as people say it: ``8.87B``, ``1.1M`` (a tiny model is not ``0.00B``)."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def unread_overrides(given: dict, read: tuple, why: str) -> str | None:
    """The ``--config.*`` overrides in ``given`` (``overrides()``) that no field in ``read`` covers (dotted paths:
    ``"run.seed"``, or ``"model"`` for all of config.model), named on one line with ``why`` the experiment leaves
    them unread; None when it reads them all. An override it would ignore would otherwise go into its results as
    if it had been used."""
    unread = sorted(k for k in given if not any(k == r or k.startswith(r + ".") for r in read))
    if not unread:
        return None
    named = ", ".join(f"--config.{k}={given[k]}" for k in unread)
    return f"{named}: {why}; drop the override{'s' if len(unread) > 1 else ''}"
