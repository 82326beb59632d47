"""``tabular-classification``: CSV/Parquet -> masking policy -> entity split -> encoded rows.

1. The table is read and masked in memory by :class:`TabularMasker` (a column no rule names fails
   the run: fail closed). Nothing unmasked is ever written by the pipeline.
2. Rows are split by the entity column ``data.split_by`` (e.g. ``customer_id``), which the policy
   must tokenise: whole entities (by token) are held out, so no customer is on both sides.
3. The masked splits go to ``<run_dir>/data/{train,eval}.parquet``.
4. :class:`TableEncoder` is fitted on the *training split only*: numeric/date columns are
   standardised with the training mean and standard deviation; string columns (kept categories,
   generalised bins, months) are one-hot over the training split's most frequent
   ``data.max_categories`` values plus an "other" slot (values unseen in training go there).
   By default the features are the columns the policy keeps or generalises (identifier tokens are
   never features); the label and the split column are never features.

``tabular-regression`` (:class:`TabularRegression`) follows the same rules with a numeric target:
``data.label_column`` must hold a finite number on every row (a non-numeric column or a NaN/infinite
value fails with :class:`TaskError`); targets are float32, one per row, kept in their own units.

The masking key comes from ``SECURETRAIN_MASK_KEY`` (hex) or is derived from the run's
de-identification secret (HMAC-SHA256 with a fixed label), so one key source serves both.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from securetrain.io.atomic import atomic_write_bytes
from securetrain.pipeline.config import PipelineConfig
from securetrain.pipeline.errors import TaskError
from securetrain.pipeline.results import MaskingSummary
from securetrain.pipeline.secrets import RunSecrets
from securetrain.pipeline.tasks.base import TaskContext, TaskData, canonical_label, file_sha256, holdout, label_names

MASK_KEY_ENV = "SECURETRAIN_MASK_KEY"
FEATURE_ACTIONS = {"keep", "generalize"}
TOKEN_ACTIONS = {"tokenize"}
#: Identity columns of the synthetic transactions table: one customer's rows share them.
_CUSTOMER_COLUMNS = ("customer_name", "customer_id", "iban", "card_number", "ssn", "email", "phone")


def masking_key(secrets: RunSecrets) -> bytes:
    env = os.environ.get(MASK_KEY_ENV)
    if env:
        from securetrain.keytext import decode_key
        from securetrain.masking.tabular.errors import MaskKeyError

        return decode_key(env, what=MASK_KEY_ENV, error=MaskKeyError)
    return hmac.new(secrets.deid_secret, b"securetrain/pipeline/tabular-mask-key", hashlib.sha256).digest()


def synthetic_transactions(config: PipelineConfig) -> Path:
    """The synthetic finance table (PII + fraud label) under ``<run_dir>/raw``; customers repeat."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from securetrain.masking.tabular.synthetic import generate_finance_table

    spec = config.data.synthetic_table
    table = generate_finance_table(spec.rows, seed=spec.seed)
    if spec.customers is not None:
        # generate_finance_table draws a new identity per row; give rows shared customers instead.
        rng = np.random.default_rng(spec.seed + 1)
        owner = pa.array(rng.integers(0, min(spec.customers, spec.rows), spec.rows))
        for name in _CUSTOMER_COLUMNS:
            if name in table.column_names:
                table = table.set_column(table.column_names.index(name), name, pc.take(table.column(name), owner))
    raw = config.run_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = raw / "transactions.parquet"
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(path, sink.getvalue().to_pybytes(), mode=0o600)
    return path


class _ColumnActionsAsList:
    """Audit adapter: the masker records ``actions`` as ``{column: action}``; column names such as
    ``ssn`` or ``api_key`` are refused as detail *keys* by the audit log (they look like secrets), so
    the map is recorded as a list of ``[column, action]`` pairs instead (same information)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def record(self, action: str, resource: str, *, outcome: str = "success", details: Any = None) -> Any:
        if details and isinstance(details.get("actions"), dict):
            details = {**details, "actions": sorted([c, a] for c, a in details["actions"].items())}
        return self.inner.record(action, resource, outcome=outcome, details=details)


class TableEncoder:
    """Numeric standardisation + capped one-hot, fitted on one table (the training split)."""

    def __init__(self, columns: list[str], max_categories: int = 32) -> None:
        self.columns = columns
        self.max_categories = max_categories
        self.numeric: dict[str, tuple[float, float]] = {}  # column -> (mean, std)
        self.categories: dict[str, list[str]] = {}  # column -> values (slot order); + one "other" slot

    @staticmethod
    def _numeric_values(col: Any) -> np.ndarray | None:
        import pyarrow as pa
        import pyarrow.compute as pc

        t = col.type
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t):
            return pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)
        if pa.types.is_date(t) or pa.types.is_timestamp(t):
            days = pc.cast(pc.cast(col, pa.date32()), pa.int32())
            return pc.cast(days, pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)
        return None

    @staticmethod
    def _strings(col: Any) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc

        return pc.cast(col, pa.string())

    def fit(self, table: Any) -> TableEncoder:
        for name in self.columns:
            col = table.column(name)
            values = self._numeric_values(col)
            if values is not None:
                finite = values[np.isfinite(values)]
                mean = float(finite.mean()) if finite.size else 0.0
                std = float(finite.std()) if finite.size else 1.0
                self.numeric[name] = (mean, std if std > 1e-12 else 1.0)
            else:
                counts = self._strings(col).value_counts().to_pylist()  # one entry per distinct value
                counts = [(c["values"], c["counts"]) for c in counts if c["values"] is not None]
                top = sorted(counts, key=lambda kv: (-kv[1], kv[0]))[: self.max_categories]
                self.categories[name] = sorted(v for v, _ in top)
        return self

    @property
    def feature_names(self) -> list[str]:
        out: list[str] = []
        for name in self.columns:
            if name in self.numeric:
                out.append(name)
            else:
                out += [f"{name}={v}" for v in self.categories[name]] + [f"{name}=<other>"]
        return out

    def transform(self, table: Any) -> torch.Tensor:
        blocks: list[np.ndarray] = []
        n = table.num_rows
        for name in self.columns:
            col = table.column(name)
            if name in self.numeric:
                values = self._numeric_values(col)
                if values is None:
                    raise TaskError(f"column {name!r} was numeric in the training split but is not here")
                mean, std = self.numeric[name]
                z = (values - mean) / std
                blocks.append(np.where(np.isfinite(z), z, 0.0)[:, None])  # missing -> the training mean
            else:
                import pyarrow as pa
                import pyarrow.compute as pc

                other = len(self.categories[name])
                found = pc.index_in(self._strings(col), value_set=pa.array(self.categories[name], pa.string()))
                idx = pc.fill_null(found, other).to_numpy(zero_copy_only=False).astype(np.int64)  # unseen/missing -> other
                onehot = np.zeros((n, other + 1), dtype=np.float32)
                onehot[np.arange(n), idx] = 1.0
                blocks.append(onehot)
        matrix = np.concatenate(blocks, axis=1) if blocks else np.zeros((n, 0))
        return torch.from_numpy(np.ascontiguousarray(matrix, dtype=np.float32))

    def state_dict(self) -> dict[str, Any]:
        return {"columns": self.columns, "max_categories": self.max_categories,
                "numeric": self.numeric, "categories": self.categories}


def _not_a_column(setting: str, name: str, columns: list[str], table: str) -> TaskError:
    """``setting`` names a column the table does not have: say so, with the near miss or the columns."""
    near = [c for c in columns if c.strip().casefold() == name.strip().casefold()]
    listed = ", ".join(repr(c) for c in columns[:30]) + (", ..." if len(columns) > 30 else "")
    hint = f"did you mean {near[0]!r}? (column names are case-sensitive)" if near else f"its columns: {listed}"
    return TaskError(f"{setting} {name!r} is not a column of table {table}", hint=hint)


def _entity_column(actions: dict[str, str], policy: str) -> str:
    """Without ``data.split_by``: the one tokenised column named ``id`` or ``*_id``."""
    candidates = [c for c, a in actions.items() if a in TOKEN_ACTIONS and (c.lower() == "id" or c.lower().endswith("_id"))]
    if len(candidates) != 1:
        found = ", ".join(candidates) or "none"
        raise TaskError(f"data.split_by: cannot tell the entity column from policy {policy!r} (tokenised id columns: {found})",
                        hint="set data.split_by to the column identifying a customer/patient/account")
    return candidates[0]


def _missing_labels(column: Any) -> int:
    """Rows without a class label: nulls, and the values that only look like one once cast to text:
    NaN in a float column (Parquet keeps it as a value, not a null) and blank strings. Cast to text
    they would become the classes ``"nan"`` and ``""`` and train a model with an extra class."""
    import pyarrow as pa
    import pyarrow.compute as pc

    missing = column.null_count
    if pa.types.is_floating(column.type):
        missing += int(pc.sum(pc.fill_null(pc.is_nan(column), False)).as_py() or 0)
    elif pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        blank = pc.equal(pc.utf8_trim_whitespace(column), "")
        missing += int(pc.sum(pc.fill_null(blank, False)).as_py() or 0)
    return missing


def _no_missing_labels(column: Any, *, where: str) -> None:
    missing = _missing_labels(column)
    if missing:
        raise TaskError(f"{where}: the label column has {missing} missing value(s) (empty, blank or NaN)",
                        hint="drop or fill those rows in your data: every row needs a class label")


def _label_ids(column: Any, classes: list[str] | None, *, where: str) -> tuple[np.ndarray, list[str]]:
    """Class ids per row and the class names, canonicalising each *distinct* label once."""
    import pyarrow as pa
    import pyarrow.compute as pc

    _no_missing_labels(column, where=where)
    raw = pc.cast(column, pa.string())
    distinct = pc.unique(raw).to_pylist()
    canonical = [canonical_label(v) for v in distinct]
    names = label_names(canonical, classes, where=where)
    ids = {n: i for i, n in enumerate(names)}
    lut = np.array([ids[c] for c in canonical], dtype=np.int64)
    position = pc.index_in(raw, value_set=pa.array(distinct, pa.string())).to_numpy(zero_copy_only=False)
    return lut[position.astype(np.int64)], names


def _typed_splits(train: Any, evaluation: Any, columns: list[str]) -> tuple[Any, Any]:
    """The splits with a CSV's kept text ``columns`` typed as pyarrow's CSV reader infers them,
    from both splits together (as the whole file was read before masking kept the text): numeric
    feature columns are numbers for the encoder, and of one type on both sides."""
    import pyarrow as pa

    from securetrain.masking.tabular.csvtext import infer_table, is_csv_text

    if not any(is_csv_text(f) and f.name in columns for f in train.schema):
        return train, evaluation
    both = infer_table(pa.concat_tables([train, evaluation]), columns)
    return both.slice(0, train.num_rows), both.slice(train.num_rows)


def _regression_targets(column: Any, *, where: str, label: str) -> np.ndarray:
    """The numeric target per row (float64); refuses a non-numeric column and non-finite values."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = column.type
    if column.null_count:
        raise TaskError(f"{where}: the target column {label!r} has {column.null_count} empty value(s)",
                        hint="drop or fill those rows in your data: every row needs a target value")
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)):
        raise TaskError(f"{where}: data.label_column {label!r} is not numeric ({t}); tabular-regression "
                        "trains on a number per row", hint="name a numeric column, or use tabular-classification "
                        "for class labels")
    values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)
    bad = int((~np.isfinite(values)).sum())
    if bad:
        raise TaskError(f"{where}: the target column {label!r} holds {bad} non-finite value(s) (NaN or infinity)",
                        hint="drop or fix those rows: a regression target must be a finite number")
    return values


def _rows_digest(meta: dict[str, Any], *tensors: torch.Tensor) -> str:
    """SHA-256 of what the model is trained and validated on (the encoded rows and labels of both
    splits, the classes and features): the run's checkpoints are bound to it, so a rerun on a changed
    table of the same length is refused instead of resumed."""
    h = hashlib.sha256(json.dumps({k: meta.get(k) for k in ("classes", "features", "label_column", "kind")},
                                  sort_keys=True).encode())
    for t in tensors:
        array = t.contiguous().numpy()
        h.update(f"{array.dtype}:{array.shape}".encode())
        h.update(array.tobytes())
    return h.hexdigest()


class EncodedRows(Dataset):
    """Items ``{"features": float32[n_features], "label": int64}`` (regression: ``float32`` label)."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"features": self.features[index], "label": self.labels[index]}


class TabularClassification:
    """The tabular task (see the module docstring)."""

    name = "tabular-classification"
    regression = False

    def _targets(self, column: Any, classes: list[str] | None, *, where: str, label: str
                 ) -> tuple[np.ndarray, list[str]]:
        """Class ids and class names (regression: the float targets and no names)."""
        if self.regression:
            return _regression_targets(column, where=where, label=label), []
        return _label_ids(column, classes, where=where)

    def ingest(self, config: PipelineConfig) -> Path:
        return config.data.source if config.data.source is not None else synthetic_transactions(config)

    def prepare(self, ctx: TaskContext, raw: Path, *, show_progress: bool = False) -> MaskingSummary:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from securetrain.masking.tabular import TabularMasker
        from securetrain.masking.tabular.csvtext import infer_table

        cfg = ctx.config
        d = cfg.data
        assert d.policy is not None
        masker = TabularMasker(d.policy, masking_key(ctx.secrets), audit=_ColumnActionsAsList(ctx.audit))
        masked, report = masker.read_masked(raw)  # unknown columns fail closed here
        actions = {c.column: c.action for c in report.columns}
        base_action = {c: a.split("+")[0] for c, a in actions.items()}
        for setting, name in (("data.split_by", d.split_by), ("data.label_column", d.label_column)):
            if name is not None and name not in base_action:
                raise _not_a_column(setting, name, list(base_action), Path(raw).name)
        split_by = d.split_by or _entity_column(base_action, report.policy_name)
        if base_action.get(split_by) not in TOKEN_ACTIONS:
            raise TaskError(
                f"data.split_by: column {split_by!r} is {base_action.get(split_by, 'absent')!r} under policy "
                f"{report.policy_name!r}; the entity column must be tokenised",
                hint="give it a 'tokenize' rule: the split needs a stable pseudonym per entity",
            )
        if d.label_column not in masked.column_names or base_action.get(d.label_column) != "keep":
            raise TaskError(f"data.label_column {d.label_column!r} is not kept by policy {report.policy_name!r}",
                            hint="give the label a 'keep' rule")
        # A CSV's kept columns are its text as written; the label's type (as pyarrow's CSV reader
        # infers it: 1.0 is class "1", TRUE is "true") is that of its values, as in build_datasets.
        labels_col = infer_table(masked.select([d.label_column])).column(0)
        if not self.regression:  # regression: empty, NaN and inf refused together
            _no_missing_labels(labels_col, where=f"table {Path(raw).name}")
        label_ids, names = self._targets(labels_col, d.classes, where=f"table {Path(raw).name}", label=d.label_column)
        entity_col = pc.cast(masked.column(split_by), pa.string())
        if entity_col.null_count:
            raise TaskError(f"data.split_by: {entity_col.null_count} row(s) have no {split_by!r} value",
                            hint="every row needs its entity to be split safely")
        entities = pc.unique(entity_col).to_pylist()  # one hash per distinct entity, not per row
        eval_entities = holdout(entities, d.eval_fraction)
        in_eval = pc.is_in(entity_col, value_set=pa.array(sorted(eval_entities), pa.string())).to_numpy(zero_copy_only=False)
        if in_eval.all() or not in_eval.any():
            raise TaskError("the entity split left one side empty", hint="use more entities or change data.eval_fraction")
        features = d.features or [c for c in masked.column_names
                                  if base_action.get(c) in FEATURE_ACTIONS and c not in (d.label_column, split_by)]
        missing = [c for c in features if c not in masked.column_names or c in (d.label_column, split_by)]
        if missing:
            raise TaskError(f"data.features: not usable after masking: {', '.join(missing)}",
                            hint="features must survive the policy and exclude the label and split column")
        out = ctx.data_dir
        digests = {"input": report.input_sha256 or file_sha256(Path(raw)), "policy": report.policy_digest}
        for split, mask in (("train", ~in_eval), ("eval", in_eval)):
            part = masked.filter(pa.array(mask))
            sink = pa.BufferOutputStream()
            pq.write_table(part, sink)
            data = sink.getvalue().to_pybytes()
            atomic_write_bytes(out / f"{split}.parquet", data, mode=0o600)
            digests[f"{split}_table"] = hashlib.sha256(data).hexdigest()
        meta = {"classes": names, "features": features, "split_by": split_by, "label_column": d.label_column,
                "kind": "regression" if self.regression else "classification"}
        atomic_write_bytes(out / "task.json", json.dumps(meta).encode(), mode=0o600)
        return MaskingSummary(
            policy=report.policy_name, policy_version=str(report.policy_version), policy_digest=report.policy_digest,
            key_id=report.key_id, rows_in=report.rows, columns=actions, split_by=split_by,
            train_rows=int((~in_eval).sum()), eval_rows=int(in_eval.sum()),
            train_entities=len(entities) - len(eval_entities), eval_entities=len(eval_entities),
            class_names=names,
            train_class_counts=[] if self.regression else np.bincount(label_ids[~in_eval], minlength=len(names)).tolist(),
            eval_class_counts=[] if self.regression else np.bincount(label_ids[in_eval], minlength=len(names)).tolist(),
            feature_columns=features, output_dir=out, digests=digests,
        )

    def build_datasets(self, ctx: TaskContext) -> TaskData:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        out = ctx.run_dir / "data"
        if not (out / "task.json").is_file():
            raise TaskError("the masked tables are missing", hint="run the masking stage first")
        meta = json.loads((out / "task.json").read_text())
        train, evaluation = _typed_splits(pq.read_table(out / "train.parquet"), pq.read_table(out / "eval.parquet"),
                                          [*meta["features"], meta["label_column"]])
        encoder = TableEncoder(meta["features"], ctx.config.data.max_categories).fit(train)  # training split only
        atomic_write_bytes(out / "encoder.json", json.dumps(encoder.state_dict()).encode(), mode=0o600)
        if meta.get("kind", "classification") != ("regression" if self.regression else "classification"):
            raise TaskError(f"the prepared data is for a {meta.get('kind', 'classification')} task, not {self.name}",
                            hint="prepare the data again (a new run) after changing the task")

        def labels(table: Any) -> torch.Tensor:
            values, _ = self._targets(table.column(meta["label_column"]), meta["classes"], where="masked split",
                                      label=meta["label_column"])
            return torch.from_numpy(values.astype(np.float32) if self.regression else values)

        x_train, y_train = encoder.transform(train), labels(train)
        x_eval, y_eval = encoder.transform(evaluation), labels(evaluation)
        return TaskData(
            train=EncodedRows(x_train, y_train),
            eval=EncodedRows(x_eval, y_eval),
            class_names=None if self.regression else meta["classes"],
            model_facts={"in_features": int(x_train.shape[1])},
            kind="regression" if self.regression else "classification",
            data_digest=_rows_digest(meta, x_train, y_train, x_eval, y_eval),
        )


class TabularRegression(TabularClassification):
    """``tabular-regression``: the tabular task with a numeric target (see the module docstring)."""

    name = "tabular-regression"
    regression = True
