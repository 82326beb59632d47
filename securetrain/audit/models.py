"""Database tables of the audit log (SQLModel).

Tables carry no schema; on PostgreSQL the log maps them into its schema with SQLAlchemy's
``schema_translate_map`` so several logs (and tests) can share one database.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, MetaData, Table, Text
from sqlmodel import Field, SQLModel

ENTRIES_TABLE = "audit_entries"
CHECKPOINTS_TABLE = "audit_checkpoints"


class AuditEntryRow(SQLModel, table=True):
    __tablename__ = ENTRIES_TABLE

    seq: int = Field(sa_column=Column(BigInteger, primary_key=True, autoincrement=False))
    ts: str = Field(max_length=32)
    actor: str = Field(max_length=256)
    hostname: str = Field(max_length=256)
    mac: str = Field(max_length=17)
    action: str = Field(max_length=128)
    resource: str = Field(max_length=1024)
    outcome: str = Field(max_length=32)
    details: str = Field(sa_column=Column(Text, nullable=False))  # RFC 8785 canonical JSON text
    prev_hash: str = Field(max_length=64)
    # Deliberately not UNIQUE: SQLite's INSERT OR REPLACE would delete a conflicting row.
    entry_hash: str = Field(max_length=64)
    # PostgreSQL: the server's view of the writer (canonical JSON text: role, addr, time), read by the
    # writer in its append transaction, hashed with the entry and re-checked by the insert trigger.
    # Not created on SQLite (no server to assert anything). PostgreSQL logs created before it existed
    # get it by ALTER TABLE (see AuditLog); their older rows keep NULL.
    server_view: str | None = Field(default=None, sa_column=Column(Text, nullable=True))


class AuditCheckpointRow(SQLModel, table=True):
    __tablename__ = CHECKPOINTS_TABLE

    tree_size: int = Field(sa_column=Column(BigInteger, primary_key=True, autoincrement=False))
    root_hash: str = Field(max_length=64)
    created_at: str = Field(max_length=32)
    note: str = Field(sa_column=Column(Text, nullable=False))


TABLES = [AuditEntryRow.__table__, AuditCheckpointRow.__table__]  # type: ignore[attr-defined]


def sqlite_tables() -> list[Table]:
    """The tables as created on SQLite: ``audit_entries`` without ``server_view``."""
    entries, checkpoints = TABLES
    meta = MetaData()
    return [Table(entries.name, meta, *(c._copy() for c in entries.c if c.name != "server_view")),
            checkpoints.to_metadata(meta)]
