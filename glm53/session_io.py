"""Session saves on disk: atomic, versioned, checksummed. Plain functions of numpy arrays and a metadata dict (the
engine decides what goes in; ``Engine.save`` / ``Engine.restore``).

Layout of a save directory::

    directory/
      LATEST                 the name of the newest complete version (replaced atomically, last)
      v000002/
        session.json         format, version, metadata, a sha256 of every array's bytes, every array file's size
        arrays/              orbax checkpoint of the arrays (history rows, indexer keys, hidden state)

A new save is written into a temporary directory, renamed into place, and only then named in ``LATEST``
(``os.replace`` of a small file: atomic on POSIX). A crash anywhere before that leaves ``LATEST`` naming the
previous save, which restores as it was; a half-written version directory is never named and is swept away by the
next save. Restoring first checks that every file orbax wrote is there at its size (a truncated or missing file is
named before orbax reads it: orbax fails on one mid-read, and its reads still in flight then print tracebacks from
its threads), then verifies every array and the metadata against their checksums, so flipped bits or an edited
token list on disk are an error that names what changed, not a session that silently continues from a different
history. A save goes only into a new or empty directory or one holding glm53 saves: it replaces older versions
there, and must not delete anything it did not write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid

import numpy as np

FORMAT = "glm53-session"
# 2: the metadata has a checksum too (``meta_sha256``). 3: the size of every file under arrays/ (``files``).
# Version 1 saves (arrays checksummed only) and 2 still restore.
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
_VERSION_RE = re.compile(r"^v(\d{6})$")


class SessionFileError(ValueError):
    """A session save that cannot be restored here: missing, corrupted, or made for another model or format (the
    message names what differs)."""


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def _meta_digest(meta: dict) -> str:
    """Of the metadata as JSON with sorted keys: what ``json.load`` gives back hashes the same (floats round-trip)."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "/"))
        else:
            out[name] = v
    return out


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _versions(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for m in (_VERSION_RE.match(n) for n in os.listdir(directory)) if m)


def latest(directory: str) -> str | None:
    """The newest complete save in ``directory`` (its version directory), or None."""
    path = os.path.join(directory, "LATEST")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:  # a directory, unreadable, or bytes a crash left there
        raise SessionFileError(f"{path} cannot be read: the save is corrupted ({type(e).__name__}: {e})") from e
    if not _VERSION_RE.match(name):
        raise SessionFileError(f"{path} names {name!r}, not a version directory: the save is corrupted")
    return os.path.join(directory, name)


def _ours(directory: str, name: str) -> bool:
    """Whether ``name`` in a save directory is something saves write: the pointer, a version (with its
    session.json: written before the version is renamed into place), or a crashed save's debris."""
    if name == "LATEST" or name.startswith((".tmp-", ".LATEST-")):
        return True
    return bool(_VERSION_RE.match(name)) and os.path.isfile(os.path.join(directory, name, "session.json"))


def check_target(directory) -> str:
    """``directory`` as an absolute path, if a save may go there: a new or empty directory, or one that holds saves
    of a session. Raises ``FileExistsError`` naming what is in the way otherwise (``Engine.save`` checks it first;
    entry points that save after a long prefill check it before)."""
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise ValueError(f"the save directory must be a non-empty path, got {directory!r}")
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise FileExistsError(f"{directory} exists and is not a directory")
    if os.path.isdir(directory):
        foreign = sorted(n for n in os.listdir(directory) if not _ours(directory, n))
        if foreign:
            raise FileExistsError(
                f"{directory} is not a glm53 session directory (it holds {', '.join(foreign[:4])}"
                f"{', ...' if len(foreign) > 4 else ''}): a save replaces what is there, so it goes only into a new "
                "or empty directory or one that holds saves of a session. Nothing was written")
    return directory


def _file_sizes(root: str) -> dict[str, int]:
    """``{path relative to root: bytes}`` of every file under ``root``."""
    sizes = {}
    for where, _, names in os.walk(root):
        for name in names:
            path = os.path.join(where, name)
            sizes[os.path.relpath(path, root)] = os.path.getsize(path)
    return sizes


def _check_files(version: str, files) -> None:
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in files.items()):
        raise SessionFileError(f"{version}/session.json: its file records are malformed: the save is corrupted")
    root = os.path.join(version, "arrays")
    for rel, size in sorted(files.items()):
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            raise SessionFileError(f"{path} is missing: the save is corrupted")
        if os.path.getsize(path) != size:
            raise SessionFileError(f"{path} holds {os.path.getsize(path):,} bytes where {size:,} were written: the "
                                   "save is truncated or corrupted")


def _this_process_only():
    """Orbax's options for a checkpoint this process reads or writes on its own: with several JAX processes
    (``glm53.distributed``) orbax would otherwise make every save and restore a collective of all of them. Sessions
    are numpy arrays every process holds whole; ``Engine.save`` has process 0 write and the others wait."""
    import jax
    import orbax.checkpoint as ocp

    me = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})


def write(directory: str, arrays: dict, meta: dict, *, _before_commit=None) -> str:
    """Save ``arrays`` (a nested dict of numpy arrays) and ``meta`` (JSON-serialisable) as the newest version in
    ``directory``. Returns the version directory. ``_before_commit`` (tests) runs after the data is written and
    before the save is named in LATEST: an exception there must leave the previous save intact."""
    import orbax.checkpoint as ocp

    directory = check_target(directory)
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):  # debris of saves that crashed before their rename
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    number = (max(_versions(directory)) + 1) if _versions(directory) else 1
    final = os.path.join(directory, f"v{number:06d}")
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
    os.makedirs(tmp)
    ckptr = ocp.StandardCheckpointer(multiprocessing_options=_this_process_only())
    ckptr.save(os.path.join(tmp, "arrays"), arrays)
    ckptr.wait_until_finished()
    flat = _flatten(arrays)
    records = {k: {"shape": list(v.shape), "dtype": str(v.dtype), "sha256": _digest(v)} for k, v in flat.items()}
    doc = {"format": FORMAT, "version": VERSION, "meta": meta, "meta_sha256": _meta_digest(meta), "arrays": records,
           "files": _file_sizes(os.path.join(tmp, "arrays"))}
    with open(os.path.join(tmp, "session.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    os.rename(tmp, final)
    _fsync_dir(directory)
    if _before_commit is not None:
        _before_commit()
    pointer = os.path.join(directory, f".LATEST-{uuid.uuid4().hex}")
    with open(pointer, "w") as f:
        f.write(os.path.basename(final))
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(directory, "LATEST"))
    _fsync_dir(directory)
    for v in _versions(directory):  # older complete versions: superseded
        if v != number:
            shutil.rmtree(os.path.join(directory, f"v{v:06d}"), ignore_errors=True)
    return final


def read(directory: str) -> tuple[dict, dict]:
    """(meta, arrays) of the newest save in ``directory``, every array checked against its checksum."""
    import orbax.checkpoint as ocp

    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise SessionFileError(f"no session save at {directory!r}: give the directory a save was written to")
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise SessionFileError(f"no session save at {directory}: not a directory")
    version = latest(directory)
    if version is None and _VERSION_RE.match(os.path.basename(directory)) \
            and os.path.isfile(os.path.join(directory, "session.json")):
        # What save returns: restoring from it would read a version that a later save may already have replaced.
        raise SessionFileError(f"{directory} is one version inside the save directory "
                               f"{os.path.dirname(directory)}: restore from that directory (its newest save)")
    if version is None:
        raise SessionFileError(f"{directory} holds no complete session save (no LATEST file): not a glm53 session "
                               "directory, or its first save never completed")
    doc_path = os.path.join(version, "session.json")
    try:
        with open(doc_path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise SessionFileError(f"{doc_path} is missing: the save is corrupted") from None
    except OSError as e:
        raise SessionFileError(f"{doc_path} cannot be read: the save is corrupted ({type(e).__name__}: {e})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SessionFileError(f"{doc_path} is not valid JSON: the save is corrupted ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SessionFileError(f"{doc_path} is not a glm53 session save")
    # The type too: ``True in (1, 2, 3)``, and an edited ``"version": true`` was read as 1, without checksums.
    if type(doc.get("version")) is not int or doc["version"] not in READABLE_VERSIONS:
        raise SessionFileError(f"{doc_path} has session format version {doc.get('version')!r}, this glm53 reads "
                               f"versions {READABLE_VERSIONS}")
    meta, expected = doc.get("meta"), doc.get("arrays")
    if not isinstance(meta, dict):
        raise SessionFileError(f"{doc_path}: its metadata is {type(meta).__name__}, not an object: the save is "
                               "corrupted")
    if doc["version"] >= 2 and doc.get("meta_sha256") != _meta_digest(meta):
        raise SessionFileError(f"{doc_path}: the metadata (tokens, lengths, sampler) does not match its checksum: "
                               "the save is corrupted or was edited")
    if not isinstance(expected, dict) or not all(
            isinstance(w, dict) and isinstance(w.get("shape"), list) and isinstance(w.get("dtype"), str)
            and isinstance(w.get("sha256"), str) for w in expected.values()):
        raise SessionFileError(f"{doc_path}: its array records are malformed (each needs a shape, dtype and "
                               "sha256): the save is corrupted")
    if doc["version"] >= 3:
        _check_files(version, doc.get("files"))
    try:
        arrays = ocp.StandardCheckpointer(multiprocessing_options=_this_process_only()).restore(
            os.path.join(version, "arrays"))
    except Exception as e:  # orbax / tensorstore raise many types for damaged files
        raise SessionFileError(f"cannot read the arrays of {version}: the save is corrupted ({type(e).__name__}: "
                               f"{str(e)[:300]})") from e
    flat = _flatten(arrays)
    if set(flat) != set(expected):
        raise SessionFileError(f"{version}: arrays {sorted(flat)} do not match the ones recorded "
                               f"{sorted(expected)}: the save is corrupted")
    for name, a in flat.items():
        want = expected[name]
        if list(a.shape) != want["shape"] or str(a.dtype) != want["dtype"]:
            raise SessionFileError(f"{version}: array {name} is {a.dtype}{list(a.shape)}, recorded as "
                                   f"{want['dtype']}{want['shape']}: the save is corrupted")
        if _digest(a) != want["sha256"]:
            raise SessionFileError(f"{version}: array {name} does not match its checksum: the save is corrupted")
    return meta, arrays
