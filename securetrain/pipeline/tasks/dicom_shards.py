"""De-identification in shards: the unit a task runner (threads, Dask, Ray) schedules and a rerun skips.

The manifest's rows are cut into fixed shards by row index. :func:`run_shard` de-identifies one
shard into the shared output folder (``NNNNNN.dcm`` by global row index) with its own
:class:`Deidentifier`; every keyed value (UIDs, pseudonyms, date shifts) depends only on the key and
the file, so the bytes written do not depend on which worker saw which file. Audit events are not
recorded by workers: they travel back in the :class:`ShardResult` and the pipeline records them in
shard order, so the log is the same for every runner.

Each finished shard leaves ``<out>/.shards/shard-NNNNN.bin``: the result (outcomes, output SHA-256s,
pseudonym mapping entries, audit events) as JSON, AES-256-GCM encrypted under a key derived from the
run's de-identification secret (the mapping holds original patient ids), with the shard's index and
inputs (paths and content digests) and policy digest bound as associated data. :func:`completed_shard` returns it only when it decrypts and every
output file still has its recorded digest; otherwise the shard runs again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from securetrain.io.atomic import atomic_write_bytes

SHARD_DIR = ".shards"
_KEY_LABEL = b"securetrain/pipeline/deid-shard\x00"


@dataclass(frozen=True)
class ShardSpec:
    """Rows ``(global row index, source path)`` of one shard."""

    index: int
    rows: tuple[tuple[int, str], ...]

    def binding(self, policy_digest: str, read: Mapping[int, str] | None = None) -> bytes:
        """What the shard's result is bound to: its index, the policy it was de-identified under
        (a changed policy re-runs it) and its inputs: the paths (an edited manifest re-runs it) and
        each file's SHA-256 (a file replaced in place re-runs it; the content, not the modification
        time, so inputs regenerated or copied byte for byte still resume). ``read``: the digests
        de-identification took of the bytes it read (row -> SHA-256), used as they are; any other
        input is hashed here, which on a rerun is far less work than de-identifying it again."""
        h = hashlib.sha256(f"shard:{self.index}\x00policy:{policy_digest}\x00".encode())
        for row, path in self.rows:
            identity = (read or {}).get(row) or _file_sha256(Path(path)) or "missing"
            h.update(f"{row}\x00{path}\x00{identity}\x00".encode())
        return h.digest()


@dataclass
class RowOutcome:
    row: int
    outcome: str  # written | rejected | quarantined
    reason: str | None = None
    tags_changed: int = 0
    pseudonym: str = ""
    sha256: str | None = None  # of the written output
    # quarantined: why, as `securetrain deid` says it (no input path: the row is the label)
    detail: str | None = None


@dataclass
class ShardResult:
    index: int
    rows: list[RowOutcome] = field(default_factory=list)
    pseudonyms: dict[str, str] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    resumed: bool = False

    def to_json(self) -> bytes:
        data = asdict(self)
        data.pop("resumed")
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ShardResult:
        data = json.loads(raw)
        return cls(index=data["index"], rows=[RowOutcome(**r) for r in data["rows"]],
                   pseudonyms=dict(data["pseudonyms"]), events=list(data["events"]))


def plan_shards(sources: Sequence[str | os.PathLike[str]], shard_size: int) -> list[ShardSpec]:
    """Cut the manifest's rows (in manifest order) into shards of ``shard_size`` rows."""
    rows = [(i, str(p)) for i, p in enumerate(sources)]
    return [ShardSpec(index=k, rows=tuple(rows[start:start + shard_size]))
            for k, start in enumerate(range(0, len(rows), shard_size))]


def output_name(row: int) -> str:
    return f"{row:06d}.dcm"


def _shard_key(deid_secret: bytes) -> bytes:
    return hashlib.sha256(_KEY_LABEL + deid_secret).digest()


def _result_path(out_dir: Path, index: int) -> Path:
    return out_dir / SHARD_DIR / f"shard-{index:05d}.bin"


def _file_sha256(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def completed_shard(out_dir: Path, shard: ShardSpec, deid_secret: bytes, policy_digest: str) -> ShardResult | None:
    """The shard's recorded result if it authenticates (same key, policy and inputs) and every
    output still verifies, else None."""
    blob_path = _result_path(out_dir, shard.index)
    try:
        blob = blob_path.read_bytes()
    except OSError:
        return None
    if len(blob) < 12 + 16:
        return None
    try:
        raw = AESGCM(_shard_key(deid_secret)).decrypt(blob[:12], blob[12:], shard.binding(policy_digest))
        result = ShardResult.from_json(raw)
    except (InvalidTag, ValueError, KeyError, TypeError):
        return None  # another key, another shard layout, or edited: do the work again
    for row in result.rows:
        if row.outcome == "written" and _file_sha256(out_dir / output_name(row.row)) != row.sha256:
            return None
    result.resumed = True
    return result


def run_shard(shard: ShardSpec, out_dir: str | os.PathLike[str], policy_path: str | os.PathLike[str],
              deid_secret: bytes) -> ShardResult:
    """De-identify one shard into ``out_dir`` (skipped when its recorded result still verifies)."""
    from securetrain.audit.recorder import MemoryAuditRecorder
    from securetrain.masking.dicom.engine import Deidentifier
    from securetrain.masking.dicom.errors import (
        BurnedInAnnotationError,
        DeidError,
        EncapsulatedDocumentError,
        MissingPatientIdentityError,
    )
    from securetrain.masking.dicom.keys import DeidKeys
    from securetrain.masking.dicom.policy import load_policy

    out = Path(out_dir)
    policy = load_policy(policy_path)
    done = completed_shard(out, shard, deid_secret, policy.digest)
    if done is not None:
        return done
    recorder = MemoryAuditRecorder()
    deid = Deidentifier(policy, DeidKeys.from_secret(deid_secret), recorder, record_changes=False)
    result = ShardResult(index=shard.index)
    read: dict[int, str] = {}  # row -> SHA-256 of the input bytes de-identified (the binding's, not read twice)
    for row, source in shard.rows:
        target = out / output_name(row)
        label = f"row {row + 1}"  # input names can carry PHI
        try:
            report = deid.deidentify_file(source, target, label=label)
        except BurnedInAnnotationError:
            result.rows.append(RowOutcome(row, "rejected", "burned_in_annotation"))
            recorder.record("deid.reject", f"input:{row}", outcome="refused", details={"reason": "burned_in_annotation"})
        except MissingPatientIdentityError:  # the policy needs a patient identity (the split's key)
            result.rows.append(RowOutcome(row, "rejected", "missing_patient_identity"))
            recorder.record("deid.reject", f"input:{row}", outcome="refused", details={"reason": "missing_patient_identity"})
        except EncapsulatedDocumentError:  # encapsulated_documents: reject (a PDF/CDA's text is not cleaned)
            result.rows.append(RowOutcome(row, "rejected", "encapsulated_document"))
            recorder.record("deid.reject", f"input:{row}", outcome="refused", details={"reason": "encapsulated_document"})
        except DeidError as exc:
            result.rows.append(RowOutcome(row, "quarantined", type(exc).__name__,
                                          detail=str(exc).removeprefix(f"{label}: ")))
            recorder.record("deid.quarantine", f"input:{row}", outcome="refused", details={"reason": type(exc).__name__})
        else:
            result.rows.append(RowOutcome(row, "written", None, report.tags_changed, report.patient_pseudonym or "",
                                          _file_sha256(target)))
            if report.input_sha256:
                read[row] = report.input_sha256
    result.pseudonyms = dict(sorted(deid.pseudonyms.items()))
    result.events = recorder.events
    nonce = os.urandom(12)
    blob = nonce + AESGCM(_shard_key(deid_secret)).encrypt(nonce, result.to_json(), shard.binding(policy.digest, read))
    (out / SHARD_DIR).mkdir(mode=0o700, exist_ok=True)
    atomic_write_bytes(_result_path(out, shard.index), blob, mode=0o600)
    return result


ShardMap = Callable[[list[ShardSpec]], list[ShardResult]]


def prefetched_map(out_dir: Path, policy_path: Path, deid_secret: bytes, *, fresh: set[int]) -> ShardMap:
    """Merge shards a task runner has completed (``fresh``: run in this flow run, so not "resumed");
    a shard whose result is missing or no longer verifies is run here."""

    def run_all(shards: list[ShardSpec]) -> list[ShardResult]:
        from securetrain.masking.dicom.policy import load_policy

        digest = load_policy(policy_path).digest
        results = []
        for shard in shards:
            result = completed_shard(out_dir, shard, deid_secret, digest)
            if result is None:
                result = run_shard(shard, out_dir, policy_path, deid_secret)
            else:
                result.resumed = shard.index not in fresh
            results.append(result)
        return results

    return run_all


def serial_map(out_dir: Path, policy_path: Path, deid_secret: bytes,
               on_shard: Callable[[ShardResult], None] | None = None) -> ShardMap:
    """Run shards one after another in this process (``execution.task_runner: serial``, ``--no-prefect``)."""

    def run_all(shards: list[ShardSpec]) -> list[ShardResult]:
        results = []
        for shard in shards:
            results.append(run_shard(shard, out_dir, policy_path, deid_secret))
            if on_shard:
                on_shard(results[-1])
        return results

    return run_all
