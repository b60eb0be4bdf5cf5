"""The inspector's tables (SQLAlchemy 2.0, typed). Times are UNIX epoch seconds (UTC) as floats.

Schema changes go through an Alembic migration in ``migrations/versions`` (a test compares the two).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class FoldableWindow:
    """A row of a traffic table that retention may fold (``inspector.storage.retention``)."""

    windows: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    """How many flush windows the row holds: 1 as a recorder writes it, more once folded."""


class DescriptorColumns:
    """The BatchDescriptor's fields, flattened into every table keyed by a graph."""

    mode: Mapped[str] = mapped_column(String(32))
    captured_size: Mapped[int] = mapped_column(Integer)
    """The token count the graph was captured at (``BatchDescriptor.num_tokens``)."""
    num_reqs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    uniform: Mapped[bool] = mapped_column(Boolean, default=False)
    has_lora: Mapped[bool] = mapped_column(Boolean, default=False)
    num_active_loras: Mapped[int] = mapped_column(Integer, default=0)
    descriptor_key: Mapped[str] = mapped_column(String(128))


class Run(Base):
    """One engine process (one rank) recording into the database."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    label: Mapped[str] = mapped_column(String(200), default="")
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    process: Mapped[str] = mapped_column(String(500))
    rank: Mapped[int] = mapped_column(Integer, default=0)
    world_size: Mapped[int] = mapped_column(Integer, default=1)
    device: Mapped[str] = mapped_column(String(200))
    backend: Mapped[str] = mapped_column(String(32))
    config: Mapped[str] = mapped_column(Text, default="{}")
    """JSON: the capture configuration (mode, sizes, checks, policy, model size...)."""
    started_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)
    """Bumped on every flush: a run whose last_seen_at is recent and ended_at is null is live."""
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    dropped_events: Mapped[int] = mapped_column(BigInteger, default=0)
    """Events the recorder could not keep: the sum of the four kinds below
    (``inspector.recording.losses``)."""
    dropped_captures: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    dropped_violations: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """Occurrences, as ``violations.count`` counts them."""
    dropped_replays: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    dropped_eager_batches: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    dropped_real_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """The ``num_real_tokens`` of the dropped replays and eager batches."""
    job: Mapped[str | None] = mapped_column(String(200), nullable=True)
    """The distributed job the run is a rank of (torchrun's run id, SLURM's job id, or given); its
    ranks are checked against each other (``inspector.ranks.check``). None: not part of a known job."""

    graphs: Mapped[list[Graph]] = relationship(back_populates="run", cascade="all, delete-orphan")

    __table_args__ = (Index(None, "started_at"), Index(None, "job", "rank"))


class Graph(DescriptorColumns, Base):
    """One captured graph: its key, what it baked in, what it cost."""

    __tablename__ = "graphs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    wrapper: Mapped[str] = mapped_column(String(200))
    backend: Mapped[str] = mapped_column(String(32))
    input_names: Mapped[str] = mapped_column(Text, default="[]")
    """JSON list of input names (``args[0]``, ``input_ids``, ``kv_caches[3]``...)."""
    input_addresses: Mapped[str] = mapped_column(Text, default="[]")
    """JSON list of integer device addresses, one per input name."""
    capture_seconds: Mapped[float] = mapped_column(Float)
    pool_bytes: Mapped[int] = mapped_column(BigInteger)
    warmup_iters: Mapped[int] = mapped_column(Integer)
    num_segments: Mapped[int] = mapped_column(Integer, default=1)
    num_ubatches: Mapped[int] = mapped_column(Integer, default=1)
    ubatch_slices: Mapped[str] = mapped_column(Text, default="[]")
    """JSON list of [req_start, req_stop, token_start, token_stop] per ubatch."""
    unexpected: Mapped[bool] = mapped_column(Boolean, default=False)
    captured_at: Mapped[float] = mapped_column(Float)
    engine_key: Mapped[str] = mapped_column(String(500), default="", server_default="")
    """The capturing engine's own key for the graph (vLLM's descriptor), where an engine captured it."""
    discarded: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """Captured only to be thrown away (vLLM's memory profiling): not a graph that serves steps."""

    run: Mapped[Run] = relationship(back_populates="graphs")

    __table_args__ = (
        Index(None, "run_id", "mode", "captured_size"),
        Index(None, "descriptor_key"),
        Index(None, "captured_at"),
    )


class ReplayWindow(FoldableWindow, DescriptorColumns, Base):
    """Replays of one graph within one flush window."""

    __tablename__ = "replay_windows"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    graph_id: Mapped[int | None] = mapped_column(ForeignKey("graphs.id", ondelete="SET NULL"), nullable=True)
    window_start: Mapped[float] = mapped_column(Float)
    window_end: Mapped[float] = mapped_column(Float)
    replays: Mapped[int] = mapped_column(BigInteger)
    num_real_tokens: Mapped[int] = mapped_column(BigInteger)
    padding_tokens: Mapped[int] = mapped_column(BigInteger)
    """Captured size times replays, less the real tokens."""

    __table_args__ = (
        Index(None, "run_id", "window_start"),
        Index(None, "graph_id", "window_start"),
        Index(None, "window_start"),
    )


class EagerFallback(FoldableWindow, Base):
    """Batches that ran eagerly within one flush window, by reason."""

    __tablename__ = "eager_fallbacks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    window_start: Mapped[float] = mapped_column(Float)
    window_end: Mapped[float] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(String(64))
    mode: Mapped[str] = mapped_column(String(32))
    """The runtime mode the batch would have replayed in."""
    batches: Mapped[int] = mapped_column(BigInteger)
    num_real_tokens: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (Index(None, "run_id", "window_start"), Index(None, "reason"))


class BatchSizeCount(FoldableWindow, Base):
    """How many batches of each real token count arrived within one flush window."""

    __tablename__ = "batch_size_counts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    window_start: Mapped[float] = mapped_column(Float)
    num_real_tokens: Mapped[int] = mapped_column(Integer)
    batches: Mapped[int] = mapped_column(BigInteger)
    uniform_batches: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    """Of those, the batches that replayed a uniform-decode graph (the decode steps, which SGLang's and
    TensorRT-LLM's decode graphs serve, apart from mixed prefill steps); None where the writer could
    not tell (rows written before it was counted, a watched engine)."""

    __table_args__ = (
        Index(None, "run_id", "num_real_tokens"),
        # Retention folds a run's rows by time (the name: the convention's would clash with the above).
        Index("ix_batch_size_counts_run_id_window_start", "run_id", "window_start"),
    )


class Violation(DescriptorColumns, Base):
    """An address drift or unexpected capture. Repeats of the same finding bump count/last_seen_at."""

    __tablename__ = "violations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    wrapper: Mapped[str] = mapped_column(String(200))
    input_name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    expected_address: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    actual_address: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    message: Mapped[str] = mapped_column(Text)
    stack: Mapped[str] = mapped_column(Text, default="")
    injected: Mapped[bool] = mapped_column(Boolean, default=False)
    count: Mapped[int] = mapped_column(Integer, default=1)
    first_seen_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (
        Index(None, "run_id", "kind"),
        Index(None, "kind", "first_seen_at"),
        Index(None, "first_seen_at"),
    )


class Divergence(DescriptorColumns, Base):
    """Where a graph and the same step run eagerly part: the first module whose output differs, as a
    probe found it after a ``replay_mismatch`` or on demand (``capture_core.locate``). One row each."""

    __tablename__ = "divergences"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    wrapper: Mapped[str] = mapped_column(String(200))
    module: Mapped[str | None] = mapped_column(String(500), nullable=True)
    """The first module whose output differs (None: none located; ``message`` says why)."""
    max_abs_error: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_rel_error: Mapped[float | None] = mapped_column(Float, nullable=True)
    agreeing: Mapped[str] = mapped_column(Text, default="[]")
    """JSON list: the modules that finished before it and agree (the outermost of them)."""
    modules_compared: Mapped[int] = mapped_column(Integer, default=0)
    reproduced: Mapped[bool] = mapped_column(Boolean, default=False)
    probe: Mapped[str] = mapped_column(String(200))
    message: Mapped[str] = mapped_column(Text)
    injected: Mapped[bool] = mapped_column(Boolean, default=False)
    seen_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (Index(None, "run_id", "mode", "descriptor_key"),)


class ReplayTotal(DescriptorColumns, Base):
    """Running totals of one graph key's replays in one run (one row per run, mode and descriptor).

    The recorder bumps it in the same transaction that appends the replay windows, so the two always
    agree; the Prometheus collector sums these few rows instead of scanning every window.
    """

    __tablename__ = "replay_totals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    graph_id: Mapped[int | None] = mapped_column(ForeignKey("graphs.id", ondelete="SET NULL"), nullable=True)
    replays: Mapped[int] = mapped_column(BigInteger, default=0)
    num_real_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    padding_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (
        UniqueConstraint("run_id", "mode", "descriptor_key"),
        Index(None, "mode", "captured_size"),
    )


class StepTime(DescriptorColumns, Base):
    """Timed steps of one graph key in one run: sums and sample counts, bumped like ``ReplayTotal``.

    ``graph_*`` are the graph's sampled replays, ``eager_*`` the same step run without a graph (the
    canary's eager steps; for mode ``none``, the eager fallbacks of that many real tokens), timed as
    ``clock`` says (``cuda_events`` or ``host_clock``: see ``capture_core.step_time``).
    """

    __tablename__ = "step_times"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    graph_id: Mapped[int | None] = mapped_column(ForeignKey("graphs.id", ondelete="SET NULL"), nullable=True)
    clock: Mapped[str] = mapped_column(String(16))
    graph_samples: Mapped[int] = mapped_column(BigInteger, default=0)
    graph_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    """The sum over the graph's timed replays."""
    eager_samples: Mapped[int] = mapped_column(BigInteger, default=0)
    eager_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    """The sum over the timed eager steps of the same size."""
    updated_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (
        UniqueConstraint("run_id", "mode", "descriptor_key"),
        Index(None, "graph_id"),
    )


class EagerTotal(Base):
    """Running totals of one run's eager batches per reason and mode (see ReplayTotal for why)."""

    __tablename__ = "eager_totals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    reason: Mapped[str] = mapped_column(String(64))
    mode: Mapped[str] = mapped_column(String(32))
    batches: Mapped[int] = mapped_column(BigInteger, default=0)
    num_real_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (UniqueConstraint("run_id", "reason", "mode"),)


class StepSequence(Base):
    """The graphs one rank ran, step by step, over one flush window: what ranks of a job compare.

    ``sequence`` is run-length encoded JSON, ``[[label, steps], ...]`` in step order, a label being
    a graph's mode and descriptor key (``full tokens=8,reqs=8,uniform``), ``eager`` for a batch run
    without a graph, or ``idle`` for a coordinated step that ran no batch. Steps are counted from
    the run's start: ``first_step`` is the window's first.
    """

    __tablename__ = "step_sequences"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    first_step: Mapped[int] = mapped_column(BigInteger)
    steps: Mapped[int] = mapped_column(Integer)
    window_start: Mapped[float] = mapped_column(Float)
    window_end: Mapped[float] = mapped_column(Float)
    sequence: Mapped[str] = mapped_column(Text)

    __table_args__ = (Index(None, "run_id", "first_step"),)


class CompileRecord(Base):
    """torch.compile's cudagraph trees skipping or re-recording graphs, with the compiler's reason.

    Written by ``graph-inspector watch``. Repeats of the same kind, function and reason in one run
    bump ``count`` and ``last_seen_at``.
    """

    __tablename__ = "compile_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    """``compile_skip`` or ``compile_rerecord``."""
    function: Mapped[str] = mapped_column(String(200), default="")
    reason: Mapped[str] = mapped_column(Text)
    message: Mapped[str] = mapped_column(Text)
    count: Mapped[int] = mapped_column(Integer, default=1)
    first_seen_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (Index(None, "run_id", "kind"), Index(None, "first_seen_at"))


class WindowFold(Base):
    """One retention transaction: a run's traffic rows in ``[range_start, range_end)`` folded into
    windows ``grain`` seconds wide, every count kept (``inspector.storage.retention``).

    The daemon's rollup reads this table to know that rows it has summed were replaced: it skips
    folded rows when it had read past every row a fold removed, and rebuilds otherwise.
    """

    __tablename__ = "window_folds"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    folded_at: Mapped[float] = mapped_column(Float)
    range_start: Mapped[float] = mapped_column(Float)
    range_end: Mapped[float] = mapped_column(Float)
    grain: Mapped[float] = mapped_column(Float)
    rows_removed: Mapped[int] = mapped_column(BigInteger)
    rows_added: Mapped[int] = mapped_column(BigInteger)
    last_replay_window_id: Mapped[int] = mapped_column(BigInteger, default=0)
    """The newest ``replay_windows`` row of the slice when it was folded (every row the fold
    removed is at most this; 0: none)."""
    last_eager_fallback_id: Mapped[int] = mapped_column(BigInteger, default=0)
    last_batch_size_id: Mapped[int] = mapped_column(BigInteger, default=0)

    __table_args__ = (Index(None, "run_id"),)
