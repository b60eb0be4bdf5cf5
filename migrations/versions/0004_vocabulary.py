"""One vocabulary: captured_size, num_real_tokens, padding_tokens (renames only; every row is kept).

- ``num_tokens`` of graphs, replay windows, replay totals and violations is a graph's padded size:
  ``captured_size``;
- ``real_tokens`` of replay windows and totals: ``num_real_tokens``; their ``padded_tokens`` (the
  padding, not the padded size): ``padding_tokens``;
- ``tokens`` of eager fallbacks and totals, ``num_tokens`` of batch-size counts are real tokens:
  ``num_real_tokens``.

SQLite renames in batch mode (the table is copied under the new names); PostgreSQL renames in place.
The indexes keep their names (the naming convention names them after their first column).

Revision ID: 0004_vocabulary
Revises: 0003_compile_events
Created: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_vocabulary"
down_revision = "0003_compile_events"
branch_labels = None
depends_on = None

RENAMES: dict[str, list[tuple[str, str, sa.types.TypeEngine]]] = {
    "graphs": [("num_tokens", "captured_size", sa.Integer())],
    "replay_windows": [
        ("num_tokens", "captured_size", sa.Integer()),
        ("real_tokens", "num_real_tokens", sa.BigInteger()),
        ("padded_tokens", "padding_tokens", sa.BigInteger()),
    ],
    "replay_totals": [
        ("num_tokens", "captured_size", sa.Integer()),
        ("real_tokens", "num_real_tokens", sa.BigInteger()),
        ("padded_tokens", "padding_tokens", sa.BigInteger()),
    ],
    "violations": [("num_tokens", "captured_size", sa.Integer())],
    "eager_fallbacks": [("tokens", "num_real_tokens", sa.BigInteger())],
    "eager_totals": [("tokens", "num_real_tokens", sa.BigInteger())],
    "batch_size_counts": [("num_tokens", "num_real_tokens", sa.Integer())],
}
"""table -> (old name, new name, type) per renamed column."""


def _rename(backwards: bool) -> None:
    for table, columns in RENAMES.items():
        with op.batch_alter_table(table) as batch:
            for old, new, type_ in columns:
                before, after = (new, old) if backwards else (old, new)
                batch.alter_column(
                    before, new_column_name=after, existing_type=type_, existing_nullable=False
                )


def upgrade() -> None:
    _rename(backwards=False)


def downgrade() -> None:
    _rename(backwards=True)
