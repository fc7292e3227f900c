"""A hypothesis state machine drives a resident and an offload engine of one model through random sequences of
open / append / generate (with and without MTP) / rollback / fork / close / save+restore: every generate must give
the same tokens and bit-identical logits in both, every refusal must be the same refusal, and the histories must
stay equal. The resident engine is the oracle.

Every example starts from a long session whose hot cache is full and evicting (``long_session``): the random
sessions alone (at most 150 rows, generates of a few tokens) never evicted a row, and rollbacks of at most 60 rows
were nearly always refused, so a fill that left an evicted position mapped to its old slot went unnoticed here."""

import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, precondition,
                                 rule)

from glm53 import AdmissionError
from engine_common import engine, ids, make_model

MODEL = None
SLOTS = 2
LENGTHS = [3, 16, 37]  # chunk shapes 4 and 16 only: few executables to compile


def model():
    global MODEL
    if MODEL is None:
        MODEL = make_model()
    return MODEL


class EngineMachine(RuleBasedStateMachine):
    sessions = Bundle("sessions")

    def __init__(self):
        super().__init__()
        self.res = engine(model(), "resident", SLOTS)
        self.off = engine(model(), "offload", SLOTS)
        self.pair: dict[int, int] = {}  # resident sid -> offload sid
        self.tmp = tempfile.mkdtemp()
        self.n_saves = 0

    def teardown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _both(self, f_res, f_off):
        """Run the same operation on both engines: both succeed or both refuse with the same error type."""
        errs = []
        outs = []
        for f in (f_res, f_off):
            try:
                outs.append(f())
                errs.append(None)
            except (AdmissionError, ValueError) as e:
                outs.append(None)
                errs.append(type(e))
        assert errs[0] == errs[1], errs
        return outs, errs[0]

    @initialize(target=sessions)
    def long_session(self):
        """A 300-row session decoded with MTP (one draft a step accepted: see ``generate``) until its hot cache is
        full and evicts (deterministic: asserted), so the random rules' generates, rollbacks (into host pages),
        forks (of a full hot cache) and saves meet an evicting cache."""
        (a, b), err = self._both(lambda: self.res.open(ids(300, 99)), lambda: self.off.open(ids(300, 99)))
        assert err is None
        self.pair[a] = b
        self._generate([a], 24, 2, accept=1)
        assert self.off.stats(b)["decode"]["evictions"] > 0
        return a

    def _generate(self, chosen, n, mtp, accept=None):
        kw = dict(mtp=mtp, accept_override=accept, return_logits=True)
        (x, y), err = self._both(lambda: self.res.generate({s: n for s in chosen}, **kw),
                                 lambda: self.off.generate({self.pair[s]: n for s in chosen}, **kw))
        if err:
            return
        for s in chosen:
            assert x[s] == y[self.pair[s]]
            assert np.array_equal(self.res.last_run.logits[s], self.off.last_run.logits[self.pair[s]])

    @rule(target=sessions, n=st.sampled_from(LENGTHS + [70, 150]), seed=st.integers(0, 9))
    def open(self, n, seed):
        (a, b), err = self._both(lambda: self.res.open(ids(n, seed)), lambda: self.off.open(ids(n, seed)))
        if err:
            return multiple()
        self.pair[a] = b
        return a

    @precondition(lambda self: self.pair)
    @rule(sid=sessions, n=st.sampled_from(LENGTHS), seed=st.integers(0, 9))
    def append(self, sid, n, seed):
        if sid not in self.pair:
            return
        self._both(lambda: self.res.append(sid, ids(n, seed)), lambda: self.off.append(self.pair[sid], ids(n, seed)))

    @precondition(lambda self: self.pair)
    @rule(data=st.data(), n=st.integers(1, 16), mtp=st.sampled_from([0, 2]), forced=st.booleans())
    def generate(self, data, n, mtp, forced):
        """``forced``: MTP steps accept one draft whatever the verdict. The random model's own verdicts reject
        nearly every draft, so greedy MTP's tokens and logits do not depend on the drafts, nor on the MTP layer's
        cache; accepted drafts become tokens and the steps' rows, so offload's MTP layer must match resident's."""
        live = sorted(self.pair)
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        self._generate(chosen, n, mtp, 1 if mtp and forced else None)

    @precondition(lambda self: self.pair)
    # One token half of the time: the pending token alone is a path of its own (the cache untouched, unless an earlier
    # rollback left the stored hidden state stale)
    @rule(sid=sessions, n=st.one_of(st.just(1), st.integers(2, 60)))
    def rollback(self, sid, n):
        if sid not in self.pair:
            return
        self._both(lambda: self.res.rollback(sid, n), lambda: self.off.rollback(self.pair[sid], n))

    @precondition(lambda self: self.pair)
    @rule(target=sessions, sid=sessions)
    def fork(self, sid):
        if sid not in self.pair:
            return multiple()
        (a, b), err = self._both(lambda: self.res.fork(sid), lambda: self.off.fork(self.pair[sid]))
        if err:
            return multiple()
        self.pair[a] = b
        return a

    @precondition(lambda self: self.pair)
    @rule(sid=consumes(sessions))
    def close(self, sid):
        if sid not in self.pair:
            return
        self.res.close(sid)
        self.off.close(self.pair.pop(sid))

    @precondition(lambda self: self.pair)
    @rule(target=sessions, sid=consumes(sessions), cross=st.booleans())
    def save_restore(self, sid, cross):
        """Save the offload session, close both, restore it into both engines (``cross``: restore the resident
        session from the offload save too, i.e. across modes)."""
        if sid not in self.pair:
            return multiple()
        self.n_saves += 1
        d_off, d_res = f"{self.tmp}/o{self.n_saves}", f"{self.tmp}/r{self.n_saves}"
        self.off.save(self.pair[sid], d_off)
        self.res.save(sid, d_res)
        self.res.close(sid)
        self.off.close(self.pair.pop(sid))
        a = self.res.restore(d_off if cross else d_res)
        b = self.off.restore(d_off)
        self.pair[a] = b
        return a

    @invariant()
    def histories_equal(self):
        for a, b in self.pair.items():
            assert self.res.tokens(a) == self.off.tokens(b)
        rep = self.off.memory_report()
        assert rep["host"]["used_pages"] + rep["host"]["free_pages"] == rep["host"]["pages"]

    @invariant()
    def next_token_has_a_source(self):
        """Every session's next token comes from a step on a pending token or from the stored hidden state of its
        last row. The resident oracle cannot catch a breach (both modes sample from the same stale state): two
        rollbacks in a row once left a session with neither, and it continued from a position rolled away."""
        for e in (self.res, self.off):
            for sid, s in e._sessions.items():
                assert s.processed < len(s.tokens) or s.hidden_valid, (e.cache_config.mode, sid, s.processed)


EngineMachine.TestCase.settings = settings(max_examples=3, stateful_step_count=10, deadline=None,
                                          suppress_health_check=list(HealthCheck))
test_engine_state_machine = EngineMachine.TestCase
