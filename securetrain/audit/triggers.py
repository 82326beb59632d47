"""Database-side append-only enforcement (defence in depth under the hash chain).

SQLite: BEFORE UPDATE/DELETE triggers abort; a BEFORE INSERT trigger aborts unless the new row is
exactly ``max(seq)+1`` and links to the last entry's hash, which also defeats ``INSERT OR REPLACE``
(BEFORE INSERT triggers run before conflict resolution). ``recursive_triggers`` is enabled on every
connection so REPLACE-deletions would fire the delete trigger too.

PostgreSQL: row triggers on UPDATE/DELETE, a statement trigger on TRUNCATE, the same insert guard,
and (see :func:`securetrain.audit.postgres.provision_postgres`) grants leaving writers INSERT+SELECT.
The PostgreSQL insert guard also re-checks ``server_view`` (see :data:`SERVER_VIEW_SQL`): its
``role`` and ``addr`` must be the inserting session's ``current_user`` and
``host(inet_client_addr())`` and its ``time`` must lie between the start of the inserting
transaction (``now()``) and the moment of the insert (``clock_timestamp()``), so a client cannot
assert another role, address or time.
"""

from __future__ import annotations

from securetrain.audit.canonical import GENESIS_HASH


def sqlite_ddl() -> list[str]:
    stmts = []
    for table in ("audit_entries", "audit_checkpoints"):
        for op in ("UPDATE", "DELETE"):
            stmts.append(
                f"CREATE TRIGGER IF NOT EXISTS {table}_no_{op.lower()} BEFORE {op} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{table} is append-only: {op} refused'); END"
            )
    stmts.append(
        "CREATE TRIGGER IF NOT EXISTS audit_entries_insert_guard BEFORE INSERT ON audit_entries "
        "WHEN NEW.seq IS NOT (SELECT COALESCE(MAX(seq), -1) + 1 FROM audit_entries) "
        f"OR NEW.prev_hash IS NOT COALESCE((SELECT entry_hash FROM audit_entries ORDER BY seq DESC LIMIT 1), '{GENESIS_HASH}') "
        "BEGIN SELECT RAISE(ABORT, 'audit_entries is append-only: seq must be max+1 and prev_hash must link'); END"
    )
    stmts.append(
        "CREATE TRIGGER IF NOT EXISTS audit_checkpoints_insert_guard BEFORE INSERT ON audit_checkpoints "
        "WHEN NEW.tree_size <= (SELECT COALESCE(MAX(tree_size), -1) FROM audit_checkpoints) "
        "OR NEW.tree_size > (SELECT COALESCE(MAX(seq), -1) + 1 FROM audit_entries) "
        "OR length(NEW.root_hash) <> 64 OR NEW.root_hash GLOB '*[^0-9a-f]*' "
        "OR instr(NEW.note, char(10) || NEW.tree_size || char(10)) = 0 "
        "BEGIN SELECT RAISE(ABORT, 'audit_checkpoints is append-only: tree_size must grow, "
        "cover existing entries and match the note'); END"
    )
    return stmts


SQLITE_TRIGGER_NAMES = [
    "audit_entries_no_update", "audit_entries_no_delete", "audit_checkpoints_no_update",
    "audit_checkpoints_no_delete", "audit_entries_insert_guard", "audit_checkpoints_insert_guard",
]


#: The writer's view of itself, as the server sees it, read once per append transaction (after the
#: log's lock, so server times never decrease along ``seq``); ``time`` has the format of ``ts``.
SERVER_VIEW_SQL = (
    "current_user AS view_role, host(inet_client_addr()) AS view_addr, "
    "to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS view_time"
)


def postgres_upgrade_ddl(schema: str) -> list[str]:
    """Bring a log created by an older securetrain up to date (idempotent; needs the table owner)."""
    return [f'ALTER TABLE "{schema}".audit_entries ADD COLUMN IF NOT EXISTS server_view text', *postgres_ddl(schema)]


def postgres_ddl(schema: str) -> list[str]:
    s = f'"{schema}"'
    stmts = [
        f"""CREATE OR REPLACE FUNCTION {s}.audit_reject_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'audit log is append-only: % on % refused', TG_OP, TG_TABLE_NAME
    USING ERRCODE = 'insufficient_privilege';
END $$""",
        f"""CREATE OR REPLACE FUNCTION {s}.audit_entries_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE head_seq bigint; head_hash text; sv jsonb; sv_time timestamptz; ok boolean := false;
BEGIN
  SELECT seq, entry_hash INTO head_seq, head_hash FROM {s}.audit_entries ORDER BY seq DESC LIMIT 1;
  IF NOT FOUND THEN head_seq := -1; head_hash := '{GENESIS_HASH}'; END IF;
  IF NEW.seq <> head_seq + 1 OR NEW.prev_hash <> head_hash THEN
    RAISE EXCEPTION 'audit_entries is append-only: seq must be max+1 and prev_hash must link'
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  -- server_view: the server's own view of this session, never one the client chose.
  BEGIN
    sv := NEW.server_view::jsonb;
  EXCEPTION WHEN OTHERS THEN sv := NULL;
  END;
  IF sv IS NOT NULL AND jsonb_typeof(sv) = 'object' THEN
    IF sv ?& ARRAY['addr', 'role', 'time'] AND sv - ARRAY['addr', 'role', 'time'] = '{{}}'::jsonb
       AND jsonb_typeof(sv -> 'role') = 'string' AND jsonb_typeof(sv -> 'time') = 'string'
       AND jsonb_typeof(sv -> 'addr') IN ('string', 'null') THEN
      IF sv ->> 'role' = current_user::text AND (sv ->> 'addr') IS NOT DISTINCT FROM host(inet_client_addr())
         AND sv ->> 'time' ~ '^[0-9]{{4}}-[0-9]{{2}}-[0-9]{{2}}T[0-9]{{2}}:[0-9]{{2}}:[0-9]{{2}}[.][0-9]{{6}}Z$' THEN
        BEGIN
          sv_time := (sv ->> 'time')::timestamptz;
        EXCEPTION WHEN OTHERS THEN sv_time := NULL;
        END;
        ok := sv_time IS NOT NULL AND sv_time >= now() AND sv_time <= clock_timestamp();
      END IF;
    END IF;
  END IF;
  IF NOT ok THEN
    RAISE EXCEPTION 'audit_entries: server_view must be the session''s own role, client address and server time'
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NEW;
END $$""",
        f"""CREATE OR REPLACE FUNCTION {s}.audit_checkpoints_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE note_root text;
BEGIN
  IF NEW.tree_size <= COALESCE((SELECT MAX(tree_size) FROM {s}.audit_checkpoints), -1) THEN
    RAISE EXCEPTION 'audit_checkpoints is append-only: tree_size must grow'
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  IF NEW.tree_size > COALESCE((SELECT MAX(seq) FROM {s}.audit_entries), -1) + 1 THEN
    RAISE EXCEPTION 'audit_checkpoints is append-only: checkpoint covers entries that do not exist'
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  BEGIN
    note_root := encode(decode(split_part(NEW.note, E'\n', 3), 'base64'), 'hex');
  EXCEPTION WHEN OTHERS THEN note_root := NULL;
  END;
  IF split_part(NEW.note, E'\n', 2) <> NEW.tree_size::text OR note_root IS DISTINCT FROM NEW.root_hash
     OR NEW.root_hash !~ '^[0-9a-f]{{64}}$' THEN
    RAISE EXCEPTION 'audit_checkpoints is append-only: note, tree_size and root_hash must agree'
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NEW;
END $$""",
    ]
    for table in ("audit_entries", "audit_checkpoints"):
        stmts.append(
            f"CREATE OR REPLACE TRIGGER {table}_no_change BEFORE UPDATE OR DELETE ON {s}.{table} "
            f"FOR EACH ROW EXECUTE FUNCTION {s}.audit_reject_change()"
        )
        stmts.append(
            f"CREATE OR REPLACE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {s}.{table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {s}.audit_reject_change()"
        )
        stmts.append(
            f"CREATE OR REPLACE TRIGGER {table}_insert_guard BEFORE INSERT ON {s}.{table} "
            f"FOR EACH ROW EXECUTE FUNCTION {s}.{table}_guard()"
        )
    return stmts
