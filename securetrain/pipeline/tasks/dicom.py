"""``dicom-classification``: labelled DICOM -> de-identification -> patient-level split -> images.

The manifest is a CSV with ``path`` and a label column (``data.label_column``, default ``label``):
integers or strings, any number of classes, mapped to ids by :func:`label_names` (recorded in the
run's result). Every file is de-identified into ``<run_dir>/deid`` under a sequence-number name;
whole patients (by pseudonym) are held out for evaluation. Multi-frame files give one frame
(``data.frames``: index, ``first``, ``middle``) or all frames (``all``) stacked as channels
``[F, H, W]`` or depth ``[1, F, H, W]`` (``data.frames_as``), resampled to ``data.depth`` frames.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from securetrain.audit.recorder import AuditRecorder, NullAuditRecorder
from securetrain.errors import ConfigError, SecureTrainError
from securetrain.io.atomic import atomic_write_bytes
from securetrain.masking.dicom.dataset import DicomDataset, decode_error
from securetrain.pipeline.config import PipelineConfig
from securetrain.pipeline.errors import TaskError
from securetrain.pipeline.results import DeidSummary
from securetrain.pipeline.secrets import RunSecrets
from securetrain.pipeline.tasks.dicom_shards import ShardMap
from securetrain.pipeline.tasks.base import TaskContext, TaskData, canonical_label, file_sha256, holdout, label_names

LABELS_FILE = "labels.json"
REFUSED_FILE = "refused.json"  # rejected + quarantined inputs of the last de-identification (no paths)


def read_labelled_manifest(manifest: Path, label_column: str = "label") -> list[tuple[Path, str]]:
    """``(path, label)`` rows; labels as canonical strings. Errors name line numbers, never paths."""
    try:
        # utf-8-sig: spreadsheet exports ("CSV UTF-8") start with a byte-order mark, which would
        # otherwise become part of the first column's name.
        with manifest.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            fields = [f.strip() for f in reader.fieldnames or []]  # "path, diagnosis" is path,diagnosis
            reader.fieldnames = fields
            if "path" not in fields or label_column not in fields:
                found = ", ".join(repr(f) for f in fields[:20]) + (", ..." if len(fields) > 20 else "")
                raise TaskError(f"manifest {manifest.name} needs columns 'path' and {label_column!r} "
                                f"(its header has {found or 'no columns'})",
                                hint="data.label_column names the label column")
            rows: list[tuple[Path, str]] = []
            for n, row in enumerate(reader, start=2):
                rel = (row.get("path") or "").strip()
                label = (row.get(label_column) or "").strip()
                if not rel:
                    raise TaskError(f"manifest {manifest.name} line {n}: empty path")
                if not label:
                    raise TaskError(f"manifest {manifest.name} line {n}: no label", hint="every training file needs a label")
                p = Path(rel)
                rows.append((p if p.is_absolute() else manifest.parent / p, canonical_label(label)))
            return rows
    except OSError as exc:
        raise ConfigError(f"cannot read manifest {manifest.name}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise TaskError(f"manifest {manifest.name} is not UTF-8 text (byte offset {exc.start})",
                        hint=f"save it as UTF-8, e.g. iconv -f latin1 -t utf-8 {manifest.name} > utf8.csv") from None


def _write_manifest(path: Path, rows: Sequence[tuple[str, int]]) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["path", "label"])
    writer.writerows(rows)
    atomic_write_bytes(path, buffer.getvalue().encode(), mode=0o600)


def _progress(enabled: bool):  # noqa: ANN202 - rich Progress or a no-op stand-in
    from securetrain.cli.console import progress_bar

    return progress_bar(transient=True, disable=not enabled)


def deidentify(
    config: PipelineConfig,
    raw_manifest: Path,
    secrets: RunSecrets,
    audit: AuditRecorder | None = None,
    *,
    show_progress: bool = False,
    shard_map: ShardMap | None = None,
) -> DeidSummary:
    """De-identify every study into ``<run_dir>/deid`` and split train/eval by patient pseudonym.

    Files the policy refuses (burned-in annotation, no patient identity) are rejected and unreadable
    ones quarantined — counted, audited, listed in ``deid/refused.json``, logged as a warning, never
    passed on. Quarantined files then fail the stage with :class:`RefusedFilesError` (exit 65)
    unless ``data.allow_quarantine`` accepts partial output; rejected ones alone do not.
    Output names are sequence numbers (input names may carry PHI).
    The pseudonym map is exported AES-256-GCM encrypted for the data owner.
    """
    from securetrain.masking.dicom.mapping import export_mapping
    from securetrain.masking.dicom.policy import load_policy
    from securetrain.pipeline.tasks.dicom_shards import output_name, plan_shards, serial_map

    assert config.data.policy is not None
    recorder = audit or NullAuditRecorder()
    policy = load_policy(config.data.policy)
    out_dir = config.run_dir / "deid"
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    rows = read_labelled_manifest(raw_manifest, config.data.label_column)
    names = label_names([label for _, label in rows], config.data.classes, where=f"manifest {raw_manifest.name}")
    ids = {name: i for i, name in enumerate(names)}
    kept: list[tuple[str, int, str]] = []
    tags_changed = rejected = quarantined = 0
    pseudonyms: dict[str, str] = {}
    shards = plan_shards([path for path, _ in rows], config.execution.shard_size)
    with _progress(show_progress) as progress:
        bar = progress.add_task("de-identify", total=len(rows), status="")
        runner = shard_map or serial_map(out_dir, Path(config.data.policy), secrets.deid_secret,
                                         on_shard=lambda r: progress.update(bar, advance=len(r.rows)))
        results = sorted(runner(shards), key=lambda r: r.index)
    if [r.index for r in results] != [s.index for s in shards]:
        raise SecureTrainError("de-identification lost shards", hint="rerun: finished shards are skipped")
    # Workers return their audit events; recording them here, in shard order, gives every runner the
    # same log (each shard's de-identifier states the policy it applied: recorded once).
    policy_events: set[str] = set()
    input_digests: set[str] = set()  # every file read (for a scheduled run's "new inputs")
    refused: dict[str, int] = {}  # reason -> files rejected or quarantined
    for result in results:
        if result.resumed:
            recorder.record("deid.shard_resumed", f"shard:{result.index}", details={"files": len(result.rows)})
        for event in result.events:
            details = event.get("details")
            if event["action"] == "dicom.read" and isinstance(details, dict):
                input_digests.add(str(details.get("sha256")))
            if event["action"] == "deid.policy_applied":
                fingerprint = json.dumps(event, sort_keys=True, default=str)
                if fingerprint in policy_events:
                    continue
                policy_events.add(fingerprint)
            recorder.record(event["action"], event["resource"], outcome=event["outcome"], details=event["details"])
        for row in result.rows:
            if row.outcome in ("rejected", "quarantined"):
                reason = f"{row.outcome}: {row.reason or 'unspecified'}"
                refused[reason] = refused.get(reason, 0) + 1
            if row.outcome == "rejected":
                rejected += 1
            elif row.outcome == "quarantined":
                quarantined += 1
            else:
                tags_changed += row.tags_changed
                kept.append((output_name(row.row), ids[rows[row.row][1]], row.pseudonym))
        pseudonyms.update(result.pseudonyms)
    _check_refusals(config, results, out_dir, policy.name, len(rows), rejected, quarantined, recorder)
    if not kept:
        raise SecureTrainError("no study survived de-identification", hint="check the policy and the input files")

    # Hold out whole patients (never images of one patient on both sides), chosen by a keyed order.
    eval_patients = holdout((p for _, _, p in kept), config.data.eval_fraction)
    train_rows = [(n, lab) for n, lab, p in kept if p not in eval_patients]
    eval_rows = [(n, lab) for n, lab, p in kept if p in eval_patients]
    from securetrain.pipeline.schedule import write_inputs

    write_inputs(config.run_dir, input_digests)
    _write_manifest(out_dir / "train.csv", train_rows)
    _write_manifest(out_dir / "eval.csv", eval_rows)
    atomic_write_bytes(out_dir / LABELS_FILE, json.dumps({"classes": names}).encode(), mode=0o600)
    mapping_key = hashlib.sha256(b"securetrain/pipeline/pseudonym-map\x00" + secrets.deid_secret).digest()
    export_mapping(out_dir / "pseudonyms.enc", dict(sorted(pseudonyms.items())), mapping_key)
    recorder.record("deid.mapping_exported", "file:pseudonyms.enc", details={"entries": len(pseudonyms)})
    return DeidSummary(
        policy=policy.name,
        policy_version=str(policy.policy_version),
        files_in=len(rows),
        files_out=len(kept),
        tags_changed=tags_changed,
        rejected=rejected,
        quarantined=quarantined,
        output_dir=out_dir,
        manifest=out_dir / "train.csv",
        class_names=names,
        train_files=len(train_rows),
        eval_files=len(eval_rows),
        train_patients=len({p for _, _, p in kept} - eval_patients),
        eval_patients=len(eval_patients),
        train_class_counts=_counts(train_rows, len(names)),
        eval_class_counts=_counts(eval_rows, len(names)),
        digests={"train_manifest": file_sha256(out_dir / "train.csv"), "eval_manifest": file_sha256(out_dir / "eval.csv"),
                 "policy": policy.digest, "input_manifest": file_sha256(raw_manifest)},
        refused_by_reason=dict(sorted(refused.items())),
        refusal_report=out_dir / REFUSED_FILE if rejected + quarantined else None,
        partial_accepted=bool(quarantined),  # only get here with quarantined files when they were accepted
    )


def _check_refusals(config: PipelineConfig, results: Sequence[Any], out_dir: Path, policy_name: str, files: int,
                    rejected: int, quarantined: int, recorder: AuditRecorder) -> None:
    """The same rule as ``securetrain deid``: rejected inputs (the policy refusing them on purpose)
    and quarantined ones (could not be processed) are listed in ``deid/refused.json`` (manifest data
    row, outcome, reason; never paths), recorded as ``deid.incomplete`` and logged as a warning.
    Quarantined files fail the stage with :class:`RefusedFilesError` (exit 65) before training
    unless ``data.allow_quarantine`` accepts them; rejected files alone never do."""
    import logging

    from securetrain.masking.dicom.errors import RefusedFilesError
    from securetrain.masking.dicom.tree import refusal_fails, write_refusal_report

    report_path = out_dir / REFUSED_FILE
    refused = rejected + quarantined
    if not refused:
        report_path.unlink(missing_ok=True)  # a report describes the run that wrote this folder
        return
    # accepted: no quarantined files, or data.allow_quarantine accepted them
    accepted = not refusal_fails(quarantined, allow_quarantine=config.data.allow_quarantine)
    rows = [{"row": row.row + 1, "outcome": row.outcome, "reason": row.reason or "unspecified",
             **({"detail": row.detail} if row.detail else {})}
            for result in results for row in result.rows if row.outcome in ("rejected", "quarantined")]
    document = {"format": "securetrain.pipeline.deid-refusals/1", "policy": policy_name, "files": files,
                "written": files - refused, "rejected": rejected, "quarantined": quarantined, "accepted": accepted,
                "refused": rows}
    write_refusal_report(report_path, document)
    recorder.record("deid.incomplete", f"file:{REFUSED_FILE}", outcome="success" if accepted else "refused",
                    details={"files": files, "rejected": rejected, "quarantined": quarantined, "accepted": accepted})
    what = f"{refused} of {files} input files not written ({rejected} rejected, {quarantined} quarantined)"
    if not accepted:
        raise RefusedFilesError(
            f"de-identification quarantined files that could not be processed: {what}; nothing was trained. "
            f"Report: {report_path}",
            hint="fix or remove the quarantined files, or set data.allow_quarantine: true to train on the rest "
                 "(files the policy rejects never fail a run)",
            report=str(report_path))
    logging.getLogger(__name__).warning(
        "de-identification: %s%s; report: %s", what,
        ", quarantined files accepted by data.allow_quarantine" if quarantined else ", rejected by the policy",
        report_path)


def _check_unusable(ctx: TaskContext, *datasets: DicomDataset) -> list[tuple[str, str]]:
    """De-identified files the loader left out of its index (header-only objects, pixels no installed
    decoder reads, unreadable palettes or rescale values): the same rule as quarantined inputs, since
    training on a silent subset is what that rule exists to prevent. Named by manifest data row and
    sequence number (never the input path); fails with :class:`RefusedFilesError` (exit 65) unless
    ``data.allow_quarantine`` accepts them, then logged, audited and counted in the run's inputs."""
    import logging

    from securetrain.masking.dicom.errors import RefusedFilesError

    unusable = [(e["path"], e["reason"]) for ds in datasets for e in ds.excluded_files]
    if not unusable:
        return []
    files = sum(len(ds) for ds in datasets) + len(unusable)
    accepted = ctx.config.data.allow_quarantine
    ctx.audit.record("data.unusable", "dataset:deid", outcome="success" if accepted else "refused",
                     details={"files": files, "unusable": len(unusable), "accepted": accepted})
    listed = "; ".join(f"{_row_name(path)}: {reason}" for path, reason in unusable[:10])
    more = f"; and {len(unusable) - 10} more" if len(unusable) > 10 else ""
    what = f"{len(unusable)} of {files} de-identified files cannot be used for training: {listed}{more}"
    if not accepted:
        raise RefusedFilesError(
            f"{what}; nothing was trained",
            hint="remove these files from the manifest (the loader cannot read an image from them), or set "
                 "data.allow_quarantine: true to train on the rest")
    logging.getLogger(__name__).warning("%s (accepted by data.allow_quarantine)", what)
    return unusable


def dropped_at_load(*datasets: Any) -> list[str]:
    """Files quarantined after their index was built (a load failed, in this process or a DataLoader
    worker: ``quarantine_dir`` sidecars), so left out of every batch they were drawn into:
    ``manifest data row N (de-identified as NNNNNN.dcm): reason`` each. Datasets without a
    quarantine report (custom tasks) contribute nothing."""
    excluded = {e["path"] for ds in datasets for e in getattr(ds, "excluded_files", ())}
    dropped: dict[str, str] = {}
    for ds in datasets:
        report = getattr(ds, "quarantine_report", None)
        for entry in report() if callable(report) else ():
            if entry["path"] not in excluded:
                dropped.setdefault(entry["path"], entry["reason"])
    return [f"{_row_name(path)}: {reason}" for path, reason in dropped.items()]


def _row_name(path: str) -> str:
    """``manifest data row N (de-identified as NNNNNN.dcm)``: output names are row sequence numbers."""
    name = Path(path).name
    stem = name.split(".")[0]
    return f"manifest data row {int(stem) + 1} (de-identified as {name})" if stem.isdigit() else name


def _counts(rows: Sequence[tuple[str, int]], n: int) -> list[int]:
    c = Counter(label for _, label in rows)
    return [c.get(i, 0) for i in range(n)]


class FramesDicomDataset(DicomDataset):
    """:class:`DicomDataset` with a frame choice for multi-frame files (or all frames stacked)."""

    def __init__(self, *args: Any, frames: str | int = "first", depth: int | None = None,
                 frames_as: str = "channels", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.frames_mode = frames
        self.depth = depth
        self.frames_as = frames_as

    def _load(self, path: str, label: int | None, reads: list[tuple[str, str, str, dict[str, Any]]] | None = None
              ) -> dict[str, Any]:
        if self.frames_mode != "all" and not isinstance(self.frames_mode, str):
            self.frame = int(self.frames_mode)
            return super()._load(path, label, reads)
        if self.frames_mode == "first":
            self.frame = 0
            return super()._load(path, label, reads)
        return self._load_frames(path, label, reads)

    def _load_frames(self, path: str, label: int | None,
                     reads: list[tuple[str, str, str, dict[str, Any]]] | None = None) -> dict[str, Any]:
        import numpy as np

        from securetrain.masking.dicom.display import Display
        from securetrain.masking.dicom.engine import read_dicom
        from securetrain.masking.dicom.errors import DeidError

        data = Path(path).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        ds = read_dicom(io.BytesIO(data), name=Path(path).name)
        self._note_read(reads, digest, len(data))
        ds, _ = self._deidentifier().deidentify_dataset(ds)
        try:
            arr = np.asarray(ds.pixel_array)
        except Exception as exc:
            raise decode_error(ds, exc) from None
        n_frames = int(ds.get("NumberOfFrames", 1) or 1)
        display = Display.of(ds)
        arr = display.apply(arr)  # palette, Modality LUT, MONOCHROME1: what a viewer shows
        colour = display.colour
        if colour and self.color_mode != "rgb":
            arr, colour = arr.mean(axis=-1), False
        elif not colour and self.color_mode == "rgb":
            raise DeidError("the file has one channel but color_mode is 'rgb'")  # changed since indexed
        if n_frames == 1:
            arr = arr[None]
        if arr.ndim != (4 if colour else 3):  # [F, H, W] or [F, H, W, 3]
            raise DeidError(f"unexpected pixel array shape {arr.shape}")
        if self.frames_mode == "middle":
            arr = arr[arr.shape[0] // 2][None]
        elif self.depth is not None and arr.shape[0] != self.depth:
            arr = arr[np.linspace(0, arr.shape[0] - 1, self.depth).round().astype(int)]
        lo, hi = float(arr.min()), float(arr.max())
        if not (np.isfinite(lo) and np.isfinite(hi)):
            raise DeidError("pixel values are not finite")
        arr = (arr - lo) / (hi - lo) if hi > lo else np.zeros_like(arr)
        pixels = torch.from_numpy(np.ascontiguousarray(arr))
        if colour:
            pixels = pixels.permute(0, 3, 1, 2)  # [F, 3, H, W]
        else:
            pixels = pixels.unsqueeze(1)  # [F, 1, H, W]
        if self.size is not None and tuple(pixels.shape[-2:]) != self.size:
            pixels = torch.nn.functional.interpolate(pixels, size=self.size, mode="bilinear", align_corners=False)
        if self.frames_mode == "all" and self.frames_as == "depth":
            pixels = pixels.permute(1, 0, 2, 3)  # [C, F, H, W] (C: 1, or 3 colour channels)
        else:  # frames as channels: frame 0's channel(s), then frame 1's, ...
            pixels = pixels.reshape(-1, *pixels.shape[-2:])
        item: dict[str, Any] = {"pixels": pixels.float(), "meta": {k: str(ds.get(k, "") or "") for k in self.meta_keys}}
        if self.has_labels:
            item["label"] = torch.tensor(-1 if label is None else label, dtype=torch.long)
        return item


def dicom_dataset(config: PipelineConfig, manifest: Path, secrets: RunSecrets, audit: AuditRecorder | None,
                  color_mode: str | None = None):
    from securetrain.devices import resolve_backend

    d = config.data
    return FramesDicomDataset(
        manifest,
        d.policy,
        secrets.deid_secret,
        size=d.image_size,
        quarantine_dir=config.run_dir / "quarantine",
        audit=audit,
        pin_memory=resolve_backend(config.training.device).pin_memory,  # the backend's advice
        frames=d.frames,
        depth=d.depth,
        frames_as=d.frames_as,
        color_mode=color_mode or d.color_mode,
    )


def _deid_digest(run_dir: Path) -> str:
    """SHA-256 of what the splits are built from: the de-identified files and labels of each split
    (``train.csv``/``eval.csv``), the class names, and the digests of every input file read
    (``inputs.json``, written by de-identification; pixel changes in the inputs change it). The
    run's checkpoints are bound to it, so relabelled or replaced studies are not resumed on."""
    from securetrain.pipeline.schedule import INPUTS_FILE

    h = hashlib.sha256()
    for path in (run_dir / "deid" / "train.csv", run_dir / "deid" / "eval.csv", run_dir / "deid" / LABELS_FILE,
                 run_dir / INPUTS_FILE):
        h.update(f"{path.name}:".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest() if path.is_file() else b"absent")
    return h.hexdigest()


class DicomClassification:
    """The default task (see the module docstring)."""

    name = "dicom-classification"

    def prepare(self, ctx: TaskContext, raw: Path, *, show_progress: bool = False) -> DeidSummary:
        return deidentify(ctx.config, raw, ctx.secrets, ctx.audit, show_progress=show_progress)

    def build_datasets(self, ctx: TaskContext) -> TaskData:
        deid_dir = ctx.run_dir / "deid"
        labels = deid_dir / LABELS_FILE
        if not labels.is_file():
            raise TaskError("the de-identified data is missing", hint="run the de-identification stage first")
        names = json.loads(labels.read_text())["classes"]
        train, evaluation = self._datasets(ctx, deid_dir)
        unusable = _check_unusable(ctx, train, evaluation)
        first = next((item for item in (train[i] for i in range(len(train))) if item is not None), None)
        facts = {"in_channels": int(first["pixels"].shape[0])} if first is not None else {}
        colour, grey = train.colour_files + evaluation.colour_files, train.grey_files + evaluation.grey_files
        inputs = {"color_mode": train.color_mode, "requested": ctx.config.data.color_mode, "colour_files": colour,
                  "grey_files": grey, "converted_to_grey": colour if train.color_mode == "grey" else 0}
        if unusable:
            inputs["unusable_files"] = len(unusable)
            inputs["unusable_reasons"] = dict(sorted(Counter(reason for _, reason in unusable).items()))
        return TaskData(train=train, eval=evaluation, class_names=names, model_facts=facts, inputs=inputs,
                        data_digest=_deid_digest(ctx.run_dir))

    @staticmethod
    def _datasets(ctx: TaskContext, deid_dir: Path) -> tuple[FramesDicomDataset, FramesDicomDataset]:
        """Both splits in one colour mode: ``auto`` keeps colour only when every file of both is
        colour; ``rgb`` refuses a grey file, naming its manifest row (the de-identified name is
        the row's sequence number; the input path may carry PHI)."""
        from securetrain.masking.dicom.errors import ColorModeError

        config = ctx.config
        try:
            train = dicom_dataset(config, deid_dir / "train.csv", ctx.secrets, ctx.audit)
            evaluation = dicom_dataset(config, deid_dir / "eval.csv", ctx.secrets, ctx.audit)
        except ColorModeError as exc:
            name = Path(exc.path).name
            row = f"manifest data row {int(name.split('.')[0]) + 1} " if name.split(".")[0].isdigit() else ""
            raise ColorModeError(
                f"data.color_mode is 'rgb' but {row}(de-identified as {name}) is a one-channel (grey) image; "
                "a model built for three colour channels cannot take it", path=name,
                hint="remove the grey files from the manifest, or set data.color_mode: grey (every image one "
                     "channel) or auto") from None
        if train.color_mode != evaluation.color_mode:  # auto, colour on one side only: grey for both
            train = dicom_dataset(config, deid_dir / "train.csv", ctx.secrets, ctx.audit, color_mode="grey")
            evaluation = dicom_dataset(config, deid_dir / "eval.csv", ctx.secrets, ctx.audit, color_mode="grey")
        return train, evaluation
