"""The ledger: who did how much work, who received how many tokens, and which key each node id owns.

Stored with SQLAlchemy: an SQLite file by default (:func:`~meshnet.ledger.database.default_ledger_url`), PostgreSQL by URL
(``postgresql://user:pass@host/db``, with the ``postgres`` extra installed; see
:mod:`meshnet.ledger.database`). The schema is versioned by the Alembic migrations shipped in
``meshnet/ledger/migrations``; :class:`Ledger` runs ``upgrade head`` when it opens a database, so a
tracker started on an old file brings it up to date and one restarted on the same file finds every
balance where it left it.

Units: node work is counted in *token-layers*, one token through one layer; a node's share in whole-model
tokens is its token-layers divided by the model's layer count. Clients are charged one unit per token
delivered to them.

One tracker process writes a ledger at a time (writes are serialized by a lock inside :class:`Ledger`);
several trackers sharing one database are not supported, and a second tracker opening an SQLite file
or PostgreSQL database another tracker holds is refused (:func:`~meshnet.ledger.hold.hold_ledger`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

from sqlalchemy import BigInteger, and_, bindparam, case, func, select, text
from sqlalchemy.exc import SQLAlchemyError

from meshnet.ledger.credit import Rect, new_area
from meshnet.ledger.database import LedgerError, db_error, is_memory, make_ledger_engine, sqlite_path, upgrade
from meshnet.ledger.hold import LOCK_WAIT_S, PostgresHold, hold_ledger
from meshnet.ledger.schema import deliveries, node_keys, work

MAX_ID_CHARS = 256  # session, client and node ids longer than this are refused (column width)


@dataclass(frozen=True)
class WorkRecord:
    """One step a node completed: ``n_tokens`` tokens from ``position`` on, through its layers.

    Attributes:
        node_id: the node that did it.
        model_sha256, n_layer: the model, and its total layer count (the denominator of a node's share).
        session_id: the client's session.
        layer_start, layer_end: the node's half-open layer range.
        position: index of the step's first token in the session.
        n_tokens: tokens in the step (>= 1).
        decode: a decode step (one new token) rather than a prefill.
    """

    node_id: str
    model_sha256: str
    n_layer: int
    session_id: str
    layer_start: int
    layer_end: int
    position: int
    n_tokens: int
    decode: bool

    @property
    def key(self) -> tuple:
        """What makes two reports the same step (the node that ran it is not part of it: a replacement
        replaying a dead node's step repeats that step)."""
        return (self.model_sha256, self.session_id, self.layer_start, self.layer_end, self.position, self.n_tokens)

    @property
    def rect(self) -> Rect:
        return Rect(self.position, self.position + self.n_tokens, self.layer_start, self.layer_end)

    def problem(self) -> str | None:
        """None when the record can be stored, else what is wrong with it."""
        if not self.node_id or len(self.node_id) > MAX_ID_CHARS:
            return f"node id must be 1..{MAX_ID_CHARS} characters"
        if not self.session_id or len(self.session_id) > MAX_ID_CHARS:
            return f"session id must be 1..{MAX_ID_CHARS} characters, got {len(self.session_id)}"
        if not self.model_sha256 or len(self.model_sha256) > 64:
            return "model sha256 must be 1..64 characters"
        if not 0 <= self.layer_start < self.layer_end <= self.n_layer:
            return (f"layer range [{self.layer_start}, {self.layer_end}) is not inside a model of "
                    f"{self.n_layer} layers")
        if self.n_tokens < 1 or self.position < 0:
            return f"step at position {self.position} with {self.n_tokens} tokens: need position >= 0, n_tokens >= 1"
        if self.position + self.n_tokens > 1 << 62:
            return f"position {self.position} is out of range"
        return None


@dataclass(frozen=True)
class WorkOutcome:
    """What :meth:`Ledger.record_work` did: ``recorded`` new steps (``credited`` token-layers among them)
    and ``duplicates`` already stored."""

    recorded: int
    duplicates: int
    credited: int


@dataclass(frozen=True)
class NodeBalance:
    """A node's credit for one model.

    Attributes:
        prefill_token_layers, decode_token_layers: credited token-layers by kind of step.
        steps: distinct steps stored for the node (an exact repeat of a stored step, such as a replay
            on the same range after a failover or a resend, is not stored again, whoever reports it).
        uncredited_steps: of ``steps``, those whose work was partly credited before (a replacement with
            another layer range replaying positions already run).
    """

    node_id: str
    model_sha256: str
    n_layer: int
    prefill_token_layers: int
    decode_token_layers: int
    steps: int
    uncredited_steps: int

    @property
    def token_layers(self) -> int:
        return self.prefill_token_layers + self.decode_token_layers

    @property
    def tokens(self) -> float:
        """Credit in whole-model tokens: token-layers / n_layer."""
        return self.token_layers / self.n_layer if self.n_layer else 0.0


@dataclass(frozen=True)
class ClientBalance:
    """What a client is charged: ``delivered_tokens`` over ``sessions`` sessions."""

    client_id: str
    delivered_tokens: int
    sessions: int


def _overlapping_steps():
    """The statement :func:`_stored_steps` runs, its values bound at each run (``model``, ``session``, ``lo``,
    ``hi``). ``lo`` and ``hi`` are 64-bit: beside the 32-bit ``n_tokens`` they would be sent as INTEGERs,
    which PostgreSQL refuses past 2**31 (positions go to 2**62)."""
    same = and_(work.c.model_sha256 == bindparam("model"), work.c.session_id == bindparam("session"))
    lo, hi = bindparam("lo", type_=BigInteger), bindparam("hi", type_=BigInteger)
    longest = select(func.coalesce(func.max(work.c.n_tokens), 1)).where(same).scalar_subquery()
    return (select(work.c.layer_start, work.c.layer_end, work.c.position, work.c.n_tokens)
            .where(same, work.c.position < hi, work.c.position > lo - longest, work.c.position + work.c.n_tokens > lo))


# Built once: building the expression and its cache key again for each session of each report was most of
# the ledger's time (record_work on a report of 80 decode steps of 8 sessions: 8.7-14.0 ms, 6.0-6.5 built once).
_OVERLAPPING_STEPS = _overlapping_steps()


def _stored_steps(conn, model: str, session: str, items: list[WorkRecord]) -> list[tuple]:
    """The stored steps of ``session`` that overlap its new records ``items``, as ``(layer_start, layer_end,
    position, n_tokens)`` rows, in one statement of one shape (compiled once).

    A stored step overlaps ``[lo, hi)`` when it starts before ``hi`` and ends after ``lo``; the position index
    bounds the rows read to those starting less than the session's longest step before ``lo``. Only the
    overlapping ones come back: a tracker gets every node's steps of every session each heartbeat, and
    making a Python row of each step in that neighbourhood (a prompt's length of decode steps a node) was
    most of the ledger's time in a busy ``meshnet up``."""
    lo = min(r.position for r in items)
    hi = max(r.position + r.n_tokens for r in items)
    return conn.execute(_OVERLAPPING_STEPS, {"model": model, "session": session, "lo": lo, "hi": hi}).all()


class Ledger:
    """The tracker's ledger over one database (thread-safe).

    Args:
        url: SQLAlchemy URL; ``"sqlite://"`` (the default) is an in-memory database that lives as long as
            this object.
        clock: Unix seconds for ``recorded_at`` columns.
        lock_wait_s: how long to wait for another process holding the same SQLite file to let go.

    Raises:
        LedgerError: the database cannot be opened or migrated.
    """

    def __init__(self, url: str = "sqlite://", clock: Callable[[], float] = time.time,
                 lock_wait_s: float = LOCK_WAIT_S) -> None:
        self.url = url
        self._clock = clock
        self._engine = make_ledger_engine(url)
        self._lock = threading.RLock()
        self._keys: dict[str, bytes] = {}
        self._holder = None
        try:
            self._holder = hold_ledger(self._engine, lock_wait_s)
            upgrade(self._engine)
            self._check_writable()
        except BaseException:
            self.close()
            raise

    @property
    def display_url(self) -> str:
        """The URL with any password masked, for logs; an SQLite file's absolute path beside it."""
        url = self._engine.url
        shown = url.render_as_string(hide_password=True)
        if url.get_backend_name() == "sqlite" and not is_memory(url):
            shown += f" (file {sqlite_path(url).expanduser().resolve()})"
        return shown

    def close(self) -> None:
        """Release the database connections (an in-memory ledger is gone afterwards) and the file."""
        self._engine.dispose()
        if self._holder is not None:
            self._holder.close()
            self._holder = None

    def _check_writable(self) -> None:
        """A write that is rolled back: a ledger already at the newest schema needs none to open, and one
        that could not be written (a read-only file or role) refused every node's registration later,
        with nothing said at start. Raises LedgerError."""
        try:
            with self._engine.connect() as conn, conn.begin() as tx:
                conn.execute(text("UPDATE alembic_version SET version_num = version_num"))
                tx.rollback()
        except SQLAlchemyError as e:
            raise LedgerError(f"ledger {self.display_url} cannot be written: {db_error(e)}") from None

    @contextlib.contextmanager
    def _reading(self):
        """A connection for reads; a database error becomes :class:`LedgerError` in one line."""
        try:
            with self._engine.connect() as conn:
                yield conn
        except SQLAlchemyError as e:
            raise LedgerError(f"ledger read failed: {db_error(e)}") from None

    @contextlib.contextmanager
    def _writing(self):
        """A transaction for writes, while this tracker still holds the ledger (a PostgreSQL session's
        lock can end under it: :meth:`PostgresHold.check <meshnet.ledger.hold.PostgresHold.check>`); a
        database error becomes :class:`LedgerError` in one line. Call with ``self._lock`` held."""
        if isinstance(self._holder, PostgresHold):
            self._holder.check()
        try:
            with self._engine.begin() as conn:
                yield conn
        except SQLAlchemyError as e:
            raise LedgerError(f"ledger write failed: {db_error(e)}") from None

    # ---- node work ---------------------------------------------------------------------------------

    def record_work(self, records: Iterable[WorkRecord]) -> WorkOutcome:
        """Store each new step once and credit the part of it no earlier step covered.

        A record whose key (model, session, layer range, position, n_tokens) is stored already is a
        duplicate and changes nothing; so is its repeat within ``records``. All records are stored in one
        transaction: either the whole batch is recorded or none of it.

        Raises:
            ValueError: a record is malformed (:meth:`WorkRecord.problem` names it); nothing is stored.
            LedgerError: the database failed; nothing is stored.
        """
        records = list(records)
        for r in records:
            problem = r.problem()
            if problem:
                raise ValueError(f"work record for session {r.session_id[:64]!r}: {problem}")
        groups: dict[tuple[str, str], list[WorkRecord]] = defaultdict(list)
        for r in records:
            groups[(r.model_sha256, r.session_id)].append(r)
        recorded = duplicates = credited = 0
        now = self._clock()
        with self._lock:
            with self._writing() as conn:
                new_rows = []
                for (model, session), items in groups.items():
                    rows = _stored_steps(conn, model, session, items)
                    keys = {(model, session, *row) for row in rows}
                    rects = [Rect(p, p + n, ls, le) for ls, le, p, n in rows]
                    for r in items:
                        if r.key in keys:
                            duplicates += 1
                            continue
                        area = new_area(r.rect, rects)
                        keys.add(r.key)
                        rects.append(r.rect)
                        new_rows.append(dict(model_sha256=model, session_id=session, layer_start=r.layer_start,
                                             layer_end=r.layer_end, position=r.position, n_tokens=r.n_tokens,
                                             decode=r.decode, node_id=r.node_id, n_layer=r.n_layer,
                                             credited_token_layers=area, recorded_at=now))
                        recorded += 1
                        credited += area
                if new_rows:  # one insert for the whole report
                    conn.execute(work.insert(), new_rows)
        return WorkOutcome(recorded, duplicates, credited)

    def node_balances(self) -> list[NodeBalance]:
        """Every node's credit per model, sorted by node id then model."""
        full = work.c.n_tokens * (work.c.layer_end - work.c.layer_start)
        q = (select(work.c.node_id, work.c.model_sha256, func.max(work.c.n_layer),
                    func.sum(case((work.c.decode, 0), else_=work.c.credited_token_layers)),
                    func.sum(case((work.c.decode, work.c.credited_token_layers), else_=0)),
                    func.count(),
                    func.sum(case((work.c.credited_token_layers < full, 1), else_=0)))
             .group_by(work.c.node_id, work.c.model_sha256).order_by(work.c.node_id, work.c.model_sha256))
        with self._lock, self._reading() as conn:
            return [NodeBalance(node, model, int(n_layer), int(pre or 0), int(dec or 0), int(steps), int(unc or 0))
                    for node, model, n_layer, pre, dec, steps, unc in conn.execute(q)]

    # ---- client deliveries -------------------------------------------------------------------------

    def record_deliveries(self, client_id: str, tokens: Iterable[tuple[str, int]],
                          model_sha256: str = "") -> tuple[int, int]:
        """Charge ``client_id`` one unit per ``(session_id, position)`` not charged before.

        Returns:
            ``(recorded, duplicates)``.

        Raises:
            ValueError: an empty or over-long id, or a negative position; nothing is stored.
            LedgerError: the database failed; nothing is stored.
        """
        tokens = [(s, int(p)) for s, p in tokens]
        if not client_id or len(client_id) > MAX_ID_CHARS:
            raise ValueError(f"client id must be 1..{MAX_ID_CHARS} characters, got {len(client_id)}")
        if len(model_sha256) > 64:
            raise ValueError("model sha256 must be at most 64 characters")
        for s, p in tokens:
            if not s or len(s) > MAX_ID_CHARS:
                raise ValueError(f"session id must be 1..{MAX_ID_CHARS} characters, got {len(s)}")
            if not 0 <= p < 1 << 62:
                raise ValueError(f"session {s[:64]!r}: position {p} is out of range")
        recorded = duplicates = 0
        now = self._clock()
        with self._lock:
            with self._writing() as conn:
                by_session: dict[str, list[int]] = defaultdict(list)
                for s, p in tokens:
                    by_session[s].append(p)
                new_rows = []
                for s, positions in by_session.items():
                    seen = set(conn.execute(select(deliveries.c.position).where(
                        deliveries.c.client_id == client_id, deliveries.c.session_id == s,
                        deliveries.c.position.between(min(positions), max(positions)))).scalars())
                    for p in positions:
                        if p in seen:
                            duplicates += 1
                            continue
                        seen.add(p)
                        new_rows.append(dict(client_id=client_id, session_id=s, position=p,
                                             model_sha256=model_sha256, recorded_at=now))
                        recorded += 1
                if new_rows:
                    conn.execute(deliveries.insert(), new_rows)
        return recorded, duplicates

    def client_balances(self) -> list[ClientBalance]:
        """Every client's delivered tokens, sorted by client id."""
        q = (select(deliveries.c.client_id, func.count(), func.count(func.distinct(deliveries.c.session_id)))
             .group_by(deliveries.c.client_id).order_by(deliveries.c.client_id))
        with self._lock, self._reading() as conn:
            return [ClientBalance(c, int(n), int(s)) for c, n, s in conn.execute(q)]

    # ---- node keys (meshnet.membership.auth.KeyBindings) -------------------------------------------

    def node_key(self, node_id: str) -> bytes | None:
        """The public key bound to ``node_id``, or None."""
        with self._lock:
            key = self._keys.get(node_id)
            if key is None:
                with self._reading() as conn:
                    key = conn.execute(select(node_keys.c.public_key)
                                       .where(node_keys.c.node_id == node_id)).scalar()
                if key is not None:
                    key = self._keys[node_id] = bytes(key)
            return key

    def bind_node_key(self, node_id: str, public_key: bytes) -> bytes:
        """Bind ``node_id`` to ``public_key`` unless bound already; returns the key bound now.

        Raises:
            LedgerError: the database failed.
        """
        with self._lock:
            existing = self.node_key(node_id)
            if existing is not None:
                return existing
            with self._writing() as conn:
                conn.execute(node_keys.insert().values(node_id=node_id, public_key=bytes(public_key),
                                                       bound_at=self._clock()))
            self._keys[node_id] = bytes(public_key)
            return self._keys[node_id]
