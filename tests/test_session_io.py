"""Save / restore of engine sessions: a saved session restored anywhere (a new process, the other cache mode,
another hot-cache size) continues exactly as the uninterrupted session; saves are atomic; incompatible or corrupted
saves are clear errors that change nothing."""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import glm53
from glm53 import SessionFileError, session_io
from engine_common import CC, engine, ids, make_model


@pytest.fixture(scope="module")
def model():
    return make_model()


def history(e, sid):
    """Open a session and bring it mid-stream: generated, then appended (the ring holds a partial page)."""
    del sid
    s = e.open(ids(150, seed=60))
    e.generate({s: 9}, mtp=2)
    e.append(s, ids(21, seed=61))
    return s


def cont(e, sid):
    # One draft a step accepted: the random model's own verdicts reject every draft, and greedy tokens and logits
    # would then not depend on the MTP layer's restored rows (a save that left them out continued identically).
    out = e.generate({sid: 12}, return_logits=True, mtp=1, accept_override=1)
    first = (out[sid], e.last_run.logits[sid])
    out = e.generate({sid: 6}, return_logits=True, temperature=0.9, seed=3)
    return [first, (out[sid], e.last_run.logits[sid])]


def assert_same(a, b):
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb and np.array_equal(la, lb)


@pytest.mark.parametrize("saved_mode", ["offload", "resident"])
def test_save_restore_continues_identically_across_modes(model, saved_mode, tmp_path):
    e = engine(model, saved_mode)
    s = history(e, None)
    path = e.save(s, str(tmp_path / "sess"))
    assert os.path.basename(path).startswith("v")
    want = cont(e, s)  # the uninterrupted session
    for mode in ("offload", "resident"):
        r = engine(model, mode)
        sid = r.restore(str(tmp_path / "sess"))
        assert r.tokens(sid) == e.tokens(s)[: len(r.tokens(sid))]
        assert_same(cont(r, sid), want)
    if saved_mode == "offload":  # another hot-cache size (a whole new set of shapes: once is enough), restored cold
        r = glm53.Engine(model, CC.replace(mode="offload", hot_rows=256), max_sessions=1)
        sid = r.restore(str(tmp_path / "sess"))
        assert r.stats(sid)["hits"] == 0
        assert_same(cont(r, sid), want)


def test_save_right_after_open_and_after_rollback(model, tmp_path):
    e = engine(model, "offload", 2)
    a = e.open(ids(37, seed=62))  # a partial page only
    e.save(a, str(tmp_path / "a"))
    b = e.open(ids(120, seed=63))
    e.generate({b: 10})
    e.rollback(b, 40)  # into host pages: the pending token's hidden state is stale
    e.save(b, str(tmp_path / "b"))
    want = {a: cont(e, a), b: cont(e, b)}
    r = engine(model, "offload", 2)
    ra, rb = r.restore(str(tmp_path / "a")), r.restore(str(tmp_path / "b"))
    assert_same(cont(r, ra), want[a])
    assert_same(cont(r, rb), want[b])


def test_restore_in_a_fresh_process(model, tmp_path):
    e = engine(model, "offload")
    s = history(e, None)
    e.save(s, str(tmp_path / "sess"))
    want = cont(e, s)
    script = textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from engine_common import engine, make_model
        e = engine(make_model(), "resident")
        sid = e.restore({str(tmp_path / "sess")!r})
        a = e.generate({{sid: 12}}, return_logits=True, mtp=1, accept_override=1)[sid]; la = e.last_run.logits[sid]
        b = e.generate({{sid: 6}}, return_logits=True, temperature=0.9, seed=3)[sid]; lb = e.last_run.logits[sid]
        np.savez({str(tmp_path / "out.npz")!r}, a=np.array(a), la=la, b=np.array(b), lb=lb)
    """)
    # The parent's platform (conftest's environment): weights initialised on another backend differ in their last
    # bits, and the save's fingerprint rightly refuses them (on the H200 the CPU-forced child did).
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    assert_same([(got["a"].tolist(), got["la"]), (got["b"].tolist(), got["lb"])], want)


def test_save_is_atomic(model, tmp_path):
    e = engine(model, "offload")
    s = e.open(ids(50, seed=64))
    d = str(tmp_path / "sess")
    e.save(s, d)
    e.generate({s: 5})
    tokens_v1 = e.tokens(s)[:50]

    def crash():
        raise KeyboardInterrupt("power cut")

    with pytest.raises(KeyboardInterrupt):
        session_io.write(d, {"x": np.zeros(3)}, {"junk": 1}, _before_commit=crash)
    r = engine(model, "offload")
    sid = r.restore(d)  # still the first save
    assert r.tokens(sid) == tokens_v1
    r.close(sid)
    e.save(s, d)  # a later save replaces it, and sweeps the crashed version away
    assert sorted(n for n in os.listdir(d) if n.startswith("v")) == ["v000003"]
    assert r.tokens(r.restore(d)) == e.tokens(s)


def test_incompatible_and_corrupted_saves(model, tmp_path):
    e = engine(model, "offload")
    s = e.open(ids(70, seed=65))
    d = str(tmp_path / "sess")
    version = e.save(s, d)
    r = engine(model, "offload")
    with pytest.raises(SessionFileError, match="kv_format: saved 'q8g64', engine 'bf16'"):
        glm53.Engine(model, CC.replace(kv_format="bf16"), max_sessions=1).restore(d)
    other = make_model(seed=4)
    with pytest.raises(SessionFileError, match="different weights"):
        engine(other, "offload").restore(d)
    small = glm53.Engine(model, CC.replace(max_len=64), max_sessions=1)
    with pytest.raises(glm53.AdmissionError, match="rows but a session slot holds 64"):
        small.restore(d)
    with pytest.raises(SessionFileError, match="no complete session save"):
        r.restore(str(tmp_path))
    # flipped bytes in the arrays: checksum (or the reader) catches them
    doc = json.load(open(os.path.join(version, "session.json")))
    doc["arrays"]["index_keys"]["sha256"] = "0" * 64
    json.dump(doc, open(os.path.join(version, "session.json"), "w"))
    with pytest.raises(SessionFileError, match="index_keys does not match its checksum"):
        r.restore(d)
    open(os.path.join(version, "session.json"), "w").write("{trunc")
    with pytest.raises(SessionFileError, match="not valid JSON"):
        r.restore(d)
    assert r.sessions == [] and r.memory_report()["host"]["used_pages"] == 0  # nothing changed


def test_saves_hold_values_and_refuse_keys_of_another_dtype(model, tmp_path):
    """The cache stores bf16 planes as their bits (kernels_pallas.kv_formats.stored_dtype); a save holds the values
    (what saves held before), and keys saved in another dtype are refused, not reinterpreted."""
    from kernels_pallas import kv_formats

    e = engine(model, "offload")
    s = e.open(ids(40, seed=66))
    d = str(tmp_path / "sess")
    e.save(s, d)
    meta, arrays = session_io.read(d)
    n = meta["processed"]
    want = kv_formats.get_format(CC.kv_format).plane_shapes(e.cfg.num_cache_layers, n, values=True)
    assert {k: (v.shape, v.dtype) for k, v in arrays["rows"].items()} == want
    assert {v.dtype for v in arrays["rows"].values()} & {np.dtype(np.uint16), np.dtype(np.uint8)} == set()
    assert arrays["index_keys"].dtype == e.cache.index_key_dtype
    arrays["index_keys"] = arrays["index_keys"].astype(np.float16)
    other = str(tmp_path / "other")
    session_io.write(other, arrays, meta)
    r = engine(model, "offload")
    with pytest.raises(SessionFileError, match="the indexer keys are float16.*expected float32"):
        r.restore(other)
    assert r.sessions == []
    assert r.generate({r.restore(d): 3})  # the save as written restores


def test_saves_refuse_what_they_cannot_keep(model, tmp_path):
    """A save edited on disk, or one whose record cannot be a session's, is refused whole (no session, no slot, no
    page taken); a save never goes into a directory holding anything but saves; a session at the slot's full length
    and one whose append was interrupted both restore and continue as they would have."""
    e = engine(model, "offload")
    s = e.open(ids(70, seed=66))
    d = str(tmp_path / "sess")
    version = e.save(s, d)
    doc_path = os.path.join(version, "session.json")
    original = json.load(open(doc_path))
    r = engine(model, "offload")

    def refused(edit, match):
        doc = json.loads(json.dumps(original))
        edit(doc)
        json.dump(doc, open(doc_path, "w"))
        with pytest.raises(SessionFileError, match=match):
            r.restore(d)
        assert r.sessions == [] and r.memory_report()["host"]["used_pages"] == 0

    def token(doc):
        doc["meta"]["tokens"][5] = (doc["meta"]["tokens"][5] + 1) % 100  # still in the vocabulary
    refused(token, "metadata .* does not match its checksum")

    def v1(**meta):  # a version 1 save (no metadata checksum) with a record that cannot be a session's
        def edit(doc):
            doc["version"] = 1
            del doc["meta_sha256"]
            doc["meta"].update(meta)
        return edit
    refused(v1(sampler="abc"), "sampler record")
    refused(v1(sampler={"seed": -1, "temperature": 0.0, "top_p": 1.0}), "seed must be an int")
    refused(v1(generated="x"), "generated is 'x'")
    refused(v1(mtp_processed=-5), "inconsistent lengths")
    refused(v1(hidden_valid="false"), "hidden_valid")
    refused(v1(fingerprint=[1]), "no engine fingerprint")
    refused(lambda doc: doc.pop("meta"), "metadata is NoneType")
    refused(lambda doc: doc["arrays"]["hidden"].pop("shape"), "array records are malformed")
    refused(lambda doc: doc["files"].update({"x": "big"}), "file records are malformed")
    json.dump(original, open(doc_path, "w"))
    assert r.tokens(r.restore(d)) == e.tokens(s)
    r.close(r.sessions[0])

    def v2(doc):  # a version 2 save records no file sizes: restored on its array checksums alone
        doc["version"] = 2
        del doc["files"]
    v2_doc = json.loads(json.dumps(original))
    v2(v2_doc)
    json.dump(v2_doc, open(doc_path, "w"))
    assert r.tokens(r.restore(d)) == e.tokens(s)
    r.close(r.sessions[0])
    json.dump(original, open(doc_path, "w"))

    # A truncated or missing array file is named before orbax reads anything (orbax failing mid-read leaves reads
    # in flight whose threads print tracebacks).
    files = original["files"]
    assert files and all(size > 0 for size in files.values())
    biggest = os.path.join(version, "arrays", max(files, key=files.get))
    kept = open(biggest, "rb").read()
    with open(biggest, "r+b") as f:
        f.truncate(len(kept) // 2)
    with pytest.raises(SessionFileError, match=f"holds {len(kept) // 2:,} bytes where {len(kept):,} were written"):
        r.restore(d)
    os.remove(biggest)
    with pytest.raises(SessionFileError, match="arrays/.* is missing"):
        r.restore(d)
    assert r.sessions == []
    open(biggest, "wb").write(kept)
    assert r.tokens(r.restore(d)) == e.tokens(s)

    # Only into a new or empty directory, or one of saves: a save replaces older versions, nothing else.
    other = tmp_path / "mine"
    (other / "v000009").mkdir(parents=True)
    (other / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a glm53 session directory .*notes.txt, v000009"):
        e.save(s, str(other))
    assert sorted(os.listdir(other)) == ["notes.txt", "v000009"]
    with pytest.raises(ValueError, match="non-empty path"):
        e.save(s, "")

    # A session at the slot's full length restores into the engine that saved it.
    full = glm53.Engine(model, CC.replace(max_len=64), max_sessions=1)
    f = full.open(ids(64, seed=67))
    full.save(f, str(tmp_path / "full"))
    full.close(f)
    assert full.tokens(full.restore(str(tmp_path / "full"))) == ids(64, seed=67)

    # An append interrupted between its chunks leaves tokens to process: saved as they are, restored, and processed
    # by the next generate, as the live session does.
    live = engine(model, "offload")
    a = live.open(ids(40, seed=68))
    chunk = live._step("chunk")
    calls = []

    def second_chunk_interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("interrupted mid-append")
        return chunk(*args, **kw)

    live._steps["chunk"] = second_chunk_interrupted
    with pytest.raises(KeyboardInterrupt):
        live.append(a, ids(3 * live.chunk, seed=69))
    live._steps["chunk"] = chunk
    assert len(live.tokens(a)) == 40 + 3 * live.chunk
    live.save(a, str(tmp_path / "mid"))
    back = engine(model, "offload")
    b = back.restore(str(tmp_path / "mid"))
    want = live.generate({a: 6}, return_logits=True)[a], live.last_run.logits[a]
    got = back.generate({b: 6}, return_logits=True)[b], back.last_run.logits[b]
    assert got[0] == want[0] and np.array_equal(got[1], want[1])
    resident = engine(model, "resident")  # the same save in the resident cache: the same tokens and logits
    c = resident.restore(str(tmp_path / "mid"))
    got = resident.generate({c: 6}, return_logits=True)[c], resident.last_run.logits[c]
    assert got[0] == want[0] and np.array_equal(got[1], want[1])


def test_save_of_a_session_rolled_back_to_its_first_token(model, tmp_path):
    """Rolled back to one token (pending), a session has no row in its cache: its save is refused before anything is
    written (orbax raised on the zero-size arrays, past the flush and leaving a half-written version behind), and the
    session continues as one that was never saved."""
    e, ref = engine(model, "offload"), engine(model, "offload")
    a, b = e.open(ids(40, seed=70)), ref.open(ids(40, seed=70))
    e.rollback(a, 39)
    ref.rollback(b, 39)
    d = tmp_path / "one"
    with pytest.raises(ValueError, match=f"session {a} has no processed rows to save"):
        e.save(a, str(d))
    assert not d.exists()
    with pytest.raises(ValueError, match=f"session {a} holds a single token, and one must stay"):
        e.rollback(a, 1)
    got = e.generate({a: 6}, return_logits=True)[a], e.last_run.logits[a]
    want = ref.generate({b: 6}, return_logits=True)[b], ref.last_run.logits[b]
    assert got[0] == want[0] and np.array_equal(got[1], want[1])
    e.save(a, str(d))  # once it holds rows again
    r = engine(model, "offload")
    assert r.tokens(r.restore(str(d))) == e.tokens(a)


def test_unreadable_saves_and_version_directories(tmp_path):
    """A LATEST or session.json that cannot be read (a directory, bytes that are not text) is a SessionFileError
    naming the file, not a raw OSError or UnicodeDecodeError; the version directory a save returns is refused with
    the save directory to restore from; an edited ``"version": true`` is not read as version 1 (whose metadata has
    no checksum)."""
    d = str(tmp_path / "sess")
    version = session_io.write(d, {"x": np.arange(3.0)}, {"tokens": [1, 2]})
    with pytest.raises(SessionFileError, match=re.escape(f"{version} is one version inside the save directory {d}")):
        session_io.read(version)
    doc_path, pointer = os.path.join(version, "session.json"), os.path.join(d, "LATEST")
    original, named = open(doc_path).read(), open(pointer).read()

    def refused_then_put_back(path, kept, why):  # bytes that are not text, then a directory, then put back
        open(path, "wb").write(b"\xff\xfe" + kept.encode())
        with pytest.raises(SessionFileError, match=f"{os.path.basename(path)} {why}: the save is corrupted"):
            session_io.read(d)
        os.remove(path)
        os.mkdir(path)
        with pytest.raises(SessionFileError, match=f"{os.path.basename(path)} cannot be read: the save is corrupted"):
            session_io.read(d)
        os.rmdir(path)
        open(path, "w").write(kept)

    doc = json.loads(original)
    doc["version"] = True
    doc["meta"]["tokens"] = [1, 3]
    json.dump(doc, open(doc_path, "w"))
    with pytest.raises(SessionFileError, match="session format version True"):
        session_io.read(d)
    refused_then_put_back(doc_path, original, "is not valid JSON")
    refused_then_put_back(pointer, named, "cannot be read")
    meta, arrays = session_io.read(d)
    assert meta == {"tokens": [1, 2]} and np.array_equal(arrays["x"], np.arange(3.0))
