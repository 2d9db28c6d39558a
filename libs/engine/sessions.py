"""Sessions: a conversation whose KV cache the engine keeps between turns.

A session turn is an ordinary request whose prompt is the session's whole token history followed
by the turn's new tokens. When the turn ends (stopped, cut by max_tokens or aborted), its sequence
is parked here instead of freed: its blocks and its computed length stay. The next turn whose
prompt starts with the parked tokens, under the same experts, adopts those blocks and computes only
what follows. Any other prompt simply recomputes (the prefix cache often still helps), so the
history the caller sends, not this table, is what a conversation is: a turn is correct whether
its KV was kept, evicted, or lost with another engine.

Idle parked sessions are the first thing the scheduler gives up under KV pressure, least recently
used first: their blocks are freed (the full ones stay findable in the prefix cache until reused).
A session idle longer than its idle timeout is ended. Engine thread only, like the scheduler.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from libs.engine.block_manager import KVCacheManager
from libs.engine.sequence import Sequence


class SessionError(Exception):
    """A session turn the engine cannot take now."""


class SessionLimitError(SessionError):
    """The engine holds as many sessions as it may (`max_sessions`)."""


class SessionBusyError(SessionError):
    """A turn of the session is already running."""


class SessionFullError(SessionError):
    """A session turn whose prompt leaves no room for a reply under the session's token limit."""


@dataclass(frozen=True)
class SessionRef:
    """What a request says about the session it is a turn of.

    `history_tokens`: how many leading prompt tokens are the session's history (0 for its first
    turn), so a turn that finds none of them kept is counted as a recompute. `idle_seconds`: how long
    the session may stay idle before the engine ends it (0: until ended or evicted by the table's
    limit). `max_tokens`: the tokens the session may hold, its history, this turn and the reply
    (0: the context window): the reply is cut to what is left (`turn_max_tokens`); None: no session
    limit, the request's own max_tokens is checked as any request's."""

    session_id: str
    history_tokens: int = 0
    idle_seconds: float = 0.0
    max_tokens: int | None = None


def turn_max_tokens(
    num_prompt_tokens: int, requested: int | None, session_max_tokens: int, max_model_len: int
) -> int:
    """The most tokens a session turn's reply may have: what the session's limit leaves after the
    turn's prompt (its history and the turn's tokens), or `requested` when that is less (None: as
    many as are left). The limit is `session_max_tokens` when it is above 0 and below the context
    window, else the context window. Raises SessionFullError, naming the limit, when nothing is left."""
    limit, name = max_model_len, f"the model's context window ({max_model_len} tokens)"
    if 0 < session_max_tokens < limit:
        # Reception sets the session limit from its EXPERT_SESSION_MAX_TOKENS and relays this error
        # to the client, so the message names the setting that bounds the session.
        limit, name = session_max_tokens, f"EXPERT_SESSION_MAX_TOKENS ({session_max_tokens})"
    room = limit - num_prompt_tokens
    if room < 1:
        raise SessionFullError(
            f"the session holds {num_prompt_tokens} tokens with this turn, and {name} leaves no room "
            "for a reply: end it and start a new one"
        )
    return room if requested is None or requested > room else requested


@dataclass
class _Session:
    session_id: str
    idle_seconds: float
    last_used: float
    parked: Sequence | None = None  # the last turn's sequence, holding its blocks
    active: str | None = None  # the request id of the turn running now
    evicted: bool = False  # its parked KV was given up under pressure since its last turn


@dataclass(frozen=True)
class SessionStats:
    sessions: int
    evictions_total: int
    recomputes_total: dict[str, int]  # by reason: evicted, diverged, new_here
    reused_tokens_total: int  # prompt tokens a turn found kept and did not compute


class SessionTable:
    def __init__(
        self, kv: KVCacheManager, max_sessions: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.kv = kv
        self.max_sessions = max_sessions
        self.clock = clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self._evictions = 0
        self._recomputes: Counter[str] = Counter()
        self._reused_tokens = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def active_request(self, session_id: str) -> str | None:
        session = self._sessions.get(session_id)
        return None if session is None else session.active

    def begin_turn(self, seq: Sequence, ref: SessionRef) -> int:
        """Register `seq` as the running turn of its session and give it the kept KV its prompt
        extends; returns the number of prompt tokens it will not compute. Raises SessionLimitError
        for a new session over the limit, SessionBusyError while another turn runs."""
        session = self._sessions.get(ref.session_id)
        now = self.clock()
        if session is None:
            if len(self._sessions) >= self.max_sessions:
                raise SessionLimitError(
                    f"this engine holds {len(self._sessions)} sessions, its limit "
                    f"(EXPERT_MAX_SESSIONS={self.max_sessions})"
                )
            session = _Session(ref.session_id, ref.idle_seconds, now)
            self._sessions[ref.session_id] = session
            reason = "new_here"
        else:
            if session.active is not None:
                raise SessionBusyError(f"session {ref.session_id!r} is already generating ({session.active})")
            reason = "evicted" if session.evicted else "diverged"
        session.idle_seconds = ref.idle_seconds
        session.active = seq.request_id
        session.last_used = now
        session.evicted = False
        self._sessions.move_to_end(ref.session_id)
        seq.session_id = ref.session_id
        reused = self._adopt(session, seq)
        if reused:
            self._reused_tokens += reused
        elif ref.history_tokens > 0:
            self._recomputes[reason] += 1
        return reused

    def _adopt(self, session: _Session, seq: Sequence) -> int:
        parked = self._unpark(session)
        if parked is None:
            return 0
        kept = parked.num_computed_tokens
        # A prompt that starts with the kept tokens (and leaves at least one to compute, whose
        # logits the next sample needs), under the same experts, continues from them.
        if not (
            0 < kept < seq.num_tokens
            and parked.adapter_key == seq.adapter_key
            and parked.num_virtual_tokens == seq.num_virtual_tokens
            and seq.token_ids[:kept] == parked.token_ids[:kept]
        ):
            self.kv.free(parked)
            return 0
        self.kv.transfer(parked, seq, kept)
        seq.num_computed_tokens = kept
        seq.num_cached_tokens = kept
        return kept

    def park(self, seq: Sequence) -> bool:
        """Keep a finished turn's blocks for the next turn; False when its session has ended (the
        caller frees them)."""
        session = self._sessions.get(seq.session_id) if seq.session_id is not None else None
        if session is None or session.active != seq.request_id:
            return False
        session.active = None
        session.last_used = self.clock()
        self._sessions.move_to_end(session.session_id)
        if seq.block_table and seq.num_computed_tokens:
            session.parked = seq
            self.kv.keep(seq)  # the pool counts its blocks (once each, however shared) as cached
        else:  # preempted, or stopped before any KV: nothing worth keeping
            self.kv.free(seq)
        return True

    def evict_one(self) -> bool:
        """Free the blocks of the least recently used idle session; False when none holds any."""
        for session in self._sessions.values():
            if session.parked is not None and session.active is None:
                self.kv.free(self._unpark(session))
                session.evicted = True
                self._evictions += 1
                return True
        return False

    def end(self, session_id: str) -> bool:
        """Forget a session and free what it keeps; its running turn, if any, is the caller's to
        abort (it is then freed, not parked). False for an unknown session."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        if session.parked is not None:
            self.kv.free(self._unpark(session))
        return True

    def _unpark(self, session: _Session) -> Sequence | None:
        parked, session.parked = session.parked, None
        if parked is not None:
            self.kv.unkeep(parked)
        return parked

    def expired(self, now: float | None = None) -> list[str]:
        """The idle sessions whose idle timeout has passed."""
        now = self.clock() if now is None else now
        return [
            s.session_id
            for s in self._sessions.values()
            if s.active is None and s.idle_seconds > 0 and now - s.last_used >= s.idle_seconds
        ]

    def stats(self) -> SessionStats:
        return SessionStats(
            sessions=len(self._sessions),
            evictions_total=self._evictions,
            recomputes_total=dict(self._recomputes),
            reused_tokens_total=self._reused_tokens,
        )
